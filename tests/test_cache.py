"""SphericalKVCache: append, protect, compress (RDR), GQA decode, errors (docs/design.md §4, §5, §7)."""
import numpy as np
import pytest
from hypothesis import event, settings, strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, consumes, initialize,
                                 invariant, precondition, rule)

import spherical_kv_ref as skv
from spherical_kv_ref import TierLadder, attention, dense_attention
from spherical_kv_ref.cache import CompressPolicy, SphericalKVCache
from spherical_kv_ref.paged import PoolExhaustedError
from spherical_kv_ref.rdr.statistics import eviction_coherence

from strategies_paged import assert_cache_same, cache_snapshot

D = 32
LADDER = TierLadder([(2, 2), (3, 2), (4, 4), (8, 8), (16, 16)])
REL = 1e-10


def make_cache(L=2, H=2, G=2, page_bytes=512, pages=400, **kw):
    kw.setdefault("policy", CompressPolicy(sinks=2, recent=4))
    return SphericalKVCache(L, H, D, LADDER, page_bytes=page_bytes, pool_bytes=pages * page_bytes,
                            num_q_heads=H * G, seed=3, **kw)


def fill(cache, seq, n, rng, chunks=(None,)):
    """Append n tokens to every layer of seq, as prefill chunks then single decode tokens."""
    H = cache.num_kv_heads
    k = rng.standard_normal((cache.num_layers, H, n, D)) + 1.0
    v = rng.standard_normal((cache.num_layers, H, n, D)) - 0.5
    cut = n if chunks == (None,) else chunks[0]
    for layer in range(cache.num_layers):
        cache.append(seq, layer, k[layer, :, :cut], v[layer, :, :cut])
    for i in range(cut, n):
        for layer in range(cache.num_layers):
            cache.append(seq, layer, k[layer, :, i:i + 1], v[layer, :, i:i + 1])
    return k, v


def rel_err(a, b):
    return np.max(np.abs(a - b)) / np.max(np.abs(b))


def test_package_exports():
    assert skv.SphericalKVCache is SphericalKVCache
    assert skv.paged.PagedKV is not None


# ------------------------------------------------------------------ decode

