"""How much of RDR's greedy margin error is its attention estimate? An oracle experiment.

RDR decides what to keep and at which tier from an estimate of the attention later
queries will pay each state: by default the last 32 prefill queries (``OBSERVE``) mixed
with a 0.2 uniform prior. The queries that decide the greedy agreement are those of the
greedy run itself. This script gives RDR exactly those queries (every position of the
dense greedy run, recorded through the exact cache) as its observation window, which no
deployable cache can know, and measures the greedy margin error, the flip rate and the
greedy agreement against the default estimate, on the windows of the evaluation
(``--context``/``--windows`` pick the same windows as ``spherical_kv_eval.evaluate``). The
``last*`` and ``default-p*`` variants are deployable at the prefill: more of the trailing
prefill queries, other priors. ``lookahead*`` estimate from the first N greedy tokens'
queries (generated on the dense cache, then regenerated through the compressed one: partly
the oracle). ``defer*`` compress after the first N greedy tokens, from their queries, and
measure the G tokens after them (``spherical-kv evaluate --defer N`` for every method);
``defer64-est-default`` is their control (the same store, the prefill's estimate). Each row
carries the dense near-tie statistics of the windows it is measured on.

    python -m validation.greedy_oracle --windows 16 --budgets 0.20 0.25

Writes ``greedy_oracle.json`` (a row per variant and budget, per-window values kept) and
prints a table.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

from spherical_kv_eval import evaluate as E

VARIANTS = {   # name: (queries of the estimate, how many (None: all; prefill: the last N,
               # greedy: the first N), prior)
    "default": ("observed", E.OBSERVE, 0.2),     # the evaluation's RDR: last 32 prefill queries
    "oracle": ("greedy", None, 0.2),             # the greedy run's own queries
    "oracle-no-prior": ("greedy", None, 0.0),
    "last128": ("prefill", 128, 0.2),            # deployable: more trailing prefill queries
    "last512": ("prefill", 512, 0.2),
    "last512-p0.05": ("prefill", 512, 0.05),
    "last512-p0": ("prefill", 512, 0.0),
    "default-p0": ("observed", E.OBSERVE, 0.0),
    "default-p0.05": ("observed", E.OBSERVE, 0.05),
    # deployable at the cost of N dense decode steps before compressing: the queries of a
    # lookahead of N greedy tokens on the dense cache (the first N of the greedy run), the
    # lookahead's tokens then dropped and all G generated through the compressed cache
    "lookahead16": ("greedy", 16, 0.2),
    "lookahead16-p0": ("greedy", 16, 0.0),
    "lookahead32-p0": ("greedy", 32, 0.0),
    "lookahead32-p0.05": ("greedy", 32, 0.05),
    "lookahead64-p0": ("greedy", 64, 0.0),
    "default+lookahead16-p0": ("observed+greedy", 16, 0.0),
    "default+lookahead32-p0.05": ("observed+greedy", 32, 0.05),
    # deferred compression, deployable: the first N tokens are generated on the dense cache,
    # then the cache (context + those N) is compressed with their N queries as the estimate,
    # and the measured G tokens are the next ones (a window shifted by N; none of its queries
    # is in the estimate)
    "defer32": ("defer", 32, 0.2),
    "defer32-p0": ("defer", 32, 0.0),
    "defer32-p0.05": ("defer", 32, 0.05),
    "defer64": ("defer", 64, 0.2),
    "defer64-p0": ("defer", 64, 0.0),
    # control: the store of defer64 (context + 64 generated tokens), but the default estimate
    # (the last 32 queries of the prefill, before the generated tokens): how much of defer's
    # gain is the window it is measured on rather than its estimate
    "defer64-est-default": ("defer-observed", 64, 0.2),
}


def _unit(job) -> dict:
    """One window: dense prefill and greedy run, then every (variant, budget) store."""
    T, w, s, args, ids = job
    runner, cfg = E._WORKER["runner"], E._WORKER["cfg"]
    trailing = max((VARIANTS[v][1] for v in args.variants if VARIANTS[v][0] == "prefill"), default=0)
    defers = sorted({VARIANTS[v][1] for v in args.variants if VARIANTS[v][0].startswith("defer")})
    pre = runner.prefill(ids[s:s + T], trailing=trailing)
    ref, gaps = runner.greedy(E._exact_store(pre), pre, max([args.generate] + defers), margins=True)
    shifted = {}     # N: (prefill of the context + the first N dense greedy tokens, its greedy run)
    for n in defers:
        pre_n = runner.prefill(np.concatenate([ids[s:s + T], ref[:n]]), observe=n)
        shifted[n] = (pre_n, *runner.greedy(E._exact_store(pre_n), pre_n, args.generate, margins=True))
    ref, gaps = ref[:args.generate], gaps[:args.generate]
    rec = E._RecordingStore(E._exact_store(pre))
    runner.logprobs(rec, pre, ref)
    sources = {"observed": pre.queries,
               "greedy": [q[0] for _, q in sorted(rec.queries.items())]}  # (Hq, G - 1, d) per layer
    if trailing:
        sources["prefill"] = pre.trailing_queries
    out = {"w": w, "results": {}, "dense_gaps": {0: gaps, **{n: g for n, (_, _, g) in shifted.items()}}}
    for name in args.variants:
        source, count, prior = VARIANTS[name]
        p, r_ref, r_gaps = pre, ref, gaps
        if source.startswith("defer"):
            p, r_ref, r_gaps = shifted[count]
            queries = p.queries if source == "defer" else sources["observed"]
        elif source == "greedy":
            queries = [q[:, :count] for q in sources["greedy"]]
        elif source == "observed+greedy":
            queries = [np.concatenate([o, g[:, :count]], axis=1)
                       for o, g in zip(sources["observed"], sources["greedy"])]
        else:
            queries = [q[:, -count:] if count else q for q in sources[source]]
        policy = dataclasses.replace(E._rdr_policy(), prior=prior)   # its window: all the queries
        for b in args.budgets:
            store, nbytes = E._spherical_store(dataclasses.replace(p, queries=queries), cfg,
                                               E.TierLadder(), b * p.dense_bytes, policy=policy)
            r = E.greedy_on_dense_path(runner.logprobs(store, p, r_ref), r_ref, r_gaps)
            r["bytes"] = nbytes / p.dense_bytes
            out["results"][f"{name}@{round(b * 100)}%"] = r
    return out


def run(args) -> list[dict]:
    t0 = time.time()
    _, tok = E._main_setup(args.jobs)
    T = args.context
    units = E.run_windows(tok, args, _unit)
    units.sort(key=lambda u: u["w"])
    rows = []
    for key in units[0]["results"]:
        rs = [u["results"][key] for u in units]
        source, count, _ = VARIANTS[key.split("@")[0]]
        shift = count if source.startswith("defer") else 0
        rows.append({"variant": key.split("@")[0], "budget_fraction": float(key.split("@")[1][:-1]) / 100,
                     "context": T, "windows": len(rs),
                     "bytes_fraction": float(np.mean([r["bytes"] for r in rs])),
                     "greedy_agreement": float(np.mean([r["agree"] for r in rs])),
                     "greedy_agreement_windows": [r["agree"] for r in rs],
                     "greedy_token_agreement": float(np.mean([r["tokens"] for r in rs])),
                     "greedy_margin_err": float(np.mean([r["margin_err"] for r in rs])),
                     "greedy_margin_err_windows": [r["margin_err"] for r in rs],
                     # how near the dense greedy runs the variant is measured on come to ties
                     "dense_gaps": E._gap_summary(np.concatenate([u["dense_gaps"][shift] for u in units]))})
    print(f"{len(units)} windows in {time.time() - t0:.0f} s", file=sys.stderr)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--first", type=int, default=None,
                   help="only the first N of the --windows windows (same windows, less time)")
    p.add_argument("--budgets", type=float, nargs="+", default=[0.20])
    p.add_argument("--continuation", type=int, default=256, help="as in spherical-kv evaluate (window spacing)")
    p.add_argument("--generate", type=int, default=128)
    p.add_argument("--variants", nargs="+", default=["default", "oracle", "oracle-no-prior"],
                   choices=sorted(VARIANTS))
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "evaluation" / "greedy_oracle.json")
    args = p.parse_args(argv)
    rows = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1) + "\n")
    print("| RDR estimate | budget | bytes % | margin err | flips (1 − greedy tokens) | greedy agree |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['variant']} | {100 * r['budget_fraction']:.0f} % | {100 * r['bytes_fraction']:.1f} | "
              f"{r['greedy_margin_err']:.4f} | {100 * (1 - r['greedy_token_agreement']):.2f} % | "
              f"{r['greedy_agreement']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
