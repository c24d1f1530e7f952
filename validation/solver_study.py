"""RDR solver study over the regimes (docs/rdr.md §4, §6): the fast solver against the exact
MILP (HiGHS), and the fast solver's reported gap against its true gap.

    python -m validation.solver_study [--quick] [--milp-limit S] [--report-only]

Writes validation/results/rdr/solver_study.{json,md,png}. Regimes: states per group 50 to
10^5, page bytes 1–16 KiB, groups 1–256, budgets 5–50 % of the top-tier bytes; one axis
varied at a time around a base case, plus corners. Instances (:func:`study_problem`):
lognormal attention weights, the example ladder (5 tiers + evict), 5 % of the states
protected at random, per-group query norms and eviction factors. The MILP gets
mip_rel_gap 1e-6 and a time limit (default 30 s); whether it proved its answer is recorded.
Where the MILP does not prove and fast skipped its page-aware search for the instance's size,
fast is run once more with that search (:func:`fast_with_step6`) to pin the true gap.
The speed target is measured in the same run: fast on 10^6 states × 6 options (256
groups) against one numpy argsort of 6·10^6 float64 (interleaved, best of 5 each).
"""
import argparse
import json
import os
import platform
import time

import numpy as np
from tqdm import tqdm

from spherical_kv_ref import rdr
from spherical_kv_ref.rdr import greedy as rdr_fast
from spherical_kv_ref.rdr.synthetic import EXAMPLE_ERROR, EXAMPLE_LADDER, _example_bytes

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "rdr")
COMMAND = "python -m validation.solver_study"
DIM = 128


def study_problem(per_group, groups, page_bytes, budget_fraction, seed=0):
    """A surrogate-shaped instance: lognormal attention per group, lognormal radii and value
    norms, 5 % protected at random; budget = budget_fraction of every state at the top tier
    (raised to what the protected states need, if more)."""
    rng = np.random.default_rng([per_group, groups, page_bytes, int(budget_fraction * 1000), seed])
    n = per_group * groups
    group = np.repeat(np.arange(groups), per_group)
    p = rng.lognormal(0.0, 1.5, n)
    p /= np.bincount(group, weights=p)[group]
    q2 = DIM * rng.lognormal(0.0, 0.5, groups)[group]
    r = rng.lognormal(np.log(np.sqrt(DIM)), 0.3, n)
    vn = rng.lognormal(0.0, 0.4, n)
    res = vn * rng.uniform(0.5, 1.5, n)
    ek, ev = rdr.tier_error_constants(EXAMPLE_LADDER, DIM, error=EXAMPLE_ERROR)
    kappa = 1.0 + rng.lognormal(1.0, 0.5, groups)[group]
    d = rdr.distortion(p, q2, r, vn, res, ek, ev, DIM, eviction_factor=kappa)
    cost = np.array([0] + [_example_bytes(kb, DIM) + _example_bytes(vb, DIM)
                           for kb, vb in EXAMPLE_LADDER])
    protected = rng.random(n) < 0.05
    budget = int(budget_fraction * n * cost[-1])
    need = rdr.Problem(d, cost, group, protected, 10**18, page_bytes).protected_bytes
    return rdr.Problem(d, cost, group, protected, max(budget, need), page_bytes)


BASE = (500, 16, 4096, 0.20)


def regimes(quick):
    """(states per group, groups, page bytes, budget fraction), one axis at a time + corners."""
    s, g, pb, b = BASE
    rows = [BASE]
    rows += [(x, g, pb, b) for x in (50, 200, 2000, 10_000)]
    rows += [(100_000, 1, pb, b)]
    rows += [(s, g, x, b) for x in (1024, 16384)]
    rows += [(200, x, pb, b) for x in (1, 4, 64, 256)]
    rows += [(s, g, pb, x) for x in (0.05, 0.10, 0.35, 0.50)]
    rows += [(50, 256, 16384, 0.50), (1000, 4, 16384, 0.05), (5000, 4, 1024, 0.05),
             (100, 64, 1024, 0.20), (2000, 8, 16384, 0.20), (166, 24, 4096, 0.20),
             (166, 24, 1024, 0.20)]
    if quick:
        rows = [r for r in rows if r[0] * r[1] <= 20_000][:8]
    return rows


