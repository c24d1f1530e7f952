"""Hypothesis strategies and small builders shared by test_paged.py and test_cache.py, and
the read-back of stored states that test_encode.py and test_retier.py share."""
import copy

import numpy as np
from hypothesis import strategies as st

from spherical_kv_ref import SphericalCodec, TierLadder

#: small ladders covering every bit width the format has (1, 2, 3, 4, 8, 16), a mixed
#: (16, 8) tier (keys without a scale, values with one) and a top tier that is not fp16.
LADDERS = (
    ((2, 2), (3, 2), (4, 4), (8, 8), (16, 16)),
    ((1, 1), (3, 3), (16, 8), (16, 16)),
    ((2, 1), (4, 2), (8, 4)),
)

ladders = st.sampled_from(LADDERS).map(TierLadder)
#: awkward state counts: one state, less than a page, not a multiple of any page size
sizes = st.sampled_from([1, 2, 17, 31, 97])
seeds = st.integers(0, 2 ** 16)


def codec_factory(dim, seed=0, layer=0, head=0):
    """(bits, salt) -> SphericalCodec of one row, memoised."""
    memo = {}

    def codec_for(bits, salt):
        if (bits, salt) not in memo:
            memo[bits, salt] = SphericalCodec(dim, bits, seed, layer=layer, head=head, salt=salt)
        return memo[bits, salt]
    return codec_for


def kv_like(rng, n, d, offset=0.0):
    """Keys/values with a common offset (what centring removes) and spread-out norms."""
    x = rng.standard_normal((n, d)) * rng.lognormal(0.0, 0.4, (n, 1))
    return x + offset


def snapshot(paged):
    """Everything a PagedKV holds, for 'unchanged after an error' checks."""
    pool = paged.pool
    return (pool.data.copy(), pool.page_tier.copy(), pool.page_count.copy(),
            pool.page_pos.copy(), list(pool._free), copy.deepcopy(paged.rows))


def assert_same(a, b):
    for x, y in zip(a[:4], b[:4]):
        np.testing.assert_array_equal(x, y)
    assert a[4] == b[4]
    assert a[5] == b[5]


def cache_snapshot(cache):
    """Everything a SphericalKVCache holds (pool, rows, per-sequence bookkeeping)."""
    seqs = {}
    for sid, s in cache._seqs.items():
        seqs[sid] = (s.length.copy(), s.mean_k.copy(), s.mean_v.copy(), s.has_mean.copy(),
                     list(s.spans), [[x.copy() for x in dq] for dq in s.queries], s.since_compress)
    return snapshot(cache.paged), seqs, sorted(cache._freed), cache._next_seq


def assert_cache_same(a, b):
    assert_same(a[0], b[0])
    assert a[1].keys() == b[1].keys()
    for sid in a[1]:
        x, y = a[1][sid], b[1][sid]
        for u, w in zip(x[:4], y[:4]):
            np.testing.assert_array_equal(u, w)
        assert x[4] == y[4] and x[6] == y[6]
        assert len(x[5]) == len(y[5])
        for qa, qb in zip(x[5], y[5]):
            assert len(qa) == len(qb)
            for u, w in zip(qa, qb):
                np.testing.assert_array_equal(u, w)
    assert a[2:] == b[2:]


def read_back_states(tables, pages, tier, page_ids, slots):
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
