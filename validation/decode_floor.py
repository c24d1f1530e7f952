"""What a paged decode of the benchmark's layouts can reach at all: the time of a kernel that
only reads the pages (csrc/page_read.cuh: v7's grid, the same page table and header chain,
the bytes XORed and dropped), against the v7 decode step on the same pool and copies of the
same byte count, in one process.

Rows per case (median of --reps, L2 flushed by a write before each repetition):
  copy_same_bytes   torch copy of half the pool's bytes (read + written = the pool's bytes)
  sum_same_bytes    torch sum over the pool viewed as int64 (a read of the same bytes)
  read_pool_order   page_read MODE 2: every pool page, grid-strided, no page table
  read_static       page_read MODE 0: v7's static interleaved split of each row's pages
                    (read_static_1page, read_static_3pages: one and three pages per warp in
                    flight instead of two)
  read_claimed      page_read MODE 1: each warp claims its row's pages one at a time, a page
                    ahead of its use (the claim -> index -> count -> page chain then waits)
  *_xM              the same with M times v7's split count (M waves of CTAs at v7's four
                    CTAs per SM; the probe's registers let up to six stay resident)
  v7_step           the decode step as benchmarked (decode + split-K merge, one CUDA graph)
With --partial, the v7 step also on pools that differ only in the row's partial page (1-8
states at these shapes, read in place by v7's generic page code, after the row's full pages):
  v7_partial_first     the partial page first in each row's page list (the slot of split 0,
                       warp 0, which starts with it)
  v7_partial_slot_end  the partial page at place 4 S - 1 (a warp that holds one page fewer
                       than the warps of the row's last, incomplete round)
  v7_full_pages        the context rounded down to whole pages (no partial page)
Every page_read row checks that the XOR of all its words equals the pool's (each page read
exactly once).

    PYTHONPATH=. python3 validation/decode_floor.py --out decode_floor.json
    python3 validation/decode_floor.py --plot decode_floor.json decode_floor.png
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_bench import D, HKV, HQ, LADDER, Timer, ada_step, build_ada, copy_bandwidth  # noqa: E402
from decode_variants import dump_table  # noqa: E402

CASES = [(32, 8192, "4/4"), (8, 32768, "4/4"), (2, 131072, "4/4"), (1, 131072, "4/4"),
         (8, 32768, "rdr-mix")]
MODES = {"read_pool_order": (2, 2), "read_static": (0, 2), "read_static_1page": (0, 1),
         "read_static_3pages": (0, 3), "read_claimed": (1, 2)}   # name: (MODE, DEPTH)
GRIDS = {"read_pool_order": (2, 4), "read_static": (2, 4)}       # name: split multipliers
PR_WARPS = 4   # csrc/page_read.cuh


def page_read_module():
    """The probe's own module (not the library's: its kernels stay out of the decode's build)."""
    import cupy as cp
    from cupy_kernels import _module
    names = {md: f"skv::page_read_kernel<{md[0]}, {md[1]}>" for md in MODES.values()}
    mod = cp.RawModule(code='#include "page_read.cuh"', options=_module.build_options(),
                       name_expressions=list(names.values()))
    mod.compile()
    return lambda mode_depth: mod.get_function(names[mode_depth])


def pool_xor(pages) -> np.ndarray:
    """XOR of every 16-byte word of the pool (4 uint32)."""
    host = pages.get().view(np.uint32).reshape(-1, 4)
    return np.bitwise_xor.reduce(host, axis=0)


