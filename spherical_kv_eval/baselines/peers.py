"""Peer baselines run by their own library: kvpress's presses (docs/baselines.md "Peers").

kvpress (PyPI ``kvpress``, NVIDIA; the optional extra ``peers``) compresses a transformers
model's cache during the prefill: a press is a context manager that hooks every attention
layer and, after the layer's forward, replaces the layer's cached keys/values by the ones it
keeps (``ScorerPress``: top-k of the press's own scores), or, for AdaKV, marks the pruned
(head, position) pairs in ``module.masked_key_indices``. :meth:`KVPressMethod.select` runs
exactly that (the press's own code, on the model's own prefill) and reads back which
prefill states each (layer, kv-head) kept; :meth:`KVPressMethod.compress` then stores those
states the way every evicting baseline here does (bf16, evicted ones absent) and counts
their bytes with the same accounting:

* ``per-head`` presses (SnapKV, ExpectedAttention, TOVA, KNorm, ObservedAttention): n states
  per kv-head, each with its int32 position: ``H·n·(2·d·2 + 4)`` per layer;
* ``pattern`` (StreamingLLM): the same sinks + recent window in every head, two int32 per
  layer: ``H·n·2·d·2 + 8``;
* ``ragged`` (AdaKV): a different count per head, H·n states in all, each with its position,
  plus one int32 count per head: ``H·n·(2·d·2 + 4) + 4·H``.

n is the largest count the layer's share of the budget pays for (as in ``eviction.py``) and
the press gets the ``compression_ratio`` that makes kvpress keep exactly n
(``int(T · (1 − ratio)) = n``). A press that keeps a state the prefill did not produce (one
that merges or edits states) is refused, not approximated.

Without kvpress these methods do not exist: :func:`peer_methods` raises
:class:`PeersUnavailable` saying how to install it; nothing is substituted.

transformers' own quantized cache (``QuantizedCache``) is the other peer here:
:class:`QuantizedCacheMethod` quantizes each layer's prefill keys and values with the cache's
own layer (``update``, as the model's prefill would call it) through a backend that installs
without a GPU (HQQ; quanto's CPU extension builds for about 20 minutes), and counts the bytes
of the tensors the library keeps. Without the backend it raises :class:`PeersUnavailable`.
"""
from __future__ import annotations

import contextlib
import importlib.util
from dataclasses import dataclass, field

import numpy as np

from .base import BF16_BYTES, INDEX_BYTES, CompressedLayer, KVMethod, check_budget
from .eviction import Evictor, budget_label, kept_layer

__all__ = ["PEER_LINEUP", "PRESSES", "KVPressMethod", "PeersUnavailable", "PressSelection",
           "QUANTIZED_CACHE_BITS", "QuantizedCacheMethod", "kvpress_available", "peer_methods",
           "quantized_cache_available", "quantized_cache_methods"]

OBSERVE = 32   # SnapKV's observation window, the same as the project's SnapKV and RDR's


class PeersUnavailable(ImportError):
    """kvpress is not installed; the message says how to install it."""


def kvpress_available() -> bool:
    """Whether kvpress can be imported (without importing it: the import patches
    transformers' attention functions)."""
    return importlib.util.find_spec("kvpress") is not None


def _kvpress():
    if not kvpress_available():
        raise PeersUnavailable(
            "the kvpress baselines need the Python package 'kvpress' "
            "(pip install 'spherical-kv[peers]', or pip install kvpress==0.5.5); without it "
            "they are left out")
    import kvpress
    _unpatch_attention()
    return kvpress


