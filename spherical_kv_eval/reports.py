"""The evaluation's reports: ``evaluate.json``, ``evaluate_meta.json``, the tables of
``evaluate.md`` (with the window-paired differences) and the figures ``pareto.png`` and
``greedy.png``."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import numpy as np

def write_reports(rows, meta, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "evaluate.json").write_text(json.dumps(rows, indent=1) + "\n")
    (out / "evaluate_meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    corpus = ("Jane Austen's novels" if meta["corpus"].startswith("debian:")
              else f"fallback text ({meta['corpus']})")
    lines = [f"# Spherical KV vs baselines — {meta['model']}, {corpus}",
             "", f"Next {meta['continuation']} tokens scored; greedy {meta['generate']} tokens"
             + (f" after {meta['defer']} generated on the dense cache (compression deferred to then)"
                if meta.get("defer") else "") + "; "
             f"probe of {meta['probe_tokens']} planted tokens; " + _time_line(meta), ""]
    for T in sorted({r["context"] for r in rows}):
        lines += [f"## Context {T} tokens", ""]
        mine = [r for r in rows if r["context"] == T]
        share = max((r.get("window_bytes_fraction") or 0.0) for r in mine)
        if share:
            lay = meta.get("layers", {})
            lines += [f"Sliding-window layers {lay.get('sliding_attention')} hold "
                      f"{100 * share:.1f} % of the dense cache (their windows, "
                      + ("at bf16" if lay.get("window_bits", 16) >= 16 else
                         f"in the {lay['window_bits']}-bit spherical code") +
                      f" in every method); every budget and bytes % is of the whole cache, the windows' "
                      f"bytes taken off first; the full-attention layers "
                      f"{lay.get('full_attention')} get the rest." +
                      (f" Budgets the windows alone exceed: "
                       f"{', '.join(meta['infeasible'][str(T)])}." if str(T) in meta.get("infeasible", {}) else ""),
                      ""]
        head = ["method", "bytes % of bf16"] + (["full-attn layers %"] if share else []) + [
            "ΔPPL %", "spread", "KL (nats)", "top-1 agree", "retrieval loss", "protected",
            "greedy agree", "greedy tokens", "margin err", "attn err"]
        lines += ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
        for r in sorted(mine, key=lambda r: -r["bytes_fraction"]):
            store = [f"{100 * r['store_bytes_fraction']:.1f}"] if share else []
            cells = [r["method"], f"{100 * r['bytes_fraction']:.1f}"] + store + [
                _with_ci(r["delta_ppl_pct"], r.get("delta_ppl_ci95"), 2),
                f"{r['delta_ppl_spread']:.2f}",
                _with_ci(r["kl_nats"], r.get("kl_nats_ci95"), 4),
                _with_ci(r["top1_agreement"], r.get("top1_agreement_ci95"), 3),
                _with_ci(r["retrieval_loss"], None, 3),
                _with_ci(r["retrieval_loss_protected"], None, 3),
                _with_ci(r["greedy_agreement"], r.get("greedy_agreement_ci95"), 2),
                _with_ci(r["greedy_token_agreement"], r.get("greedy_token_agreement_ci95"), 3),
                _with_ci(r.get("greedy_margin_err"), r.get("greedy_margin_err_ci95"), 4),
                _with_ci(r["attn_out_rel_err"], r.get("attn_out_rel_err_ci95"), 3)]
            lines.append("| " + " | ".join(cells) + " |")
        lines += ["", f"± : half-width of the 95 % confidence interval of the mean over the "
                      f"{mine[0]['windows']} windows (Student's t)"
                      + ("; the retrieval probe is one planted context per length, so it has none"
                         if any(r["retrieval_loss"] is not None for r in mine) else "") + ".", ""]
        pairs = rdr_against_baselines(mine)
        if pairs:
            lines += ["Each baseline point against the RDR point (10-50 % budgets) with the most "
                      "bytes not above its own: the difference RDR − baseline, paired by window, "
                      "with its 95 % CI; **lower** / **higher**: the CI excludes 0, *tie*: it "
                      "holds 0.", "",
                      "| baseline | bytes % | RDR point | bytes % | ΔPPL % | KL (nats) | margin err | "
                      "ΔPPL lower in |",
                      "|---|---:|---|---:|---:|---:|---:|---:|"]
            for p in pairs:
                a, b = p["rdr"], p["baseline"]
                cells = [_paired_cell(p["by_metric"][k], digits)
                         for k, digits in (("delta_ppl_pct", 2), ("kl_nats", 4),
                                           ("greedy_margin_err", 4))]
                lines.append(f"| {b['method']} | {100 * b['bytes_fraction']:.1f} | {a['method']} | "
                             f"{100 * a['bytes_fraction']:.1f} | " + " | ".join(cells)
                             + f" | {p['lower']}/{p['windows']} |")
            lines.append("")
            for key, label in (("delta_ppl_pct", "ΔPPL"), ("kl_nats", "KL"),
                               ("greedy_margin_err", "margin error")):
                v = [p["by_metric"][key]["verdict"] for p in pairs if p["by_metric"][key]]
                if v:
                    lines.append(f"{label}: RDR lower by the CI than {v.count('lower')} of the "
                                 f"{len(v)} baseline points, tied with {v.count('tie')}, higher "
                                 f"than {v.count('higher')}.")
            lines.append("")
        target = greedy_target(mine)
        if target is not None:
            lines += [f"Greedy target (after-prefill protocol): {target['rdr']}'s margin error "
                      f"{target['rdr_value']:.4f} against {target['fp8']}'s {target['fp8_value']:.4f}; "
                      f"difference {_paired_cell(target, 4)}: "
                      + ("met" if target["met"] else "not met")
                      + (" (the CI holds 0)" if target["verdict"] == "tie" else "") + ".", ""]
    (out / "evaluate.md").write_text("\n".join(lines))
    plot_reports(rows, out)


def _time_line(meta) -> str:
    """How long the run took: this command's seconds, and for a run resumed from earlier
    parts the units' own seconds (summed over the worker processes) too."""
    if not meta.get("units_resumed"):
        return f"run took {meta['seconds']} s."
    return (f"the units took {meta.get('unit_seconds')} s of worker time in all (this command "
            f"{meta['seconds']} s; {meta['units_resumed']} units came from earlier parts of the run).")


