"""Encode/append launcher (docs/design.md §3 steps 0-5, §6; kernel in csrc/encode.cuh).

``encode_into_pages`` encodes n key (part="key") or value (part="value") vectors and writes
each straight into (dst_page, dst_slot) of the pool, at the bit width of that page's tier;
``encode_kv_into_pages`` does both parts of the same states in one launch.
It does not touch page_count (the cache's bookkeeping). With ``check=True`` (default) it
first checks every index (page ids inside the pool, heads inside sigma, mean rows inside
mean, every destination page at a tier of the ladder and every slot inside its page) and the
inputs, signs and means for NaN/Inf on the device and raises ValueError naming the argument
before any launch, so a bad index never writes outside the pool and such a call writes
nothing; then it syncs once more and raises ValueError for a norm beyond an fp16 scale or a
16-bit coordinate beyond fp16 (found by the kernel: the other vectors of that call are
written).
``check=False`` keeps the call free of host syncs (graph capture): the caller guarantees
the indices.

The kernels (docs/PERF_NOTES.md, "Encode") find each cell without a search: on the uniform
codebook (``encode_affine_kernel``) an affine function of t, rounded; on any other
(``encode_table_kernel``) one bucket look-up and one compare, tables from ``cell_tables``.
Vectors near a cell or fp16 boundary go through a float64 pipeline, so every byte equals the
reference's.
"""
from __future__ import annotations

import functools

import numpy as np

from ._module import constants, cupy, kernel
from .kernel_tables import KernelTables, as_device, device_tables, pool_views

_C = constants()
THREADS = _C["ENC_THREADS"]          # threads per encode block (and per re-tier block)
BLOCKS_PER_SM = _C["ENC_CTAS"]       # __launch_bounds__ of the encode kernels (head dims
BLOCKS_PER_SM_WIDE = _C["ENC_CTAS_WIDE"]   # below WIDE_DIM, and from it on)

# Cell table blob (csrc/encode.cuh, ENC_*): per bit row (1, 2, 3, 4, 8 bits) CELL_PRM
# parameters; then (codebooks other than uniform) the float32 squared levels, and per row
# EncRow<b>::G buckets: the midpoint inside each (float32, or NO_MID) and the cell below it (int32).
CELL_PRM = _C["ENC_PRM"]
BUCKETS = {b: _C[f"EncRow<{b}>::G"] for b in (1, 2, 3, 4, 8)}
CELL_LEV2 = _C["ENC_LEV2"]
CELL_BM = _C["ENC_BM"]
CELL_NB = _C["ENC_NB"]
CELL_WORDS = _C["ENC_WORDS"]
MAGIC_BITS = _C["ENC_MAGIC_BITS"]   # bits of 1.5 * 2^23
NO_MID = np.float32(3.0e38)
# float32 ulps between the scale and an fp16 rounding boundary below which the float64
# pipeline decides the scale: about twice the float32 error bound (csrc/encode.cuh)
SCALE_GUARD = {"table": 64, "uniform": 48}
_U = 2.0 ** -24
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


def check_inputs(*checks, finite=()) -> None:
    """Raises ValueError unless every (index array, bound, what) has all entries in
    [0, bound) (bound: a number, or an array of one bound per entry) and every array of
    ``finite`` (an array, or (array, name) to name it in the message) is free of NaN/Inf: one
    device reduction per array, one host sync for all of them."""
    msgs = input_faults(cupy(), checks, finite)
    if msgs:
        raise ValueError("; ".join(msgs))


def input_faults(xp, checks, finite=()) -> list:
    """The messages ``check_inputs`` raises, computed with the array module xp (CuPy on the
    device, NumPy on the host, where the tests run them without a GPU)."""
    flags, msgs = [], []
    for a, hi, what in checks:
        if getattr(a, "size", 0):
            flags.append(xp.any((a < 0) | (a >= (hi if hasattr(hi, "shape") else int(hi)))))
            msgs.append(what)
    for a in finite:
        a, name = a if isinstance(a, tuple) else (a, None)
        if isinstance(a, np.uint64):        # an absent table (a NULL pointer argument)
            continue
        if a.size:
            flags.append(~xp.all(xp.isfinite(a)))
            # the kernels' NaN/Inf status message, or the named array's
            msgs.append(dict(_STATUS)[1] if name is None else f"{name} contains NaN or Inf")
    if not flags:
        return []
    bad = xp.stack(flags)
    bad = bad.get() if hasattr(bad, "get") else bad    # CuPy: one host sync for all of them
    return list(dict.fromkeys(m for flag, m in zip(bad, msgs) if flag))


