"""The decode benchmark as a picture: ``python -m validation.plot_decode [json] [png]``.

Reads the rows ``validation/decode_bench.py`` writes (``decode_h200.json``) and draws, for
each (batch, context) shape, the time of the default ADA kernel per tier and codebook next
to the peers timed in the same run (torch SDPA bf16, FlashInfer bf16 and fp8) and next to
each row's floor: the bytes it must read at the copy bandwidth measured in that run. The
gap between a bar and its floor marker is what the kernel still leaves on the table.
A row carries the run it comes from (``run``): where a codebook's default kernel was not
re-timed in the latest run, its bars come from the earlier run the JSON names.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "kernels"
TIERS = ("4/4", "3/3", "2/2", "rdr-mix")
CODEBOOKS = (("uniform", "ADA, uniform codebook"), ("lloyd-max", "ADA, Lloyd–Max codebook"))
PEERS = (("sdpa_bf16", "torch SDPA bf16", "k", "-"),
         ("flashinfer_bf16", "FlashInfer bf16", "tab:red", "--"),
         ("flashinfer_fp8", "FlashInfer fp8", "tab:purple", ":"))


def decode_rows(rows):
    """{(batch, context): {"ada": {(codebook, tiers): row}, peer method: row}} of the rows
    that answer the benchmark's question: each codebook's default ADA kernel and the peers."""
    shapes = {}
    for r in rows:
        key = (r["batch"], r["context"])
        if r["method"] == "ada" and r.get("default"):
            shapes.setdefault(key, {}).setdefault("ada", {})[(r["codebook"], r["tiers"])] = r
        elif r["method"] in {p[0] for p in PEERS} and r["us"] is not None:
            shapes.setdefault(key, {})[r["method"]] = r
    order = sorted(shapes, key=lambda k: (k[1], -k[0]))     # the order: 32x8K first
    return {k: shapes[k] for k in order if "ada" in shapes[k]}


def floor_us(row) -> float:
    """Microseconds to read the row's bytes at the copy bandwidth of its run."""
    return row["bytes_read"] / (row["copy_gbps"] * 1e3)


def plot(rows, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shapes = decode_rows(rows)
    if not shapes:
        raise ValueError("no default ADA rows to plot")
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.6 * len(shapes), 4.8), squeeze=False)
    width = 0.38
    for ax, ((batch, ctx), got) in zip(axes[0], shapes.items()):
        for j, (cb, label) in enumerate(CODEBOOKS):
            xs, us, fl = [], [], []
            for i, tiers in enumerate(TIERS):
                r = got["ada"].get((cb, tiers))
                if r is not None:
                    xs.append(i + (j - 0.5) * width)
                    us.append(r["us"])
                    fl.append(floor_us(r))
            ax.bar(xs, us, width, label=label, color=("tab:blue", "tab:orange")[j], alpha=0.85)
            ax.scatter(xs, fl, marker="_", s=260, color="tab:green", linewidths=3, zorder=3,
                       label="bytes at copy bandwidth" if j == 0 else None)
        for method, label, color, ls in PEERS:
            if method in got:
                ax.axhline(got[method]["us"], color=color, ls=ls, lw=1.4, label=label)
        ax.set_xticks(range(len(TIERS)), ["RDR mix" if t == "rdr-mix" else t for t in TIERS])
        ax.set_xlabel("tiers (key bits / value bits)")
        ax.set_ylabel("decode step, µs (one layer)")
        ax.set_title(f"batch {batch} × context {ctx // 1024}K")
        ax.grid(True, axis="y", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    hq, hkv, d = next((r["heads"] for r in rows if r.get("heads")), (32, 8, 128))  # older files: 8B
    shape = "Llama-3.1-8B layer shapes " if (hq, hkv, d) == (32, 8, 128) else ""
    fig.suptitle(f"ADA paged decode vs peers, {shape}({hq} query / {hkv} kv heads, d = {d})",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    src = Path(argv[0]) if argv else RESULTS / "decode_h200.json"
    dst = Path(argv[1]) if len(argv) > 1 else src.with_suffix(".png")
    plot(json.loads(src.read_text()), dst)
    print(f"wrote {dst}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