def fast_with_step6(p):
    """fast with its page-aware search (step 6) run whatever the instance's size. The
    library skips the step above ``max_search_work`` (default 1e7) for time; this lab run
    (tens of seconds there) gives the proven bound and the answer that pin the true gap of
    the library's answer where HiGHS proves nothing."""
    return rdr.solve(p, "fast", max_search_work=np.inf)


def study_row(per_group, groups, page_bytes, budget_fraction, milp_limit):
    p = study_problem(per_group, groups, page_bytes, budget_fraction)
    t = time.perf_counter()
    fast = rdr.solve(p, "fast")
    t_fast = time.perf_counter() - t
    t = time.perf_counter()
    exact = rdr.solve(p, "milp", time_limit=milp_limit, mip_rel_gap=1e-6)
    t_milp = time.perf_counter() - t
    best = min(exact.objective, fast.objective)
    bound = max(exact.lower_bound, fast.lower_bound)
    ref = ref_s = None
    skipped = (fast.gap > rdr_fast.SEARCH_GAP and
               not rdr_fast.search_fits(int((~p.protected).sum())))
    if skipped and not exact.optimal:
        t = time.perf_counter()
        ref = fast_with_step6(p)
        ref_s = time.perf_counter() - t
        best, bound = min(best, ref.objective), max(bound, ref.lower_bound)
    obj = fast.objective
    return {"states_per_group": per_group, "groups": groups, "page_bytes": page_bytes,
            "budget_fraction": budget_fraction, "states": p.n,
            "pages_per_group": p.budget_bytes / p.page_bytes / groups,
            "fast_objective": obj, "fast_lower_bound": fast.lower_bound,
            "fast_reported_gap": fast.gap, "fast_s": t_fast,
            "milp_objective": exact.objective, "milp_lower_bound": exact.lower_bound,
            "milp_proven": bool(exact.optimal), "milp_s": t_milp,
            "step6_skipped": bool(skipped),
            "ref_objective": None if ref is None else ref.objective,
            "ref_lower_bound": None if ref is None else ref.lower_bound, "ref_s": ref_s,
            "fast_vs_milp": (obj - exact.objective) / exact.objective if exact.objective else 0.0,
            # the true gap (obj − optimum)/obj lies between these; equal when milp proves (or
            # the reference run does)
            "true_gap_low": (obj - best) / obj if obj else 0.0,
            "true_gap_high": (obj - bound) / obj if obj else 0.0}


def timing(repeat=5):
    """fast on 10^6 states × 6 options against one argsort of 6·10^6 float64: the two runs
    interleaved, best of ``repeat`` each (the machine is shared; the best is the least
    disturbed)."""
    p = rdr.synthetic_problem(10**6, num_groups=256)
    keys = np.random.default_rng(0).random(p.n * p.num_options)
    fast = sort = np.inf
    for _ in range(repeat):
        t = time.perf_counter()
        rdr.solve(p, "fast")
        fast = min(fast, time.perf_counter() - t)
        t = time.perf_counter()
        np.argsort(keys)
        sort = min(sort, time.perf_counter() - t)
    return {"states": p.n, "options": p.num_options, "groups": p.num_groups,
            "page_bytes": p.page_bytes, "fast_s": fast, "argsort_s": sort, "ratio": fast / sort,
            "repeat": repeat, "fast_reported_gap": rdr.solve(p).gap}


