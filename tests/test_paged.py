"""Page pool, page tables, re-tiering and the numba paged decode (docs/design.md §4, §6)."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from spherical_kv_ref import SphericalCodec, TierLadder, attention
from spherical_kv_ref.paged import (PagedKV, PageTable, PoolExhaustedError, encode_rotated,
                                    mixed_tier_attention, page_layout, stored_rotated)
from spherical_kv_ref.paged_decode import PagedDecodeTables, paged_decode

from strategies_paged import (LADDERS, assert_same, codec_factory, kv_like, ladders, seeds,
                              sizes, snapshot)

D = 32
REL = 1e-10     # float64 everywhere: the paged and flat sums differ by summation order only


def build_row(ladder, n, rng, page_bytes=1024, num_pages=64, centre=True, key="r",
              paged=None, dim=D):
    """A PagedKV with one row of n states appended at the top tier (in two chunks)."""
    paged = paged or PagedKV(ladder, dim, page_bytes, num_pages)
    cf = codec_factory(dim)
    k = kv_like(rng, n, dim, offset=1.5)
    v = kv_like(rng, n, dim, offset=-0.5)
    mk = k[: max(1, n // 2)].mean(0) if centre else None
    mv = v[: max(1, n // 2)].mean(0) if centre else None
    kb, vb = ladder.bits(ladder.top)
    paged.add_row(key)
    cut = n // 3
    for sl in (slice(0, cut), slice(cut, n)):
        if sl.stop > sl.start:
            paged.append(key, cf(kb, 0).encode(k[sl], mean=mk), cf(vb, 1).encode(v[sl], mean=mv),
                         np.arange(sl.start, sl.stop))
    return paged, cf, mk, mv


def flat_reference(paged, key, cf, q, mk, mv, scale):
    parts = [(ke, ve, cf(paged.ladder.bits(t)[0], 0), cf(paged.ladder.bits(t)[1], 1))
             for t, (ke, ve, _) in paged.gather(key).items()]
    return mixed_tier_attention(q, parts, mk, mv, softmax_scale=scale, return_lse=True)


def run_paged(paged, key, cf, q, mk, mv, scale, num_splits):
    kc, vc = cf(16, 0), cf(16, 1)      # the rotation does not depend on the bits
    q_rot = kc.rotate_query(q)[None]
    q_mu = (q @ np.float64(np.float32(mk)) if mk is not None else np.zeros(q.shape[0]))[None]
    acc, lse = paged_decode(paged, paged.page_table([key]), q_rot, q_mu,
                            PagedDecodeTables(paged), scale, num_splits)
    out = vc.rotation.inverse(acc[0])
    if mv is not None:
        out = out + np.float64(np.float32(mv))
    return out, lse[0]


def rel_err(a, b):
    return np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300)


# ------------------------------------------------------------------------ layout

@pytest.mark.parametrize("tiers", LADDERS)
@pytest.mark.parametrize("page_bytes", [512, 4096])
def test_layout_matches_format(tiers, page_bytes):
    ladder = TierLadder(tiers)
    for t, lay in enumerate(page_layout(ladder, 64, page_bytes)[1:], start=1):
        kb, vb = ladder.bits(t)
        p = ladder.states_per_page(t, 64, page_bytes)
        assert lay.states_per_page == p
        assert lay.value_codes_offset == p * lay.key_code_bytes
        end = p * (lay.key_code_bytes + lay.value_code_bytes)
        assert lay.key_scales_offset == (end if kb != 16 else -1)
        if vb != 16:
            assert lay.value_scales_offset == end + (2 * p if kb != 16 else 0)
            end = lay.value_scales_offset + 2 * p
        elif kb != 16:
            end = lay.key_scales_offset + 2 * p
        assert end <= page_bytes


def test_page_bytes_hold_the_codec_output_verbatim():
    rng = np.random.default_rng(1)
    ladder = TierLadder(LADDERS[0])
    paged, cf, mk, mv = build_row(ladder, 5, rng, page_bytes=512)
    paged.retier([("r", np.array([1, 1, 1, 5, 5]), cf)])
    page = [p for p in paged.pages("r") if paged.pool.page_tier[p] == 1][0]
    lay = paged.pool.layout[1]
    ke, ve, pos = paged.gather("r")[1]
    raw = paged.pool.data[page]
    np.testing.assert_array_equal(raw[:3 * lay.key_code_bytes].view(np.uint32).reshape(3, -1), ke.codes)
    o = lay.value_codes_offset
    np.testing.assert_array_equal(raw[o:o + 3 * lay.value_code_bytes].view(np.uint32).reshape(3, -1), ve.codes)
    o = lay.key_scales_offset
    np.testing.assert_array_equal(raw[o:o + 6].view(np.float16), ke.scale)
    o = lay.value_scales_offset
    np.testing.assert_array_equal(raw[o:o + 6].view(np.float16), ve.scale)
    assert sorted(pos) == [0, 1, 2]
    assert paged.pool.page_count[page] == 3


def test_encode_rotated_equals_codec_encode():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((50, D)) * 3
    for bits in (1, 2, 3, 4, 8, 16):
        codec = SphericalCodec(D, bits, 7, layer=2, head=1)
        a = codec.encode(x)
        b = encode_rotated(codec, codec.rotation.apply(x))
        np.testing.assert_array_equal(a.codes, b.codes)
        np.testing.assert_array_equal(a.scale, b.scale)
    # demotion from the stored fp16 state is re-encoding the stored rotated vector
    top = SphericalCodec(D, 16, 7)
    low = SphericalCodec(D, 4, 7)
    y = stored_rotated(top, top.encode(x))
    np.testing.assert_array_equal(encode_rotated(low, y).codes, low.encode(top.decode(top.encode(x))).codes)


# ------------------------------------------------------------------------ paged = flat

@pytest.mark.parametrize("n", [1, 17, 97])
@pytest.mark.parametrize("num_splits", [1, 3, 64])
@pytest.mark.parametrize("centre", [True, False])
def test_paged_decode_equals_flat_single_tier(n, num_splits, centre):
    rng = np.random.default_rng(n * 7 + num_splits)
    ladder = TierLadder(LADDERS[0])
    paged, cf, mk, mv = build_row(ladder, n, rng, page_bytes=512, centre=centre)
    q = rng.standard_normal((3, D)) * 2
    out, lse = run_paged(paged, "r", cf, q, mk, mv, 0.3, num_splits)
    (ke, ve, _), = paged.gather("r").values()
    if centre:
        ke = type(ke)(ke.scale, ke.codes, ke.bits, ke.dim, np.float32(mk))
        ve = type(ve)(ve.scale, ve.codes, ve.bits, ve.dim, np.float32(mv))
    ref, ref_lse = attention(q, ke, ve, cf(16, 0), cf(16, 1), softmax_scale=0.3, return_lse=True)
    assert rel_err(out, ref) < REL
    assert rel_err(lse, ref_lse) < REL


@given(ladder=ladders, n=sizes, seed=seeds, num_splits=st.integers(1, 5),
       page_bytes=st.sampled_from([256, 512, 1024]), centre=st.booleans())
def test_paged_decode_equals_flat_mixed_tiers(ladder, n, seed, num_splits, page_bytes, centre):
    rng = np.random.default_rng(seed)
    paged, cf, mk, mv = build_row(ladder, n, rng, page_bytes=page_bytes, centre=centre)
    new = rng.integers(0, ladder.top + 1, n)
    new[rng.integers(n)] = rng.integers(1, ladder.top + 1)     # at least one state kept
    paged.retier([("r", new, cf)])
    paged.check_invariants()
    # a second, further demotion re-encodes from the already lowered states
    st_ = paged.states("r")
    lower = np.maximum(np.minimum(st_.tier, rng.integers(1, ladder.top + 1, len(st_))), 1)
    paged.retier([("r", lower, cf)])
    paged.check_invariants()
    assert np.array_equal(np.sort(paged.states("r").pos), np.flatnonzero(new > 0))
    q = rng.standard_normal((2, D)) * 2
    out, lse = run_paged(paged, "r", cf, q, mk, mv, 1 / np.sqrt(D), num_splits)
    ref, ref_lse = flat_reference(paged, "r", cf, q, mk, mv, 1 / np.sqrt(D))
    assert rel_err(out, ref) < REL
    assert rel_err(lse, ref_lse) < REL


def test_paged_decode_several_rows_in_one_table():
    rng = np.random.default_rng(3)
    ladder = TierLadder(LADDERS[0])
    paged, cf, mk, mv = build_row(ladder, 40, rng, key="a", page_bytes=512)
    _, _, mk2, mv2 = build_row(ladder, 9, rng, key="b", paged=paged)
    paged.retier([("a", np.repeat([1, 2, 3, 4, 5], 8), cf)])
    q = rng.standard_normal((2, D))
    table = paged.page_table(["a", "b"])
    assert table.indptr[-1] == table.indices.size
    q_rot = np.stack([cf(16, 0).rotate_query(q)] * 2)
    acc, _ = paged_decode(paged, table, q_rot, np.zeros((2, 2)), PagedDecodeTables(paged), 0.2, 2)
    for r, (key, m, v_) in enumerate((("a", mk, mv), ("b", mk2, mv2))):
        ref, _ = flat_reference(paged, key, cf, q, None, None, 0.2)
        assert rel_err(cf(16, 1).rotation.inverse(acc[r]), ref) < REL


# ------------------------------------------------------------------------ operations

def test_retier_never_promotes_and_changes_nothing_on_error():
    rng = np.random.default_rng(4)
    ladder = TierLadder(LADDERS[0])
    paged, cf, _, _ = build_row(ladder, 20, rng)
    paged.retier([("r", np.full(20, 2), cf)])
    before = snapshot(paged)
    with pytest.raises(ValueError, match="promot"):
        paged.retier([("r", np.full(20, 3), cf)])
    with pytest.raises(ValueError, match="one per kept state"):
        paged.retier([("r", np.full(19, 1), cf)])
    with pytest.raises(ValueError, match="no row"):
        paged.retier([("zz", np.full(20, 1), cf)])
    assert_same(before, snapshot(paged))


def test_pool_exhaustion_is_an_error_and_leaves_pool_unchanged():
    rng = np.random.default_rng(5)
    ladder = TierLadder(LADDERS[0])
    per = ladder.states_per_page(ladder.top, D, 512)
    paged, cf, mk, mv = build_row(ladder, 3 * per - 1, rng, page_bytes=512, num_pages=4)
    before = snapshot(paged)
    k = rng.standard_normal((per + 2, D))
    with pytest.raises(PoolExhaustedError, match="need 2 free pages, have 1"):
        paged.append("r", cf(16, 0).encode(k, mean=mk), cf(16, 1).encode(k, mean=mv), np.arange(100, 100 + per + 2))
    assert_same(before, snapshot(paged))
    # the pool stays usable: what fits still goes in, filling the open page first
    paged.append("r", cf(16, 0).encode(k[:per + 1]), cf(16, 1).encode(k[:per + 1]), np.arange(100, 101 + per))
    assert paged.pool.num_free == 0
    paged.check_invariants()


def test_retier_that_needs_more_pages_than_the_pool_has():
    rng = np.random.default_rng(6)
    ladder = TierLadder(((8, 8), (16, 16)))
    per_top = ladder.states_per_page(2, D, 256)
    paged, cf, _, _ = build_row(ladder, per_top, rng, page_bytes=256, num_pages=2)
    _, _, _, _ = build_row(ladder, per_top, rng, key="s", paged=paged)
    assert paged.pool.num_free == 0
    before = snapshot(paged)
    # one state demoted: the top tier keeps one page, the lower tier needs a second one
    new = np.full(per_top, 2)
    new[0] = 1
    with pytest.raises(PoolExhaustedError):
        paged.retier([("r", new, cf)])
    assert_same(before, snapshot(paged))


def test_compact_repacks_partial_pages():
    rng = np.random.default_rng(7)
    ladder = TierLadder(LADDERS[0])
    paged, cf, mk, mv = build_row(ladder, 3, rng, page_bytes=512)
    q = rng.standard_normal((2, D))
    ref, _ = flat_reference(paged, "r", cf, q, mk, mv, 0.2)
    # split the row's states over three partly filled pages by hand
    (page,) = paged.pages("r")
    ke, ve, pos = paged.pool.read(page)
    extra = paged.pool.allocate(2, ladder.top)
    for j, p in enumerate(extra):
        paged.pool.write(p, 0, ke.take(slice(j + 1, j + 2)), ve.take(slice(j + 1, j + 2)), pos[j + 1:j + 2])
    paged.pool.page_count[page] = 1
    paged.rows["r"].extend(extra)
    with pytest.raises(AssertionError, match="3 pages for 3 states"):
        paged.check_invariants()
    assert paged.compact("r", ladder.top) == 2
    paged.check_invariants()
    assert paged.compact("r", ladder.top) == 0
    out, _ = run_paged(paged, "r", cf, q, mk, mv, 0.2, 2)
    assert rel_err(out, ref) < REL


def test_page_table_errors():
    rng = np.random.default_rng(8)
    ladder = TierLadder(LADDERS[0])
    paged, cf, _, _ = build_row(ladder, 10, rng, num_pages=8)
    tables = PagedDecodeTables(paged)
    q = np.zeros((1, 1, D))
    qmu = np.zeros((1, 1))
    bad = [PageTable(np.array([0, 1], np.int32), np.array([8], np.int32), np.array([1], np.int32)),
           PageTable(np.array([0, 1], np.int32), np.array([-1], np.int32), np.array([1], np.int32)),
           PageTable(np.array([0, 1], np.int32), np.array([5], np.int32), np.array([1], np.int32)),
           PageTable(np.array([0, 2], np.int32), np.array([0], np.int32), np.array([1], np.int32)),
           PageTable(np.array([0, 0], np.int32), np.zeros(0, np.int32), np.array([0], np.int32))]
    msgs = ["outside 0..7", "outside 0..7", "free page 5", "indptr", "no kept state"]
    before = snapshot(paged)
    for table, msg in zip(bad, msgs):
        with pytest.raises(ValueError, match=msg):
            paged_decode(paged, table, q, qmu, tables, 0.1)
    with pytest.raises(ValueError, match="q_rot"):
        paged_decode(paged, paged.page_table(["r"]), np.zeros((1, 1, D + 1)), qmu, tables, 0.1)
    assert_same(before, snapshot(paged))


def test_free_row_returns_every_page():
    rng = np.random.default_rng(9)
    ladder = TierLadder(LADDERS[1])
    paged, cf, _, _ = build_row(ladder, 97, rng, page_bytes=512, num_pages=64)
    paged.retier([("r", rng.integers(0, 5, 97), cf)])
    paged.free_row("r")
    assert paged.pool.num_free == paged.pool.num_pages
    assert not paged.pool.page_tier.any()
    with pytest.raises(ValueError, match="no row"):
        paged.append("r", cf(16, 0).encode(np.ones((1, D))), cf(16, 1).encode(np.ones((1, D))), [0])
    paged.check_invariants()


@pytest.mark.parametrize("tiers", LADDERS + (TierLadder.DEFAULT,))
@pytest.mark.parametrize("dim, page_bytes", [(64, 4096), (128, 4096), (64, 1024)])
def test_layout_agrees_with_the_kernel_geometry(tiers, dim, page_bytes):
    """The reference pages and the CUDA launchers' geometry table describe the same bytes."""
    pages = pytest.importorskip("cupy_kernels.kernel_tables")
    ladder = TierLadder(tiers)
    geom = pages.kernel_tables(ladder, dim, page_bytes).geom
    for t, lay in enumerate(page_layout(ladder, dim, page_bytes)[1:], start=1):
        assert list(geom[t]) == [lay.key_bits, lay.value_bits, lay.states_per_page, lay.key_words,
                                 lay.value_words, lay.value_codes_offset // 4,
                                 lay.key_scales_offset, lay.value_scales_offset]


