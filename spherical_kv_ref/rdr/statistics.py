"""Per-state statistics for RDR's distortion surrogate, and protection masks (docs/rdr.md §1):
the one home of these statistics; ``SphericalKVCache.compress`` reads its rows through :func:`row_statistics`.

Shapes: keys/values of one layer are (num_kv_heads, n, d), queries (num_q_heads, w, d) with
num_q_heads = G · num_kv_heads (GQA: query head h reads kv-head h // G). Every statistic is
per (kv-head, token): (num_kv_heads, n). Masks are bool arrays over the token axis that the
caller combines with ``|`` and broadcasts over (layer, kv-head) as it needs.
"""
from __future__ import annotations

import numpy as np

__all__ = ["row_statistics", "eviction_coherence", "rope_inv_freq", "rope_shift", "future_queries", "window_attention", "AttentionAccumulator", "output_statistics",
           "sink_mask", "recent_mask", "span_mask", "outlier_mask"]


def _gqa(num_q_heads, num_kv_heads):
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads = {num_q_heads} is not a multiple of "
                         f"num_kv_heads = {num_kv_heads}")
    return num_q_heads // num_kv_heads


def _finite(name, x):
    x = np.asarray(x, dtype=np.float64)
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{name} has NaN or infinite entries")
    return x


def row_statistics(keys, values, queries, softmax_scale, prior, candidates=None):
    """Surrogate inputs of one (layer, kv-head) row from its observed queries (docs/rdr.md §1):
    (p, Q², r, ‖v‖, res, κ) for ``rdr.distortion``.

    keys, values: (n, d) the row's states as the cache holds them (rotated, centred);
    queries: (m, d) the recorded queries of the GQA group (a query head at one step), in
    the keys' rotated coordinates, or None / empty when none was recorded.
    Each query q attends with P_q = (1 − prior)·softmax(s·q·k) + prior/n and outputs
    o_q = Σ P_qi·v_i. The surrogate is the mean over queries of each query's expected
    squared output error, so p_i² = mean_q P_qi² and p_i²·res_i² = mean_q P_qi²·‖v_i − o_q‖²
    (the errors of different heads and steps do not cancel). Q² is the queries' mean ‖q‖².
    κ_i (eviction factor): the exact single-eviction shift carries 1/(1 − P_qi); with
    ``candidates`` (n,) bool, κ is also multiplied by the row's measured coherence
    (:func:`eviction_coherence` over the candidates below their median p). Without
    queries: p = 1/n, Q² = mean r², κ = 1. Returns six float64 arrays of (n,) (Q² a float).
    """
    yk = _finite("keys", keys)
    yv = _finite("values", values)
    n = yk.shape[0]
    r = np.linalg.norm(yk, axis=1)
    vn = np.linalg.norm(yv, axis=1)
    if queries is None or len(queries) == 0:
        p = np.full(n, 1.0 / n)
        res = np.linalg.norm(yv - (p @ yv)[None, :], axis=1)
        return p, float(np.mean(r * r)), r, vn, res, np.ones(n)
    qr = _finite("queries", queries)
    z = softmax_scale * (qr @ yk.T)
    z -= z.max(axis=1, keepdims=True)
    P = np.exp(z)
    P /= P.sum(axis=1, keepdims=True)
    P = (1.0 - prior) * P + prior / n                                    # (queries, n)
    o = P @ yv                                                           # (queries, d)
    # ‖v_i − o_q‖² for every query and state, by one product
    dist2 = np.maximum(vn[None, :] ** 2 - 2.0 * (o @ yv.T) + np.sum(o * o, axis=1)[:, None], 0.0)
    w = P * P
    p2 = w.mean(axis=0)
    e = (w * dist2).mean(axis=0)
    e_evict = (w * dist2 / np.maximum(1.0 - P, 1e-12) ** 2).mean(axis=0)
    tiny = np.finfo(float).tiny
    kappa = np.where(e > tiny, e_evict / np.maximum(e, tiny), 1.0)
    if candidates is not None:
        kappa *= eviction_coherence(P, o, yv, dist2, p2, candidates)
    p = np.sqrt(p2)
    res = np.sqrt(e / np.maximum(p2, tiny))
    return p, float(np.mean(np.sum(qr * qr, axis=1))), r, vn, res, np.maximum(kappa, 1.0)


def rope_inv_freq(head_dim, theta=10000.0):
    """The rotary frequencies θ_i = theta^(−2i/d), i < d/2, of the default (unscaled) RoPE."""
    d = int(head_dim)
    if d < 2 or d % 2:
        raise ValueError(f"head_dim must be even and >= 2 for RoPE, got {head_dim!r}")
    return 1.0 / float(theta) ** (np.arange(0, d, 2, dtype=np.float64) / d)


