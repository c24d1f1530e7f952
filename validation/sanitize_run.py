"""A small representative run of every kernel (encode on both codebooks; decode on the table and
the affine path, every fast page kind of the affine one at D = 128 and 256, with and without split-K; both merges,
with the log-sum-exp output; re-tier/compaction) for compute-sanitizer (memcheck, racecheck,
initcheck).

    compute-sanitizer --tool memcheck --error-exitcode 9 python3 validation/sanitize_run.py
    ... python3 validation/sanitize_run.py --encode-only    # the encode and re-tier part alone
"""
import sys

import numpy as np


def encode_part(dim, tables_by_codebook, ladder):
    """Encode into fresh pages of every tier (both codebooks), then demote and compact them."""
    import cupy as cp
    from cupy_kernels import encode_into_pages, encode_kv_into_pages, retier
    for codebook, tables in tables_by_codebook.items():
        n = 40
        rng = np.random.default_rng(0)
        t_top, t_low = len(ladder), 2
        p_top, p_low = tables.states_per_page(t_top), tables.states_per_page(t_low)
        pages = cp.asarray(rng.integers(0, 256, (16, tables.page_bytes), dtype=np.uint8))
        tier = cp.asarray([t_top] * 8 + [t_low] * 8, cp.int32)
        slots = np.arange(n)
        dpg = cp.asarray((slots // p_top).astype(np.int32))
        dsl = cp.asarray((slots % p_top).astype(np.int32))
        x = cp.random.standard_normal((n, dim), dtype=cp.float32)
        sig = cp.ones((1, dim), cp.float32)
        head = cp.zeros(n, cp.int32)
        # the 16-bit tier runs the float64 path
        encode_into_pages(x, pages, tier, tables, sig, head, dpg, dsl, part="key")
        encode_into_pages(x, pages, tier, tables, sig, head, dpg, dsl, part="value")
        lpg = cp.asarray((8 + slots // p_low).astype(np.int32))
        lsl = cp.asarray((slots % p_low).astype(np.int32))
        xz = x.copy()
        xz[5] = 0.0                 # a zero vector: the float64 path on a float32 tier
        mean = cp.random.standard_normal((1, dim), dtype=cp.float32)
        for part in ("key", "value"):   # float32 paths, 37 vectors (a part-idle warp)
            encode_into_pages(xz[:37], pages, tier, tables, sig, head[:37], lpg[:37], lsl[:37],
                              part=part)
            encode_into_pages(x[:37], pages, tier, tables, sig, head[:37], lpg[:37], lsl[:37],
                              part=part, mean=mean, mean_index=head[:37])
        retier(pages, tier, tables, dpg, dsl, lpg, lsl)                        # demotion
        retier(pages, tier, tables, lpg[:5], lsl[:5], lpg[:5] + 4, lsl[:5])    # compaction
        # full 4/4 and 8/8 pages of Gaussian rows in one launch (both widths through
        # its one cells loop; ~3 % and ~20-27 % of the vectors take the float64 pipeline)
        t4, t8 = ladder.index((4, 4)) + 1, ladder.index((8, 8)) + 1
        p4, p8 = tables.states_per_page(t4), tables.states_per_page(t8)
        m = 600
        npg = -(-m // p4) + -(-m // p8)
        spages = cp.zeros((npg, tables.page_bytes), cp.uint8)
        stier = cp.asarray([t4] * -(-m // p4) + [t8] * -(-m // p8), cp.int32)
        xs = cp.random.standard_normal((2 * m, dim), dtype=cp.float32)
        k = np.arange(m)
        spg = cp.asarray(np.concatenate([k // p4, -(-m // p4) + k // p8]).astype(np.int32))
        ssl = cp.asarray(np.concatenate([k % p4, k % p8]).astype(np.int32))
        for part in ("key", "value"):
            encode_into_pages(xs, spages, stier, tables, sig, cp.zeros(2 * m, cp.int32), spg, ssl,
                              part=part)
        # keys and values in one launch (two rows of blocks), the values centred
        z2 = cp.zeros(2 * m, cp.int32)
        encode_kv_into_pages(xs, xs[::-1], spages, stier, tables, sig, -sig, z2, spg, ssl,
                             mean_v=mean, mean_index=z2)


def wide_tiers_part(dim, group, lengths, seed, splits):
    """Decode rows where full and partial pages of every tier of the ladder 2/2 .. 16/16
    interleave (uniform codebook: the affine path's fast pages), random filler bytes in the
    pages' unused tails, at each split count."""
    import cupy as cp
    from validation.decode_cases import build_case, run_case, to_device
    wide = [(2, 2), (3, 3), (4, 4), (8, 8), (16, 16)]
    case = build_case(1, 2, group, dim, lengths, wide, [1, 2, 3, 4, 5], seed=seed,
                      fill_random=True, reference_parts=False, codebook="uniform", chunks_per_row=8)
    dev = to_device(case)
    for s in splits:
        out = run_case(case, dev, num_splits=s)
        assert bool(cp.all(cp.isfinite(out)))


def main(argv=None):
    import cupy as cp
    from cupy_kernels import kernel_tables
    from validation.decode_cases import build_case, run_case, to_device
    encode_only = "--encode-only" in (sys.argv[1:] if argv is None else argv)
    ladder = [(2, 2), (3, 2), (4, 3), (4, 4), (8, 8), (16, 16)]
    for dim, group in ((128, 4), (64, 8)):
        tables = {}
        for codebook in ("lloyd-max", "uniform"):   # table path, affine path
            if encode_only:
                tables[codebook] = kernel_tables(ladder, dim, codebook=codebook)
                continue
            case = build_case(2, 2, group, dim, [97, 300, 17, 64], ladder, [1, 2, 3, 4, 5, 6],
                              seed=1, centred=True, fill_random=True, reference_parts=False,
                              codebook=codebook)
            dev = to_device(case)
            for splits in (1, 3, 300):
                # the split runs also write each head's log-sum-exp (300 splits: the per-row
                # merge on the affine path too)
                lse = cp.empty(case.q.shape[:2], cp.float32) if splits > 1 else None
                out = run_case(case, dev, num_splits=splits, lse=lse)
                assert bool(cp.all(cp.isfinite(out)))
                assert lse is None or bool(cp.all(cp.isfinite(lse)))
            tables[codebook] = case.tables
        if not encode_only:
            # the affine path's 4/4 fast pages (swizzled staging) next to partial 4/4 pages and
            # other tiers in one row, random filler bytes in the pages' unused tails
            case = build_case(1, 2, group, dim, [200, 75], ladder, [2, 4, 6], seed=2, fill_random=True,
                              reference_parts=False, codebook="uniform", chunks_per_row=6)
            dev = to_device(case)
            for splits in (1, 2):
                out = run_case(case, dev, num_splits=splits)
                assert bool(cp.all(cp.isfinite(out)))
            # the other fast pages (full 2/2, 3/3, 8/8 and 16/16 pages) with partial pages of
            # every tier, in rows of several pages per tier, split-K interleaved over them
            wide_tiers_part(dim, group, [1500, 1100], seed=3, splits=(1, 2, 3))
        encode_part(dim, tables, ladder)
    if not encode_only:
        # the D = 256 fast pages (full 2/2, 3/3, 4/4, 8/8 and 16/16 pages) likewise
        wide_tiers_part(256, 8, [900, 700], seed=4, splits=(1, 3))
    cp.cuda.Device().synchronize()
    print("sanitize run done")


if __name__ == "__main__":
    main()
