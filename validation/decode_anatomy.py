"""Where the time of one v7 decode step goes: a diagnostic build of the v7 kernel
(csrc/ada_decode.cuh, DEC7_TRACE = 1) stamps %globaltimer per CTA at kernel entry, after the
query prologue, at each warp's end of its pages, after the cross-warp barrier and at exit (the
partial or the output written), and each warp after every 4th of its pages (its streaming rate
over the step: a slow SM against a slow end). This script runs that build on the benchmark's
pools (one GPU) and writes per-case summaries and one repetition's per-CTA stamps; ``--plot``
draws them.

    PYTHONPATH=. python3 validation/decode_anatomy.py --out anatomy.json          # GPU
    python3 -m validation.decode_anatomy --plot anatomy.json --png anatomy.png    # CPU

The stamps cost a few instructions and (at 128 registers) a few spilled bytes, so the traced
kernel is slightly slower than the built one; read the split of the time, not its total.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_bench import D, HKV, HQ, LADDER, build_ada  # noqa: E402

TRACE_CTAS, WARPS = 4096, 4   # csrc SKV_TRACE_CTAS, DEC_WARPS
PROGRESS_SLOTS, EVERY = 32, 4   # csrc SKV_PROGRESS_SLOTS, DEC7_TRACE_EVERY: each warp's stamps
# after its 4th, 8th, ... page
POINTS = 16   # csrc SKV_TRACE_POINTS: 0 entry, 1 prologue done, 2 pages done (barrier), 3 exit,
# 4..7 each warp's end of its pages, 8 SM id, 9 warp 0's first header block read and first copy
# issued, 10 warp 0's query rotated, 11 the prologue's first barrier passed (every warp's first
# header block read and query rotated), 12..15 each warp before the prologue's last barrier
CASES = "8x32768:4/4,1x131072:4/4,32x8192:4/4,2x131072:4/4,8x32768:rdr-mix"


def progress_rates(tr: np.ndarray, prog: np.ndarray, every: int = EVERY) -> dict:
    """Streaming rates (pages per microsecond) from the progress stamps prog[cta, warp, slot]
    (ns; 0 = none): per warp over its whole stream and over the first and second half of its
    intervals; per SM the mean of its warps. Says whether a late warp is slow throughout (a
    slow SM) or slows down at the end."""
    sm = tr[:, 8].astype(int)
    whole, ratio, sm_rates = [], [], {}
    for c in range(prog.shape[0]):
        for w in range(prog.shape[1]):
            st = prog[c, w][prog[c, w] > 0].astype(np.float64) / 1e3
            if st.size < 3:
                continue
            gaps = np.diff(st)
            half = gaps.size // 2
            rate = every * gaps.size / (st[-1] - st[0])
            whole.append(rate)
            if half:
                ratio.append(gaps[:half].mean() / gaps[half:].mean())   # late rate / early rate
            sm_rates.setdefault(int(sm[c]), []).append(rate)
    if not whole:
        return {}
    per_sm = np.array([np.mean(v) for v in sm_rates.values()])
    return dict(warp_pages_per_us_median=float(np.median(whole)),
                warp_rate_p10_over_p90=float(np.percentile(whole, 10) / np.percentile(whole, 90)),
                sm_rate_min_over_max=float(per_sm.min() / per_sm.max()),
                late_over_early_rate_median=float(np.median(ratio)) if ratio else float("nan"))


def summarize(tr: np.ndarray, splits: int, prog: np.ndarray | None = None) -> dict:
    """Per-step figures (microseconds) from the stamps tr[cta, point] of one launch (and, with
    prog, the streaming rates of progress_rates)."""
    t = tr.astype(np.float64)
    us = (t - t[:, 0].min()) / 1e3   # every point but 8 (the SM id) is a time
    entry, pro, done, exit_ = us[:, 0], us[:, 1], us[:, 2], us[:, 3]
    wend = us[:, 4:8]
    row_ctas = exit_.reshape(-1, splits)
    epi = exit_ - done
    return dict(
        span_us=float(exit_.max()), entry_spread_us=float(entry.max()),
        prologue_us_median=float(np.median(pro - entry)), prologue_us_max=float((pro - entry).max()),
        first_copy_issued_us_median=float(np.median(us[:, 9] - entry)),
        query_rotated_us_median=float(np.median(us[:, 10] - entry)),
        first_barrier_us_median=float(np.median(us[:, 11] - entry)),
        first_barrier_us_max=float((us[:, 11] - entry).max()),
        **{f"warp{w}_at_last_barrier_us_median": float(np.median(us[:, 12 + w] - entry))
           for w in range(WARPS)},
        pages_start_us_median=float(np.median(pro)),
        pages_us_median=float(np.median(wend.max(axis=1) - pro)),
        pages_end_us_p10=float(np.percentile(wend.max(axis=1), 10)),
        pages_end_us_median=float(np.median(wend.max(axis=1))),
        pages_end_us_max=float(wend.max()),
        warp_spread_us_median=float(np.median(wend.max(axis=1) - wend.min(axis=1))),
        warp_spread_us_max=float((wend.max(axis=1) - wend.min(axis=1)).max()),
        barrier_us_median=float(np.median(done - wend.max(axis=1))),
        epilogue_us_median=float(np.median(epi)), epilogue_us_max=float(epi.max()),
        exit_us_p50=float(np.median(exit_)), exit_us_p90=float(np.percentile(exit_, 90)),
        row_end_spread_us_median=float(np.median(row_ctas.max(axis=1) - row_ctas.min(axis=1))),
        sms=int(len(np.unique(tr[:, 8]))),
        **(progress_rates(tr, prog) if prog is not None else {}))


def measure(args) -> dict:
    import importlib
    import cupy as cp
    from cupy_kernels import kernel_tables, make_workspace
    from cupy_kernels.ada_decode import splits_for
    from decode_variants import launcher_as, variant_module
    ad = importlib.import_module("cupy_kernels.ada_decode")
    mod, getter = variant_module(dict(DEC7_TRACE=1, **args.define))
    try:
        trace = cp.ndarray((TRACE_CTAS, POINTS), cp.uint64, memptr=mod.get_global("skv_trace"))
        progress = cp.ndarray((TRACE_CTAS, WARPS, PROGRESS_SLOTS), cp.uint64,
                              memptr=mod.get_global("skv_progress"))
    except Exception as e:   # the module exposes no such symbol: nothing to read
        raise SystemExit(f"cannot read the trace buffers: {e}")
    flush = cp.empty(256 << 20, cp.uint8)
    tables = kernel_tables(LADDER, D, codebook="uniform")
    out_rows, raw = [], {}
    for case in args.cases.split(","):
        shape, tiers, *pool = case.split(":")   # an optional third field: the pool's order
        batch, context = (int(v) for v in shape.split("x"))
        state, _ = build_ada(batch, context, tiers, tables, order=pool[0] if pool else "shuffled")
        q = cp.random.standard_normal((batch, HQ, D), dtype=cp.float32)
        rows = batch * HKV
        splits = splits_for(tables, 7, rows, int(state["indices"].size))
        if rows * splits > TRACE_CTAS:
            print(f"{case}: {rows * splits} CTAs, more than the trace holds; skipped", flush=True)
            continue
        call = (q, state["pages"], state["page_tier"], state["page_count"], state["indptr"],
                state["indices"], tables, state["sigma_k"], state["sigma_v"])
        ws = make_workspace(rows, HQ // HKV, D, splits)
        out = cp.empty((batch, HQ, D), cp.float32)
        with launcher_as(ad, getter, args.set):
            ad.ada_decode(*call, num_kv_heads=HKV, out=out, workspace=ws, version=7)
            reps = []
            for _ in range(args.reps):
                trace.fill(0)
                progress.fill(0)
                flush.fill(0)
                e0, e1 = cp.cuda.Event(), cp.cuda.Event()
                e0.record()
                ad.ada_decode(*call, num_kv_heads=HKV, out=out, workspace=ws, version=7,
                              validate=False)
                e1.record()
                e1.synchronize()
                reps.append((cp.cuda.get_elapsed_time(e0, e1) * 1e3,
                             cp.asnumpy(trace[:rows * splits]),
                             cp.asnumpy(progress[:rows * splits])))
        if not bool(cp.all(cp.isfinite(out))):
            raise SystemExit(f"{case}: non-finite output")
        sums = [dict(event_us=ev, **summarize(tr, splits, pg)) for ev, tr, pg in reps]
        med = {k: float(np.median([s[k] for s in sums])) for k in sums[0]}
        mid = int(np.argsort([s["span_us"] for s in sums])[len(sums) // 2])
        r = dict(batch=batch, context=context, tiers=tiers, splits=splits, reps=args.reps,
                 cache_bytes=int(state["layout"].cache_bytes),
                 **{k: round(v, 2) for k, v in med.items()})
        out_rows.append(r)
        tr, pg = reps[mid][1], reps[mid][2]
        t0 = int(tr[:, 0].min())
        raw[case] = dict(splits=splits, event_us=reps[mid][0],
                         stamps_ns=(tr[:, :8].astype(np.int64) - t0).tolist(),
                         late_points_ns=(tr[:, 9:POINTS].astype(np.int64) - t0).tolist(),   # 9 .. 15
                         sm=tr[:, 8].astype(int).tolist(),
                         progress_ns=[[int(v) - t0 for v in w if v] for c in pg for w in c])
        print(json.dumps(r), flush=True)
        del state
        cp.get_default_memory_pool().free_all_blocks()
    return dict(rows=out_rows, raw=raw)


def plot(data: dict, png: str) -> None:
    """One panel per case: how many CTAs are in their prologue, streaming pages, in the
    epilogue (after their last warp's pages) or done, over the step; the step ends when the
    last CTA exits."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = list(data["raw"])
    fig, axes = plt.subplots(len(keys), 1, figsize=(9, 2.3 * len(keys)), squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        r = data["raw"][key]
        st = np.asarray(r["stamps_ns"], dtype=np.float64) / 1e3
        entry, pro, exit_ = st[:, 0], st[:, 1], st[:, 3]
        wend = st[:, 4:8].max(axis=1)
        t = np.linspace(0.0, exit_.max() * 1.03, 600)[:, None]
        phases = [((t >= entry) & (t < pro)).sum(1), ((t >= pro) & (t < wend)).sum(1),
                  ((t >= wend) & (t < exit_)).sum(1), (t >= exit_).sum(1)]
        ax.stackplot(t[:, 0], *phases, colors=["tab:orange", "tab:blue", "tab:red", "0.85"],
                     labels=["prologue", "streaming pages", "epilogue", "done"])
        ax.axvline(exit_.max(), color="k", lw=0.8)
        ax.set_title(f"{key}: {st.shape[0]} CTAs ({r['splits']} per row); last exit "
                     f"{exit_.max():.1f} us, median end of pages {np.median(wend):.1f} us", fontsize=9)
        ax.set_ylabel("CTAs")
        ax.set_xlim(0, t[-1, 0])
        ax.set_ylim(0, st.shape[0])
    axes[-1, 0].set_xlabel("microseconds since the first CTA's entry (traced build, one launch)")
    axes[0, 0].legend(loc="center left", fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="decode_anatomy.json")
    ap.add_argument("--cases", default=CASES, help="BxCONTEXT:tiers[:order], comma-separated (order: synthetic_layout's, "
                         "shuffled by default)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--plot", help="draw a saved JSON instead of measuring (no GPU needed)")
    ap.add_argument("--png", default=None)
    ap.add_argument("--define", action="append", default=[],
                    help="NAME=VALUE, a further define of the traced build (repeatable)")
    ap.add_argument("--set", action="append", default=[],
                    help="NAME=VALUE, a launcher constant of cupy_kernels.ada_decode set while "
                         "measuring (a Python literal; repeatable), e.g. WAVES_V7=2")
    args = ap.parse_args(argv)
    args.define = dict(d.split("=", 1) for d in args.define)
    args.set = {k: ast.literal_eval(v) for k, v in (d.split("=", 1) for d in args.set)}
    if args.plot:
        with open(args.plot) as f:
            data = json.load(f)
        plot(data, args.png or os.path.splitext(args.plot)[0] + ".png")
        return 0
    data = measure(args)
    with open(args.out, "w") as f:
        json.dump(data, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
