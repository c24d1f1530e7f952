"""ADA paged decode launcher (docs/design.md §6; kernel in csrc/ada_decode.cuh).

``ada_decode`` runs one decode step of one layer: q (batch, num_q_heads, d) against the
paged cache of rows (sequence b, kv-head h) -> row b*num_kv_heads + h. It allocates only
the output and split-K partials of size O(splits * rows * group * d); pass ``out`` and a
``DecodeWorkspace`` (and ``validate=False``) to make a step free of allocations and host
syncs, e.g. inside a CUDA graph capture.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from spherical_kv_ref.codec import whole

from . import _pdl
from ._module import DIMS, constants, cupy, kernel
from .kernel_tables import KernelTables, as_device, device_tables

_C = constants()
THREADS = 32 * _C["DEC_WARPS"]       # threads per decode CTA
MAX_GROUP = _C["DEC_HEADS"]          # query heads per kv-head served by one mma tile
LUT_BYTES = _C["LUT_BYTES"]          # the table path's replicated look-up tables (shared memory)
MERGE_HEAD_MAX_SPLITS = _C["MERGE_HEAD_MAX_SPLITS"]   # ada_merge_per_head_kernel's limit


@dataclass(frozen=True)
class DecodePath:
    """How one codebook path decodes (csrc/ada_decode.cuh), the launch side of its kernel.

    kernel: the decode kernel; ctas_per_sm, ctas_per_sm_wide: its residency (its
    __launch_bounds__) below and from WIDE_DIM on (``ctas(dim)``); waves,
    fit: the default split count fills ``waves`` waves of resident CTAs, rounding the splits
    per row down (fit: whole waves) or up; stages: page buffers per warp; query_apart: the
    rotated query is staged past the page buffers (which fill while it is built); geom_rows:
    the geometry table is padded with zero rows to this many (the kernel reads them at
    entry; 0: as is); per_head_merge: split-K partials merge with ada_merge_per_head_kernel
    (up to MERGE_HEAD_MAX_SPLITS splits, a programmatic dependent launch) instead of
    ada_merge_kernel; mean_out_of_logits: the kernel leaves q . mu_K out of the logits (the
    merge adds it back into the log-sum-exp)."""
    name: str
    kernel: str
    ctas_per_sm: int
    ctas_per_sm_wide: int
    waves: int
    fit: bool
    stages: int
    query_apart: bool
    geom_rows: int
    per_head_merge: bool
    mean_out_of_logits: bool

    def ctas(self, dim: int) -> int:
        """Resident CTAs per SM of this path's kernel at head dim ``dim``."""
        return self.ctas_per_sm_wide if dim >= _C["WIDE_DIM"] else self.ctas_per_sm


# Any codebook (Lloyd–Max, kernel_tables' default): look-up tables in shared memory.
TABLE_PATH = DecodePath("table", "ada_decode_table_kernel", ctas_per_sm=_C["TABLE_CTAS"],
                        ctas_per_sm_wide=_C["TABLE_CTAS_WIDE"],
                        waves=2, fit=False, stages=2, query_apart=False, geom_rows=0,
                        per_head_merge=False, mean_out_of_logits=False)
# The uniform codebook: codes are affine in the level, no tables; one wave of CTAs (half the
# splits of two waves halve the per-CTA prologue and epilogue and the merge's work).
AFFINE_PATH = DecodePath("affine", "ada_decode_affine_kernel", ctas_per_sm=_C["AFF_CTAS"],
                         ctas_per_sm_wide=_C["AFF_CTAS_WIDE"],
                         waves=1, fit=True, stages=_C["AFF_STAGES"], query_apart=True,
                         geom_rows=_C["SKV_GEOM_PRE_ROWS"], per_head_merge=True,
                         mean_out_of_logits=True)


def decode_path(tables: KernelTables) -> DecodePath:
    """The uniform codebook decodes on the affine path (no look-up tables); any other codebook
    (Lloyd–Max, kernel_tables' default) on the table path. The pool's codebook decides."""
    return AFFINE_PATH if tables.codebook == "uniform" else TABLE_PATH


def splits_for(tables: KernelTables, rows: int, total_pages: int) -> int:
    """The split count ``ada_decode`` uses when none is given (shapes only, no device read)."""
    path = decode_path(tables)
    return choose_splits(rows, total_pages, ctas_per_sm=path.ctas(tables.dim), waves=path.waves,
                         fit=path.fit)


