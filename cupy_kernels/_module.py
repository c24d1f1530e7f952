"""Loads the kernel sources once per device through a cached ``cupy.RawModule``, and reads
the constants the launchers share with the kernels from the sources themselves.

CuPy is imported lazily so that ``import cupy_kernels`` works where CuPy is absent (CI).
"""
from __future__ import annotations

import ast
import functools
import hashlib
import os
import re
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
DIMS = (64, 128, 256)
# The kernels of the module, by op: decode on the table path (any codebook, look-up tables)
# and on the affine path (the uniform codebook); the split-K merges (one CTA per row, or one
# per head and row); encode on either path; re-tier.
KERNELS = ("ada_decode_table_kernel", "ada_decode_affine_kernel",
           "ada_merge_kernel", "ada_merge_per_head_kernel",
           "encode_table_kernel", "encode_affine_kernel",
           "retier_kernel")
OPTIONS = ("--std=c++17", "-default-device")
OP_HEADERS = ("ada_decode.cuh", "encode.cuh", "retier.cuh")


def template_name(kernel: str, dim: int) -> str:
    """The C++ name of one template instance, e.g. ``skv::ada_decode_table_kernel<128>``."""
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


def source(csrc: Path | None = None, headers: tuple = OP_HEADERS) -> str:
    """Translation unit handed to NVRTC: the ``headers`` (default: every op's .cuh, in
    dependency order), after a digest of every .cuh's text (of ``csrc``, default CSRC). CuPy
    caches compiled modules on disk keyed by this string and the options; the #include lines
    alone would let a changed header load a stale binary (seen once: a kernel fixed in its
    header kept faulting from the cache)."""
    digest = hashlib.sha256()
    for path in sorted((CSRC if csrc is None else csrc).glob("*.cuh")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    lines = [f"// sources sha256 {digest.hexdigest()}"]
    lines += [f'#include "{name}"' for name in headers]
    return "\n".join(lines)


def instance_names() -> list:
    """Every kernel instance the run-time module holds (its NVRTC name expressions)."""
    return [template_name(k, d) for k in KERNELS for d in DIMS]


#: ``SPHERICAL_KV_WIDE_FAST_PAGES=1`` in the environment builds the decode with the head-dim-256
#: fast pages on (csrc ada_decode.cuh, WIDE_FAST_PAGES; off by default until a GPU run has passed
#: their tests; docs/PERF_NOTES.md "Head dim 256").
WIDE_FAST_ENV = "SPHERICAL_KV_WIDE_FAST_PAGES"


def build_options() -> tuple:
    """The NVRTC options of the run-time module (the headers found through CSRC, and the
    head-dim-256 fast pages where WIDE_FAST_ENV asks for them)."""
    wide = ("-DSKV_WIDE_FAST_PAGES=1",) if os.environ.get(WIDE_FAST_ENV, "0") == "1" else ()
    return OPTIONS + wide + (f"-I{CSRC}",)


_DECL = re.compile(r"^constexpr\s+(?:int|u32|unsigned|float)\s+([^;]+);", re.M)
_DEFINE = re.compile(r"^#define\s+(SKV_\w+)\s+(\d+)\s*$", re.M)
_ROW = re.compile(r"template <> struct (\w+)<(\d+)> \{ static constexpr int ([^;]+); \};")


def _value(expr: str, known: dict):
    """An integer or float C constant expression over numbers and already known names."""
    expr = re.sub(r"(\d+\.\d*)f\b", r"\1", expr.strip())
    expr = re.sub(r"\b(0x[0-9a-fA-F]+|\d+)u\b", r"\1", expr)

    def ev(n):
        if isinstance(n, ast.Constant) and isinstance(n.value, (int, float)):
            return n.value
        if isinstance(n, ast.Name):
            return known[n.id]
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub):
            return -ev(n.operand)
        if isinstance(n, ast.BinOp):
            a, b = ev(n.left), ev(n.right)
            if isinstance(n.op, ast.Add):
                return a + b
            if isinstance(n.op, ast.Sub):
                return a - b
            if isinstance(n.op, ast.Mult):
                return a * b
            if isinstance(n.op, ast.Div):
                return a // b if isinstance(a, int) and isinstance(b, int) else a / b
        raise ValueError(expr)
    return ev(ast.parse(expr, mode="eval").body)


@functools.lru_cache(maxsize=None)
def constants() -> dict:
    """The named constants of the kernel sources, read from the .cuh files (the one place
    they are defined): every ``constexpr`` int/float declaration at namespace scope whose
    value is a number or an arithmetic expression of earlier ones, every numeric
    ``#define SKV_*``, and the ``static constexpr int`` members of a full specialisation
    such as ``EncRow<4>`` (as ``"EncRow<4>::G"``). No CuPy needed."""
    known: dict = {}
    for name in ("spherical_common.cuh",) + OP_HEADERS + RDR_HEADERS:
        text = re.sub(r"//[^\n]*", "", (CSRC / name).read_text())
        for m in _DEFINE.finditer(text):
            known[m.group(1)] = int(m.group(2))
        for m in _ROW.finditer(text):
            for part in m.group(3).split(","):
                key, expr = part.split("=")
                known[f"{m.group(1)}<{m.group(2)}>::{key.strip()}"] = _value(expr, known)
        for m in _DECL.finditer(text):
            for part in m.group(1).split(","):
                if "=" not in part:
                    continue
                key, expr = part.split("=", 1)
                try:
                    known[key.strip()] = _value(expr, known)
                except (ValueError, KeyError, SyntaxError):
                    continue   # not a plain number (a function call, a hex float, ...)
    return known


@functools.lru_cache(maxsize=None)
def _built(device_id: int, headers: tuple, names: tuple):
    """The ``cupy.RawModule`` of ``headers`` with the kernel instances ``names``, compiled
    once per device."""
    cp = cupy()
    with cp.cuda.Device(device_id):
        mod = cp.RawModule(code=source(headers=headers), options=build_options(),
                           name_expressions=list(names))
        mod.compile()
    return mod


def _module(device_id: int):
    """The ops' module: every decode, merge, encode and re-tier instance."""
    return _built(device_id, OP_HEADERS, tuple(instance_names()))


# RDR's statistics, stored-state, hull and cut-count kernels (rdr_stats.cuh): float64, no head-dim
# template, a module of their own so that the ops' build does not grow with them
RDR_HEADERS = ("rdr_stats.cuh",)
RDR_HULL_OPTIONS = (8,)   # T + 1 of the hull kernel's instances (the default ladder's 7 tiers)
RDR_KERNELS = ("skv::rdr_softmax_kernel", "skv::rdr_state_sums_kernel",
               "skv::rdr_rotated_kernel") + tuple(
    f"skv::rdr_{k}_kernel<{t}>" for k in ("hull", "cut_counts") for t in RDR_HULL_OPTIONS)


def rdr_kernel(name: str):
    """The compiled RDR kernel ``name`` (one of RDR_KERNELS) on the current device."""
    if name not in RDR_KERNELS:
        raise ValueError(f"unknown RDR kernel {name!r}; one of {RDR_KERNELS}")
    cp = cupy()
    return _built(cp.cuda.Device().id, RDR_HEADERS, RDR_KERNELS).get_function(name)


def kernel(name: str, dim: int):
    """The compiled kernel ``name`` for head dim ``dim`` on the current device."""
    cp = cupy()
    return _module(cp.cuda.Device().id).get_function(template_name(name, dim))
