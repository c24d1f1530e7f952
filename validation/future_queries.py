"""RDR's estimate of the queries to come: the last N recorded queries as they are, against
the same queries carried through RoPE to the next H decode positions (``CompressPolicy.horizon``,
``rdr.statistics.future_queries``), after-prefill protocol (compress right after the prefill).

Per window of ``spherical_kv_eval.evaluate`` (same windows for a ``--context``/``--windows``):
one dense prefill, the dense scoring pass over the next ``--continuation`` tokens and the
dense greedy run of ``--generate`` tokens; then every (variant, budget) RDR store, and fp8
e4m3 (50 % of the bytes, the greedy target's reference), scored on the same tokens: ΔPPL
of the continuation and the greedy margin error along the dense greedy path
(``evaluate.greedy_on_dense_path``). Every figure carries its 95 % CI over windows
(Student t); every comparison the window-paired difference's CI.

    python -m validation.future_queries --context 2048 --windows 16 --budgets 0.10 0.20 \\
        --horizons 0 128 512

Writes ``future_queries.json`` (per-window values kept) and ``future_queries.md``.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

from spherical_kv_eval import evaluate as E


def ci95(x) -> tuple[float, float]:
    """(mean, half-width of the 95 % Student-t interval, ``evaluate.ci95``; NaN below two
    windows) of per-window values."""
    x = np.asarray(x, dtype=np.float64)
    half = E.ci95(x)
    return float(x.mean()), float("nan") if half is None else half


def _variant(h: int) -> str:
    return "last32" if h == 0 else f"rope{h}"


def _unit(job) -> dict:
    T, w, s, args, ids = job
    runner, cfg = E._WORKER["runner"], E._WORKER["cfg"]
    ctx, cont = ids[s:s + T], ids[s + T:s + T + args.continuation]
    pre = runner.prefill(ctx)
    dense_lp = runner.logprobs(E._exact_store(pre), pre, cont)
    dense_nll = float(-dense_lp[np.arange(len(cont)), cont].mean())
    ref, gaps = runner.greedy(E._exact_store(pre), pre, args.generate, margins=True)
    builds = {}
    for h in args.horizons:
        policy = dataclasses.replace(E._rdr_policy(), horizon=h)
        for b in args.budgets:
            builds[f"{_variant(h)}@{round(b * 100)}%"] = (
                lambda pre, b=b, policy=policy: E._spherical_store(pre, cfg, E.TierLadder(),
                                                                   b * pre.dense_bytes, policy=policy))
    fp8 = next(m for m in E.lineup(cfg, [0.5], peers=False) if m.name.startswith("fp8"))
    builds["fp8-e4m3@50%"] = fp8.build
    out = {"w": w, "dense_nll": dense_nll, "gaps": [float(g) for g in gaps], "results": {}}
    for name, build in builds.items():
        store, nbytes = build(pre)
        fresh = copy.deepcopy(store)                   # scoring appends to the store
        lp = runner.logprobs(store, pre, cont)
        r = E.greedy_on_dense_path(runner.logprobs(fresh, pre, ref), ref, gaps)
        r["nll"] = float(-lp[np.arange(len(cont)), cont].mean())
        r["kl"] = float(np.mean(np.sum(np.exp(dense_lp) * (dense_lp - lp), axis=1)))
        r["bytes"] = nbytes / pre.dense_bytes
        out["results"][name] = r
    return out


def summarise(units) -> list[dict]:
    units = sorted(units, key=lambda u: u["w"])
    dense = np.array([u["dense_nll"] for u in units])
    rows = []
    for name in units[0]["results"]:
        rs = [u["results"][name] for u in units]
        dppl = (np.exp(np.array([r["nll"] for r in rs]) - dense) - 1) * 100
        me = np.array([r["margin_err"] for r in rs])
        rows.append({"method": name, "windows": len(rs),
                     "bytes_fraction": float(np.mean([r["bytes"] for r in rs])),
                     "delta_ppl_pct": ci95(dppl), "delta_ppl_windows": dppl.tolist(),
                     "greedy_margin_err": ci95(me), "greedy_margin_err_windows": me.tolist(),
                     "kl_nats": ci95([r["kl"] for r in rs]),
                     "greedy_token_agreement": ci95([r["tokens"] for r in rs]),
                     "greedy_agreement": ci95([r["agree"] for r in rs])})
    return rows


def paired(rows, a: str, b: str) -> dict:
    """a − b, paired by window (``evaluate.paired_difference``): ΔPPL and margin error, as
    (mean, 95 % CI half-width), and each one's verdict under ``verdicts``."""
    ra = next(r for r in rows if r["method"] == a)
    rb = next(r for r in rows if r["method"] == b)
    out = {"a": a, "b": b, "verdicts": {}}
    for k, key in (("delta_ppl", "delta_ppl_pct"), ("greedy_margin_err", "greedy_margin_err")):
        p = E.paired_difference(ra, rb, key)
        out[k] = (p["diff"], float("nan") if p["ci95"] is None else p["ci95"])
        out["verdicts"][k] = p["verdict"]
    return out


