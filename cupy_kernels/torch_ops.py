"""The kernels as torch custom ops, for models, ``torch.compile`` and CUDA graphs (docs/design.md §8).

``spherical_kv::decode`` runs ``ada_decode`` and ``spherical_kv::append`` runs
``encode_kv_into_pages`` plus the page-count update of the states it wrote. Both launch on
torch's current stream (a CuPy ``ExternalStream`` over it), view every tensor through DLPack
(no copy), allocate nothing of their own and never sync with the host, so a decode step made
of them is captured by ``torch.cuda.graph`` and by ``torch.compile(mode="reduce-overhead")``.
They write into tensors they are handed (``mutates_args``) and return nothing; their fake
implementations do nothing, which is all tracing needs.

Nothing here validates the page tables: the device cache (``device_cache.DeviceKVCache``)
plans them outside the captured step. Kernel tables are not tensors; an op names them by the
integer its ``register_tables`` call returned.
"""
from __future__ import annotations

import contextlib
from typing import Dict

import torch

from ._module import cupy
from .ada_decode import DecodeWorkspace, ada_decode
from .encode import encode_kv_into_pages
from .kernel_tables import KernelTables

__all__ = ["torch_stream", "register_tables", "decode", "append"]

_TABLES: Dict[int, KernelTables] = {}
_STREAMS: Dict[int, object] = {}


def register_tables(tables: KernelTables) -> int:
    """The id the ops know ``tables`` by (the same object always gets the same id)."""
    key = id(tables)
    _TABLES[key] = tables
    return key


@contextlib.contextmanager
def torch_stream():
    """Launch CuPy kernels on torch's current CUDA stream (the one a graph capture records)."""
    cp = cupy()
    ptr = torch.cuda.current_stream().cuda_stream
    stream = _STREAMS.get(ptr)
    if stream is None:
        stream = _STREAMS[ptr] = cp.cuda.ExternalStream(ptr)
    with stream:
        yield


@torch.library.custom_op("spherical_kv::decode",
                         mutates_args=("out", "lse", "part_o", "part_lse"))
def decode(q: torch.Tensor, pages: torch.Tensor, page_tier: torch.Tensor,
           page_count: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor,
           sigma_k: torch.Tensor, sigma_v: torch.Tensor, mean_k: torch.Tensor,
           mean_v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, part_o: torch.Tensor,
           part_lse: torch.Tensor, tables_id: int, num_kv_heads: int, softmax_scale: float,
           num_splits: int, with_lse: bool) -> None:
    """out (batch, Hq, d) float32 = ADA attention of q (batch, Hq, d) float32 over the rows
    (sequence, kv-head) of one layer; with ``with_lse`` also each head's log-sum-exp into
    lse (batch, Hq). part_o (splits, rows, G, d), part_lse (splits, rows, G): the split-K
    partials (num_splits of them; any tensor when num_splits is 1)."""
    cp = cupy()
    with torch_stream():     # DLPack views made on torch's stream (no cross-stream wait)
        ws = DecodeWorkspace(int(num_splits), cp.from_dlpack(part_o) if num_splits > 1 else None,
                             cp.from_dlpack(part_lse) if num_splits > 1 else None)
        ada_decode(q, pages, page_tier, page_count, indptr, indices, _TABLES[tables_id],
                   sigma_k, sigma_v, num_kv_heads=num_kv_heads, mean_k=mean_k, mean_v=mean_v,
                   softmax_scale=softmax_scale, num_splits=num_splits, out=out,
                   workspace=ws, validate=False, lse=lse if with_lse else None)


@decode.register_fake
def _decode_fake(q, pages, page_tier, page_count, indptr, indices, sigma_k, sigma_v, mean_k,
                 mean_v, out, lse, part_o, part_lse, tables_id, num_kv_heads, softmax_scale,
                 num_splits, with_lse) -> None:
    return None


@torch.library.custom_op("spherical_kv::append", mutates_args=("pages", "page_count", "status"))
def append(k: torch.Tensor, v: torch.Tensor, pages: torch.Tensor, page_tier: torch.Tensor,
           page_count: torch.Tensor, sigma_k: torch.Tensor, sigma_v: torch.Tensor,
           head: torch.Tensor, dst_page: torch.Tensor, dst_slot: torch.Tensor,
           dst_count: torch.Tensor, mean_k: torch.Tensor, mean_v: torch.Tensor,
           mean_index: torch.Tensor, status: torch.Tensor, tables_id: int) -> None:
    """Encodes keys k and values v (n, d) float32 into (dst_page, dst_slot) of the pool and
    sets page_count[dst_page] = dst_count (the slot after the state: states fill a page in
    order, so this is its new count). head, dst_*, mean_index: int32 (n,). Faults the
    kernel finds (a norm past fp16) are or-ed into status (int32 (1,)), read outside."""
    with torch_stream():
        encode_kv_into_pages(k, v, pages, page_tier, _TABLES[tables_id], sigma_k, sigma_v,
                             head, dst_page, dst_slot, mean_k=mean_k, mean_v=mean_v,
                             mean_index=mean_index, check=False,
                             status=cupy().from_dlpack(status))
    page_count.index_put_((dst_page,), dst_count)


@append.register_fake
def _append_fake(k, v, pages, page_tier, page_count, sigma_k, sigma_v, head, dst_page,
                 dst_slot, dst_count, mean_k, mean_v, mean_index, status, tables_id) -> None:
    return None
