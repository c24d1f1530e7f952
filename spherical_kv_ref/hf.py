"""transformers integration: a ``Cache`` whose attention reads compressed state.

Usage (batch 1, decoder models of transformers 5.2 and later: Llama-family, and
sliding-window hybrids such as Gemma-3)::

    from spherical_kv_ref.hf import spherical_kv
    with torch.no_grad(), spherical_kv(model, budget_fraction=0.2) as caches:
        out = model.generate(ids, max_new_tokens=32)   # compressed after the prefill

or, the attention switched for good, ``use_spherical_attention(model)`` and
``model.generate(ids, past_key_values=SphericalCache(model.config, budget_fraction=0.2))``.
Budgets are fractions of the bf16 bytes of the full-attention layers' states (2 bytes a
coordinate). By hand (``budget_fraction=None``): prefill ``ids[:, :-1]`` through the cache,
``cache.compress(...)``, then ``generate(ids, ...)`` with the whole sequence (transformers
runs only the tokens the cache does not hold yet, so the cache must hold fewer tokens than
``ids``). ``past_key_values=`` is the keyword transformers 5.2 reads; 5.24 also reads
``cache=`` and warns that models' ``forward`` drops the old name in 5.40.

Before ``compress`` the cache behaves like a dynamic dense cache and records the last
``observe`` queries of each layer (RDR's attention estimates). After it, each layer's new
tokens are attended in two parts merged by their log-sum-exp: the stored context (a
``ContextStore``: compressed states, or any baseline's states) and the current chunk
(causal: each token reads itself exactly and the chunk's earlier tokens as the store holds
them, so a chunk computes what one-token steps compute). New tokens enter the store at the
top tier for Spherical KV.

Sliding-window layers (``config.layer_types`` "sliding_attention") keep transformers' own
semantics and their own dense window (the last ``sliding_window`` − 1 states, as
transformers' ``DynamicSlidingWindowLayer`` holds them); only the full-attention layers
enter the context store, so RDR spends the whole budget on them (``held_bytes`` says which
layers hold what). The registered attention carries sdpa's mask function, so masks (causal
from any offset, sliding windows) are built as for sdpa.

torch and transformers are imported here only; the core reference never needs them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from typing import Callable, List, Optional, Sequence

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from .ada import merge_attention
from .cache import SphericalKVCache
from .codec import whole
from .hf_store import (ContextStore, DenseStore, SphericalStore, _check_store,  # noqa: F401
                       _chunk_part, _softmax_part, fill_cache, observing)

ATTENTION_NAME = "spherical_kv"
FULL, SLIDING = "full_attention", "sliding_attention"


# ------------------------------------------------------------------------- the HF cache

def rope_frequencies(config) -> Optional[np.ndarray]:
    """The RoPE frequencies (head_dim / 2,) of a config with the default (unscaled) rotary
    embedding, for ``CompressPolicy.horizon``; None for any other rope type."""
    from .rdr.statistics import rope_inv_freq
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    theta = rope.get("rope_theta", getattr(text, "rope_theta", None))
    if rope.get("rope_type", "default") != "default" or theta is None \
            or getattr(text, "partial_rotary_factor", 1.0) != 1.0:
        return None
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return rope_inv_freq(head_dim, theta)


def _text_config(config):
    """The decoder's config of ``config``; ValueError naming what is missing where it is not
    a decoder-only model's config with the attention geometry SphericalCache reads."""
    if config is None:
        raise ValueError("SphericalCache needs the model's config (model.config), got None")
    name = type(config).__name__
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{name} is an encoder-decoder model's config: SphericalCache serves "
                         f"decoder-only models (Llama-family, Gemma-3)")
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    missing = [a for a in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads")
               if not isinstance(getattr(text, a, None), int)]
    if not missing and not isinstance(getattr(text, "head_dim", None), int) \
            and not isinstance(getattr(text, "hidden_size", None), int):
        missing.append("head_dim (or hidden_size)")
    if missing:
        raise ValueError(f"{name} has no {', '.join(missing)}: SphericalCache serves decoder-only "
                         f"models whose config gives the layers, the query and kv-head counts and "
                         f"the head dim (Llama-family, Gemma-3)")
    return text


