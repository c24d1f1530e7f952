"""Build-time variants of the encode kernels, timed on the same inputs as the kernels as
built (one GPU, one process). A variant is a set of NVRTC defines of csrc/*.cuh and launcher
settings of cupy_kernels/encode.py. ENC3_SCALE64 = 0 sends a vector whose fp16 scale alone is
in doubt to the float64 pipeline, as before the float64 scale decision; ENC3_DEFER = 0 is a
diagnostic build that defers nothing (wrong output: the time of v3's float32 path alone, so the
difference is what the float64 pipeline costs). Every row says whether its pool bytes equal
those of the kernels as built (the correctness check of a variant; the diagnostic is expected
to differ).

    PYTHONPATH=. python3 validation/encode_variants.py --out encode_variants.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_bench import (D, LADDER, Timer, copy_bandwidth, encode_bytes,  # noqa: E402
                          encode_inputs, encode_keys_values)
from decode_variants import dump_table, launcher_as  # noqa: E402

# name: (NVRTC defines, launcher overrides)
VARIANTS = {
    "v3_scale0": (dict(ENC3_SCALE64=0), {}),
    "v3_nodefer": (dict(ENC3_DEFER=0), {}),
    # keys and values in two launches (encode_kv_into_pages as two encode_into_pages calls)
    "v3_kv2": ({}, dict(KV_ONE_LAUNCH=False)),
}
CASES = [(32, 8192, "rdr-mix"), (8, 32768, "rdr-mix"), (1, 131072, "rdr-mix"),
         (8, 32768, "4/4"), (1, 131072, "4/4"), (1, 131072, "3/3"), (8, 32768, "3/3"),
         (8, 32768, "2/2"), (1, 131072, "2/2")]


def variant_getter(defines: dict):
    """A kernel getter like cupy_kernels._module.kernel, for a module built with `defines`
    (only the two v3 encode kernels are instantiated)."""
    import cupy as cp
    from cupy_kernels import _module
    opts = _module.build_options() + tuple(f"-D{k}={v}" for k, v in defines.items())
    names = [_module.template_name(k, D) for k in ("encode_v3_kernel", "encode_v3_uniform_kernel")]
    mod = cp.RawModule(code=_module.source(), options=opts, name_expressions=names)
    mod.compile()
    return lambda name, dim: mod.get_function(_module.template_name(name, dim))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="encode_variants.json")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--cases", default="all", help="'all' or indices into CASES, e.g. 0,1")
    ap.add_argument("--variants", default="all", help="'all' or names of VARIANTS")
    ap.add_argument("--codebooks", default="lloyd-max,uniform")
    args = ap.parse_args(argv)
    import importlib
    import cupy as cp
    from cupy_kernels import kernel_tables
    enc = importlib.import_module("cupy_kernels.encode")
    timer = Timer(args.reps)
    copy_gbps = copy_bandwidth(timer)
    print(f"copy bandwidth (read + write): {copy_gbps:.0f} GB/s", flush=True)
    chosen = list(VARIANTS) if args.variants == "all" else [v for v in args.variants.split(",") if v]
    getters = {"v3": None, **{name: variant_getter(VARIANTS[name][0]) for name in chosen}}
    cases = CASES if args.cases == "all" else [CASES[int(i)] for i in args.cases.split(",")]
    rows = []
    for (batch, context, tiers), cb in [(c, b) for c in cases for b in args.codebooks.split(",")]:
        tables = kernel_tables(LADDER, D, codebook=cb)
        lay, inp = encode_inputs(batch, context, tiers, tables)
        nbytes = encode_bytes(lay)
        first = None
        for name, getter in getters.items():
            pages = cp.zeros((lay.page_tier.size, tables.page_bytes), cp.uint8)
            st = cp.zeros(1, cp.int32)
            with launcher_as(enc, getter, VARIANTS[name][1] if name in VARIANTS else {}):
                us = timer(lambda: encode_keys_values(inp, tables, pages, st, 3))
            status = int(st.get()[0])
            same = True if first is None else bool(cp.array_equal(pages, first))
            if first is None:
                first = pages
            r = dict(variant=name, batch=batch, context=context, tiers=tiers, codebook=cb,
                     us=round(us, 2), pct_copy=round(100 * nbytes / (us * 1e-6) / 1e9 / copy_gbps, 1),
                     bytes_equal_to_v3=same, status=status)
            rows.append(r)
            print(json.dumps(r), flush=True)
        del inp, pages, first
        cp.get_default_memory_pool().free_all_blocks()
    dump_table(args.out, copy_gbps, rows,
               [("variant", "variant", -13, "s"), ("batch", "B", 3, "d"), ("context", "ctx", 7, "d"),
                ("tiers", "tiers", 8, "s"), ("codebook", "codebook", 9, "s"), ("us", "us", 8, ".1f"),
                ("pct_copy", "%copy", 6, ".1f"), ("bytes_equal_to_v3", "same", 5, "s")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