def slot_checks(xp, page, slot, pt, tables: KernelTables, name: str):
    """The checks of check_inputs that every (page, slot) names a slot of a page of the
    ladder: the page's tier in 1..T (not a free page) and the slot in 0..P(tier) - 1 (``name``:
    what the message calls them, "dst" or "src"). Pages outside the pool are another check's."""
    if not getattr(page, "size", 0):
        return []
    geom = device_tables(tables)["geom"] if xp is not np else tables.geom
    tier = pt[xp.clip(page, 0, pt.shape[0] - 1)]
    cap = geom[xp.clip(tier, 0, tables.num_tiers), 2]
    return [(tier - 1, tables.num_tiers, f"a {name}_page is free or has an unknown tier "
                                         f"(page_tier not in 1..{tables.num_tiers})"),
            (slot, cap, f"a {name}_slot is outside its page (0..P-1 of the page's tier)")]


def _dest_ranges(dests, pt, sigmas, mi, means, tables: KernelTables):
    """The index checks of check_inputs for an encode call: page ids, destination tiers and
    slots, heads (against every sigma table) and mean rows (against every mean table that is
    given)."""
    hd, dp, ds = dests
    out = [(dp, pt.shape[0], f"a dst_page is outside the pool of {pt.shape[0]} pages")]
    out += slot_checks(cupy(), dp, ds, pt, tables, "dst")
    rows = min(s.shape[0] for s in sigmas)
    out.append((hd, rows, f"a head is outside the {rows} rows of sigma"))
    given = [m for m in means if not isinstance(m, np.uint64)]
    if given and not isinstance(mi, np.uint64):
        r = min(m.shape[0] for m in given)
        out.append((mi, r, f"a mean_index is outside the {r} rows of mean"))
    return out


def index_array(a, name, n, per: str = "vector"):
    """a as a C-contiguous int32 device array of n entries (one per ``per``); ValueError
    naming ``name`` otherwise (no copy unless it is strided)."""
    arr, _ = as_device(a, name, np.int32, 1)
    if arr.shape[0] != n:
        raise ValueError(f"{name} must have {n} entries (one per {per}), got {arr.shape[0]}")
    return arr if arr.flags.c_contiguous else arr.copy()


def cell_margin(bits: int, dim: int, mids: np.ndarray) -> float:
    """Distance in t (float64) within which the float32 path of the encode kernels defers a
    coordinate to the float64 pipeline: 2 (L + 1) u sqrt(d) + 48 u M (u = 2^-24, L = log2 d,
    M the largest |midpoint|): at least twice the float32 error of t (csrc/encode.cuh)."""
    m = float(np.max(np.abs(mids))) if mids.size else 0.0
    return 2.0 * (np.log2(dim) + 1.0) * _U * np.sqrt(dim) + 48.0 * _U * m


def _uniform_row(lev: np.ndarray, mids: np.ndarray, dim: int) -> np.ndarray:
    """Parameters of the affine cell A = (t - mid0)/step + 1/2, code = clamp(rint(A)), with
    the threshold on |A - rint(A)| that keeps every code equal to the float64 count of
    midpoints below t."""
    n = lev.size
    hs = 0.5 * (lev[-1] - lev[0]) / (n - 1)
    step = 2.0 * hs
    mid0 = mids[0]
    dev = float(np.max(np.abs(mids - (mid0 + step * np.arange(n - 1)))))   # ~1e-16
    big = float(np.max(np.abs(mids)))
    # the float32 error of t, the midpoints' distance from the exact grid, and the rounding of
    # A (its constants, the fma.sat, times 2^b - 1), in units of A
    mar = ((cell_margin(int(np.log2(n)), dim, mids) + dev) / step
           + 4.0 * _U * (big / step + n) + 2.0 ** -20)
    if not mar < 0.25:
        raise ValueError("encode: the uniform codebook's cells are too narrow for float32")
    thr = np.float32(0.5 - mar)
    if float(thr) > 0.5 - mar:                      # round the threshold down
        thr = np.nextafter(thr, np.float32(0))
    row = np.zeros(CELL_PRM, np.float64)
    row[0] = 1.0 / (step * (n - 1))
    row[1] = (0.5 - mid0 / step) / (n - 1)
    row[2] = n - 1
    row[3] = thr
    row[4] = np.sqrt(dim / 2.0) / hs
    out = row.astype(np.float32)
    out[3] = thr
    out[5:6].view(np.int32)[0] = SCALE_GUARD["uniform"]
    return out