def layer_kinds(config):
    """Each layer's attention, ``FULL`` or ``SLIDING``, and the window (tokens; None without
    sliding layers), read from a model config as transformers' own dynamic cache reads it:
    ``layer_types`` if the config has them, else every layer sliding when ``sliding_window``
    is set. ValueError for any other kind of layer (chunked, linear, shared-KV), and for a
    config that is not a decoder-only model's (``_text_config``)."""
    text = _text_config(config)
    window = getattr(text, "sliding_window", None)
    kinds = getattr(text, "layer_types", None)
    if kinds is None:
        kinds = [SLIDING if window is not None else FULL] * text.num_hidden_layers
    kinds = list(kinds)
    other = sorted(set(kinds) - {FULL, SLIDING})
    if other:
        raise ValueError(f"config.layer_types: SphericalCache serves {FULL!r} and {SLIDING!r} "
                         f"layers, got {other}")
    if len(kinds) != text.num_hidden_layers:
        raise ValueError(f"config.layer_types names {len(kinds)} layers, the model has "
                         f"{text.num_hidden_layers}")
    if SLIDING in kinds and (window is None or int(window) < 1):
        raise ValueError(f"config.sliding_window must be a positive whole number for sliding "
                         f"layers, got {window!r}")
    return kinds, (None if SLIDING not in kinds else int(window))


def _tokens(query) -> int:
    """The query length ``get_mask_sizes`` is asked about: transformers < 5.3 passes the
    chunk's cache positions (a tensor), later ones the length."""
    return int(query.shape[0]) if isinstance(query, torch.Tensor) else int(query)


class _Layer(CacheLayerMixin):
    """One full-attention layer: dense tensors before compression, a pending chunk after.
    ``slot`` is its layer index in the context store (the model's full-attention layers,
    in order)."""

    is_sliding = False

    def __init__(self, owner: "SphericalCache", index: int, slot: int):
        super().__init__()
        self.owner, self.index, self.slot = owner, index, slot
        self.length = 0
        self.pending = None

    def lazy_initialization(self, key_states, value_states):
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if key_states.shape[0] != 1:
            raise ValueError(f"SphericalCache serves batch 1, got batch {key_states.shape[0]}")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.slot == 0 and self.owner.store is None:
            self.owner._pass_starts(self.length)      # may compress: the prefill is done
        if self.pending is not None:
            raise RuntimeError(f"layer {self.index}: the model's attention did not read the "
                               f"compressed store on the last forward pass (its attention is "
                               f"not 'spherical_kv'): call use_spherical_attention(model), or "
                               f"use `with spherical_kv(model, ...)`")
        self.length += key_states.shape[-2]
        if self.owner.store is None:
            self.keys = key_states if self.keys is None else torch.cat([self.keys, key_states], dim=-2)
            self.values = value_states if self.values is None else torch.cat([self.values, value_states], dim=-2)
            k, v = self.keys, self.values
            mode = "dense"
        else:
            self.pending = (key_states, value_states)
            k, v = key_states, value_states
            mode = "store"
        # The attention function finds its way back here through the returned tensor.
        k = k.view(k.shape)
        k._spherical_kv = (self.owner, self.index, mode)
        return k, v

    def get_mask_sizes(self, query):
        n = _tokens(query)
        if n == 0:      # what generate() leaves of ids the cache already holds
            raise ValueError(f"a forward pass of 0 new tokens (the cache holds {self.length}): "
                             f"generate() takes the whole sequence, the tokens the cache holds "
                             f"and at least one more")
        return self.length + n, 0

    def get_seq_length(self):
        return self.length

    def get_max_length(self):
        return -1

    get_max_cache_shape = get_max_length     # the same question under transformers < 5.3's name

    def reset(self):
        self.keys = self.values = None
        self.length = 0
        self.pending = None


