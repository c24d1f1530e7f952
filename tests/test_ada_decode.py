"""GPU tests of the ADA paged decode kernel against the NumPy reference (docs/design.md §6).

Tolerance (docs/PERF_NOTES.md "Error budget"): the kernel rounds the rotated query, the
codebook levels and the softmax weights times value scales to fp16 (relative error 2^-11
each) and accumulates in fp32. Per query head this bounds the output error by
2^-10 * (1 + 2 * softmax_scale * |q| * max r_K) * max |v_hat| (``DecodeCase.error_scale``);
the tests allow twice that. Independent roundings make the typical error far smaller, so a
second check bounds the error relative to that scale on average (catches wrong indexing that
the worst-case bound would hide).
"""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from cupy_kernels._module import DIMS as KERNEL_DIMS   # importable without CuPy

pytestmark = pytest.mark.gpu

LADDER = [(2, 2), (3, 2), (4, 2), (4, 3), (4, 4), (8, 8), (16, 16)]
WIDE_LADDER = [(1, 1), (2, 2), (3, 3), (4, 4), (8, 8), (16, 16)]
BOUND = 2.0 * 2.0 ** -10
# head dims with fast pages in the affine kernel (D = 256: built with SPHERICAL_KV_WIDE_FAST_PAGES=1;
# without it these cases run every D = 256 page on decode_page)
FAST_DIMS = [128, 256]


def _check(case, out, softmax_scale=None):
    ref = case.reference(softmax_scale)
    got = np.asarray(out.get() if hasattr(out, "get") else out.cpu().numpy(), np.float64)
    assert np.all(np.isfinite(got))
    err = np.linalg.norm(got - ref, axis=-1)
    scale = case.error_scale(softmax_scale)
    worst = float(np.max(err / scale))
    assert worst <= BOUND, f"worst error {worst:.3g} x scale > {BOUND:.3g}"
    assert float(np.mean(err / scale)) <= BOUND / 8


def _as_table_path(case):
    """The same uniform-codebook case decoded on the table path (which decodes any codebook)."""
    import dataclasses
    return dataclasses.replace(case, tables=dataclasses.replace(case.tables, codebook="uniform-table"))


def _check_against_table_path(case, splits, softmax_scale):
    """One affine-path decode of a uniform-codebook case against the table path's decode of
    the same pool (same codes, other fp16 roundings: within the error budget) and against
    the reference."""
    from validation.decode_cases import run_case
    a = run_case(case, num_splits=splits, softmax_scale=softmax_scale)
    b = run_case(_as_table_path(case), num_splits=splits, softmax_scale=softmax_scale).get()
    diff = np.linalg.norm(a.get().astype(np.float64) - b, axis=-1)
    assert float(np.max(diff / case.error_scale(softmax_scale))) <= BOUND
    _check(case, a, softmax_scale)


@st.composite
def decode_shapes(draw):
    dim = draw(st.sampled_from(KERNEL_DIMS))
    group = draw(st.sampled_from([1, 4, 8]))
    hkv = draw(st.integers(1, 2))
    batch = draw(st.integers(1, 3))
    lengths = draw(st.lists(st.integers(1, 400), min_size=batch * hkv, max_size=batch * hkv))
    ladder = draw(st.sampled_from([LADDER, WIDE_LADDER]))
    tiers = draw(st.lists(st.integers(1, len(ladder)), min_size=1, max_size=4, unique=True))
    return dict(batch=batch, num_kv_heads=hkv, group=group, dim=dim, lengths=lengths,
                ladder=ladder, tier_choices=tiers, seed=draw(st.integers(0, 2 ** 16)),
                centred=draw(st.booleans()),
                codebook=draw(st.sampled_from(["lloyd-max", "uniform"])))


@settings(max_examples=40, deadline=None)
@given(shape=decode_shapes(), splits=st.sampled_from([None, 1, 2, 5]))
def test_matches_reference(shape, splits):
    from validation.decode_cases import build_case, run_case
    case = build_case(**shape)
    _check(case, run_case(case, num_splits=splits))