def _bucket_row(bits: int, mids: np.ndarray, dim: int, g: int):
    """(parameters, midpoints, cells) of the bucket table of one row: bucket b = rint((t - lo)/w)
    covers [lo + (b - 1/2) w, lo + (b + 1/2) w]; widened by delta (more than the float32 error
    of t and of the index) it holds at most one midpoint, whose float32 value the bucket
    stores (NO_MID if none), with the count of midpoints below the widened bucket."""
    margin = cell_margin(bits, dim, mids)
    # Rows of 1-4 bits need no clamp where g buckets over all of |t| <= sqrt(d) are fine enough;
    # at wide head dims (WIDE_DIM: sqrt(256) = 16) they are not, and the kernels clamp every
    # row (enc_cells_table<true>), so rows of 2-4 bits take the clamped grid over the midpoints
    # (the 1-bit row's one midpoint keeps the full range, which the clamp leaves as it is).
    clamped = bits > 4 or (dim >= _C["WIDE_DIM"] and mids.size > 1)
    if not clamped:  # |t| <= sqrt(d) (1 + 2^-18) whenever the radius is in range
        t_max = np.sqrt(dim) + 0.5
        lo, w = -t_max, 2.0 * t_max / (g - 1)
    else:            # clamped to [0, g - 1]; the two end buckets hold no midpoint
        w = (mids[-1] - mids[0]) / (g - 5)
        lo = mids[0] - 2.0 * w
        t_max = max(abs(lo), abs(lo + (g - 1) * w))
    delta = 2.0 * margin + 16.0 * _U * t_max
    b = np.arange(g)
    ext_lo = lo + (b - 0.5) * w - delta
    ext_hi = lo + (b + 0.5) * w + delta
    ext_lo[0], ext_hi[-1] = -np.inf, np.inf
    below = np.searchsorted(mids, ext_lo, side="left")          # midpoints < ext_lo
    upto = np.searchsorted(mids, ext_hi, side="right")          # midpoints <= ext_hi
    inside = upto - below
    if np.any(inside > 1):
        raise ValueError(f"encode: {g} buckets are too coarse for the {bits}-bit codebook")
    m = np.where(inside == 1, mids[np.minimum(below, mids.size - 1)].astype(np.float32), NO_MID)
    prm = np.zeros(CELL_PRM, np.float32)
    prm[0] = 1.0 / w
    prm[1] = -lo / w
    prm[2] = g - 1
    prm[3] = margin
    prm[4] = np.sqrt(dim / 2.0)
    prm[5:6].view(np.int32)[0] = SCALE_GUARD["table"]
    prm[6:7].view(np.uint32)[0] = (-4 * MAGIC_BITS) % 2 ** 32   # the kernel's table offset
    return prm, m.astype(np.float32), below.astype(np.int32)


_CELL_CACHE: dict = {}


