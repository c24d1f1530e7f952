"""Tests of the encode/append kernels (cupy_kernels/encode.py) against the reference.

Codes and fp16 scales must match the float64 reference bit for bit. The kernels compute in
float32 and take the float64 path for any coordinate or scale within their float32 error
bound of a boundary, which the near-boundary tests below force. The GPU tests carry the
``gpu`` mark; the CPU test of the cell tables replays the kernels' float32 decisions in NumPy.
"""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from strategies_paged import read_back_states
from cupy_kernels._module import DIMS as KERNEL_DIMS   # importable without CuPy

LADDER = [(1, 1), (2, 2), (3, 2), (4, 3), (4, 4), (8, 8), (16, 16)]
CODEBOOKS = ("lloyd-max", "uniform")


def _assert_pages_are_reference(tables, host, tiers, page_ids, slots, x, dim, seed, codebook,
                                mean=None):
    """Every vector's key and value codes and scales, read back from the host copy of the
    pages, equal the reference codec's (rotation seed ``seed``, salt 0) byte for byte."""
    from spherical_kv_ref import SphericalCodec
    for t in range(1, len(LADDER) + 1):
        idx = np.flatnonzero(tiers == t)
        kc, ks, vc, vs = read_back_states(tables, host, t, page_ids[idx], slots[idx])
        for part, (codes, scales) in (("key", (kc, ks)), ("value", (vc, vs))):
            bits = LADDER[t - 1][0 if part == "key" else 1]
            ref = SphericalCodec(dim, bits, seed=seed, salt=0, codebook=codebook).encode(
                x[idx].astype(np.float64), mean=mean)
            np.testing.assert_array_equal(codes, ref.codes)
            np.testing.assert_array_equal(scales, ref.scale)


@pytest.mark.gpu
@settings(max_examples=40, deadline=None)
@given(dim=st.sampled_from(KERNEL_DIMS), tier=st.integers(1, len(LADDER)), n=st.integers(1, 97),
       centred=st.booleans(), seed=st.integers(0, 2 ** 16), strided=st.booleans(),
       codebook=st.sampled_from(CODEBOOKS))
