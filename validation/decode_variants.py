"""Build-time variants of the v7 affine decode kernel, timed on the same pools as v6 and v7 as
built (one GPU, one process): which of the v7 choices pays, before v7 is made the default. A
variant is a set of NVRTC defines of csrc/ada_decode.cuh (DEC7_CONV: 0 = codes fed to the mma
as fp16 subnormals by one lop3, 1 = v6's lop3 + fma per pair; DEC7_LSPLIT: two accumulators per
sub-tile for the fast path's logits; DEC7_STAGES: page buffers per warp, with the launcher's
STAGES_V7; DEC7_FAST3 / DEC7_FAST2 / DEC7_FAST8 / DEC7_FAST16: full 3/3 / 2/2 / 8/8 / 16/16 pages
on their fast path or the generic code; DEC7_INTERLEAVE: splits take a row's pages interleaved
or as contiguous ranges; DEC7_EARLY: the page stream starts at kernel entry, before the query
prologue, or after it) and/or a launcher setting (WAVES_V7: whole waves of resident CTAs the split count
aims at; MERGE_V7: v7's merge kernel instead of v6's). Every row carries the relative difference of its output
from v6's on the same pool and queries (a correctness check of each variant).

    PYTHONPATH=. python3 validation/decode_variants.py --out variants.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_bench import D, HKV, HQ, LADDER, Timer, ada_step, build_ada, copy_bandwidth  # noqa: E402

# name: (NVRTC defines or None for the module as built, launcher overrides)
VARIANTS = {
    "v7_waves2": (None, dict(WAVES_V7=2)),
    # three and four waves of smaller CTAs: the hardware's CTA scheduler balances the SMs (the
    # tail), each CTA pays the prologue (measured slower, docs/PERF_NOTES.md)
    "v7_waves3": (None, dict(WAVES_V7=3)),
    "v7_waves4": (None, dict(WAVES_V7=4)),
    "v7_oldmerge": (None, dict(MERGE_V7=False)),
    # the rotated query in rows of D floats as before (32-way bank conflicts in the fragment
    # builders of the prologue; DEC7_QPAD, csrc qs_at)
    "v7_qpad0": (dict(DEC7_QPAD=0), {}),
    # the geometry row of each page read from global memory in the header chain, as before
    # DEC7_GEOM_PRE (the table in registers at entry, one dependent load fewer)
    "v7_geompre0": (dict(DEC7_GEOM_PRE=0), dict(GEOM_ROWS_V7=0)),
    "v7_lsplit0": (dict(DEC7_LSPLIT=0), {}),
    "v7_stages3": (dict(DEC7_STAGES=3), dict(STAGES_V7=3)),
    "v7_conv1": (dict(DEC7_CONV=1), {}),
    # v8 (fast path pipelined across pages): two logit accumulators per sub-tile as v7
    "v8_lsplit1": (dict(DEC8_LSPLIT=1), {}),
    # v7 with full 3/3 and 2/2 pages on the generic code again (as before page_f2)
    "v7_generic32": (dict(DEC7_FAST3=0, DEC7_FAST2=0), {}),
    # v7 as before the mixed-tier work: contiguous splits, 8/8 and 16/16 pages generic
    "v7_contig": (dict(DEC7_INTERLEAVE=0, DEC7_FAST8=0, DEC7_FAST16=0), {}),
    # interleaved splits only (8/8 and 16/16 pages generic); fast 8/8 and 16/16 pages only
    "v7_ilv_only": (dict(DEC7_FAST8=0, DEC7_FAST16=0), {}),
    "v7_fast816_only": (dict(DEC7_INTERLEAVE=0), {}),
    # v7 as before DEC7_EARLY: the query prologue first (block-wide rotation, fragments, the
    # staging area shared with the page buffers), then the first header block and page copy
    "v7_late": (dict(DEC7_EARLY=0), {}),
    # two pages per warp in flight at entry instead of one (measured slower as the default)
    "v7_early2": (dict(DEC7_EARLY=2), {}),
    # the merge launched plainly after the decode (as before MERGE_PDL), without and with the
    # decode's instruction that allows a programmatic launch (DEC7_PDL)
    "v7_nopdl": (dict(DEC7_PDL=0), dict(MERGE_PDL=False)),
    "v7_pdl_plain": (None, dict(MERGE_PDL=False)),
    # the merge allowed to launch at each CTA's entry (DEC7_PDL = 1; the default, 2, after its
    # pages)
    "v7_pdl_entry": (dict(DEC7_PDL=1), {}),
}
# measured in device run 1 (before WAVES_V7 = 1, the v7 merge and DEC7_LSPLIT = 1 were made the
# default): v7_waves1 (now the default), v7_stages3, v7_conv1 (docs/PERF_NOTES.md, v7)
CASES = [(32, 8192, "4/4"), (8, 32768, "4/4"), (2, 131072, "4/4"), (1, 131072, "4/4"),
         (8, 32768, "2/2"), (8, 32768, "3/3"), (8, 32768, "rdr-mix"),
         (32, 8192, "3/3"), (1, 131072, "3/3"), (1, 131072, "2/2"),
         (32, 8192, "rdr-mix"), (1, 131072, "rdr-mix"), (2, 131072, "rdr-mix")]


def variant_module(defines: dict):
    """(module, kernel getter like cupy_kernels._module.kernel) for a module built with
    `defines` (only the affine v7 and v8 decode and the merges are instantiated)."""
    import cupy as cp
    from cupy_kernels import _module
    opts = _module.build_options() + tuple(f"-D{k}={v}" for k, v in defines.items())
    names = [_module.template_name(k, D) for k in ("ada_decode_uniform_v7_kernel",
                                                    "ada_decode_uniform_v8_kernel",
                                                    "ada_merge_kernel", "ada_merge_v7_kernel")]
    mod = cp.RawModule(code=_module.source(), options=opts, name_expressions=names)
    mod.compile()
    return mod, lambda name, dim: mod.get_function(_module.template_name(name, dim))


def variant_kernels(defines: dict):
    """A kernel getter like cupy_kernels._module.kernel, for a module built with `defines`."""
    return variant_module(defines)[1]


@contextlib.contextmanager
def launcher_as(ad, getter=None, overrides=None):
    """A launcher module ``ad`` (cupy_kernels.ada_decode, or .encode) launching through
    ``getter`` (a variant module's kernels; None: as built) with its constants ``overrides``
    set, restored on exit."""
    built, saved = ad.kernel, {k: getattr(ad, k) for k in overrides or {}}
    if getter is not None:
        ad.kernel = getter
    for k, v in (overrides or {}).items():
        setattr(ad, k, v)
    try:
        yield
    finally:
        ad.kernel = built
        for k, v in saved.items():
            setattr(ad, k, v)


def dump_table(path, copy_gbps, rows, columns):
    """Writes {copy_gbps, rows} to ``path`` as JSON, then prints the rows as a table; columns:
    (key, header, width (negative: left-aligned), format spec) each."""
    with open(path, "w") as f:
        json.dump(dict(copy_gbps=copy_gbps, rows=rows), f, indent=1)
    align = lambda w: f"{'<' if w < 0 else '>'}{abs(w)}"
    print("\n" + " ".join(format(h, align(w)) for _, h, w, _ in columns))
    for r in rows:
        print(" ".join(format(str(r[k]) if spec == "s" else r[k], align(w) + spec)
                       for k, _, w, spec in columns))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="decode_variants.json")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--cases", default="all", help="'all' or indices into CASES, e.g. 0,1,6")
    ap.add_argument("--variants", default="all", help="'all' or names of VARIANTS, e.g. v8_lsplit1")
    ap.add_argument("--pools", default="shuffled:0",
                    help="page pools each case is timed on, order:seed (synthetic_layout's order: "
                         "shuffled, contiguous, strided), e.g. shuffled:0,shuffled:1,contiguous:0")
    ap.add_argument("--baselines", default="v6,v7,v8",
                    help="kernels as built, timed before the variants (the first is the reference "
                         "of rel_diff_vs_v6), e.g. v6,v7")
    args = ap.parse_args(argv)
    import importlib
    import cupy as cp
    from cupy_kernels import kernel_tables
    ad = importlib.import_module("cupy_kernels.ada_decode")   # the module (the package
    # exports the function of the same name)
    timer = Timer(args.reps)
    copy_gbps = copy_bandwidth(timer)
    print(f"copy bandwidth (read + write): {copy_gbps:.0f} GB/s", flush=True)
    tables = kernel_tables(LADDER, D, codebook="uniform")
    chosen = list(VARIANTS) if args.variants == "all" else [v for v in args.variants.split(",") if v]
    getters = {name: variant_kernels(VARIANTS[name][0]) for name in chosen if VARIANTS[name][0]}
    cases = CASES if args.cases == "all" else [CASES[int(i)] for i in args.cases.split(",")]
    rows = []
    pools = [(p.split(":")[0], int(p.split(":")[1]) if ":" in p else 0)
             for p in args.pools.split(",") if p]
    for (batch, context, tiers), (order, seed) in [(c, p) for c in cases for p in pools]:
        state, _ = build_ada(batch, context, tiers, tables, seed=seed, order=order)
        lay = state["layout"]
        q = cp.random.standard_normal((batch, HQ, D), dtype=cp.float32)
        nbytes = lay.cache_bytes + q.size * 4 + (lay.indptr.size + 3 * lay.indices.size) * 4
        ref = None
        for name in [*[b for b in args.baselines.split(",") if b], *chosen]:
            over = VARIANTS[name][1] if name in VARIANTS else {}
            with launcher_as(ad, getters.get(name), over):
                ver = 6 if name == "v6" else 8 if name.startswith("v8") else 7
                run, out, splits = ada_step(state, tables, q, batch, ver)
                us = timer(run)
            if ref is None:
                ref = out.copy()
            rel = float(cp.linalg.norm(out - ref) / cp.linalg.norm(ref))
            finite = bool(cp.all(cp.isfinite(out)))
            r = dict(variant=name, batch=batch, context=context, tiers=tiers, pool=f"{order}:{seed}",
                     us=round(us, 2),
                     splits=splits, gbps=round(nbytes / (us * 1e-6) / 1e9, 1),
                     pct_copy=round(100 * nbytes / (us * 1e-6) / 1e9 / copy_gbps, 1),
                     rel_diff_vs_v6=rel, finite=finite)
            rows.append(r)
            print(json.dumps(r), flush=True)
            del run
        del state
        cp.get_default_memory_pool().free_all_blocks()
    dump_table(args.out, copy_gbps, rows,
               [("variant", "variant", -12, "s"), ("batch", "B", 3, "d"), ("context", "ctx", 7, "d"),
                ("tiers", "tiers", 8, "s"), ("pool", "pool", 12, "s"), ("us", "us", 8, ".1f"),
                ("pct_copy", "%copy", 6, ".1f"), ("splits", "splits", 6, "d"),
                ("rel_diff_vs_v6", "rel vs v6", 9, ".2e")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
