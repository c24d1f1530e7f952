"""Host-side page helpers shared by the launchers: the per-tier geometry table, the codebook
tables the kernels read, and ``pack_pages`` (NumPy Encoded arrays -> pages, docs/format.md).

Everything here is NumPy; ``to_device`` is the only function that touches CuPy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import numpy as np

from ._module import DIMS, constants

GEOM_STRIDE = constants()["SKV_GEOM_STRIDE"]   # int32 per geometry row (csrc/spherical_common.cuh)
LEVEL_BITS = (1, 2, 3, 4, 8)   # rows of the (5, 256) level tables


def uniform_half_steps(tables: "KernelTables") -> np.ndarray:
    """float32 (5,): half the step hs_b of the uniform codebook for b = 1, 2, 3, 4, 8 bits, so
    that C_b[c] = hs_b * (2c - (2^b - 1)) (docs/format.md). The affine decode path feeds the
    integers 2c - (2^b - 1) to the tensor cores and multiplies hs_b into the scales.
    ValueError unless the tables' levels are of that form (to 1e-9 relative)."""
    out = np.zeros(len(LEVEL_BITS))
    for r, b in enumerate(LEVEL_BITS):
        n = 2 ** b
        lev = tables.levels64[r, :n]
        hs = 0.5 * (lev[-1] - lev[0]) / (n - 1)
        grid = hs * (2 * np.arange(n) + 1 - n)
        if not hs > 0 or np.max(np.abs(lev - grid)) > 1e-9 * np.max(np.abs(lev)):
            raise ValueError(f"the {tables.codebook} codebook at {b} bits is not affine in the "
                             "code; the affine decode path needs codebook='uniform'")
        out[r] = hs
    return out.astype(np.float32)


@dataclass(frozen=True)
class KernelTables:
    """What the kernels need to know about a ladder at one head dim and page size.

    geom: int32 (T+1, 8) rows [kbits, vbits, P, kwords, vwords, voff_words, ksoff_bytes,
    vsoff_bytes] (row 0 unused), each tier's ``spherical_kv_ref.paged.tier_layout``.
    levels32: float32 (5, 256) codebook levels for 1, 2, 3, 4, 8 bits (zero padded);
    levels64 / mids64: the same in float64 and their midpoints (cell boundaries, computed as
    in the reference quantiser)."""
    ladder: Tuple[Tuple[int, int], ...]
    dim: int
    page_bytes: int
    codebook: str
    geom: np.ndarray
    levels32: np.ndarray
    levels64: np.ndarray
    mids64: np.ndarray

    @property
    def num_tiers(self) -> int:
        return len(self.ladder)

    @property
    def page_words(self) -> int:
        return self.page_bytes // 4

    def states_per_page(self, tier: int) -> int:
        return int(self.geom[tier, 2])

    def bytes_per_state(self, tier: int) -> int:
        from spherical_kv_ref.codec import vector_bytes
        kb, vb = self.ladder[tier - 1]
        return vector_bytes(kb, self.dim) + vector_bytes(vb, self.dim)


