"""Attention statistics the eviction baselines rank states by (H2O, SnapKV).

From the prefill's post-RoPE queries ``(q_heads, T, d)`` and keys ``(kv_heads, T, d)``
of each layer, with causal softmax attention ``p[h, i, j]`` (scale ``1/sqrt(d)``):

* ``accumulated[l][g, j] = mean over the GQA group of g of  sum_i p[h, i, j]``
  (H2O's accumulated attention; every query row i that can see j contributes;
  optionally estimated from every s-th row, see ``query_stride``);
* ``observation[l][g, j] = mean over the group of  sum_{i >= T - window} p[h, i, j]``
  (SnapKV's votes from the observation window of the last ``window`` queries).

Query head h belongs to kv-head ``h // group`` (the transformers GQA convention).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["AttentionStats", "attention_stats"]


@dataclass
class AttentionStats:
    """Per layer, (kv_heads, T) float64 arrays; ``window`` the observation length."""

    accumulated: list[np.ndarray]
    observation: list[np.ndarray]
    window: int

    def check(self, keys) -> None:
        if len(self.accumulated) != len(keys) or len(self.observation) != len(keys):
            raise ValueError(f"stats cover {len(self.accumulated)} layers, the cache has "
                             f"{len(keys)}")
        want = keys[0].shape[:2]
        for l, (a, o) in enumerate(zip(self.accumulated, self.observation)):
            if a.shape != want or o.shape != want:
                raise ValueError(f"layer {l}: stats shapes {a.shape}, {o.shape} do not match "
                                 f"the cache's (kv_heads, T) = {want}")


def _layer_stats(q: np.ndarray, k: np.ndarray, window: int, block: int, stride: int,
                 scale=None):
    hq, T, d = q.shape
    hk = k.shape[0]
    if hq % hk:
        raise ValueError(f"{hq} query heads do not split into groups over {hk} kv-heads")
    group = hq // hk
    scale = np.float32(1.0 / np.sqrt(d) if scale is None else scale)
    acc = np.zeros((hk, T))
    obs = np.zeros((hk, T))
    w0 = T - window
    rows = np.union1d(np.arange(0, T, stride), np.arange(w0, T))
    for g in range(hk):
        qg = q[g * group:(g + 1) * group].astype(np.float32)  # (group, T, d)
        kg = k[g].astype(np.float32)                           # (T, d)
        for b0 in range(0, len(rows), block):
            r = rows[b0:b0 + block]
            stop = int(r[-1]) + 1  # row i sees columns 0..i: only columns < stop matter
            logits = (qg[:, r] @ kg[:stop].T) * scale
            logits = np.where(np.arange(stop)[None, :] <= r[:, None], logits, -np.inf)
            logits -= logits.max(axis=-1, keepdims=True)
            p = np.exp(logits)
            p /= p.sum(axis=-1, keepdims=True)                 # (group, rows, stop)
            sampled = (r % stride) == 0
            if sampled.any():
                acc[g, :stop] += stride * p[:, sampled].sum(axis=(0, 1), dtype=np.float64) / group
            in_window = r >= w0
            if in_window.any():
                obs[g, :stop] += p[:, in_window].sum(axis=(0, 1), dtype=np.float64) / group
    return acc, obs


def _layer_stats_torch(q: np.ndarray, k: np.ndarray, window: int, block: int, stride: int,
                       scale, device):
    """``_layer_stats`` in torch on ``device``: the same rows, blocks, float32 products and
    softmax, the sums in float64; equal to it within float32 rounding (the order of a
    product's additions differs). Returns (kv_heads, T) float64 NumPy arrays."""
    import torch
    hq, T, d = q.shape
    hk = k.shape[0]
    if hq % hk:
        raise ValueError(f"{hq} query heads do not split into groups over {hk} kv-heads")
    group = hq // hk
    scale = float(np.float32(1.0 / np.sqrt(d) if scale is None else scale))
    acc = torch.zeros((hk, T), dtype=torch.float64, device=device)
    obs = torch.zeros((hk, T), dtype=torch.float64, device=device)
    w0 = T - window
    rows = np.union1d(np.arange(0, T, stride), np.arange(w0, T))
    cols = torch.arange(T, device=device)
    for g in range(hk):
        qg = torch.as_tensor(q[g * group:(g + 1) * group], dtype=torch.float32).to(device)
        kg = torch.as_tensor(k[g], dtype=torch.float32).to(device)
        for b0 in range(0, len(rows), block):
            r = rows[b0:b0 + block]
            stop = int(r[-1]) + 1
            rt = torch.as_tensor(r).to(device)
            logits = (qg[:, rt] @ kg[:stop].T) * scale
            p = torch.softmax(logits.masked_fill(cols[None, :stop] > rt[:, None], -torch.inf), -1)
            sampled = (r % stride) == 0
            if sampled.any():
                pick = torch.as_tensor(np.flatnonzero(sampled)).to(device)
                acc[g, :stop] += stride * p[:, pick].sum(dim=(0, 1), dtype=torch.float64) / group
            in_window = np.flatnonzero(r >= w0)
            if in_window.size:
                pick = torch.as_tensor(in_window).to(device)
                obs[g, :stop] += p[:, pick].sum(dim=(0, 1), dtype=torch.float64) / group
    return acc.cpu().numpy(), obs.cpu().numpy()


def attention_stats(queries, keys, *, window: int = 32, block: int = 256,
                    query_stride: int = 1, scale=None, device=None) -> AttentionStats:
    """Accumulated and observation-window attention per (layer, kv-head, token).

    ``queries[l]``: (q_heads, T, d); ``keys[l]``: (kv_heads, T, d), post-RoPE.
    ``window``: SnapKV's observation window (the last ``window`` queries, at most T).
    ``block``: query rows per softmax block (memory: group·block·T floats).
    ``query_stride``: accumulate H2O's attention over every ``query_stride``-th query
    row only (rows 0, s, 2s, ...), times s, to cut the O(T²) cost on long contexts; 1
    (the default) is exact. The observation window always uses all its rows.
    ``scale``: the softmax scale (default 1/√d; a model's own where it differs).
    ``device``: None computes in NumPy (the reference); a torch device ("cuda") computes
    the same in torch there (``_layer_stats_torch``, equal within float32 rounding).
    """
    if len(queries) == 0 or len(queries) != len(keys):
        raise ValueError(f"need one query and one key array per layer, got {len(queries)} "
                         f"and {len(keys)}")
    T = np.shape(keys[0])[1]
    if not 1 <= window <= T:
        raise ValueError(f"observation window must be in [1, T={T}], got {window}")
    if block < 1 or query_stride < 1:
        raise ValueError(f"block and query_stride must be positive, got {block}, "
                         f"{query_stride}")
    acc, obs = [], []
    for l, (q, k) in enumerate(zip(queries, keys)):
        q, k = np.asarray(q), np.asarray(k)
        if q.ndim != 3 or k.ndim != 3 or q.shape[1:] != k.shape[1:] or k.shape[1] != T:
            raise ValueError(f"layer {l}: queries {q.shape} and keys {k.shape} must be "
                             f"(heads, T={T}, d) with the same T and d")
        a, o = (_layer_stats(q, k, window, block, query_stride, scale) if device is None else
                _layer_stats_torch(q, k, window, block, query_stride, scale, device))
        acc.append(a)
        obs.append(o)
    return AttentionStats(acc, obs, window)
