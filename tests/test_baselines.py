"""KV-compression baselines (spherical_kv_eval/baselines): bytes, budgets, quantizer errors."""
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from spherical_kv_eval.baselines import (
    FP8_MAX, H2O, KIVI, AttentionStats, Dense, FP8E4M3, SnapKV, StreamingLLM,
    asymmetric_quantize, attention_stats, bf16_round, dense_bytes, fp8_e4m3_round,
    max_pool_1d, standard_methods)


def _cache(L=2, H=3, T=97, d=64, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    ks = [(scale * rng.standard_normal((H, T, d))).astype(np.float32) for _ in range(L)]
    vs = [(scale * rng.standard_normal((H, T, d))).astype(np.float32) for _ in range(L)]
    qs = [rng.standard_normal((3 * H, T, d)).astype(np.float32) for _ in range(L)]
    return qs, ks, vs


# ---- number formats -------------------------------------------------------------------

def _e4m3_table():
    """Every finite e4m3 value with its mantissa field, by enumerating the encodings."""
    vals, mants = [], []
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue  # the NaN code
            v = (m / 8) * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
            for s in (1.0, -1.0):
                vals.append(s * v)
                mants.append(m)
    vals, mants = np.array(vals), np.array(mants)
    order = np.argsort(vals, kind="stable")
    return vals[order], mants[order]


def _e4m3_brute(x):
    vals, mants = _e4m3_table()
    out = np.empty_like(x, dtype=np.float64)
    for i, xi in enumerate(x):
        xi = float(np.clip(xi, -FP8_MAX, FP8_MAX))
        dist = np.abs(vals - xi)
        best = np.flatnonzero(dist == dist.min())
        even = [j for j in best if mants[j] % 2 == 0]
        out[i] = vals[even[0] if even else best[0]]
    return out


def test_fp8_rounding_matches_enumeration_including_every_tie():
    vals, _ = _e4m3_table()
    uniq = np.unique(vals)
    assert uniq.max() == FP8_MAX and len(uniq) == 253  # 254 finite codes, ±0 coincide
    rng = np.random.default_rng(1)
    mids = (uniq[1:] + uniq[:-1]) / 2
    x = np.concatenate([mids, uniq, rng.uniform(-500, 500, 400),
                        rng.standard_normal(300) * 2.0 ** rng.integers(-12, 6, 300),
                        [460.0, -1e6, 1e-12, 0.0]])
    np.testing.assert_array_equal(fp8_e4m3_round(x), _e4m3_brute(x))


def test_bf16_round_is_nearest_ties_to_even():
    rng = np.random.default_rng(2)
    x = (rng.standard_normal(2000) * 10.0 ** rng.integers(-5, 5, 2000)).astype(np.float32)
    bits = x.view(np.uint32)
    lo = (bits & 0xFFFF0000).view(np.float32).astype(np.float64)
    hi = ((bits & 0xFFFF0000) + 0x10000).view(np.float32).astype(np.float64)
    r = bf16_round(x).astype(np.float64)
    assert np.all((r == lo) | (r == hi))
    err = np.abs(r - x)
    assert np.all(err <= np.minimum(np.abs(lo - x), np.abs(hi - x)))
    tie = np.float32(1.0 + 2.0 ** -8)  # exactly between 1 and the next bf16: goes to 1
    assert bf16_round(np.array([tie]))[0] == 1.0


# ---- quantizing baselines -------------------------------------------------------------

def test_dense_is_the_byte_reference():
    qs, ks, vs = _cache(T=17)
    c = Dense().compress(ks, vs)
    assert c.nbytes == dense_bytes(2, 3, 17, 64) == 2 * 2 * 3 * 17 * 64 * 2
    assert c.fraction == 1.0 and c.kept_fraction == 1.0
    np.testing.assert_array_equal(c.layers[1].values, bf16_round(vs[1]))


def test_fp8_method_bytes_and_values_on_the_scaled_grid():
    qs, ks, vs = _cache(L=3, H=2, T=33, scale=7.0)
    c = FP8E4M3().compress(ks, vs)
    assert c.nbytes == 3 * (2 * 2 * 33 * 64 + 2 * 2 * 4)
    for layer, k in zip(c.layers, ks):
        for h in range(2):
            scale = np.float32(np.abs(k[h]).max() / FP8_MAX)
            if h == 0:  # the stored codes are the enumerated e4m3 rounding of x / scale
                codes = _e4m3_brute(k[h].ravel().astype(np.float64) / scale)
                np.testing.assert_array_equal(
                    layer.keys[h].ravel(), (codes * scale).astype(np.float32))
            # relative error of e4m3 with 3 mantissa bits: half a step = 2^-4 of 2^e
            err = np.abs(layer.keys[h] - k[h])
            assert np.all(err <= np.maximum(np.abs(k[h]) * 2.0 ** -4, scale * 2.0 ** -10)
                          * (1 + 1e-5))


@given(bits=st.sampled_from([2, 4]), n=st.integers(1, 40), seed=st.integers(0, 2**16),
       spread=st.floats(1e-3, 1e3))
def test_asymmetric_quantization_error_within_half_step(bits, n, seed, spread):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((5, n)) * spread + rng.standard_normal((5, 1))).astype(np.float32)
    x_hat, codes, scale, zero = asymmetric_quantize(x, bits, axis=1)
    assert codes.max() < 2 ** bits and scale.dtype == np.float16
    s = scale.astype(np.float64)
    bound = s / 2 + np.abs(x).astype(np.float64) * 2.0 ** -23 + 1e-30
    assert np.all(np.abs(x_hat.astype(np.float64) - x) <= bound)
    assert np.all(zero.astype(np.float64) <= x.min(axis=1, keepdims=True))


