"""The one interface every KV-compression baseline implements (docs/baselines.md).

A method sees the prefill cache of one sequence, every layer at once:
``keys[l]``, ``values[l]`` of shape ``(kv_heads, T, head_dim)``, post-RoPE, float32.
It returns a :class:`CompressedKV`: per layer the keys and values the model attends
with (de-quantized; evicted positions zeroed), a ``(kv_heads, T)`` keep mask, and the
bytes the method's storage needs, counted honestly (codes, scales, zero points,
kept-position metadata).

The byte reference (100 %) is the dense bf16 cache: ``2 bytes`` per element of K and V.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = [
    "BF16_BYTES", "INDEX_BYTES", "CompressedKV", "CompressedLayer", "KVMethod",
    "bf16_round", "check_kv", "dense_bytes",
]

BF16_BYTES = 2   # bytes per element of the dense reference cache
INDEX_BYTES = 4  # int32 position stored per kept (layer, kv-head, token) by evictors


def dense_bytes(num_layers: int, kv_heads: int, tokens: int, head_dim: int) -> int:
    """Bytes of the dense bf16 cache: K and V, 2 bytes per element."""
    return 2 * num_layers * kv_heads * tokens * head_dim * BF16_BYTES


def bf16_round(x: np.ndarray) -> np.ndarray:
    """x rounded to bfloat16 (round to nearest, ties to even), returned as float32."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    lsb = (bits >> 16) & 1
    rounded = ((bits + 0x7FFF + lsb) >> 16) << 16
    out = rounded.astype(np.uint32).view(np.float32)
    return np.where(np.isfinite(x), out, x).astype(np.float32)


@dataclass
class CompressedLayer:
    """One layer after compression.

    ``keys``, ``values``: (kv_heads, T, head_dim) float32, what attention uses (zero
    where evicted); ``keep``: (kv_heads, T) bool, True where the state is attendable;
    ``nbytes``: storage of this layer in bytes.
    """

    keys: np.ndarray
    values: np.ndarray
    keep: np.ndarray
    nbytes: int


@dataclass
class CompressedKV:
    """A whole compressed cache: one :class:`CompressedLayer` per layer."""

    method: str
    layers: list[CompressedLayer]

    @property
    def nbytes(self) -> int:
        return int(sum(layer.nbytes for layer in self.layers))

    @property
    def dense_nbytes(self) -> int:
        h, t, d = self.layers[0].keys.shape
        return dense_bytes(len(self.layers), h, t, d)

    @property
    def fraction(self) -> float:
        """Bytes as a fraction of the dense bf16 cache of the same tokens."""
        return self.nbytes / self.dense_nbytes

    @property
    def kept_fraction(self) -> float:
        return float(np.mean([layer.keep.mean() for layer in self.layers]))


def check_kv(keys: Sequence[np.ndarray], values: Sequence[np.ndarray]):
    """Validate per-layer (kv_heads, T, head_dim) float arrays; return float32 lists."""
    if len(keys) == 0 or len(keys) != len(values):
        raise ValueError(f"need the same positive number of key and value layers, got "
                         f"{len(keys)} and {len(values)}")
    ks, vs = [], []
    shape = np.shape(keys[0])
    for l, (k, v) in enumerate(zip(keys, values)):
        k, v = np.asarray(k), np.asarray(v)
        if k.ndim != 3 or k.shape != shape or v.shape != shape:
            raise ValueError(f"layer {l}: keys {k.shape} and values {v.shape} must both be "
                             f"(kv_heads, T, head_dim) = {shape} like layer 0")
        if min(shape) < 1:
            raise ValueError(f"empty cache shape {shape}")
        if not (np.issubdtype(k.dtype, np.floating) and np.issubdtype(v.dtype, np.floating)):
            raise ValueError(f"layer {l}: keys/values must be floating point")
        if not (np.isfinite(k).all() and np.isfinite(v).all()):
            raise ValueError(f"layer {l}: keys/values contain NaN or Inf")
        ks.append(k.astype(np.float32, copy=False))
        vs.append(v.astype(np.float32, copy=False))
    return ks, vs


class KVMethod(ABC):
    """A KV-cache compression method.

    ``name``: a short label including its setting (e.g. ``"kivi2"``, ``"h2o@25%"``).
    ``budget``: the target bytes as a fraction of the dense bf16 cache, or ``None`` for
    methods that have only native operating points (quantizers).
    ``needs_stats``: whether :meth:`compress` needs an :class:`AttentionStats`.
    """

    name: str = "method"
    budget: float | None = None
    needs_stats: bool = False

    def compress(self, keys, values, stats=None) -> CompressedKV:
        """Compress a prefill cache (see module docstring for shapes)."""
        ks, vs = check_kv(keys, values)
        if self.needs_stats:
            if stats is None:
                raise ValueError(f"{self.name} needs attention statistics (stats=...)")
            stats.check(ks)
        layers = [self._compress_layer(l, k, v, stats) for l, (k, v) in enumerate(zip(ks, vs))]
        return CompressedKV(self.name, layers)

    @abstractmethod
    def _compress_layer(self, layer: int, keys: np.ndarray, values: np.ndarray,
                        stats) -> CompressedLayer:
        """One layer: keys/values (kv_heads, T, head_dim) float32."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


def check_budget(budget: float) -> float:
    """budget as a float fraction of the dense bf16 bytes in (0, 1]; ValueError otherwise."""
    budget = float(budget)
    if not 0.0 < budget <= 1.0:
        raise ValueError(f"budget must be a fraction of the dense bf16 bytes in (0, 1], "
                         f"got {budget}")
    return budget
