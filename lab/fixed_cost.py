"""The decode kernel's fixed cost per call inside a CUDA graph: ``--calls`` decode ops (one
per layer, as in a model's step) of a 4/4 device cache at the Llama-3.1-8B layer shape (8
kv-heads, 32 query heads, d 128), captured in one graph and replayed; µs per call from CUDA
events (median of ``--reps`` replays). At a context of one page per row the per-call time is
the fixed cost (prologue, merge, tail); at larger contexts the rest is reading pages. Each
context runs with the split-K merge (the step's ``num_splits``) and, where the kernel allows
it, without (1 split).

A captured step launches the merge plainly (``_pdl``: programmatic dependent launch inside
a graph replayed wrong numbers on the H200), so PDL's share is measured outside graphs:
the same calls issued eagerly with ``SPHERICAL_KV_PDL`` 1 and 0 (one Python call per op:
where the host issues slower than the GPU runs them, the two agree and say only that).

    PYTHONPATH=. python3 lab/fixed_cost.py --batch 8 --contexts 16,1024,32768
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np


def _median_us(fn, reps: int, per: int) -> float:
    import torch
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / per)
    return float(np.median(times[2:]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--contexts", default="16,1024,32768")
    ap.add_argument("--calls", type=int, default=32, help="decode calls per graph (layers)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=None, help="JSON file for the rows")
    args = ap.parse_args()
    import torch
    from cupy_kernels.device_cache import DeviceKVCache
    from spherical_kv_ref.tiers import TierLadder
    torch.set_grad_enabled(False)
    H, Hq, d, B, n = 8, 32, 128, args.batch, args.calls
    rows = []
    for context in (int(x) for x in args.contexts.split(",")):
        ladder = TierLadder([(4, 4)])
        per = ladder.states_per_page(1, d, 4096)
        pages = B * n * H * (-(-(context + 16) // per)) + 16
        cache = DeviceKVCache(n, H, d, ladder, pool_bytes=pages * 4096, num_q_heads=Hq,
                              codebook="uniform")
        g = torch.Generator(device="cuda").manual_seed(0)
        seqs = [cache.new_sequence() for _ in range(B)]
        for s in seqs:
            for layer in range(n):
                kv = torch.randn((2, H, context, d), device="cuda", generator=g)
                cache.append(s, layer, kv[0], kv[1])
        step = cache.decode_step(seqs, 1)
        q = torch.randn((B, Hq, d), device="cuda", generator=g)
        for splits in sorted({step.num_splits, 1}, reverse=True):
            step.num_splits = splits

            def calls():
                for layer in range(n):
                    step.decode(layer, q)
            calls()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                calls()
            row = dict(batch=B, context=context, splits=splits, calls=n,
                       graph_us_per_call=_median_us(graph.replay, args.reps, n))
            for pdl in ("1", "0"):
                os.environ["SPHERICAL_KV_PDL"] = pdl
                calls()
                torch.cuda.synchronize()
                row[f"eager_pdl{pdl}_us_per_call"] = _median_us(calls, args.reps, n)
            os.environ.pop("SPHERICAL_KV_PDL")
            rows.append(row)
            print(json.dumps(row), flush=True)
            del graph
        step.close(0)
        del cache
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "gpu": torch.cuda.get_device_name()}, f, indent=1)


if __name__ == "__main__":
    main()