@pytest.mark.parametrize("codebook", ["lloyd-max", "uniform"])
def test_long_rows_split_k_and_softmax_scale(codebook):
    from validation.decode_cases import build_case, run_case
    case = build_case(1, 2, 4, 128, [3000, 1700], LADDER, [1, 5, 7], seed=3, centred=True,
                      codebook=codebook)
    _check(case, run_case(case, num_splits=16, softmax_scale=0.3), softmax_scale=0.3)
    _check(case, run_case(case))


@pytest.mark.parametrize("dim", KERNEL_DIMS)
def test_uniform_every_bit_width(dim):
    """The affine path at every bit width (1, 2, 3, 4, 8 and the fp16 top tier), one tier per
    case, with partial pages (read in place) and full pages (staged)."""
    from validation.decode_cases import build_case, run_case
    for tier in range(1, len(WIDE_LADDER) + 1):
        case = build_case(2, 2, 8, dim, [700, 129, 33, 410], WIDE_LADDER, [tier], seed=tier,
                          centred=tier % 2 == 0, codebook="uniform")
        _check(case, run_case(case, num_splits=1))
        _check(case, run_case(case, num_splits=3))


@pytest.mark.parametrize("dim", KERNEL_DIMS)
def test_affine_and_table_paths_agree_on_every_width(dim):
    """The affine path (u = c - 2^(B-1) plus the per-head corrections, lazy running maximum,
    q . mu_K left out) and the table path decode the same uniform pool to the kernels'
    rounding scale, on tiers of every width, with partial pages, one split and several."""
    from validation.decode_cases import build_case
    case = build_case(2, 2, 4, dim, [1000, 37, 515, 300], WIDE_LADDER, [1, 2, 3, 4, 5, 6],
                      seed=31, centred=True, codebook="uniform")
    for splits in (1, 4):
        _check_against_table_path(case, splits, None)


@pytest.mark.parametrize("codebook", ["lloyd-max", "uniform"])
def test_peaked_softmax_lazy_maximum(codebook):
    """A softmax scale 45x the usual one spreads the logits over hundreds of log2 units, so
    the running maximum keeps moving by more than the affine path's lazy slack deep into each row (every
    such step rescales the accumulators) and p = 2^(z - m) spans the whole fp32 range."""
    from validation.decode_cases import build_case, run_case
    case = build_case(1, 2, 8, 128, [2500, 900], WIDE_LADDER, [2, 3, 4, 5, 6], seed=41,
                      centred=True, codebook=codebook)
    for splits in (1, 3):
        _check(case, run_case(case, num_splits=splits, softmax_scale=4.0), softmax_scale=4.0)


@pytest.mark.parametrize("dim", FAST_DIMS)
@pytest.mark.parametrize("softmax_scale", [None, 4.0])
def test_affine_fast_44_pages_and_domain_changes(softmax_scale, dim):
    """The affine kernel decodes full 4/4 pages on their fast path (codes as fp16 subnormals,
    accumulators in the "F domain"), full 3/3 and 2/2 pages on theirs (the "F2" domain) and
    every other page on decode_page; pages of 4/4, 2/2, 3/3, 8/8 and the fp16 tier interleave
    in each row (many chunks, shuffled page order), so the accumulators change domain many
    times, next to long pure-4/4 rows (one split and several). Against the reference and
    against the table path (same codes, other fp16 roundings)."""
    from validation.decode_cases import build_case
    case = build_case(2, 2, 8, dim, [1300, 640, 31, 2000], WIDE_LADDER, [2, 3, 4, 5, 6],
                      seed=57, centred=True, codebook="uniform", chunks_per_row=12)
    pure = build_case(1, 2, 4, dim, [3100, 62], WIDE_LADDER, [4], seed=58, codebook="uniform")
    for c in (case, pure):
        for splits in (1, 2, 7, 40):
            _check_against_table_path(c, splits, softmax_scale)