def _unpatch_attention() -> None:
    """Undo what importing kvpress does to transformers' attention functions.

    kvpress wraps every registered attention function (in the interface's local mapping)
    so that AdaKV can mask pruned keys while decoding through kvpress's own cache. This
    adapter never decodes that way (it reads AdaKV's mask after the prefill and stores the
    kept states itself), and the wrapper passes ``dropout`` positionally, which an
    attention function with another signature (the ``spherical_kv`` one of
    ``spherical_kv_ref.hf``) cannot take; so the wrappers are removed and every name
    resolves to its registered function again."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    local = ALL_ATTENTION_FUNCTIONS._local_mapping
    for name in [n for n, f in local.items()
                 if getattr(f, "__module__", "") == "kvpress.attention_patch"]:
        del local[name]


@dataclass(frozen=True)
class PressSpec:
    """One kvpress press: its class, keyword arguments, the layout of what it keeps
    (``per-head``, ``pattern`` or ``ragged``), the attention implementation it needs and,
    for AdaKV, the key of the scorer it wraps."""
    cls: str
    layout: str
    kwargs: dict = field(default_factory=dict)
    attention: str = "sdpa"
    inner: str | None = None


PRESSES = {
    "snapkv": PressSpec("SnapKVPress", "per-head", {"window_size": OBSERVE}),
    "streamingllm": PressSpec("StreamingLLMPress", "pattern", {"n_sink": 4}),
    "expected": PressSpec("ExpectedAttentionPress", "per-head"),
    "tova": PressSpec("TOVAPress", "per-head"),
    "knorm": PressSpec("KnormPress", "per-head"),
    "observed": PressSpec("ObservedAttentionPress", "per-head", attention="eager"),
    "adakv-expected": PressSpec("AdaKVPress", "ragged", inner="expected"),
    "adakv-snapkv": PressSpec("AdaKVPress", "ragged", inner="snapkv"),
}
PEER_LINEUP = ("snapkv", "streamingllm", "expected", "tova", "knorm", "observed",
               "adakv-expected")


@dataclass
class PressSelection:
    """What a press kept of one prefill: per layer a (kv_heads, T) bool mask."""
    keep: list

    def check(self, keys) -> None:
        if len(self.keep) != len(keys):
            raise ValueError(f"the selection covers {len(self.keep)} layers, the cache has "
                             f"{len(keys)}")
        for l, (m, k) in enumerate(zip(self.keep, keys)):
            if m.shape != k.shape[:2]:
                raise ValueError(f"layer {l}: selection {m.shape} does not match the cache's "
                                 f"(kv_heads, T) = {k.shape[:2]}")


@contextlib.contextmanager
def _attention(model, name: str):
    """Run ``model`` with the transformers attention implementation ``name``, then restore."""
    configs = {id(c): c for c in [model.config] + [getattr(m, "config", None)
                                                   for m in model.modules()]
               if c is not None and hasattr(c, "_attn_implementation")}
    saved = [(c, c._attn_implementation) for c in configs.values()]
    try:
        for c, _ in saved:
            c._attn_implementation = name
        yield
    finally:
        for c, impl in saved:
            c._attn_implementation = impl


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def _kept_positions(dense_k, dense_v, kept_k, kept_v) -> np.ndarray:
    """(H, T) mask of the prefill states (rows of dense_k/dense_v, (H, T, d)) that the
    kept rows are exact copies of; RuntimeError for a kept row that is none of them."""
    H, T, _ = dense_k.shape
    keep = np.zeros((H, T), dtype=bool)
    for h in range(H):
        where: dict = {}
        for t, row in enumerate(np.concatenate([dense_k[h], dense_v[h]], axis=1)):
            where.setdefault(row.tobytes(), []).append(t)
        for row in np.concatenate([kept_k[h], kept_v[h]], axis=1):
            slot = where.get(row.tobytes())
            if not slot:
                raise RuntimeError("a kept state is none of the prefill's states: the press "
                                   "changed them (only evicting presses fit this adapter)")
            keep[h, slot.pop(0)] = True
    return keep


class KVPressMethod(Evictor):
    """A kvpress press at a byte budget (a fraction of the dense bf16 cache).

    ``select(model, input_ids)`` runs the press on the model's prefill and returns a
    :class:`PressSelection`; ``compress(keys, values, selection)`` keeps those states of the
    prefill cache in bf16 (the :class:`KVMethod` interface, the selection in the place of
    the statistics). ``press``: a key of :data:`PRESSES`; ``press_kwargs`` override the
    press's arguments (``inner_kwargs`` AdaKV's wrapped scorer's).
    """

    needs_stats = True

    def __init__(self, press: str, budget: float, press_kwargs=None, inner_kwargs=None):
        if press not in PRESSES:
            raise ValueError(f"press must be one of {sorted(PRESSES)}, got {press!r}")
        self.budget = check_budget(budget)
        self.press, self.spec = press, PRESSES[press]
        self.press_kwargs = {**self.spec.kwargs, **(press_kwargs or {})}
        self.inner_kwargs = ({**PRESSES[self.spec.inner].kwargs, **(inner_kwargs or {})}
                             if self.spec.inner else None)
        self.per_state_meta = 0 if self.spec.layout == "pattern" else INDEX_BYTES
        self.per_layer_meta = 2 * INDEX_BYTES if self.spec.layout == "pattern" else 0
        self.name = f"kvpress-{press}@{budget_label(self.budget)}"
        self.family = f"kvpress-{press}"

    def _layer_meta(self, H: int) -> int:
        return H * INDEX_BYTES if self.spec.layout == "ragged" else self.per_layer_meta

    def tokens_per_head(self, H: int, T: int, d: int) -> int:
        """States per kv-head (on average, for AdaKV) the layer's budget pays for (<= T)."""
        state = 2 * d * BF16_BYTES + self.per_state_meta
        n = (self.layer_budget_bytes(H, T, d) - self._layer_meta(H)) // (H * state)
        return int(min(T, max(0, n)))

    @staticmethod
    def compression_ratio(T: int, n: int) -> float:
        """The kvpress ``compression_ratio`` under which a press keeps n of T states:
        kvpress keeps ``int(T · (1 − ratio))``, so aim at n + 1/2 (safe from rounding)."""
        return 0.0 if n >= T else 1.0 - (n + 0.5) / T

    def make_press(self, compression_ratio: float):
        """The kvpress press object at ``compression_ratio``."""
        kvpress = _kvpress()
        if self.spec.inner:
            inner = PRESSES[self.spec.inner]
            scorer = getattr(kvpress, inner.cls)(compression_ratio=compression_ratio,
                                                 **self.inner_kwargs)
            return getattr(kvpress, self.spec.cls)(press=scorer, **self.press_kwargs)
        return getattr(kvpress, self.spec.cls)(compression_ratio=compression_ratio,
                                               **self.press_kwargs)

    def select(self, model, input_ids) -> PressSelection:
        """Run the press on the prefill of ``input_ids`` ((T,) or (1, T) token ids) through
        ``model`` (a transformers causal LM kvpress supports) and read back what it kept."""
        _kvpress()
        import torch
        from transformers import DynamicCache
        # on whatever device the model is (a CUDA copy runs the presses' prefills far faster;
        # what was kept comes back to the host)
        ids = torch.as_tensor(np.asarray(input_ids)).reshape(1, -1).to(model.device)
        cfg = model.config
        H, T, d = cfg.num_key_value_heads, ids.shape[1], _head_dim(cfg)
        n = self.tokens_per_head(H, T, d)
        if n < 1:
            raise ValueError(f"budget {self.budget} pays for no state per kv-head at T={T}")
        press = self.make_press(self.compression_ratio(T, n))
        layers = model.model.layers
        dense = [None] * len(layers)

        def record(idx):
            def hook(module, args, kwargs, output):   # runs before the press's own hook
                lay = kwargs["past_key_values"].layers[idx]
                dense[idx] = (_host(lay.keys[0]), _host(lay.values[0]))
            return hook

        handles = [layer.self_attn.register_forward_hook(record(i), with_kwargs=True)
                   for i, layer in enumerate(layers)]
        _clear_masks(layers)
        cache = DynamicCache()
        try:
            with _one_eager_prefill(model.device, self.spec.attention), \
                    _attention(model, self.spec.attention), press(model), torch.no_grad():
                model.model(ids, past_key_values=cache, use_cache=True)
            keep = []
            for i, layer in enumerate(layers):
                masked = getattr(layer.self_attn, "masked_key_indices", None)
                if masked is not None:           # AdaKV: the cache is whole, pruned ones marked
                    m = np.ones((H, T), dtype=bool)
                    _, heads, pos = (t.cpu().numpy() for t in masked)
                    m[heads, pos] = False
                else:
                    lay = cache.layers[i]
                    m = _kept_positions(*dense[i], _host(lay.keys[0]), _host(lay.values[0]))
                keep.append(m)
        finally:
            for h in handles:
                h.remove()
            _clear_masks(layers)
        return PressSelection(keep)

    def _compress_layer(self, layer, keys, values, selection):
        H, T, d = keys.shape
        keep = selection.keep[layer]
        counts = keep.sum(axis=1)
        n = self.tokens_per_head(H, T, d)
        if keep.all():
            return kept_layer(keys, values, keep, H * T * 2 * d * BF16_BYTES)
        layout = self.spec.layout
        if layout == "ragged":
            if counts.sum() != H * n:
                raise RuntimeError(f"{self.name}: layer {layer} kept {counts.sum()} states, "
                                   f"the budget pays for {H * n}")
            nbytes = int(counts.sum()) * (2 * d * BF16_BYTES + INDEX_BYTES) + H * INDEX_BYTES
        else:
            if not np.array_equal(counts, np.full(H, n)):
                raise RuntimeError(f"{self.name}: layer {layer} kept {counts} states per head, "
                                   f"the budget pays for {n}")
            if layout == "pattern" and not _is_sinks_and_recent(keep):
                raise RuntimeError(f"{self.name}: layer {layer} kept no sinks + recent pattern")
            nbytes = self.layer_bytes(H, T, d, n)
        if nbytes > self.layer_budget_bytes(H, T, d):
            raise RuntimeError(f"{self.name}: layer {layer} needs {nbytes} bytes, over its "
                               f"budget of {self.layer_budget_bytes(H, T, d)}")
        return kept_layer(keys, values, keep, nbytes)