@pytest.mark.parametrize("T", [1, 32, 63, 64, 97, 300])
@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_bytes_structure_and_error(T, bits):
    H, d, g, r = 3, 64, 32, 32
    qs, ks, vs = _cache(L=2, H=H, T=T, d=d, seed=T)
    m = KIVI(bits)
    c = m.compress(ks, vs)
    nq = max(0, (T - r) // g) * g
    assert m.quantized_tokens(T) == nq and T - nq >= min(T, r)
    per_head = (2 * math.ceil(nq * d * bits / 8) + (nq // g) * d * 4 + nq * (d // g) * 4
                + 2 * (T - nq) * d * 2)
    assert c.nbytes == 2 * H * per_head
    for layer, k, v in zip(c.layers, ks, vs):
        np.testing.assert_array_equal(layer.keys[:, nq:], bf16_round(k[:, nq:]))
        np.testing.assert_array_equal(layer.values[:, nq:], bf16_round(v[:, nq:]))
        for h in range(H):
            for t0 in range(0, nq, g):  # a key group: one channel over 32 tokens
                blk, ref = layer.keys[h, t0:t0 + g], k[h, t0:t0 + g]
                for j in (0, 17, 63):
                    assert len(np.unique(blk[:, j])) <= 2 ** bits
                step = (ref.max(0) - ref.min(0)) / (2 ** bits - 1)
                assert np.all(np.abs(blk - ref) <= step * (1 + 2e-3) / 2 + 1e-6)
            for t in range(0, nq, 7):  # a value group: one token over 32 channels
                for c0 in (0, 32):
                    assert len(np.unique(layer.values[h, t, c0:c0 + g])) <= 2 ** bits


def test_kivi_native_fractions_at_long_context():
    qs, ks, vs = _cache(L=1, H=1, T=2048)
    # per (K, V) element pair: codes 2·bits/8 bytes, key and value (scale, zero) pairs
    # 4 bytes per 32 elements each; the 32-token tail 2·2 bytes; dense 2·2 bytes
    for bits in (4, 2):
        expect = (2016 * (2 * bits / 8 + 2 * 4 / 32) + 32 * 4) / (2048 * 4)
        assert KIVI(bits).compress(ks, vs).fraction == pytest.approx(expect, rel=1e-12)


# ---- attention statistics -------------------------------------------------------------

def _brute_stats(q, k, window):
    hq, T, d = q.shape
    group = hq // k.shape[0]
    acc, obs = np.zeros((k.shape[0], T)), np.zeros((k.shape[0], T))
    for h in range(hq):
        logits = q[h].astype(np.float64) @ k[h // group].T.astype(np.float64) / np.sqrt(d)
        logits[np.triu_indices(T, 1)] = -np.inf
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        acc[h // group] += p.sum(0) / group
        obs[h // group] += p[T - window:].sum(0) / group
    return acc, obs


@pytest.mark.parametrize("T, window, block", [(1, 1, 4), (17, 5, 4), (97, 32, 7), (97, 97, 256)])
def test_attention_stats_match_brute_force(T, window, block):
    qs, ks, vs = _cache(L=2, H=3, T=T, d=16, seed=T)
    stats = attention_stats(qs, ks, window=window, block=block)
    for l in range(2):
        acc, obs = _brute_stats(qs[l], ks[l], window)
        np.testing.assert_allclose(stats.accumulated[l], acc, rtol=2e-5, atol=1e-6)
        np.testing.assert_allclose(stats.observation[l], obs, rtol=2e-5, atol=1e-6)
        np.testing.assert_allclose(stats.accumulated[l].sum(1), T, rtol=1e-5)
        np.testing.assert_allclose(stats.observation[l].sum(1), window, rtol=1e-5)


def test_attention_stats_query_stride_samples_rows():
    T, s, w = 50, 4, 6
    qs, ks, vs = _cache(L=1, H=3, T=T, d=16, seed=9)
    stats = attention_stats(qs, ks, window=w, query_stride=s, block=5)
    acc_all = np.zeros((3, T))
    for i in range(0, T, s):  # rows 0, s, 2s, ... only; row i = window 1 of prefix i+1
        _, row_i = _brute_stats(qs[0][:, :i + 1], ks[0][:, :i + 1], 1)
        acc_all[:, :i + 1] += s * row_i
    np.testing.assert_allclose(stats.accumulated[0], acc_all, rtol=2e-5, atol=1e-6)
    _, obs = _brute_stats(qs[0], ks[0], w)
    np.testing.assert_allclose(stats.observation[0], obs, rtol=2e-5, atol=1e-6)


STATS_CASES = [(1, 1, 1, 4), (17, 5, 3, 4), (97, 32, 4, 7), (97, 97, 1, 256)]


@pytest.mark.parametrize("device", ["cpu"])
@pytest.mark.parametrize("T, window, stride, block", STATS_CASES)
def test_attention_stats_in_torch_are_the_numpy_reference_s(device, T, window, stride, block):
    """The torch twin (what a run on a GPU computes) gives the NumPy statistics within
    float32 rounding, at awkward sizes, strided or not, blocks that do not divide the rows
    (on the CPU here; tests/test_evaluate_device.py runs it on a GPU)."""
    pytest.importorskip("torch")
    qs, ks, _ = _cache(L=2, H=3, T=T, d=16, seed=T + stride)
    ref = attention_stats(qs, ks, window=window, query_stride=stride, block=block)
    got = attention_stats(qs, ks, window=window, query_stride=stride, block=block, device=device)
    for l in range(2):
        for a, b in ((got.accumulated[l], ref.accumulated[l]), (got.observation[l], ref.observation[l])):
            assert a.dtype == np.float64 and a.shape == b.shape
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# ---- evicting baselines ---------------------------------------------------------------

def _stats_with(acc, obs, window):
    return AttentionStats([acc], [obs], window)


@pytest.mark.parametrize("budget", [0.5, 0.25, 0.15, 0.10, 0.013, 1.0])
@pytest.mark.parametrize("cls", [StreamingLLM, H2O, SnapKV])
@pytest.mark.parametrize("T", [97, 300])
def test_eviction_keeps_exactly_what_the_budget_allows(cls, budget, T):
    L, H, d = 2, 3, 64
    qs, ks, vs = _cache(L=L, H=H, T=T, d=d, seed=3)
    stats = attention_stats(qs, ks, window=min(16, T))
    c = cls(budget).compress(ks, vs, stats)
    layer_budget = math.floor(budget * H * T * 2 * d * 2)
    state = 2 * d * 2 + (0 if cls is StreamingLLM else 4)
    meta = 8 if cls is StreamingLLM else 0
    n = min(T, (layer_budget - meta) // (H * state))
    for layer, k, v in zip(c.layers, ks, vs):
        assert np.array_equal(layer.keep.sum(1), np.full(H, n))
        if n < T:
            assert layer.nbytes == H * n * state + meta <= layer_budget
            assert layer.nbytes + H * state > layer_budget  # one more per head won't fit
        else:
            assert layer.nbytes == H * T * 2 * d * 2
        kept = layer.keep[..., None]
        np.testing.assert_array_equal(layer.keys, np.where(kept, bf16_round(k), 0))
        np.testing.assert_array_equal(layer.values, np.where(kept, bf16_round(v), 0))
    assert c.nbytes <= budget * c.dense_nbytes


def test_streamingllm_keeps_sinks_and_recent():
    qs, ks, vs = _cache(L=1, H=2, T=100, d=64)
    keep = StreamingLLM(0.25, sinks=4).compress(ks, vs).layers[0].keep
    n = keep[0].sum()
    expect = np.zeros(100, bool)
    expect[:4] = True
    expect[100 - (n - 4):] = True
    assert np.array_equal(keep[0], expect) and np.array_equal(keep[1], expect)


def test_h2o_keeps_heavy_hitters_and_recent_window():
    H, T, d = 2, 200, 64
    qs, ks, vs = _cache(L=1, H=H, T=T, d=d)
    acc = np.random.default_rng(5).uniform(0, 1, (H, T))
    heavy = [[0, 3, 50, 77, 120], [1, 2, 90, 91, 150]]
    for h in range(H):
        acc[h, heavy[h]] += 10.0
    m = H2O(0.1)
    n = m.tokens_per_head(H, T, d)
    keep = m.compress(ks, vs, _stats_with(acc, acc, 8)).layers[0].keep
    n_recent = round(n * 0.5)
    for h in range(H):
        assert keep[h, T - n_recent:].all()
        assert keep[h, heavy[h]].all()
        older = np.flatnonzero(keep[h, :T - n_recent])
        rest = np.setdiff1d(np.arange(T - n_recent), older)
        assert acc[h, older].min() >= acc[h, rest].max()


def test_snapkv_pools_votes_and_keeps_the_window():
    H, T, d, w = 1, 300, 64, 16
    qs, ks, vs = _cache(L=1, H=H, T=T, d=d)
    obs = np.zeros((H, T))
    obs[0, 100] = 5.0  # one spike: pooling with kernel 7 pulls in 97..103
    obs[0, 200] = 4.0
    obs[0, 10] = 3.0
    m = SnapKV(0.25, kernel=7)
    n = m.tokens_per_head(H, T, d)
    assert n >= w + 21
    keep = m.compress(ks, vs, _stats_with(obs, obs, w)).layers[0].keep[0]
    assert keep[T - w:].all()
    for c in (100, 200, 10):
        assert keep[c - 3:c + 4].all()
    np.testing.assert_array_equal(max_pool_1d(np.array([[0., 5, 0, 0, 1]]), 3),
                                  [[5., 5, 5, 1, 1]])


def test_standard_methods_cover_the_line_up():
    names = [m.name for m in standard_methods()]
    assert names[:4] == ["dense-bf16", "fp8-e4m3", "kivi4", "kivi2"]
    for b in ("50%", "25%", "15%", "10%"):
        for kind in ("streamingllm", "h2o", "snapkv"):
            assert f"{kind}@{b}" in names


@pytest.mark.parametrize("call, msg", [
    (lambda: H2O(0.0), "budget"),
    (lambda: SnapKV(1.5), "budget"),
    (lambda: SnapKV(0.5, kernel=4), "odd"),
    (lambda: KIVI(3), "2 or 4 bits"),
    (lambda: H2O(0.5).compress(*_cache()[1:]), "needs attention statistics"),
    (lambda: Dense().compress([np.zeros((2, 3))], [np.zeros((2, 3))]), "kv_heads, T, head_dim"),
    (lambda: Dense().compress([np.full((1, 2, 4), np.nan)], [np.zeros((1, 2, 4))]), "NaN"),
    (lambda: Dense().compress([], []), "same positive number"),
    (lambda: attention_stats(*_cache(T=8)[:2], window=9), "observation window"),
    (lambda: attention_stats(*_cache(T=8)[:2], window=2, query_stride=0), "query_stride"),
    (lambda: H2O(0.5).compress(_cache(T=8)[1], _cache(T=8)[2],
                               attention_stats(*_cache(T=9)[:2], window=2)), "stats"),
])
def test_bad_input_raises_value_error(call, msg):
    with pytest.raises(ValueError, match=msg):
        call()
