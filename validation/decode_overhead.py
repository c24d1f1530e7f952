"""Where the decode step's time goes besides streaming pages: the step time (CUDA graph of
decode + merge, as ``decode_bench.py`` times it) for one batch at growing contexts, fitted by
``us = fixed + per_page * pages_per_warp``. ``fixed`` is what a step costs whatever its length
(launch, prologue, pipeline fill, epilogue, merge); ``per_page`` gives the streaming rate,
which is compared with the copy bandwidth of the same run. ``--flush read`` empties L2 by
reading instead of zeroing a buffer before each repetition (no dirty lines written back
during the timed step); ``--sdpa`` also times torch SDPA bf16 at each point.

    PYTHONPATH=. python3 validation/decode_overhead.py --out decode_overhead.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_bench import D, HKV, HQ, LADDER, Timer, ada_step, build_ada, copy_bandwidth  # noqa: E402

WARPS_PER_CTA = 4


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="decode_overhead.json")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tiers", default="4/4")
    ap.add_argument("--flush", default="write", choices=("write", "read"))
    ap.add_argument("--sdpa", action="store_true")
    ap.add_argument("--series", default="8:2048,4096,8192,16384,32768;1:16384,32768,65536,131072",
                    help="batch:contexts;batch:contexts")
    args = ap.parse_args(argv)
    import cupy as cp
    from cupy_kernels import kernel_tables
    timer = Timer(args.reps, flush=args.flush)
    copy_gbps = copy_bandwidth(timer)
    tables = kernel_tables(LADDER, D, codebook="uniform")
    rows = []
    for part in args.series.split(";"):
        batch, ctxs = part.split(":")
        batch = int(batch)
        series = []
        for context in (int(c) for c in ctxs.split(",")):
            state, _ = build_ada(batch, context, args.tiers, tables)
            lay = state["layout"]
            q = cp.random.standard_normal((batch, HQ, D), dtype=cp.float32)
            run, out, splits = ada_step(state, tables, q, batch)
            us = timer(run)
            pages = int(state["indices"].size)
            per_warp = pages / (batch * HKV * splits * WARPS_PER_CTA)
            r = dict(flush=args.flush, batch=batch, context=context, tiers=args.tiers, splits=splits, pages=pages,
                     pages_per_warp=round(per_warp, 2), cache_bytes=lay.cache_bytes, us=round(us, 2),
                     pct_copy=round(100 * lay.cache_bytes / (us * 1e-6) / 1e9 / copy_gbps, 1))
            if args.sdpa:
                import torch
                import torch.nn.functional as F
                qt = torch.randn(batch, HQ, 1, D, dtype=torch.bfloat16, device="cuda")
                k = torch.randn(batch, HKV, context, D, dtype=torch.bfloat16, device="cuda")
                v = torch.randn_like(k)
                r["sdpa_bf16_us"] = round(timer(lambda: F.scaled_dot_product_attention(
                    qt, k, v, enable_gqa=True)), 2)
                del qt, k, v
            print(json.dumps(r), flush=True)
            series.append(r)
            del run, out, state
            cp.get_default_memory_pool().free_all_blocks()
        x = np.array([r["pages_per_warp"] for r in series])
        y = np.array([r["us"] for r in series])
        slope, fixed = np.polyfit(x, y, 1)
        bytes_per_page = series[-1]["cache_bytes"] / series[-1]["pages"]
        ctas = batch * HKV * series[-1]["splits"]
        stream_gbps = ctas * WARPS_PER_CTA * bytes_per_page / (slope * 1e-6) / 1e9
        fit = dict(flush=args.flush, batch=batch, fixed_us=round(float(fixed), 2), per_page_us=round(float(slope), 3),
                   streaming_gbps=round(float(stream_gbps), 1),
                   streaming_pct_copy=round(100 * stream_gbps / copy_gbps, 1),
                   max_residual_us=round(float(np.max(np.abs(y - (fixed + slope * x)))), 2))
        print("fit", json.dumps(fit), flush=True)
        rows.append(dict(fit=fit, points=series))
    with open(args.out, "w") as f:
        json.dump(dict(copy_gbps=round(copy_gbps, 1), flush=args.flush, series=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