def cell_tables(tables: KernelTables) -> np.ndarray:
    """float32 (CELL_WORDS,) cell-table blob of the encode kernels for ``tables`` (cached per
    tables object)."""
    key = id(tables)
    hit = _CELL_CACHE.get(key)
    if hit is not None and hit[0] is tables:
        return hit[1]
    from .kernel_tables import LEVEL_BITS
    blob = np.zeros(CELL_WORDS, np.float32)
    ints = blob.view(np.int32)
    off = CELL_BM
    for r, bits in enumerate(LEVEL_BITS):
        n = 2 ** bits
        lev = tables.levels64[r, :n]
        mids = tables.mids64[r, :n - 1]
        if tables.codebook == "uniform":
            blob[r * CELL_PRM:(r + 1) * CELL_PRM] = _uniform_row(lev, mids, tables.dim)
        else:
            g = BUCKETS[bits]
            prm, m, c0 = _bucket_row(bits, mids, tables.dim, g)
            blob[r * CELL_PRM:(r + 1) * CELL_PRM] = prm
            blob[CELL_LEV2 + 256 * r:CELL_LEV2 + 256 * r + n] = (lev * lev).astype(np.float32)
            blob[off:off + g] = m
            ints[off + CELL_NB:off + CELL_NB + g] = c0
            off += g
    _CELL_CACHE[key] = (tables, blob)
    return blob


_CELL_DEVICE: dict = {}


def _cell_device(tables: KernelTables):
    """The cell-table blob on the current device, uploaded once per (tables, device)."""
    cp = cupy()
    key = (id(tables), cp.cuda.Device().id)
    hit = _CELL_DEVICE.get(key)
    if hit is None or hit[0] is not tables:
        hit = (tables, cp.asarray(cell_tables(tables)))
        _CELL_DEVICE[key] = hit
    return hit[1]


def _rows(x, tables: KernelTables, name: str):
    """(n, d) float32 rows the kernels can load (16-byte aligned, unit column stride)."""
    cp = cupy()
    xa, _ = as_device(x, name, ndim=2)
    if xa.dtype.kind != "f":
        raise ValueError(f"{name} must be a float array, got {xa.dtype}")
    if xa.shape[1] != tables.dim:
        raise ValueError(f"{name} has dim {xa.shape[1]}; the tables are for {tables.dim}")
    if (xa.dtype != np.float32 or xa.strides[1] != 4 or xa.strides[0] % 16
            or xa.data.ptr % 16):   # the kernel loads rows with 16-byte vector loads
        xa = cp.ascontiguousarray(xa, dtype=cp.float32)
    return xa


def _rows_of(a, d: int, name: str):
    """A contiguous float32 (R, d) table (rotation signs, means)."""
    t, _ = as_device(a, name, np.float32, 2)
    if t.shape[1] != d:
        raise ValueError(f"{name} must have shape (R, {d})")
    return cupy().ascontiguousarray(t)


def _dests(head, dst_page, dst_slot, n: int):
    """The int32 (n,) head, page and slot of every vector."""
    return tuple(index_array(a, nm, n) for a, nm in ((head, "head"), (dst_page, "dst_page"),
                                                 (dst_slot, "dst_slot")))


