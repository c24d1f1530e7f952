"""Tier-homogeneous page pool and CSR page tables (docs/paged.md, docs/format.md "Pages").

One pool of ``num_pages`` fixed-size pages of ``page_bytes`` bytes serves every tier, so one
free list is enough; a page holds states of one row (one (sequence, layer, kv-head)) and one
tier. Page metadata (``page_tier``, ``page_count``, ``page_pos``) lives in arrays beside the
page bytes, which is what a kernel reads before it streams a page.

Inside a page (structure of arrays, ``P`` = states per page of the tier):

    key codes   [P][kb]   at 0
    value codes [P][vb]   at P·kb
    key scales  fp16 [P]  at P·(kb + vb)            (only if key_bits < 16)
    value scales fp16 [P] right after the key scales (only if value_bits < 16)

States are stored exactly as the codec writes them: the rotated, centred vector's packed
codes and its fp16 scale (docs/format.md "Encoded vector"). The row's means μ_K, μ_V sit
beside the page table (the cache keeps them), not in the pages.

Re-tiering (RDR's decision) only ever lowers a tier. A demoted state is re-encoded from what
is stored: its rotated vector ŷ = s·ĉ (the fp16 values themselves at 16 bits) is quantised
again at the lower bit width *in the same rotated frame*. That is correct because the
rotation Π depends on (seed, layer, kv-head, key/value) only, never on the tier, so every
tier of a row shares one accumulation space and no un-rotation is needed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Hashable, List, Optional, Sequence

import numpy as np

from . import codebooks
from .ada import mixed_tier_attention   # the decode specification; re-exported here
from .codec import FP16_MAX, Encoded, SphericalCodec, pack_fp16, pack_codes, vector_bytes, whole
from .tiers import TierLadder, states_per_page

__all__ = ["TierLayout", "tier_layout", "page_layout", "PoolExhaustedError", "PagePool", "PagedKV",
           "PageTable", "RowStates", "encode_rotated", "scatter_states", "stored_rotated",
           "mixed_tier_attention"]


class PoolExhaustedError(ValueError):
    """The page pool has fewer free pages than an operation needs (nothing was changed)."""


# ------------------------------------------------------------------------------ layout

@dataclass(frozen=True)
class TierLayout:
    """Byte layout of one tier's pages (docs/format.md "Pages"). Offsets in bytes from the
    start of the page; a scale offset is -1 where that half of the state has no scale."""
    tier: int
    key_bits: int
    value_bits: int
    states_per_page: int
    key_code_bytes: int
    value_code_bytes: int
    value_codes_offset: int
    key_scales_offset: int
    value_scales_offset: int

    @property
    def key_words(self) -> int:
        return self.key_code_bytes // 4

    @property
    def value_words(self) -> int:
        return self.value_code_bytes // 4


def _code_bytes(bits: int, dim: int) -> int:
    return vector_bytes(bits, dim) - (0 if bits == 16 else 2)


def tier_layout(tier: int, key_bits: int, value_bits: int, dim: int, page_bytes: int) -> TierLayout:
    """The byte layout of the pages of one tier (docs/format.md "Pages"; docs/design.md §4).

    The one definition of the page geometry: ``page_layout``, the numba decode's tables
    (``paged_decode.PagedDecodeTables``), the kernels' geometry rows
    (``cupy_kernels.kernel_tables``) and the engine's ``BlockFormat`` are built from it.
    States per page as ``tiers.states_per_page``; ValueError if not one state fits."""
    kb, vb = _code_bytes(key_bits, dim), _code_bytes(value_bits, dim)
    p = states_per_page(vector_bytes(key_bits, dim) + vector_bytes(value_bits, dim),
                        page_bytes, tier)
    ks_off = p * (kb + vb) if key_bits != 16 else -1
    vs_off = -1
    if value_bits != 16:
        vs_off = p * (kb + vb) + (2 * p if key_bits != 16 else 0)
    return TierLayout(tier, key_bits, value_bits, p, kb, vb, p * kb, ks_off, vs_off)


def page_layout(ladder: TierLadder, dim: int, page_bytes: int) -> tuple:
    """Layouts of tiers 1..T as a tuple indexed by tier (entry 0 is None)."""
    return (None,) + tuple(tier_layout(t, *ladder.bits(t), dim, page_bytes)
                           for t in range(1, len(ladder) + 1))


# ------------------------------------------------------------------------------ re-encoding

def stored_rotated(codec: SphericalCodec, enc: Encoded) -> np.ndarray:
    """ŷ = s·ĉ (n, d) float64: the rotated, centred vector a stored state stands for."""
    return enc.scale.astype(np.float64)[:, None] * codec.rotated_points(enc)


def encode_rotated(codec: SphericalCodec, y: np.ndarray, mean=None) -> Encoded:
    """Encode vectors already in the codec's rotated (and centred) frame, (n, d) float.

    The same steps as ``SphericalCodec.encode`` after its rotation (docs/format.md): radius,
    nearest level per coordinate, scale s = r/‖ĉ‖ in fp16, packing. Used to demote a stored
    state without leaving the rotated frame."""
    y = np.asarray(y, dtype=np.float64)
    n, d = y.shape
    mean32 = None if mean is None else np.asarray(mean, np.float32)
    if codec.bits == 16:
        if np.any(np.abs(y) > FP16_MAX):
            raise ValueError("a rotated coordinate exceeds the fp16 range (65504)")
        return Encoded(np.ones(n, np.float16), pack_fp16(y.astype(np.float16)), 16, d, mean32,
                       codec.key)
    r = np.sqrt(np.sum(y * y, axis=1))
    zero = r == 0.0
    u = y / np.where(zero, 1.0, r)[:, None]
    codes = codebooks.quantize(np.sqrt(d) * u, codec.levels)
    codes[zero] = 0
    chat_norm = np.sqrt(np.sum(codec.levels[codes] ** 2, axis=1) / d)
    scale = np.where(zero, 0.0, r / chat_norm)
    if np.any(scale > FP16_MAX):
        raise ValueError("a re-encoded scale exceeds the fp16 range (65504)")
    return Encoded(scale.astype(np.float16), pack_codes(codes, codec.bits), codec.bits, d, mean32,
                   codec.key)


def scatter_states(data: np.ndarray, lay: TierLayout, page, slot, keys: Encoded,
                   values: Encoded) -> None:
    """Write state i (codes and fp16 scales of keys[i], values[i]) into slot[i] of page[i].

    data: uint8 (num_pages, page_bytes), the pool's bytes, written in place; every page
    named is of the tier ``lay`` describes; page, slot (n,) integers, any order (the
    caller's bookkeeping keeps them distinct and inside the page). The bytes land where
    docs/format.md "Pages" puts them; page counts are the caller's."""
    page = np.asarray(page, np.int64)[:, None]
    slot = np.asarray(slot, np.int64)[:, None]
    kb, vb = lay.key_code_bytes, lay.value_code_bytes
    data[page, slot * kb + np.arange(kb)] = \
        np.ascontiguousarray(keys.codes, np.uint32).view(np.uint8).reshape(-1, kb)
    data[page, lay.value_codes_offset + slot * vb + np.arange(vb)] = \
        np.ascontiguousarray(values.codes, np.uint32).view(np.uint8).reshape(-1, vb)
    two = np.arange(2)
    if lay.key_scales_offset >= 0:
        data[page, lay.key_scales_offset + 2 * slot + two] = \
            np.ascontiguousarray(keys.scale, np.float16).view(np.uint8).reshape(-1, 2)
    if lay.value_scales_offset >= 0:
        data[page, lay.value_scales_offset + 2 * slot + two] = \
            np.ascontiguousarray(values.scale, np.float16).view(np.uint8).reshape(-1, 2)


# ------------------------------------------------------------------------------ pool

class PagePool:
    """``num_pages`` pages of ``page_bytes`` bytes, with their metadata and one free list.

    data: uint8 (num_pages, page_bytes). page_tier: int32 (num_pages,), 0 = free.
    page_count: int32 (num_pages,) valid states (slots 0..count-1). page_pos: int32
    (num_pages, P_max) token position of each slot (-1 where empty), bookkeeping only."""

    def __init__(self, ladder: TierLadder, dim: int, page_bytes: int, num_pages: int):
        if int(page_bytes) != page_bytes or page_bytes <= 0 or page_bytes % 16:
            raise ValueError(f"page_bytes must be a positive multiple of 16, got {page_bytes!r}")
        if int(num_pages) != num_pages or num_pages < 1:
            raise ValueError(f"num_pages must be a positive integer, got {num_pages!r}")
        self.ladder, self.dim = ladder, int(dim)
        self.page_bytes, self.num_pages = int(page_bytes), int(num_pages)
        self.layout = page_layout(ladder, self.dim, self.page_bytes)
        self.max_states_per_page = max(lay.states_per_page for lay in self.layout[1:])
        self.data = np.zeros((self.num_pages, self.page_bytes), np.uint8)
        self.page_tier = np.zeros(self.num_pages, np.int32)
        self.page_count = np.zeros(self.num_pages, np.int32)
        self.page_pos = np.full((self.num_pages, self.max_states_per_page), -1, np.int32)
        # a stack popped from the end: page 0 is handed out first (deterministic)
        self._free: List[int] = list(range(self.num_pages - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self, n: int, tier: int) -> List[int]:
        """Take n pages for a tier (count 0). PoolExhaustedError, changing nothing, if short."""
        if n > len(self._free):
            raise PoolExhaustedError(f"page pool exhausted: need {n} free pages, have "
                                     f"{len(self._free)} of {self.num_pages} "
                                     f"({self.page_bytes} bytes each)")
        ids = [self._free.pop() for _ in range(n)]
        self.page_tier[ids] = tier
        self.page_count[ids] = 0
        return ids

    def release(self, ids: Sequence[int]) -> None:
        for p in ids:
            if self.page_tier[p] == 0:
                raise RuntimeError(f"page {p} released twice; this is a bug")
            self.page_tier[p] = 0
            self.page_count[p] = 0
            self.page_pos[p] = -1
            self.data[p] = 0          # a free page holds zeros: no stale states, reproducible bytes
            self._free.append(int(p))

    def write(self, page: int, slot: int, keys: Encoded, values: Encoded, pos) -> None:
        """Store states at slots slot.. of a page of the keys'/values' tier; count grows to cover them."""
        lay = self.layout[int(self.page_tier[page])]
        n = len(keys)
        if slot + n > lay.states_per_page:
            raise RuntimeError("write past the end of a page; this is a bug")
        scatter_states(self.data, lay, np.full(n, page), np.arange(slot, slot + n), keys, values)
        self.page_pos[page, slot:slot + n] = pos
        self.page_count[page] = max(int(self.page_count[page]), slot + n)

    def read(self, page: int):
        """(keys Encoded, values Encoded, positions) of a page's valid states (mean None)."""
        tier = int(self.page_tier[page])
        lay = self.layout[tier]
        n = int(self.page_count[page])
        row = self.data[page]
        kb, vb = lay.key_code_bytes, lay.value_code_bytes
        kc = row[:n * kb].copy().view(np.uint32).reshape(n, kb // 4)
        o = lay.value_codes_offset
        vc = row[o:o + n * vb].copy().view(np.uint32).reshape(n, vb // 4)
        ks = np.ones(n, np.float16)
        vs = np.ones(n, np.float16)
        if lay.key_scales_offset >= 0:
            o = lay.key_scales_offset
            ks = row[o:o + 2 * n].copy().view(np.float16)
        if lay.value_scales_offset >= 0:
            o = lay.value_scales_offset
            vs = row[o:o + 2 * n].copy().view(np.float16)
        return (Encoded(ks, kc, lay.key_bits, self.dim), Encoded(vs, vc, lay.value_bits, self.dim),
                self.page_pos[page, :n].copy())


def _concat(encs: List[Encoded], bits: int, dim: int, words: int) -> Encoded:
    if not encs:
        return Encoded(np.zeros(0, np.float16), np.zeros((0, words), np.uint32), bits, dim)
    return Encoded(np.concatenate([e.scale for e in encs]), np.concatenate([e.codes for e in encs]),
                   bits, dim)


# ------------------------------------------------------------------------------ rows

@dataclass(frozen=True)
class PageTable:
    """CSR page table over rows (docs/format.md): indptr int32 [rows+1], indices int32,
    last_page_len int32 [rows] (0 for a row without pages)."""
    indptr: np.ndarray
    indices: np.ndarray
    last_page_len: np.ndarray


@dataclass(frozen=True)
class RowStates:
    """Every kept state of a row in page-table order: tier, token position, page, slot."""
    tier: np.ndarray
    pos: np.ndarray
    page: np.ndarray
    slot: np.ndarray

    def __len__(self) -> int:
        return int(self.tier.shape[0])


CodecFor = Callable[[int, int], SphericalCodec]    # (bits, salt) -> codec of the row


class PagedKV:
    """A page pool plus one page list per row (any hashable key, e.g. (seq, layer, head)).

    Operations validate everything before they change anything, so an error (a
    ``ValueError``, or ``PoolExhaustedError`` which is one) leaves pool and rows as they were.
    Invariant kept by every operation: each (row, tier) has at most one partly filled page,
    so it occupies exactly ⌈n/P⌉ pages — the page count RDR charges."""

    def __init__(self, ladder: TierLadder, dim: int, page_bytes: int = 4096, num_pages: int = 1024):
        self.ladder = ladder
        self.top = ladder.top
        self.pool = PagePool(ladder, dim, page_bytes, num_pages)
        self.rows: Dict[Hashable, List[int]] = {}

    # -------------------------------------------------------------- rows
    @property
    def dim(self) -> int:
        return self.pool.dim

    def add_row(self, key: Hashable) -> None:
        if key in self.rows:
            raise ValueError(f"a row with key {key!r} already exists")
        self.rows[key] = []

    def _row(self, key) -> List[int]:
        if key not in self.rows:
            raise ValueError(f"no row with key {key!r} (never added, or freed)")
        return self.rows[key]

    def pages(self, key) -> List[int]:
        """Page ids of a row (a copy), in page-table order."""
        return list(self._row(key))

    def num_states(self, key) -> int:
        return int(self.pool.page_count[self._row(key)].sum()) if self._row(key) else 0

    def states(self, key) -> RowStates:
        pages = np.asarray(self._row(key), np.int64)
        cnt = self.pool.page_count[pages].astype(np.int64)
        page = np.repeat(pages, cnt)
        slot = np.arange(page.size) - np.repeat(np.cumsum(cnt) - cnt, cnt)
        return RowStates(self.pool.page_tier[page].astype(np.int64),
                         self.pool.page_pos[page, slot].astype(np.int64), page, slot)

    def gather(self, key) -> Dict[int, tuple]:
        """{tier: (keys, values, positions)} of a row's kept states, tiers present only,
        each in page-table order (the order of ``states``)."""
        row = np.asarray(self._row(key), np.int64)
        pool = self.pool
        out = {}
        tiers = pool.page_tier[row]
        for t in sorted({int(x) for x in tiers}):
            lay = pool.layout[t]
            pages = row[tiers == t]
            blk = pool.data[pages]                                   # (m, page_bytes)
            per = lay.states_per_page
            valid = (np.arange(per)[None, :] < pool.page_count[pages][:, None]).reshape(-1)
            kb, vb = lay.key_code_bytes, lay.value_code_bytes

            def field(off, width):
                x = blk[:, off:off + per * width].reshape(-1, width)[valid]
                return np.ascontiguousarray(x)
            kc = field(0, kb).view(np.uint32)
            vc = field(lay.value_codes_offset, vb).view(np.uint32)
            n = kc.shape[0]
            ks = field(lay.key_scales_offset, 2).view(np.float16)[:, 0] \
                if lay.key_scales_offset >= 0 else np.ones(n, np.float16)
            vs = field(lay.value_scales_offset, 2).view(np.float16)[:, 0] \
                if lay.value_scales_offset >= 0 else np.ones(n, np.float16)
            pos = pool.page_pos[pages][:, :per].reshape(-1)[valid]
            out[t] = (Encoded(ks, kc, lay.key_bits, self.dim), Encoded(vs, vc, lay.value_bits, self.dim), pos)
        return out

    def bytes(self, key) -> int:
        """Bytes the pool holds for a row: pages × page_bytes (padding of partial pages included)."""
        return len(self._row(key)) * self.pool.page_bytes

    # -------------------------------------------------------------- append
    def _open_top_pages(self, row):
        per = self.pool.layout[self.top].states_per_page
        r = np.asarray(row, np.int64)
        return [int(p) for p in r[(self.pool.page_tier[r] == self.top) & (self.pool.page_count[r] < per)]]

    def pages_needed(self, key, n: int) -> int:
        """Fresh pages an append of n states to a row would take."""
        n = whole("n", n, 0)
        per = self.pool.layout[self.top].states_per_page
        room = sum(per - int(self.pool.page_count[p]) for p in self._open_top_pages(self._row(key)))
        return -(-max(0, n - room) // per)

    def append(self, key, keys: Encoded, values: Encoded, pos):
        """Store new states at the top tier (a prefill chunk or one decode token).

        keys, values: Encoded at the top tier's key/value bits; pos (n,) token positions.
        Fills the row's partly filled top-tier page first, then fresh pages. Returns an
        undo token for ``undo_append``."""
        row = self._row(key)
        kb, vb = self.ladder.bits(self.top)
        for name, e in (("keys", keys), ("values", values)):
            if not isinstance(e, Encoded):
                raise ValueError(f"{name} must be Encoded (a codec's encode), got {type(e).__name__}")
        pos = np.asarray(pos)
        if pos.ndim != 1 or (pos.size and pos.dtype.kind not in "iu"):
            raise ValueError(f"pos must be a 1-d array of integer token positions, got {pos.dtype} "
                             f"{pos.shape}")
        pos = pos.astype(np.int64)
        if keys.bits != kb or values.bits != vb or keys.dim != self.dim or values.dim != self.dim:
            raise ValueError(f"keys and values must be encoded at the top tier ({kb}, {vb}) bits, "
                             f"dim {self.dim}; got ({keys.bits}, {values.bits}), dim "
                             f"({keys.dim}, {values.dim})")
        n = len(keys)
        if len(values) != n or pos.shape[0] != n:
            raise ValueError(f"keys ({n}), values ({len(values)}) and pos ({pos.shape[0]}) must "
                             f"have one entry per new state")
        per = self.pool.layout[self.top].states_per_page
        open_pages = self._open_top_pages(row)
        fresh = self.pool.allocate(self.pages_needed(key, n), self.top)   # raises before any change
        row.extend(fresh)
        token = ([(p, int(self.pool.page_count[p]), self.pool.data[p].copy()) for p in open_pages], fresh)
        done = 0
        for p in open_pages + fresh:
            c = int(self.pool.page_count[p])
            m = min(per - c, n - done)
            if m <= 0:
                continue
            sl = slice(done, done + m)
            self.pool.write(p, c, keys.take(sl), values.take(sl), pos[sl])
            done += m
        return token

    def undo_append(self, key, token) -> None:
        """Take back an append (its undo token), provided nothing else changed the row since."""
        row = self._row(key)
        opened, fresh = token
        for p, c, raw in opened:
            self.pool.data[p] = raw
            self.pool.page_pos[p, c:] = -1
            self.pool.page_count[p] = c
        gone = set(fresh)
        row[:] = [p for p in row if p not in gone]
        self.pool.release(fresh)

    # -------------------------------------------------------------- re-tier, compact, free
    def _plan(self, key, new_tier, codec_for: CodecFor):
        """Validate an allocation for one row; return what to rewrite (no change made)."""
        st = self.states(key)
        new_tier = np.asarray(new_tier)
        if new_tier.shape != (len(st),) or (len(st) and not np.issubdtype(new_tier.dtype, np.integer)):
            raise ValueError(f"row {key!r}: allocation must be ({len(st)},) integers, one per kept "
                             f"state in page-table order, got {new_tier.shape} {new_tier.dtype}")
        new_tier = new_tier.astype(np.int64)
        if len(st) and (new_tier.min() < 0 or new_tier.max() > self.top):
            raise ValueError(f"row {key!r}: tiers must lie in 0..{self.top}")
        up = new_tier > st.tier
        if np.any(up):
            i = int(np.flatnonzero(up)[0])
            raise ValueError(f"row {key!r}: state at position {int(st.pos[i])} would be promoted "
                             f"from tier {int(st.tier[i])} to {int(new_tier[i])}; a demoted state "
                             f"cannot regain bits, promotion is never allowed")
        changed = sorted({int(t) for t in st.tier[new_tier != st.tier]}
                         | {int(t) for t in new_tier[(new_tier != st.tier) & (new_tier > 0)]})
        return st, new_tier, changed

    def retier(self, items) -> None:
        """Apply allocations: items = [(key, new_tier (n,), codec_for)], new_tier aligned with
        ``states(key)``; 0 evicts, a lower tier demotes (re-encoded from what is stored, see the
        module docstring), equal keeps. Every (row, tier) that changes is rewritten densely.
        All rows are validated and the pool capacity checked before anything changes."""
        plans = [(key, codec_for) + self._plan(key, nt, codec_for) for key, nt, codec_for in items]
        keys_seen = [key for key, *_ in plans]
        if len(set(keys_seen)) != len(keys_seen):
            raise ValueError("a row appears twice in one retier call")
        # build the new content of every changed (row, tier) in memory first
        work = []
        released = 0
        needed = 0
        for key, codec_for, st, new_tier, changed in plans:
            if not changed:
                continue
            content = self.gather(key)
            old_pages = [p for p in self._row(key) if int(self.pool.page_tier[p]) in changed]
            released += len(old_pages)
            new_content = {}
            for t in changed:
                if t == 0:
                    continue
                parts_k, parts_v, parts_p = [], [], []
                kb, vb = self.ladder.bits(t)
                for src, (k_enc, v_enc, pos) in content.items():
                    sel = new_tier[st.tier == src] == t
                    if not np.any(sel):
                        continue
                    k_sel, v_sel = k_enc.take(sel), v_enc.take(sel)
                    if src != t:     # demotion: re-encode from the stored rotated vector
                        skb, svb = self.ladder.bits(src)
                        k_sel = encode_rotated(codec_for(kb, 0), stored_rotated(codec_for(skb, 0), k_sel))
                        v_sel = encode_rotated(codec_for(vb, 1), stored_rotated(codec_for(svb, 1), v_sel))
                    parts_k.append(k_sel)
                    parts_v.append(v_sel)
                    parts_p.append(pos[sel])
                lay = self.pool.layout[t]
                ke = _concat(parts_k, kb, self.dim, lay.key_words)
                ve = _concat(parts_v, vb, self.dim, lay.value_words)
                new_content[t] = (ke, ve, np.concatenate(parts_p) if parts_p else np.zeros(0, np.int64))
                needed += -(-len(ke) // lay.states_per_page)
            work.append((key, old_pages, new_content))
        if needed > self.pool.num_free + released:
            raise PoolExhaustedError(f"page pool exhausted: the allocation needs {needed} pages, "
                                     f"{self.pool.num_free + released} would be free")
        for key, old_pages, new_content in work:
            row = self._row(key)
            old = set(old_pages)
            row[:] = [p for p in row if p not in old]
            self.pool.release(old_pages)
            for t, (ke, ve, pos) in new_content.items():
                self._write_dense(row, t, ke, ve, pos)

    def _write_dense(self, row: List[int], tier: int, ke: Encoded, ve: Encoded, pos) -> None:
        """Write states of one tier into fresh, densely filled pages appended to the row."""
        pool = self.pool
        lay = pool.layout[tier]
        per = lay.states_per_page
        n = len(ke)
        if n == 0:
            return
        m = -(-n // per)
        ids = pool.allocate(m, tier)
        blk = np.zeros((m, pool.page_bytes), np.uint8)

        def put(off, width, x):           # x (n, width) bytes into slots of every page
            full = np.zeros((m * per, width), np.uint8)
            full[:n] = x
            blk[:, off:off + per * width] = full.reshape(m, per * width)
        put(0, lay.key_code_bytes, np.ascontiguousarray(ke.codes, np.uint32).view(np.uint8))
        put(lay.value_codes_offset, lay.value_code_bytes,
            np.ascontiguousarray(ve.codes, np.uint32).view(np.uint8))
        if lay.key_scales_offset >= 0:
            put(lay.key_scales_offset, 2, np.ascontiguousarray(ke.scale, np.float16).view(np.uint8).reshape(n, 2))
        if lay.value_scales_offset >= 0:
            put(lay.value_scales_offset, 2, np.ascontiguousarray(ve.scale, np.float16).view(np.uint8).reshape(n, 2))
        idx = np.asarray(ids, np.int64)
        pool.data[idx] = blk
        cnt = np.full(m, per, np.int32)
        cnt[-1] = n - (m - 1) * per
        pool.page_count[idx] = cnt
        p_full = np.full(m * per, -1, np.int32)
        p_full[:n] = pos
        pool.page_pos[idx, :per] = p_full.reshape(m, per)
        row.extend(ids)

    def compact(self, key, tier: int) -> int:
        """Re-pack a row's pages of one tier densely (⌈n/P⌉ pages); returns pages freed."""
        row = self._row(key)
        if not 1 <= tier <= self.top:
            raise ValueError(f"tier must be in 1..{self.top}, got {tier}")
        mine = [p for p in row if self.pool.page_tier[p] == tier]
        per = self.pool.layout[tier].states_per_page
        n = int(self.pool.page_count[mine].sum()) if mine else 0
        if len(mine) == -(-n // per):
            return 0
        ke, ve, pos = self.gather(key)[tier]
        old = set(mine)
        row[:] = [p for p in row if p not in old]
        self.pool.release(mine)            # frees at least as many pages as are rewritten
        self._write_dense(row, tier, ke, ve, pos)
        return len(mine) - -(-n // per)

    def free_row(self, key) -> None:
        row = self._row(key)
        self.pool.release(row)
        del self.rows[key]

    # -------------------------------------------------------------- page tables
    def page_table(self, keys: Sequence[Hashable]) -> PageTable:
        """CSR page table over the given rows, in that order."""
        lists = [self._row(k) for k in keys]
        indptr = np.zeros(len(lists) + 1, np.int32)
        indptr[1:] = np.cumsum([len(x) for x in lists])
        indices = np.array([p for x in lists for p in x], np.int32)
        last = np.array([self.pool.page_count[x[-1]] if x else 0 for x in lists], np.int32)
        return PageTable(indptr, indices, last)

    def check_invariants(self) -> None:
        """Raise AssertionError if an invariant of docs/paged.md is broken (tests and debugging)."""
        seen = {}
        for key, row in self.rows.items():
            for p in row:
                assert p not in seen, f"page {p} in rows {seen.get(p)!r} and {key!r}"
                seen[p] = key
                assert self.pool.page_tier[p] != 0, f"row {key!r} holds free page {p}"
                assert self.pool.page_count[p] > 0, f"row {key!r} holds empty page {p}"
            for t in range(1, self.top + 1):
                mine = [p for p in row if self.pool.page_tier[p] == t]
                n = int(self.pool.page_count[mine].sum()) if mine else 0
                per = self.pool.layout[t].states_per_page
                assert len(mine) == -(-n // per), f"row {key!r} tier {t}: {len(mine)} pages for {n} states"
            pos = self.states(key).pos
            assert np.unique(pos).size == pos.size, f"row {key!r} holds a position twice"
        free = set(self.pool._free)
        assert len(free) == len(self.pool._free), "a page is on the free list twice"
        assert not (free & set(seen)), "a page is both free and in a row"
        assert len(free) + len(seen) == self.pool.num_pages, "page leak"
        assert np.all(self.pool.page_tier[list(free)] == 0) if free else True