def kernel_tables(ladder, dim: int, page_bytes: int = 4096,
                  codebook: str = "lloyd-max") -> KernelTables:
    """Builds the tables for ``ladder`` (a TierLadder or a list of (key_bits, value_bits))."""
    from spherical_kv_ref import codebooks

    tiers = tuple(tuple(int(b) for b in t) for t in getattr(ladder, "tiers", ladder))
    if not tiers:
        raise ValueError("the ladder needs at least one tier")
    from spherical_kv_ref.codec import whole
    if whole("dim", dim, 1) not in DIMS:
        raise ValueError(f"dim must be one of the head dims the kernels are built for, {DIMS}; got {dim}")
    if whole("page_bytes", page_bytes, 16) % 16:
        raise ValueError(f"page_bytes must be a positive multiple of 16, got {page_bytes}")
    from spherical_kv_ref.paged import tier_layout
    geom = np.zeros((len(tiers) + 1, GEOM_STRIDE), np.int32)
    for t, (kb, vb) in enumerate(tiers, start=1):
        for b in (kb, vb):
            if b not in (1, 2, 3, 4, 8, 16):
                raise ValueError(f"bits must be one of 1, 2, 3, 4, 8, 16; got {b} in tier {t}")
        lay = tier_layout(t, kb, vb, dim, page_bytes)     # the page geometry, docs/design.md §4
        geom[t] = (kb, vb, lay.states_per_page, lay.key_words, lay.value_words,
                   lay.value_codes_offset // 4, lay.key_scales_offset, lay.value_scales_offset)
    levels64 = np.zeros((len(LEVEL_BITS), 256))
    mids64 = np.zeros((len(LEVEL_BITS), 256))
    for r, b in enumerate(LEVEL_BITS):
        lev = codebooks.codebook(b, dim, codebook)
        levels64[r, :lev.size] = lev
        mids64[r, :lev.size - 1] = 0.5 * (lev[1:] + lev[:-1])
    return KernelTables(tiers, int(dim), int(page_bytes), codebook, geom,
                        levels64.astype(np.float32), levels64, mids64)


@dataclass
class PackedPages:
    """A page pool and CSR page table in NumPy (docs/format.md "Pages")."""
    pages: np.ndarray        # uint8 (num_pages, page_bytes)
    page_tier: np.ndarray    # int32 (num_pages,)
    page_count: np.ndarray   # int32 (num_pages,)
    indptr: np.ndarray       # int32 (rows + 1,)
    indices: np.ndarray      # int32 (total pages,)
    last_page_len: np.ndarray  # int32 (rows,)


def pack_pages(rows: Sequence[Sequence[Tuple[int, object, object]]], tables: KernelTables,
               num_pages: int | None = None, rng=None, fill: int | None = 0) -> PackedPages:
    """Lays encoded states into tier-homogeneous pages.

    rows: for each row (sequence, kv-head), a list of (tier, keys Encoded, values Encoded)
    chunks; a chunk's states fill pages of that tier densely (slots 0..count-1), every page
    of one row and tier except the last one full. rng (numpy Generator): shuffles page ids
    and the order of a row's pages (both are free in the format). fill: byte value of unused
    page bytes, or None for random bytes (shows that kernels ignore them). ValueError naming
    the argument (``rows[r]`` for a chunk of row r) before anything is laid out."""
    from spherical_kv_ref.codec import Encoded, whole
    if not isinstance(tables, KernelTables):
        raise ValueError(f"tables must be KernelTables (kernel_tables), got {type(tables).__name__}")
    if num_pages is not None:
        num_pages = whole("num_pages", num_pages, 0)
    if fill is not None:
        fill = whole("fill", fill, 0, 256)
    g = tables.geom
    plan: List[List[Tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]] = []
    for r, chunks in enumerate(rows):
        mine = []
        for chunk in chunks:
            if not (isinstance(chunk, (tuple, list)) and len(chunk) == 3 and isinstance(chunk[1], Encoded)
                    and isinstance(chunk[2], Encoded)):
                raise ValueError(f"rows[{r}]: a chunk must be (tier, keys Encoded, values "
                                 f"Encoded), got {type(chunk).__name__}")
            tier, ke, ve = chunk
            if isinstance(tier, (bool, np.bool_)) or not isinstance(tier, (int, np.integer)) \
                    or not 1 <= tier <= tables.num_tiers:
                raise ValueError(f"rows[{r}]: tier {tier!r} outside 1..{tables.num_tiers}")
            kb, vb, p, kw, vw = (int(x) for x in g[tier, :5])
            if ke.bits != kb or ve.bits != vb or ke.dim != tables.dim or ve.dim != tables.dim:
                raise ValueError(f"rows[{r}]: tier {tier} holds ({kb}, {vb}) bits at dim "
                                 f"{tables.dim}, got ({ke.bits}, {ve.bits}) at {ke.dim}")
            if len(ke) != len(ve):
                raise ValueError(f"rows[{r}]: keys and values differ in length")
            for a in range(0, len(ke), p):
                sl = slice(a, min(len(ke), a + p))
                mine.append((tier, ke.codes[sl], ke.scale[sl], ve.codes[sl], ve.scale[sl]))
        plan.append(mine)
    used = sum(len(m) for m in plan)
    num_pages = used if num_pages is None else num_pages
    if num_pages < used:
        raise ValueError(f"num_pages={num_pages}: the rows need {used} pages")
    ids = np.arange(num_pages, dtype=np.int32)
    if rng is not None:
        rng.shuffle(ids)
    if fill is None:
        gen = rng if rng is not None else np.random.default_rng(0)
        pages = gen.integers(0, 256, (num_pages, tables.page_bytes), dtype=np.uint8)
    else:
        pages = np.full((num_pages, tables.page_bytes), fill, np.uint8)
    page_tier = np.zeros(num_pages, np.int32)
    page_count = np.zeros(num_pages, np.int32)
    indptr = np.zeros(len(plan) + 1, np.int32)
    indices: List[int] = []
    last = np.zeros(len(plan), np.int32)
    k = 0
    for r, mine in enumerate(plan):
        order = list(range(len(mine)))
        if rng is not None:
            rng.shuffle(order)
        for o in order:
            tier, kc, ks, vc, vs = mine[o]
            pid = int(ids[k]); k += 1
            kb, vb, p, kw, vw, voff, ksoff, vsoff = (int(x) for x in g[tier])
            n = kc.shape[0]
            words = pages[pid].view(np.uint32)
            words[:n * kw] = np.ascontiguousarray(kc, np.uint32).reshape(-1)
            words[voff:voff + n * vw] = np.ascontiguousarray(vc, np.uint32).reshape(-1)
            if ksoff >= 0:
                pages[pid, ksoff:ksoff + 2 * n] = np.ascontiguousarray(ks, np.float16).view(np.uint8)
            if vsoff >= 0:
                pages[pid, vsoff:vsoff + 2 * n] = np.ascontiguousarray(vs, np.float16).view(np.uint8)
            page_tier[pid] = tier
            page_count[pid] = n
            indices.append(pid)
            last[r] = n
        indptr[r + 1] = len(indices)
    return PackedPages(pages, page_tier, page_count, indptr,
                       np.asarray(indices, np.int32), last)


def rotation_signs(codecs: Sequence) -> np.ndarray:
    """float32 (H, d) sign table from codecs (one per kv-head), for the kernels. ValueError
    naming ``codecs`` for none, a codec without a Hadamard rotation, or codecs of different
    head dims."""
    out = []
    for c in codecs:
        s = getattr(c, "signs", None)
        if s is None:
            raise ValueError(f"codecs: the kernels need Hadamard rotations (a power-of-two head "
                             f"dim), got {type(c).__name__} without rotation signs")
        out.append(np.asarray(s, np.float32))
    if not out:
        raise ValueError("codecs must hold one codec per kv-head, got none")
    if len({a.shape for a in out}) > 1:
        raise ValueError(f"codecs must share one head dim, got {sorted({a.shape[0] for a in out})}")
    return np.stack(out)


_DEVICE_CACHE: Dict[tuple, dict] = {}


def device_tables(tables: KernelTables) -> dict:
    """CuPy copies of the tables on the current device, uploaded once and cached."""
    from ._module import cupy
    cp = cupy()
    key = (id(tables), cp.cuda.Device().id)
    hit = _DEVICE_CACHE.get(key)
    if hit is None or hit["tables"] is not tables:
        hit = {"tables": tables,
               "geom": cp.asarray(tables.geom),
               "levels32": cp.asarray(tables.levels32),
               "levels64": cp.asarray(tables.levels64),
               "mids64": cp.asarray(tables.mids64),
               "half_steps": (cp.asarray(uniform_half_steps(tables))
                              if tables.codebook == "uniform" else None)}
        _DEVICE_CACHE[key] = hit
    return hit


def as_device(x, name: str, dtype=None, ndim: int | None = None):
    """(cupy array viewing x, came_from_torch). x: a CuPy array or anything with
    ``__dlpack__`` on the GPU (torch tensors). No copy; host arrays are a ValueError."""
    from ._module import cupy
    cp = cupy()
    if isinstance(x, cp.ndarray):
        arr, torch_in = x, False
    elif hasattr(x, "__dlpack__") and not isinstance(x, np.ndarray):
        try:
            arr = cp.from_dlpack(x)
        except Exception as e:
            raise ValueError(f"{name}: cannot view it on the GPU through DLPack ({e})") from e
        torch_in = type(x).__module__.startswith("torch")
    else:
        raise ValueError(f"{name} must be a CuPy array or a GPU tensor with __dlpack__, "
                         f"got {type(x).__name__}")
    if dtype is not None and arr.dtype != np.dtype(dtype):
        raise ValueError(f"{name} must have dtype {np.dtype(dtype)}, got {arr.dtype}")
    if ndim is not None and arr.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {arr.shape}")
    return arr, torch_in


def pool_views(pages, page_tier, tables: KernelTables):
    """(pages as uint32 (num_pages, page_words), page_tier int32 (num_pages,)) for the kernels
    that write into the pool (encode, re-tier): pages is the pool itself, uint8
    (num_pages, page_bytes) or uint32, C-contiguous (never copied); ValueError otherwise."""
    from ._module import cupy
    cp = cupy()
    pg, _ = as_device(pages, "pages", ndim=2)
    if pg.dtype == np.uint8 and pg.shape[1] == tables.page_bytes:
        pg = pg.view(cp.uint32)
    elif not (pg.dtype == np.uint32 and pg.shape[1] == tables.page_words):
        raise ValueError(f"pages must be uint8 (N, {tables.page_bytes}) or uint32 (N, {tables.page_words})")
    if not pg.flags.c_contiguous:
        raise ValueError("pages must be C-contiguous")
    pt, _ = as_device(page_tier, "page_tier", np.int32, 1)
    if pt.shape[0] != pg.shape[0]:
        raise ValueError("page_tier must have one entry per page")
    return pg, pt
