"""A small representative run of every kernel (encode v1 and v2, decode on the table and the affine path,
v7, v6, v5 and v4, with and without split-K, merge, re-tier/compaction) for compute-sanitizer (memcheck, racecheck, initcheck).

    compute-sanitizer --tool memcheck --error-exitcode 9 python3 validation/sanitize_run.py
"""
import numpy as np


def main():
    import cupy as cp
    from cupy_kernels import encode_into_pages, kernel_tables, retier
    from cupy_kernels.cases import build_case, run_case, to_device
    ladder = [(2, 2), (3, 2), (4, 3), (4, 4), (8, 8), (16, 16)]
    for dim, group in ((128, 4), (64, 8)):
        for codebook in ("lloyd-max", "uniform"):   # table path, affine path
            case = build_case(2, 2, group, dim, [97, 300, 17, 64], ladder, [1, 2, 3, 4, 5, 6],
                              seed=1, centred=True, fill_random=True, reference_parts=False,
                              codebook=codebook)
            dev = to_device(case)
            for splits, version in ((1, 7), (3, 7), (1, 6), (3, 6), (1, 5), (3, 5), (3, 4)):
                out = run_case(case, dev, num_splits=splits, version=version)
                assert bool(cp.all(cp.isfinite(out)))
        # v7's fast path (full 4/4 pages, swizzled staging) next to partial 4/4 pages and other
        # tiers in one row, random filler bytes in the pages' unused tails
        case = build_case(1, 2, group, dim, [200, 75], ladder, [2, 4, 6], seed=2, fill_random=True,
                          reference_parts=False, codebook="uniform", chunks_per_row=6)
        dev = to_device(case)
        for splits in (1, 2):
            out = run_case(case, dev, num_splits=splits, version=7)
            assert bool(cp.all(cp.isfinite(out)))
        tables = case.tables
        # encode into fresh pages of every tier, then demote and compact them
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
        for version in (1, 2):   # v1 and v2 (v2 runs its float64 path for the 16-bit tier)
            encode_into_pages(x, pages, tier, tables, sig, head, dpg, dsl, part="key",
                              version=version)
            encode_into_pages(x, pages, tier, tables, sig, head, dpg, dsl, part="value",
                              version=version)
        lpg = cp.asarray((8 + slots // p_low).astype(np.int32))
        lsl = cp.asarray((slots % p_low).astype(np.int32))
        for part in ("key", "value"):   # v2's float32 path, 37 vectors (a part-idle warp)
            encode_into_pages(x[:37], pages, tier, tables, sig, head[:37], lpg[:37], lsl[:37],
                              part=part, version=2)
        retier(pages, tier, tables, dpg, dsl, lpg, lsl)                        # demotion
        retier(pages, tier, tables, lpg[:5], lsl[:5], lpg[:5] + 4, lsl[:5])    # compaction
    cp.cuda.Device().synchronize()
    print("sanitize run done")


if __name__ == "__main__":
    main()
