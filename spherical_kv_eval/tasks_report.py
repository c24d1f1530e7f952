"""The reports of ``spherical-kv tasks``: one row per (task, context length, method) with its
accuracy and Wilson 95 % interval over the instances, the instance-paired exact tests against
dense and against the RDR point at no more bytes, ``tasks.md`` and ``tasks.png``."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import numpy as np

from spherical_kv_eval.reports import COLORS, MARKERS, NUDGE

PROTECTED = "+protect"      # name suffix of a method run with the planted items protected
DEPTH_TASKS = ("niah-single",)      # tasks whose needle sits at one of a few fixed depths
ALPHA = 0.05


def wilson(correct: int, n: int) -> Optional[list]:
    """The Wilson score 95 % interval [low, high] of ``correct`` successes in ``n``."""
    if n == 0:
        return None
    from scipy.stats import binomtest
    ci = binomtest(int(correct), int(n)).proportion_ci(1 - ALPHA, method="wilson")
    return [float(ci.low), float(ci.high)]


def paired_binary(x, y) -> Optional[dict]:
    """Two methods' outcomes (1 = correct) on the same instances, compared by McNemar's exact
    test: of the instances only one gets right (``only_a``, ``only_b``), the count of either
    is Binomial(only_a + only_b, 1/2) if neither method is better; ``p`` is its two-sided
    p-value. ``diff``: accuracy a − b; ``verdict`` of a's error against b's: "lower" or
    "higher" where p < 0.05, "tie" otherwise. None where the instances differ."""
    x, y = np.asarray(x, bool), np.asarray(y, bool)
    if x.size == 0 or x.shape != y.shape:
        return None
    only_a, only_b = int(np.sum(x & ~y)), int(np.sum(~x & y))
    p = 1.0
    if only_a + only_b:
        from scipy.stats import binomtest
        p = float(binomtest(only_a, only_a + only_b, 0.5).pvalue)
    diff = float(x.mean() - y.mean())
    verdict = "tie" if p >= ALPHA else ("lower" if diff > 0 else "higher")
    return {"diff": diff, "only_a": only_a, "only_b": only_b, "p": p, "verdict": verdict}


def task_rows(units, methods, tasks, lengths) -> list[dict]:
    """The rows of a run: per (context length, task) each method of ``methods`` (line-up
    entries; a name with ``PROTECTED`` where the units hold it) over the instances, with
    ``vs_dense`` and ``vs_rdr`` (``paired_binary`` of the method against dense-bf16 and
    against the unprotected RDR point with the most bytes not above its own)."""
    rows = []
    for T in lengths:
        for task in tasks:
            mine = sorted((u for u in units if u["T"] == T and u["task"] == task),
                          key=lambda u: u["index"])
            if not mine:
                continue
            here = []
            for m in methods:
                for name, protected in ((m.name, False), (m.name + PROTECTED, True)):
                    got = [u["methods"][name] for u in mine if name in u["methods"]]
                    if not got or len(got) < len(mine):
                        continue
                    outcomes = [int(r["correct"]) for r in got]
                    here.append({
                        "task": task, "context": int(T), "method": name, "family": m.family,
                        "protected": protected, "budget_fraction": m.budget,
                        "bytes_fraction": float(np.mean([r["bytes"] for r in got])),
                        "instances": len(got), "correct": int(sum(outcomes)),
                        "accuracy": float(np.mean(outcomes)),
                        "accuracy_ci95": wilson(sum(outcomes), len(got)),
                        "outcomes": outcomes, "depths": [u["depth"] for u in mine],
                        "outputs": [r["output"] for r in got]})
                    if task in DEPTH_TASKS:         # the accuracy at each depth of the needle
                        at = {}
                        for u, ok in zip(mine, outcomes):
                            at.setdefault(u["depth"], []).append(ok)
                        here[-1]["by_depth"] = {f"{d:g}": float(np.mean(v))
                                                for d, v in sorted(at.items())}
            dense = next((r for r in here if r["family"] == "dense"), None)
            rdr = sorted((r for r in here if r["family"] == "skv-rdr" and not r["protected"]),
                         key=lambda r: r["bytes_fraction"])
            for r in here:
                r["vs_dense"] = (paired_binary(r["outcomes"], dense["outcomes"])
                                 if dense is not None and r is not dense else None)
                r["vs_rdr"] = None
                if r["family"] not in ("dense", "skv-rdr"):
                    within = [a for a in rdr if a["bytes_fraction"] <= r["bytes_fraction"] + 1e-3]
                    if within:
                        # RDR against this baseline: "lower" = RDR's error is lower
                        p = paired_binary(within[-1]["outcomes"], r["outcomes"])
                        r["vs_rdr"] = dict(p, rdr=within[-1]["method"],
                                           rdr_bytes_fraction=within[-1]["bytes_fraction"])
            rows += here
    return rows


def _acc(r) -> str:
    lo, hi = r["accuracy_ci95"]
    return f"{r['accuracy']:.2f} [{lo:.2f}, {hi:.2f}]"


def _pair(p, lead="") -> str:
    if p is None:
        return "—"
    mark = "*tie*" if p["verdict"] == "tie" else f"**{p['verdict']}**"
    return f"{lead}{p['diff']:+.2f} (p {p['p']:.2g}) {mark}"


def write_task_reports(rows, meta, out: Path) -> list[Path]:
    """``tasks.json`` (rows and meta), ``tasks.md`` and ``tasks.png`` under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "tasks.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [f"# Long-context tasks — {meta['model']}, Jane Austen's novels as the haystack", "",
             f"{meta['instances']} instances per (task, length), seed {meta['seed']}; exact match "
             f"of the greedy answer; the question comes after compression. Run took "
             f"{meta['seconds']} s.", ""]
    for T in sorted({r["context"] for r in rows}):
        mine = [r for r in rows if r["context"] == T]
        tasks = list(dict.fromkeys(r["task"] for r in mine))
        lines += [f"## Context {T} tokens", "", "Dense bf16 first (a task dense fails says "
                  "nothing of the methods):", "", "| task | dense accuracy [95 % CI] |", "|---|---:|"]
        for task in tasks:
            d = next((r for r in mine if r["task"] == task and r["family"] == "dense"), None)
            lines.append(f"| {task} | {_acc(d) if d else '—'} |")
        lines.append("")
        for task in tasks:
            depth = task in DEPTH_TASKS
            lines += [f"### {task}", "", "| method | bytes % of bf16 | accuracy [95 % CI] | "
                      + ("by depth (depth: accuracy) | " if depth else "")
                      + "vs dense | vs RDR at ≤ bytes (RDR − method) |",
                      "|---|---:|---:|" + ("---|" if depth else "") + "---:|---|"]
            for r in sorted((r for r in mine if r["task"] == task),
                            key=lambda r: (r["family"] != "dense", -r["bytes_fraction"])):
                v = r["vs_rdr"]
                at = (", ".join(f"{float(d):.0%}: {a:.2f}" for d, a in r["by_depth"].items())
                      + " | ") if depth else ""
                lines.append(f"| {r['method']} | {100 * r['bytes_fraction']:.1f} | {_acc(r)} | "
                             f"{at}{_pair(r['vs_dense'])} | "
                             + (_pair(v, f"{v['rdr']}: ") if v else "—") + " |")
            lines.append("")
    lines += ["Accuracy: the share of instances whose greedy answer matches exactly, with its "
              "Wilson 95 % interval. *vs dense*: accuracy difference to dense-bf16 on the same "
              "instances and McNemar's exact p; **lower**/**higher** (the method's error against "
              "dense's) where p < 0.05, *tie* otherwise. *vs RDR*: the RDR point with the most "
              "bytes not above the method's, its accuracy minus the method's, the verdict of "
              f"RDR's error. `{PROTECTED}`: the planted items marked protected (not the default).",
              ""]
    (out / "tasks.md").write_text("\n".join(lines))
    plot_tasks(rows, out / "tasks.png")
    return [out / "tasks.json", out / "tasks.md", out / "tasks.png"]