class _Window(DynamicSlidingWindowLayer):
    """A sliding-window layer: transformers' own (its states, its mask sizes), batch 1, and
    taking a window given as float64 arrays (``SphericalCache.from_store``) in the model's
    dtype, and onto its device, at the first update."""

    def update(self, key_states, value_states, *args, **kwargs):
        if key_states.shape[0] != 1:
            raise ValueError(f"SphericalCache serves batch 1, got batch {key_states.shape[0]}")
        if self.is_initialized and (self.keys.dtype != key_states.dtype
                                    or self.keys.device != key_states.device):
            self.keys = self.keys.to(key_states.device, key_states.dtype)
            self.values = self.values.to(value_states.device, value_states.dtype)
        return super().update(key_states, value_states, *args, **kwargs)


@dataclasses.dataclass(frozen=True)
class HeldBytes:
    """What a ``SphericalCache`` holds, by kind of layer (bytes).

    store: the full-attention layers' context: the store's bytes after ``compress`` or
    ``set_store`` (Spherical KV: pages × page_bytes), before it their dense states at 2
    bytes a coordinate (bf16, the baseline every budget is a fraction of). window: the
    sliding-window layers' states (at most sliding_window − 1 per layer and kv-head, all
    a later token can see), 2 bytes a coordinate. store_layers, window_layers: the model
    layers each covers."""
    store: int
    window: int
    store_layers: tuple
    window_layers: tuple

    @property
    def total(self) -> int:
        return self.store + self.window


#: ``SphericalCache``'s budget when none is given: compress by hand, and warn if the cache
#: runs on past its prefill still dense (``budget_fraction=None`` says so without the warning)
_UNSET = object()