def page_reader(get, mode, state, splits):
    """(launch fn, output) of one page_read (MODE, DEPTH) over ``state``'s pool and page table."""
    import cupy as cp
    pages = state["pages"]
    if pages.shape[1] != 4096:
        raise ValueError("page_read reads 4096-byte pages")
    rows = state["indptr"].size - 1
    claims = [cp.zeros(rows, cp.int32), cp.zeros(rows, cp.int32)]
    out = cp.zeros((splits * rows * PR_WARPS, 4), cp.uint32)
    fn = get(mode)
    turn = [0]

    def run():
        a, b = claims[turn[0]], claims[1 - turn[0]]
        fn((splits, rows), (PR_WARPS * 32,),
           (pages, np.int32(pages.shape[0]), state["indptr"], state["indices"],
            state["page_count"], np.int32(splits), a, b, out))
        turn[0] ^= 1
    return run, out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="decode_floor.json")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--cases", default="all", help="'all' or indices into CASES, e.g. 0,1")
    ap.add_argument("--partial", action="store_true",
                    help="also time v7 on pools that place the rows' partial pages elsewhere")
    ap.add_argument("--plot", nargs=2, metavar=("JSON", "PNG"),
                    help="only draw the picture of a table this script wrote (no GPU)")
    args = ap.parse_args(argv)
    if args.plot:
        plot(json.loads(Path(args.plot[0]).read_text()), Path(args.plot[1]))
        return 0
    import cupy as cp
    import torch
    from cupy_kernels import kernel_tables
    from cupy_kernels.ada_decode import splits_for

    timer = Timer(args.reps)
    copy_gbps = copy_bandwidth(timer)
    print(f"copy bandwidth (read + write): {copy_gbps:.0f} GB/s", flush=True)
    get = page_read_module()
    tables = kernel_tables(LADDER, D, codebook="uniform")
    chosen = CASES if args.cases == "all" else [CASES[int(i)] for i in args.cases.split(",")]
    rows = []
    for batch, context, tiers in chosen:
        state, _ = build_ada(batch, context, tiers, tables)
        lay = state["layout"]
        pool_bytes = int(state["pages"].size)
        splits = splits_for(tables, None, batch * HKV, int(lay.indices.size))
        want = pool_xor(state["pages"])

        def row(method, us, nbytes, splits=None, xor_ok=None):
            r = dict(method=method, batch=batch, context=context, tiers=tiers, us=round(us, 2),
                     bytes=int(nbytes), gbps=round(nbytes / (us * 1e-6) / 1e9, 1),
                     pct_copy=round(100 * nbytes / (us * 1e-6) / 1e9 / copy_gbps, 1),
                     floor_us=round(nbytes / copy_gbps / 1e3, 2), splits=splits, xor_ok=xor_ok)
            rows.append(r)
            print(r, flush=True)

        flat = torch.from_dlpack(state["pages"].reshape(-1))
        half = pool_bytes // 2
        dst = torch.empty(half, dtype=torch.uint8, device="cuda")
        row("copy_same_bytes", timer(lambda: dst.copy_(flat[:half])), 2 * half)
        del dst
        as64 = flat.view(torch.int64)
        row("sum_same_bytes", timer(lambda: as64.sum()), pool_bytes)
        for name, mode in MODES.items():
            for m in (1,) + GRIDS.get(name, ()):
                run, out = page_reader(get, mode, state, splits * m)
                us = timer(run)
                got = np.bitwise_xor.reduce(out.get(), axis=0)
                row(name + (f"_x{m}" if m > 1 else ""), us, pool_bytes, splits=splits * m,
                    xor_ok=bool(np.array_equal(got, want)))
        q = cp.asarray(np.random.default_rng(0).standard_normal((batch, HQ, D), np.float32))
        step, _, vs = ada_step(state, tables, q, batch)
        row("v7_step", timer(step), lay.cache_bytes, splits=vs)
        del state, flat, as64, step
        if args.partial and tiers in ("4/4", "3/3", "2/2"):
            per_page = tables.states_per_page(int(lay.page_tier[lay.indices[0]]))
            npr = int(lay.indptr[1])
            variants = {"v7_partial_first": (context, 0),
                        "v7_partial_slot_end": (context, 4 * splits - 1),
                        "v7_full_pages": (context // per_page * per_page, None)}
            for name, (ctx, at) in variants.items():
                if context % per_page == 0 or (at is not None and at >= npr):
                    continue
                st, _ = build_ada(batch, ctx, tiers, tables, last_page_at=at)
                step, _, vs = ada_step(st, tables, q, batch)
                row(name, timer(step), st["layout"].cache_bytes, splits=vs)
                del st, step
        cp.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()
        dump_table(args.out, copy_gbps, rows, COLUMNS)
    plot(dict(copy_gbps=copy_gbps, rows=rows), Path(args.out).with_suffix(".png"))
    return 0


BARS = (("copy_same_bytes", "torch copy, same bytes", "tab:gray"),
        ("sum_same_bytes", "torch sum, same bytes", "silver"),
        ("read_pool_order", "page reader, pool order (no table)", "tab:green"),
        ("read_static", "page reader, v7's grid and split", "tab:olive"),
        ("v7_step", "ADA decode step (v7)", "tab:blue"))


def plot(data: dict, path) -> None:
    """One panel per case: the time of each reader and of the v7 step, and the time that is
    85 % of copy bandwidth over the v7 step's bytes (the decode target)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cases = {}
    for r in data["rows"]:
        cases.setdefault((r["batch"], r["context"], r["tiers"]), {})[r["method"]] = r
    cases = {k: v for k, v in cases.items() if "v7_step" in v}
    if not cases:
        raise ValueError("no v7_step rows to plot")
    fig, axes = plt.subplots(1, len(cases), figsize=(3.2 * len(cases), 4.2), squeeze=False)
    for ax, ((batch, ctx, tiers), got) in zip(axes[0], cases.items()):
        for i, (method, label, color) in enumerate(BARS):
            if method in got:
                ax.bar(i, got[method]["us"], 0.7, color=color, label=label)
        target = got["v7_step"]["floor_us"] / 0.85
        ax.axhline(target, color="tab:red", ls="--", lw=1.4, label="85 % of copy (the target)")
        ax.set_xticks([])
        ax.set_ylabel("µs")
        ax.set_title(f"{batch} × {ctx // 1024}K, {'RDR mix' if tiers == 'rdr-mix' else tiers}",
                     fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8)
    fig.suptitle(f"What reading the pages costs on its own (copy {data['copy_gbps']:.0f} GB/s)",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


COLUMNS = [("method", "method", -20, "s"), ("batch", "B", 3, "d"), ("context", "ctx", 7, "d"),
           ("tiers", "tiers", 8, "s"), ("us", "us", 8, ".1f"), ("floor_us", "bytes/copy", 10, ".1f"),
           ("pct_copy", "%copy", 6, ".1f"), ("splits", "splits", 6, "s"), ("xor_ok", "xor", 5, "s")]

if __name__ == "__main__":
    sys.exit(main())
