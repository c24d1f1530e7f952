"""What the device's own build of the kernels looks like: registers, local memory (stack and
spills), static shared memory per kernel instance, next to the same figures from ``nvcc
-Xptxas -v`` that CI checks. The library builds through NVRTC at run time, whose compiler
version can differ from the nvcc that CI uses, so a kernel that is spill-free in CI can still
touch local memory on the device (docs/PERF_NOTES.md, v7).

    PYTHONPATH=. python3 validation/build_info.py --out build_info.json
"""
from __future__ import annotations

import argparse
import json


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
