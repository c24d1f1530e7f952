"""Tests of the re-tier/compaction kernel (cupy_kernels/retier.py) against the reference.

Codes and fp16 scales must match the float64 reference bit for bit: the kernel computes in
float64 like the reference (a coordinate within ~1e-16 of a cell boundary could differ; no
input here lands there). The GPU tests carry the ``gpu`` mark.
"""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from strategies_paged import read_back_states
from cupy_kernels._module import DIMS as KERNEL_DIMS   # importable without CuPy

LADDER = [(1, 1), (2, 2), (3, 2), (4, 3), (4, 4), (8, 8), (16, 16)]


@pytest.mark.gpu
@settings(max_examples=20, deadline=None)
@given(dim=st.sampled_from(KERNEL_DIMS), src=st.integers(1, len(LADDER)),
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
    kc, ks, vc, vs = read_back_states(tables, pages.get(), dst, dpg, dsl)
    if dst == src:
        ek, ev = ke, ve
    else:
        ek = encode_rotated(codec(kbd, 0), stored_rotated(codec(kbs, 0), ke))
        ev = encode_rotated(codec(vbd, 1), stored_rotated(codec(vbs, 1), ve))
    np.testing.assert_array_equal(kc, ek.codes)
    np.testing.assert_array_equal(vc, ev.codes)
    np.testing.assert_array_equal(ks, ek.scale)
    np.testing.assert_array_equal(vs, ev.scale)


@pytest.mark.gpu
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
    for args in ((a(2), a(0), a(1), a(0)), (a(0), a(0), a(-1), a(0))):
        with pytest.raises(ValueError, match="outside the pool of 2 pages"):
            retier(pages, tier, tables, *args)