@contextlib.contextmanager
def _one_eager_prefill(device, attention):
    """Hold the block alone among this machine's processes when it runs an eager-attention
    prefill on a GPU, and hand the allocator's blocks back after it.

    Eager attention materialises every head's (T, T) weights: 9 x 8192^2 float32 (2.4 GB)
    per layer for SmolLM2 at 8K, about 7 GB at the peak with its softmax and mask. Each
    worker of a parallel run kept that much reserved after its first such press, and eight
    workers ran an 80 GB GPU out of memory; one at a time, each worker holds only what its
    other methods need (~2-3 GB). On the CPU, or with another attention, the block runs as
    it is."""
    if device.type != "cuda" or attention != "eager":
        yield
        return
    import fcntl
    import os
    import tempfile
    import torch
    path = os.path.join(tempfile.gettempdir(), "spherical_kv_eager_prefill.lock")
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            torch.cuda.empty_cache()
            fcntl.flock(lock, fcntl.LOCK_UN)


def _host(t) -> np.ndarray:
    """A torch tensor of the cache as a float32 NumPy array of its own."""
    return t.float().cpu().numpy().copy()


def _clear_masks(layers) -> None:
    """Drop AdaKV's marks of pruned keys (read once per prefill, never left behind)."""
    for layer in layers:
        if hasattr(layer.self_attn, "masked_key_indices"):
            layer.self_attn.masked_key_indices = None


