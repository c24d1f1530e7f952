"""CPU paged decode (numba) that walks page headers and pages the way the CUDA kernel does.

Implements the paged decode of docs/paged.md on the host, for testing the algorithm and as the
CPU fast path of ``SphericalKVCache.decode``. Work decomposition, mirroring the kernel:

    one work item per (row, split); a row is one (sequence, kv-head) of one layer and its
    G query heads (the GQA group: one KV read serves all of them); split s walks the pages
    indptr[row] + s·pages_per_split … of the row's CSR list.
    For each page: read the header (page_tier, page_count), look up the tier's layout; form
    the logits of the page's valid slots from the key codes and scales (a tile of P × G),
    update the split's online softmax once per page (running max m, sum l, rescale of the
    accumulator), then accumulate e^{z−m}·s^V·ĉ^V in rotated value coordinates. Then merge the splits of a row (m = max m_s, l = Σ l_s·e^{m_s−m},
    acc = Σ acc_s·e^{m_s−m}) and normalise.

Π_K q (once per query head) and Π_Vᵀ acc + μ_V (once per query head) are applied outside,
in float64 NumPy, as the kernel does in its prologue/epilogue. No dense key or value
matrix is formed. All arithmetic is float64, so the result equals the flat reference
(``ada.mixed_tier_attention``, ``ada.attention``) to rounding.
"""
from __future__ import annotations

import numba
import numpy as np

from . import codebooks
from .paged import PagedKV, PageTable

__all__ = ["PagedDecodeTables", "decode_pool", "paged_decode", "NUM_SPLITS"]

#: page splits per row when the caller names none (split-K; the result moves only by rounding)
NUM_SPLITS = 4

#: fp16 bit pattern → float64, the kernel's half-to-float conversion as a table.
_HALF = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float64)


class PagedDecodeTables:
    """Per-pool constants the kernel receives: the pool's ``paged.page_layout`` as arrays
    indexed by tier 0..T (offsets in words and halves), and codebook levels C_b/√d per bit
    width (rows indexed by bits, 256 columns)."""

    def __init__(self, paged: PagedKV, codebook: str = "lloyd-max"):
        self._build(paged.pool.layout, paged.dim, codebook)

    @classmethod
    def for_layout(cls, layout, dim: int, codebook: str = "lloyd-max") -> "PagedDecodeTables":
        """The tables of a pool that is not a ``PagedKV`` (an engine's block pool): layout is
        ``paged.page_layout(ladder, dim, page_bytes)``."""
        self = cls.__new__(cls)
        self._build(layout, int(dim), codebook)
        return self

    def _build(self, lay, d: int, codebook: str) -> None:
        self.dim = d
        t = len(lay)
        self.key_bits = np.zeros(t, np.int64)
        self.value_bits = np.zeros(t, np.int64)
        self.per_page = np.zeros(t, np.int64)
        self.key_words = np.zeros(t, np.int64)
        self.value_words = np.zeros(t, np.int64)
        self.value_codes_off = np.zeros(t, np.int64)     # in uint32 words
        self.key_scales_off = np.full(t, -1, np.int64)   # in uint16 halves
        self.value_scales_off = np.full(t, -1, np.int64)
        for i in range(1, t):
            x = lay[i]
            self.key_bits[i], self.value_bits[i] = x.key_bits, x.value_bits
            self.per_page[i] = x.states_per_page
            self.key_words[i], self.value_words[i] = x.key_words, x.value_words
            self.value_codes_off[i] = x.value_codes_offset // 4
            if x.key_scales_offset >= 0:
                self.key_scales_off[i] = x.key_scales_offset // 2
            if x.value_scales_offset >= 0:
                self.value_scales_off[i] = x.value_scales_offset // 2
        self.levels = np.zeros((17, 256), np.float64)
        for b in {int(v) for v in np.concatenate([self.key_bits[1:], self.value_bits[1:]])}:
            if b != 16:
                lv = codebooks.codebook(b, d, codebook)
                self.levels[b, :lv.size] = lv / np.sqrt(d)


