"""KV-cache compression baselines behind one interface (docs/baselines.md).

``KVMethod.compress(keys, values, stats)`` takes per-layer post-RoPE
``(kv_heads, T, head_dim)`` arrays and returns a :class:`CompressedKV` whose ``nbytes``
counts everything the method stores, against the dense bf16 cache (100 %).
"""
from .base import (BF16_BYTES, INDEX_BYTES, CompressedKV, CompressedLayer, KVMethod,
                   bf16_round, check_kv, dense_bytes)
from .eviction import H2O, SnapKV, StreamingLLM, max_pool_1d
from .quant import FP8E4M3, FP8_MAX, KIVI, Dense, asymmetric_quantize, fp8_e4m3_round
from .stats import AttentionStats, attention_stats

__all__ = [
    "BF16_BYTES", "INDEX_BYTES", "CompressedKV", "CompressedLayer", "KVMethod",
    "bf16_round", "check_kv", "dense_bytes", "H2O", "SnapKV", "StreamingLLM",
    "max_pool_1d", "FP8E4M3", "FP8_MAX", "KIVI", "Dense", "asymmetric_quantize",
    "fp8_e4m3_round", "AttentionStats", "attention_stats", "DEFAULT_BUDGETS",
    "standard_methods",
]

DEFAULT_BUDGETS = (0.50, 0.25, 0.15, 0.10)


def standard_methods(budgets=DEFAULT_BUDGETS, *, kivi_residual: int = 32) -> list[KVMethod]:
    """The evaluation's line-up: the native points (dense, fp8, KIVI-4, KIVI-2) and
    every evicting method at each budget (fractions of the dense bf16 bytes)."""
    methods: list[KVMethod] = [Dense(), FP8E4M3(), KIVI(4, residual=kivi_residual),
                               KIVI(2, residual=kivi_residual)]
    for b in budgets:
        methods += [StreamingLLM(b), H2O(b), SnapKV(b)]
    return methods