@pytest.mark.parametrize("dim", FAST_DIMS)
@pytest.mark.parametrize("softmax_scale", [None, 4.0])
def test_affine_fast_33_and_22_pages(softmax_scale, dim):
    """The affine kernel decodes full 3/3 and 2/2 pages (D = 128: page_f2; 256: page33w,
    page22w) on their own fast path (2-bit fields as fp16 subnormals, the 3-bit plane bit merged
    into the field; accumulators in the "F2" domain; at D = 128 40 and 60 states per page, at 256
    20 and 31, the last sub-tile partly empty): rows whose pages of
    every tier of the wide ladder (1/1, 8/8, 16/16 generic; 4/4 on its own fast path, another
    domain) and partial pages interleave, and pure 3/3 and 2/2 rows of many full pages and one
    partial page, at 1, 2, 7 and 40 splits. Against the reference and against the table path
    (same codes, other fp16 roundings). Page padding is random, so a read of a non-state slot that were not
    masked would show."""
    from validation.decode_cases import build_case
    mixed = build_case(2, 2, 8, dim, [1500, 700, 41, 2400], WIDE_LADDER, [1, 2, 3, 4, 5, 6],
                       seed=61, centred=True, codebook="uniform", chunks_per_row=16)
    pure3 = build_case(1, 2, 4, dim, [4000, 39], WIDE_LADDER, [3], seed=62, centred=True,
                       codebook="uniform")
    pure2 = build_case(1, 2, 8, dim, [6000, 61], WIDE_LADDER, [2], seed=63, codebook="uniform")
    for c in (mixed, pure3, pure2):
        for splits in (1, 2, 7, 40):
            _check_against_table_path(c, splits, softmax_scale)


@pytest.mark.parametrize("dim", FAST_DIMS)
@pytest.mark.parametrize("softmax_scale", [None, 4.0])
def test_affine_fast_88_and_1616_pages(softmax_scale, dim):
    """The affine kernel decodes full 8/8 pages (page_f8, page88w: bytes as fp16 subnormals,
    accumulators in the 4/4 path's F44 domain, the odd blocks' operands times 16) and full 16/16
    pages (page_f16, page1616w: the fp16 words straight into the mma, generic domain) on their
    own fast paths (D = 128, 256): rows
    where pages of every tier of the wide ladder and partial pages interleave (shuffled page
    order: the accumulators change domain often), rows of 4/4, 8/8 and 16/16 pages only
    (4/4 and 8/8 share a domain), pure 8/8 and 16/16 rows of many full pages and one partial
    page, and a row in chunk order (pages ordered as the cache lays them), at 1, 2, 3, 7 and 40
    splits. Against the reference and against the table path (same codes, other fp16 roundings). Page
    padding is random: a read of a non-state slot that were not masked would show."""
    from validation.decode_cases import build_case
    mixed = build_case(2, 2, 8, dim, [1500, 900, 37, 2600], WIDE_LADDER, [1, 2, 3, 4, 5, 6],
                       seed=71, centred=True, codebook="uniform", chunks_per_row=16)
    wide = build_case(1, 2, 8, dim, [2200, 1700], WIDE_LADDER, [4, 5, 6], seed=72,
                      centred=True, codebook="uniform", chunks_per_row=12)
    pure8 = build_case(1, 2, 4, dim, [3000, 46], WIDE_LADDER, [5], seed=73, centred=True,
                       codebook="uniform")
    pure16 = build_case(1, 2, 8, dim, [1200, 13], WIDE_LADDER, [6], seed=74, codebook="uniform")
    ordered = build_case(1, 2, 8, dim, [2900, 2100], WIDE_LADDER, [2, 3, 4, 5, 6], seed=75,
                         codebook="uniform", chunks_per_row=10, shuffle=False)
    for c in (mixed, wide, pure8, pure16, ordered):
        for splits in (1, 2, 3, 7, 40):
            _check_against_table_path(c, splits, softmax_scale)


def test_affine_ladder_longer_than_the_geometry_lanes():
    """The affine kernel holds geometry rows 0-15 in lanes at kernel entry and reads the row of
    a page of a higher tier from the table: the longest ladder (18 tiers, one per state size)
    with pages of tiers 1, 4, 7 (4/4, fast path), 12 (8/8), 15, 16, 17 and 18 (16/16, fast path)
    interleaved, at 1, 3 and 40 splits, against the reference and the table path."""
    from validation.decode_cases import build_case
    ladder = [(1, 1), (1, 2), (1, 3), (1, 4), (2, 4), (3, 4), (4, 4), (1, 8), (2, 8), (3, 8),
              (4, 8), (8, 8), (1, 16), (2, 16), (3, 16), (4, 16), (8, 16), (16, 16)]
    case = build_case(2, 2, 8, 128, [1300, 2100, 57, 900], ladder, [1, 4, 7, 12, 15, 16, 17, 18],
                      seed=91, centred=True, codebook="uniform", chunks_per_row=16)
    for splits in (1, 3, 40):
        _check_against_table_path(case, splits, None)


