"""The device cache's captured decode path: ``DecodeStep``, the next N tokens of a batch
planned so that a model's decode step over them is one CUDA graph (docs/design.md §8).

Made by ``DeviceKVCache.decode_step(seqs, steps)``, outside any graph: page capacity for the
N tokens reserved (fresh pages enter the page tables with count 0, which the decode kernel
reads as empty), every token's (page, slot) planned into device tables, the page tables and
means uploaded, every buffer the step writes allocated. A step is then made of the torch
custom ops of ``torch_ops`` on those buffers: no host sync, no allocation by the kernels.
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np

from spherical_kv_ref.ada import merge_attention
from spherical_kv_ref.codec import whole
from spherical_kv_ref.paged import PoolExhaustedError

from .ada_decode import splits_for

__all__ = ["DecodeStep"]


def _torch():
    import torch
    return torch


class DecodeStep:
    """The next ``steps`` tokens of a batch of sequences, planned for a captured decode
    (``DeviceKVCache.decode_step``).

    Made outside the captured region: every row's capacity for ``steps`` top-tier tokens is
    reserved (fresh pages enter the page tables with count 0, which the decode reads as
    empty), each step's (page, slot) per row planned into device tables, the page tables and
    means uploaded, and every buffer the step writes allocated. Per step, outside the
    graph: ``set_step(i)``. Inside it: ``slots()`` once, then per layer ``append``,
    ``decode`` or ``attend`` (torch custom ops only). ``close(done)`` commits ``done``
    tokens to the host bookkeeping and releases what was reserved beyond them."""

    def __init__(self, cache, seqs: List[int], steps: int):
        torch = _torch()
        self.cache, self.seqs, self.steps = cache, seqs, steps
        c = cache
        L, H, d, P, T = c.num_layers, c.num_kv_heads, c.head_dim, c.top_per_page, c.ladder.top
        ss = [c._seq(x) for x in seqs]
        for x, s in zip(seqs, ss):
            c._open(s, "decode_step")
            if np.any(s.length != s.length[0]):
                raise ValueError(f"sequence {x}: its layers hold different lengths {sorted(set(s.length.tolist()))}")
            if not s.has_mean.all() and c.centre:
                raise ValueError(f"sequence {x}: every layer needs a first chunk (append) before decode steps")
        B = len(seqs)
        R = B * H
        plans = [[c._tail_plan(s.rows[l][h], steps) for s in ss for h in range(H)] for l in range(L)]
        need = sum(new for pl in plans for _, new in pl)
        if need > c._num_free:
            raise PoolExhaustedError(f"page pool exhausted: {steps} decode steps of {B} sequence(s) "
                                     f"need {need} free pages, {c._num_free} are free")
        fresh = c._allocate(need)
        c._set_pages(fresh, np.full(need, T), np.zeros(need))
        page = np.empty((steps, L, R), np.int32)
        slot = np.empty((steps, L, R), np.int32)
        self._reserved = []
        indptr = np.zeros((L, R + 1), np.int64)
        indices = []
        a = 0
        for l in range(L):
            lists = []
            for r, (fill, new) in enumerate(plans[l]):
                row = ss[r // H].rows[l][r % H]
                ids = fresh[a:a + new]
                a += new
                page[:, l, r], slot[:, l, r] = row.tail_slots(fill, ids, P, steps)
                self._reserved.append((row, fill, ids))
                lists.append(np.concatenate([row.pages, ids]))
            indptr[l, 1:] = np.cumsum([x.size for x in lists])
            indices.append(np.concatenate(lists))
        dev = lambda x, dt=torch.int32: torch.as_tensor(np.ascontiguousarray(x), device=c.device).to(dt)
        self.plan_page, self.plan_slot, self.plan_count = dev(page), dev(slot), dev(slot + 1)
        self.indptr = [dev(indptr[l]) for l in range(L)]
        self.indices = [dev(indices[l]) for l in range(L)]
        self.mean_k = torch.stack([torch.cat([s.mean_k[l] for s in ss]) for l in range(L)])
        self.mean_v = torch.stack([torch.cat([s.mean_v[l] for s in ss]) for l in range(L)])
        self.head = dev(np.tile(np.arange(H, dtype=np.int32), B))
        self.mean_index = dev(np.arange(R, dtype=np.int32))
        self.step_index = torch.zeros(1, dtype=torch.int64, device=c.device)
        self.dst_page = torch.empty((1, L, R), dtype=torch.int32, device=c.device)
        self.dst_slot = torch.empty_like(self.dst_page)
        self.dst_count = torch.empty_like(self.dst_page)
        self.status = torch.zeros(1, dtype=torch.int32, device=c.device)
        self.out = torch.empty((B, c.num_q_heads, d), dtype=torch.float32, device=c.device)
        self.lse = torch.empty((B, c.num_q_heads), dtype=torch.float32, device=c.device)
        most = max(int(indptr[l, -1]) for l in range(L))
        self.num_splits = max(2, splits_for(c.tables, R, most))
        self.part_o = torch.empty((self.num_splits, R, c.group_size, d), dtype=torch.float32, device=c.device)
        self.part_lse = torch.empty((self.num_splits, R, c.group_size), dtype=torch.float32, device=c.device)
        from .torch_ops import register_tables
        self.tables_id = register_tables(c.tables)
        self.signs = [c.signs(l) for l in range(L)]
        self.done = 0
        self.closed = False
        for s in ss:
            s.step = self

    def static_tensors(self) -> list:
        """Every tensor a captured step reads or writes (for ``torch._dynamo.mark_static_address``)."""
        c = self.cache
        out = [c.pages, c.page_tier, c.page_count, self.plan_page, self.plan_slot, self.plan_count,
               self.mean_k, self.mean_v, self.head, self.mean_index, self.step_index, self.dst_page,
               self.dst_slot, self.dst_count, self.status, self.out, self.lse, self.part_o,
               self.part_lse]
        return out + self.indptr + self.indices + [t for pair in self.signs for t in pair]

    def set_step(self, i: int) -> None:
        """Which of the planned steps the next replay runs (outside the graph; stream-ordered)."""
        i = whole("i", i, 0, self.steps)
        self.step_index.fill_(i)
        self.done = max(self.done, i + 1)

    def slots(self) -> None:
        """Gathers the current step's destinations for every layer (captured), and sets each
        destination page's count to the states before the step's own, so that a step run
        twice (a warm-up, a graph replay of the same step) reads what it read the first time."""
        torch = _torch()
        torch.index_select(self.plan_page, 0, self.step_index, out=self.dst_page)
        torch.index_select(self.plan_slot, 0, self.step_index, out=self.dst_slot)
        torch.index_select(self.plan_count, 0, self.step_index, out=self.dst_count)
        self.cache.page_count.index_put_((self.dst_page.view(-1),), self.dst_slot.view(-1))

    def append(self, layer: int, k, v) -> None:
        """Writes the step's token of every sequence: k, v (batch, num_kv_heads, d)."""
        torch = _torch()
        c = self.cache
        R = len(self.seqs) * c.num_kv_heads
        k = k.detach().reshape(R, c.head_dim).to(torch.float32).contiguous()
        v = v.detach().reshape(R, c.head_dim).to(torch.float32).contiguous()
        sk, sv = self.signs[layer]
        torch.ops.spherical_kv.append(k, v, c.pages, c.page_tier, c.page_count, sk, sv, self.head,
                                      self.dst_page[0, layer], self.dst_slot[0, layer],
                                      self.dst_count[0, layer], self.mean_k[layer],
                                      self.mean_v[layer], self.mean_index, self.status,
                                      self.tables_id)

    def decode(self, layer: int, q, with_lse: bool = False):
        """ADA attention (batch, num_q_heads, d) float32 of q over the layer's rows (the
        step's own token included once ``append`` wrote it); a view of a buffer the next
        call overwrites."""
        torch = _torch()
        c = self.cache
        sk, sv = self.signs[layer]
        torch.ops.spherical_kv.decode(q.detach().to(torch.float32).contiguous(), c.pages, c.page_tier,
                                      c.page_count, self.indptr[layer], self.indices[layer], sk, sv,
                                      self.mean_k[layer], self.mean_v[layer], self.out, self.lse,
                                      self.part_o, self.part_lse, self.tables_id,
                                      c.num_kv_heads, c.softmax_scale, self.num_splits, with_lse)
        return self.out

    def attend(self, layer: int, q, k, v):
        """The integration's semantics for one new token: q (batch, Hq, d) attends to the
        stored context (codes) and to its own k, v (batch, H, d) exactly, merged by their
        log-sum-exps; then the token is appended. Returns float32 (batch, Hq, d)."""
        torch = _torch()
        c = self.cache
        G = c.group_size
        out = self.decode(layer, q, with_lse=True)
        q32 = q.to(torch.float32)
        k32 = k.to(torch.float32).repeat_interleave(G, dim=1)
        v32 = v.to(torch.float32).repeat_interleave(G, dim=1)
        own = c.softmax_scale * (q32 * k32).sum(dim=-1)
        # the token's own part: one state, its value, its logit as the log-sum-exp
        res, _ = merge_attention(out, self.lse, v32, own, xp=torch)
        self.append(layer, k, v)
        return res

    def close(self, done: Optional[int] = None) -> None:
        """Commits ``done`` tokens per sequence (default: the highest step set + 1) to the
        host bookkeeping and releases the reserved pages no token reached."""
        if self.closed:
            return
        c = self.cache
        done = self.done if done is None else whole("done", done, 0, self.steps + 1)
        P, T = c.top_per_page, c.ladder.top
        unused = []
        for row, fill, ids in self._reserved:
            unused.append(row.grow(fill, ids, T, P, done)[2])
        for x in self.seqs:
            s = c._seq(x)
            s.length += done
            s.step = None
        c._release(np.concatenate(unused) if unused else np.zeros(0, np.int32))
        self.closed = True