def test_encode_matches_reference(dim, tier, n, centred, seed, strided, codebook):
    import cupy as cp
    from spherical_kv_ref import SphericalCodec
    from cupy_kernels import encode_into_pages, kernel_tables, rotation_signs
    tables = kernel_tables(LADDER, dim, codebook=codebook)
    rng = np.random.default_rng(seed)
    kb, vb = LADDER[tier - 1]
    heads = 3
    kcs = [SphericalCodec(dim, kb, seed=7, head=h, salt=0, codebook=codebook) for h in range(heads)]
    vcs = [SphericalCodec(dim, vb, seed=7, head=h, salt=1, codebook=codebook) for h in range(heads)]
    x = rng.normal(0, 1, (n, dim)) * rng.uniform(0.01, 30, (n, 1))
    x[rng.random(n) < 0.1] = 0.0                      # r = 0 states
    v = rng.normal(0, 1, (n, dim))
    head = rng.integers(0, heads, n).astype(np.int32)
    means = rng.normal(0, 2, (heads, dim)).astype(np.float32) if centred else None
    p = tables.states_per_page(tier)
    num_pages = -(-n // p) + 3
    order = rng.permutation(num_pages * p)[:n]
    page_ids, slots = (order // p).astype(np.int32), (order % p).astype(np.int32)
    pages = cp.asarray(rng.integers(0, 256, (num_pages, tables.page_bytes), dtype=np.uint8))
    page_tier = cp.full(num_pages, tier, cp.int32)
    xs = x.astype(np.float32)
    xd = cp.asarray(np.concatenate([xs, xs], axis=1))[:, :dim] if strided else cp.asarray(xs)
    kw = {} if not centred else dict(mean=cp.asarray(means), mean_index=cp.asarray(head))
    sig_k = cp.asarray(rotation_signs(kcs))
    encode_into_pages(xd, pages, page_tier, tables, sig_k, cp.asarray(head), cp.asarray(page_ids),
                      cp.asarray(slots), part="key", **kw)
    encode_into_pages(cp.asarray(v.astype(np.float32)), pages, page_tier, tables,
                      cp.asarray(rotation_signs(vcs)), cp.asarray(head), cp.asarray(page_ids),
                      cp.asarray(slots), part="value", **kw)
    kc, ks, vc, vs = read_back_states(tables, pages.get(), tier, page_ids, slots)
    for i in range(n):
        h = head[i]
        mu = None if means is None else means[h]
        ek = kcs[h].encode(xs[i:i + 1].astype(np.float64), mean=mu)
        ev = vcs[h].encode(v[i:i + 1].astype(np.float32).astype(np.float64), mean=mu)
        np.testing.assert_array_equal(kc[i], ek.codes[0])
        np.testing.assert_array_equal(vc[i], ev.codes[0])
        assert ks[i] == ek.scale[0] and vs[i] == ev.scale[0]


@pytest.mark.gpu
@pytest.mark.parametrize("codebook", CODEBOOKS)
def test_encode_rejects_bad_input(codebook):
    import cupy as cp
    from cupy_kernels import encode_into_pages, kernel_tables
    enc = encode_into_pages
    tables = kernel_tables(LADDER, 64, codebook=codebook)
    pages = cp.zeros((2, tables.page_bytes), cp.uint8)
    tier = cp.asarray([5, 0], cp.int32)
    sig = cp.ones((1, 64), cp.float32)
    z = cp.zeros(1, cp.int32)
    x = cp.ones((1, 64), cp.float32)
    bad = x.copy(); bad[0, 3] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        enc(bad, pages, tier, tables, sig, z, z, z)
    with pytest.raises(ValueError, match="NaN"):      # a 16-bit page
        enc(bad, pages, cp.asarray([len(LADDER), 0], cp.int32), tables, sig, z, z, z)
    with pytest.raises(ValueError, match="fp16"):
        enc(x * 3e4, pages, tier, tables, sig, z, z, z)
    with pytest.raises(ValueError, match="free"):
        enc(x, pages, tier, tables, sig, z, z + 1, z)
    with pytest.raises(ValueError, match="slot"):
        enc(x, pages, tier, tables, sig, z, z, z + 500)
    with pytest.raises(ValueError):
        enc(x.astype(cp.int32), pages, tier, tables, sig, z, z, z)
    with pytest.raises(ValueError):
        enc(x.get(), pages, tier, tables, sig, z, z, z)    # host array
    with pytest.raises(ValueError, match="part"):
        enc(x, pages, tier, tables, sig, z, z, z, part="both")


@pytest.mark.gpu
@pytest.mark.parametrize("codebook", CODEBOOKS)
def test_encode_nonfinite_input(codebook):
    """NaN/Inf input: with check=True the call raises before any launch and writes nothing;
    with check=False the kernels skip those vectors, write the others and set the status bit
    (raise_status turns it into the same ValueError), on every tier width."""
    import cupy as cp
    from cupy_kernels import encode_into_pages, encode_kv_into_pages, kernel_tables
    from cupy_kernels.encode import raise_status
    tables = kernel_tables(LADDER, 64, codebook=codebook)
    rng = np.random.default_rng(len(codebook))
    n = len(LADDER)
    filler = rng.integers(0, 256, (n, tables.page_bytes), dtype=np.uint8)
    pages, tier = cp.asarray(filler), cp.arange(1, n + 1, dtype=cp.int32)
    sig = cp.ones((1, 64), cp.float32)
    x = cp.asarray(rng.normal(0, 1, (n, 64)).astype(np.float32))
    x[2, 5] = np.nan
    x[n - 1, 0] = np.inf                     # a 16-bit page
    head, page, slot = cp.zeros(n, cp.int32), cp.arange(n, dtype=cp.int32), cp.zeros(n, cp.int32)
    with pytest.raises(ValueError, match="NaN"):
        encode_into_pages(x, pages, tier, tables, sig, head, page, slot)
    with pytest.raises(ValueError, match="NaN"):
        encode_kv_into_pages(x, x, pages, tier, tables, sig, sig, head, page, slot)
    np.testing.assert_array_equal(pages.get(), filler)
    st = encode_into_pages(x, pages, tier, tables, sig, head, page, slot, check=False)
    with pytest.raises(ValueError, match="NaN"):
        raise_status(st)
    got = pages.get()
    for i in range(n):
        kwords = int(tables.geom[i + 1, 3])
        changed = not np.array_equal(got[i, :4 * kwords], filler[i, :4 * kwords])
        assert changed == (i not in (2, n - 1)), i


@pytest.mark.gpu
@pytest.mark.parametrize("codebook", CODEBOOKS)
def test_encode_rejects_indices_outside_before_launch(codebook):
    """A page id outside the pool, a head outside sigma or a mean row outside mean raises
    ValueError before any launch: the pool (and the memory past it) is left as it was."""
    import cupy as cp
    from cupy_kernels import encode_into_pages, encode_kv_into_pages, kernel_tables
    tables = kernel_tables(LADDER, 64, codebook=codebook)
    rng = np.random.default_rng(len(codebook))
    filler = rng.integers(0, 256, (3, tables.page_bytes), dtype=np.uint8)
    pool = cp.asarray(filler)
    pages, tier = pool[:2], cp.asarray([5, 5], cp.int32)   # a third page past the pool's end
    sig = cp.ones((2, 64), cp.float32)
    mean = cp.zeros((3, 64), cp.float32)
    x = cp.asarray(rng.normal(0, 1, (4, 64)).astype(np.float32))
    a = lambda *v: cp.asarray(v, cp.int32)
    head, page, slot = a(0, 1, 0, 1), a(0, 1, 1, 0), a(0, 1, 2, 3)
    cases = [(dict(dst_page=a(0, 1, 2, 0)), "dst_page is outside the pool of 2"),
             (dict(dst_page=a(0, -1, 1, 0)), "dst_page"),
             (dict(head=a(0, 1, 2, 0)), "head is outside the 2 rows"),
             (dict(mean_index=a(0, 3, 0, 0)), "mean_index is outside the 3 rows")]
    for change, msg in cases:
        kw = dict(head=head, dst_page=page, dst_slot=slot, mean_index=a(0, 1, 2, 0)) | change
        with pytest.raises(ValueError, match=msg):
            encode_into_pages(x, pages, tier, tables, sig, kw["head"], kw["dst_page"],
                              kw["dst_slot"], mean=mean, mean_index=kw["mean_index"])
        with pytest.raises(ValueError, match=msg):
            encode_kv_into_pages(x, x, pages, tier, tables, sig, sig, kw["head"], kw["dst_page"],
                                 kw["dst_slot"], mean_k=mean, mean_index=kw["mean_index"])
        np.testing.assert_array_equal(pool.get(), filler)
    encode_into_pages(x, pages, tier, tables, sig, head, page, slot, mean=mean,
                      mean_index=a(0, 1, 2, 0))    # in range: written
    assert bool(cp.any(pool[:2] != cp.asarray(filler[:2])))
    np.testing.assert_array_equal(pool[2].get(), filler[2])


@pytest.mark.gpu
@pytest.mark.parametrize("codebook", CODEBOOKS)
@pytest.mark.parametrize("dim", KERNEL_DIMS)
def test_encode_kv_equals_two_parts(dim, codebook):
    """encode_kv_into_pages (one launch: keys and values in two rows of blocks) writes the
    bytes of encode_into_pages on the keys, then on the values, over every tier in a shuffled
    pool, with each part's own signs, centring of the keys only, strided value rows and random
    filler in the pages; with the values' rows different from the keys' (not swapped)."""
    import cupy as cp
    from cupy_kernels import encode_into_pages, encode_kv_into_pages, kernel_tables
    tables = kernel_tables(LADDER, dim, codebook=codebook)
    rng = np.random.default_rng(dim + 3)
    n, heads = 333, 3
    tiers = rng.integers(1, len(LADDER) + 1, n).astype(np.int32)
    page_ids = rng.permutation(n).astype(np.int32)
    slots = (np.arange(n) % 2).astype(np.int32)
    filler = rng.integers(0, 256, (n, tables.page_bytes), dtype=np.uint8)
    page_tier = np.zeros(n, np.int32)
    page_tier[page_ids] = tiers
    k = cp.asarray(rng.normal(0, 1, (n, dim)).astype(np.float32))
    v = cp.asarray(rng.normal(0, 3, (n, 2 * dim)).astype(np.float32))[:, ::2]   # strided rows
    sk = cp.asarray((1 - 2 * rng.integers(0, 2, (heads, dim))).astype(np.float32))
    sv = cp.asarray((1 - 2 * rng.integers(0, 2, (heads, dim))).astype(np.float32))
    head = cp.asarray(rng.integers(0, heads, n).astype(np.int32))
    mk = cp.asarray(rng.normal(0, 0.5, (heads, dim)).astype(np.float32))
    dpg, dsl, pt = cp.asarray(page_ids), cp.asarray(slots), cp.asarray(page_tier)
    one = cp.asarray(filler)
    encode_kv_into_pages(k, v, one, pt, tables, sk, sv, head, dpg, dsl, mean_k=mk,
                         mean_index=head)
    two = cp.asarray(filler)
    encode_into_pages(k, two, pt, tables, sk, head, dpg, dsl, part="key", mean=mk,
                      mean_index=head)
    encode_into_pages(v, two, pt, tables, sv, head, dpg, dsl, part="value")
    assert bool(cp.any(one != cp.asarray(filler)))
    np.testing.assert_array_equal(one.get(), two.get())
    with pytest.raises(ValueError, match="same shape"):
        encode_kv_into_pages(k, v[:-1], one, pt, tables, sk, sv, head, dpg, dsl)
    with pytest.raises(ValueError, match="mean_index"):
        encode_kv_into_pages(k, v, one, pt, tables, sk, sv, head, dpg, dsl, mean_v=mk)
    bad = v.copy()
    bad[7, 3] = np.inf
    with pytest.raises(ValueError, match="NaN"):
        encode_kv_into_pages(k, bad, one, pt, tables, sk, sv, head, dpg, dsl)


def _near_boundary_rows(codec, n, rng):
    """n float32 rows x whose rotated, normalised coordinates t = sqrt(d) y_j / |y| sit on
    cell boundaries (midpoints of the codebook) up to the float32 rounding of x, at four
    coordinates per row, and at radii from 1e-20 to 1e3 (one row all zero)."""
    d = codec.dim
    mids = 0.5 * (codec.levels[1:] + codec.levels[:-1])
    rows = []
    mids = mids[np.abs(mids) <= 3.0]
    for i in range(n):
        y = rng.normal(0, 1, d)
        js = rng.choice(d, 4, replace=False)
        a = rng.choice(mids, 4) / np.sqrt(d)     # want y_j = a_j |y|: |y| = |rest| / sqrt(1 - sum a^2)
        y[js] = 0.0
        y[js] = a * np.linalg.norm(y) / np.sqrt(1.0 - np.sum(a * a))
        y *= 10.0 ** rng.uniform(-20, 3) if i % 3 else 1.0
        rows.append(codec.rotation.inverse(y[None])[0])
    x = np.asarray(rows, np.float32)
    x[0] = 0.0
    return x


@pytest.mark.gpu
@pytest.mark.parametrize("codebook", CODEBOOKS)
@pytest.mark.parametrize("dim", KERNEL_DIMS)
def test_encode_near_cell_boundaries_mixed_tiers(dim, codebook):
    """Every tier of the ladder in one launch (groups of one warp at different bit widths),
    inputs on cell boundaries (the float64 path) and at extreme radii: the
    reference's bytes."""
    import cupy as cp
    from spherical_kv_ref import SphericalCodec
    from cupy_kernels import encode_into_pages, kernel_tables, rotation_signs
    tables = kernel_tables(LADDER, dim, codebook=codebook)
    rng = np.random.default_rng(11 + dim)
    per = 13
    tiers = np.repeat(np.arange(1, len(LADDER) + 1), per)
    rng.shuffle(tiers)
    n = tiers.size
    pages = cp.asarray(rng.integers(0, 256, (n, tables.page_bytes), dtype=np.uint8))
    page_tier = cp.asarray(tiers.astype(np.int32))        # vector i -> page i, slot i % 3
    page_ids = np.arange(n, dtype=np.int32)
    slots = (np.arange(n) % 3).astype(np.int32)
    head = np.zeros(n, np.int32)
    x = np.zeros((n, dim), np.float32)
    for t in range(1, len(LADDER) + 1):
        bits = LADDER[t - 1][0]
        idx = np.flatnonzero(tiers == t)
        probe = SphericalCodec(dim, bits if bits < 16 else 4, seed=5, salt=0, codebook=codebook)
        x[idx] = _near_boundary_rows(probe, idx.size, rng)
    sig = cp.asarray(rotation_signs([SphericalCodec(dim, 4, seed=5, salt=0)]))
    for part in ("key", "value"):
        encode_into_pages(cp.asarray(x), pages, page_tier, tables, sig, cp.asarray(head),
                          cp.asarray(page_ids), cp.asarray(slots), part=part)
    _assert_pages_are_reference(tables, pages.get(), tiers, page_ids, slots, x, dim, 5, codebook)


# ------------------------------------------------- cells found without a search ----

def _rows_at(codec, ts, n, rng, k=8):
    """n float32 rows whose rotated, normalised coordinates t put up to k (eight) coordinates at
    values drawn from ts (|t| < 0.3 sqrt(d)), the rest Gaussian."""
    d = codec.dim
    ts = np.asarray(ts, np.float64)
    ts = ts[np.abs(ts) < 0.3 * np.sqrt(d)]
    rows = []
    for _ in range(n):
        y = rng.normal(0, 1, d)
        js = rng.choice(d, k, replace=False)
        a = rng.choice(ts, k) / np.sqrt(d)
        y[js] = 0.0
        y[js] = a * np.linalg.norm(y) / np.sqrt(1.0 - np.sum(a * a))
        rows.append(codec.rotation.inverse(y[None])[0] * 10.0 ** rng.uniform(-3, 3))
    return np.asarray(rows, np.float32)


def _cell_edge_rows(codec, tables, bits, n, rng):
    """Rows for the kernels' own conditions: coordinates on the edges of its buckets (table path) or
    at the half-integers of A, i.e. the midpoints, shifted by its threshold (uniform path),
    rows whose rotation is one coordinate (|t| = sqrt(d): the ends of the bucket index), a
    row at the lower end of its radius range and one with a scale near the fp16 limit."""
    from cupy_kernels.encode import cell_tables, CELL_PRM
    from cupy_kernels.kernel_tables import LEVEL_BITS
    d = codec.dim
    prm = cell_tables(tables)[LEVEL_BITS.index(bits) * CELL_PRM:][:CELL_PRM].astype(np.float64)
    if tables.codebook == "uniform":
        n_lev = 2 ** bits
        step = 1.0 / (prm[0] * (n_lev - 1))
        mids = 0.5 * (codec.levels[1:] + codec.levels[:-1])
        mar = (0.5 - prm[3]) * step                   # the threshold, in t
        ts = np.concatenate([mids + mar * f for f in (-1.5, -1.01, -0.99, 0.99, 1.01, 1.5)])
    else:
        w, lo = 1.0 / prm[0], -prm[1] / prm[0]
        ts = lo + (np.arange(int(prm[2]) + 1) - 0.5) * w
        ts = np.concatenate([ts, ts + 1e-6, ts - 1e-6])
    x = _rows_at(codec, ts, n, rng)
    onehot = []
    for i in range(max(2, n // 8)):
        y = np.zeros(d)
        y[rng.integers(d)] = rng.choice([-1.0, 1.0]) * 10.0 ** rng.uniform(-6, 3)
        if i % 2:
            y += rng.normal(0, 1e-3, d) * np.abs(y).max()
        onehot.append(codec.rotation.inverse(y[None])[0])
    x = np.concatenate([x, np.asarray(onehot, np.float32)])
    x[-1] *= 1e-16                                    # at / below the float32 radius range: float64 path
    x[-2] = rng.normal(0, 1, d) * (3e4 / np.sqrt(d))  # a scale near the fp16 limit
    return x


@pytest.mark.gpu
@pytest.mark.parametrize("codebook", CODEBOOKS)
@pytest.mark.parametrize("dim", KERNEL_DIMS)
def test_encode_own_bucket_edges(dim, codebook):
    """The encode kernels on bucket edges / threshold neighbourhoods, one-hot rotations, radius limits, in a
    mixed-tier launch of a size that leaves part of the last warp idle, centred and strided:
    the reference's bytes."""
    import cupy as cp
    from spherical_kv_ref import SphericalCodec
    from cupy_kernels import encode_into_pages, kernel_tables, rotation_signs
    tables = kernel_tables(LADDER, dim, codebook=codebook)
    rng = np.random.default_rng(3 + dim)
    chunks, tiers = [], []
    for t in range(1, len(LADDER) + 1):
        bits = LADDER[t - 1][0]
        probe = SphericalCodec(dim, bits if bits < 16 else 4, seed=9, salt=0, codebook=codebook)
        xs = _cell_edge_rows(probe, tables, bits if bits < 16 else 4, 21, rng)
        chunks.append(xs)
        tiers += [t] * len(xs)
    x = np.concatenate(chunks)
    tiers = np.asarray(tiers)
    perm = rng.permutation(len(x))
    x, tiers = x[perm], tiers[perm]
    n = len(x) - (len(x) % 4 == 0)                    # not a multiple of four vectors
    x, tiers = x[:n], tiers[:n]
    mean = rng.normal(0, 0.5, (1, dim)).astype(np.float32)
    x = (x + mean).astype(np.float32)                 # centring removes it again (rounded)
    pages = cp.asarray(rng.integers(0, 256, (n, tables.page_bytes), dtype=np.uint8))
    page_tier = cp.asarray(tiers.astype(np.int32))
    page_ids = np.arange(n, dtype=np.int32)
    slots = (np.arange(n) % 2).astype(np.int32)
    head = np.zeros(n, np.int32)
    xd = cp.asarray(np.concatenate([x, x], axis=1))[:, :dim]     # strided rows
    sig = cp.asarray(rotation_signs([SphericalCodec(dim, 4, seed=9, salt=0)]))
    for part in ("key", "value"):
        encode_into_pages(xd, pages, page_tier, tables, sig, cp.asarray(head), cp.asarray(page_ids),
                          cp.asarray(slots), part=part, mean=cp.asarray(mean),
                          mean_index=cp.asarray(head))
    _assert_pages_are_reference(tables, pages.get(), tiers, page_ids, slots, x, dim, 9, codebook,
                                mean=mean[0])


@pytest.mark.gpu
@pytest.mark.parametrize("codebook", CODEBOOKS)
@pytest.mark.parametrize("dim", KERNEL_DIMS)
def test_encode_one_coordinate_near_a_midpoint(dim, codebook):
    """Rows with one rotated coordinate within the float32 margin of a midpoint (offsets from
    ~1e-8 to ~3e-5 in t, both sides; the float32 cell is wrong for some), the rest Gaussian, at
    every tier in one launch (one cells loop for all widths): the reference's codes and
    scales."""
    import cupy as cp
    from spherical_kv_ref import SphericalCodec
    from cupy_kernels import encode_into_pages, kernel_tables, rotation_signs
    tables = kernel_tables(LADDER, dim, codebook=codebook)
    rng = np.random.default_rng(11 + dim)
    chunks, tiers = [], []
    for t in range(1, len(LADDER) + 1):
        bits = LADDER[t - 1][0] if LADDER[t - 1][0] < 16 else 4
        probe = SphericalCodec(dim, bits, seed=9, salt=0, codebook=codebook)
        mids = 0.5 * (probe.levels[1:] + probe.levels[:-1])
        off = np.concatenate([s * 10.0 ** np.arange(-8, -4.4, 0.5) for s in (-1, 1)])
        n = 160 if bits == 8 else 40
        chunks.append(_rows_at(probe, (mids[:, None] + off[None, :]).ravel(), n, rng, k=1))
        tiers += [t] * n
    x = np.concatenate(chunks)
    tiers = np.asarray(tiers)
    perm = rng.permutation(len(x))
    x, tiers = x[perm], tiers[perm]
    n = len(x)
    pages = cp.asarray(rng.integers(0, 256, (n, tables.page_bytes), dtype=np.uint8))
    page_ids = np.arange(n, dtype=np.int32)
    slots = np.zeros(n, np.int32)
    head = cp.zeros(n, cp.int32)
    sig = cp.asarray(rotation_signs([SphericalCodec(dim, 4, seed=9, salt=0)]))
    for part in ("key", "value"):
        encode_into_pages(cp.asarray(x), pages, cp.asarray(tiers.astype(np.int32)), tables, sig,
                          head, cp.asarray(page_ids), cp.asarray(slots), part=part)
    _assert_pages_are_reference(tables, pages.get(), tiers, page_ids, slots, x, dim, 9, codebook)


def _rows_with_scales_near_fp16_midpoints(codec, n, rng):
    """n float32 rows whose reference scale r / ||C[c] / sqrt(d)|| lies within a relative
    1e-8 .. 2e-6 (either side) of a midpoint between two fp16 values: inside the float32 guard,
    outside its float64 tolerance, so the kernels settle each by its float64 scale decision."""
    from spherical_kv_ref import codebooks
    d = codec.dim
    rows = []
    while len(rows) < n:
        x = rng.normal(0, 1, d) * 10.0 ** rng.uniform(-2, 2)
        for _ in range(3):   # scaling moves the float32 rounding of x a little: settle it
            x32 = x.astype(np.float32).astype(np.float64)
            y = codec.rotation.apply(x32[None])[0]
            r = np.sqrt(np.sum(y * y))
            c = codebooks.quantize(np.sqrt(d) * y / r, codec.levels)
            sc = r / np.sqrt(np.sum(codec.levels[c] ** 2) / d)
            h = np.float16(sc)
            mids = [(float(h) + float(np.nextafter(h, np.float16(s)))) / 2 for s in (-np.inf, np.inf)]
            m = min(mids, key=lambda v: abs(v - sc))
            x = x32 * (m / sc) * (1.0 + rng.choice([-1, 1]) * 10.0 ** rng.uniform(-8, np.log10(2e-6)))
        rows.append(x)
    return np.asarray(rows, np.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("codebook", CODEBOOKS)
@pytest.mark.parametrize("dim", KERNEL_DIMS)
def test_encode_scales_near_fp16_midpoints(dim, codebook):
    """Every quantised tier with scales a hair above or below an fp16 rounding midpoint (the kernels'
    float64 scale decision, and the float64 pipeline where that is too close), centred and
    not, next to a few 16-bit rows: the reference's bytes."""
    import cupy as cp
    from spherical_kv_ref import SphericalCodec
    from cupy_kernels import encode_into_pages, kernel_tables, rotation_signs
    tables = kernel_tables(LADDER, dim, codebook=codebook)
    rng = np.random.default_rng(29 + dim)
    chunks, tiers = [], []
    for t in range(1, len(LADDER) + 1):
        bits = LADDER[t - 1][0]
        if bits < 16:
            codec = SphericalCodec(dim, bits, seed=4, salt=0, codebook=codebook)
            chunks.append(_rows_with_scales_near_fp16_midpoints(codec, 40, rng))
        else:                # no scale: a few plain rows (the helper below reads every tier)
            chunks.append(rng.normal(0, 1, (5, dim)).astype(np.float32))
        tiers += [t] * len(chunks[-1])
    x, tiers = np.concatenate(chunks), np.asarray(tiers)
    n = len(x)
    sig = cp.asarray(rotation_signs([SphericalCodec(dim, 4, seed=4, salt=0)]))
    page_ids = np.arange(n, dtype=np.int32)
    slots = np.zeros(n, np.int32)
    for mean in (None, np.zeros((1, dim), np.float32)):
        pages = cp.zeros((n, tables.page_bytes), cp.uint8)
        kw = {} if mean is None else dict(mean=cp.asarray(mean), mean_index=cp.zeros(n, cp.int32))
        for part in ("key", "value"):
            encode_into_pages(cp.asarray(x), pages, cp.asarray(tiers.astype(np.int32)), tables,
                              sig, cp.zeros(n, cp.int32), cp.asarray(page_ids), cp.asarray(slots),
                              part=part, **kw)
        _assert_pages_are_reference(tables, pages.get(), tiers, page_ids, slots, x, dim, 4,
                                    codebook, mean=None if mean is None else mean[0])


@pytest.mark.gpu
def test_encode_in_a_graph():
    """An encode with check=False captured in a CUDA graph and replayed on new rows (every tier,
    so the float64 pipeline runs too): the bytes and status of an eager call on those rows."""
    import cupy as cp
    from spherical_kv_ref import SphericalCodec
    from cupy_kernels import encode_into_pages, kernel_tables, rotation_signs
    dim, n = 128, 3001
    tables = kernel_tables(LADDER, dim, codebook="uniform")
    rng = np.random.default_rng(23)
    args = (cp.asarray(rng.integers(1, len(LADDER) + 1, n).astype(np.int32)), tables,
            cp.asarray(rotation_signs([SphericalCodec(dim, 4, seed=3, salt=0)])),
            cp.zeros(n, cp.int32), cp.arange(n, dtype=cp.int32), cp.zeros(n, cp.int32))
    x = cp.asarray(rng.normal(0, 1, (n, dim)).astype(np.float32))
    st = cp.zeros(1, cp.int32)
    pages = cp.zeros((n, tables.page_bytes), cp.uint8)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        encode_into_pages(x, pages, *args, check=False, status=st)   # compiles, caches tables
        stream.begin_capture()
        encode_into_pages(x, pages, *args, check=False, status=st)
        graph = stream.end_capture()
        x[...] = cp.asarray(rng.normal(0, 1, (n, dim)).astype(np.float32))
        graph.launch()
    stream.synchronize()
    assert int(st.get()[0]) == 0
    eager = cp.zeros_like(pages)
    encode_into_pages(x, eager, *args)
    np.testing.assert_array_equal(pages.get(), eager.get())


def _emulate_float32_path(x, sigma, tables, bits):
    """NumPy replay of the encode kernels' float32 path for rows x (n, d) float32 (no centring), one
    float32 rounding per operation (an fma: one rounding of the float64 result, exact except
    on double-rounding ties). Returns (codes, fp16 scales, deferred): the rows it defers go to
    the float64 pipeline, the others it writes."""
    from cupy_kernels.encode import cell_tables, CELL_PRM, CELL_LEV2, CELL_BM, CELL_NB, BUCKETS
    from cupy_kernels.kernel_tables import LEVEL_BITS
    f32 = np.float32
    blob = cell_tables(tables)
    r = LEVEL_BITS.index(bits)
    prm = blob[r * CELL_PRM:(r + 1) * CELL_PRM]
    fma = lambda a, b, c: (a.astype(np.float64) * b + c).astype(f32)
    n, d = x.shape
    b1 = (x[:, 1::2] * sigma[1::2]).astype(f32)
    z = np.empty_like(x)
    z[:, 0::2] = fma(x[:, 0::2], sigma[0::2], b1)
    z[:, 1::2] = fma(x[:, 0::2], sigma[0::2], -b1)
    r2 = np.sum(z.astype(np.float64) ** 2, axis=1).astype(f32)
    h = 2
    while h < d:
        y = z.reshape(n, d // (2 * h), 2, h)
        a, b = y[:, :, 0, :].copy(), y[:, :, 1, :].copy()
        y[:, :, 0, :], y[:, :, 1, :] = a + b, a - b
        h *= 2
    ok = (r2 >= 1e-30) & (r2 <= 1e30)
    z[~ok], r2[~ok] = 0, 1
    rinv = (1.0 / np.sqrt(r2.astype(np.float64))).astype(f32)
    kt = (f32(1.41421356) * rinv)[:, None]
    k = (kt * prm[0]).astype(f32)
    nl = 2 ** bits
    if tables.codebook == "uniform":
        a_s = np.clip(fma(z, k, prm[1]), 0, 1)
        ar = fma(a_s, f32(nl - 1), f32(12582912.0))
        rr = (ar - f32(12582912.0)).astype(f32)
        near = np.abs(fma(a_s, f32(nl - 1), -rr)) >= prm[3]
        codes = rr.astype(np.int64)
        sumsq = np.sum((2.0 * codes + 1 - nl) ** 2, axis=1).astype(f32)
    else:
        off = CELL_BM + sum(BUCKETS[b] for b in LEVEL_BITS[:r])
        g = BUCKETS[bits]
        a = fma(z, k, prm[1])
        if bits == 8 or tables.dim >= 256:     # the kernels' clamp (WIDE_DIM)
            a = np.clip(a, 0, prm[2])
        bi = np.rint(a).astype(np.int64)
        assert bi.min() >= 0 and bi.max() < g            # the kernel's look-up stays in its row
        e = (blob[off:off + g][bi].astype(np.float64) - z.astype(np.float64) * kt).astype(f32)
        near = np.abs(e) <= prm[3]
        codes = blob.view(np.int32)[off + CELL_NB:off + CELL_NB + g][bi] + np.signbit(e)
        lev2 = blob[CELL_LEV2 + 256 * r:CELL_LEV2 + 256 * r + nl]
        sumsq = np.sum(lev2[codes].astype(np.float64), axis=1).astype(f32)
    rz = (r2 * rinv).astype(f32)
    sf = (rz * ((1.0 / np.sqrt(sumsq.astype(np.float64))).astype(f32) * prm[4])).astype(f32)
    guard = prm[5:6].view(np.int32)[0]
    sclose = ~((sf >= 2.0 ** -14) & (sf < 65000.0)) | (np.abs((sf.view(np.int32) & 0x1fff) - 0x1000) <= guard)
    return codes, sf.astype(np.float16), near.any(axis=1) | sclose | ~ok


@pytest.mark.parametrize("codebook", CODEBOOKS)
@pytest.mark.parametrize("dim", KERNEL_DIMS)
def test_cell_tables_and_float32_decisions(dim, codebook):
    """CPU: every t of a bucket, widened by more than float32 can move it, gets the
    reference's cell from (cell below) + (t > midpoint); the uniform thresholds sit in
    (1/4, 1/2); and the float32 path replayed in NumPy writes only the
    reference's codes and scales, on random rows, rows at the kernels' own edges and on cell
    boundaries (where it must defer)."""
    from spherical_kv_ref import SphericalCodec
    from cupy_kernels import kernel_tables
    from cupy_kernels.encode import cell_tables, CELL_PRM, CELL_BM, CELL_NB, BUCKETS
    from cupy_kernels.kernel_tables import LEVEL_BITS
    tables = kernel_tables([(b, b) for b in LEVEL_BITS], dim, codebook=codebook)
    blob = cell_tables(tables)
    rng = np.random.default_rng(dim)
    off = CELL_BM
    for r, bits in enumerate(LEVEL_BITS):
        prm = blob[r * CELL_PRM:(r + 1) * CELL_PRM]
        codec = SphericalCodec(dim, bits, seed=2, codebook=codebook)
        mids = 0.5 * (codec.levels[1:] + codec.levels[:-1])
        if codebook == "uniform":
            assert 0.25 < prm[3] < 0.5
        else:
            g = BUCKETS[bits]
            w, lo = 1.0 / float(prm[0]), -float(prm[1]) / float(prm[0])
            m = blob[off:off + g]
            c0 = blob.view(np.int32)[off + CELL_NB:off + CELL_NB + g]
            # every t of a bucket widened by its margin plus the float32 error of the index
            # (16 u sqrt(d) here) and farther than the margin from the bucket's float32
            # midpoint (nearer t are deferred) gets (cell below) + (t > m) = #midpoints < t
            margin = float(prm[3])
            widen = margin + 16 * 2.0 ** -24 * np.sqrt(dim)
            for b in range(g):
                e_lo = lo + (b - 0.5) * w - widen
                e_hi = lo + (b + 0.5) * w + widen
                ts = np.concatenate([[e_lo, e_hi], np.linspace(e_lo, e_hi, 9),
                                     mids + 1.01 * margin, mids - 1.01 * margin])
                ts = ts[(ts >= e_lo) & (ts <= e_hi)] if 0 < b < g - 1 else \
                    ts[ts <= e_hi] if b == 0 else ts[ts >= e_lo]
                ts = ts[np.abs(ts - float(m[b])) > margin]
                want = np.searchsorted(mids, ts, side="left")
                got = c0[b] + (ts > float(m[b]))
                np.testing.assert_array_equal(got, want)
            off += g
        sigma = np.asarray(codec.rotation.signs, np.float32)
        xs = [(rng.normal(0, 1, (3000, dim)) * rng.uniform(0.01, 30, (3000, 1))).astype(np.float32),
              _cell_edge_rows(codec, tables, bits, 400, rng), _near_boundary_rows(codec, 200, rng)]
        for k, x in enumerate(xs):
            codes, scales, deferred = _emulate_float32_path(x, sigma, tables, bits)
            ref = codec.encode(x.astype(np.float64))
            written = ~deferred
            np.testing.assert_array_equal(codes[written], codec.codes(ref)[written])
            np.testing.assert_array_equal(scales[written], ref.scale[written])
            if k == 0:   # random rows: the float64 path stays the exception (at d = 256
                # a vector has twice the coordinates, each with a margin sqrt(2) x 9/8 wider:
                # about 3x the deferrals of d = 128, measured 54 % at 8 bits, 5.5 % below)
                limit = (0.35, 0.05) if dim < 256 else (0.6, 0.08)
                assert deferred.mean() < (limit[0] if bits == 8 else limit[1])
            if k == 2:   # rows on cell boundaries (and a zero row) must all be deferred
                assert deferred.all()