def rope_shift(q, shift, inv_freq):
    """Post-RoPE queries moved ``shift`` positions on: R(p + Δ)·q̃ = R(Δ)·(R(p)·q̃), RoPE's
    rotations composing. The rotate-half layout of transformers: coordinate i pairs with
    i + d/2 at frequency inv_freq[i]. q: (..., d); shift: broadcastable to q's leading
    shape (tokens, may be fractional); inv_freq: (d/2,). Returns float64 like q."""
    q = np.asarray(q, dtype=np.float64)
    f = np.asarray(inv_freq, dtype=np.float64)
    half = f.shape[0]
    if q.shape[-1] != 2 * half:
        raise ValueError(f"queries of dimension {q.shape[-1]} need {q.shape[-1] // 2} RoPE "
                         f"frequencies, got {half}")
    ang = np.asarray(shift, dtype=np.float64)[..., None] * f          # (..., d/2)
    c, s = np.cos(ang), np.sin(ang)
    a, b = q[..., :half], q[..., half:]
    return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)


def future_queries(queries, inv_freq, horizon, points=4):
    """The recorded queries carried to the positions of the next ``horizon`` decode steps.

    queries: (m, d) post-RoPE queries of the last m positions L−m .. L−1 (oldest first);
    each is moved (:func:`rope_shift`) to the ``points`` future positions L − 1 + h_k,
    h_k = (k + ½)·horizon/points. Returns (m·points, d): an empirical model of the queries
    to come whose mean and second moment are those of the recent queries' content (μ, Σ of
    the pre-RoPE queries) rotated to the future positions and averaged over them,
    (1/K)·Σ_k R(f_k)(μμᵀ + Σ)R(f_k)ᵀ; every sample-based statistic of
    :func:`row_statistics` (P², the residuals, κ) is then an expectation over that model, not
    over the positions the queries were recorded at. (ExpectedAttention scores keys with the
    same carried moments, in a Gaussian closed form.)
    """
    q = np.asarray(queries, dtype=np.float64)
    if q.ndim != 2:
        raise ValueError(f"queries must be (m, d), got shape {q.shape}")
    if int(horizon) < 1 or int(points) < 1:
        raise ValueError(f"horizon and points must be positive, got {horizon!r}, {points!r}")
    m = q.shape[0]
    ahead = (np.arange(int(points)) + 0.5) * (int(horizon) / int(points))        # (K,)
    shift = (m - 1 - np.arange(m))[:, None] + ahead[None, :]                    # (m, K)
    return rope_shift(np.repeat(q[:, None, :], ahead.size, axis=1), shift, inv_freq).reshape(-1, q.shape[1])


def eviction_coherence(P, o, values, dist2, p2, candidates) -> float:
    """How much larger the output shift of evicting a row's low-attention states is than
    the sum of their squares (≥ 1; 1 when there is nothing to measure): with S = the
    candidates below their median p2, mean_q ‖Σ_S P_qi (o_q − v_i)‖² over
    mean_q Σ_S P_qi² ‖o_q − v_i‖². P (m, n), o (m, d), values (n, d), dist2 (m, n)."""
    idx = np.flatnonzero(candidates)
    if idx.size < 2:
        return 1.0
    S = idx[p2[idx] <= np.median(p2[idx])]
    Ps = P[:, S]
    shift = Ps.sum(axis=1)[:, None] * o - Ps @ values[S]                # (queries, d)
    coherent = float(np.mean(np.sum(shift * shift, axis=1)))
    independent = float(np.mean(np.sum(Ps * Ps * dist2[:, S], axis=1)))
    if not independent > 0.0:
        return 1.0
    return max(1.0, coherent / independent)


def window_attention(queries, keys, softmax_scale=None, causal=True):
    """Attention probabilities of the last w prefill queries (the observation window).

    queries: (num_q_heads, w, d), the queries of positions n−w .. n−1; keys: (num_kv_heads,
    n, d). With ``causal``, query j of the window sees keys 0 .. n−w+j. Returns
    (p, q_sq): p (num_kv_heads, n) = softmax probabilities averaged over the w queries and
    the G query heads of each group; q_sq (num_kv_heads,) = mean ‖q‖² over the same queries
    (the Q² estimate of the surrogate). float64.
    """
    q = _finite("queries", queries)
    k = _finite("keys", keys)
    if q.ndim != 3 or k.ndim != 3 or q.shape[2] != k.shape[2]:
        raise ValueError(f"queries (Hq, w, d) and keys (Hkv, n, d) expected, got {q.shape}, {k.shape}")
    hq, w, d = q.shape
    hk, n, _ = k.shape
    g = _gqa(hq, hk)
    if w > n:
        raise ValueError(f"window of {w} queries is longer than the {n} keys")
    s = 1.0 / np.sqrt(d) if softmax_scale is None else float(softmax_scale)
    logits = s * np.einsum("hgwd,hnd->hgwn", q.reshape(hk, g, w, d), k)
    if causal:
        visible = np.arange(n)[None, :] <= (n - w + np.arange(w))[:, None]
        logits = np.where(visible, logits, -np.inf)
    logits -= logits.max(axis=-1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=-1, keepdims=True)
    q_sq = np.einsum("hgwd,hgwd->h", q.reshape(hk, g, w, d), q.reshape(hk, g, w, d)) / (g * w)
    return p.mean(axis=(1, 2)), q_sq


