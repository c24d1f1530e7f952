"""Encode/append launcher (DESIGN §3 steps 0-5, §6; kernel in csrc/encode.cuh).

``encode_into_pages`` encodes n key (part="key") or value (part="value") vectors and writes
each straight into (dst_page, dst_slot) of the pool, at the bit width of that page's tier.
It does not touch page_count (the cache's bookkeeping). With ``check=True`` (default) it
syncs once and raises ValueError for NaN/Inf input, a norm beyond an fp16 scale, or a bad
destination; ``check=False`` keeps the call free of host syncs (graph capture).

Two kernel generations (docs/PERF_NOTES.md, "Encode"): ``version=2`` (default) runs eight
lanes per vector in float32 with a float64 fallback for coordinates near a cell boundary,
``version=1`` one warp per vector in float64. Both write the reference's bytes.
"""
from __future__ import annotations

import functools

import numpy as np

from ._module import cupy, kernel
from .pages import KernelTables, as_device, device_tables, pool_views

THREADS = 256
ENCODE_VERSIONS = (1, 2)
DEFAULT_ENCODE_VERSION = 2
V2_BLOCKS_PER_SM = 4      # __launch_bounds__(256, 4) of encode_v2_kernel
_STATUS = ((1, "an input vector contains NaN or Inf"),
           (2, "a vector norm is too large for an fp16 scale (max 65504)"),
           (4, "a rotated coordinate exceeds the fp16 range of the 16-bit tier"),
           (8, "a destination page is free or has an unknown tier"),
           (16, "a destination slot is outside its page"),
           (32, "a re-tier would add bits (promotion is never allowed)"))


def raise_status(status) -> None:
    """Turns the kernels' status word into ValueError (one host sync)."""
    s = int(status.get()[0])
    msgs = [m for bit, m in _STATUS if s & bit]
    if msgs:
        raise ValueError("; ".join(msgs))


@functools.lru_cache(maxsize=None)
def _sm_count(device_id: int) -> int:
    return int(cupy().cuda.Device(device_id).attributes["MultiProcessorCount"])


def _index(a, name, n):
    arr, _ = as_device(a, name, np.int32, 1)
    if arr.shape[0] != n:
        raise ValueError(f"{name} must have {n} entries, got {arr.shape[0]}")
    return arr if arr.flags.c_contiguous else arr.copy()


def encode_into_pages(x, pages, page_tier, tables: KernelTables, sigma, head, dst_page, dst_slot,
                      *, part: str = "key", mean=None, mean_index=None, check: bool = True,
                      status=None, version: int | None = None):
    """x (n, d) float (rows may be strided); sigma float32 (H, d) rotation signs of the
    kv-heads; head int32 (n,) which sigma row each vector uses; dst_page, dst_slot int32
    (n,); mean float32 (R, d) with mean_index int32 (n,) (centring) or None. Writes into
    ``pages`` (uint8 (num_pages, page_bytes) or uint32) in place. ``version``: the kernel
    generation (1 or 2; None: the default, 2)."""
    cp = cupy()
    if part not in ("key", "value"):
        raise ValueError(f"part must be 'key' or 'value', got {part!r}")
    version = DEFAULT_ENCODE_VERSION if version is None else version
    if version not in ENCODE_VERSIONS:
        raise ValueError(f"encode version must be one of {ENCODE_VERSIONS}, got {version!r}")
    xa, _ = as_device(x, "x", ndim=2)
    if xa.dtype.kind != "f":
        raise ValueError(f"x must be a float array, got {xa.dtype}")
    n, d = xa.shape
    if d != tables.dim:
        raise ValueError(f"x has dim {d}; the tables are for {tables.dim}")
    if (xa.dtype != np.float32 or xa.strides[1] != 4 or xa.strides[0] % 16
            or xa.data.ptr % 16):   # the kernel loads rows with 16-byte vector loads
        xa = cp.ascontiguousarray(xa, dtype=cp.float32)
    pg, pt = pool_views(pages, page_tier, tables)
    sg, _ = as_device(sigma, "sigma", np.float32, 2)
    if sg.shape[1] != d:
        raise ValueError(f"sigma must have shape (H, {d})")
    sg = cp.ascontiguousarray(sg)
    hd = _index(head, "head", n)
    dp = _index(dst_page, "dst_page", n)
    ds = _index(dst_slot, "dst_slot", n)
    if mean is not None:
        mn, _ = as_device(mean, "mean", np.float32, 2)
        if mn.shape[1] != d:
            raise ValueError(f"mean must have shape (R, {d})")
        mn = cp.ascontiguousarray(mn)
        if mean_index is None:
            raise ValueError("mean needs mean_index (which mean row each vector uses)")
        mi = _index(mean_index, "mean_index", n)
    else:
        mn = mi = np.uint64(0)
    if status is None:
        status = cp.zeros(1, cp.int32)
    if n:
        dev = device_tables(tables)
        if version == 2:   # four vectors per warp, a grid of resident blocks walking the rest
            blocks = max(1, min(-(-n * 8 // THREADS),
                                V2_BLOCKS_PER_SM * _sm_count(cp.cuda.Device().id)))
        else:
            blocks = max(1, min(-(-n * 32 // THREADS), 132 * 16))
        kernel("encode_v2_kernel" if version == 2 else "encode_kernel", d)(
            (blocks,), (THREADS,),
            (xa, np.int64(xa.strides[0] // 4), np.int32(n), hd, sg, mn, mi, dp, ds,
             np.int32(0 if part == "key" else 1), pg, np.int32(tables.page_words), pt,
             dev["geom"], np.int32(tables.num_tiers), dev["levels64"], dev["mids64"], status))
    if check:
        raise_status(status)
    return status