def _is_sinks_and_recent(keep: np.ndarray) -> bool:
    """Every head keeps the same set: a prefix and a suffix of the positions."""
    if not (keep == keep[0]).all():
        return False
    dropped = np.flatnonzero(~keep[0])      # one contiguous block of evicted positions
    return dropped.size == 0 or dropped[-1] - dropped[0] + 1 == dropped.size


def peer_methods(budgets, presses=PEER_LINEUP) -> list[KVPressMethod]:
    """Every press of ``presses`` at every budget; :class:`PeersUnavailable` without kvpress."""
    _kvpress()
    return [KVPressMethod(p, b) for b in budgets for p in presses]


# ----------------------------------------------------------------------------- QuantizedCache

QUANTIZED_CACHE_BITS = (4, 2)   # the evaluation's points: 28 % and 16 % of the bytes at d = 64


def quantized_cache_available(backend: str = "hqq") -> bool:
    """Whether transformers' ``QuantizedCache`` can run with ``backend`` here."""
    return backend == "hqq" and importlib.util.find_spec("hqq") is not None


class QuantizedCacheMethod(KVMethod):
    """transformers' ``QuantizedCache`` with the HQQ backend at ``nbits``: groups of 64
    (the library's default) with a bf16 scale and zero point each, HQQ's own optimised
    rounding, along ``axis`` = 1 for keys and values: HQQ's recommended setting (its own
    documentation: "start with nbits=4, group_size=64, axis=1"), where a group is one head
    vector of 64 channels. The cache's default axis 0 reshapes the flat (1, H, T, d) tensor to
    (64, -1), so a group gathers one element from every (H·T·d)/64-th position, states far apart
    that share no scale. On one 1024-token window of the evaluation's corpus, SmolLM2's
    next-token KL was 0.033 with axis 0 against 0.0085 with axis 1 at 4 bits, and 1.07
    against 1.18 at 2 bits (keys on axis 0 and values on axis 1: 0.020 and 0.58); ``axis``
    takes either.

    Each layer's prefill keys and values go to the library's cache layer in bf16 (as a bf16
    model hands them to its cache) through ``update``, the call a prefill makes: the first
    update quantizes all it is given, so the whole prefill is held quantized; the states the
    model attends with are what the next ``update`` returns, the library's dequantization.
    Later tokens are appended in full precision, as with every method of the evaluation
    (the library's residual of 128 tokens would hold them so too, up to 128).

    Bytes: those of the tensors the library keeps, the packed codes and each group's scale
    and zero point: ``nbits/8 + 4/64`` bytes per element (28.1 % of bf16 at 4 bits, 15.6 % at
    2). ``device``: where the quantization runs (``"cuda"`` is far faster than a CPU core).
    """

    def __init__(self, nbits: int = 4, backend: str = "hqq", device: str = "cpu", axis: int = 1):
        if axis not in (0, 1):
            raise ValueError(f"HQQ quantizes along axis 0 or 1, got {axis}")
        if backend != "hqq":
            raise ValueError(f"only the hqq backend runs here (quanto needs its C++ extension "
                             f"built), got {backend!r}")
        if nbits not in (1, 2, 3, 4, 8):
            raise ValueError(f"HQQ quantizes to 1, 2, 3, 4 or 8 bits, got {nbits}")
        self.nbits, self.backend, self.device, self.axis = int(nbits), backend, str(device), axis
        self.name = f"hf-{backend}{nbits}" + ("" if axis == 1 else f"-axis{axis}")
        self.family = f"hf-quantized-{backend}"

    def _layer(self):
        if not quantized_cache_available(self.backend):
            raise PeersUnavailable(
                "transformers' QuantizedCache with the HQQ backend needs the Python package "
                "'hqq' (pip install 'spherical-kv[peers]', or pip install hqq==0.2.8.post1)")
        from transformers.cache_utils import HQQQuantizedLayer
        return HQQQuantizedLayer(nbits=self.nbits, axis_key=self.axis, axis_value=self.axis)

    def _compress_layer(self, layer, keys, values, stats):
        import torch
        H, T, d = keys.shape
        group = 64                                  # the library's default q_group_size
        if keys.size % group:
            raise ValueError(f"{self.name}: a layer's {keys.size} key elements do not fill "
                             f"groups of {group}")
        cache = self._layer()

        def model_side(x):                          # (H, T, d) -> (1, H, T, d) bf16 on device
            return torch.as_tensor(x)[None].to(device=self.device, dtype=torch.bfloat16)

        k, v = model_side(keys), model_side(values)
        with torch.no_grad():
            cache.update(k, v)                      # the prefill's update: all quantized
            k_hat, v_hat = cache.update(k[:, :, :0], v[:, :, :0])   # what attention reads
        nbytes = sum(int(q.nbytes + meta["scale"].nbytes + meta["zero"].nbytes)
                     for q, meta in (cache._quantized_keys, cache._quantized_values))
        return CompressedLayer(_host(k_hat[0]), _host(v_hat[0]), np.ones((H, T), dtype=bool),
                               nbytes)


def quantized_cache_methods(bits=QUANTIZED_CACHE_BITS, device: str = "cpu"):
    """transformers' QuantizedCache (HQQ) at each of ``bits``; :class:`PeersUnavailable`
    without hqq."""
    methods = [QuantizedCacheMethod(b, device=device) for b in bits]
    methods[0]._layer()                             # fail here, before any work, without hqq
    return methods