class AttentionAccumulator:
    """Mean attention probability of every token over the decode steps it has seen.

    ``update(p)`` takes one step's probabilities (num_q_heads, n) over the n tokens cached
    at that step (n never shrinks); ``mean()`` returns (num_kv_heads, n_max): for each token,
    the average over the steps since it entered the cache and over the query heads of its
    group (0 for a token no step has seen yet).
    """

    def __init__(self, num_q_heads, num_kv_heads):
        self.group = _gqa(num_q_heads, num_kv_heads)
        self.num_q_heads, self.num_kv_heads = num_q_heads, num_kv_heads
        self.total = np.zeros((num_kv_heads, 0))
        self.steps = np.zeros(0, dtype=np.int64)

    def update(self, probs):
        p = _finite("probs", probs)
        if p.ndim != 2 or p.shape[0] != self.num_q_heads:
            raise ValueError(f"probs must be ({self.num_q_heads}, n), got {p.shape}")
        n = p.shape[1]
        if n < self.steps.size:
            raise ValueError(f"probs covers {n} tokens, fewer than the {self.steps.size} seen")
        grow = n - self.steps.size
        self.total = np.concatenate([self.total, np.zeros((self.num_kv_heads, grow))], axis=1)
        self.steps = np.concatenate([self.steps, np.zeros(grow, dtype=np.int64)])
        self.total += p.reshape(self.num_kv_heads, self.group, n).mean(axis=1)
        self.steps += 1

    def mean(self):
        return self.total / np.maximum(self.steps, 1)


def output_statistics(probs, values):
    """Value norm and distance to the output estimate, per (kv-head, token).

    probs: (num_kv_heads, n) estimated attention (rows need not sum to one: they are
    normalised); values: (num_kv_heads, n, d). o = Σ_i p_i v_i / Σ_i p_i per kv-head.
    Returns (value_norm, value_residual = ‖v_i − o‖), each (num_kv_heads, n)."""
    p = _finite("probs", probs)
    v = _finite("values", values)
    if v.ndim != 3 or p.shape != v.shape[:2]:
        raise ValueError(f"probs (H, n) and values (H, n, d) expected, got {p.shape}, {v.shape}")
    mass = p.sum(axis=1, keepdims=True)
    o = np.einsum("hn,hnd->hd", p / np.where(mass > 0, mass, 1.0), v)
    return np.linalg.norm(v, axis=2), np.linalg.norm(v - o[:, None, :], axis=2)


def _length(n):
    n = int(n)
    if n < 0:
        raise ValueError(f"number of tokens must be >= 0, got {n}")
    return n


def sink_mask(n, num_sinks=4):
    """The first num_sinks tokens (attention sinks). (n,) bool."""
    m = np.zeros(_length(n), dtype=bool)
    m[:max(int(num_sinks), 0)] = True
    return m


def recent_mask(n, window=64):
    """The last ``window`` tokens (the recent window decode attends to most). (n,) bool."""
    n = _length(n)
    m = np.zeros(n, dtype=bool)
    if window > 0:
        m[max(n - int(window), 0):] = True
    return m


def span_mask(n, spans):
    """Explicit token spans [start, stop) (retrieved evidence, tool output). (n,) bool."""
    n = _length(n)
    m = np.zeros(n, dtype=bool)
    for start, stop in spans:
        if not 0 <= start <= stop <= n:
            raise ValueError(f"span [{start}, {stop}) is not inside [0, {n})")
        m[start:stop] = True
    return m


def outlier_mask(key_radius, value_norm, z=6.0):
    """States whose key radius or value norm lies far in the upper tail of its (layer,
    kv-head): robust z-score (x − median) / (1.4826 · MAD) > z along the last (token) axis.
    Where the MAD is 0, the mean absolute deviation stands in; if that is 0 too, nothing
    is an outlier. key_radius, value_norm: (..., n). Returns (..., n) bool."""
    out = None
    for name, x in (("key_radius", key_radius), ("value_norm", value_norm)):
        x = _finite(name, x)
        med = np.median(x, axis=-1, keepdims=True)
        dev = np.abs(x - med)
        spread = 1.4826 * np.median(dev, axis=-1, keepdims=True)
        spread = np.where(spread > 0, spread, 1.2533 * dev.mean(axis=-1, keepdims=True))
        flag = np.where(spread > 0, (x - med) > z * spread, False)
        out = flag if out is None else (out | flag)
    return out