def test_affine_split_partition_covers_every_page_once():
    """The affine kernel's splits take a row's pages interleaved (warp w of split s: pages 4s + w + 4Sk): at
    any split count the CTAs together decode every page exactly once. Compared with one split
    (every page in one CTA) far more tightly than the error budget: the outputs differ only by
    fp32 summation order and the fp16 rounding of P' against other running maxima (~2e-4 of a
    head's output), while a page missed or read twice moves a head by about its share of the
    softmax weight times its values (rows of 100 to 3000 states, a page is 0.3-30 % of a row:
    >= 1e-2 of the output; no centring, so the output is not dominated by mu_V). Rows shorter
    than 4S pages leave splits and warps empty."""
    from validation.decode_cases import build_case, run_case
    cases = [build_case(2, 2, 8, 128, [3000, 100, 777, 1900], WIDE_LADDER, [1, 2, 3, 4, 5, 6],
                        seed=81, codebook="uniform", chunks_per_row=9),
             build_case(1, 2, 4, 128, [2500, 400], WIDE_LADDER, [3, 4, 5], seed=82,
                        codebook="uniform", chunks_per_row=4, shuffle=False)]
    for c in cases:
        one = run_case(c, num_splits=1).get().astype(np.float64)
        for splits in (2, 3, 5, 17, 64, 130):
            got = run_case(c, num_splits=splits).get().astype(np.float64)
            rel = np.linalg.norm(got - one, axis=-1) / np.linalg.norm(one, axis=-1)
            assert float(np.max(rel)) <= 5e-3, (splits, float(np.max(rel)))