def plot_tasks(rows, path: Path) -> None:
    """Accuracy against bytes, one panel per (context length, task): one line per method
    family (protected runs dotted), Wilson intervals as bars, dense as a horizontal line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    lengths = sorted({r["context"] for r in rows})
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    fig, axes = plt.subplots(len(lengths), len(tasks), figsize=(3.6 * len(tasks), 3.2 * len(lengths)),
                             squeeze=False, sharey=True)
    legend = {}
    for ax, (T, task) in zip(axes.flat, [(T, t) for T in lengths for t in tasks]):
        mine = [r for r in rows if r["context"] == T and r["task"] == task]
        fams = {}
        for r in mine:
            if r["family"] == "dense":
                line = ax.axhline(r["accuracy"], color="k", ls="--", lw=1.2, label="dense-bf16")
                legend.setdefault("dense-bf16", line)
                continue
            fams.setdefault(r["family"] + (" protected" if r["protected"] else ""), []).append(r)
        xs = []
        for i, (fam, rs) in enumerate(sorted(fams.items())):
            rs.sort(key=lambda r: r["bytes_fraction"])
            style = fam.split(" ")[0].removeprefix("kvpress-")
            # families at the same bytes shift a little sideways, so that none hides another
            shift = 1 + 2 * NUDGE * (2 * i / max(len(fams) - 1, 1) - 1)
            x = [100 * r["bytes_fraction"] * shift for r in rs]
            xs += x
            y = [r["accuracy"] for r in rs]
            err = [[v - r["accuracy_ci95"][0] for v, r in zip(y, rs)],
                   [r["accuracy_ci95"][1] - v for v, r in zip(y, rs)]]
            line = ax.errorbar(x, y, yerr=err, marker=MARKERS.get(style, "o"),
                               color=COLORS.get(style), ls=":" if "protected" in fam else "-",
                               lw=2 if style == "skv-rdr" else 1.2, capsize=2, mfc="none",
                               label=fam)
            legend.setdefault(fam, line)
        ax.set_xscale("log")
        if xs:
            lo, hi = min(xs) / 1.25, max(xs) * 1.25
            ticks = [t for t in (5, 10, 15, 20, 25, 30, 40, 50, 65, 80, 100) if lo <= t <= hi]
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set_xlim(lo, hi)
        ax.set_ylim(-0.05, 1.05)
        ax.set_title(f"{task}, {T} tokens", fontsize=10)
        ax.set_xlabel("cache bytes, % of bf16")
        ax.grid(True, which="both", alpha=0.3)
    for ax in axes[:, 0]:
        ax.set_ylabel("accuracy (exact match)")
    fig.tight_layout()
    names = sorted(legend, key=lambda n: (n != "dense-bf16", not n.startswith("skv-"), n))
    fig.legend([legend[n] for n in names], names, loc="center left", bbox_to_anchor=(1.0, 0.5),
               fontsize=9, frameon=False)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
