"""GPU tests of the encode/append and re-tier/compaction kernels against the reference.

Codes and fp16 scales must match the float64 reference bit for bit. Encode v1 and re-tier
compute in float64 like the reference (a coordinate within ~1e-16 of a cell boundary could
differ; no input here lands there); encode v2 computes in float32 and takes the float64 path
for any coordinate or scale within its float32 error bound of a boundary, which the
near-boundary test below forces.
"""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

pytestmark = pytest.mark.gpu

LADDER = [(1, 1), (2, 2), (3, 2), (4, 3), (4, 4), (8, 8), (16, 16)]


def _read_back(tables, pages, tier, page_ids, slots):
    """(key codes, key scales, value codes, value scales) of states at (page, slot)."""
    kb, vb, p, kw, vw, voff, ksoff, vsoff = (int(x) for x in tables.geom[tier])
    words = pages.view(np.uint32)
    kc = np.stack([words[pg, s * kw:(s + 1) * kw] for pg, s in zip(page_ids, slots)])
    vc = np.stack([words[pg, voff + s * vw:voff + (s + 1) * vw] for pg, s in zip(page_ids, slots)])
    ks = np.array([pages[pg, ksoff + 2 * s:ksoff + 2 * s + 2].view(np.float16)[0] if ksoff >= 0
                   else np.float16(1) for pg, s in zip(page_ids, slots)])
    vs = np.array([pages[pg, vsoff + 2 * s:vsoff + 2 * s + 2].view(np.float16)[0] if vsoff >= 0
                   else np.float16(1) for pg, s in zip(page_ids, slots)])
    return kc, ks, vc, vs


@settings(max_examples=30, deadline=None)
@given(dim=st.sampled_from([64, 128]), tier=st.integers(1, len(LADDER)), n=st.integers(1, 97),
       centred=st.booleans(), seed=st.integers(0, 2 ** 16), strided=st.booleans(),
       version=st.sampled_from([1, 2]))
def test_encode_matches_reference(dim, tier, n, centred, seed, strided, version):
    import cupy as cp
    from spherical_kv_ref import SphericalCodec
    from cupy_kernels import encode_into_pages, kernel_tables, rotation_signs
    tables = kernel_tables(LADDER, dim)
    rng = np.random.default_rng(seed)
    kb, vb = LADDER[tier - 1]
    heads = 3
    kcs = [SphericalCodec(dim, kb, seed=7, head=h, salt=0) for h in range(heads)]
    vcs = [SphericalCodec(dim, vb, seed=7, head=h, salt=1) for h in range(heads)]
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
                      cp.asarray(slots), part="key", version=version, **kw)
    encode_into_pages(cp.asarray(v.astype(np.float32)), pages, page_tier, tables,
                      cp.asarray(rotation_signs(vcs)), cp.asarray(head), cp.asarray(page_ids),
                      cp.asarray(slots), part="value", version=version, **kw)
    kc, ks, vc, vs = _read_back(tables, pages.get(), tier, page_ids, slots)
    for i in range(n):
        h = head[i]
        mu = None if means is None else means[h]
        ek = kcs[h].encode(xs[i:i + 1].astype(np.float64), mean=mu)
        ev = vcs[h].encode(v[i:i + 1].astype(np.float32).astype(np.float64), mean=mu)
        np.testing.assert_array_equal(kc[i], ek.codes[0])
        np.testing.assert_array_equal(vc[i], ev.codes[0])
        assert ks[i] == ek.scale[0] and vs[i] == ev.scale[0]