@pytest.mark.parametrize("tiers", LADDERS + (TierLadder.DEFAULT,))
@pytest.mark.parametrize("dim, page_bytes", [(64, 4096), (32, 1024)])
def test_decode_tables_and_engine_blocks_read_the_one_geometry(tiers, dim, page_bytes):
    """The numba decode's tables and the engine's block format carry page_layout's numbers
    (in words and halves where the decode reads them so), nothing of their own."""
    from spherical_kv_ref.engine import BlockFormat
    from spherical_kv_ref.paged import tier_layout
    ladder = TierLadder(tiers)
    lay = page_layout(ladder, dim, page_bytes)
    tab = PagedDecodeTables.for_layout(lay, dim)
    for t in range(1, len(ladder) + 1):
        x = lay[t]
        assert x == tier_layout(t, *ladder.bits(t), dim, page_bytes)
        assert (tab.key_bits[t], tab.value_bits[t], tab.per_page[t]) == \
            (x.key_bits, x.value_bits, x.states_per_page)
        assert (tab.key_words[t], tab.value_words[t], tab.value_codes_off[t]) == \
            (x.key_words, x.value_words, x.value_codes_offset // 4)
        for off, half in ((x.key_scales_offset, tab.key_scales_off[t]),
                          (x.value_scales_offset, tab.value_scales_off[t])):
            assert half == (off // 2 if off >= 0 else -1)
        fmt = BlockFormat(*ladder.bits(t), dim, 2, block_size=16)
        assert fmt.layout == tier_layout(1, *ladder.bits(t), dim, fmt.page_bytes)
        assert fmt.layout.states_per_page == 16
