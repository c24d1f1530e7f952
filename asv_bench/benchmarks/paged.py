"""SphericalKVCache on CPU at the real model's shape: append, compress (RDR), paged decode.

Shape: 8192 tokens, 30 layers, 3 kv-heads (9 query heads, GQA 3), head_dim 64, the default
tier ladder, 4 KiB pages. One "step" of decode is one query per layer over all 30 layers.
"""
import numpy as np

import spherical_kv_ref as skv
from spherical_kv_ref.cache import CompressPolicy

LAYERS, KV_HEADS, Q_HEADS, DIM = 30, 3, 9, 64
PAGE_BYTES = 4096
POOL_BYTES = 200 << 20          # 8192 tokens at the fp16 top tier need 180 MiB


def _data(tokens, seed=0):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((KV_HEADS, tokens, DIM)).astype(np.float32) + 0.5
    v = rng.standard_normal((KV_HEADS, tokens, DIM)).astype(np.float32)
    q = rng.standard_normal((Q_HEADS, DIM))
    return k, v, q


def _cache():
    return skv.SphericalKVCache(LAYERS, KV_HEADS, DIM, page_bytes=PAGE_BYTES, pool_bytes=POOL_BYTES,
                                num_q_heads=Q_HEADS, policy=CompressPolicy(sinks=4, recent=64))


def _filled(tokens, budget_fraction=None):
    """A cache with one sequence of `tokens` tokens in every layer (the same keys and values
    in each layer, which does not change the work), a query observed per layer, and
    optionally compressed to budget_fraction of its fp16 size."""
    k, v, q = _data(tokens)
    cache = _cache()
    seq = cache.new_sequence()
    for layer in range(LAYERS):
        cache.append(seq, layer, k, v)
        cache.observe(seq, layer, q)
    if budget_fraction is not None:
        cache.compress(seq, int(budget_fraction * cache.bytes_in_use(seq)))
    return cache, seq, q


class Prefill:
    """Prefill: 8K tokens appended to every layer of a fresh sequence (encode at the fp16
    top tier, write pages)."""
    params = [8192]
    param_names = ["tokens"]
    number = 1
    repeat = 3
    timeout = 600

    def setup(self, tokens):
        self.k, self.v, _ = _data(tokens)
        self.cache = _cache()
        self.seq = self.cache.new_sequence()

    def time_prefill(self, tokens):
        for layer in range(LAYERS):
            self.cache.append(self.seq, layer, self.k, self.v)


_FULL = {}


class AppendToken:
    """One decode token appended to every layer of an 8K-token sequence."""
    params = [8192]
    param_names = ["tokens"]
    number = 1
    repeat = 10
    timeout = 600

    def setup(self, tokens):
        if tokens not in _FULL:
            _FULL[tokens] = _filled(tokens)
        self.cache, self.seq, _ = _FULL[tokens]
        self.k, self.v, _ = _data(1, seed=1)

    def time_append_token(self, tokens):
        for layer in range(LAYERS):
            self.cache.append(self.seq, layer, self.k, self.v)


class Compress:
    """RDR over all 30 × 3 (layer, kv-head) groups of an 8K-token sequence, applied."""
    params = ([8192], [0.25, 0.5])
    param_names = ["tokens", "budget_fraction"]
    number = 1
    repeat = 2
    timeout = 900

    def setup(self, tokens, budget_fraction):
        self.cache, self.seq, _ = _filled(tokens)
        self.budget = int(budget_fraction * self.cache.bytes_in_use(self.seq))
        # the solver's per-tier error constants are computed once per process; keep them
        # out of the timing (a serving engine pays them once at start-up)
        from spherical_kv_ref import rdr
        rdr.tier_error_constants(self.cache.ladder.tiers, DIM)

    def time_compress(self, tokens, budget_fraction):
        self.cache.compress(self.seq, self.budget)

    def track_bytes_after(self, tokens, budget_fraction):
        self.cache.compress(self.seq, self.budget)
        return self.cache.bytes_in_use(self.seq)
    track_bytes_after.unit = "bytes"


_DECODE = {}


class Decode:
    """One decode step (30 layers, 9 query heads) through the numba paged decode."""
    params = ([8192], ["fp16", "compressed-0.25"])
    param_names = ["tokens", "cache"]
    number = 1
    repeat = 5
    timeout = 900

    def setup(self, tokens, kind):
        if (tokens, kind) not in _DECODE:
            _DECODE[tokens, kind] = _filled(tokens, None if kind == "fp16" else 0.25)
        self.cache, self.seq, self.q = _DECODE[tokens, kind]
        self.cache.decode(self.seq, 0, self.q, record=False)      # compile outside the timing

    def time_decode_step(self, tokens, kind):
        for layer in range(LAYERS):
            self.cache.decode(self.seq, layer, self.q, record=False)

    def track_states_per_second(self, tokens, kind):
        import time
        t = time.perf_counter()
        self.time_decode_step(tokens, kind)
        return self.cache.num_states(self.seq) / (time.perf_counter() - t)
    track_states_per_second.unit = "states/s"