@pytest.mark.parametrize("version", [1, 2])
def test_encode_rejects_bad_input(version):
    import cupy as cp
    from functools import partial
    from cupy_kernels import encode_into_pages, kernel_tables
    enc = partial(encode_into_pages, version=version)
    tables = kernel_tables(LADDER, 64)
    pages = cp.zeros((2, tables.page_bytes), cp.uint8)
    tier = cp.asarray([5, 0], cp.int32)
    sig = cp.ones((1, 64), cp.float32)
    z = cp.zeros(1, cp.int32)
    x = cp.ones((1, 64), cp.float32)
    bad = x.copy(); bad[0, 3] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        enc(bad, pages, tier, tables, sig, z, z, z)
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
    with pytest.raises(ValueError, match="version"):
        encode_into_pages(x, pages, tier, tables, sig, z, z, z, version=3)


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


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("dim", [64, 128])
def test_encode_near_cell_boundaries_mixed_tiers(version, dim):
    """Every tier of the ladder in one launch (groups of one warp at different bit widths),
    inputs on cell boundaries (v2's float64 path) and at extreme radii: the reference's bytes."""
    import cupy as cp
    from spherical_kv_ref import SphericalCodec
    from cupy_kernels import encode_into_pages, kernel_tables, rotation_signs
    tables = kernel_tables(LADDER, dim)
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
        probe = SphericalCodec(dim, bits if bits < 16 else 4, seed=5, salt=0)
        x[idx] = _near_boundary_rows(probe, idx.size, rng)
    sig = cp.asarray(rotation_signs([SphericalCodec(dim, 4, seed=5, salt=0)]))
    for part in ("key", "value"):
        encode_into_pages(cp.asarray(x), pages, page_tier, tables, sig, cp.asarray(head),
                          cp.asarray(page_ids), cp.asarray(slots), part=part, version=version)
    host = pages.get()
    for t in range(1, len(LADDER) + 1):
        idx = np.flatnonzero(tiers == t)
        kc, ks, vc, vs = _read_back(tables, host, t, page_ids[idx], slots[idx])
        for part, (codes, scales) in (("key", (kc, ks)), ("value", (vc, vs))):
            bits = LADDER[t - 1][0 if part == "key" else 1]
            ref = SphericalCodec(dim, bits, seed=5, salt=0).encode(x[idx].astype(np.float64))
            np.testing.assert_array_equal(codes, ref.codes)
            np.testing.assert_array_equal(scales, ref.scale)


@settings(max_examples=20, deadline=None)
@given(dim=st.sampled_from([64, 128]), src=st.integers(1, len(LADDER)),
       drop=st.integers(0, len(LADDER) - 1), n=st.integers(1, 40), seed=st.integers(0, 2 ** 16))
def test_retier_matches_reference(dim, src, drop, n, seed):
    import cupy as cp
    from spherical_kv_ref import SphericalCodec
    from spherical_kv_ref.paged import encode_rotated, stored_rotated
    from cupy_kernels import kernel_tables, pack_pages, retier
    dst = max(1, src - drop)
    kbs, vbs = LADDER[src - 1]
    kbd, vbd = LADDER[dst - 1]
    if kbd > kbs or vbd > vbs:       # this ladder is monotone; keep the test honest anyway
        return
    tables = kernel_tables(LADDER, dim)
    rng = np.random.default_rng(seed)
    codec = lambda b, salt: SphericalCodec(dim, b, seed=3, salt=salt)
    ke = codec(kbs, 0).encode(rng.normal(0, 3, (n, dim)))
    ve = codec(vbs, 1).encode(rng.normal(0, 1, (n, dim)))
    packed = pack_pages([[(src, ke, ve)]], tables, num_pages=2 * (n + 2), fill=None, rng=None)
    p_src = tables.states_per_page(src)
    pd = tables.states_per_page(dst)
    nsrc = -(-n // p_src)
    free = np.arange(nsrc, packed.pages.shape[0])
    page_tier = packed.page_tier.copy()
    ndst = -(-n // pd)
    page_tier[free[:ndst]] = dst
    perm = rng.permutation(n)
    sp, ss = (np.arange(n) // p_src).astype(np.int32), (np.arange(n) % p_src).astype(np.int32)
    dpg, dsl = free[perm // pd].astype(np.int32), (perm % pd).astype(np.int32)
    pages = cp.asarray(packed.pages)
    retier(pages, cp.asarray(page_tier), tables, cp.asarray(sp), cp.asarray(ss),
           cp.asarray(dpg), cp.asarray(dsl))
    kc, ks, vc, vs = _read_back(tables, pages.get(), dst, dpg, dsl)
    if dst == src:
        ek, ev = ke, ve
    else:
        ek = encode_rotated(codec(kbd, 0), stored_rotated(codec(kbs, 0), ke))
        ev = encode_rotated(codec(vbd, 1), stored_rotated(codec(vbs, 1), ve))
    np.testing.assert_array_equal(kc, ek.codes)
    np.testing.assert_array_equal(vc, ev.codes)
    np.testing.assert_array_equal(ks, ek.scale)
    np.testing.assert_array_equal(vs, ev.scale)


def test_retier_rejects_promotion_and_overlap():
    import cupy as cp
    from cupy_kernels import kernel_tables, retier
    tables = kernel_tables(LADDER, 64)
    pages = cp.zeros((2, tables.page_bytes), cp.uint8)
    tier = cp.asarray([2, 5], cp.int32)
    a = lambda *v: cp.asarray(v, cp.int32)
    with pytest.raises(ValueError, match="promotion"):
        retier(pages, tier, tables, a(0), a(0), a(1), a(0))
    with pytest.raises(ValueError, match="both a source"):
        retier(pages, tier, tables, a(1, 1), a(0, 1), a(1, 1), a(1, 2))
