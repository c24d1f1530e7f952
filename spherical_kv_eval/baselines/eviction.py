"""Evicting baselines: StreamingLLM, H2O, SnapKV.

Each keeps some states in bf16 and drops the rest, at a target byte budget (a fraction
of the dense bf16 cache). The budget is split evenly over layers and kv-heads (as the
original methods do), so every (layer, kv-head) keeps the same number of tokens.

Bytes per layer (H kv-heads, head_dim d, n kept tokens per head):
* H2O, SnapKV: the kept set differs per head, so each kept state also stores its
  int32 position: ``H·n·(2·d·2 + 4)``.
* StreamingLLM: the kept set is the same contiguous pattern for every head (sinks +
  recent window), described by two int32 numbers per layer: ``H·n·2·d·2 + 8``.
When the budget covers every token, nothing is evicted and no metadata is stored.
"""
from __future__ import annotations

import numpy as np

from .base import (BF16_BYTES, INDEX_BYTES, CompressedLayer, KVMethod, bf16_round,
                   check_budget)

__all__ = ["StreamingLLM", "H2O", "SnapKV", "kept_layer", "max_pool_1d"]


def budget_label(budget: float) -> str:
    """A budget as the methods' names show it: 0.25 -> '25%'."""
    return f"{100 * budget:g}%"


class Evictor(KVMethod):
    """Shared budget arithmetic and output assembly."""

    per_state_meta = INDEX_BYTES  # bytes of metadata per kept state
    per_layer_meta = 0            # bytes of metadata per layer

    def layer_budget_bytes(self, H: int, T: int, d: int) -> int:
        """The byte budget of one layer: floor(budget · dense bf16 bytes of the layer)."""
        return int(np.floor(self.budget * H * T * 2 * d * BF16_BYTES))

    def tokens_per_head(self, H: int, T: int, d: int) -> int:
        """Most tokens each kv-head can keep within the layer's budget (<= T)."""
        state = 2 * d * BF16_BYTES + self.per_state_meta
        n = (self.layer_budget_bytes(H, T, d) - self.per_layer_meta) // (H * state)
        return int(min(T, max(0, n)))

    def layer_bytes(self, H: int, T: int, d: int, n: int) -> int:
        if n >= T:
            return H * T * 2 * d * BF16_BYTES
        return H * n * (2 * d * BF16_BYTES + self.per_state_meta) + self.per_layer_meta

    def _compress_layer(self, layer, keys, values, stats):
        H, T, d = keys.shape
        n = self.tokens_per_head(H, T, d)
        keep = np.ones((H, T), dtype=bool) if n >= T else self._select(layer, H, T, n, stats)
        if not np.array_equal(keep.sum(axis=1), np.full(H, n)):
            raise RuntimeError(f"{self.name}: selection kept {keep.sum(axis=1)} != {n}")
        return kept_layer(keys, values, keep, self.layer_bytes(H, T, d, n))

    def _select(self, layer, H, T, n, stats) -> np.ndarray:
        raise NotImplementedError


def kept_layer(keys: np.ndarray, values: np.ndarray, keep: np.ndarray,
               nbytes: int) -> CompressedLayer:
    """The layer an evictor leaves: the kept states rounded to bf16, the rest zeroed."""
    k_hat = np.where(keep[..., None], bf16_round(keys), 0.0).astype(np.float32)
    v_hat = np.where(keep[..., None], bf16_round(values), 0.0).astype(np.float32)
    return CompressedLayer(k_hat, v_hat, keep, nbytes)


def _recent_and_top(scores: np.ndarray, n: int, n_recent: int) -> np.ndarray:
    """Keep mask per head: the last ``n_recent`` tokens plus the ``n - n_recent`` best
    scoring older ones (ties go to the earlier position)."""
    H, T = scores.shape
    keep = np.zeros((H, T), dtype=bool)
    n_recent = min(n_recent, n)
    if n_recent:
        keep[:, T - n_recent:] = True
    n_top = n - n_recent
    if n_top:
        older = scores[:, :T - n_recent]
        order = np.argsort(-older, axis=1, kind="stable")[:, :n_top]
        np.put_along_axis(keep, order, True, axis=1)
    return keep


class StreamingLLM(Evictor):
    """StreamingLLM (Xiao et al., 2024): the first ``sinks`` tokens (attention sinks)
    plus the most recent tokens that fit the budget."""

    per_state_meta = 0
    per_layer_meta = 2 * INDEX_BYTES  # number of sinks and window start

    def __init__(self, budget: float, *, sinks: int = 4):
        self.budget = check_budget(budget)
        if sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {sinks}")
        self.sinks = sinks
        self.name = f"streamingllm@{budget_label(self.budget)}"

    def _select(self, layer, H, T, n, stats):
        keep = np.zeros((H, T), dtype=bool)
        s = min(self.sinks, n)
        keep[:, :s] = True
        if n - s:
            keep[:, T - (n - s):] = True
        return keep


class H2O(Evictor):
    """H2O (Zhang et al., 2023): heavy hitters by accumulated attention plus a recent
    window; ``recent_ratio`` of the kept tokens is the recent window (half, as in the
    paper). Selection is one-shot after prefill, on the prefill's accumulated
    attention (column sums of the causal attention matrix, averaged over the GQA
    group); the recent tokens are not ranked."""

    needs_stats = True

    def __init__(self, budget: float, *, recent_ratio: float = 0.5):
        self.budget = check_budget(budget)
        if not 0.0 <= recent_ratio <= 1.0:
            raise ValueError(f"recent_ratio must be in [0, 1], got {recent_ratio}")
        self.recent_ratio = recent_ratio
        self.name = f"h2o@{budget_label(self.budget)}"

    def _select(self, layer, H, T, n, stats):
        n_recent = int(round(n * self.recent_ratio))
        return _recent_and_top(stats.accumulated[layer], n, n_recent)


def max_pool_1d(x: np.ndarray, kernel: int) -> np.ndarray:
    """Max over a centred window of ``kernel`` positions along the last axis (the
    window is clipped at the ends; stride 1, same length)."""
    if kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"pooling kernel must be a positive odd number, got {kernel}")
    r = kernel // 2
    T = x.shape[-1]
    padded = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(r, r)], constant_values=-np.inf)
    out = np.full_like(x, -np.inf, dtype=np.float64)
    for shift in range(kernel):
        out = np.maximum(out, padded[..., shift:shift + T])
    return out


class SnapKV(Evictor):
    """SnapKV (Li et al., 2024): the observation window (the last ``stats.window``
    tokens, whose queries vote) is kept; older tokens are ranked by the window's
    attention to them, max-pooled over ``kernel`` neighbouring positions so that
    whole clusters are kept, per kv-head (votes averaged over the GQA group)."""

    needs_stats = True

    def __init__(self, budget: float, *, kernel: int = 7):
        self.budget = check_budget(budget)
        max_pool_1d(np.zeros((1, 1)), kernel)  # validates the kernel
        self.kernel = kernel
        self.name = f"snapkv@{budget_label(self.budget)}"

    def _select(self, layer, H, T, n, stats):
        w = min(stats.window, T)
        pooled = np.full((H, T), -np.inf)
        pooled[:, :T - w] = max_pool_1d(stats.observation[layer][:, :T - w], self.kernel)
        return _recent_and_top(pooled, n, w)
