"""Reference decode attention from codes (docs/design.md §6): equal to attention over the decoded
states, centring exact, and close to dense attention at high precision."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import spherical_kv_ref as skv
from spherical_kv_ref.ada import merge_attention
from spherical_kv_ref.rotation import VALUE_SALT


def _codecs(dim, kb, vb, seed=0):
    return skv.SphericalCodec(dim, kb, seed), skv.SphericalCodec(dim, vb, seed, salt=VALUE_SALT)


@given(dim=st.sampled_from((64, 128, 96)), kb=st.sampled_from((2, 3, 4, 8, 16)),
       vb=st.sampled_from((1, 2, 3, 4, 8, 16)), n=st.sampled_from((1, 17, 97)),
       m=st.sampled_from((1, 4, 8)), centred=st.booleans(), seed=st.integers(0, 99))
def test_attention_from_codes_equals_attention_over_decoded_states(dim, kb, vb, n, m, centred, seed):
    rng = np.random.default_rng(seed)
    k, v, q = rng.standard_normal((n, dim)) + 1, rng.standard_normal((n, dim)), rng.standard_normal((m, dim))
    kc, vc = _codecs(dim, kb, vb, seed)
    ke = kc.encode(k, mean=k.mean(0) if centred else None)
    ve = vc.encode(v, mean=v.mean(0) if centred else None)
    out = skv.attention(q, ke, ve, kc, vc)
    ref = skv.dense_attention(q, kc.decode(ke), vc.decode(ve))
    assert np.allclose(out, ref, rtol=1e-10, atol=1e-10 * np.abs(ref).max())


def test_centred_and_uncentred_attention_agree_on_exact_data():
    # fp16 tier: the stored states are exact to fp16, so both variants see the same data
    rng = np.random.default_rng(1)
    k = rng.standard_normal((33, 64)) * 0.25 + 3.0
    v = rng.standard_normal((33, 64)) * 0.25 - 2.0
    q = rng.standard_normal((4, 64))
    kc, vc = _codecs(64, 16, 16)
    plain = skv.attention(q, kc.encode(k), vc.encode(v), kc, vc)
    centred = skv.attention(q, kc.encode(k, mean=k.mean(0)), vc.encode(v, mean=v.mean(0)), kc, vc)
    exact = skv.dense_attention(q, k, v)
    assert np.allclose(plain, exact, atol=5e-3) and np.allclose(centred, exact, atol=5e-3)
    assert np.allclose(plain, centred, atol=5e-3)


def test_centring_shrinks_logit_error_when_keys_share_a_mean():
    rng = np.random.default_rng(4)
    mu = rng.standard_normal(128) * 3           # the mean carries most of the key energy
    k = rng.standard_normal((256, 128)) + mu
    q = rng.standard_normal((4, 128))
    kc = skv.SphericalCodec(128, 3)
    exact = q @ k.T
    err_plain = np.abs(kc.logits(q, kc.encode(k)) - exact).mean()
    err_c = np.abs(kc.logits(q, kc.encode(k, mean=k.mean(0))) - exact).mean()
    # radii shrink by about ‖k − μ‖/‖k‖ ≈ 1/3, and the logit error with them
    assert err_c < 0.5 * err_plain


@pytest.mark.parametrize("kb,vb,tol", [(16, 16, 2e-3), (8, 8, 2e-2), (4, 4, 0.2)])
def test_attention_error_shrinks_with_bits(kb, vb, tol):
    rng = np.random.default_rng(5)
    k, v, q = rng.standard_normal((200, 64)), rng.standard_normal((200, 64)), rng.standard_normal((8, 64)) * 2
    kc, vc = _codecs(64, kb, vb)
    out = skv.attention(q, kc.encode(k), vc.encode(v), kc, vc)
    exact = skv.dense_attention(q, k, v)
    assert np.linalg.norm(out - exact) / np.linalg.norm(exact) < tol


def test_lse_lets_two_halves_merge_into_the_whole():
    rng = np.random.default_rng(6)
    k, v, q = rng.standard_normal((50, 64)), rng.standard_normal((50, 64)), rng.standard_normal((3, 64))
    kc, vc = _codecs(64, 4, 4)
    ke, ve = kc.encode(k), vc.encode(v)
    whole = skv.attention(q, ke, ve, kc, vc)
    a, la = skv.attention(q, ke.take(slice(0, 20)), ve.take(slice(0, 20)), kc, vc, return_lse=True)
    b, lb = skv.attention(q, ke.take(slice(20, 50)), ve.take(slice(20, 50)), kc, vc, return_lse=True)
    merged, lse = merge_attention(a, la, b, lb)
    assert np.allclose(merged, whole, rtol=1e-12, atol=1e-12)
    assert np.allclose(lse, skv.attention(q, ke, ve, kc, vc, return_lse=True)[1], rtol=1e-12)
    # a part over no state (lse −inf) adds nothing, on either side
    for got, l in (merge_attention(a, la, np.zeros_like(a), np.full(3, -np.inf)),
                   merge_attention(np.zeros_like(a), np.full(3, -np.inf), a, la)):
        assert np.array_equal(got, a) and np.array_equal(l, la)


def test_attention_rejects_mismatched_inputs():
    kc, vc = _codecs(64, 4, 4)
    ke = kc.encode(np.ones((3, 64)))
    ve = vc.encode(np.ones((2, 64)))
    with pytest.raises(ValueError, match="3 keys but 2 values"):
        skv.attention(np.ones((1, 64)), ke, ve, kc, vc)
    with pytest.raises(ValueError, match="zero kept states"):
        skv.attention(np.ones((1, 64)), ke.take(slice(0, 0)), ve.take(slice(0, 0)), kc, vc)


def test_tier_ladder_bytes_and_validation():
    ladder = skv.TierLadder([(2, 2), (3, 3), (4, 4), (8, 8), (16, 16)])
    assert ladder.bytes_per_state(0, 128) == 0
    assert ladder.bytes_per_state(3, 128) == 2 * 66
    assert ladder.bytes_per_state(5, 128) == 512
    assert list(ladder.costs(128)) == [0, 68, 100, 132, 260, 512]
    assert ladder.states_per_page(3, 128, 4096) == 4096 // 132
    with pytest.raises(ValueError, match="ascending"):
        skv.TierLadder([(4, 4), (2, 2)])
    with pytest.raises(ValueError, match="bits"):
        skv.TierLadder([(5, 4)])
    with pytest.raises(ValueError, match="cannot hold"):
        ladder.states_per_page(5, 128, 256)
