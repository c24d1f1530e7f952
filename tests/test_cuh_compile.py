"""CPU checks (no GPU needed): every kernel source compiles with nvcc for sm_90, and ptxas
reports no register spills and no stack frame for any kernel instance (DESIGN §6); and the
module the library builds at run time (NVRTC, the same source string, options and name
expressions as cupy_kernels._module) compiled for sm_90 by NVRTC 13.0 where its library is
installed (the `nvrtc` extra; CI installs it), whose local memory can differ from nvcc's."""
import ctypes
import glob
import os
import re
import shutil
import subprocess

import pytest

from cupy_kernels._module import CSRC, DIMS, KERNELS

NVCC = shutil.which("nvcc")
SOURCES = sorted(p.name for p in CSRC.glob("*.cuh"))
# Local memory a kernel may use, bytes of spill stores (loads: twice that). The v4 affine
# kernel, kept only for the side-by-side benchmark, holds one value across the page loop in 4
# bytes of stack (one store before the loop, loads after the prologue and in the epilogue;
# docs/PERF_NOTES.md v5). The v6 affine kernel keeps one 4-byte page-loop variable in local
# memory (stores and a load in the page header, once per page, never inside the 32-state step;
# docs/PERF_NOTES.md v6): measured faster than the spill-free one-sub-tile build. The v8 affine
# kernel (D = 128) keeps one prologue value for the epilogue in 4 bytes of stack (one store
# before the page loop, loads in the prologue and the epilogue; nothing inside the loop).
# NVRTC 13.0 (the run-time build) spills a little more of the same kernels (v4, v6: 20 bytes;
# v8: 12 stores, 36 loads; docs/PERF_NOTES.md build_info). Nothing else may spill.
ALLOWED_NVCC = {"ada_decode_uniform_v4_kernel": 8, "ada_decode_uniform_v6_kernel": 16,
                "ada_decode_uniform_v8_kernel": 8}
# Kernels outside the library's module (built by their validation script), as their instances.
PROBES = {"page_read.cuh": [f"skv::page_read_kernel<{m}, {d}>"
                            for m, d in ((0, 1), (0, 2), (0, 3), (1, 2), (2, 2))]}
ALLOWED_NVRTC = {"ada_decode_uniform_v4_kernel": 20, "ada_decode_uniform_v6_kernel": 20,
                 "ada_decode_uniform_v8_kernel": 20}


def check_spills(log: str, allowed: dict, entries_expected: int, what: str) -> None:
    """Every entry function in a ptxas -v log within its spill allowance (0 if unlisted)."""
    entries = re.findall(r"Compiling entry function '([^']+)'", log)
    assert len(entries) == entries_expected, log
    spills = re.findall(r"Compiling entry function '([^']+)'.*?(\d+) bytes stack frame, "
                        r"(\d+) bytes spill stores, (\d+) bytes spill loads", log, re.S)
    assert len(spills) == len(entries), log
    for entry, frame, stores, loads in spills:
        allow = next((v for k, v in allowed.items() if k in entry), 0)
        assert int(stores) <= allow and int(loads) <= 2 * allow, \
            f"register spills in {entry} ({what}): {stores} bytes stored, {loads} loaded"


def test_sources_found():
    assert {"ada_decode.cuh", "encode.cuh", "retier.cuh", "spherical_common.cuh"} <= set(SOURCES)


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("name", SOURCES)
def test_compiles_for_sm90_without_spills(name, tmp_path):
    text = (CSRC / name).read_text()
    assert text.lstrip().startswith("//"), f"{name} must open with a comment (thread -> data map)"
    kernels = [k for k in KERNELS if re.search(rf"\b{k}\s*\(", text)]
    instances = [f"skv::{k}<{d}>" for k in kernels for d in DIMS] + PROBES.get(name, [])
    lines = [f'#include "{name}"', "void skv_instantiate() {"]
    lines += [f"  (void)&{i};" for i in instances]
    lines.append("}")
    unit = tmp_path / "unit.cu"
    unit.write_text("\n".join(lines) + "\n")
    res = subprocess.run([NVCC, "-arch=sm_90", "-Xptxas", "-v", "-std=c++17", f"-I{CSRC}", "-c",
                          str(unit), "-o", str(tmp_path / "unit.o")],
                         capture_output=True, text=True, timeout=600)
    log = res.stdout + res.stderr
    assert res.returncode == 0, log
    if not instances:
        return
    check_spills(log, ALLOWED_NVCC, len(instances), f"nvcc, {name}")
    assert "warning" not in log.lower(), log


