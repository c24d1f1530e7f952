"""Loads the kernel sources once per device through a cached ``cupy.RawModule``.

CuPy is imported lazily so that ``import cupy_kernels`` works where CuPy is absent (CI).
"""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
DIMS = (64, 128)
KERNELS = ("ada_decode_kernel", "ada_decode_uniform_kernel", "ada_decode_v4_kernel",
           "ada_decode_uniform_v4_kernel", "ada_decode_v6_kernel", "ada_decode_uniform_v6_kernel",
           "ada_decode_uniform_v7_kernel", "ada_decode_uniform_v8_kernel",
           "ada_merge_kernel", "ada_merge_v7_kernel",
           "encode_kernel", "encode_v2_kernel", "encode_v3_kernel", "encode_v3_uniform_kernel",
           "retier_kernel")
OPTIONS = ("--std=c++17", "-default-device")


def template_name(kernel: str, dim: int) -> str:
    """The C++ name of one template instance, e.g. ``skv::ada_decode_kernel<128>``."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; one of {KERNELS}")
    if dim not in DIMS:
        raise ValueError(f"head dim {dim} has no kernel instance; supported: {DIMS}")
    return f"skv::{kernel}<{int(dim)}>"


def cupy():
    """The cupy module, or a clear error where it is missing."""
    try:
        import cupy as cp
    except ImportError as e:  # pragma: no cover - exercised only without CuPy
        raise RuntimeError("cupy_kernels needs CuPy (pip install spherical-kv[cuda13])") from e
    return cp


def source() -> str:
    """Translation unit handed to NVRTC: every op's .cuh, in dependency order, after a digest
    of every .cuh's text. CuPy caches compiled modules on disk keyed by this string and the
    options; the #include lines alone would let a changed header load a stale binary (seen
    once: a kernel fixed in its header kept faulting from the cache)."""
    digest = hashlib.sha256()
    for path in sorted(CSRC.glob("*.cuh")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    lines = [f"// sources sha256 {digest.hexdigest()}"]
    lines += [f'#include "{name}"' for name in ("ada_decode.cuh", "encode.cuh", "retier.cuh")]
    return "\n".join(lines)


def instance_names() -> list:
    """Every kernel instance the run-time module holds (its NVRTC name expressions)."""
    return [template_name(k, d) for k in KERNELS for d in DIMS]


def build_options() -> tuple:
    """The NVRTC options of the run-time module (the headers found through CSRC)."""
    return OPTIONS + (f"-I{CSRC}",)


@functools.lru_cache(maxsize=None)
def _module(device_id: int):
    cp = cupy()
    with cp.cuda.Device(device_id):
        mod = cp.RawModule(code=source(), options=build_options(),
                           name_expressions=instance_names())
        mod.compile()
    return mod


def kernel(name: str, dim: int):
    """The compiled kernel ``name`` for head dim ``dim`` on the current device."""
    cp = cupy()
    return _module(cp.cuda.Device().id).get_function(template_name(name, dim))