def _with_ci(value, half, digits: int) -> str:
    """A table cell: ``value`` with ``± half`` (its 95 % CI) where there is one."""
    if value is None:
        return "—"
    return f"{value:.{digits}f}" + ("" if half is None else f" ± {half:.{digits}f}")


def _paired_cell(p: Optional[dict], digits: int) -> str:
    """A paired difference as ``+0.12 ± 0.05 **lower**`` (bold where the CI excludes 0)."""
    if p is None:
        return "—"
    if p["ci95"] is None:
        return f"{p['diff']:+.{digits}f}"
    mark = {"tie": "*tie*"}.get(p["verdict"], f"**{p['verdict']}**")
    return f"{p['diff']:+.{digits}f} ± {p['ci95']:.{digits}f} {mark}"


# the per-window figures a claim is paired on: (row key of the mean, row key of the windows)
PAIRED = (("delta_ppl_pct", "delta_ppl_windows"), ("kl_nats", "kl_windows"),
          ("greedy_margin_err", "greedy_margin_err_windows"))


def paired_difference(a: dict, b: dict, key: str) -> Optional[dict]:
    """Row ``a`` − row ``b`` on ``key`` (one of ``PAIRED``), paired by window: mean, standard
    error, 95 % CI half-width, the windows where ``a`` is lower, and the verdict: "lower"
    or "higher" where the CI excludes 0, "tie" where it holds 0. None where either row
    lacks that figure's per-window values (older runs, no greedy run)."""
    windows = dict(PAIRED)[key]
    x, y = a.get(windows), b.get(windows)
    if not x or not y or len(x) != len(y):
        return None
    d = np.asarray(x, float) - np.asarray(y, float)
    half = ci95(d)
    verdict = ("—" if half is None else "lower" if d.mean() + half < 0
               else "higher" if d.mean() - half > 0 else "tie")
    return {"diff": float(d.mean()), "windows": len(d), "ci95": half, "verdict": verdict,
            "se": float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else float("nan"),
            "lower": int(np.sum(d < 0))}