def test_default_splits_per_path():
    """The affine path's default split count rounds down to whole waves of resident CTAs
    (one wave); the table path's rounds up to about two waves."""
    import math
    from cupy_kernels import kernel_tables
    from cupy_kernels.ada_decode import AFFINE_PATH, TABLE_PATH, _sm_count, splits_for
    uniform = kernel_tables(LADDER, 128, codebook="uniform")
    table = kernel_tables(LADDER, 128)
    for rows, pages in ((64, 64 * 1058), (256, 256 * 265), (16, 16 * 4229), (8, 8 * 4229)):
        slots = AFFINE_PATH.waves * AFFINE_PATH.ctas_per_sm * _sm_count()
        s = splits_for(uniform, rows, pages)
        assert rows * s <= slots < rows * (s + 1)
        target = TABLE_PATH.waves * TABLE_PATH.ctas_per_sm * _sm_count()
        assert splits_for(table, rows, pages) == min(math.ceil(target / rows), pages // rows // 8, 256)


@pytest.mark.parametrize("codebook", ["lloyd-max", "uniform"])
def test_merge_many_splits(codebook):
    """The merges (the affine path's one CTA per head and row, splits in four groups; the
    table path's one CTA per row) with more splits than pages (empty splits: lse = -inf),
    and beyond the per-head merge's 256-split limit (then the per-row merge)."""
    from validation.decode_cases import build_case, run_case
    case = build_case(1, 2, 8, 128, [3100, 300], WIDE_LADDER, [2, 4], seed=59, centred=True,
                      codebook=codebook)
    for splits in (5, 64, 256, 300):
        _check(case, run_case(case, num_splits=splits))


def test_uniform_and_table_paths_agree_on_uniform_codes():
    """The table path decodes any codebook: on a uniform pool it must agree with the affine
    path to the kernels' rounding scale (different fp16 roundings, same attention)."""
    from validation.decode_cases import build_case
    case = build_case(1, 2, 4, 128, [900, 300], LADDER, [1, 2, 3, 5, 7], seed=21,
                      codebook="uniform")
    _check_against_table_path(case, 2, None)


def test_affine_path_rejects_non_affine_levels():
    import dataclasses
    from cupy_kernels.kernel_tables import kernel_tables, uniform_half_steps
    lm = kernel_tables(LADDER, 128)
    with pytest.raises(ValueError):
        uniform_half_steps(dataclasses.replace(lm, codebook="uniform"))
    hs = uniform_half_steps(kernel_tables(LADDER, 128, codebook="uniform"))
    assert hs.shape == (5,) and np.all(hs > 0)


def test_paged_vs_flat():
    """The same encoded states in shuffled scattered pages (random filler bytes) and in one
    ordered pool (one chunk per row and tier) agree up to fp32 summation order."""
    import copy
    import cupy as cp
    from cupy_kernels import pack_pages
    from validation.decode_cases import build_case, run_case
    scattered = build_case(2, 2, 4, 128, [250, 31, 93, 400], LADDER, [1, 5, 7], seed=11,
                           shuffle=True, fill_random=True)
    tier_of = {bits: t for t, bits in enumerate(LADDER, start=1)}
    rows = []
    for parts in scattered.parts:
        by_tier = {}
        for ke, ve, _, _ in parts:
            by_tier.setdefault(tier_of[(ke.bits, ve.bits)], []).append((ke, ve))
        chunks = []
        for t, encs in sorted(by_tier.items()):
            from spherical_kv_ref import Encoded
            ke = Encoded(np.concatenate([k.scale for k, _ in encs]),
                         np.concatenate([k.codes for k, _ in encs]), encs[0][0].bits, 128)
            ve = Encoded(np.concatenate([v.scale for _, v in encs]),
                         np.concatenate([v.codes for _, v in encs]), encs[0][1].bits, 128)
            chunks.append((t, ke, ve))
        rows.append(chunks)
    flat = copy.copy(scattered)
    flat.packed = pack_pages(rows, scattered.tables, rng=None, fill=0)
    assert flat.packed.indices.size <= scattered.packed.indices.size
    a = run_case(scattered, num_splits=1).get()
    b = run_case(flat, num_splits=3).get()
    # Another page order changes the running maxima, so the fp16 roundings of p * s_V differ:
    # the two agree to the kernel's own rounding scale, not to fp32 summation order.
    diff = np.linalg.norm(a.astype(np.float64) - b, axis=-1)
    assert float(np.max(diff / scattered.error_scale())) <= BOUND
    _check(flat, cp.asarray(b))
    _check(scattered, cp.asarray(a))


def test_noncontiguous_and_torch_inputs():
    torch = pytest.importorskip("torch")
    import cupy as cp
    from validation.decode_cases import build_case, run_case, to_device
    case = build_case(2, 2, 4, 64, [40, 77, 5, 130], LADDER, [2, 5, 6], seed=5)
    dev = to_device(case)
    ref = run_case(case, dev, num_splits=1).get()
    big = cp.zeros((case.q.shape[1], 2, case.q.shape[0], 64), cp.float32)
    big[:, 1] = dev["q"].transpose(1, 0, 2)
    dev["q"] = big[:, 1].transpose(1, 0, 2)          # (batch, Hq, d) with odd strides
    assert not dev["q"].flags.c_contiguous
    got = run_case(case, dev, num_splits=1).get()
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6 * float(np.abs(ref).max()))
    tq = torch.from_dlpack(cp.ascontiguousarray(dev["q"])).to(torch.bfloat16)
    dev["q"] = tq
    out = run_case(case, dev, num_splits=2)
    assert isinstance(out, torch.Tensor) and out.is_cuda
    qb = tq.float().cpu().numpy()
    case.q = qb
    _check(case, cp.asarray(out))


@pytest.mark.parametrize("breakage", ["index_oob", "free_page", "count_too_big", "indptr_len",
                                      "indptr_decreasing", "indptr_end", "dtype", "group"])
def test_bad_page_tables_rejected(breakage):
    import cupy as cp
    from validation.decode_cases import build_case, run_case, to_device
    case = build_case(1, 2, 4, 128, [50, 70], LADDER, [5], seed=2, shuffle=False)
    dev = to_device(case)
    kw = {}
    if breakage == "index_oob":
        dev["indices"][1] = dev["page_tier"].shape[0] + 3
    elif breakage == "free_page":
        dev["page_tier"][int(dev["indices"][0])] = 0
    elif breakage == "count_too_big":
        dev["page_count"][int(dev["indices"][0])] = 10_000
    elif breakage == "indptr_len":
        dev["indptr"] = dev["indptr"][:-1]
    elif breakage == "indptr_decreasing":
        dev["indptr"][1] = dev["indptr"][2] + 1
    elif breakage == "indptr_end":
        dev["indptr"][-1] -= 1
    elif breakage == "dtype":
        dev["indices"] = dev["indices"].astype(cp.int64)
    elif breakage == "group":
        dev["q"] = cp.zeros((1, 18, 128), cp.float32)
    with pytest.raises(ValueError):
        run_case(case, dev, **kw)


