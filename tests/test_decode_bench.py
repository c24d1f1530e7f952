"""CPU checks of the decode benchmark's outputs (validation/decode_bench.py,
validation/plot_decode.py); the benchmark itself runs on the GPU."""
import json

import pytest

from validation.plot_decode import RESULTS, decode_rows, floor_us, plot


def test_decode_plot_draws_the_committed_benchmark(tmp_path):
    """The decode picture is drawn from the committed H200 rows: one panel per shape, the
    default ADA kernel of each codebook per tier, the peers of the same run, and the floor
    (bytes at copy bandwidth), which every measured time must lie above."""
    rows = json.loads((RESULTS / "decode_h200.json").read_text())
    shapes = decode_rows(rows)
    assert list(shapes) == [(32, 8192), (8, 32768), (2, 131072), (1, 131072)]
    for got in shapes.values():
        assert {"sdpa_bf16"} <= set(got)
        assert len(got["ada"]) == 8          # 4 tier sets x 2 codebooks, defaults only
        for r in got["ada"].values():
            assert r["default"] and 0 < floor_us(r) < r["us"]
    png = tmp_path / "decode.png"
    plot(rows, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="no default ADA rows"):
        plot([r for r in rows if r["method"] != "ada"], tmp_path / "none.png")


@pytest.mark.parametrize("order", ["shuffled", "contiguous", "strided"])
def test_synthetic_layout_orders_place_every_page_once(order):
    """The benchmark pools' page orders (validation.decode_cases.synthetic_layout): each one uses
    every page id once, keeps each row's pages in order with the states that go to them, and
    places a row's pages as named: one run of ids (contiguous), every rows-th id (strided), or
    a seeded permutation (shuffled: the same for a seed, not a run)."""
    import numpy as np
    from validation.decode_cases import synthetic_layout
    from cupy_kernels.kernel_tables import kernel_tables
    from validation.decode_bench import LADDER
    tables = kernel_tables(LADDER, 128, codebook="uniform")
    counts = {3: 100, 1: 70}   # 4/4 and 2/2 states per row: full and partial pages of both
    lay = synthetic_layout(2, 3, 170, tables, counts, seed=5, order=order)
    rows, npr = 6, lay.indptr[1]
    ids = lay.indices.reshape(rows, npr)
    assert sorted(lay.indices.tolist()) == list(range(rows * npr))
    assert np.array_equal(lay.indptr, np.arange(rows + 1) * npr)
    # every state goes to a page of its own row, in the row's page order
    state_row = np.repeat(np.arange(rows), 170)
    pos = {int(p): (r, k) for r in range(rows) for k, p in enumerate(ids[r])}
    where = np.array([pos[int(p)] for p in lay.dst_page])
    assert np.array_equal(where[:, 0], state_row)
    assert np.all(np.diff(where[:, 1].reshape(rows, 170), axis=1) >= 0)
    assert np.all(lay.page_count[lay.indices] > 0)
    if order == "contiguous":
        assert np.array_equal(ids, np.arange(rows * npr).reshape(rows, npr))
    elif order == "strided":
        assert np.array_equal(ids, np.arange(rows * npr).reshape(npr, rows).T)
    else:
        again = synthetic_layout(2, 3, 170, tables, counts, seed=5, order=order)
        assert np.array_equal(again.indices, lay.indices)
        assert not np.array_equal(ids, np.arange(rows * npr).reshape(rows, npr))
    with pytest.raises(ValueError, match="order must be"):
        synthetic_layout(2, 3, 170, tables, counts, order="sorted")


def test_synthetic_layout_moves_the_last_page():
    """``last_page_at`` moves each row's last page (the top tier's partial one) to the given
    place of the row's page list; the states still go to the pages that hold them, and the
    pool and its counts are the same as without it."""
    import numpy as np
    from validation.decode_cases import synthetic_layout
    from cupy_kernels.kernel_tables import kernel_tables
    from validation.decode_bench import LADDER
    tables = kernel_tables(LADDER, 128, codebook="uniform")
    per = tables.states_per_page(3)
    base = synthetic_layout(2, 2, 3 * per + 5, tables, {3: 3 * per + 5}, seed=3)
    for at in (0, 2):
        lay = synthetic_layout(2, 2, 3 * per + 5, tables, {3: 3 * per + 5}, seed=3, last_page_at=at)
        counts = lay.page_count[lay.indices].reshape(4, 4)
        assert (counts[:, at] == 5).all() and (np.delete(counts, at, axis=1) == per).all()
        assert np.array_equal(np.bincount(lay.dst_page, minlength=lay.page_tier.size), lay.page_count)
        assert np.array_equal(np.sort(lay.page_count), np.sort(base.page_count))
    with pytest.raises(ValueError, match="last_page_at"):
        synthetic_layout(2, 2, 3 * per + 5, tables, {3: 3 * per + 5}, last_page_at=4)


def test_the_plugin_default_tier_has_a_case_of_its_own_ladder():
    """decode_bench --tiers 8/4 (the vLLM plugin's default tier): its pool is built with a
    ladder of its own whose tier 4 is (8, 4), every page of that tier, holding 8-bit keys and
    4-bit values; the other cases keep BENCH_LADDER and its tables."""
    import numpy as np
    from cupy_kernels.kernel_tables import kernel_tables
    from spherical_kv_ref.tiers import TierLadder
    from validation.decode_cases import BENCH_LADDER, bench_ladder, bench_layout
    assert bench_ladder("4/4") is BENCH_LADDER and bench_ladder("rdr-mix") is BENCH_LADDER
    ladder = bench_ladder("8/4")
    assert ladder[3] == (8, 4)
    tables = kernel_tables(ladder, 128, codebook="uniform")
    lay = bench_layout(2, 300, "8/4", tables)
    assert np.all(lay.page_tier[lay.indices] == 4)
    per = TierLadder(ladder).states_per_page(4, 128, tables.page_bytes)
    assert lay.indices.size == 2 * 8 * -(-300 // per)        # 8 kv-heads a sequence