#: where the targets apply and how they are read: fast within 0.5 % of the MILP's best
#: objective; its reported gap at most twice the true gap, with a floor of 1e-4 (a true gap
#: of 0 asks a reported gap below 0.01 %, not exactly 0). The true gap is known only as an
#: interval unless the MILP proves: "yes" when the reported gap is within 2× of the
#: interval's low end (so of any true gap in it), "undetermined" otherwise
TARGET_PAGES, TARGET_REL, GAP_FACTOR, GAP_FLOOR = 2.0, 0.005, 2.0, 1e-4


def verdict(r):
    """(objective target, certificate target) of a row, or n/a below TARGET_PAGES."""
    if r["pages_per_group"] < TARGET_PAGES:
        return "n/a", "n/a"
    obj = "yes" if r["fast_vs_milp"] <= TARGET_REL else "no"
    if r["fast_reported_gap"] <= GAP_FACTOR * r["true_gap_low"] + GAP_FLOOR:
        gap = "yes"
    elif r["fast_reported_gap"] > GAP_FACTOR * r["true_gap_high"] + GAP_FLOOR:
        gap = "no"
    else:
        gap = "undetermined"
    return obj, gap


def write(rows, speed, args):
    os.makedirs(OUT, exist_ok=True)
    meta = {"command": COMMAND + (" --quick" if args.quick else ""), "milp_limit_s": args.milp_limit,
            "cpus": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__}
    with open(os.path.join(OUT, "solver_study.json"), "w") as f:
        json.dump({"meta": meta, "timing": speed, "rows": rows}, f, indent=1)
    lines = ["# RDR solver study: fast vs MILP over the regimes", "",
             f"Written by `{meta['command']}` ({os.cpu_count()} CPU cores; HiGHS mip_rel_gap 1e-6, "
             f"time limit {args.milp_limit} s). Instances: `validation.solver_study.study_problem` "
             "(lognormal attention, 5 tiers + evict, 5 % protected at random). *pages/group*: "
             "the budget in pages per group. *true gap*: (fast − optimum)/fast, an interval "
             "[fast vs the best objective known, fast vs the best bound known] when the MILP "
             "does not prove; *known from*: where fast skipped step 6 for its size and the "
             "MILP did not prove, fast was also run with step 6 (`fast_with_step6`, time in "
             "brackets), and its answer and bound enter the best known. Targets, where pages/group ≥ 2: *objective*: fast within 0.5 % "
             "of the MILP's best; *certificate*: reported gap ≤ 2 × true gap + 0.01 % — yes "
             "when that holds for the interval's low end, undetermined when only the MILP's "
             "unproven bound could decide.", ""]
    if speed:
        lines += ["## Speed target (≤ 3× one argsort of n·(T+1) float64)", "",
                  "| states | options | groups | fast (s) | argsort (s) | ratio | fast reported gap |",
                  "|---:|---:|---:|---:|---:|---:|---:|",
                  f"| {speed['states']} | {speed['options']} | {speed['groups']} | "
                  f"{speed['fast_s']:.3f} | {speed['argsort_s']:.3f} | {speed['ratio']:.2f} | "
                  f"{speed['fast_reported_gap']:.2e} |", ""]
    lines += ["## Regimes", "",
              "| states/group | groups | page | budget | pages/group | fast (s) | milp (s) | "
              "milp proven | fast vs milp | fast reported gap | true gap | known from | "
              "objective | certificate |",
              "|---:|---:|---:|---:|---:|---:|---:|:---:|---:|---:|---:|:---:|:---:|:---:|"]
    for r in rows:
        closed = r["true_gap_high"] - r["true_gap_low"] <= 1e-9
        tg = (f"{100 * r['true_gap_low']:.3f} %" if r["milp_proven"] or closed else
              f"{100 * r['true_gap_low']:.3f}–{100 * r['true_gap_high']:.3f} %")
        known = ("milp, fast" if r.get("ref_s") is None else
                 f"milp, fast, step 6 ({r['ref_s']:.0f} s)")
        lines.append(
            f"| {r['states_per_group']} | {r['groups']} | {r['page_bytes'] // 1024} KiB | "
            f"{100 * r['budget_fraction']:.0f} % | {r['pages_per_group']:.1f} | {r['fast_s']:.2f} | "
            f"{r['milp_s']:.1f} | {'yes' if r['milp_proven'] else 'no'} | "
            f"{100 * r['fast_vs_milp']:+.3f} % | {100 * r['fast_reported_gap']:.3f} % | {tg} | "
            f"{known} | "
            f"{' | '.join(verdict(r))} |")
    lines.append("")
    with open(os.path.join(OUT, "solver_study.md"), "w") as f:
        f.write("\n".join(lines))
    plot(rows)
    return "\n".join(lines)


