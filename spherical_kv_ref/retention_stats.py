"""Per-state statistics for RDR's distortion surrogate, and protection masks (DESIGN §5).

Shapes: keys/values of one layer are (num_kv_heads, n, d), queries (num_q_heads, w, d) with
num_q_heads = G · num_kv_heads (GQA: query head h reads kv-head h // G). Every statistic is
per (kv-head, token): (num_kv_heads, n). Masks are bool arrays over the token axis that the
caller combines with ``|`` and broadcasts over (layer, kv-head) as it needs.
"""
from __future__ import annotations

import numpy as np

__all__ = ["window_attention", "AttentionAccumulator", "output_statistics",
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