class SphericalCache(Cache):
    """A transformers ``Cache`` backed by a context store (batch 1).

    config: the model config (num_hidden_layers, num_attention_heads, num_key_value_heads,
    head_dim; layer_types and sliding_window for hybrid models; ValueError naming what is
    missing for any other config). observe: how many of the latest queries per
    full-attention layer to record for RDR's attention estimate: the prefill's last ones,
    rolled on by any tokens run before ``compress`` (so compressing after a few dense decode
    steps estimates from them).

    budget_fraction: the budget as a fraction in (0, 1] of the bf16 bytes of the
    full-attention layers' states (2 bytes a coordinate, keys and values: the bytes
    ``held_bytes().store`` counts while dense). Given, the cache compresses itself once
    the prefill is done: at the start of the next forward pass (in ``generate``, before the
    first generated token's), after ``defer`` more tokens if that is set. Left out, the cache
    waits for ``compress`` and warns if a forward pass runs on it past the prefill while it is
    still dense; ``budget_fraction=None`` compresses by hand without that warning. The
    budget holds when ``compress`` runs: tokens generated after it enter at the top tier
    and add their bytes (docs/paged.md, "Budgets").

    store_class: what holds the compressed context, called as ``store_class(kv, seq)`` with
    the ``SphericalKVCache`` and sequence id ``compress`` fills (default ``SphericalStore``,
    the NumPy reference; ``cupy_kernels.hf_store.GpuSphericalStore`` reads it through the GPU
    decode kernel). Other keyword arguments go to ``SphericalKVCache`` when ``compress``
    builds it (its ``softmax_scale`` defaults to the scale the model's attention used in the
    dense phase).

    Full-attention layers go to the store; sliding-window layers keep their window dense
    (module docstring). ``store_layers``: the model layers the store's layer indices
    0, 1, … stand for; ``window_layers``: the others."""

    def __init__(self, config, observe: int = 32, *, budget_fraction=_UNSET, defer: int = 0,
                 store_class: Optional[Callable] = None, **cache_kwargs):
        observe = whole("observe", observe, 0)
        text = _text_config(config)
        kinds, self.sliding_window = layer_kinds(config)
        self.num_layers = text.num_hidden_layers
        self.num_q_heads = text.num_attention_heads
        self.num_kv_heads = text.num_key_value_heads
        self.head_dim = getattr(text, "head_dim", None) or text.hidden_size // self.num_q_heads
        self.store_layers = tuple(i for i, k in enumerate(kinds) if k == FULL)
        self.window_layers = tuple(i for i, k in enumerate(kinds) if k == SLIDING)
        slot = {layer: j for j, layer in enumerate(self.store_layers)}
        super().__init__(layers=[_Layer(self, i, slot[i]) if k == FULL else
                                 _Window(sliding_window=self.sliding_window)
                                 for i, k in enumerate(kinds)])
        self.model_config = config
        self.observe = int(observe)
        self._warn_dense = budget_fraction is _UNSET
        self.budget_fraction = None if budget_fraction is _UNSET else budget_fraction
        if self.budget_fraction is not None:
            self.budget_fraction = _fraction("budget_fraction", self.budget_fraction)
            if not self.store_layers:
                raise ValueError("budget_fraction: the model has no full-attention layer, its "
                                 "sliding windows are all the cache holds: nothing to compress")
        self.defer = whole("defer", defer, 0)
        if store_class is not None and not callable(store_class):
            raise ValueError(f"store_class must be a class or callable (kv, seq) -> ContextStore, "
                             f"got {store_class!r}")
        self.store_class = store_class or SphericalStore
        self.cache_kwargs = cache_kwargs
        self._clear()

    def _clear(self) -> None:
        """The state a fresh cache starts in (``__init__``, ``reset``)."""
        self.observed: List[Optional[np.ndarray]] = [None] * self.num_layers
        self.scaling: Optional[float] = None
        self.store: Optional[ContextStore] = None
        self.kv: Optional[SphericalKVCache] = None
        self.seq: Optional[int] = None
        self.report = None            # the automatic compress's CompressReport
        self._prefill: Optional[int] = None    # tokens held when the first pass ended

    def _make_store(self, kv: SphericalKVCache, seq: int) -> ContextStore:
        """The context store over sequence ``seq`` of ``kv``: the one place a compressed
        store is made (``store_class``)."""
        return self.store_class(kv, seq)

    def _pass_starts(self, held: int) -> None:
        """Called by the first full-attention layer at every forward pass while dense, with
        the tokens it holds: compress once the prefill (and ``defer``) is done, or warn once
        that nothing will."""
        if held == 0:
            return
        if self._prefill is None:
            self._prefill = held
        if self.budget_fraction is None:
            if self._warn_dense:
                self._warn_dense = False
                warnings.warn("SphericalCache: a forward pass runs past the prefill and nothing "
                              "has compressed the cache, so it stays dense; pass "
                              "SphericalCache(config, budget_fraction=...) to compress after "
                              "the prefill, call compress(), or pass budget_fraction=None to "
                              "say the cache is compressed by hand", stacklevel=4)
            return
        if held - self._prefill >= self.defer:
            if self.scaling is None:
                raise ValueError("SphericalCache: the model's attention did not run through the "
                                 "'spherical_kv' attention during the prefill, so the cache "
                                 "cannot compress itself: call use_spherical_attention(model), "
                                 "or use `with spherical_kv(model, ...)`, before the prefill")
            try:
                self.report = self.compress(budget_fraction=self.budget_fraction)
            except ValueError as e:
                raise ValueError(f"SphericalCache(budget_fraction={self.budget_fraction}) could "
                                 f"not compress after the prefill of {held} tokens: {e}") from e

    # -- the Cache API transformers calls -----------------------------------------------
    def reset(self) -> None:
        """Empty the cache, compressed store included: the next forward pass is a new
        prefill and a later ``compress`` (or the automatic one) runs again."""
        super().reset()
        self._clear()

    def crop(self, max_length: int) -> None:
        """Drop tokens from the end of a dense cache: ``max_length`` < 0 drops that many,
        ``max_length`` >= 0 keeps the first ``max_length`` (transformers' two conventions).
        NotImplementedError once compressed (the store keeps no undo of its appends) or with
        sliding-window layers (a window cannot take back the states it dropped)."""
        n = self.get_seq_length(self.store_layers[0]) if self.store_layers else 0
        max_length = int(max_length)
        keep = n + max_length if max_length < 0 else min(max_length, n)
        if keep == n:
            return
        if self.store is not None:
            raise NotImplementedError("SphericalCache.crop: the cache is compressed and its "
                                      "store cannot drop tokens; reset() and prefill again")
        if self.window_layers:
            raise NotImplementedError("SphericalCache.crop: sliding-window layers cannot take "
                                      "back the states their window dropped")
        keep = max(keep, 0)
        for i in self.store_layers:
            lay = self.layers[i]
            if lay.keys is not None:
                lay.keys, lay.values = lay.keys[..., :keep, :], lay.values[..., :keep, :]
            lay.length = keep
        gone = n - keep
        self.observed = [None if o is None or o.shape[1] <= gone else o[:, :o.shape[1] - gone]
                         for o in self.observed]

    def _batch_one(self, what: str, rows) -> None:
        if rows != [0]:
            raise NotImplementedError(f"SphericalCache.{what}: the cache serves batch 1, so "
                                      f"beam search, num_return_sequences > 1 and batched "
                                      f"prompts are not supported")

    def batch_repeat_interleave(self, repeats: int) -> None:
        """A no-op for ``repeats`` = 1; NotImplementedError otherwise (batch 1)."""
        self._batch_one("batch_repeat_interleave", [0] * int(repeats))

    def reorder_cache(self, beam_idx) -> None:
        """A no-op for the identity order of batch 1; NotImplementedError otherwise."""
        self._batch_one("reorder_cache", [int(i) for i in torch.as_tensor(beam_idx).reshape(-1)])

    def batch_select_indices(self, indices) -> None:
        """A no-op for selecting the one row of batch 1; NotImplementedError otherwise."""
        self._batch_one("batch_select_indices", [int(i) for i in torch.as_tensor(indices).reshape(-1)])

    @classmethod
    def from_store(cls, config, store: ContextStore, length: int, windows=None, **kw):
        """A cache ``length`` tokens into a sequence whose full-attention layers read
        ``store`` (indexed by ``store_layers``) and whose sliding-window layers hold
        ``windows``: per window layer, in order, (keys, values) (num_kv_heads, n, d) arrays
        of its last n ≤ min(length, sliding_window − 1) post-RoPE states (what ``dense_kv``
        gives for that layer after a prefill of ``length`` tokens)."""
        cache = cls(config, **kw)
        length = whole("length", length, 1)
        _check_store(store, cache.num_q_heads, cache.num_kv_heads, len(cache.store_layers))
        windows = [] if windows is None else list(windows)
        if len(windows) != len(cache.window_layers):
            raise ValueError(f"windows: the model has {len(cache.window_layers)} sliding-window "
                             f"layers, got {len(windows)} windows")
        most = min(length, (cache.sliding_window or 1) - 1)
        for layer, (k, v) in zip(cache.window_layers, windows):
            k, v = torch.as_tensor(np.asarray(k))[None], torch.as_tensor(np.asarray(v))[None]
            if k.shape != v.shape or k.shape[1] != cache.num_kv_heads or k.shape[3] != cache.head_dim \
                    or k.shape[2] != most:
                raise ValueError(f"windows: layer {layer} needs keys and values of shape "
                                 f"({cache.num_kv_heads}, {most}, {cache.head_dim}), got "
                                 f"{tuple(k.shape[1:])} and {tuple(v.shape[1:])}")
        for layer, (k, v) in zip(cache.window_layers, windows):
            lay = cache.layers[layer]
            k, v = torch.as_tensor(np.asarray(k))[None], torch.as_tensor(np.asarray(v))[None]
            lay.lazy_initialization(k, v)
            lay.keys, lay.values = k, v
            lay.cumulative_length = length
        cache.set_store(store)
        for layer in cache.store_layers:
            lay = cache.layers[layer]
            lay.length = length
            lay.is_initialized = True
        return cache

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """transformers' ``Cache.update``, after checking the chunk: key_states and
        value_states finite floating tensors of one shape (1, num_kv_heads, T, head_dim),
        layer_idx a layer of the model (ValueError naming the argument, the cache unchanged)."""
        layer_idx = whole("layer_idx", layer_idx, 0, self.num_layers)
        want = (1, self.num_kv_heads, self.head_dim)
        for name, t in (("key_states", key_states), ("value_states", value_states)):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name} must be a torch tensor, got {type(t).__name__}")
            if not t.is_floating_point():
                raise ValueError(f"{name} must be a floating tensor, got {t.dtype}")
            if t.ndim != 4 or (t.shape[0], t.shape[1], t.shape[3]) != want:
                raise ValueError(f"{name} must have shape (1, {self.num_kv_heads}, T, "
                                 f"{self.head_dim}) (SphericalCache serves batch 1), got "
                                 f"{tuple(t.shape)}")
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"{name} contains NaN or Inf")
        if key_states.shape != value_states.shape:
            raise ValueError(f"key_states {tuple(key_states.shape)} and value_states "
                             f"{tuple(value_states.shape)} must have the same shape")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _spans(self, protect) -> list:
        """``compress``'s protect spans as [(start, stop)], each of whole numbers with
        0 <= start < stop <= the tokens held (ValueError naming protect otherwise)."""
        n = self.layers[self.store_layers[0]].length if self.store_layers else 0
        try:
            spans = [tuple(p) for p in protect]
        except TypeError:
            raise ValueError(f"protect must be a list of (start, stop) spans, got {protect!r}") from None
        for p in spans:
            try:
                if len(p) != 2:
                    raise ValueError
                a, b = (whole("start", p[0], 0), whole("stop", p[1], 0))
            except ValueError:
                raise ValueError(f"protect: a span must be (start, stop) whole numbers, got "
                                 f"{p!r}") from None
            if not a < b <= n:
                raise ValueError(f"protect: span [{a}, {b}) is not within the {n} tokens held "
                                 f"(0 <= start < stop <= {n})")
        return spans

    # -- dense phase ----------------------------------------------------------------
    def dense_kv(self, layer: int):
        """The dense post-RoPE keys and values of a layer, (num_kv_heads, n, d) float64: a
        full-attention layer's whole prefill (until compressed), a sliding-window layer's
        window (its last states, at most sliding_window − 1)."""
        lay = self.layers[whole("layer", layer, 0, self.num_layers)]
        if lay.keys is None or lay.keys.numel() == 0:
            raise ValueError(f"layer {layer} holds no dense states (nothing prefilled, or compressed)")
        return (lay.keys[0].detach().cpu().double().numpy(),
                lay.values[0].detach().cpu().double().numpy())

    def held_bytes(self) -> HeldBytes:
        """The bytes held, by kind of layer (``HeldBytes``)."""
        window = sum(2 * 2 * self.layers[i].keys.numel() for i in self.window_layers
                     if self.layers[i].keys is not None)
        if self.store is not None:
            store = self.store.nbytes()
        else:
            store = sum(2 * 2 * self.layers[i].keys.numel() for i in self.store_layers
                        if self.layers[i].keys is not None)
        return HeldBytes(int(store), int(window), self.store_layers, self.window_layers)

    def set_store(self, store: ContextStore) -> None:
        """Replace the full-attention layers' dense states by a context store (a baseline's,
        or Spherical KV's) whose layer j is model layer ``store_layers[j]``; the
        sliding-window layers keep their windows. ValueError naming ``store`` for anything but
        a ContextStore of the model's heads and full-attention layers."""
        _check_store(store, self.num_q_heads, self.num_kv_heads, len(self.store_layers))
        self.store = store
        for i in self.store_layers:
            self.layers[i].keys = self.layers[i].values = None

    def compress(self, budget_bytes: Optional[int] = None, protect: Sequence[tuple] = (),
                 ladder=None, method: str = "fast", *, budget_fraction: Optional[float] = None):
        """Move the full-attention layers' dense prefill into a ``SphericalKVCache``, protect
        the given token spans, run RDR to the budget (for those layers: the windows are not
        in it) and switch attention to the compressed states. Returns the ``CompressReport``.

        The budget is ``budget_bytes`` (an integer number of bytes; a float is refused, so
        0.25 is never read as 0 bytes) or ``budget_fraction`` in [0, 1] of the bf16 bytes of
        the full-attention layers' states (``held_bytes().store`` before compression). It
        holds now: tokens appended later add their bytes. On a refused budget the cache stays
        dense and usable."""
        if self.store is not None:
            raise ValueError("this cache is already compressed (reset() empties it)")
        protect = self._spans(protect)
        if not self.store_layers:
            raise ValueError("the model has no full-attention layer: its sliding windows are "
                             "all the cache holds, there is nothing to compress")
        n = self.layers[self.store_layers[0]].length
        if n == 0:
            raise ValueError("the cache holds no tokens yet: run the prefill through it first")
        if (budget_bytes is None) == (budget_fraction is None):
            raise ValueError("compress needs exactly one of budget_bytes (bytes) and "
                             "budget_fraction (a fraction of the bf16 bytes)")
        if budget_fraction is not None:
            f = _fraction("budget_fraction", budget_fraction, zero=True)
            budget_bytes = int(np.floor(f * self.held_bytes().store))
        kw = dict(self.cache_kwargs)
        if ladder is not None:
            kw["ladder"] = ladder
        kw["policy"] = observing(kw.get("policy"), self.observe)
        if self.scaling is not None:
            kw.setdefault("softmax_scale", self.scaling)
        if "rope_inv_freq" not in kw:
            kw["rope_inv_freq"] = rope_frequencies(self.model_config)
        L = len(self.store_layers)
        if "pool_bytes" not in kw:
            kw["pool_bytes"] = max(4 << 20, 2 * L * self.num_kv_heads * n * 4 * self.head_dim)
        kv = SphericalKVCache(L, self.num_kv_heads, self.head_dim,
                              num_q_heads=self.num_q_heads, **kw)
        keys, values = zip(*[self.dense_kv(layer) for layer in self.store_layers])
        seq = fill_cache(kv, keys, values, [self.observed[layer] for layer in self.store_layers],
                         protect)
        report = kv.compress(seq, budget_bytes, method=method)
        self.kv, self.seq = kv, seq
        self.set_store(self._make_store(kv, seq))
        return report