def plot(rows):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    ppg = np.array([r["pages_per_group"] for r in rows])
    rel = np.array([r["fast_vs_milp"] for r in rows])
    proven = np.array([r["milp_proven"] for r in rows])
    floor = 1e-7
    for mask, mk, lab in ((proven, "o", "milp proven"), (~proven, "^", "milp not proven")):
        a.scatter(ppg[mask], np.maximum(rel[mask], floor), marker=mk, label=lab)
    a.axhline(TARGET_REL, color="r", ls="--", lw=1, label="0.5 % target")
    a.axvline(TARGET_PAGES, color="grey", ls=":", lw=1)
    a.set(xscale="log", yscale="log", xlabel="budget in pages per group",
          ylabel=f"(fast − milp) / milp (floored at {floor:g})", title="fast vs MILP objective")
    a.legend(fontsize=8)
    rep = np.maximum([r["fast_reported_gap"] for r in rows], floor)
    lo = np.maximum([r["true_gap_low"] for r in rows], floor)
    hi = np.maximum([r["true_gap_high"] for r in rows], floor)
    b.hlines(rep, lo, hi, color="grey", lw=1)          # the true gap's interval, where open
    b.scatter(lo, rep, c=np.log10(ppg), cmap="viridis", zorder=3)
    lim = np.array([floor, 1.0])
    b.plot(lim, lim, "k-", lw=0.8, label="reported = true")
    b.plot(lim, GAP_FACTOR * lim + GAP_FLOOR, "r--", lw=0.8, label="2 × true + 0.01 % (target)")
    b.set(xscale="log", yscale="log", xlabel=f"true gap, low end (line: to the high end; "
          f"floored at {floor:g})", ylabel="fast's reported gap",
          title="certificate (colour: log10 pages/group)")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(OUT, "solver_study.png"), dpi=110)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small regimes only, no 10^6 timing")
    ap.add_argument("--milp-limit", type=float, default=30.0, help="HiGHS time limit (s)")
    ap.add_argument("--report-only", action="store_true",
                    help="rewrite the markdown and the picture from the last run's JSON")
    args = ap.parse_args()
    if args.report_only:
        with open(os.path.join(OUT, "solver_study.json")) as f:
            last = json.load(f)
        args.quick = last["meta"]["command"].endswith("--quick")
        args.milp_limit = last["meta"]["milp_limit_s"]
        print(write(last["rows"], last["timing"], args))
        return
    rdr.solve(study_problem(50, 2, 4096, 0.2))          # compile the numba kernels
    speed = None if args.quick else timing()
    if speed:
        print(f"speed: fast {speed['fast_s']:.3f} s, argsort {speed['argsort_s']:.3f} s, "
              f"ratio {speed['ratio']:.2f}", flush=True)
    rows = []
    for reg in tqdm(regimes(args.quick), desc="regimes"):
        rows.append(study_row(*reg, milp_limit=args.milp_limit))
        r = rows[-1]
        tqdm.write(f"{reg}: fast vs milp {100 * r['fast_vs_milp']:+.3f} %, reported gap "
                   f"{100 * r['fast_reported_gap']:.3f} %, milp proven {r['milp_proven']}, "
                   f"fast {r['fast_s']:.2f} s, milp {r['milp_s']:.1f} s")
    print(write(rows, speed, args))


if __name__ == "__main__":
    main()