def test_module_source_changes_with_any_header(tmp_path, monkeypatch):
    """The string handed to NVRTC (CuPy's on-disk cache key, with the options) carries a digest
    of every header, so an edited .cuh is compiled again instead of loaded stale."""
    from cupy_kernels import _module
    for p in CSRC.glob("*.cuh"):
        (tmp_path / p.name).write_bytes(p.read_bytes())
    monkeypatch.setattr(_module, "CSRC", tmp_path)
    before = _module.source()
    assert before == _module.source()
    with open(tmp_path / "spherical_common.cuh", "a") as f:
        f.write("\n// edited\n")
    after = _module.source()
    assert after != before
    assert after.splitlines()[1:] == before.splitlines()[1:]   # the same #include lines


def _nvrtc():
    """The NVRTC 13 library (the nvidia-cuda-nvrtc wheel), its builtins loaded first so that
    it finds them without LD_LIBRARY_PATH; None where it is not installed."""
    try:
        import nvidia   # namespace package of NVIDIA's wheels
    except ImportError:
        return None
    for root in getattr(nvidia, "__path__", []):
        lib = os.path.join(root, "cu13", "lib", "libnvrtc.so.13")
        builtins = sorted(glob.glob(os.path.join(root, "cu13", "lib", "libnvrtc-builtins.so.13.*")))
        if os.path.exists(lib) and builtins:
            ctypes.CDLL(builtins[0], mode=ctypes.RTLD_GLOBAL)
            return ctypes.CDLL(lib)
    return None


def _cuda_include():
    """The CUDA headers of the toolkit whose nvcc is on PATH (cuda_fp16.h, for NVRTC)."""
    if NVCC is None:
        return None
    res = subprocess.run([NVCC, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
                         capture_output=True, text=True)
    m = re.search(r"^#\$ TOP=(\S+)", res.stdout + res.stderr, re.M)
    for inc in ([os.path.join(m.group(1), "include")] if m else []) + sorted(glob.glob("/usr/local/cuda*/include")):
        if os.path.exists(os.path.join(inc, "cuda_fp16.h")):
            return inc
    return None


NVRTC = _nvrtc()


@pytest.mark.skipif(NVRTC is None or NVCC is None,
                    reason="NVRTC 13 library (pip install nvidia-cuda-nvrtc==13.0.*) or CUDA headers missing")
def test_runtime_build_without_spills():
    """The module exactly as cupy_kernels._module builds it on the device (source string,
    options, every kernel instance by name), compiled for sm_90 by NVRTC with ptxas -v: every
    instance within its NVRTC allowance."""
    from cupy_kernels import _module
    inc = _cuda_include()
    assert inc, "CUDA headers not found next to nvcc"
    lib = NVRTC
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), _module.source().encode(), b"skv.cu",
                                  0, None, None) == 0
    names = _module.instance_names()
    for n in names:
        assert lib.nvrtcAddNameExpression(prog, n.encode()) == 0
    opts = list(_module.build_options()) + [f"-I{inc}", "-arch=sm_90", "--ptxas-options=-v"]
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    buf = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, buf)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    log = buf.value.decode(errors="replace")
    assert rc == 0, log
    check_spills(log, ALLOWED_NVRTC, len(names), "NVRTC")
