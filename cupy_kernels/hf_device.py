"""transformers integration on the GPU: a ``Cache`` whose full-attention layers hold their
context in a ``DeviceKVCache`` (docs/design.md §8).

Usage (batch >= 1, left-padded prompts of different lengths), in one call as
``spherical_kv_ref.hf.spherical_kv`` is on the CPU::

    from cupy_kernels.hf_device import device_spherical_kv
    with device_spherical_kv(model, budget_fraction=0.2) as caches:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=32)

or with a cache of one's own::

    cache = DeviceSphericalCache(model.config, budget_fraction=0.2)
    with cache.bound(model):                 # selects the attention; restored on exit
        out = model.generate(ids, attention_mask=mask, past_key_values=cache,
                             max_new_tokens=32)

The prefill runs dense (sdpa, with the mask transformers builds) and records each layer's
last ``observe`` queries; each sequence's real tokens (the padding dropped) then enter the
device cache, which compresses them to ``budget_fraction`` of their bf16 bytes (2 bytes a
coordinate, keys and values: the convention every budget of the project uses) or to
``budget_bytes`` per sequence, or keeps them at the top tier when neither is given. Each
later token reads the compressed context from the codes and itself exactly, merged by
their log-sum-exps (``DecodeStep.attend``), then enters the cache at the top tier: the
semantics of ``spherical_kv_ref.hf.SphericalCache``, which is its CPU twin (batch 1).
Sliding-window layers keep transformers' own dense window layer.

A decode step is made of torch custom ops on buffers planned ``reserve`` tokens ahead, so a
whole-model step can be captured in a CUDA graph: call ``begin_step()`` before each replay
(it sets the step's page slots) and ``end_step()`` after; ``generate`` calls them itself.
"""
from __future__ import annotations

import contextlib
from typing import List, Optional

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from spherical_kv_ref.codec import whole
from spherical_kv_ref.hf import FULL, layer_kinds
from spherical_kv_ref.hf_store import observing

from .device_cache import DeviceKVCache

ATTENTION_NAME = "spherical_kv_device"

__all__ = ["DeviceSphericalCache", "device_spherical_kv", "device_attention", "ATTENTION_NAME"]


class _DeviceLayer(CacheLayerMixin):
    """A full-attention layer: the prefill's dense states until they enter the device
    cache, then one token at a time."""

    is_sliding = False

    def __init__(self, owner: "DeviceSphericalCache", index: int, slot: int):
        super().__init__()
        self.owner, self.index, self.slot = owner, index, slot

    def lazy_initialization(self, key_states, value_states):
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return key_states, value_states

    def get_mask_sizes(self, query):
        n = int(query.shape[0]) if isinstance(query, torch.Tensor) else int(query)
        return self.owner.seen + n, 0

    def get_seq_length(self):
        return self.owner.seen

    def get_max_length(self):
        return -1

    get_max_cache_shape = get_max_length

    def reset(self):
        """Nothing to drop: the states live in the owner's device cache (its ``reset``)."""


