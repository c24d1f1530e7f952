"""What the device's own build of the kernels looks like: registers, local memory (stack and
spills), static shared memory per kernel instance, next to the same figures from ``nvcc
-Xptxas -v`` that CI checks. The library builds through NVRTC at run time, whose compiler
version can differ from the nvcc that CI uses, so a kernel that is spill-free in CI can still
touch local memory on the device.

    PYTHONPATH=. python3 validation/build_info.py --out build_info.json

``offline_build`` compiles the same module without a GPU (NVRTC 13 from the nvidia-cuda-nvrtc
wheel, for sm_90): tests/test_cuh_compile.py reads its ptxas log, lab/kernel_identity.py its
machine code.
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass


def nvrtc_library():
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


def cuda_include():
    """The CUDA headers (cuda_fp16.h, for NVRTC) of the toolkit whose nvcc is on PATH, else of
    a /usr/local/cuda* toolkit; None where there are none."""
    nvcc = shutil.which("nvcc")
    tops = []
    if nvcc:
        res = subprocess.run([nvcc, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True)
        m = re.search(r"^#\$ TOP=(\S+)", res.stdout + res.stderr, re.M)
        tops = [os.path.join(m.group(1), "include")] if m else []
    for inc in tops + sorted(glob.glob("/usr/local/cuda*/include")):
        if os.path.exists(os.path.join(inc, "cuda_fp16.h")):
            return inc
    return None


@dataclass
class OfflineBuild:
    rc: int          # nvrtcCompileProgram's result (0: compiled)
    log: str         # the compiler's log (ptxas -v lines with --ptxas-options=-v)
    cubin: bytes     # the sm_90 binary (empty unless rc is 0)
    lowered: dict    # name expression -> mangled kernel name


def offline_build(source: str, names, options, arch: str = "sm_90") -> OfflineBuild:
    """``source`` with the kernel instances ``names`` (NVRTC name expressions) compiled by
    NVRTC for ``arch`` with ``options`` plus the CUDA headers: no GPU needed."""
    lib = nvrtc_library()
    inc = cuda_include()
    if lib is None or inc is None:
        raise RuntimeError("offline builds need NVRTC 13 (pip install nvidia-cuda-nvrtc==13.0.*) "
                           "and the CUDA headers")
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"skv.cu", 0, None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    try:
        for n in names:
            if lib.nvrtcAddNameExpression(prog, n.encode()):
                raise RuntimeError(f"nvrtcAddNameExpression failed for {n}")
        opts = list(options) + [f"-I{inc}", f"-arch={arch}"]
        arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, buf)
        log = buf.value.decode(errors="replace")
        if rc:
            return OfflineBuild(rc, log, b"", {})
        lowered = {}
        for n in names:
            p = ctypes.c_char_p()
            lib.nvrtcGetLoweredName(prog, n.encode(), ctypes.byref(p))
            lowered[n] = p.value.decode()
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, cubin)
        return OfflineBuild(rc, log, cubin.raw, lowered)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def kernel_rows(mod, names, build: str) -> list:
    rows = []
    for name in names:
        fn = mod.get_function(name)
        a = fn.attributes
        rows.append(dict(build=build, kernel=name, registers=int(a["num_regs"]),
                         local_bytes=int(a["local_size_bytes"]),
                         static_smem_bytes=int(a["shared_size_bytes"]),
                         binary_version=int(a["binary_version"])))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="build_info.json")
    args = ap.parse_args(argv)
    import cupy as cp
    from cupy_kernels import _module
    names = _module.instance_names()
    info = dict(nvrtc_version=".".join(map(str, cp.cuda.nvrtc.getVersion())),
                cupy=cp.__version__, runtime=cp.cuda.runtime.runtimeGetVersion(),
                driver=cp.cuda.runtime.driverGetVersion())
    rows = kernel_rows(_module._module(cp.cuda.Device().id), names, "nvrtc")
    for r in rows:
        flag = "  <- local memory" if r["local_bytes"] else ""
        print(f"{r['build']:6s} {r['kernel']:48s} regs {r['registers']:3d} local {r['local_bytes']:4d} B "
              f"smem {r['static_smem_bytes']:6d} B sm_{r['binary_version']}{flag}")
    print(json.dumps(info))
    with open(args.out, "w") as f:
        json.dump(dict(info, kernels=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
