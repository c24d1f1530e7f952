"""The serving frontier as a table and a picture: bytes against engine ΔPPL.

    python -m validation.engine_frontier validation/results/engine/frontier_*.json

Reads the rows of ``validation/engine_dppl.py --json`` (any number of files, both models) and
writes, next to the first file, ``frontier.md`` (per model and format: bytes per token and %
of bf16, ΔPPL as mean ± 95 % CI, min and max over the rotation seeds) and ``frontier.png``
(one panel per model: the mean with its CI and the max over seeds against bytes, the 1 %
target and the 30 % byte line). Formats with a width the storage format does not have
(engine_dppl.LAB_BITS) are drawn hollow and marked in the table: they say what a kernel
change would buy, not what ships.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

TARGET_DPPL = 0.01          # mean ΔPPL the default must reach on both models
TARGET_BYTES = 0.30         # of bf16's bytes
LEGEND = """ΔPPL of the passage of tests/test_vllm_e2e.py with every key and value of the
compressed layers read from the format (validation/engine_dppl.py; docs/serving.md "Choosing a
tier"), over rotation seeds (fp8 has none). Bytes per token: codes and scales of every kv-head
of the compressed layers; `+ N`: bytes held once (fp8's float32 scale per layer for keys and
values). Formats: K/V the format's tier; "emulated width" a key or value width the format
lacks; fp8 e4m3 with vLLM's scale 1.0, fp8-amax with amax/448 scales; rdr:B per-layer tiers by
RDR's surrogate, rdr-grad:B with each layer's distortion measured on the loss, within budget B
(a tier's bytes, or % of bf16). In brackets, engine_dppl's --variant: [sdpa] the attention in
float32 sdpa instead of float64; [centre-keys] the keys centred by the sequence's own mean.
"""
TITLES = {"smollm2": "SmolLM2-135M, all 30 layers",
          "gemma3-270m": "Gemma-3-270M, its 3 full-attention layers"}


def is_lab(tier: str) -> bool:
    from validation.engine_dppl import LAB_BITS
    tier = tier.split(" ")[0]
    if ":" in tier or "/" not in tier:
        return False
    return any(int(b) in LAB_BITS for b in tier.split("/"))


def summarise(rows):
    """[{model, tier, codebook, seeds, bytes_per_token, bytes_frac, mean, ci95, min, max}]
    in order of model, then bytes."""
    from spherical_kv_eval.evaluate import ci95
    groups = {}
    for r in rows:
        tier = r["tier"] + "".join(f" [{v}]" for v in r.get("variant", []))
        groups.setdefault((r["model"], tier, r["codebook"]), []).append(r)
    out = []
    for (model, tier, cb), rs in groups.items():
        seeds = sorted({r["seed"] for r in rs})
        if len(seeds) != len(rs):
            raise ValueError(f"{model} {tier} {cb}: a seed appears twice")
        d = np.array([r["dppl"] for r in rs])
        out.append({"model": model, "tier": tier, "codebook": cb, "seeds": len(seeds),
                    "bytes_per_token": rs[0]["bytes_per_token"],
                    "bytes_frac": rs[0]["bytes_per_token"] / rs[0]["bf16_bytes_per_token"],
                    "fixed_bytes": rs[0].get("fixed_bytes", 0),
                    "mean": float(d.mean()), "ci95": ci95(d), "min": float(d.min()),
                    "max": float(d.max()), "lab": is_lab(tier)})
    return sorted(out, key=lambda s: (s["model"] != "smollm2", s["bytes_frac"], s["tier"]))


def table(summary) -> str:
    lines = []
    for model in dict.fromkeys(s["model"] for s in summary):
        lines += [f"### {TITLES.get(model, model)}", "",
                  "| format | codebook | bytes / token | % of bf16 | ΔPPL mean ± 95 % CI | min | max | seeds |",
                  "|---|---|---|---|---|---|---|---|"]
        for s in (s for s in summary if s["model"] == model):
            ci = "" if s["ci95"] is None else f" ± {100 * s['ci95']:.2f}"
            name = s["tier"] + (" (emulated width)" if s["lab"] else "")
            fixed = f" + {s['fixed_bytes']}" if s["fixed_bytes"] else ""
            lines.append(f"| {name} | {s['codebook']} | {s['bytes_per_token']}{fixed} | "
                         f"{100 * s['bytes_frac']:.1f} % | {100 * s['mean']:+.2f}{ci} % | "
                         f"{100 * s['min']:+.2f} % | {100 * s['max']:+.2f} % | {s['seeds']} |")
        lines.append("")
    return "\n".join(lines)


#: where a label may sit beside its point, offset points (dx, dy), in order of preference
LABEL_PLACES = ((5, 3), (5, -11), (5, 13), (-5, 3), (-5, -11), (5, -21), (5, 23), (-5, 13))


def place_labels(ax, labels, marks, fontsize=8) -> list:
    """Offset (dx, dy) in points from LABEL_PLACES for each (text, x, y) of ``labels`` (data
    units, ``ax`` as laid out now): the first place whose text box, estimated from the
    font size, overlaps no label already placed and no point of ``marks`` (x, y) but its
    own; where every place is taken, the one with the fewest overlaps."""
    px = ax.figure.dpi / 72.0
    h, w = fontsize * px, 0.6 * fontsize * px          # a line's height, a character's width
    dots = ax.transData.transform(np.asarray(marks, dtype=float))
    boxes, out = [], []
    for text, x, y in labels:
        ox, oy = ax.transData.transform((x, y))
        best = None
        for dx, dy in LABEL_PLACES:
            x0 = ox + dx * px - (len(text) * w if dx < 0 else 0)
            y0 = oy + dy * px
            box = (x0, y0, x0 + len(text) * w, y0 + h)
            hits = sum(b[0] < box[2] and box[0] < b[2] and b[1] < box[3] and box[1] < b[3]
                       for b in boxes)
            hits += sum(box[0] - 4 < qx < box[2] + 4 and box[1] - 4 < qy < box[3] + 4
                        and (abs(qx - ox) > 1 or abs(qy - oy) > 1) for qx, qy in dots)
            if best is None or hits < best[0]:
                best = (hits, (dx, dy), box)
            if hits == 0:
                break
        boxes.append(best[2])
        out.append(best[1])
    return out


def picture(summary, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from spherical_kv_vllm import DEFAULT_TIER
    default = "/".join(map(str, DEFAULT_TIER))
    models = list(dict.fromkeys(s["model"] for s in summary))
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 5), squeeze=False)
    placed = []
    for ax, model in zip(axes[0], models):
        labels, marks = [], []
        for s in (s for s in summary if s["model"] == model):
            x, m = 100 * s["bytes_frac"], 100 * s["mean"]
            marks.append((x, m))
            colour = ("tab:purple" if s["tier"].startswith("fp8") else
                      "tab:green" if s["tier"].startswith("rdr") else
                      "tab:orange" if s["codebook"] == "lloyd-max" else "tab:blue")
            face = "none" if s["lab"] else colour
            ax.errorbar(x, m, yerr=None if s["ci95"] is None else 100 * s["ci95"], fmt="o",
                        color=colour, mfc=face, capsize=3)
            if s["seeds"] > 1:
                ax.plot(x, 100 * s["max"], "v", color=colour, mfc="none", ms=6)
                marks.append((x, 100 * s["max"]))
            label = s["tier"] + (" LM" if s["codebook"] == "lloyd-max" else "")
            if s["tier"] == default and s["codebook"] == "uniform":
                label += " (plugin default)"
            labels.append((label, x, m))
        placed.append((ax, labels, marks))
        ax.axhline(100 * TARGET_DPPL, color="k", ls="--", lw=0.8)
        ax.axvline(100 * TARGET_BYTES, color="k", ls=":", lw=0.8)
        ax.set_yscale("symlog", linthresh=1.0)
        lo, hi = ax.get_xlim()
        ax.set_xlim(lo, hi + 0.08 * (hi - lo))     # room for the rightmost labels
        ax.set_xlabel("bytes per token, % of bf16")
        ax.set_ylabel("engine ΔPPL, %  (● mean ± 95 % CI, ▽ max over seeds)")
        ax.set_title(TITLES.get(model, model), fontsize=10)
        ax.grid(alpha=0.3)
    fig.text(0.01, 0.01, "blue: uniform codebook; orange (LM): Lloyd–Max; hollow: a width the "
             "format lacks (emulated); purple: fp8 e4m3 (per-tensor scale); green: per-layer "
             "tiers by RDR; dashed: ΔPPL 1 %; dotted: 30 % of bf16", fontsize=8)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    for ax, labels, marks in placed:             # placed once the axes are laid out
        for (label, x, m), offset in zip(labels, place_labels(ax, labels, marks)):
            ax.annotate(label, (x, m), textcoords="offset points", xytext=offset,
                        ha="left" if offset[0] > 0 else "right", fontsize=8)
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    paths = [Path(p) for p in (sys.argv[1:] if argv is None else argv)]
    if not paths:
        print(__doc__)
        return 2
    rows = [r for p in paths for r in json.loads(p.read_text())]
    summary = summarise(rows)
    out = paths[0].parent
    (out / "frontier.md").write_text(
        "# Engine ΔPPL against bytes (written by `python -m validation.engine_frontier`)\n\n"
        + LEGEND + "\n" + table(summary))
    picture(summary, out / "frontier.png")
    print(table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
