"""Angle-Domain Attention: the decode specification, attention straight from stored codes
(docs/design.md §6; docs/ada.md).

The reference decode for one kv-head and the query heads of its GQA group, over kept
states of one tier (``attention``) or several (``mixed_tier_attention``):
    ℓ̂[m, i] = logits from key codes (codec.logits), p = softmax(softmax_scale·ℓ̂),
    o[m]    = Π_Vᵀ( Σ_i p[m, i]·s^V_i·ĉ^V_i ) + μ_V.
Values are accumulated in rotated coordinates and rotated back once per query head.
Attention over disjoint sets of states merges exactly by the log-sum-exps
(``merge_attention``). Every faster path (the numba paged decode, the CUDA kernel, the
adapters) is tested against these functions and does not restate them.
"""
from __future__ import annotations

import numpy as np

from .codec import Encoded, SphericalCodec, as_float_matrix, as_real_array


def softmax_scale_of(softmax_scale, dim: int) -> float:
    """softmax_scale as a positive finite float (None: 1/√dim); ValueError otherwise."""
    if softmax_scale is None:
        return 1.0 / np.sqrt(dim)
    s = softmax_scale
    if isinstance(s, (bool, np.bool_)) or not isinstance(s, (int, float, np.integer, np.floating)) \
            or not np.isfinite(s) or s <= 0:
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale!r}")
    return float(s)


def softmax(z: np.ndarray, axis: int = -1) -> np.ndarray:
    """softmax along ``axis``, float64; −inf entries (masked logits) get probability 0."""
    z = as_real_array(z, "z").astype(np.float64)
    if np.any(np.isnan(z)):
        raise ValueError("z contains NaN")
    z = z - np.max(z, axis=axis, keepdims=True)
    e = np.exp(z)
    return e / np.sum(e, axis=axis, keepdims=True)


def rotated_value_sum(weights: np.ndarray, values: Encoded, value_codec: SphericalCodec) -> np.ndarray:
    """Σ_i w[m, i]·s_i·ĉ_i in rotated coordinates, (m, d) float64.

    Accumulated level by level: Σ_L C[L]/√d · Σ_{i: c_ij = L} w[m, i]·s_i, so no decoded
    value matrix is formed (the same sums the kernel forms, in another order)."""
    ws = weights * values.scale.astype(np.float64)[None, :]
    if value_codec.bits == 16:
        return ws @ value_codec.rotated_points(values)
    codes = value_codec.codes(values)
    out = np.zeros((weights.shape[0], value_codec.dim))
    for level, c in enumerate(value_codec.levels / np.sqrt(value_codec.dim)):
        out += c * (ws @ (codes == level))
    return out


def attention(q, keys: Encoded, values: Encoded, key_codec: SphericalCodec,
              value_codec: SphericalCodec, softmax_scale: float | None = None,
              return_lse: bool = False):
    """Decode attention of query heads q (m, d) over n encoded states, (m, d) float64.

    softmax_scale defaults to 1/√d. With return_lse, also the log-sum-exp of the scaled
    logits per query (m,), the quantity split-K merges combine."""
    key_codec._check_encoded(keys, "keys")
    value_codec._check_encoded(values, "values")
    if len(keys) != len(values):
        raise ValueError(f"{len(keys)} keys but {len(values)} values")
    if key_codec.dim != value_codec.dim:
        raise ValueError("key and value codecs must share the head dimension")
    q = as_float_matrix(q, "q", key_codec.dim)
    if len(keys) == 0:
        raise ValueError("attention over zero kept states is undefined")
    return mixed_tier_attention(q, [(keys, values, key_codec, value_codec)], keys.mean,
                                values.mean, softmax_scale, return_lse=return_lse)


def mixed_tier_attention(q, parts, key_mean=None, value_mean=None, softmax_scale=None,
                         value_rotation=None, return_lse=False):
    """Flat reference decode over kept states of several tiers, (m, d) float64.

    parts: list of (keys Encoded, values Encoded, key_codec, value_codec), one per tier; all
    codecs of one row share the key rotation and the value rotation. Logits per tier from
    codes (codec.logits, with q·μ_K when key_mean is given), one softmax over all states,
    Σ p_i·s_i·ĉ_i in rotated coordinates per tier, Π_Vᵀ once, + μ_V. With one part this
    is ``attention``. softmax_scale defaults to 1/√d. With return_lse, also the log-sum-exp
    of the scaled logits per query (m,)."""
    q = np.asarray(q, np.float64)
    d = q.shape[1]
    scale = softmax_scale_of(softmax_scale, d)
    z = []
    for k_enc, _, kc, _ in parts:
        k_enc = Encoded(k_enc.scale, k_enc.codes, k_enc.bits, k_enc.dim,
                        None if key_mean is None else np.asarray(key_mean, np.float32))
        z.append(scale * kc.logits(q, k_enc))
    z = np.concatenate(z, axis=1)
    if z.shape[1] == 0:
        raise ValueError("attention over zero kept states is undefined")
    zmax = z.max(axis=1, keepdims=True)
    e = np.exp(z - zmax)
    denom = e.sum(axis=1, keepdims=True)
    p = e / denom
    acc = np.zeros((q.shape[0], d))
    a = 0
    for k_enc, v_enc, _, vc in parts:
        acc += rotated_value_sum(p[:, a:a + len(k_enc)], v_enc, vc)
        a += len(k_enc)
    rot = parts[0][3].rotation if value_rotation is None else value_rotation
    out = rot.inverse(acc)
    if value_mean is not None:
        out = out + np.asarray(value_mean, np.float32).astype(np.float64)[None, :]
    if return_lse:
        return out, (zmax + np.log(denom))[:, 0]
    return out


def merge_attention(out_a, lse_a, out_b, lse_b, xp=np):
    """Attention over the union of two disjoint sets of states, from the attention over each:
    lse = log(e^{lse_a} + e^{lse_b}), out = e^{lse_a − lse}·out_a + e^{lse_b − lse}·out_b,
    exact (docs/design.md §6). out_* (..., d), lse_* (...) natural-log log-sum-exps of the
    scaled logits; a part with lse −inf holds no state and adds nothing. Returns (out, lse).
    xp: numpy or cupy. The split-K merge, a stored context with a new chunk, an engine
    step's context blocks with its own block."""
    lse = xp.logaddexp(lse_a, lse_b)
    return xp.exp(lse_a - lse)[..., None] * out_a + xp.exp(lse_b - lse)[..., None] * out_b, lse


def dense_attention(q, k, v, softmax_scale: float | None = None) -> np.ndarray:
    """Exact float64 attention of q (m, d) over k, v (n, d): the ground truth for tests."""
    q = as_real_array(q, "q")
    if q.ndim != 2:
        raise ValueError(f"q must have shape (m, d), got {q.shape}")
    q = as_float_matrix(q, "q", q.shape[1])
    k = as_float_matrix(k, "k", q.shape[1])
    v = as_real_array(v, "v")
    if v.ndim != 2 or v.shape[0] != k.shape[0]:
        raise ValueError(f"v must have shape (n, d_v) with n = {k.shape[0]} (one per key), got {v.shape}")
    v = as_float_matrix(v, "v", v.shape[1])
    scale = softmax_scale_of(softmax_scale, q.shape[1])
    return softmax(scale * q @ k.T) @ v
