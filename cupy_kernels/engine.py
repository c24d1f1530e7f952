"""The engine adapter's operations on the GPU (docs/design.md §8; spherical_kv_ref.engine).

``CudaPagedAttention`` has the interface of ``spherical_kv_ref.engine.CpuPagedAttention``:
``write`` stores a step's keys and values in their engine slots with ``encode_kv_into_pages``
(byte for byte the reference encoder), ``attend`` runs ``ada_decode`` over the context part
and over each own-block group of the step's plan and merges them by their log-sum-exps. The
pool is the engine's own block pool on the GPU (a torch tensor or CuPy array, viewed by
DLPack, never copied); the plan comes from ``spherical_kv_ref.engine.plan_step`` on the host
and its small index arrays are uploaded once per step (``upload``).

What it costs: one decode launch for the context part plus one per distinct own-block count
among the step's tokens (at most block_size), and one host sync per step to plan. A kernel
that honoured a per-row last-page length would make it one launch and graph-capturable.
"""
from __future__ import annotations

from typing import Dict

import numpy as np

from spherical_kv_ref.engine import (BlockFormat, StepPlan, context_table, merge_into,
                                     own_block_groups)
from spherical_kv_ref.rotation import KEY_SALT, VALUE_SALT

from ._module import cupy
from .ada_decode import ada_decode
from .encode import encode_kv_into_pages
from .kernel_tables import as_device, kernel_tables, rotation_signs

__all__ = ["CudaPagedAttention", "DevicePlan", "upload"]


class DevicePlan:
    """A ``StepPlan``'s decode calls with their index arrays on the GPU, made once per step
    and shared by every layer: [(count, tokens, indptr, indices)], the context part first
    (count = block_size, every page full)."""

    def __init__(self, plan: StepPlan, num_kv_heads: int):
        cp = cupy()
        self.plan = plan
        H = int(num_kv_heads)
        self.calls = []
        if plan.ctx_tokens.size:
            indptr, indices = context_table(plan, H)
            self.calls.append((plan.block_size, plan.ctx_tokens, indptr, indices))
        for c, tokens, idx in own_block_groups(plan, H):
            self.calls.append((c, tokens, np.arange(idx.size + 1), idx))
        self.calls = [(c, cp.asarray(t), cp.asarray(ip, cp.int32), cp.asarray(ix, cp.int32))
                      for c, t, ip, ix in self.calls]


def upload(plan: StepPlan, num_kv_heads: int) -> DevicePlan:
    return DevicePlan(plan, num_kv_heads)


class CudaPagedAttention:
    """write(pool, layer, key, value, slot_mapping) and attend(pool, layer, query, plan,
    softmax_scale) on the GPU, as ``CpuPagedAttention`` (float32 out, (N, Hq, d), a CuPy
    array, or a torch tensor when the query is one). plan: a ``StepPlan`` or its
    ``DevicePlan``. Head dims 64, 128 and 256 (the kernels')."""

    def __init__(self, fmt: BlockFormat):
        self.fmt = fmt
        self.tables = kernel_tables([fmt.tier], fmt.head_dim, fmt.page_bytes, codebook=fmt.codebook)
        self._signs: Dict[int, tuple] = {}
        self._tier: Dict[int, object] = {}

    def _pages(self, pool):
        cp = cupy()
        a, _ = as_device(pool, "pool")
        fmt = self.fmt
        if a.dtype != np.uint8 or not a.flags.c_contiguous or a.size % fmt.block_bytes \
                or a.shape[0] * fmt.block_bytes != a.size:
            raise ValueError(f"pool must be C-contiguous uint8 blocks of {fmt.block_bytes} bytes, "
                             f"got {a.dtype} {a.shape}")
        pages = a.reshape(-1, fmt.page_bytes)
        n = pages.shape[0]
        if n not in self._tier:     # every page of the pool is tier 1
            self._tier[n] = cp.ones(n, cp.int32)
        return pages, self._tier[n]

    def signs(self, layer: int):
        """(sigma_k, sigma_v) float32 (H, d) on the GPU: the rotations of the layer's heads."""
        hit = self._signs.get(int(layer))
        if hit is None:
            cp = cupy()
            H = self.fmt.num_kv_heads
            hit = tuple(cp.asarray(rotation_signs([self.fmt.codec(layer, h, part)
                                                   for h in range(H)]))
                        for part in (KEY_SALT, VALUE_SALT))
            self._signs[int(layer)] = hit
        return hit

    def write(self, pool, layer: int, key, value, slot_mapping) -> None:
        cp = cupy()
        fmt = self.fmt
        H, d, B = fmt.num_kv_heads, fmt.head_dim, fmt.block_size
        pages, tier = self._pages(pool)
        k, _ = as_device(key, "key", ndim=3)
        v, _ = as_device(value, "value", ndim=3)
        if k.shape != v.shape or k.shape[1:] != (H, d):
            raise ValueError(f"key and value must be (N, {H}, {d}), got {k.shape} and {v.shape}")
        slots, _ = as_device(slot_mapping, "slot_mapping", ndim=1)
        slots = slots.astype(cp.int64)
        if slots.shape[0] > k.shape[0]:
            raise ValueError(f"{slots.shape[0]} slots for {k.shape[0]} tokens")
        keep = cp.flatnonzero(slots >= 0)
        s = slots[keep]
        head = cp.tile(cp.arange(H, dtype=cp.int32), int(keep.size))
        dst_page = ((s // B)[:, None] * H + cp.arange(H)[None, :]).reshape(-1).astype(cp.int32)
        dst_slot = cp.repeat(s % B, H).astype(cp.int32)
        sk, sv = self.signs(layer)
        encode_kv_into_pages(k[keep].reshape(-1, d), v[keep].reshape(-1, d), pages, tier,
                             self.tables, sk, sv, head, dst_page, dst_slot)

    def attend(self, pool, layer: int, query, plan, softmax_scale: float):
        cp = cupy()
        fmt = self.fmt
        H = fmt.num_kv_heads
        dplan = plan if isinstance(plan, DevicePlan) else upload(plan, H)
        if dplan.plan.block_size != fmt.block_size:
            raise ValueError(f"the plan is for block_size {dplan.plan.block_size}, the pool's "
                             f"is {fmt.block_size}")
        pages, tier = self._pages(pool)
        torch_in = type(query).__module__.startswith("torch")
        q, _ = as_device(query.float() if torch_in else query, "query", ndim=3)
        if q.shape[0] != dplan.plan.num_tokens or q.shape[1] % H or q.shape[2] != fmt.head_dim:
            raise ValueError(f"query must be ({dplan.plan.num_tokens}, a multiple of {H}, "
                             f"{fmt.head_dim}), got {q.shape}")
        q = q.astype(cp.float32)
        N, Hq, d = q.shape
        out = cp.zeros((N, Hq, d), cp.float32)
        lse = cp.full((N, Hq), -cp.inf, cp.float32)
        count = cp.zeros(pages.shape[0], cp.int32)
        sk, sv = self.signs(layer)
        for c, tokens, indptr, indices in dplan.calls:
            count[indices] = c          # stream-ordered: the previous call has read its counts
            part_lse = cp.empty((tokens.size, Hq), cp.float32)
            part = ada_decode(q[tokens], pages, tier, count, indptr, indices, self.tables, sk, sv,
                              num_kv_heads=H, softmax_scale=softmax_scale, lse=part_lse)
            merge_into(cp, out, lse, tokens, part, part_lse)
        if torch_in:
            import torch
            return torch.from_dlpack(out)
        return out