class DeviceSphericalCache(Cache):
    """A transformers ``Cache`` over a ``DeviceKVCache`` (module docstring).

    config: the model config. budget_fraction: the compressed context's bytes as a fraction
    of its bf16 bytes, per sequence; budget_bytes: or a byte count per sequence (at most
    one of the two; neither: no compression). observe: queries per layer recorded for RDR.
    compress_method: RDR's solver ("fast", "milp" on the host, "device" on the GPU;
    ``DeviceKVCache.compress``).
    reserve: decode steps planned at a time. Other keyword arguments go to
    ``DeviceKVCache`` (ladder, page_bytes, pool_bytes, seed, codebook, policy)."""

    def __init__(self, config, *, budget_fraction: Optional[float] = None,
                 budget_bytes: Optional[int] = None, observe: int = 8, reserve: int = 64,
                 compress_method: Optional[str] = None, **cache_kwargs):
        if budget_fraction is not None and budget_bytes is not None:
            raise ValueError("give budget_fraction or budget_bytes, not both")
        if budget_fraction is not None and (isinstance(budget_fraction, bool) or
                                            not 0.0 < float(budget_fraction) <= 1.0):
            raise ValueError(f"budget_fraction must be in (0, 1], got {budget_fraction!r}")
        self.budget_fraction = budget_fraction
        self.compress_method = compress_method
        self.budget_bytes = None if budget_bytes is None else whole("budget_bytes", budget_bytes, 0)
        self.observe = whole("observe", observe, 1)
        self.reserve = whole("reserve", reserve, 1)
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        for name in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads"):
            if getattr(text, name, None) is None:
                raise ValueError(f"config has no {name}: DeviceSphericalCache serves decoder models "
                                 f"of the Llama family and sliding-window hybrids")
        kinds, self.sliding_window = layer_kinds(config)
        self.num_q_heads = text.num_attention_heads
        self.num_kv_heads = text.num_key_value_heads
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // self.num_q_heads
        self.store_layers = tuple(i for i, k in enumerate(kinds) if k == FULL)
        slot = {layer: j for j, layer in enumerate(self.store_layers)}
        super().__init__(layers=[_DeviceLayer(self, i, slot[i]) if k == FULL else
                                 DynamicSlidingWindowLayer(sliding_window=self.sliding_window)
                                 for i, k in enumerate(kinds)])
        self.cache_kwargs = dict(cache_kwargs)
        self.kv: Optional[DeviceKVCache] = None
        self.seqs: List[int] = []
        self.step = None
        self.decoding = self.in_step = False
        self.steps_taken = 0
        self.seen = 0                   # tokens per row transformers has run, padding included
        self.auto_steps = True
        self.decoding = False
        self.in_step = False
        self.reports = []

    # ------------------------------------------------------------------ binding
    @contextlib.contextmanager
    def bound(self, model):
        """Selects this integration's attention for ``model`` and restores the model's own
        on exit (also after an error)."""
        AttentionInterface.register(ATTENTION_NAME, device_attention)
        AttentionMaskInterface.register(ATTENTION_NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
        saved = {}
        for m in model.modules():
            cfg = getattr(m, "config", None)
            if cfg is not None and hasattr(cfg, "_attn_implementation") and id(cfg) not in saved:
                saved[id(cfg)] = (cfg, cfg._attn_implementation)
                cfg._attn_implementation = ATTENTION_NAME
            if hasattr(m, "layer_idx") and hasattr(m, "o_proj"):
                m._skv_cache = self
        try:
            yield self
        finally:
            for cfg, name in saved.values():
                cfg._attn_implementation = name
            for m in model.modules():
                if getattr(m, "_skv_cache", None) is self:
                    del m._skv_cache

    # ------------------------------------------------------------------ phases
    def _prefill(self, module, query, key, value, attention_mask, scaling):
        """Dense attention over the prompt; then the layer's real tokens enter the device
        cache (and its last queries are recorded)."""
        lay = self.layers[module.layer_idx]
        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling)
        B, T = key.shape[0], key.shape[2]
        if self.kv is None:
            self._open(key.device, float(scaling))
            self.seqs = [self.kv.new_sequence() for _ in range(B)]
        valid = _real_tokens(attention_mask, B, T, key.device)
        with torch.no_grad():
            for b, sid in enumerate(self.seqs):
                idx = valid[b]
                self.kv.append(sid, lay.slot, key[b][:, idx], value[b][:, idx])
                q = query[b][:, idx][:, -self.observe:]
                self.kv.observe(sid, lay.slot, q.transpose(0, 1))
        return out

    def _open(self, device, scaling: float):
        kw = dict(self.cache_kwargs)
        # RDR reads every one of the ``observe`` recorded queries, as the CPU cache's does
        # (the policy's own window, 8 by default, would keep only the last few of them)
        kw["policy"] = observing(kw.get("policy"), self.observe)
        kw.setdefault("softmax_scale", scaling)
        kw.setdefault("pool_bytes", 1 << 30)
        self.kv = DeviceKVCache(len(self.store_layers), self.num_kv_heads, self.head_dim,
                                num_q_heads=self.num_q_heads, device=device, **kw)

    def _compress(self, seqs=None) -> None:
        """RDR to the cache's budget for ``seqs`` (default: every sequence of the batch)."""
        if self.budget_fraction is None and self.budget_bytes is None:
            return
        self.reports.extend(self.kv.compress_all(self.seqs if seqs is None else seqs,
                                                 self.budget_bytes,
                                                 method=self.compress_method,
                                                 budget_fraction=self.budget_fraction))

    def begin_step(self) -> None:
        """Before a decode step (outside any graph): the step's page slots."""
        if self.step is not None and self.steps_taken == self.step.steps:
            self.step.close()
            self.step = None
        if self.step is None:
            self.step = self.kv.decode_step(self.seqs, self.reserve)
            self.steps_taken = 0
        self.step.set_step(self.steps_taken)
        self.step.slots()
        self.in_step = True

    def end_step(self) -> None:
        """After a decode step: its tokens are in the cache."""
        self.steps_taken += 1
        self.in_step = False

    def close(self) -> None:
        """Commits the open decode plan (the cache stays usable)."""
        if self.in_step:
            self.end_step()
        if self.step is not None:
            self.step.close(self.steps_taken)
            self.step = None
            self.steps_taken = 0

    # ------------------------------------------------------------------ Cache API
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        layer_idx = whole("layer_idx", layer_idx, 0, len(self.layers))
        if layer_idx == 0:          # a forward pass begins
            T = key_states.shape[2]
            if self.kv is not None and (self.decoding or T == 1):
                if T != 1:
                    raise ValueError("DeviceSphericalCache takes one prompt, then one token per "
                                     f"step (got a chunk of {T} tokens after the prompt)")
                if not self.decoding:
                    self.decoding = True
                    self._compress()
                if self.auto_steps:
                    if self.in_step:
                        self.end_step()
                    self.begin_step()
            self.seen += T
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def crop(self, max_length: int):
        raise NotImplementedError("DeviceSphericalCache cannot crop: compressed states are not "
                                  "kept per position (assisted decoding is not supported)")

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("DeviceSphericalCache does not serve beam search")

    def batch_repeat_interleave(self, repeats: int):
        raise NotImplementedError("DeviceSphericalCache does not expand its batch")

    def reset(self):
        if self.kv is not None:
            self.close()
            for sid in self.seqs:
                self.kv.free(sid)
        self.kv, self.step, self.seqs, self.reports = None, None, [], []
        self.steps_taken = self.seen = 0
        self.decoding = self.in_step = False
        for lay in self.layers:
            lay.reset()