@numba.njit(cache=True)
def _unpack(words, base, bits, d, levels, half, out):
    """The rotated point of one packed vector starting at words[base] into out (d,):
    C_b[c_j]/√d per coordinate, or the fp16 values at 16 bits (docs/format.md "Packing")."""
    if bits == 16:
        for i in range((d + 1) // 2):
            w = np.int64(words[base + i])
            out[2 * i] = half[w & 0xFFFF]
            if 2 * i + 1 < d:
                out[2 * i + 1] = half[w >> 16]
    elif bits == 3:
        w2 = (2 * d + 31) // 32
        for j in range(d):
            lo = (np.int64(words[base + (j >> 4)]) >> (2 * (j & 15))) & 3
            hi = (np.int64(words[base + w2 + (j >> 5)]) >> (j & 31)) & 1
            out[j] = levels[3, lo | (hi << 2)]
    else:
        per_word = 32 // bits
        mask = (1 << bits) - 1
        j = 0
        i = 0
        while j < d:
            w = np.int64(words[base + i])
            f = 0
            while f < per_word and j < d:
                out[j] = levels[bits, (w >> (f * bits)) & mask]
                f += 1
                j += 1
            i += 1


@numba.njit(cache=True)
def _decode_rows(qr, qmu, scale, indptr, indices, pool32, pool16, page_tier, page_count,
                 key_bits, value_bits, key_words, value_words, value_codes_off,
                 key_scales_off, value_scales_off, levels, half, num_splits, max_per_page,
                 acc_out, lse_out):
    rows, g, d = qr.shape
    m_s = np.empty((num_splits, g))
    l_s = np.empty((num_splits, g))
    a_s = np.empty((num_splits, g, d))
    kvec = np.empty(d)
    vvec = np.empty(d)
    zbuf = np.empty((max_per_page, g))
    for r in range(rows):
        start, stop = indptr[r], indptr[r + 1]
        npages = stop - start
        per_split = (npages + num_splits - 1) // num_splits
        for s in range(num_splits):
            for h in range(g):
                m_s[s, h] = -np.inf
                l_s[s, h] = 0.0
                for j in range(d):
                    a_s[s, h, j] = 0.0
            lo = start + s * per_split
            hi = min(stop, lo + per_split)
            for pi in range(lo, hi):
                page = indices[pi]
                tier = page_tier[page]
                cnt = page_count[page]
                kb, vb = key_bits[tier], value_bits[tier]
                kw, vw = key_words[tier], value_words[tier]
                voff = value_codes_off[tier]
                kso, vso = key_scales_off[tier], value_scales_off[tier]
                words = pool32[page]
                halves = pool16[page]
                # pass 1 over the page: logits of every slot for every head of the group
                # (one read of a state's codes serves all G heads), and the page's max
                for slot in range(cnt):
                    ks = half[np.int64(halves[kso + slot])] if kso >= 0 else 1.0
                    _unpack(words, slot * kw, kb, d, levels, half, kvec)
                    for h in range(g):
                        dot = 0.0
                        for j in range(d):
                            dot += qr[r, h, j] * kvec[j]
                        zbuf[slot, h] = scale * (ks * dot + qmu[r, h])
                # online softmax, rescaled once per page
                for h in range(g):
                    m_new = m_s[s, h]
                    for slot in range(cnt):
                        m_new = max(m_new, zbuf[slot, h])
                    corr = np.exp(m_s[s, h] - m_new)    # 0 on the split's first page (-inf)
                    m_s[s, h] = m_new
                    l_s[s, h] *= corr
                    for j in range(d):
                        a_s[s, h, j] *= corr
                # pass 2: accumulate s^V·ĉ^V weighted by e^{z − m} in rotated value coordinates
                for slot in range(cnt):
                    vs = half[np.int64(halves[vso + slot])] if vso >= 0 else 1.0
                    _unpack(words, voff + slot * vw, vb, d, levels, half, vvec)
                    for h in range(g):
                        p = np.exp(zbuf[slot, h] - m_s[s, h])
                        l_s[s, h] += p
                        w = p * vs
                        for j in range(d):
                            a_s[s, h, j] += w * vvec[j]
        # merge the splits of this row
        for h in range(g):
            m = -np.inf
            for s in range(num_splits):
                m = max(m, m_s[s, h])
            l_tot = 0.0
            for j in range(d):
                acc_out[r, h, j] = 0.0
            for s in range(num_splits):
                if l_s[s, h] == 0.0:
                    continue
                f = np.exp(m_s[s, h] - m)
                l_tot += l_s[s, h] * f
                for j in range(d):
                    acc_out[r, h, j] += a_s[s, h, j] * f
            for j in range(d):
                acc_out[r, h, j] /= l_tot
            lse_out[r, h] = m + np.log(l_tot)


def paged_decode(paged: PagedKV, table: PageTable, q_rot, q_mu, tables: PagedDecodeTables,
                 softmax_scale: float, num_splits: int | None = None):
    """Attention accumulators for rows of a CSR page table.

    q_rot: (rows, G, d) float64, Π_K q of the G query heads of each row (each row's own key
    rotation). q_mu: (rows, G) float64, q·μ_K (0 without centring; it only shifts the
    logits, kept so the log-sum-exp matches the reference). Returns (acc, lse): acc
    (rows, G, d) = Σ_i p_i·s^V_i·ĉ^V_i in rotated value coordinates (apply Π_Vᵀ and add μ_V),
    lse (rows, G) the log-sum-exp of the scaled logits. Every row must hold a state."""
    pool = paged.pool
    return decode_pool(pool.data, pool.page_tier, pool.page_count, table.indptr, table.indices,
                       q_rot, q_mu, tables, softmax_scale, num_splits)


def decode_pool(data, page_tier, page_count, indptr, indices, q_rot, q_mu,
                tables: PagedDecodeTables, softmax_scale: float, num_splits: int | None = None):
    """``paged_decode`` over a pool given as arrays: data uint8 (num_pages, page_bytes)
    C-contiguous, page_tier and page_count int32 (num_pages,), indptr and indices the CSR
    page table (docs/format.md). The same result and errors; the pool is only read."""
    q_rot = np.ascontiguousarray(q_rot, np.float64)
    q_mu = np.ascontiguousarray(q_mu, np.float64)
    data = np.asarray(data)
    if data.dtype != np.uint8 or data.ndim != 2 or not data.flags.c_contiguous \
            or data.shape[1] % 4:
        raise ValueError(f"data must be C-contiguous uint8 (num_pages, page_bytes), got "
                         f"{data.dtype} {data.shape}")
    num_pages = data.shape[0]
    page_tier = np.ascontiguousarray(page_tier, np.int32)
    page_count = np.ascontiguousarray(page_count, np.int32)
    if page_tier.shape != (num_pages,) or page_count.shape != (num_pages,):
        raise ValueError(f"page_tier and page_count must have shape ({num_pages},)")
    rows = np.asarray(indptr).shape[0] - 1
    if q_rot.ndim != 3 or q_rot.shape[0] != rows or q_rot.shape[2] != tables.dim:
        raise ValueError(f"q_rot must be (rows={rows}, G, d={tables.dim}), got {q_rot.shape}")
    if q_mu.shape != q_rot.shape[:2]:
        raise ValueError(f"q_mu must be {q_rot.shape[:2]}, got {q_mu.shape}")
    num_splits = NUM_SPLITS if num_splits is None else num_splits
    if int(num_splits) != num_splits or num_splits < 1:
        raise ValueError(f"num_splits must be a positive integer, got {num_splits!r}")
    idx = np.asarray(indices)
    if idx.size and (idx.min() < 0 or idx.max() >= num_pages):
        bad = idx[(idx < 0) | (idx >= num_pages)][0]
        raise ValueError(f"page table holds page id {int(bad)}, outside 0..{num_pages - 1}")
    if idx.size and np.any(page_tier[idx] == 0):
        bad = idx[page_tier[idx] == 0][0]
        raise ValueError(f"page table refers to free page {int(bad)}")
    indptr = np.asarray(indptr)
    if indptr[0] != 0 or np.any(np.diff(indptr) < 0) or indptr[-1] != idx.size:
        raise ValueError("page table indptr must start at 0, be non-decreasing and end at len(indices)")
    cum = np.concatenate([[0], np.cumsum(page_count[idx], dtype=np.int64)])
    empty = cum[indptr[1:]] == cum[indptr[:-1]]
    if np.any(empty):
        raise ValueError(f"row {int(np.flatnonzero(empty)[0])} of the page table holds no kept "
                         f"state; attention over zero states is undefined")
    acc = np.empty(q_rot.shape)
    lse = np.empty(q_rot.shape[:2])
    _decode_rows(q_rot, q_mu, float(softmax_scale), indptr.astype(np.int64), idx.astype(np.int64),
                 data.view(np.uint32), data.view(np.uint16), page_tier,
                 page_count, tables.key_bits, tables.value_bits, tables.key_words,
                 tables.value_words, tables.value_codes_off, tables.key_scales_off,
                 tables.value_scales_off, tables.levels, _HALF, int(num_splits),
                 int(tables.per_page.max()), acc, lse)
    return acc, lse
