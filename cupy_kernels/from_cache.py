"""The GPU decode over a reference ``SphericalKVCache``: the kernels' inputs taken from the
cache itself (its pool, page tables, rotation signs, centring means, softmax scale and
codebook), so that code which keeps its bookkeeping in the reference cache (appends,
protected spans, RDR's compress) can run the decode on the GPU, and so that the kernels are
checked against the cache, not only against synthetic pools (tests/test_cache_kernels.py).

    pool = upload_pool(cache)                        # after every change to the cache
    out = decode_cache(cache, [s0, s1], layer, q, pool=pool)   # q (2, Hq, d) on the GPU

``upload_pool`` copies the whole pool (O(pool bytes)): fine between compressions, not per
token. An engine that keeps its pool on the GPU calls ``ada_decode`` itself with
``kernel_inputs``' tables and signs and writes new states with ``encode_kv_into_pages``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from .kernel_tables import KernelTables, kernel_tables, rotation_signs


@functools.lru_cache(maxsize=32)
def _tables(tiers: tuple, dim: int, page_bytes: int, codebook: str) -> KernelTables:
    return kernel_tables(list(tiers), dim, page_bytes, codebook=codebook)


def _check_cache(cache) -> None:
    from spherical_kv_ref.cache import SphericalKVCache
    if not isinstance(cache, SphericalKVCache):
        raise ValueError(f"cache must be a SphericalKVCache, got {type(cache).__name__}")


@dataclass(frozen=True)
class CacheKernelInputs:
    """Host arrays of one decode over ``rows`` = len(seqs) * num_kv_heads rows (sequence-major,
    then kv-head), as ``ada_decode`` takes them."""
    tables: KernelTables
    sigma_k: np.ndarray      # float32 (num_kv_heads, d): the keys' rotation signs of the layer
    sigma_v: np.ndarray
    indptr: np.ndarray       # int32 (rows + 1,)
    indices: np.ndarray      # int32: pool page ids
    mean_k: np.ndarray | None    # float32 (rows, d), None when the cache does not centre
    mean_v: np.ndarray | None
    num_kv_heads: int
    softmax_scale: float


def kernel_inputs(cache, seqs, layer: int) -> CacheKernelInputs:
    """The kernels' view of one layer of ``cache`` over the sequences ``seqs`` (an id or a
    list). The rotation of a (layer, kv-head, part) is the same at every tier (re-tiering never
    rotates), so the signs come from the top tier's codecs. ValueError for a cache the kernels
    cannot read (a head dim without a kernel instance, ``_module.DIMS``; a ladder or page size
    they do not support), and for a bad sequence id or layer (naming it; the cache's own checks)."""
    from spherical_kv_ref.rotation import KEY_SALT, VALUE_SALT
    _check_cache(cache)
    table = cache.page_table(seqs, layer)      # checks seqs and layer
    tiers = tuple(tuple(int(b) for b in t) for t in cache.ladder.tiers)
    tables = _tables(tiers, int(cache.head_dim), int(cache.page_bytes), str(cache.codebook))
    layer = int(layer)                         # a whole number in range (page_table)
    kb, vb = cache.ladder.bits(cache.ladder.top)
    signs = [rotation_signs([cache.codec(layer, h, bits, salt) for h in range(cache.num_kv_heads)])
             for bits, salt in ((kb, KEY_SALT), (vb, VALUE_SALT))]
    means = (np.ascontiguousarray(table.mean_k, np.float32),
             np.ascontiguousarray(table.mean_v, np.float32)) if cache.centre else (None, None)
    return CacheKernelInputs(tables, signs[0], signs[1], np.asarray(table.indptr, np.int32),
                             np.asarray(table.indices, np.int32), means[0], means[1],
                             int(cache.num_kv_heads), float(cache.softmax_scale))


@dataclass
class DevicePool:
    """A copy of the cache's pool on the GPU: pages uint8 (num_pages, page_bytes), page_tier
    and page_count int32 (num_pages,)."""
    pages: object
    page_tier: object
    page_count: object


def upload_pool(cache) -> DevicePool:
    """Copies the cache's pool to the current GPU (take a new copy after the cache changes:
    appends, compress, free)."""
    from ._module import cupy
    _check_cache(cache)
    cp = cupy()
    pool = cache.paged.pool
    return DevicePool(cp.asarray(pool.data), cp.asarray(pool.page_tier),
                      cp.asarray(pool.page_count))


def decode_cache(cache, seqs, layer: int, q, *, pool: DevicePool | None = None, **kw):
    """Attention outputs (len(seqs), num_q_heads, d) float32 of one decode step of ``layer``
    for each sequence of ``seqs``, by ``ada_decode`` on the GPU; the same as
    ``cache.decode(seq, layer, q[i], record=False)`` for each i, within the kernel's fp16
    error budget (docs/PERF_NOTES.md). q: (len(seqs), num_q_heads, d) on the GPU (CuPy or
    torch). pool: ``upload_pool(cache)`` of the cache as it is now (uploaded here if None).
    Further keywords go to ``ada_decode`` (num_splits, out, workspace, validate, lse);
    num_splits defaults to the cache's own (None there: the kernel's choice)."""
    from .ada_decode import ada_decode
    from ._module import cupy
    inp = kernel_inputs(cache, seqs, layer)
    if pool is not None and not isinstance(pool, DevicePool):
        raise ValueError(f"pool must be upload_pool(cache) or None, got {type(pool).__name__}")
    cp = cupy()
    pool = upload_pool(cache) if pool is None else pool
    sk, sv, indptr, indices, mk, mv = (None if a is None else cp.asarray(a) for a in
                                       (inp.sigma_k, inp.sigma_v, inp.indptr, inp.indices,
                                        inp.mean_k, inp.mean_v))
    if cache.num_splits is not None and kw.get("workspace") is None:
        kw.setdefault("num_splits", cache.num_splits)
    return ada_decode(q, pool.pages, pool.page_tier, pool.page_count, indptr, indices,
                      inp.tables, sk, sv, num_kv_heads=inp.num_kv_heads, mean_k=mk, mean_v=mv,
                      softmax_scale=inp.softmax_scale, **kw)
