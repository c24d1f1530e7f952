"""Build-time variants of the v6 affine decode kernel, timed on the same pools as v5 and v6
as built (one GPU, one process): which of the v6 changes pays, before one is made the
default. A variant is a set of NVRTC defines of csrc/ada_decode.cuh (DEC_UNI6_SUB: 16-state
sub-tiles per softmax step; DEC_UNI6_CTAS: the residency asked of ptxas; DEC_LAZY_MAX: the
log2 slack of the running maximum, 0 = move it at every new maximum).

    PYTHONPATH=. python3 validation/decode_variants.py --out variants.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_bench import D, HKV, HQ, LADDER, Timer, ada_step, build_ada, copy_bandwidth  # noqa: E402

VARIANTS = {
    "sub2_ctas4": dict(DEC_UNI6_SUB=2, DEC_UNI6_CTAS=4),
    "sub2_ctas3": dict(DEC_UNI6_SUB=2, DEC_UNI6_CTAS=3),
    "sub1_lazy0": dict(DEC_LAZY_MAX="0.0f"),
}
# v6 as built with twice the split-K splits (choose_splits aims at ~4 waves instead of ~2)
WAVES4 = "v6_4waves"
CASES = [(32, 8192, "4/4"), (8, 32768, "4/4"), (8, 32768, "2/2"), (1, 131072, "4/4"),
         (8, 32768, "rdr-mix")]


def variant_kernels(defines: dict):
    """A kernel getter like cupy_kernels._module.kernel, for a module built with `defines`
    (only the affine v6 decode and the merge are instantiated)."""
    import cupy as cp
    from cupy_kernels import _module
    opts = _module.OPTIONS + (f"-I{_module.CSRC}",) + tuple(f"-D{k}={v}" for k, v in defines.items())
    names = [_module.template_name(k, D) for k in ("ada_decode_uniform_v6_kernel", "ada_merge_kernel")]
    mod = cp.RawModule(code=_module.source(), options=opts, name_expressions=names)
    mod.compile()
    return lambda name, dim: mod.get_function(_module.template_name(name, dim))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="decode_variants.json")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    import importlib
    import cupy as cp
    from cupy_kernels import kernel_tables
    ad = importlib.import_module("cupy_kernels.ada_decode")   # the module (the package
    # exports the function of the same name)
    timer = Timer(args.reps)
    copy_gbps = copy_bandwidth(timer)
    print(f"copy bandwidth (read + write): {copy_gbps:.0f} GB/s", flush=True)
    tables = kernel_tables(LADDER, D, codebook="uniform")
    getters = {name: variant_kernels(defs) for name, defs in VARIANTS.items()}
    built_kernel, built_ctas = ad.kernel, ad.CTAS_PER_SM_UNIFORM_V6
    rows = []
    for batch, context, tiers in CASES:
        state, _ = build_ada(batch, context, tiers, tables)
        lay = state["layout"]
        q = cp.random.standard_normal((batch, HQ, D), dtype=cp.float32)
        nbytes = lay.cache_bytes + q.size * 4 + (lay.indptr.size + 3 * lay.indices.size) * 4
        ref = None
        for name in ["v5", "v6", WAVES4, *VARIANTS]:
            if name in VARIANTS:
                ad.kernel = getters[name]
                ad.CTAS_PER_SM_UNIFORM_V6 = int(VARIANTS[name].get("DEC_UNI6_CTAS", built_ctas))
            elif name == WAVES4:
                ad.CTAS_PER_SM_UNIFORM_V6 = 2 * built_ctas
            try:
                run, out, splits = ada_step(state, tables, q, batch, 5 if name == "v5" else 6)
                us = timer(run)
            finally:
                ad.kernel, ad.CTAS_PER_SM_UNIFORM_V6 = built_kernel, built_ctas
            if ref is None:
                ref = out.copy()
            rel = float(cp.linalg.norm(out - ref) / cp.linalg.norm(ref))
            r = dict(variant=name, batch=batch, context=context, tiers=tiers, us=round(us, 2),
                     splits=splits, gbps=round(nbytes / (us * 1e-6) / 1e9, 1),
                     pct_copy=round(100 * nbytes / (us * 1e-6) / 1e9 / copy_gbps, 1),
                     rel_diff_vs_v5=rel)
            rows.append(r)
            print(json.dumps(r), flush=True)
            del run
        del state
        cp.get_default_memory_pool().free_all_blocks()
    with open(args.out, "w") as f:
        json.dump(dict(copy_gbps=copy_gbps, rows=rows), f, indent=1)
    print(f"\n{'variant':12s} {'B':>3s} {'ctx':>7s} {'tiers':>8s} {'us':>8s} {'%copy':>6s}")
    for r in rows:
        print(f"{r['variant']:12s} {r['batch']:3d} {r['context']:7d} {r['tiers']:>8s} "
              f"{r['us']:8.1f} {r['pct_copy']:6.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