def rdr_against_baselines(rows) -> list[dict]:
    """The claim "RDR below every baseline at the same or more bytes", point by point for one
    context length: each baseline point (neither RDR nor dense) against the RDR point of the
    10-50 % budgets with the most bytes not above its own, with the window-paired
    differences RDR − baseline of ΔPPL (the top-level ``diff``, ``se``, ``ci95``, ``lower``,
    ``verdict``), of KL and of the greedy margin error (``by_metric``, ``paired_difference``).
    Rows without per-window ΔPPLs (older runs) give nothing."""
    rdr = sorted((r for r in rows if r["family"] == "skv-rdr" and "delta_ppl_windows" in r
                  and 0.1 - 1e-9 <= (r["budget_fraction"] or 0) <= 0.5 + 1e-9),
                 key=lambda r: r["bytes_fraction"])
    out = []
    for b in sorted(rows, key=lambda r: -r["bytes_fraction"]):
        if b["family"] in ("skv-rdr", "dense") or "delta_ppl_windows" not in b:
            continue
        within = [a for a in rdr if a["bytes_fraction"] <= b["bytes_fraction"] + 1e-3]
        if not within:
            continue
        a = within[-1]
        by_metric = {k: paired_difference(a, b, k) for k, _ in PAIRED}
        if by_metric["delta_ppl_pct"] is None:
            continue
        out.append(dict(by_metric["delta_ppl_pct"], rdr=a, baseline=b, by_metric=by_metric))
    return out


def greedy_target(rows) -> Optional[dict]:
    """The greedy target for one context length: RDR's greedy margin error at the
    largest RDR point within 20 % of the bytes against fp8-e4m3's (50 %), paired by window.
    ``met``: the mean difference is ≤ 0; ``verdict``: what its 95 % CI says. None without
    both points or without a greedy run."""
    rdr = [r for r in rows if r["family"] == "skv-rdr" and r["bytes_fraction"] <= 0.20 + 1e-3
           and r.get("greedy_margin_err_windows")]
    fp8 = [r for r in rows if r["family"] == "fp8e4m3" and r.get("greedy_margin_err_windows")]
    if not rdr or not fp8:
        return None
    a = max(rdr, key=lambda r: r["bytes_fraction"])
    p = paired_difference(a, fp8[0], "greedy_margin_err")
    return dict(p, rdr=a["method"], fp8=fp8[0]["method"], met=p["diff"] <= 0,
                rdr_value=a["greedy_margin_err"], fp8_value=fp8[0]["greedy_margin_err"])


def ci95(x) -> Optional[float]:
    """Half-width of the 95 % confidence interval of the mean of ``x`` (Student's t with
    n − 1 degrees of freedom; the windows are the samples); None for fewer than 2."""
    x = np.asarray(x, float)
    if x.size < 2:
        return None
    from scipy.stats import t
    return float(t.ppf(0.975, x.size - 1) * x.std(ddof=1) / math.sqrt(x.size))


#: ΔPPL's y axis: linear within ±PPL_LINEAR % (noise puts dense-quality methods a little
#: either side of 0), logarithmic beyond, with its ticks written out as percentages
PPL_LINEAR = 0.1
PARETO_METRICS = [("delta_ppl_pct", "perplexity increase over dense (ΔPPL), %\n"
                   f"linear within ±{PPL_LINEAR:g} %, log scale beyond", "symlog",
                   (1.0, "target: ΔPPL 1 %")),
                  ("kl_nats", "next-token KL(dense ‖ method), nats (log)", "log", None)]