def _fmt(m_h, digits) -> str:
    m, h = m_h
    return f"{m:.{digits}f} ± {h:.{digits}f}"


def report(rows, comparisons, meta) -> str:
    lines = [f"RDR's future-query estimate, after-prefill protocol: SmolLM2-135M-Instruct, "
             f"{meta['context']}-token contexts, {meta['windows']} windows, ΔPPL of the next "
             f"{meta['continuation']} tokens, margin error along {meta['generate']} dense greedy "
             f"tokens; mean ± 95 % CI over windows. `python -m validation.future_queries "
             f"{' '.join(meta['argv'])}` ({meta['seconds']:.0f} s, {meta['machine']}).", "",
             "| method | bytes % | ΔPPL % | KL nats | margin err | greedy tokens | greedy agree |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['method']} | {100 * r['bytes_fraction']:.1f} | {_fmt(r['delta_ppl_pct'], 2)} | "
                     f"{_fmt(r['kl_nats'], 4)} | {_fmt(r['greedy_margin_err'], 4)} | "
                     f"{_fmt(r['greedy_token_agreement'], 3)} | {_fmt(r['greedy_agreement'], 3)} |")
    lines += ["", "Window-paired differences (a − b, mean ± 95 % CI; 'tie' where the CI holds 0):", "",
              "| a | b | ΔPPL diff (pp) | margin err diff |", "|---|---|---:|---:|"]
    for c in comparisons:
        v = c["verdicts"]
        lines.append(f"| {c['a']} | {c['b']} | {_fmt(c['delta_ppl'], 2)} ({v['delta_ppl']}) | "
                     f"{_fmt(c['greedy_margin_err'], 4)} ({v['greedy_margin_err']}) |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--first", type=int, default=None, help="only the first N of the windows")
    p.add_argument("--budgets", type=float, nargs="+", default=[0.10, 0.20])
    p.add_argument("--horizons", type=int, nargs="+", default=[0, 128, 512],
                   help="CompressPolicy.horizon of each RDR variant (0: the last-N queries as recorded)")
    p.add_argument("--continuation", type=int, default=256)
    p.add_argument("--generate", type=int, default=128)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--machine", default="2-core CPU machine")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "evaluation"
                   / "future_queries")
    args = p.parse_args(argv)
    t0 = time.time()
    _, tok = E._main_setup(args.jobs)
    T = args.context
    units = E.run_windows(tok, args, _unit)
    rows = summarise(units)
    base = _variant(0)
    comparisons = []
    for b in args.budgets:
        tag = f"@{round(b * 100)}%"
        for h in args.horizons:
            if h and base in [_variant(x) for x in args.horizons]:
                comparisons.append(paired(rows, _variant(h) + tag, base + tag))
    for r in rows:
        if r["method"] != "fp8-e4m3@50%" and r["bytes_fraction"] <= 0.2 + 1e-9:
            comparisons.append(paired(rows, r["method"], "fp8-e4m3@50%"))
    gaps = np.concatenate([u["gaps"] for u in units])
    meta = {"context": T, "windows": len(units), "continuation": args.continuation,
            "generate": args.generate, "argv": argv, "seconds": time.time() - t0,
            "machine": args.machine, "processes": args.jobs, "dense_greedy_gaps": E._gap_summary(gaps)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "future_queries.json").write_text(json.dumps(
        {"meta": meta, "rows": rows, "comparisons": comparisons}, indent=1) + "\n")
    text = report(rows, comparisons, meta)
    (args.out / "future_queries.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