def _fraction(name: str, f, zero: bool = False) -> float:
    """``f`` as a float in (0, 1] (with ``zero``: [0, 1]); ValueError naming ``name``
    otherwise."""
    ok = (not isinstance(f, (bool, np.bool_)) and isinstance(f, (int, float, np.integer, np.floating))
          and (0.0 <= float(f) if zero else 0.0 < float(f)) and float(f) <= 1.0)
    if not ok:
        raise ValueError(f"{name} must be a fraction of the bf16 bytes in "
                         f"{'[0' if zero else '(0'}, 1], got {f!r}")
    return float(f)


# ------------------------------------------------------------------------- attention

def spherical_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The attention function registered as ``"spherical_kv"`` (batch 1).

    Dense phase (and sliding-window layers): sdpa with the mask transformers built, plus
    recording the trailing queries. Store phase: the chunk's queries attend to the store
    (compressed context) and causally to the chunk itself."""
    handle = getattr(key, "_spherical_kv", None)
    if handle is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    owner, layer, mode = handle
    scale = float(scaling) if scaling is not None else 1.0 / np.sqrt(query.shape[-1])
    if mode == "dense":
        owner.scaling = scale
        if owner.observe:         # the latest queries, across chunks (a prefill, then decode steps)
            new = query[0, :, -owner.observe:].detach().cpu().double().numpy()
            old = owner.observed[layer]
            owner.observed[layer] = new if old is None else \
                np.concatenate([old, new], axis=1)[:, -owner.observe:]
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    lay = owner.layers[layer]
    # the store is NumPy: a model on a GPU hands it its queries and states on the CPU
    q = query[0].detach().cpu().double().numpy()                 # (nq, T, d)
    k_new, v_new = (t[0].detach().cpu().double().numpy() for t in lay.pending)
    store = owner.store
    G = store.num_q_heads // store.num_kv_heads
    out_s, lse_s = store.attend(lay.slot, q, scale)
    # A chunk reads its earlier tokens as the store holds them and itself exactly, so a
    # chunk of T tokens computes what T one-token steps compute.
    k_held, v_held = store.append(lay.slot, k_new, v_new)
    lay.pending = None
    out_c = np.empty(q.shape)
    lse_c = np.empty(q.shape[:2])
    exact = k_held is k_new and v_held is v_new       # the store keeps the chunk as given
    for h in range(store.num_kv_heads):
        sl = slice(h * G, (h + 1) * G)
        out_c[sl], lse_c[sl] = (_softmax_part(q[sl], k_new[h], v_new[h], scale, causal_offset=0)
                                if exact else
                                _chunk_part(q[sl], k_new[h], v_new[h], k_held[h], v_held[h], scale))
    out, _ = merge_attention(out_s, lse_s, out_c, lse_c)
    res = torch.from_numpy(out).to(query.device, query.dtype).transpose(0, 1).unsqueeze(0).contiguous()
    return res, None


def select_attention(model, name: str, fn=None) -> None:
    """Select attention implementation ``name`` for ``model`` and every sub-config; with
    ``fn``, register it under that name first, with sdpa's mask function (masks are built per
    attention implementation: without one, transformers builds none, and sliding windows and
    causal masks from an offset are lost)."""
    if fn is not None:
        AttentionInterface.register(name, fn)
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.config._attn_implementation = name
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = name


def use_spherical_attention(model) -> None:
    """Register ``spherical_attention`` (with sdpa's mask function) and select it for
    ``model`` (``select_attention``)."""
    select_attention(model, ATTENTION_NAME, spherical_attention)


def _attention_configs(model) -> list:
    """The model's config and every sub-config that names an attention implementation,
    each once."""
    found = {id(model.config): model.config}
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            found.setdefault(id(cfg), cfg)
    return list(found.values())


@contextlib.contextmanager
def spherical_kv(model, budget_fraction: float = 0.2, **cache_kwargs):
    """Within the block, ``model.generate`` runs on a compressed cache and the model's
    attention is ``spherical_kv``; on exit both are as they were::

        with spherical_kv(model, budget_fraction=0.2) as caches:
            out = model.generate(ids, max_new_tokens=32)
        caches[-1].held_bytes()

    Each ``generate`` call without ``past_key_values`` gets a fresh
    ``SphericalCache(model.config, budget_fraction=budget_fraction, **cache_kwargs)``,
    which compresses itself after the prefill (its budget: a fraction in (0, 1] of the bf16
    bytes of the full-attention layers' states); the block yields the list of those caches,
    in call order. A ``past_key_values`` given to ``generate`` is used as it is. The
    config and the budget are checked on entry (ValueError). Other uses of the model (a
    plain forward pass) only see the attention switched: it is sdpa's until a
    ``SphericalCache`` is passed."""
    budget_fraction = _fraction("budget_fraction", budget_fraction)
    SphericalCache(model.config, budget_fraction=budget_fraction, **cache_kwargs)  # the checks
    saved = [(c, c._attn_implementation) for c in _attention_configs(model)]
    own = model.__dict__.get("generate")
    inner = model.generate
    caches: List[SphericalCache] = []

    @functools.wraps(inner)
    def generate(*args, **kwargs):
        if kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None:
            return inner(*args, **kwargs)
        cache = SphericalCache(model.config, budget_fraction=budget_fraction, **cache_kwargs)
        caches.append(cache)
        with warnings.catch_warnings():
            # transformers 5.24 and later also read ``cache=`` and warn about the old name;
            # 5.2 reads only ``past_key_values=``
            warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated")
            return inner(*args, past_key_values=cache, **kwargs)

    use_spherical_attention(model)
    model.generate = generate
    try:
        yield caches
    finally:
        for cfg, impl in saved:
            cfg._attn_implementation = impl
        if own is None:
            del model.generate
        else:
            model.generate = own
