"""The device cache: ``spherical_kv_ref.SphericalKVCache``'s GPU twin (docs/design.md §8).

The pool (uint8 pages), each page's tier and count, the rows' centring means and the
rotation signs live on the GPU as torch tensors; the kernels view them through DLPack and
launch on torch's current stream. The host keeps only bookkeeping it can compute without
reading the device: each row's (sequence, layer, kv-head) page list, the pages' tiers and
counts, and its states' token positions. Nothing of the pool is ever copied back or
re-uploaded.

Operations, as the reference's (same names, arguments and errors where they share them):

* ``append(seq, layer, k, v)``: a chunk of one sequence (k, v (num_kv_heads, t, d)) encoded
  by ``encode_kv_into_pages`` straight into the row's open page and fresh pages, at the top
  tier; the first chunk of a layer fixes its means.
* ``decode(seqs, layer, q)``: one step of attention for a batch of sequences (q (batch,
  num_q_heads, d)) through ``ada_decode``; with ``lse=True`` also the log-sum-exps, to
  merge with a chunk's own part.
* ``compress(seq, budget_bytes)``: per-state statistics on the GPU (float64, from the stored
  codes and the observed queries), RDR on the host (``spherical_kv_ref.cache.plan_compress``,
  the reference's own decision: only per-state figures cross), then ``retier`` in place and
  the page tables updated. Rewritten rows hold their tiers in ascending order, the top
  tier's pages last, so a row's last page is the only one appends write to.
* ``decode_step(seqs, steps)``: a ``DecodeStep`` for the next ``steps`` tokens of a batch:
  page capacity reserved and every token's (page, slot) planned on the host, the page
  tables uploaded once; its ``append``/``decode``/``attend`` are the custom ops of
  ``torch_ops`` on preallocated buffers, with no host sync and no allocation by the kernels,
  so a model's decode step over them is captured in one CUDA graph. Its ``close`` commits
  the tokens written to the host bookkeeping and returns the unused reserved pages.
* ``free(seq)``, ``bytes_in_use``, ``num_states``, ``protect``, ``observe``.

Errors are ValueError naming the argument (``PoolExhaustedError``, one, when the pool cannot
hold an append, a reservation or a compress), raised before anything changes.

Bytes. ``bytes_in_use(seq)`` counts pages × page_bytes (as the reference);
``metadata_bytes(seq)`` adds what the device holds beside the pages for it: the means
(2 · 4 · d bytes per row), each page's tier and count (8 bytes), its page-table entry
(4 bytes) and, for the states a compress kept, their token positions (4 bytes each), so
``bytes_in_use + metadata_bytes`` is every byte the sequence costs.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Dict, List, Optional, Sequence

import numpy as np

from spherical_kv_ref import codebooks
from spherical_kv_ref.cache import (CompressPolicy, CompressReport, RowForCompress,
                                    SphericalKVCache, compress_method, plan_compress,
                                    set_cache_settings)
from spherical_kv_ref.codec import SphericalCodec, whole
from spherical_kv_ref.paged import PoolExhaustedError
from spherical_kv_ref.rdr.surrogate import tier_error_constants
from spherical_kv_ref.rotation import KEY_SALT, VALUE_SALT
from spherical_kv_ref.tiers import TierLadder

from ._module import constants
from .ada_decode import ada_decode
from .encode import encode_kv_into_pages
from .kernel_tables import kernel_tables, rotation_signs
from .retier import retier

__all__ = ["DeviceKVCache", "PoolExhaustedError"]

#: bytes of device metadata per page (tier and count, int32 each) and per page-table entry
PAGE_META_BYTES = 8
INDEX_BYTES = 4
#: bytes of device metadata per state a compress kept (its token position, int32)
POSITION_BYTES = 4
# compress's statistics: a batch of rows joins the next layer's while its float64
# temporaries (keys and values, softmax weights and o·vᵀ: 16·n·(d + queries) bytes a row)
# stay under this (two layers of a 32K-token Llama-8B sequence); at least one layer's rows
# go together whatever their size
STATS_BATCH_BYTES = 3 << 30


def _torch():
    import torch
    return torch


def dense_slots(ids, per: int, n: int):
    """(page, slot) int32 (n,) of n states filling the pages ``ids`` in order, ``per`` a page."""
    ids = np.asarray(ids, np.int32)
    return np.repeat(ids, per)[:n], np.tile(np.arange(per, dtype=np.int32), ids.size)[:n]


def dense_counts(npages: int, per: int, n: int) -> np.ndarray:
    """The counts of ``npages`` pages that n states fill densely, ``per`` a page."""
    c = np.full(npages, per, np.int32)
    if npages:
        c[-1] = n - per * (npages - 1)
    return c


class _Row:
    """Host mirror of one (sequence, layer, kv-head) row: its pages in order with their
    tiers and counts; its states' positions in storage order (pages in order, slots in
    order) are ``kept`` followed by tail_from .. tail_to - 1 (appended since the row was last
    rewritten). ``kept`` is an int32 tensor on the cache's device (None until a compress
    rewrites the row): a compress makes and reads it there, so no per-state array crosses to
    the host. Only the last page takes appends."""
    __slots__ = ("pages", "tiers", "counts", "kept", "tail_from", "tail_to")

    def __init__(self):
        self.pages = np.zeros(0, np.int32)
        self.tiers = np.zeros(0, np.int32)
        self.counts = np.zeros(0, np.int32)
        self.kept = None
        self.tail_from = self.tail_to = 0

    def num_kept(self) -> int:
        return 0 if self.kept is None else int(self.kept.numel())

    def positions(self) -> np.ndarray:
        """Every state's token position, in storage order (int64, on the host)."""
        kept = np.zeros(0, np.int64) if self.kept is None else self.kept.cpu().numpy()
        return np.concatenate([kept.astype(np.int64),
                               np.arange(self.tail_from, self.tail_to, dtype=np.int64)])

    def num_states(self) -> int:
        return int(self.counts.sum())

    def room(self, top: int, per: int) -> int:
        """States the last page still takes: an open page of the top tier (per a page)."""
        if self.pages.size and self.tiers[-1] == top and self.counts[-1] < per:
            return per - int(self.counts[-1])
        return 0

    def tail_slots(self, fill: int, ids, per: int, n: int):
        """(page, slot) int32 of the next n top-tier states: ``fill`` of them into the open
        last page, the rest densely into the fresh pages ``ids``."""
        k = min(fill, n)
        c0 = int(self.counts[-1]) if k else 0
        pg, sl = dense_slots(ids, per, n - k)
        return (np.concatenate([np.full(k, self.pages[-1] if k else 0, np.int32), pg]),
                np.concatenate([np.arange(c0, c0 + k, dtype=np.int32), sl]))

    def grow(self, fill: int, ids, top: int, per: int, n: int):
        """Commits n new top-tier states laid out as ``tail_slots`` lays them. Returns (the
        pages written, their counts now, the fresh pages left unused)."""
        k = min(fill, n)
        if k:
            self.counts[-1] += k
        used = -(-(n - k) // per)
        self.pages = np.concatenate([self.pages, ids[:used]])
        self.tiers = np.concatenate([self.tiers, np.full(used, top, np.int32)])
        self.counts = np.concatenate([self.counts, dense_counts(used, per, n - k)])
        self.tail_to += n
        m = used + (1 if k else 0)
        return self.pages[self.pages.size - m:], self.counts[self.counts.size - m:], ids[used:]

    def state_slots(self):
        """(page, slot, tier) of every state, in storage order."""
        c = self.counts.astype(np.int64)
        page = np.repeat(self.pages, c)
        start = np.repeat(np.cumsum(c) - c, c)
        slot = np.arange(int(c.sum()), dtype=np.int64) - start
        return page, slot.astype(np.int32), np.repeat(self.tiers, c)


class _Seq:
    def __init__(self, num_layers, num_kv_heads, dim, torch, device):
        self.rows = [[_Row() for _ in range(num_kv_heads)] for _ in range(num_layers)]
        self.length = np.zeros(num_layers, np.int64)
        self.mean_k = torch.zeros((num_layers, num_kv_heads, dim), dtype=torch.float32, device=device)
        self.mean_v = torch.zeros_like(self.mean_k)
        self.has_mean = np.zeros(num_layers, bool)
        self.spans: List[tuple] = []
        self.queries: List[Optional[object]] = [None] * num_layers
        self.step = None              # the open decode plan (decode_step.DecodeStep), if any


class DeviceKVCache:
    """The compressed KV cache of one model on one GPU (module docstring).

    Arguments as ``SphericalKVCache``'s (num_layers, num_kv_heads, head_dim, ladder,
    page_bytes, pool_bytes (default 64 MiB), seed, num_q_heads, centre, policy,
    softmax_scale, codebook); device: the torch CUDA device (default the current one).
    Head dims 64, 128 and 256 (the kernels'). ``policy.horizon`` is not supported here."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int,
                 ladder: Optional[TierLadder] = None, page_bytes: int = 4096,
                 pool_bytes: Optional[int] = None, seed: int = 0, *,
                 num_q_heads: Optional[int] = None, centre: bool = True,
                 policy: Optional[CompressPolicy] = None, softmax_scale: Optional[float] = None,
                 codebook: str = "uniform", device=None):
        torch = _torch()
        page_bytes, pool_bytes = set_cache_settings(
            self, num_layers, num_kv_heads, head_dim, ladder, page_bytes, pool_bytes, seed,
            num_q_heads, centre, policy, softmax_scale)
        if self.policy.horizon:
            raise ValueError("policy.horizon is not supported by the device cache")
        if self.policy.every is not None:
            raise ValueError("policy.every is not supported by the device cache: call compress")
        self.codebook = codebook
        self.tables = kernel_tables(self.ladder, self.head_dim, page_bytes, codebook=codebook)
        self.device = torch.device("cuda") if device is None else torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"device must be a CUDA device, got {self.device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        n = pool_bytes // page_bytes
        self.pages = torch.zeros((n, page_bytes), dtype=torch.uint8, device=self.device)
        self.page_tier = torch.zeros(n, dtype=torch.int32, device=self.device)
        self.page_count = torch.zeros(n, dtype=torch.int32, device=self.device)
        self._free = np.arange(n - 1, -1, -1, dtype=np.int32)    # a stack: lowest ids first
        self._num_free = n
        self._codecs: Dict[tuple, SphericalCodec] = {}
        self._signs: Dict[int, tuple] = {}
        self._rot: Dict[tuple, object] = {}
        self._seqs: Dict[int, _Seq] = {}
        self._freed = set()
        self._next_seq = 0
        self.compress_seconds: Dict[str, float] = {}
        # RDR's per-tier error constants: a seeded Monte Carlo on the host (~2.4 s once per
        # process and (ladder, head dim, codebook), then cached), made here at start-up
        # rather than inside the first compress, where it was 2.4 of a 32K-token batch's 4.8 s
        self._tier_errors()
        top = self.ladder.top
        self.top_per_page = self.ladder.states_per_page(top, self.head_dim, page_bytes)

    # ------------------------------------------------------------------ helpers
    @property
    def page_bytes(self) -> int:
        return self.tables.page_bytes

    @property
    def num_pages(self) -> int:
        return int(self.pages.shape[0])

    @property
    def num_free_pages(self) -> int:
        return self._num_free

    def _tier_errors(self):
        """(eK, eV) of the ladder's tiers (``rdr.tier_error_constants``, cached per process)."""
        return tier_error_constants(self.ladder.tiers, self.head_dim, kind=self.codebook)

    def codec(self, layer: int, head: int, bits: int, salt: int) -> SphericalCodec:
        """The reference's codec of (layer, kv-head, bits, salt): the same rotations."""
        k = (layer, head, bits, salt)
        if k not in self._codecs:
            self._codecs[k] = SphericalCodec(self.head_dim, bits, self.seed, layer=layer,
                                             head=head, salt=salt, codebook=self.codebook)
        return self._codecs[k]

    def signs(self, layer: int):
        """(sigma_k, sigma_v) float32 (num_kv_heads, d) on the device."""
        hit = self._signs.get(layer)
        if hit is None:
            torch = _torch()
            kb, vb = self.ladder.bits(self.ladder.top)
            hit = tuple(torch.as_tensor(rotation_signs([self.codec(layer, h, b, salt)
                                                        for h in range(self.num_kv_heads)]),
                                        device=self.device)
                        for b, salt in ((kb, KEY_SALT), (vb, VALUE_SALT)))
            self._signs[layer] = hit
        return hit

    # the ids and their errors are the reference's (sequences by id, freed ids refused)
    _seq = SphericalKVCache._seq
    _layer = SphericalKVCache._layer

    def _open(self, s: _Seq, what: str) -> None:
        if s.step is not None:
            raise ValueError(f"{what}: the sequence is in an open DecodeStep; close it first")

    def _tensor(self, x, name: str, shape: tuple):
        torch = _torch()
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch tensor on {self.device}, got {type(x).__name__}")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating tensor, got {x.dtype}")
        if x.device != self.device:
            raise ValueError(f"{name} is on {x.device}; the cache is on {self.device}")
        if x.ndim != len(shape) or any(w is not None and a != w for a, w in zip(x.shape, shape)):
            want = ", ".join("t" if w is None else str(w) for w in shape)
            raise ValueError(f"{name} must have shape ({want}), got {tuple(x.shape)}")
        return x

    def _allocate(self, n: int) -> np.ndarray:
        ids = self._free[self._num_free - n:self._num_free][::-1].copy()
        self._num_free -= n
        return ids

    def _release(self, ids: np.ndarray) -> None:
        if ids.size == 0:
            return
        dev = self._upload(ids, np.int64)
        # index_fill_, not ``[dev] = 0``: the assignment sends its 0 up as a tensor, a
        # pageable copy that waits for the stream
        self.page_tier.index_fill_(0, dev, 0)
        self.page_count.index_fill_(0, dev, 0)
        self._free[self._num_free:self._num_free + ids.size] = ids[::-1]
        self._num_free += ids.size

    def _set_pages(self, ids: np.ndarray, tier: np.ndarray, count: np.ndarray) -> None:
        torch = _torch()
        if ids.size == 0:
            return
        # one upload of the three (each pageable copy would wait for the stream)
        up = self._upload(np.concatenate([ids, tier, count]).reshape(3, -1), np.int64)
        self.page_tier[up[0]] = up[1].to(torch.int32)
        self.page_count[up[0]] = up[2].to(torch.int32)

    # ------------------------------------------------------------------ lifecycle
    def sequences(self) -> List[int]:
        return sorted(self._seqs)

    def new_sequence(self) -> int:
        """Open a sequence; returns its id (0, 1, 2, … in order of creation)."""
        sid = self._next_seq
        self._next_seq += 1
        self._seqs[sid] = _Seq(self.num_layers, self.num_kv_heads, self.head_dim, _torch(), self.device)
        return sid

    def free(self, seq) -> None:
        """Return every page of a sequence to the pool; the id cannot be used again."""
        s = self._seq(seq)
        self._open(s, "free")
        for rows in s.rows:
            for row in rows:
                self._release(row.pages)
        del self._seqs[int(seq)]
        self._freed.add(int(seq))

    # ------------------------------------------------------------------ append / protect
    def _tail_plan(self, row: _Row, t: int):
        """(fill, new) for t new top-tier states of a row: how many go into its open last
        page, how many fresh pages the rest need."""
        P = self.top_per_page
        fill = min(row.room(self.ladder.top, P), t)
        return fill, -(-(t - fill) // P)

    def append(self, seq, layer, k, v) -> None:
        """Append t new tokens of one layer: k, v (num_kv_heads, t, head_dim) float CUDA
        tensors, post-RoPE, at positions length..length+t−1 at the top tier. The first
        chunk of a layer fixes its means μ_K, μ_V (per kv-head, over the chunk)."""
        torch = _torch()
        s = self._seq(seq)
        self._open(s, "append")
        layer = self._layer(layer)
        H, d, T, P = self.num_kv_heads, self.head_dim, self.ladder.top, self.top_per_page
        k = self._tensor(k, "k", (H, None, d))
        v = self._tensor(v, "v", (H, None, d))
        if k.shape != v.shape:
            raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
        t = int(k.shape[1])
        if t == 0:
            return
        bad = torch.stack([~torch.isfinite(k).all(), ~torch.isfinite(v).all()]).cpu().numpy()
        for flag, name in zip(bad, ("k", "v")):
            if flag:
                raise ValueError(f"{name} contains NaN or Inf")
        rows = s.rows[layer]
        plans = [self._tail_plan(row, t) for row in rows]
        need = sum(new for _, new in plans)
        if need > self._num_free:
            raise PoolExhaustedError(f"page pool exhausted: appending {t} token(s) to layer {layer} "
                                     f"needs {need} free pages, {self._num_free} of "
                                     f"{self.num_pages} are free")
        k32 = k.detach().to(torch.float32)
        v32 = v.detach().to(torch.float32)
        first = self.centre and not s.has_mean[layer]
        if first:
            mk = k.detach().to(torch.float64).mean(dim=1).to(torch.float32)
            mv = v.detach().to(torch.float64).mean(dim=1).to(torch.float32)
        else:
            mk, mv = s.mean_k[layer], s.mean_v[layer]
        pages_new = self._allocate(need)
        opened, slots, a = [], [], 0
        for row, (fill, new) in zip(rows, plans):
            opened.append(pages_new[a:a + new])
            a += new
            slots.append(row.tail_slots(fill, opened[-1], P, t))
        dp = np.concatenate([x[0] for x in slots])
        ds = np.concatenate([x[1] for x in slots])
        self._set_pages(pages_new, np.full(need, T), np.zeros(need))
        head = np.repeat(np.arange(H, dtype=np.int32), t)
        dev = lambda x: torch.as_tensor(x, device=self.device)
        sk, sv = self.signs(layer)
        means = dict(mean_k=mk, mean_v=mv, mean_index=dev(head)) if self.centre else {}
        try:
            with _stream():
                encode_kv_into_pages(k32.reshape(H * t, d), v32.reshape(H * t, d), self.pages,
                                     self.page_tier, self.tables, sk, sv, dev(head), dev(dp),
                                     dev(ds), **means)
        except ValueError:
            self._release(pages_new)
            raise
        # bookkeeping: the rows, the counts of every page written, means, length
        written, counts = [], []
        for row, (fill, _), ids in zip(rows, plans, opened):
            if row.tail_to != s.length[layer]:
                raise AssertionError("row positions out of step with the layer's length")
            pg, cnt, _ = row.grow(fill, ids, T, P, t)
            written.append(pg)
            counts.append(cnt)
        written = np.concatenate(written)
        self._set_pages(written, np.full(written.size, T), np.concatenate(counts))
        if first:
            s.mean_k[layer], s.mean_v[layer], s.has_mean[layer] = mk, mv, True
        s.length[layer] += t

    # protection is the reference's: spans of token positions, sinks and the recent window
    protect = SphericalKVCache.protect
    protected_mask = SphericalKVCache.protected_mask

    def observe(self, seq, layer, q) -> None:
        """Record queries (num_q_heads, d) or (m, num_q_heads, d) of one layer for RDR's
        attention estimates; the last ``policy.window`` are kept (float64, on the device)."""
        torch = _torch()
        s = self._seq(seq)
        layer = self._layer(layer)
        q = self._tensor(q, "q", (q.shape[0], self.num_q_heads, self.head_dim) if getattr(q, "ndim", 0) == 3
                         else (self.num_q_heads, self.head_dim))
        q = q.detach().to(torch.float64).reshape(-1, self.num_q_heads, self.head_dim)
        if not bool(torch.isfinite(q).all()):
            raise ValueError("q contains NaN or Inf")
        old = s.queries[layer]
        both = q if old is None else torch.cat([old, q])
        s.queries[layer] = both[-max(self.policy.window, 1):].clone()

    # ------------------------------------------------------------------ bytes
    # the budget conventions are the reference's: a fraction is of the bf16 bytes
    bf16_bytes = SphericalKVCache.bf16_bytes
    _budget = SphericalKVCache._budget

    def bytes_in_use(self, seq=None) -> int:
        """Bytes the pool holds for a sequence (all sequences if None): pages × page_bytes."""
        if seq is None:
            return (self.num_pages - self._num_free) * self.page_bytes
        s = self._seq(seq)
        return sum(row.pages.size for rows in s.rows for row in rows) * self.page_bytes

    def metadata_bytes(self, seq) -> int:
        """Device bytes beside the pages: means, page tiers and counts, page-table entries,
        and the token positions of the states a compress kept (4 bytes each)."""
        s = self._seq(seq)
        pages = sum(row.pages.size for rows in s.rows for row in rows)
        kept = sum(row.num_kept() for rows in s.rows for row in rows)
        rows = self.num_layers * self.num_kv_heads
        return (rows * 2 * 4 * self.head_dim + pages * (PAGE_META_BYTES + INDEX_BYTES)
                + 4 * (rows + 1) + POSITION_BYTES * kept)

    def num_states(self, seq, layer=None) -> int:
        s = self._seq(seq)
        layers = range(self.num_layers) if layer is None else [self._layer(layer)]
        return sum(row.num_states() for l in layers for row in s.rows[l])

    def length(self, seq, layer: int = 0) -> int:
        return int(self._seq(seq).length[self._layer(layer)])

    # ------------------------------------------------------------------ decode
    def _table(self, seqs: Sequence[int], layer: int):
        """indptr, indices (int32 device tensors) and means of one layer over rows
        (sequence, kv-head) of ``seqs``."""
        torch = _torch()
        ss = [self._seq(x) for x in seqs]
        lists = [row.pages for s in ss for row in s.rows[layer]]
        indptr = np.zeros(len(lists) + 1, np.int64)
        indptr[1:] = np.cumsum([p.size for p in lists])
        indices = np.concatenate(lists) if lists else np.zeros(0, np.int32)
        mk = torch.cat([s.mean_k[layer] for s in ss])
        mv = torch.cat([s.mean_v[layer] for s in ss])
        dev = lambda x: torch.as_tensor(np.ascontiguousarray(x, np.int32), device=self.device)
        return dev(indptr), dev(indices), mk, mv

    def _seq_list(self, seqs) -> List[int]:
        if isinstance(seqs, (int, np.integer)) and not isinstance(seqs, (bool, np.bool_)):
            seqs = [seqs]
        if not isinstance(seqs, (list, tuple, range, np.ndarray)) or len(seqs) == 0:
            raise ValueError(f"seqs must be a sequence id or a non-empty list of them, got {seqs!r}")
        for x in seqs:
            self._seq(x)
        return [int(x) for x in seqs]

    def decode(self, seqs, layer, q, *, lse: bool = False):
        """Attention (batch, num_q_heads, d) float32 of one step of one layer for the
        sequences ``seqs`` (a list, one per row of q (batch, num_q_heads, d)) over what the
        cache holds, with the page tables checked (one host sync). With ``lse``: (out, lse
        (batch, num_q_heads), the natural log-sum-exp of the scaled logits). Records nothing."""
        torch = _torch()
        seqs = self._seq_list(seqs)
        layer = self._layer(layer)
        q = self._tensor(q, "q", (len(seqs), self.num_q_heads, self.head_dim))
        indptr, indices, mk, mv = self._table(seqs, layer)
        sk, sv = self.signs(layer)
        out = torch.empty((len(seqs), self.num_q_heads, self.head_dim), dtype=torch.float32,
                          device=self.device)
        l = (torch.empty((len(seqs), self.num_q_heads), dtype=torch.float32, device=self.device)
             if lse else None)
        with _stream():
            ada_decode(q.detach().to(torch.float32), self.pages, self.page_tier, self.page_count,
                       indptr, indices, self.tables, sk, sv, num_kv_heads=self.num_kv_heads,
                       mean_k=mk if self.centre else None, mean_v=mv if self.centre else None,
                       softmax_scale=self.softmax_scale, out=out, lse=l)
        return (out, l) if lse else out

    def decode_step(self, seqs, steps: int):
        """A captured-decode plan for the next ``steps`` tokens of every sequence of ``seqs``
        (``DecodeStep``). Every layer's length must be the same in each sequence."""
        from .decode_step import DecodeStep
        return DecodeStep(self, self._seq_list(seqs), whole("steps", steps, 1))

    # ------------------------------------------------------------------ compress
    def _rotations(self, layer: int):
        """Π of the keys of every kv-head of ``layer``, a float64 (H, d, d) device tensor
        (made once)."""
        hit = self._rot.get(("rotations", layer))
        if hit is None:
            hit = _torch().as_tensor(
                np.stack([self.codec(layer, h, 16, KEY_SALT).rotation.dense()
                          for h in range(self.num_kv_heads)]), device=self.device)
            self._rot[("rotations", layer)] = hit
        return hit

    def stored_rotated(self, page, slot, tier: int):
        """(keys, values) (n, d) float64 device tensors: ŷ = s·ĉ, the rotated, centred
        vectors the states at (page, slot) (int arrays or device tensors, all of tier ``tier``) stand for
        (``paged.stored_rotated``), decoded from the pool on the device."""
        torch = _torch()
        g = self.tables.geom[tier]
        kb, vb, _, kw, vw, voff, ksoff, vsoff = (int(x) for x in g)
        words = self.pages.view(torch.int32)
        halves = self.pages.view(torch.float16)
        pg = torch.as_tensor(page, device=self.device).long()[:, None]
        sl = torch.as_tensor(slot, device=self.device).long()[:, None]
        out = []
        for bits, nw, off, soff in ((kb, kw, 0, ksoff), (vb, vw, voff, vsoff)):
            w = words[pg, off + sl * nw + torch.arange(nw, device=self.device)[None, :]]
            out.append(_points(w, bits, self.head_dim, None if bits == 16 else self._levels(bits),
                               halves, pg, sl, soff))
        return out[0], out[1]

    def _levels(self, bits: int):
        """The codebook's levels at ``bits`` as a float64 device tensor (made once)."""
        hit = self._rot.get(("levels", bits))
        if hit is None:
            hit = _torch().as_tensor(codebooks.codebook(bits, self.head_dim, self.codebook),
                                     device=self.device)
            self._rot[("levels", bits)] = hit
        return hit

    def _stored_rows(self, page, slot, tier):
        """(keys, values) (n, d) float64 device tensors of states of any tiers, in order
        (page, slot, tier int64 device tensors (n,)): ``stored_rotated``'s values, from one
        kernel (``rdr_device.stored_states``) on CUDA; elsewhere (the host tests) by tier."""
        from . import rdr_device
        torch = _torch()
        if page.device.type != "cuda":
            yk = torch.empty((page.numel(), self.head_dim), dtype=torch.float64)
            yv = torch.empty_like(yk)
            for t in torch.unique(tier).tolist():
                idx = torch.nonzero(tier == t).squeeze(1)
                yk[idx], yv[idx] = self.stored_rotated(page[idx], slot[idx], int(t))
            return yk, yv
        tables = self._rot.get("stored")
        if tables is None:
            levels = np.zeros((self.ladder.top + 1, 2, constants()["RDR_LEVELS"]))
            for t in range(1, self.ladder.top + 1):
                for part, bits in enumerate(self.ladder.bits(t)):
                    if bits != 16:
                        levels[t, part, :1 << bits] = codebooks.codebook(bits, self.head_dim,
                                                                         self.codebook)
            tables = (torch.as_tensor(self.tables.geom, device=self.device).contiguous(),
                      torch.as_tensor(levels, device=self.device))
            self._rot["stored"] = tables
        return rdr_device.stored_states(self.pages, page, slot, tier, *tables, self.head_dim)

    def _rotated_queries(self, s: _Seq, layer: int, heads):
        """The layer's recorded queries of the GQA groups of ``heads``, each in its kv-head's
        rotated frame: (len(heads), m·G, d), or None without queries."""
        torch = _torch()
        q = s.queries[layer]
        if q is None:
            return None
        G, d = self.group_size, self.head_dim
        heads = list(heads)
        # a run of consecutive heads (the usual case) is a slice: a list index would go to
        # the device as a pageable copy, which waits for the stream
        h0 = heads[0]
        at = slice(h0, h0 + len(heads)) if heads == list(range(h0, h0 + len(heads))) else heads
        mine = q.view(q.shape[0], self.num_kv_heads, G, d).transpose(0, 1)[at]   # (h, m, G, d)
        return torch.bmm(mine.reshape(len(heads), -1, d),
                         self._rotations(layer)[at].transpose(1, 2))

    def _state_index(self, s: _Seq) -> "_States":
        """Every state of a sequence on the device (``_States``), built from the host's page
        lists: O(pages) on the host, O(states) only on the device."""
        torch = _torch()
        rows = [row for layer in s.rows for row in layer]
        R = len(rows)
        cat = lambda f, dt: (np.concatenate([f(r) for r in rows]).astype(dt) if R else np.zeros(0, dt))
        counts = cat(lambda r: r.counts, np.int64)
        n_row = np.array([int(r.counts.sum()) for r in rows], np.int64)
        off = np.concatenate([[0], np.cumsum(n_row)])
        N = int(off[-1])
        nk = np.array([r.num_kept() for r in rows], np.int64)
        # the page lists go up in one copy (a pageable copy makes the host wait for the
        # stream), and every repeat is told its length (else it reads it back)
        parts = dict(counts=counts, pages=cat(lambda r: r.pages, np.int64),
                     tiers=cat(lambda r: r.tiers, np.int64), n_row=n_row, first=off[:-1],
                     tail=np.array([r.tail_from for r in rows], np.int64) - nk, nk=nk,
                     koff=np.cumsum(nk) - nk, length=s.length.astype(np.int64))
        blob = self._upload(np.concatenate(list(parts.values())))
        at = np.cumsum([0] + [v.size for v in parts.values()])
        g = {k: blob[a:b] for k, a, b in zip(parts, at[:-1], at[1:])}
        c = g["counts"]
        page = torch.repeat_interleave(g["pages"], c, output_size=N)
        slot = torch.arange(N, device=self.device) - torch.repeat_interleave(
            torch.cumsum(c, 0) - c, c, output_size=N)
        tier = torch.repeat_interleave(g["tiers"], c, output_size=N)
        row = torch.repeat_interleave(torch.arange(R, device=self.device), g["n_row"],
                                      output_size=N)
        idx = torch.arange(N, device=self.device) - g["first"][row]
        tail = g["tail"][row] + idx
        if nk.any():    # the kept positions are on the device already (_Row.kept)
            kept = torch.cat([r.kept for r in rows if r.kept is not None]).long()
            inside = idx < g["nk"][row]
            pos = torch.where(inside, kept[torch.where(inside, g["koff"][row] + idx, 0)], tail)
        else:
            pos = tail
        pol = self.policy
        length = g["length"][row // self.num_kv_heads]
        prot = (pos < pol.sinks) | (pos >= length - pol.recent)
        for a, b in s.spans:
            prot |= (pos >= a) & (pos < b)
        return _States(page, slot, tier, row, pos, prot, n_row, off)

    def _statistics(self, ss: List[_Seq], sts: List["_States"]):
        """RDR's per-state statistics of sequences on the device (``rdr_device``): the rows
        that hold as many states and queries in one batch (a layer's, of every sequence, and
        the next layers' alike while the batch stays small). Per
        sequence (p, r, vn, res, kappa (N,) and q2 per row (R,)), float64 device tensors in
        its states' order."""
        torch = _torch()
        from . import rdr_device
        H, d = self.num_kv_heads, self.head_dim
        sizes = [int(st.off[-1]) for st in sts]
        first = np.concatenate([[0], np.cumsum(sizes)])
        R = len(sts[0].n_row) if sts else 0
        out = {k: torch.empty(int(first[-1]), dtype=torch.float64, device=self.device)
               for k in ("p", "r", "vn", "res", "kappa")}
        q2 = torch.zeros(len(sts) * R, dtype=torch.float64, device=self.device)
        cat = lambda f: f(sts[0]) if len(sts) == 1 else torch.cat([f(st) for st in sts])
        page, slot, tier = cat(lambda st: st.page), cat(lambda st: st.slot), cat(lambda st: st.tier)
        prot = cat(lambda st: st.protected)
        # every batch planned on the host first: their rows' first states and row ids go to
        # the device in one copy (a copy per batch made the host wait each time). A batch is
        # the rows of one layer that hold as many states and queries, joined by the next
        # layers' alike while its float64 temporaries stay under STATS_BATCH_BYTES (fewer,
        # larger launches: the per-layer ops on a 32K-token sequence take a few us each)
        plan: List[tuple] = []                   # (n, m, members [(seq, layer, head)])
        for layer in range(self.num_layers):
            groups: Dict[tuple, list] = {}
            for i, (s, st) in enumerate(zip(ss, sts)):
                q = s.queries[layer]
                m = -1 if q is None else int(q.shape[0])
                for h in range(H):
                    n = int(st.n_row[layer * H + h])
                    if n:
                        groups.setdefault((n, m), []).append((i, layer, h))
            for (n, m), members in groups.items():
                rows = len(plan[-1][2]) + len(members) if plan else 0
                if (plan and plan[-1][:2] == (n, m)
                        and rows * n * 16 * (d + max(m, 0) * self.group_size) <= STATS_BATCH_BYTES):
                    plan[-1][2].extend(members)
                else:
                    plan.append((n, m, list(members)))
        starts = [int(first[i] + sts[i].off[layer * H + h]) for _, _, mem in plan
                  for i, layer, h in mem]
        row_ids = [i * R + layer * H + h for _, _, mem in plan for i, layer, h in mem]
        index = self._upload(np.array([starts, row_ids], np.int64).reshape(2, -1))
        at = 0
        for n, _, members in plan:
            B = len(members)
            a = starts[at]
            if starts[at:at + B] == list(range(a, a + B * n, n)):
                idx = slice(a, a + B * n)    # rows one after another (a sequence's heads): views
            else:
                idx = (index[0, at:at + B, None]
                       + torch.arange(n, device=self.device)[None, :]).reshape(-1)
            yk, yv = self._stored_rows(page[idx], slot[idx], tier[idx])
            # the heads of each (sequence, layer) of the batch rotated in one product
            runs = [(key, [h for _, _, h in grp]) for key, grp in
                    itertools.groupby(members, key=lambda ilh: ilh[:2])]
            qr = [self._rotated_queries(ss[i], layer, heads) for (i, layer), heads in runs]
            qr = None if qr[0] is None else torch.cat(qr)
            cand = (~prot[idx]).view(B, n) if self.policy.coherence else None
            res = rdr_device.row_statistics(yk.view(B, n, d), yv.view(B, n, d), qr,
                                            self.softmax_scale, self.policy.prior, cand)
            for k, v in zip(("p", "r", "vn", "res", "kappa"), (res[0],) + tuple(res[2:])):
                out[k][idx] = v.reshape(-1)
            q2[index[1, at:at + B]] = res[1]
            at += B
        return [({k: v[int(first[i]):int(first[i + 1])] for k, v in out.items()},
                 q2[i * R:(i + 1) * R]) for i in range(len(sts))]

    def compress(self, seq, budget_bytes: Optional[int] = None, method: Optional[str] = None, *,
                 budget_fraction: Optional[float] = None) -> CompressReport:
        """RDR over every layer and kv-head of a sequence, applied in place on the device
        (``SphericalKVCache.compress``: the same budget arguments, decision and errors).
        method "fast" / "milp" (default: the policy's): statistics on the device, the
        reference's solver on the host; "device": statistics, surrogate and an LP-greedy
        solver all on the device (``rdr_device``; its gap is reported in the allocation).
        Needs the new pages free before it releases the old ones (PoolExhaustedError,
        nothing changed, otherwise). ``compress_seconds`` sums the time of its parts."""
        return self.compress_all([seq], budget_bytes, method, budget_fraction=budget_fraction)[0]

    def compress_all(self, seqs, budget_bytes: Optional[int] = None,
                     method: Optional[str] = None, *,
                     budget_fraction: Optional[float] = None) -> List[CompressReport]:
        """``compress`` of several sequences, each to its own budget (``budget_bytes`` or
        ``budget_fraction`` of its own bf16 bytes); one report per sequence, in order.
        Every decision is made before any sequence changes, so a budget that cannot hold a
        sequence's protected states is a ValueError with nothing changed; with "device" one
        solve serves them all (``rdr_device.greedy_allocation`` over one problem per
        sequence, each solved as alone). The sequences are then rewritten in order; an
        exhausted pool stops at the sequence that does not fit (PoolExhaustedError), those
        before it compressed, it and those after unchanged."""
        import time
        seqs = self._seq_list(seqs)
        if len(set(seqs)) != len(seqs):
            raise ValueError(f"seqs names a sequence twice: {seqs}")
        ss = [self._seq(x) for x in seqs]
        for s in ss:
            self._open(s, "compress")
        budgets = [self._budget(x, budget_bytes, budget_fraction) for x in seqs]
        if method != "device":
            method = compress_method(self.policy, method)
        # the parts as named ranges, for torch's profiler (lab/profile_compress.py)
        part = lambda name: _torch().profiler.record_function(f"compress.{name}")
        t0 = time.perf_counter()
        with part("statistics"):
            befores = [self.bytes_in_use(x) for x in seqs]
            sts = [self._state_index(s) for s in ss]
            live = [i for i, st in enumerate(sts) if st.page.numel()]
            stats = dict(zip(live, self._statistics([ss[i] for i in live],
                                                    [sts[i] for i in live])))
            self._sync()
        t1 = time.perf_counter()
        with part("solve"):
            if method == "device":
                answers = dict(zip(live, self._solve_device([seqs[i] for i in live],
                                                            [sts[i] for i in live],
                                                            [stats[i] for i in live],
                                                            [budgets[i] for i in live])))
            else:
                answers = {i: self._solve_host(seqs[i], sts[i], *stats[i], budgets[i], method)
                           for i in live}
            self._sync()
        t2 = time.perf_counter()
        with part("apply"):
            reports = self._apply_all(seqs, ss, sts, budgets, befores, answers)
        took = dict(statistics=t1 - t0, solve=t2 - t1, apply=time.perf_counter() - t2)
        for k, v in took.items():     # summed over the calls, for the benchmarks
            self.compress_seconds[k] = self.compress_seconds.get(k, 0.0) + v
        return reports

    def _apply_all(self, seqs, ss, sts, budgets, befores, answers) -> List[CompressReport]:
        """compress_all's last part: each decided sequence rewritten in order, its report."""
        reports = []
        for i, (x, s, st, budget, before) in enumerate(zip(seqs, ss, sts, budgets, befores)):
            tier, alloc = answers.get(i, (None, None))
            if tier is None:
                reports.append(CompressReport(before, before, budget, 0, 0, 0, None))
                continue
            demoted = int(((tier > 0) & (tier < st.tier)).sum())
            self._apply(s, st, tier, budget)
            after = self.bytes_in_use(x)
            if alloc.bytes is None:
                alloc = dataclasses.replace(alloc, bytes=after)
            reports.append(CompressReport(before, after, budget, int(st.page.numel()),
                                          self.num_states(x), demoted, alloc))
        return reports

    def _upload(self, x, dtype=None):
        """A host array on the device without making the host wait (``rdr_device.upload``)."""
        from .rdr_device import upload
        return upload(x, self.device, dtype)

    def _sync(self) -> None:
        """Waits for the device's queued work (compress times its parts by the host clock)."""
        if self.device.type == "cuda":
            _torch().cuda.synchronize(self.device)

    def _solve_host(self, sid, st, stats, q2, budget, method):
        """The reference's decision (``plan_compress``) from the device's statistics, one
        copy to the host; the tiers back on the device (N,)."""
        torch = _torch()
        host = {k: v.cpu().numpy() for k, v in stats.items()}
        q2h, prot, tier = q2.cpu().numpy(), st.protected.cpu().numpy(), st.tier.cpu().numpy()
        rows = []
        for r in range(len(st.n_row)):
            a, b = int(st.off[r]), int(st.off[r + 1])
            key = (sid, r // self.num_kv_heads, r % self.num_kv_heads)
            if a == b:
                rows.append(RowForCompress(key, tier[a:b], None, None))
                continue
            row_stats = tuple(host[k][a:b] for k in ("p",)) + (float(q2h[r]),) + tuple(
                host[k][a:b] for k in ("r", "vn", "res", "kappa"))
            rows.append(RowForCompress(key, tier[a:b], prot[a:b], row_stats))
        plan = plan_compress(self, rows, budget, sid, method)
        if plan is None:
            return None, None
        new = np.concatenate([t for t in plan.tiers if t is not None])
        return torch.as_tensor(new.astype(np.int64), device=self.device), plan.allocation

    def _solve_device(self, sids, sts, stats, budgets):
        """``rdr_device``'s LP-greedy over the states of the sequences ``sids`` (their state
        indices, statistics and budgets), one problem per sequence in one solve; per
        sequence (its tiers (N,) on the device, its Allocation). Only the answer's figures
        leave the device (the tiers, once, for the reports)."""
        from spherical_kv_ref.rdr.problem import Allocation
        from . import rdr_device
        torch = _torch()
        d, pb = self.head_dim, self.page_bytes
        share = [0.0] + [pb / p for p in self._per()[1:]]
        for sid, st, budget in zip(sids, sts, budgets):
            rows, T1 = len(st.n_row), self.ladder.top + 1
            held = _counts(st.row * T1 + st.tier, rows * T1, st.protected)
            need = int(self._dense_pages(held.view(rows, T1).cpu().numpy()).sum())
            if need * pb > budget:
                raise ValueError(f"the protected states of sequence {sid} alone need {need * pb} "
                                 f"bytes (sinks, recent window and protected spans, page "
                                 f"padding included), more than budget_bytes = {budget}")
        ek, ev = self._tier_errors()
        R = len(sts[0].n_row)
        cat = lambda f: torch.cat([f(i, st) for i, st in enumerate(sts)])
        D = cat(lambda i, st: rdr_device.distortion(
            stats[i][0]["p"], stats[i][1][st.row], stats[i][0]["r"], stats[i][0]["vn"],
            stats[i][0]["res"], ek, ev, d, self.softmax_scale, stats[i][0]["kappa"],
            self.policy.key_term))
        tier, objective, bound = rdr_device.greedy_allocation(
            D, cat(lambda i, st: st.tier), cat(lambda i, st: st.protected),
            cat(lambda i, st: st.row + i * R), share, pb, [float(b) for b in budgets],
            R * len(sts), segment=cat(lambda i, st: torch.full_like(st.row, i)))
        # the reports' tiers as int8 (options <= 8): a 67 MB int64 copy of a 32K-token
        # sequence's 8.4M states cost ~45 ms of host time
        host = _host(tier.to(torch.int8)).copy()
        out, a = [], 0
        for st, obj, lb in zip(sts, objective, bound):
            n = st.page.numel()
            gap = (obj - lb) / obj if obj > 0 else 0.0
            out.append((tier[a:a + n], Allocation(tier=host[a:a + n], objective=obj,
                                                  lower_bound=lb, gap=gap, bytes=None,
                                                  method="device", optimal=gap == 0.0)))
            a += n
        return out

    def _dense_pages(self, cnt: np.ndarray) -> np.ndarray:
        """The pages that states counted per (row, tier) (R, T+1) fill densely (tier 0
        holds none)."""
        pages = -(-cnt // self._per()[None, :])
        pages[:, 0] = 0
        return pages

    def _per(self) -> np.ndarray:
        T, d, pb = self.ladder.top, self.head_dim, self.page_bytes
        return np.array([1] + [self.ladder.states_per_page(t, d, pb) for t in range(1, T + 1)])

    def _apply(self, s: _Seq, st: "_States", new, budget: int) -> None:
        """Rewrite every row whose tiers changed (``new`` (N,) int64 device tensor, the
        states' new tiers): its kept states into fresh pages, tiers in ascending order (top
        last), each tier's in storage order, by one ``retier`` launch; then release the old
        pages. Everything per state stays on the device, the kept states' positions too
        (``_Row.kept``); the host gets per-(row, tier) counts."""
        torch = _torch()
        T1 = self.ladder.top + 1
        R = len(st.n_row)
        per = self._per()
        # the changed states' rows, and the kept states' (row, tier), in one copy down
        alive = new > 0
        both = torch.cat([_counts(st.row, R, new != st.tier),
                          _counts(st.row * T1 + new, R * T1, alive)]).cpu().numpy()
        changed = both[:R] > 0
        cnt = both[R:].reshape(R, T1)
        npg = self._dense_pages(cnt)
        if int(npg.sum()) * self.page_bytes > budget:
            raise RuntimeError(f"RDR allocation needs {int(npg.sum()) * self.page_bytes} bytes "
                               f"for budget {budget}; this is a bug")
        npg[~changed] = 0
        need = int(npg.sum())
        if not changed.any():
            return
        if need > self._num_free:
            raise PoolExhaustedError(f"page pool exhausted: the allocation needs {need} new pages "
                                     f"before the old ones are released, {self._num_free} are free")
        fresh = self._allocate(need)
        dev = self._upload
        flat = npg.reshape(-1)
        base = np.cumsum(flat) - flat                     # first fresh page of each (row, tier)
        cnt_moved = np.where(changed[:, None], cnt, 0).reshape(-1)
        first = np.cumsum(cnt_moved) - cnt_moved          # first moved state of each (row, tier)
        moving = alive & dev(changed)[st.row]
        # the moving states in storage order; the host knows how many (no wait for the count)
        at = _nonzero(moving, int(cnt_moved.sum()))
        key = (st.row * T1 + new)[at]
        order = torch.sort(key, stable=True).indices
        sel = at[order]
        key = key[order]
        t_sel = new[sel]
        rank = torch.arange(key.numel(), device=self.device) - dev(first)[key]
        per_t = dev(per)[t_sel]
        dst_p = dev(fresh.astype(np.int64))[dev(base)[key] + rank // per_t]
        dst_s = rank % per_t
        group_tier = np.tile(np.arange(T1, dtype=np.int32), R)    # the tier of each (row, tier)
        page_tier = np.repeat(group_tier, flat)
        # full pages, then each (row, tier)'s last page with what is left (dense_counts)
        page_count = np.repeat(per[group_tier], flat).astype(np.int32)
        used = flat > 0
        page_count[np.cumsum(flat)[used] - 1] = cnt_moved[used] - per[group_tier][used] * (flat[used] - 1)
        self._set_pages(fresh, page_tier, np.zeros(need))
        i32 = lambda x: x.to(torch.int32).contiguous()
        with _stream():
            retier(self.pages, self.page_tier, self.tables, i32(st.page[sel]), i32(st.slot[sel]),
                   i32(dst_p), i32(dst_s), check=False)
        self._set_pages(fresh, page_tier, page_count)
        kept = st.pos[sel].to(torch.int32)     # stays on the device; each row holds its slice
        moved_rows = cnt_moved.reshape(R, T1).sum(axis=1)
        kept_at = np.cumsum(moved_rows) - moved_rows
        page_at = np.cumsum(npg.sum(axis=1)) - npg.sum(axis=1)
        olds = []
        for r in np.flatnonzero(changed):
            row = s.rows[r // self.num_kv_heads][r % self.num_kv_heads]
            olds.append(row.pages)
            a, n = int(page_at[r]), int(npg[r].sum())
            row.pages = fresh[a:a + n].copy()
            row.tiers = page_tier[a:a + n].copy()
            row.counts = page_count[a:a + n].copy()
            row.kept = kept[int(kept_at[r]):int(kept_at[r] + moved_rows[r])]
            row.tail_from = row.tail_to
        self._release(np.concatenate(olds))


class _States:
    """Every state of one sequence, rows in (layer, kv-head) order, each row's states in
    storage order: page, slot, tier, row, token position (int64 device tensors (N,)) and
    protected (bool); the host's states per row n_row (R,) and row offsets off (R+1,)."""
    __slots__ = ("page", "slot", "tier", "row", "pos", "protected", "n_row", "off")

    def __init__(self, page, slot, tier, row, pos, protected, n_row, off):
        self.page, self.slot, self.tier, self.row = page, slot, tier, row
        self.pos, self.protected, self.n_row, self.off = pos, protected, n_row, off


def _counts(key, bins: int, where):
    """How many of the entries where ``where`` is True hold each key in [0, bins), (bins,)
    int64 on key's device. A histogram, not index_add_ (a row's states are contiguous, so a
    warp's adds would all contend for one address); the other entries go to a spill bin,
    so no masked copy makes the host wait for its size."""
    torch = _torch()
    return torch.bincount(torch.where(where, key, bins), minlength=bins + 1)[:bins]


def _nonzero(mask, count: int):
    """The indices of mask's True entries, in order (1-D int64), count of them known to the
    caller: nonzero_static makes no host wait, where torch.nonzero reads the count back."""
    torch = _torch()
    try:
        return torch.nonzero_static(mask, size=count)[:, 0]
    except (AttributeError, NotImplementedError):   # a torch without it for this device
        return torch.nonzero(mask).squeeze(1)


def _stream():
    from .torch_ops import torch_stream
    return torch_stream()


def _host(x) -> np.ndarray:
    """A device tensor's values on the host through page-locked memory (torch caches such
    buffers): the per-state arrays of a compress are tens of MB, which a pageable copy moves
    at a fraction of the link's rate."""
    if not x.is_cuda:
        return x.numpy()
    buf = _torch().empty(x.shape, dtype=x.dtype, pin_memory=True)
    buf.copy_(x)
    return buf.numpy()


def _points(w, bits: int, dim: int, levels, halves, pg, sl, soff: int):
    """s·ĉ (n, d) float64 from packed words w (n, words) int32 of one part at ``bits`` with
    the codebook's ``levels`` (device), scales read at byte offset ``soff`` of each page (fp16;
    none at 16 bits)."""
    torch = _torch()
    if bits == 16:
        return w.contiguous().view(torch.float16)[:, :dim].to(torch.float64)
    u = w.to(torch.int64) & 0xFFFFFFFF

    def fields(words, b):
        per = 32 // b
        shifts = torch.arange(per, device=words.device, dtype=torch.int64) * b
        f = (words[:, :, None] >> shifts) & ((1 << b) - 1)
        return f.reshape(words.shape[0], -1)[:, :dim]
    if bits == 3:
        w2 = -(-2 * dim // 32)
        codes = fields(u[:, :w2], 2) | (fields(u[:, w2:], 1) << 2)
    else:
        codes = fields(u, bits)
    scale = halves[pg[:, 0], soff // 2 + sl[:, 0]].to(torch.float64)
    return scale[:, None] * (levels[codes] / math.sqrt(dim))
