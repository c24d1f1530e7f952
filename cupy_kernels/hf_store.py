"""The transformers integration's context store on the GPU kernels.

``spherical_kv_ref.hf.SphericalStore`` evaluates attention over a compressed sequence with
the NumPy reference. ``GpuSphericalStore`` is the same store whose ``attend`` runs
``ada_decode`` over the cache's own pool and page tables (``decode_cache``), one kernel row
per query token, with the log-sum-exps the integration merges with the new chunk's part:

    cache = SphericalCache(model.config, budget_fraction=0.2, store_class=GpuSphericalStore)
    model.generate(..., past_key_values=cache)         # spherical_kv_ref.hf.SphericalCache

(or, by hand, ``cache.set_store(GpuSphericalStore(cache.kv, cache.seq))`` after
``cache.compress(...)``).

The cache's bookkeeping (appends of new tokens at the top tier, RDR) stays on the host in the
reference ``SphericalKVCache``; the pool is copied to the GPU again after it changes (an
append), so this is the kernels' path for a model, checked against the reference store, not
an engine's fast path (an engine keeps its pool on the GPU: docs/kernels.md).
"""
from __future__ import annotations

import numpy as np

from spherical_kv_ref.hf import SphericalStore

from .from_cache import decode_cache, upload_pool


class GpuSphericalStore(SphericalStore):
    """A ``SphericalStore`` whose attention runs on the GPU decode kernel.

    attend(layer, q (num_q_heads, T, d), scale) -> (out (num_q_heads, T, d), lse
    (num_q_heads, T)) float64 on the host, as the reference store returns them; scale must be
    the cache's softmax scale (ValueError otherwise: the kernel reads it from the cache)."""

    def __init__(self, kv, seq: int):
        super().__init__(kv, seq)
        self._pool = None

    def attend(self, layer, q, scale):
        from ._module import cupy
        cp = cupy()
        q = np.asarray(q)
        if q.ndim != 3 or q.shape[0] != self.num_q_heads or q.shape[2] != self.kv.head_dim:
            raise ValueError(f"q must be (num_q_heads={self.num_q_heads}, T, "
                             f"d={self.kv.head_dim}), got {q.shape}")
        if not np.isclose(float(scale), float(self.kv.softmax_scale), rtol=1e-6, atol=0.0):
            raise ValueError(f"scale {scale} is not the cache's softmax scale {self.kv.softmax_scale}")
        T = q.shape[1]
        if self._pool is None:
            self._pool = upload_pool(self.kv)
        qd = cp.asarray(np.ascontiguousarray(q.transpose(1, 0, 2), dtype=np.float32))  # (T, Hq, d)
        lse = cp.empty((T, self.num_q_heads), cp.float32)
        out = decode_cache(self.kv, [self.seq] * T, layer, qd, pool=self._pool, lse=lse)
        return (cp.asnumpy(out).transpose(1, 0, 2).astype(np.float64),
                cp.asnumpy(lse).T.astype(np.float64))

    def append(self, layer, k, v):
        held = super().append(layer, k, v)
        self._pool = None                 # the pages changed: copy them again before attending
        return held