@contextlib.contextmanager
def device_spherical_kv(model, budget_fraction: float = 0.2, **cache_kwargs):
    """Within the block, each ``model.generate`` call without ``past_key_values`` runs on a
    fresh ``DeviceSphericalCache(model.config, budget_fraction=..., **cache_kwargs)`` (the
    block yields them, in call order), with this integration's attention selected; on exit
    the model's attention and ``generate`` are as they were, also after an error. The
    config and the budget are checked on entry (ValueError)."""
    DeviceSphericalCache(model.config, budget_fraction=budget_fraction, **cache_kwargs)  # checks
    own = model.__dict__.get("generate")
    inner = model.generate
    caches: List[DeviceSphericalCache] = []

    def generate(*args, **kwargs):
        if kwargs.get("past_key_values") is not None:
            return inner(*args, **kwargs)
        cache = DeviceSphericalCache(model.config, budget_fraction=budget_fraction, **cache_kwargs)
        caches.append(cache)
        with cache.bound(model):
            return inner(*args, past_key_values=cache, **kwargs)

    model.generate = generate
    try:
        yield caches
    finally:
        if own is None:
            del model.generate
        else:
            model.generate = own


def _real_tokens(mask, B: int, T: int, device):
    """Per row, the key positions the prompt's last query may see (left padding dropped),
    from the 4-D mask transformers built (bool: True attends; float: 0 attends)."""
    if mask is None:
        return [torch.arange(T, device=device)] * B
    last = mask[:, 0, -1, -T:]
    ok = last if last.dtype == torch.bool else last == 0
    return [torch.nonzero(ok[b]).flatten() for b in range(B)]


def device_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The attention registered as ``"spherical_kv_device"``: sliding-window layers and any
    model not bound to a cache run sdpa; a bound full-attention layer attends densely in the
    prefill and through ``DecodeStep.attend`` after it. Returns (batch, T, Hq, d)."""
    cache = getattr(module, "_skv_cache", None)
    layer = getattr(module, "layer_idx", None)
    if cache is None or not isinstance(cache.layers[layer], _DeviceLayer):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    if not cache.decoding:
        return cache._prefill(module, query, key, value, attention_mask, scale), None
    slot = cache.layers[layer].slot
    out = cache.step.attend(slot, query[:, :, 0], key[:, :, 0], value[:, :, 0])
    return out.to(query.dtype)[:, None], None