@pytest.mark.parametrize("where", ["q_nan", "q_inf", "mean_k_nan", "mean_v_inf"])
def test_nonfinite_queries_and_means_rejected_before_launch(where):
    """NaN/Inf in the queries or the means is a ValueError before any launch (validate=True,
    the same host sync as the page table's checks): ``out`` keeps what it held. With
    validate=False (the graph path) nothing checks them: the call runs and its output is
    undefined (measured: finite numbers for a NaN query on the table path), which is why the
    check exists."""
    import cupy as cp
    from validation.decode_cases import build_case, run_case, to_device
    case = build_case(1, 2, 4, 128, [50, 70], LADDER, [5, 7], seed=4, centred=True)
    dev = to_device(case)
    part, what = where.split("_")[:-1], where.split("_")[-1]
    name = "_".join(part)
    bad = float("nan") if what == "nan" else float("inf")
    dev[name] = dev[name].copy()
    dev[name].reshape(-1)[5] = bad
    out = cp.full((1, 8, 128), 7.0, cp.float32)
    with pytest.raises(ValueError, match="NaN or Inf"):
        run_case(case, dev, out=out)
    assert bool(cp.all(out == 7.0))
    run_case(case, dev, out=out, validate=False)
    cp.cuda.Device().synchronize()


def _reference_lse(case, softmax_scale=None):
    """(batch, Hq) float64 natural-log log-sum-exp of the scaled logits (with q . mu_K), and
    per head the logit error scale 1 + softmax_scale |q| max r_K."""
    from validation.decode_cases import stored_radii
    from spherical_kv_ref.paged import mixed_tier_attention
    b, hq, d = case.q.shape
    g = hq // case.num_kv_heads
    sc = 1.0 / np.sqrt(d) if softmax_scale is None else softmax_scale
    lse, scale = np.zeros((b, hq)), np.zeros((b, hq))
    for r, parts in enumerate(case.parts):
        bi, h = divmod(r, case.num_kv_heads)
        qh = case.q[bi, h * g:(h + 1) * g].astype(np.float64)
        _, lse[bi, h * g:(h + 1) * g] = mixed_tier_attention(
            qh, parts, key_mean=None if case.mean_k is None else case.mean_k[r],
            value_mean=None if case.mean_v is None else case.mean_v[r],
            softmax_scale=softmax_scale, return_lse=True)
        scale[bi, h * g:(h + 1) * g] = 1.0 + sc * np.linalg.norm(qh, axis=1) * stored_radii(parts)[0]
    return lse, scale


@pytest.mark.parametrize("codebook,dim,group,centred", [("uniform", 128, 4, True),
                                                        ("uniform", 64, 8, False),
                                                        ("lloyd-max", 128, 1, True),
                                                        ("lloyd-max", 64, 4, False)])
def test_lse_matches_reference(codebook, dim, group, centred):
    """ada_decode(lse=...) writes each head's log-sum-exp of its scaled logits (q . mu_K
    included), within the logits' error budget of the reference's, at the default split count
    and at 2 and 5 splits; the outputs are those of a call without lse."""
    import cupy as cp
    from cupy_kernels.ada_decode import splits_for
    from validation.decode_cases import build_case, run_case, to_device
    case = build_case(2, 2, group, dim, [300, 45, 700, 12], LADDER, [1, 5, 7], seed=11,
                      centred=centred, codebook=codebook)
    dev = to_device(case)
    want, scale = _reference_lse(case, 0.2)
    for splits in (None, 2, 5):
        lse = cp.full((2, 2 * group), 7.0, cp.float32)
        out = run_case(case, dev, num_splits=splits, lse=lse, softmax_scale=0.2)
        err = np.abs(lse.get() - want) / scale
        assert np.max(err) <= BOUND, (splits, float(np.max(err)))
        ns = splits or max(2, splits_for(case.tables, 4, int(dev["indices"].size)))
        plain = run_case(case, dev, num_splits=ns, softmax_scale=0.2)
        assert bool(cp.all(out == plain)), splits
    with pytest.raises(ValueError, match="lse must be"):
        run_case(case, dev, lse=cp.zeros((2, 3), cp.float32))
    with pytest.raises(ValueError, match="split-K merge"):
        run_case(case, dev, lse=cp.zeros((2, 2 * group), cp.float32), num_splits=1)


