"""Where the decode step's time goes besides streaming pages: the step time (CUDA graph of
decode + merge, as ``decode_bench.py`` times it) for one batch at growing contexts, fitted by
``us = fixed + per_page * pages_per_warp``. ``fixed`` is what a step costs whatever its length
(launch, prologue, pipeline fill, epilogue, merge); ``per_page`` gives the streaming rate,
which is compared with the copy bandwidth of the same run. ``--flush read`` empties L2 by
reading instead of zeroing a buffer before each repetition (no dirty lines written back
during the timed step); ``--sdpa`` also times torch SDPA bf16 at each point; ``--variants``
times build-time variants of ``decode_variants.py`` next to the kernel as built (``built``) at
each point, each with its own fit.

    PYTHONPATH=. python3 validation/decode_overhead.py --out decode_overhead.json
    PYTHONPATH=. python3 validation/decode_overhead.py --variants built,v7_late
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_bench import D, HKV, HQ, LADDER, Timer, ada_step, build_ada, copy_bandwidth  # noqa: E402
from decode_variants import VARIANTS, variant_kernels  # noqa: E402

WARPS_PER_CTA = 4


def _fit(points, batch, flush, copy_gbps):
    """us = fixed + per_page * pages_per_warp over one series, and the streaming rate it implies."""
    x = np.array([r["pages_per_warp"] for r in points])
    y = np.array([r["us"] for r in points])
    slope, fixed = np.polyfit(x, y, 1)
    bytes_per_page = points[-1]["cache_bytes"] / points[-1]["pages"]
    ctas = batch * HKV * points[-1]["splits"]
    stream_gbps = ctas * WARPS_PER_CTA * bytes_per_page / (slope * 1e-6) / 1e9
    return dict(flush=flush, batch=batch, fixed_us=round(float(fixed), 2),
                per_page_us=round(float(slope), 3), streaming_gbps=round(float(stream_gbps), 1),
                streaming_pct_copy=round(100 * stream_gbps / copy_gbps, 1),
                max_residual_us=round(float(np.max(np.abs(y - (fixed + slope * x)))), 2))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="decode_overhead.json")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tiers", default="4/4")
    ap.add_argument("--flush", default="write", choices=("write", "read"))
    ap.add_argument("--sdpa", action="store_true")
    ap.add_argument("--series", default="8:2048,4096,8192,16384,32768;1:16384,32768,65536,131072",
                    help="batch:contexts;batch:contexts")
    ap.add_argument("--variants", default="built",
                    help="'built' (the kernels as built) and/or names of decode_variants.VARIANTS "
                         "that set only NVRTC defines, e.g. built,v7_late")
    args = ap.parse_args(argv)
    import importlib
    import cupy as cp
    from cupy_kernels import kernel_tables
    ad = importlib.import_module("cupy_kernels.ada_decode")   # the module, not the function
    names = [v for v in args.variants.split(",") if v]
    bad = [v for v in names if v != "built" and not (v in VARIANTS and VARIANTS[v][0]
                                                    and not VARIANTS[v][1])]
    if bad:
        ap.error(f"--variants: {bad} are not variants that set only NVRTC defines")
    built_kernel = ad.kernel
    getters = {v: built_kernel if v == "built" else variant_kernels(VARIANTS[v][0]) for v in names}
    timer = Timer(args.reps, flush=args.flush)
    copy_gbps = copy_bandwidth(timer)
    tables = kernel_tables(LADDER, D, codebook="uniform")
    rows = []
    for part in args.series.split(";"):
        batch, ctxs = part.split(":")
        batch = int(batch)
        series = {v: [] for v in names}
        for context in (int(c) for c in ctxs.split(",")):
            state, _ = build_ada(batch, context, args.tiers, tables)
            lay = state["layout"]
            q = cp.random.standard_normal((batch, HQ, D), dtype=cp.float32)
            pages = int(state["indices"].size)
            sdpa_us = None
            if args.sdpa:
                import torch
                import torch.nn.functional as F
                qt = torch.randn(batch, HQ, 1, D, dtype=torch.bfloat16, device="cuda")
                k = torch.randn(batch, HKV, context, D, dtype=torch.bfloat16, device="cuda")
                v = torch.randn_like(k)
                sdpa_us = round(timer(lambda: F.scaled_dot_product_attention(
                    qt, k, v, enable_gqa=True)), 2)
                del qt, k, v
            for name in names:
                ad.kernel = getters[name]
                try:
                    run, out, splits = ada_step(state, tables, q, batch)
                    us = timer(run)
                finally:
                    ad.kernel = built_kernel
                per_warp = pages / (batch * HKV * splits * WARPS_PER_CTA)
                r = dict(variant=name, flush=args.flush, batch=batch, context=context,
                         tiers=args.tiers, splits=splits, pages=pages,
                         pages_per_warp=round(per_warp, 2), cache_bytes=lay.cache_bytes,
                         us=round(us, 2),
                         pct_copy=round(100 * lay.cache_bytes / (us * 1e-6) / 1e9 / copy_gbps, 1))
                if sdpa_us is not None:
                    r["sdpa_bf16_us"] = sdpa_us
                print(json.dumps(r), flush=True)
                series[name].append(r)
                del run, out
            del state
            cp.get_default_memory_pool().free_all_blocks()
        for name in names:
            fit = dict(variant=name, **_fit(series[name], batch, args.flush, copy_gbps))
            print("fit", json.dumps(fit), flush=True)
            rows.append(dict(fit=fit, points=series[name]))
    with open(args.out, "w") as f:
        json.dump(dict(copy_gbps=round(copy_gbps, 1), flush=args.flush, series=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