def decode_smem_bytes(dim: int, page_bytes: int, path: DecodePath) -> int:
    """Dynamic shared memory of the decode kernel: tables (table path only) + max(``stages``
    page buffers per warp [+ the rotated query staged past them: MAX_GROUP rows of dim +
    dim / 32 float32, csrc qs_at], the merge tiles) (csrc/ada_decode.cuh decode_region_bytes)."""
    query = MAX_GROUP * (dim + dim // 32) * 4 if path.query_apart else 0
    tables = LUT_BYTES if path is TABLE_PATH else 0
    return tables + max(4 * path.stages * page_bytes + query, 4 * MAX_GROUP * dim * 4)


@dataclass
class DecodeWorkspace:
    """Split-K partial outputs (splits, rows, group, d) float32 and their log2-sum-exp."""
    num_splits: int
    part_o: object
    part_lse: object


def _sm_count() -> int:
    cp = cupy()
    return int(cp.cuda.Device().attributes["MultiProcessorCount"])


_SMEM_SET = {}


def _allow_smem(fn, nbytes: int) -> None:
    """Raises the kernel's dynamic shared-memory limit once (above 48 KiB needs opt-in).

    Keyed by the CUfunction handle: the kernel getter returns a new Python object per call, so
    an ``id()`` key could be reused by another kernel's object after garbage collection and
    skip the opt-in (seen once as CUDA_ERROR_INVALID_VALUE on the first launch of a table
    kernel). Without a handle the limit is set on every call."""
    try:
        key = int(fn.kernel.ptr)
    except Exception:  # no handle exposed: set it every time (one driver call)
        key = None
    if key is not None and _SMEM_SET.get(key, 0) >= nbytes:
        return
    fn.max_dynamic_shared_size_bytes = int(nbytes)
    if key is not None:
        _SMEM_SET[key] = int(nbytes)


def choose_splits(rows: int, total_pages: int, min_pages_per_split: int = 8,
                  ctas_per_sm: int = TABLE_PATH.ctas_per_sm, waves: int = 2,
                  fit: bool = False) -> int:
    """Split count that gives ~``waves`` waves of CTAs, from shapes only (no device read).
    ctas_per_sm: the kernel's residency (DecodePath.ctas). fit: round the splits per
    row down, so that the CTAs fill whole waves, instead of up (up to rows - 1 CTAs in a
    further, nearly empty wave). ValueError naming the argument for a count that is not a
    whole number (rows, total_pages >= 0; the others >= 1)."""
    rows, total_pages = whole("rows", rows, 0), whole("total_pages", total_pages, 0)
    min_pages_per_split = whole("min_pages_per_split", min_pages_per_split, 1)
    ctas_per_sm, waves = whole("ctas_per_sm", ctas_per_sm, 1), whole("waves", waves, 1)
    target = waves * ctas_per_sm * _sm_count()
    avg = max(1, total_pages // max(1, rows))
    per_row = target // max(1, rows) if fit else math.ceil(target / max(1, rows))
    return int(max(1, min(per_row, avg // min_pages_per_split, 256)))


#: the most splits ``make_workspace`` allocates and ``ada_decode`` takes: far past any use
#: (``choose_splits`` picks at most 256; past MERGE_HEAD_MAX_SPLITS the per-row merge runs),
#: so that a count meant for something else is refused before a huge allocation
MAX_SPLITS = 4096


def make_workspace(rows: int, group: int, dim: int, num_splits: int) -> DecodeWorkspace:
    """The split-K partials of ``ada_decode`` for ``rows`` rows of ``group`` query heads at
    head dim ``dim`` over ``num_splits`` splits (1: none needed, nothing allocated).
    ValueError naming the argument, before any allocation, for a count out of range."""
    rows = whole("rows", rows, 0)
    group = whole("group", group, 1, MAX_GROUP + 1)
    dim = whole("dim", dim, 1)
    if dim not in DIMS:
        raise ValueError(f"dim must be one of the kernels' head dims {DIMS}, got {dim}")
    num_splits = whole("num_splits", num_splits, 1, MAX_SPLITS + 1)
    cp = cupy()
    if num_splits <= 1:
        return DecodeWorkspace(1, None, None)
    return DecodeWorkspace(int(num_splits),
                           cp.empty((num_splits, rows, group, dim), cp.float32),
                           cp.empty((num_splits, rows, group), cp.float32))


PAGE_TABLE_FAULTS = ("indptr[0] must be 0", "indptr[-1] must equal len(indices)",
                     "indptr must be non-decreasing", "an entry of indices is outside the pool",
                     "a page in indices is free (page_tier 0), has an unknown page_tier, or a "
                     "page_count outside 1..P")
#: the arrays ``ada_decode`` checks for NaN and Inf, in the order it passes them
FINITE_NAMES = ("q", "mean_k", "mean_v", "sigma_k", "sigma_v")


def validate_page_table(page_tier, page_count, indptr, indices, tables: KernelTables, rows: int,
                        finite=()):
    """Checks the page table on the device, then raises ValueError (one host sync).

    indptr starts at 0, never decreases and ends at len(indices); every index names a page
    of the pool; every referenced page has a tier in 1..T and 1..P(tier) valid states. And
    every array in ``finite`` (the queries and means) holds no NaN or Inf, checked in the
    same sync."""
    cp = cupy()
    bad = page_table_faults(cp, page_tier, page_count, indptr, indices, device_tables(tables)["geom"],
                            tables.num_tiers, rows, finite)
    raise_page_table_faults(bad.get())   # the one host sync of validation


def raise_page_table_faults(b, names=FINITE_NAMES) -> None:
    """ValueError for the first fault flagged in ``page_table_faults``' answer, if any; a
    NaN or Inf names the arrays it is in (``names``: those of ``finite``, in order)."""
    for flag, msg in zip(b, PAGE_TABLE_FAULTS):
        if flag:
            raise ValueError(f"bad page table: {msg}")
    if b[5]:
        which = [n for n, f in zip(names, b[6:]) if f]
        raise ValueError(f"{' and '.join(which) or 'q, mean_k or mean_v'} contains NaN or Inf")


def page_table_faults(xp, page_tier, page_count, indptr, indices, geom, num_tiers: int, rows: int,
                      finite=()):
    """The checks of ``validate_page_table`` as int32 flags (6 + len(finite),), one per
    PAGE_TABLE_FAULTS entry, one for NaN/Inf in any array of ``finite`` and then one per such
    array, computed with the array module xp: CuPy on the device, NumPy on the host (where the
    tests run them without a GPU)."""
    num_pages = page_tier.shape[0]
    bad = xp.zeros(6 + len(finite), xp.int32)
    for i, a in enumerate(finite):
        if a is not None and a.size:
            bad[6 + i] = ~xp.all(xp.isfinite(a))
            bad[5] |= bad[6 + i]
    bad[0] = indptr[0] != 0
    bad[1] = (indptr[-1] != indices.shape[0])
    if rows > 0:
        bad[2] = xp.any(indptr[1:] < indptr[:-1])
    if indices.shape[0]:
        bad[3] = xp.any((indices < 0) | (indices >= num_pages))
        idx = xp.clip(indices, 0, num_pages - 1)
        tier = page_tier[idx]
        tier_ok = (tier >= 1) & (tier <= num_tiers)
        cap = geom[xp.clip(tier, 0, num_tiers), 2]
        cnt = page_count[idx]
        bad[4] = xp.any(~tier_ok | (cnt < 1) | (cnt > cap))
    return bad


def ada_decode(q, pages, page_tier, page_count, indptr, indices, tables: KernelTables,
               sigma_k, sigma_v, *, num_kv_heads: int, mean_k=None, mean_v=None,
               softmax_scale: float | None = None, num_splits: int | None = None,
               out=None, workspace: DecodeWorkspace | None = None, validate: bool = True,
               lse=None):
    """o (batch, num_q_heads, d) float32 = ADA attention over the paged, encoded cache.

    q: (batch, Hq, d) float (any strides; copied to float32 only if it is not float32 with a
    unit last stride). pages: uint8 (num_pages, page_bytes) or uint32 (num_pages,
    page_bytes/4). page_tier, page_count: int32 (num_pages,). indptr: int32 (rows+1,),
    indices: int32, rows = batch * num_kv_heads in (sequence, kv-head) order. sigma_k,
    sigma_v: float32 (num_kv_heads, d) rotation signs. mean_k, mean_v: float32 (rows, d)
    or None. The pool's codebook picks the path (``decode_path``): the uniform codebook the
    affine kernel, any other the table kernel. num_splits: split-K partitions of each row's
    pages (None: ``splits_for``). validate (default): before the launch, one host sync checks the page
    table and that q, mean_k, mean_v and the signs hold no NaN or Inf (ValueError, ``out`` untouched);
    pass False inside a CUDA graph, where nothing checks them (non-finite input then gives an
    undefined output, not always NaN). lse: a contiguous float32 (batch, num_q_heads) array
    that receives each head's log-sum-exp (natural log) of its scaled logits
    softmax_scale * q . k over the row's states (-inf for a row without states), for merging
    this attention with another (prefix sharing, chunked prefill); it needs the split-K merge,
    so the call takes at least 2 splits (a workspace of 1 split is a ValueError). Returns a
    CuPy array (a torch tensor if q is one)."""
    path = decode_path(tables)
    hkv = whole("num_kv_heads", num_kv_heads, 1)
    if num_splits is not None:
        num_splits = whole("num_splits", num_splits, 1)
    if softmax_scale is not None and (isinstance(softmax_scale, (bool, np.bool_))
                                      or not isinstance(softmax_scale, numbers.Real)):
        raise ValueError(f"softmax_scale must be a real number or None, got {softmax_scale!r}")
    if workspace is not None and not isinstance(workspace, DecodeWorkspace):
        raise ValueError(f"workspace must be a DecodeWorkspace (make_workspace) or None, got "
                         f"{type(workspace).__name__}")
    cp = cupy()
    if type(q).__module__.startswith("torch") and getattr(q, "dtype", None) is not None \
            and str(q.dtype) != "torch.float32":
        q = q.float()     # bf16/fp16 queries: (batch, Hq, d), a few KiB
    qa, torch_in = as_device(q, "q", ndim=3)
    if qa.dtype.kind != "f":
        raise ValueError(f"q must be a float array, got {qa.dtype}")
    batch, hq, d = qa.shape
    if d != tables.dim:
        raise ValueError(f"q has head dim {d}; the tables are for {tables.dim}")
    if hq % hkv:
        raise ValueError(f"num_q_heads={hq} is not a multiple of num_kv_heads={hkv}")
    group = hq // hkv
    if group > MAX_GROUP:
        raise ValueError(f"GQA group of {group} query heads; the kernel serves up to {MAX_GROUP}")
    rows = batch * hkv
    pg, _ = as_device(pages, "pages", ndim=2)
    if pg.dtype == np.uint8:
        if pg.shape[1] != tables.page_bytes:
            raise ValueError(f"pages have {pg.shape[1]} bytes, tables say {tables.page_bytes}")
        pg = pg.view(cp.uint32)
    elif pg.dtype == np.uint32:
        if pg.shape[1] != tables.page_words:
            raise ValueError(f"pages have {pg.shape[1]} words, tables say {tables.page_words}")
    else:
        raise ValueError(f"pages must be uint8 or uint32, got {pg.dtype}")
    if not pg.flags.c_contiguous:
        raise ValueError("pages must be C-contiguous (it is the pool itself, never copied)")
    num_pages = pg.shape[0]
    pt, _ = as_device(page_tier, "page_tier", np.int32, 1)
    pc, _ = as_device(page_count, "page_count", np.int32, 1)
    ip, _ = as_device(indptr, "indptr", np.int32, 1)
    ix, _ = as_device(indices, "indices", np.int32, 1)
    if pt.shape[0] != num_pages or pc.shape[0] != num_pages:
        raise ValueError(f"page_tier/page_count must have {num_pages} entries")
    if ip.shape[0] != rows + 1:
        raise ValueError(f"indptr must have batch*num_kv_heads+1 = {rows + 1} entries, got {ip.shape[0]}")
    sk, _ = as_device(sigma_k, "sigma_k", np.float32, 2)
    sv, _ = as_device(sigma_v, "sigma_v", np.float32, 2)
    for name, s in (("sigma_k", sk), ("sigma_v", sv)):
        if s.shape != (hkv, d):
            raise ValueError(f"{name} must have shape ({hkv}, {d}), got {s.shape}")
    sk, sv = cp.ascontiguousarray(sk), cp.ascontiguousarray(sv)
    means = []
    for name, m in (("mean_k", mean_k), ("mean_v", mean_v)):
        if m is None:
            means.append(None)
            continue
        ma, _ = as_device(m, name, np.float32, 2)
        if ma.shape != (rows, d):
            raise ValueError(f"{name} must have shape ({rows}, {d}), got {ma.shape}")
        means.append(cp.ascontiguousarray(ma))
    for name, a in (("page_tier", pt), ("page_count", pc), ("indptr", ip), ("indices", ix)):
        if not a.flags.c_contiguous:
            raise ValueError(f"{name} must be contiguous")
    if qa.dtype != np.float32 or qa.strides[2] != 4:
        qa = qa.astype(cp.float32)   # (batch, Hq, d): a few KiB, never O(tokens * d)
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    if not math.isfinite(scale):
        raise ValueError("softmax_scale must be finite")
    if lse is not None:
        lse, _ = as_device(lse, "lse", np.float32, 2)
        if lse.shape != (batch, hq) or not lse.flags.c_contiguous:
            raise ValueError(f"lse must be a contiguous float32 ({batch}, {hq}) array")
        if num_splits is not None and int(num_splits) < 2:
            raise ValueError("lse needs the split-K merge: num_splits must be >= 2")
    if workspace is not None:
        splits = workspace.num_splits
        if num_splits is not None and num_splits != splits:
            raise ValueError("num_splits disagrees with the workspace")
        if lse is not None and splits < 2:
            raise ValueError("lse needs the split-K merge: a workspace of at least 2 splits")
        if splits > 1 and workspace.part_o.shape != (splits, rows, group, d):
            raise ValueError("workspace shape does not match this call")
    else:
        splits = (splits_for(tables, rows, ix.shape[0])
                  if num_splits is None else int(num_splits))
        if lse is not None:
            splits = max(splits, 2)
        workspace = make_workspace(rows, group, d, splits)
    if out is None:
        out = cp.empty((batch, hq, d), cp.float32)
    else:
        out, _ = as_device(out, "out", np.float32, 3)
        if out.shape != (batch, hq, d) or not out.flags.c_contiguous:
            raise ValueError(f"out must be a contiguous float32 ({batch}, {hq}, {d}) array")
    if validate:
        validate_page_table(pt, pc, ip, ix, tables, rows, finite=(qa, *means, sk, sv))
    if rows == 0:
        if lse is not None:
            lse.fill(-np.inf)
        return out
    dev = device_tables(tables)
    null = np.uint64(0)   # a NULL pointer argument
    mk = means[0] if means[0] is not None else null
    mv = means[1] if means[1] is not None else null
    po = workspace.part_o if splits > 1 else null
    pl = workspace.part_lse if splits > 1 else null
    kern = kernel(path.kernel, d)
    smem = decode_smem_bytes(d, tables.page_bytes, path)
    levels = dev["levels32"] if path is TABLE_PATH else dev["half_steps"]
    if smem > 227 * 1024:
        raise ValueError(f"page_bytes={tables.page_bytes} needs {smem} bytes of shared memory "
                         "per block; use pages of at most 24 KiB")
    _allow_smem(kern, smem)
    geom = dev["geom"]
    if geom.shape[0] < path.geom_rows:
        key = ("geom_padded", path.geom_rows)
        if key not in dev:
            dev[key] = cp.concatenate([geom, cp.zeros((path.geom_rows - geom.shape[0],) + geom.shape[1:],
                                                      geom.dtype)])
        geom = dev[key]
    q_strides = (np.int64(qa.strides[0] // 4), np.int64(qa.strides[1] // 4))   # in floats
    kern((splits, rows), (THREADS,),
         (qa, *q_strides,
          pg, np.int32(tables.page_words), pt, pc, ip, ix, geom, levels,
          sk, sv, mk, mv, np.int32(hkv), np.int32(group),
          np.float32(scale * math.log2(math.e)), np.int32(splits), out, po, pl),
         shared_mem=smem)
    if splits > 1:
        # lse: q . mu_K is added back where the kernel left it out of the logits
        lk = mk if (lse is not None and path.mean_out_of_logits) else null
        margs = (workspace.part_o, workspace.part_lse, np.int32(splits), np.int32(rows),
                 np.int32(hkv), np.int32(group), sv, mv, out,
                 qa, *q_strides, lk,
                 np.float32(scale), lse if lse is not None else null)
        if path.per_head_merge and splits <= MERGE_HEAD_MAX_SPLITS:
            merge = kernel("ada_merge_per_head_kernel", d)
            if not _pdl.launch(merge, (group, rows), (4 * d,), margs):
                merge((group, rows), (4 * d,), margs)
        else:
            kernel("ada_merge_kernel", d)((rows,), (d,), margs)
    if torch_in:
        import torch
        return torch.from_dlpack(out)
    return out


def cache_bytes(page_count, indptr, indices, tables: KernelTables, page_tier) -> int:
    """Bytes the decode kernel must read for a page table (host arrays): the codes and scales
    of every valid state (full pages are streamed whole: they are the same bytes + padding)."""
    pc = np.asarray(page_count)
    pt = np.asarray(page_tier)
    ix = np.asarray(indices)
    per = np.array([0] + [tables.bytes_per_state(t) for t in range(1, tables.num_tiers + 1)])
    return int(np.sum(pc[ix] * per[pt[ix]]))