def test_no_dense_allocation_during_decode():
    """Hooks CuPy's allocator: no allocation of >= tokens * d * 2 bytes during a decode."""
    import cupy as cp
    from validation.decode_cases import build_case, run_case, to_device
    case = build_case(1, 8, 4, 128, [2048] * 8, LADDER, [5], seed=4, reference_parts=False)
    dev = to_device(case)
    run_case(case, dev)   # compile and warm the table caches outside the hook
    tokens = int(case.lengths.sum())
    limit = tokens * 128 * 2
    pool = cp.get_default_memory_pool()
    sizes = []

    def hooked(nbytes):
        sizes.append(int(nbytes))
        return pool.malloc(nbytes)

    cp.cuda.set_allocator(hooked)
    try:
        for splits in (None, 1, 32):
            run_case(case, dev, num_splits=splits)
        cp.cuda.Device().synchronize()
    finally:
        cp.cuda.set_allocator(pool.malloc)
    assert sizes, "the hook saw no allocation at all (the output must be allocated)"
    assert max(sizes) < limit, f"an allocation of {max(sizes)} bytes (limit {limit})"


def test_cuda_graph_capture_replays():
    import cupy as cp
    from cupy_kernels.ada_decode import make_workspace
    from validation.decode_cases import build_case, run_case, to_device
    case = build_case(2, 2, 8, 128, [300, 45, 700, 12], LADDER, [1, 5, 7], seed=9)
    dev = to_device(case)
    ws = make_workspace(4, 8, 128, 4)
    out = cp.empty((2, 16, 128), cp.float32)
    run_case(case, dev, out=out, workspace=ws, validate=False)   # compile before capture
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        run_case(case, dev, out=out, workspace=ws, validate=False)
        graph = stream.end_capture()
    out.fill(np.nan)
    cp.cuda.Device().synchronize()
    graph.launch(stream)
    stream.synchronize()
    _check(case, out)


@pytest.mark.parametrize("splits", [2, 66])
def test_per_head_merge_as_programmatic_launch(splits, monkeypatch):
    """The affine path's merge launched as a programmatic dependent of the decode (its CTAs
    may start while the decode's last CTAs run and wait for the whole grid) writes the same
    bytes as a plain launch (``_pdl.launch`` made to decline), on a stream and replayed from
    a CUDA graph, and matches the reference."""
    import cupy as cp
    from cupy_kernels import _pdl
    from cupy_kernels.ada_decode import make_workspace
    from validation.decode_cases import build_case, run_case, to_device
    assert _pdl._launch_ex() is not None, "the driver has no cuLaunchKernelEx"
    case = build_case(2, 2, 4, 128, [3000, 45, 2500, 700], WIDE_LADDER, [3, 4], seed=17,
                      codebook="uniform")
    dev = to_device(case)
    ws = make_workspace(4, 4, 128, splits)
    outs = {}
    programmatic = _pdl.launch
    for pdl in (False, True):
        monkeypatch.setattr(_pdl, "launch", programmatic if pdl else (lambda *a, **k: False))
        out = cp.full((2, 8, 128), np.nan, cp.float32)
        run_case(case, dev, out=out, workspace=ws, validate=False)
        cp.cuda.Device().synchronize()
        outs[pdl] = out.get()
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            run_case(case, dev, out=out, workspace=ws, validate=False)
            graph = stream.end_capture()
        for _ in range(3):
            out.fill(np.nan)
            graph.launch(stream)
            stream.synchronize()
            np.testing.assert_array_equal(out.get(), outs[pdl])
    np.testing.assert_array_equal(outs[True], outs[False])
    _check(case, cp.asarray(outs[True]))
