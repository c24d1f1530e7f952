"""GPU check of the bandwidth probe of validation/decode_floor.py (csrc/page_read.cuh): each of
its ways through a pool (static with one, two or three pages per warp in flight, claimed, pool order) reads every page exactly once, so the XOR of all the words it
returns equals the pool's, on ragged rows with partial pages, static and claimed, launch after
launch (the claimed mode resets its counters for the next launch)."""
import numpy as np
import pytest


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [(0, 1), (0, 2), (0, 3), (1, 2), (2, 2)])
def test_page_read_reads_every_page_once(mode):
    import cupy as cp
    from cupy_kernels.cases import synthetic_layout
    from cupy_kernels.pages import kernel_tables
    from validation.decode_bench import LADDER
    from validation.decode_floor import page_read_module, page_reader, pool_xor
    tables = kernel_tables(LADDER, 128, codebook="uniform")
    lay = synthetic_layout(3, 2, 700, tables, {3: 400, 1: 250, 5: 50}, seed=1)
    rng = np.random.default_rng(2)
    pages = cp.asarray(rng.integers(0, 256, (lay.page_tier.size, 4096), dtype=np.uint8))
    state = dict(pages=pages, indptr=cp.asarray(lay.indptr), indices=cp.asarray(lay.indices),
                 page_count=cp.asarray(lay.page_count))
    want = pool_xor(pages)
    get = page_read_module()
    for splits in (1, 3):
        run, out = page_reader(get, mode, state, splits)
        for _ in range(3):
            out.fill(0)
            run()
            got = np.bitwise_xor.reduce(out.get(), axis=0)
            assert np.array_equal(got, want), (mode, splits)
    # a pool page the table does not name is not read by the table's modes
    extra = cp.concatenate([pages, cp.asarray(rng.integers(0, 256, (1, 4096), dtype=np.uint8))])
    state["pages"] = extra
    run, out = page_reader(get, mode, state, 2)
    run()
    got = np.bitwise_xor.reduce(out.get(), axis=0)
    assert not np.array_equal(pool_xor(extra), want)
    assert np.array_equal(got, pool_xor(extra) if mode[0] == 2 else want)