GREEDY_METRICS = [("greedy_agreement", "greedy agreement: common prefix / generated", "linear",
                   (0.9, "target: agreement 0.9")),
                  ("greedy_margin_err", "RMS change of the greedy margin, logits (log)", "log", None)]
# each plotted figure's 95 % CI half-width in a row (error bars)
CI_KEYS = {"delta_ppl_pct": "delta_ppl_ci95", "kl_nats": "kl_nats_ci95",
           "greedy_agreement": "greedy_agreement_ci95", "greedy_margin_err": "greedy_margin_err_ci95"}
# one marker shape per method family, so points that coincide stay told apart
# (kvpress's presses by their press name; the peers' lines are dashed)
MARKERS = {"skv-rdr": "o", "skv-fixed": "s", "fp8e4m3": "D", "kivi": "^", "h2o": "v",
           "snapkv": "P", "streamingllm": "X", "expected": "<", "tova": ">", "knorm": "h",
           "observed": "*", "adakv-expected": "d", "adakv-snapkv": "p", "hf-quantized-hqq": "8"}
# kvpress's eight presses take the eight colours of Okabe and Ito's palette (told apart by
# eye and under the common colour-vision deficiencies); the project's own baselines and the
# QuantizedCache muted tones of their own, Spherical KV with RDR a heavy purple line
COLORS = {"snapkv": "#0072B2", "streamingllm": "#E69F00", "expected": "#009E73",
          "tova": "#D55E00", "knorm": "#56B4E9", "observed": "#000000",
          "adakv-expected": "#CC79A7", "adakv-snapkv": "#F0E442",
          "fp8e4m3": "#7f7f7f", "h2o": "#8c564b", "kivi": "#bcbd22", "skv-fixed": "#17becf",
          "hf-quantized-hqq": "#393b79", "skv-rdr": "#6a0dad"}
NUDGE = 0.012     # points of one family shift by up to ±NUDGE·x sideways (log x): ties stay visible


def _padded_limits(axis, values, pad=0.06):
    """(low, high) holding every value with ``pad`` of the span either side, measured in
    the axis's own scale (log, symlog or linear), so no marker is cut by the frame."""
    t = axis.get_transform()
    lo, hi = (float(v) for v in t.transform(np.array([min(values), max(values)], dtype=float)))
    span = (hi - lo) or abs(hi) or 1.0
    out = t.inverted().transform(np.array([lo - pad * span, hi + pad * span]))
    return float(out[0]), float(out[1])


def _percent_ticks(ax) -> None:
    """ΔPPL's ticks within the axis's limits: 0, ±0.1 and 1-3-10 steps, written as signed
    percentages (+1 %, −0.1 %), so the symmetric log scale reads as numbers."""
    lo, hi = ax.get_ylim()
    steps = [0.05, 0.1, 0.3, 1, 3, 10, 30, 100, 300, 1000]
    ticks = [t for t in sorted({0.0} | {s for s in steps} | {-s for s in steps}) if lo <= t <= hi]
    ax.set_yticks(ticks, [("0" if t == 0 else f"{t:+g} %".replace("-", "\u2212")) for t in ticks])
    ax.yaxis.set_minor_locator(__import__("matplotlib").ticker.NullLocator())


def _legend_order(label: str) -> tuple:
    """Spherical KV first, then the project's own baselines, then the peers, the reference
    lines last."""
    if label.startswith("target"):
        return (3, label)
    if label.startswith("skv-"):
        return (0, label != "skv-rdr", label)
    return (2 if label.startswith(("kvpress-", "hf-")) else 1, label)


