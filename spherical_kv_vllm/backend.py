"""The vLLM attention backend over Spherical KV pages: backend, metadata builder, impl.

vLLM's side of the contract (vllm 0.32, docs/serving.md):
* ``customize_spec`` sets the layer's KV spec to uint8 states of ``state_bytes`` bytes
  (codes + fp16 scales of one key and one value at the tier), so vLLM's block b of a layer
  is the tensor (H, block_size, state_bytes) = H pages of the storage format, head-major
  (layout LBHNC), and vLLM's memory accounting counts the compressed bytes;
* ``do_kv_cache_update`` (called before ``forward``, ``forward_includes_kv_cache_update =
  False``) writes the step's keys and values into their slots;
* the builder turns vLLM's metadata into the adapter's step plan once per step, shared by
  every layer; ``forward`` asks the adapter for the attention of the step's queries.
Everything else (block allocation, prefix caching, preemption) stays vLLM's.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from vllm.platforms import current_platform
from vllm.v1.attention.backend import (AttentionBackend, AttentionImpl, AttentionMetadata,
                                       AttentionMetadataBuilder, AttentionType,
                                       CommonAttentionMetadata, MultipleOf)
from vllm.v1.kv_cache_interface import KVCacheLayout

from spherical_kv_ref.engine import BlockFormat, CpuPagedAttention, StepPlan, plan_step

from . import settings

__all__ = ["SphericalKVBackend", "SphericalKVImpl", "SphericalKVMetadata",
           "SphericalKVMetadataBuilder", "state_bytes"]


def _settings():
    got = settings()
    if got is None:
        raise RuntimeError("the Spherical KV backend was selected but SPHERICAL_KV_TIER is not "
                           "set in this process")
    return got


def state_bytes(head_size: int) -> int:
    """Bytes of one (key, value) state of one kv-head at the configured tier."""
    (kb, vb), codebook, seed = _settings()
    return BlockFormat(kb, vb, head_size, 1, 16, codebook, seed).state_bytes


class SphericalKVBackend(AttentionBackend):
    forward_includes_kv_cache_update: bool = False
    accept_output_buffer: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto"]

    @staticmethod
    def get_name() -> str:
        # must name a member of AttentionBackendEnum: the one this class overrides
        return "CPU_ATTN" if current_platform.is_cpu() else "CUSTOM"

    @staticmethod
    def get_impl_cls():
        return SphericalKVImpl

    @staticmethod
    def get_builder_cls():
        return SphericalKVMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None):
        # block_size · state_bytes must be a multiple of 16 bytes (docs/format.md "Pages")
        return [MultipleOf(16)]

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        if current_platform.is_cpu():
            return head_size >= 4
        from cupy_kernels._module import DIMS
        return head_size in DIMS             # the GPU kernels' head dims

    @classmethod
    def supported_kv_cache_layouts(cls):
        return (KVCacheLayout.LBHNC,)       # each (block, kv-head) one contiguous page

    @classmethod
    def customize_spec(cls, spec):
        if spec.state_content_bytes is not None:
            return spec
        if spec.head_size_v != spec.head_size:
            raise ValueError("Spherical KV pages need equal key and value head sizes")
        return replace(spec, dtype=torch.uint8, state_content_bytes=state_bytes(spec.head_size))


@dataclass
class SphericalKVMetadata(AttentionMetadata):
    """The step plan of one step (host arrays), shared by every layer of the group; the GPU
    copy of its index arrays is made by the first layer that needs it."""
    plan: StepPlan
    device_plan: object = None


class SphericalKVMetadataBuilder(AttentionMetadataBuilder[SphericalKVMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> SphericalKVMetadata:
        cm = common_attn_metadata
        R = cm.num_reqs
        plan = plan_step(cm.query_start_loc_cpu[:R + 1].numpy(),
                         cm.seq_lens[:R].cpu().numpy(),
                         cm.block_table_tensor[:R].cpu().numpy(), self.block_size,
                         num_tokens=cm.num_actual_tokens)
        return SphericalKVMetadata(plan)


class SphericalKVImpl(AttentionImpl[SphericalKVMetadata]):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes=None, sliding_window=None, kv_cache_dtype: str = "auto",
                 logits_soft_cap=None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name=None, sinks=None, **_ignored) -> None:
        unsupported = {"ALiBi": alibi_slopes is not None, "a sliding window": sliding_window,
                       "a logits soft cap": logits_soft_cap, "attention sinks": sinks is not None,
                       "KV sharing between layers": kv_sharing_target_layer_name}
        for what, used in unsupported.items():
            if used:
                raise NotImplementedError(f"the Spherical KV backend does not support {what}")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"the Spherical KV backend serves decoder attention only, "
                                      f"got {attn_type}")
        if kv_cache_dtype != "auto":
            raise NotImplementedError("the Spherical KV backend stores its own format; leave "
                                      f"kv_cache_dtype at 'auto', got {kv_cache_dtype!r}")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self._ops = None
        self._layer = None

    def _setup(self, layer, kv_cache: torch.Tensor):
        if self._ops is None:
            from vllm.model_executor.models.utils import extract_layer_index
            (kb, vb), codebook, seed = _settings()
            block_size = int(kv_cache.shape[2])       # (num_blocks, H, block_size, state_bytes)
            fmt = BlockFormat(kb, vb, self.head_size, self.num_kv_heads, block_size, codebook, seed)
            if kv_cache.device.type == "cpu":
                self._ops = CpuPagedAttention(fmt)
            else:
                from cupy_kernels.engine import CudaPagedAttention
                self._ops = CudaPagedAttention(fmt)
            self._layer = extract_layer_index(layer.layer_name)
        return self._ops

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        n = slot_mapping.shape[0]
        if n == 0 or kv_cache.numel() == 0:
            return
        ops = self._setup(layer, kv_cache)
        if kv_cache.device.type == "cpu":
            ops.write(kv_cache.numpy(), self._layer, key[:n].float().numpy(),
                      value[:n].float().numpy(), slot_mapping.numpy())
        else:
            ops.write(kv_cache, self._layer, key[:n], value[:n], slot_mapping)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None,
                output_scale=None, output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported")
        if output is None:
            output = torch.empty_like(query)
        if attn_metadata is None or kv_cache.numel() == 0:     # vLLM's profiling run
            return output.fill_(0)
        plan = attn_metadata.plan
        N = plan.num_tokens
        ops = self._setup(layer, kv_cache)
        q = query[:N].view(N, self.num_heads, self.head_size)
        if kv_cache.device.type == "cpu":
            out = torch.from_numpy(ops.attend(kv_cache.numpy(), self._layer, q.float().numpy(),
                                              plan, self.scale))
        else:
            if attn_metadata.device_plan is None:
                from cupy_kernels.engine import upload
                attn_metadata.device_plan = upload(plan, self.num_kv_heads)
            out = ops.attend(kv_cache, self._layer, q, attn_metadata.device_plan, self.scale)
        output[:N].copy_(out.reshape(output[:N].shape).to(output.dtype))
        return output