def _args(tables: KernelTables, n: int, part: int, rows, mi, dests, pg, pt):
    """The arguments every encode kernel starts with: ``rows`` = (x, signs, means) of part
    ``part`` (0: keys, 1: values), the mean index, the destinations, the pool."""
    xa, sg, mn = rows
    hd, dp, ds = dests
    dev = device_tables(tables)
    return (xa, np.int64(xa.strides[0] // 4), np.int32(n), hd, sg, mn, mi, dp, ds,
            np.int32(part), pg, np.int32(tables.page_words), pt, dev["geom"],
            np.int32(tables.num_tiers), dev["levels64"], dev["mids64"])


def _launch(tables: KernelTables, n: int, part: int, first, second, mi, dests, pg, pt, status):
    """One encode launch: ``first`` = (x, signs, means) as part ``part``, and with ``second``
    (the values' (x, signs, means), part 0) a second row of blocks as part 1."""
    x2, s2, m2 = second if second is not None else first
    parts = 1 if second is None else 2
    name = "encode_affine_kernel" if tables.codebook == "uniform" else "encode_table_kernel"
    kernel(name, tables.dim)((_blocks(n, parts, tables.dim), parts), (THREADS,),
                             _args(tables, n, part, first, mi, dests, pg, pt) +
                             (_cell_device(tables), status, x2, np.int64(x2.strides[0] // 4), s2, m2))


def _blocks(n: int, parts: int, dim: int) -> int:
    """Blocks per part of an encode launch: enough for four vectors per warp, at most one
    wave of resident blocks over all parts (the rest walked by the grid stride)."""
    cp = cupy()
    per_sm = BLOCKS_PER_SM_WIDE if dim >= _C["WIDE_DIM"] else BLOCKS_PER_SM
    return max(1, min(-(-n * 8 // THREADS), per_sm * _sm_count(cp.cuda.Device().id) // parts))


def encode_into_pages(x, pages, page_tier, tables: KernelTables, sigma, head, dst_page, dst_slot,
                      *, part: str = "key", mean=None, mean_index=None, check: bool = True,
                      status=None):
    """x (n, d) float (rows may be strided); sigma float32 (H, d) rotation signs of the
    kv-heads; head int32 (n,) which sigma row each vector uses; dst_page, dst_slot int32
    (n,); mean float32 (R, d) with mean_index int32 (n,) (centring) or None. Writes into
    ``pages`` (uint8 (num_pages, page_bytes) or uint32) in place. Keys and values of the
    same states: ``encode_kv_into_pages`` (one launch)."""
    cp = cupy()
    if part not in ("key", "value"):
        raise ValueError(f"part must be 'key' or 'value', got {part!r}")
    xa = _rows(x, tables, "x")
    n, d = xa.shape
    pg, pt = pool_views(pages, page_tier, tables)
    sg = _rows_of(sigma, d, "sigma")
    dests = _dests(head, dst_page, dst_slot, n)
    if mean is not None:
        if mean_index is None:
            raise ValueError("mean needs mean_index (which mean row each vector uses)")
        mn, mi = _rows_of(mean, d, "mean"), index_array(mean_index, "mean_index", n)
    else:
        mn = mi = np.uint64(0)
    if check:
        check_inputs(*_dest_ranges(dests, pt, (sg,), mi, (mn,), tables),
                     finite=((xa, "x"), (sg, "sigma"), (mn, "mean")))
    if status is None:
        status = cp.zeros(1, cp.int32)
    p = 0 if part == "key" else 1
    if n:
        _launch(tables, n, p, (xa, sg, mn), None, mi, dests, pg, pt, status)
    if check:
        raise_status(status)
    return status


def encode_kv_into_pages(k, v, pages, page_tier, tables: KernelTables, sigma_k, sigma_v, head,
                         dst_page, dst_slot, *, mean_k=None, mean_v=None, mean_index=None,
                         check: bool = True, status=None):
    """Keys k and values v (n, d) of the same n states into their pages: as
    ``encode_into_pages`` with part="key" on k and part="value" on v (same bytes), in one
    launch (two rows of blocks, keys and values side by side). sigma_k, sigma_v: the rotation signs of each part;
    mean_k, mean_v: each part's mean rows (either may be None), indexed by mean_index."""
    cp = cupy()
    ka, va = _rows(k, tables, "k"), _rows(v, tables, "v")
    if ka.shape != va.shape:
        raise ValueError(f"k and v must have the same shape, got {ka.shape} and {va.shape}")
    if (mean_k is not None or mean_v is not None) and mean_index is None:
        raise ValueError("mean_k / mean_v need mean_index (which mean row each vector uses)")
    n, d = ka.shape
    pg, pt = pool_views(pages, page_tier, tables)
    sk, sv = _rows_of(sigma_k, d, "sigma_k"), _rows_of(sigma_v, d, "sigma_v")
    dests = _dests(head, dst_page, dst_slot, n)
    mk = _rows_of(mean_k, d, "mean_k") if mean_k is not None else np.uint64(0)
    mv = _rows_of(mean_v, d, "mean_v") if mean_v is not None else np.uint64(0)
    mi = index_array(mean_index, "mean_index", n) if mean_index is not None else np.uint64(0)
    if check:
        check_inputs(*_dest_ranges(dests, pt, (sk, sv), mi, (mk, mv), tables),
                     finite=((ka, "k"), (va, "v"), (sk, "sigma_k"), (sv, "sigma_v"),
                             (mk, "mean_k"), (mv, "mean_v")))
    if status is None:
        status = cp.zeros(1, cp.int32)
    if n:
        _launch(tables, n, 0, (ka, sk, mk), (va, sv, mv), mi, dests, pg, pt, status)
    if check:
        raise_status(status)
    return status