def plot(rows, path: Path, metrics=PARETO_METRICS) -> None:
    """Bytes vs each of ``metrics`` (one plot row each: key, label, y scale, labelled reference
    line or None), one line and marker shape per method family, one column per context
    length, one legend for every panel, outside them; the families' points are nudged
    slightly sideways so equal ones do not hide each other, and the axes hold every point
    and the reference line. Default: ΔPPL (top) and next-token KL (bottom);
    ``GREEDY_METRICS``: greedy agreement and margin error."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    contexts = sorted({r["context"] for r in rows})
    fig, axes = plt.subplots(len(metrics), len(contexts), figsize=(6 * len(contexts), 4.5 * len(metrics)),
                             squeeze=False)
    legend = {}
    for row, (key, label, scale, ref) in enumerate(metrics):
        for ax, T in zip(axes[row], contexts):
            fams = {}
            for r in rows:
                if r["context"] == T and r["family"] != "dense" and r.get(key) is not None:
                    fams.setdefault(r["family"], []).append(r)
            ax.set_xscale("log")
            if scale == "symlog":
                ax.set_yscale("symlog", linthresh=PPL_LINEAR)    # ΔPPL can be slightly negative (noise)
                ax.axhline(0.0, color="k", lw=0.6)
            else:
                ax.set_yscale(scale)
            xs, ys = [], []
            for i, (fam, rs) in enumerate(sorted(fams.items())):
                rs.sort(key=lambda r: r["bytes_fraction"])
                shift = 1 + NUDGE * (2 * i / max(len(fams) - 1, 1) - 1)
                x = [100 * r["bytes_fraction"] * shift for r in rs]
                y = [max(r[key], 1e-5) if scale == "log" else r[key] for r in rs]
                peer = fam.startswith(("kvpress-", "hf-"))  # the field's own code: dashed
                style = fam.removeprefix("kvpress-")
                line, = ax.plot(x, y, marker=MARKERS.get(style, "o"),
                                color=COLORS.get(style), ms=7 if fam == "skv-rdr" else 6,
                                mfc="none" if fam != "skv-rdr" else None, mew=1.4,
                                ls="--" if peer else "-",
                                lw=2.5 if fam == "skv-rdr" else 1.2, label=fam)
                legend.setdefault(fam, line)
                half = [r.get(CI_KEYS.get(key, "")) for r in rs]
                if all(h is not None for h in half):         # the 95 % CIs as error bars
                    lo = [min(h, v - 1e-5) if scale == "log" else h for h, v in zip(half, y)]
                    ax.errorbar(x, y, yerr=[lo, half], fmt="none", ecolor=line.get_color(),
                                alpha=0.45, lw=1, capsize=2)
                xs += x
                ys += y
            if ref is not None:
                value, text = ref
                legend.setdefault(text, ax.axhline(value, color="k", ls=":", lw=1.2, label=text))
                ys.append(value)
            if not xs:
                continue
            ax.set_xlim(*_padded_limits(ax.xaxis, xs))
            ax.set_ylim(*_padded_limits(ax.yaxis, ys, pad=0.08))
            if scale == "symlog":
                _percent_ticks(ax)
            lo, hi = ax.get_xlim()
            ticks = [t for t in (10, 15, 20, 25, 30, 40, 50, 65, 80, 100) if lo <= t <= hi]
            if len(ticks) < 2:          # points close together in bytes: ticks between them
                ticks = sorted({float(f"{t:.4g}") for t in np.geomspace(lo, hi, 5)[1:-1]})
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
            ax.set_xlim(lo, hi)
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set_xlabel("cache bytes, % of bf16 (all overheads counted)")
            ax.set_ylabel(label)
            ax.set_title(f"context {T} tokens")
            ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    if legend:
        names = sorted(legend, key=_legend_order)
        fig.legend([legend[n] for n in names], names, loc="center left", bbox_to_anchor=(1.0, 0.5),
                   fontsize=9, title="method (dashed: the peers' own code)", title_fontsize=9,
                   frameon=False)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def plot_reports(rows, out: Path) -> list[Path]:
    """Draw ``pareto.png`` and, where the rows have greedy metrics, ``greedy.png`` under
    ``out``; returns the files written."""
    written = [out / "pareto.png"]
    plot(rows, written[0])
    if any(r.get("greedy_margin_err") is not None for r in rows):
        written.append(out / "greedy.png")
        plot(rows, written[-1], GREEDY_METRICS)
    return written