@pytest.mark.parametrize("n", [1, 17, 97])
def test_decode_equals_flat_reference_after_compress(n):
    rng = np.random.default_rng(n)
    cache = make_cache()
    seq = cache.new_sequence()
    fill(cache, seq, n, rng, chunks=(max(1, n - 3),))
    q = rng.standard_normal((cache.num_q_heads, D)) * 2
    for layer in range(cache.num_layers):
        cache.observe(seq, layer, q)
    for budget in (cache.bytes_in_use(seq), cache.bytes_in_use(seq) // 2):
        try:
            cache.compress(seq, budget)
        except ValueError as e:
            assert "protected states" in str(e) and n <= 6
            continue
        for layer in range(cache.num_layers):
            out = cache.decode(seq, layer, q)
            ref = cache.reference_decode(seq, layer, q)
            assert rel_err(out, ref) < REL
    cache.paged.check_invariants()


def test_gqa_heads_share_their_kv_head():
    rng = np.random.default_rng(1)
    cache = make_cache(L=1, H=2, G=3)
    seq = cache.new_sequence()
    k, v = fill(cache, seq, 23, rng)
    q = rng.standard_normal((6, D))
    out = cache.decode(seq, 0, q)
    top = LADDER.top
    for h in range(2):
        (ke, ve, _), = cache.paged.gather((seq, 0, h)).values()
        mk, mv = cache._seqs[seq].mean_k[0, h], cache._seqs[seq].mean_v[0, h]
        ke = skv.Encoded(ke.scale, ke.codes, 16, D, mk)
        ve = skv.Encoded(ve.scale, ve.codes, 16, D, mv)
        ref = attention(q[3 * h:3 * h + 3], ke, ve, cache.codec(0, h, 16, 0), cache.codec(0, h, 16, 1))
        assert rel_err(out[3 * h:3 * h + 3], ref) < REL
        # fp16 top tier with centring: close to exact attention on the raw keys and values
        exact = dense_attention(q[3 * h:3 * h + 3], k[0, h], v[0, h])
        assert np.max(np.abs(out[3 * h:3 * h + 3] - exact)) < 1e-2
    assert top == 5


def test_means_fixed_by_first_chunk():
    rng = np.random.default_rng(2)
    cache = make_cache(L=1)
    seq = cache.new_sequence()
    k = rng.standard_normal((2, 10, D)) + 3
    v = rng.standard_normal((2, 10, D))
    cache.append(seq, 0, k[:, :6], v[:, :6])
    mk = cache._seqs[seq].mean_k[0].copy()
    np.testing.assert_allclose(mk, k[:, :6].mean(axis=1), rtol=1e-6)
    cache.append(seq, 0, k[:, 6:], v[:, 6:])
    np.testing.assert_array_equal(cache._seqs[seq].mean_k[0], mk)
    table = cache.page_table(seq, 0)
    np.testing.assert_array_equal(table.mean_k, mk)
    assert table.indptr.tolist() == [0, 3, 6] and table.last_page_len.tolist() == [2, 2]   # 4 per page
    # centring off: zero means, still exact to the reference
    off = make_cache(L=1, centre=False)
    s2 = off.new_sequence()
    off.append(s2, 0, k, v)
    q = rng.standard_normal((4, D))
    assert not off.page_table(s2, 0).mean_k.any()
    assert rel_err(off.decode(s2, 0, q), off.reference_decode(s2, 0, q)) < REL


# ------------------------------------------------------------------ compress

def test_compress_respects_budget_protection_and_never_promotes():
    rng = np.random.default_rng(3)
    cache = make_cache(L=2, H=2)
    seq = cache.new_sequence()
    fill(cache, seq, 90, rng, chunks=(80,))
    cache.protect(seq, 40, 45)
    full = cache.bytes_in_use(seq)
    # a generous budget changes nothing
    tiers0 = {k: cache.paged.states(k) for k in cache.paged.rows}
    cache.compress(seq, 10 * full)
    for k, s0 in tiers0.items():
        np.testing.assert_array_equal(cache.paged.states(k).tier, s0.tier)
    for frac in (0.5, 0.3, 0.8):
        before = {k: dict(zip(cache.paged.states(k).pos, cache.paged.states(k).tier)) for k in cache.paged.rows}
        budget = int(frac * full)
        rep = cache.compress(seq, budget)
        assert cache.bytes_in_use(seq) == rep.bytes_after <= budget
        for k in cache.paged.rows:
            stt = cache.paged.states(k)
            now = dict(zip(stt.pos, stt.tier))
            assert set(now) <= set(before[k])
            assert all(now[p] <= before[k][p] for p in now), "a state was promoted"
            for p in list(range(2)) + list(range(40, 45)) + list(range(86, 90)):
                assert now.get(p) == LADDER.top, f"protected position {p} not at the top tier"
        cache.paged.check_invariants()


def test_demote_all_puts_every_unprotected_state_at_one_tier():
    rng = np.random.default_rng(5)
    cache = make_cache(L=2, H=2)
    seq = cache.new_sequence()
    k, v = fill(cache, seq, 60, rng)
    cache.protect(seq, 10, 12)
    full, n = cache.bytes_in_use(seq), cache.num_states(seq)
    snap = cache_snapshot(cache)
    for bad in (0, LADDER.top + 1, 2.0):
        with pytest.raises(ValueError, match="tier must be"):
            cache.demote_all(seq, bad)
    assert_cache_same(snap, cache_snapshot(cache))
    cache.demote_all(seq, 3)
    assert cache.num_states(seq) == n and cache.bytes_in_use(seq) < full
    for key in cache.paged.rows:
        stt = cache.paged.states(key)
        prot = cache.protected_mask(seq, key[1], stt.pos)
        assert np.all(stt.tier[prot] == LADDER.top) and np.all(stt.tier[~prot] == 3)
    cache.demote_all(seq, 1)               # lower again: a second demotion
    cache.demote_all(seq, 4)               # higher: nothing regains bits
    tiers = np.concatenate([cache.paged.states(key).tier for key in cache.paged.rows])
    assert set(tiers) == {1, LADDER.top}
    cache.paged.check_invariants()
    # decode still agrees with the flat reference over what is stored, and new tokens enter on top
    q = rng.standard_normal((cache.num_q_heads, D))
    np.testing.assert_allclose(cache.decode(seq, 0, q, record=False), cache.reference_decode(seq, 0, q),
                               rtol=1e-9, atol=1e-9)
    fill(cache, seq, 1, rng)
    last = cache.paged.states((seq, 0, 0))
    assert last.tier[np.argmax(last.pos)] == LADDER.top


def test_protected_states_over_budget_is_a_clear_error():
    rng = np.random.default_rng(4)
    cache = make_cache(L=1, H=1)
    seq = cache.new_sequence()
    fill(cache, seq, 30, rng)
    cache.protect(seq, 0, 20)
    snap = cache_snapshot(cache)
    with pytest.raises(ValueError, match=r"protected states of sequence 0 alone need 3072 bytes"):   # 24 states, 4 per page
        cache.compress(seq, 1500)
    assert_cache_same(snap, cache_snapshot(cache))


def test_observed_queries_steer_what_is_kept():
    rng = np.random.default_rng(5)
    # prior=0: the estimate is the observed window alone
    cache = make_cache(L=1, H=1, G=1, policy=CompressPolicy(sinks=0, recent=0, prior=0.0))
    seq = cache.new_sequence()
    k = rng.standard_normal((1, 60, D)) * 0.3
    q = rng.standard_normal((1, D))
    k[0, 37] = q[0]                          # a heavy hitter for this query (p ≈ 0.7)
    cache.append(seq, 0, k, rng.standard_normal((1, 60, D)))
    cache.observe(seq, 0, q)
    cache.compress(seq, 512)                 # one page: a few states survive
    stt = cache.paged.states((seq, 0, 0))
    assert 37 in stt.pos
    # the heavy hitter gets the most bits of any state kept
    assert stt.tier[list(stt.pos).index(37)] == stt.tier.max()
    # without the observation the same budget goes to other states
    blind = make_cache(L=1, H=1, G=1, policy=CompressPolicy(sinks=0, recent=0))
    s2 = blind.new_sequence()
    blind.append(s2, 0, k, rng.standard_normal((1, 60, D)))
    blind.compress(s2, 512)
    assert blind.paged.states((s2, 0, 0)).tier.max() < LADDER.top


def test_compress_without_recorded_queries_estimates_uniform_attention():
    """No query recorded (no decode, no observe): compress scores every state as uniform
    attention would, p = 1/n, Q² = mean r², κ = 1 (docs/rdr.md §5), and keeps to the budget;
    also when every state is one vector, so that every distortion is zero (centring leaves
    nothing) or tied."""
    rng = np.random.default_rng(21)
    one = rng.standard_normal(D)
    for same in (False, True):
        for frac in (0.35, 0.5, 0.9):
            cache = make_cache()
            seq = cache.new_sequence()
            if same:
                for layer in range(cache.num_layers):
                    cache.append(seq, layer, np.tile(one, (2, 60, 1)), np.tile(-one, (2, 60, 1)))
            else:
                fill(cache, seq, 60, rng)
            st = cache.paged.states((seq, 0, 0))
            p, q2, r, _, _, kappa = cache._row_statistics(seq, cache._seqs[seq], 0, 0, st,
                                                          np.ones(60, bool))
            assert np.all(p == 1 / 60) and np.all(kappa == 1.0)
            assert q2 == pytest.approx(np.mean(r * r))
            rep = cache.compress(seq, budget_fraction=frac)
            assert cache.bytes_in_use(seq) == rep.bytes_after <= rep.budget_bytes
            q = rng.standard_normal((cache.num_q_heads, D))
            np.testing.assert_allclose(cache.decode(seq, 1, q, record=False),
                                       cache.reference_decode(seq, 1, q), rtol=1e-9, atol=1e-9)


def test_coherence_factor_matches_its_definition():
    rng = np.random.default_rng(9)
    nq, n, dim = 5, 30, D
    P = rng.dirichlet(np.ones(n), size=nq)
    yv = rng.standard_normal((n, dim))
    o = P @ yv
    dist2 = np.sum((yv[None] - o[:, None]) ** 2, axis=2)
    p2 = (P * P).mean(axis=0)
    cand = np.ones(n, bool)
    cand[:3] = False                                   # protected: never in S
    got = eviction_coherence(P, o, yv, dist2, p2, cand)
    idx = np.flatnonzero(cand)
    S = idx[p2[idx] <= np.median(p2[idx])]
    coh = np.mean([np.sum((P[q, S] @ (o[q] - yv[S])) ** 2) for q in range(nq)])
    ind = np.mean([np.sum(P[q, S] ** 2 * dist2[q, S]) for q in range(nq)])
    assert got == pytest.approx(max(1.0, coh / ind))
    # values of the low-attention states all equal: the factor is about |S|
    yv2 = yv.copy()
    yv2[S] = yv[S[0]]
    o2 = P @ yv2
    d2 = np.sum((yv2[None] - o2[:, None]) ** 2, axis=2)
    assert eviction_coherence(P, o2, yv2, d2, p2, cand) > 0.5 * len(S)
    assert eviction_coherence(P, o, yv, dist2, p2, np.zeros(n, bool)) == 1.0


def test_coherence_is_large_only_when_evicted_values_align():
    rng = np.random.default_rng(10)
    n = 80
    q = rng.standard_normal((1, D))
    k = rng.standard_normal((1, n, D)) * 0.3
    k[0, n // 2:] += q[0]                                # the query looks at the second half
    v_random = rng.standard_normal((1, n, D))
    u = rng.standard_normal(D)
    v_aligned = 0.1 * rng.standard_normal((1, n, D))
    v_aligned[0, :n // 2] += u                           # the ignored half shares a value
    v_aligned[0, n // 2:] -= u
    kappa = {}
    for name, v in (("random", v_random), ("aligned", v_aligned)):
        cache = make_cache(L=1, H=1, G=1, policy=CompressPolicy(sinks=0, recent=0))
        seq = cache.new_sequence()
        cache.append(seq, 0, k, v)
        cache.observe(seq, 0, q)
        st = cache.paged.states((seq, 0, 0))
        *_, kap = cache._row_statistics(seq, cache._seqs[seq], 0, 0, st, np.ones(n, bool))
        kappa[name] = np.median(kap)
    assert kappa["random"] < 4
    assert kappa["aligned"] > 10
    with pytest.raises(ValueError, match="coherence"):
        CompressPolicy(coherence=1)


def test_policy_recompresses_during_decode():
    rng = np.random.default_rng(6)
    budget = 3 * 1024 * 2 * 2
    cache = make_cache(L=2, H=2, page_bytes=1024,
                       policy=CompressPolicy(sinks=2, recent=4, every=5, budget_bytes=budget))
    seq = cache.new_sequence()
    fill(cache, seq, 40, rng, chunks=(4,))
    for step in range(12):
        q = rng.standard_normal((4, D))
        for layer in range(2):
            cache.append(seq, layer, rng.standard_normal((2, 1, D)), rng.standard_normal((2, 1, D)))
            cache.decode(seq, layer, q)
        assert cache._seqs[seq].since_compress < 5
    assert cache.bytes_in_use(seq) <= budget + 5 * 2 * 2 * 1024
    cache.paged.check_invariants()
    with pytest.raises(ValueError, match="budget_bytes"):
        CompressPolicy(every=3)
    with pytest.raises(ValueError, match="prior"):
        CompressPolicy(prior=1.5)


def test_failed_automatic_compress_undoes_the_append():
    rng = np.random.default_rng(7)
    cache = make_cache(L=1, H=1, policy=CompressPolicy(sinks=2, recent=40, every=1, budget_bytes=1024))
    seq = cache.new_sequence()
    k = rng.standard_normal((1, 8, D))
    cache.append(seq, 0, k, k)              # 8 protected states: 2 pages of 4 = 1024 bytes
    snap = cache_snapshot(cache)
    with pytest.raises(ValueError, match="alone need 1536 bytes"):
        cache.append(seq, 0, k[:, :1], k[:, :1])
    assert_cache_same(snap, cache_snapshot(cache))


# ------------------------------------------------------------------ errors

def test_errors_leave_the_cache_unchanged_and_usable():
    rng = np.random.default_rng(8)
    cache = make_cache(L=2, H=2, pages=12)
    a, b = cache.new_sequence(), cache.new_sequence()
    fill(cache, a, 9, rng)
    cache.free(b)
    q = rng.standard_normal((4, D))
    out0 = cache.decode(a, 1, q, record=False)
    snap = cache_snapshot(cache)
    good = rng.standard_normal((2, 3, D))
    cases = [
        (lambda: cache.append(b, 0, good, good), "freed"),
        (lambda: cache.append(99, 0, good, good), "unknown sequence"),
        (lambda: cache.append(a, 2, good, good), "layer must be in 0..1"),
        (lambda: cache.append(a, 0, good[:1], good[:1]), r"\(2, t, 32\)"),
        (lambda: cache.append(a, 0, good[..., :16], good[..., :16]), r"\(2, t, 32\)"),
        (lambda: cache.append(a, 0, good, good[:, :2]), "same shape"),
        (lambda: cache.append(a, 0, good * np.nan, good), "NaN"),
        (lambda: cache.append(a, 0, rng.standard_normal((2, 200, D)), rng.standard_normal((2, 200, D))),
         "page pool exhausted"),
        (lambda: cache.decode(a, 0, q[:3]), r"\(4, 32\)"),
        (lambda: cache.decode(a, 0, q[:, :8]), r"\(4, 32\)"),
        (lambda: cache.decode(b, 0, q), "freed"),
        (lambda: cache.observe(a, 0, q[:2]), r"\(4, 32\)"),
        (lambda: cache.protect(a, 5, 5), "start < stop"),
        (lambda: cache.protect(a, -1, 5), "start"),
        (lambda: cache.compress(a, -5), "budget_bytes"),
        (lambda: cache.compress(a, 1.5), "budget_bytes"),
        (lambda: cache.compress(a, 10 ** 6, method="exact"), "method"),
        (lambda: cache.free(b), "freed"),
        (lambda: cache.bytes_in_use(b), "freed"),
    ]
    for call, msg in cases:
        with pytest.raises(ValueError, match=msg):
            call()
        assert_cache_same(snap, cache_snapshot(cache))
    with pytest.raises(PoolExhaustedError):
        cache.append(a, 0, rng.standard_normal((2, 200, D)), rng.standard_normal((2, 200, D)))
    np.testing.assert_array_equal(cache.decode(a, 1, q, record=False), out0)
    # still usable
    fill(cache, a, 2, rng)
    cache.compress(a, cache.bytes_in_use(a))
    cache.paged.check_invariants()
    new = cache.new_sequence()
    assert new == 2
    with pytest.raises(ValueError, match="no kept state"):
        cache.decode(new, 0, q)


@pytest.mark.parametrize("kw, msg", [
    (dict(num_q_heads=3), "multiple"),
    (dict(page_bytes=100, pool_bytes=1000), "multiple of 16"),
    (dict(page_bytes=256, pool_bytes=128), "pool_bytes"),
    (dict(softmax_scale=0.0), "softmax_scale"),
])
def test_constructor_errors(kw, msg):
    args = dict(page_bytes=512, pool_bytes=4096)
    args.update(kw)
    with pytest.raises(ValueError, match=msg):
        SphericalKVCache(1, 2, D, LADDER, **args)


# ------------------------------------------------------------------ stateful

SD = 16
S_LADDER = TierLadder([(2, 2), (4, 4), (16, 16)])


class CacheMachine(RuleBasedStateMachine):
    """Random interleavings of new_sequence / append / protect / observe / compress /
    decode / free over several sequences, checking docs/design.md §4's invariants after each step:
    bytes in use ≤ budget after compress, one sequence's operations never change another's
    decode, protected states kept where they are (new ones at the top tier), every refused
    call leaves the whole cache as it was, a freed sequence returns exactly its pages."""

    seqs = Bundle("seqs")

    @initialize()
    def setup(self):
        self.cache = SphericalKVCache(2, 2, SD, S_LADDER, page_bytes=256, pool_bytes=256 * 48,
                                      num_q_heads=4, seed=1, policy=CompressPolicy(sinks=1, recent=2, window=3))
        self.rng = np.random.default_rng(0)
        self.live = set()
        self.probe = {}       # seq -> probe query

    def _outputs(self, sid):
        q = self.probe[sid]
        outs = []
        for layer in range(2):
            try:
                outs.append(self.cache.decode(sid, layer, q, record=False))
            except ValueError:
                outs.append(None)
        return outs

    def _others_unchanged(self, sid, op):
        """Run op on sid; every other live sequence must decode bit-identically after."""
        others = {o: self._outputs(o) for o in self.live if o != sid}
        result = op()
        for o, before in others.items():
            after = self._outputs(o)
            for x, y in zip(before, after):
                assert (x is None) == (y is None)
                if x is not None:
                    np.testing.assert_array_equal(x, y)
        return result

    def _refused(self, op, match, error=ValueError):
        """op must raise error (matching) and leave everything as it was."""
        snap = cache_snapshot(self.cache)
        with pytest.raises(error, match=match):
            op()
        assert_cache_same(snap, cache_snapshot(self.cache))

    @precondition(lambda self: len(self.live) < 4)
    @rule(target=seqs, prefill=st.sampled_from([0, 1, 3, 7, 12]))
    def new_sequence(self, prefill):
        sid = self._others_unchanged(None, self.cache.new_sequence)
        self.live.add(sid)
        self.probe[sid] = self.rng.standard_normal((4, SD))
        if prefill:
            self.append(sid, prefill, (0, 1))
        return sid

    @rule(sid=seqs, t=st.sampled_from([1, 1, 2, 3, 5, 7, 13, 17]),
          layers=st.sampled_from([(0, 1), (0, 1), (0,), (1,)]))
    def append(self, sid, t, layers):
        """A chunk of t tokens into some layers (one layer alone: a prefill in progress)."""
        if sid not in self.live:
            self._refused(lambda: self.cache.append(sid, 0, np.ones((2, t, SD)), np.ones((2, t, SD))), "freed")
            return
        for layer in layers:
            k = self.rng.standard_normal((2, t, SD)) + 0.5
            v = self.rng.standard_normal((2, t, SD))
            need = sum(self.cache.paged.pages_needed((sid, layer, h), t) for h in range(2))
            if self.cache.paged.pool.num_free < need:
                self._refused(lambda: self.cache.append(sid, layer, k, v), "pool exhausted", PoolExhaustedError)
                event("append: pool exhausted")
                return
            self._others_unchanged(sid, lambda: self.cache.append(sid, layer, k, v))

    @rule(sid=seqs, start=st.integers(0, 30), width=st.integers(1, 6))
    def protect(self, sid, start, width):
        if sid not in self.live:
            return
        length = int(self.cache._seqs[sid].length.max())
        if start + width > length:
            self._refused(lambda: self.cache.protect(sid, start, start + width), "goes past")
            event("protect: past the end")
        else:
            self.cache.protect(sid, start, start + width)

    @rule(sid=seqs, layer=st.integers(0, 1))
    def observe(self, sid, layer):
        if sid in self.live:
            self.cache.observe(sid, layer, self.rng.standard_normal((4, SD)) * 2)

    @rule(sid=seqs, frac=st.floats(0.0, 1.2), absolute=st.sampled_from([None, None, 0, 256, 1024]),
          as_fraction=st.booleans())
    def compress(self, sid, frac, absolute, as_fraction):
        """RDR to a random budget: a fraction of what the sequence holds (given as bytes or
        as budget_fraction), or a few pages (often less than the protected states need)."""
        if sid not in self.live:
            self._refused(lambda: self.cache.compress(sid, 1024), "freed")
            return
        c = self.cache
        if absolute is not None:
            kw = dict(budget_bytes=absolute)
        elif as_fraction and frac <= 1.0:
            kw = dict(budget_fraction=frac)
        else:
            kw = dict(budget_bytes=int(frac * c.bytes_in_use(sid)))
        budget = kw.get("budget_bytes", int(np.floor(frac * c.bf16_bytes(sid))))   # a fraction is of the bf16 bytes
        before = {k: dict(zip(c.paged.states(k).pos, c.paged.states(k).tier))
                  for k in c.paged.rows if k[0] == sid}
        snap = cache_snapshot(c)
        try:
            self._others_unchanged(sid, lambda: c.compress(sid, **kw))
        except ValueError as e:
            assert "protected states" in str(e)
            event("compress: refused")
            assert_cache_same(snap, cache_snapshot(c))
            return
        assert c.bytes_in_use(sid) <= budget
        event("compress: applied")
        top = S_LADDER.top
        for k, old in before.items():
            stt = c.paged.states(k)
            now = dict(zip(stt.pos, stt.tier))
            assert set(now) <= set(old)
            assert all(now[p] <= old[p] for p in now), "promotion"
            prot = c.protected_mask(sid, k[1], np.array(sorted(old), np.int64))
            for p, is_prot in zip(sorted(old), prot):
                if is_prot:
                    assert now.get(p) == old[p], f"protected position {p} changed"
                    if old[p] == top:
                        event("compress: protected state at the top tier")

    @rule(sid=seqs, layer=st.integers(0, 1))
    def decode(self, sid, layer):
        if sid not in self.live:
            self._refused(lambda: self.cache.decode(sid, layer, self.rng.standard_normal((4, SD))), "freed")
            return
        q = self.rng.standard_normal((4, SD))
        try:
            out = self._others_unchanged(sid, lambda: self.cache.decode(sid, layer, q))
        except ValueError as e:
            assert "no kept state" in str(e)
            event("decode: empty")
            return
        ref = self.cache.reference_decode(sid, layer, q)
        assert rel_err(out, ref) < REL

    @rule(sid=seqs, which=st.integers(0, 5))
    def bad_call(self, sid, which):
        """A call with one bad argument: refused, nothing changes."""
        c, ok = self.cache, np.ones((2, 1, SD))
        calls = [
            (lambda: c.append(sid, 2, ok, ok), "layer"),
            (lambda: c.append(sid, 0, ok * np.nan, ok), "k contains NaN"),
            (lambda: c.append(sid, 1, ok, ok[..., :8]), "v must have shape"),
            (lambda: c.compress(sid, 0.5), "budget_fraction"),
            (lambda: c.compress(sid, budget_fraction=1.5), "budget_fraction"),
            (lambda: c.decode(sid, 0, np.full((4, SD), np.inf)), "q contains NaN"),
        ]
        call, match = calls[which]
        self._refused(call, match if sid in self.live else "freed")

    @rule(sid=consumes(seqs))
    def free(self, sid):
        if sid in self.live:
            pool = self.cache.paged.pool
            held = self.cache.bytes_in_use(sid) // self.cache.page_bytes
            free0 = pool.num_free
            self._others_unchanged(sid, lambda: self.cache.free(sid))
            self.live.discard(sid)
            assert pool.num_free == free0 + held, "a freed sequence did not return all its pages"
            self._refused(lambda: self.cache.bytes_in_use(sid), "freed")

    @invariant()
    def pool_invariants(self):
        if not hasattr(self, "cache"):
            return
        c = self.cache
        c.paged.check_invariants()          # one page per state, page counts, no leaks
        pool = c.paged.pool
        assert pool.num_free + pool.num_used == pool.num_pages
        assert c.bytes_in_use() == sum(c.bytes_in_use(s) for s in self.live)
        for key, pages in c.paged.rows.items():
            assert key[0] in self.live
            stt = c.paged.states(key)
            np.testing.assert_array_equal(stt.tier, pool.page_tier[stt.page])   # page tier == state tier
            assert np.all(stt.pos < c._seqs[key[0]].length[key[1]])


CacheMachine.TestCase.settings = settings(settings.default, stateful_step_count=30)
TestCacheMachine = CacheMachine.TestCase


def test_horizon_estimates_from_the_queries_carried_through_rope():
    from spherical_kv_ref.rdr.statistics import future_queries, rope_inv_freq
    f = rope_inv_freq(D, 10000.0)
    with pytest.raises(ValueError, match="rope_inv_freq"):
        make_cache(L=1, H=1, G=2, policy=CompressPolicy(sinks=0, recent=0, horizon=64))
    with pytest.raises(ValueError, match="rope_inv_freq"):
        make_cache(L=1, H=1, G=2, rope_inv_freq=f[:-1])
    with pytest.raises(ValueError, match="horizon"):
        CompressPolicy(horizon=-1)
    q = np.random.default_rng(14).standard_normal((4, 2, D))

    def stats(horizon, window, observations):
        rng = np.random.default_rng(13)
        cache = make_cache(L=1, H=1, G=2, rope_inv_freq=f,
                           policy=CompressPolicy(sinks=0, recent=0, window=window, horizon=horizon))
        seq = cache.new_sequence()
        cache.append(seq, 0, rng.standard_normal((1, 50, D)), rng.standard_normal((1, 50, D)))
        for o in observations:
            cache.observe(seq, 0, o)
        st = cache.paged.states((seq, 0, 0))
        return cache._row_statistics(seq, cache._seqs[seq], 0, 0, st, np.ones(50, bool))

    carried = stats(64, 3, q)                      # the window keeps the last 3 observations
    # the same as recording, without a horizon, the last 3 queries of each head carried on
    moved = np.stack([future_queries(q[1:, g], f, 64) for g in range(2)], axis=1)     # (24, 2, D)
    by_hand = stats(0, len(moved), moved)
    for a, b in zip(carried, by_hand):
        assert np.allclose(a, b, rtol=1e-10, atol=1e-14)
    plain = stats(0, 3, q)
    assert not np.allclose(plain[0], carried[0])           # the estimate moved
    assert carried[1] == pytest.approx(plain[1])          # RoPE keeps ‖q‖²: so does Q²
