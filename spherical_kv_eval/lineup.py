"""The evaluation's line-up: the methods every window runs (the project's baselines,
kvpress's presses and transformers' QuantizedCache where installed, Spherical KV at fixed
tiers and with RDR), what one dense prefill leaves them (``Prefill``) and the context stores
they build from it (``spherical-kv evaluate``, docs/evaluate.md)."""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from spherical_kv_ref.cache import CompressPolicy, SphericalKVCache
from spherical_kv_ref.tiers import TierLadder

OBSERVE = 32          # trailing prefill queries: SnapKV's window and RDR's estimate
PREFILL_CHUNK = 2048  # prefill chunk (tokens) of a sliding-window model (Runner)


@dataclass
class Method:
    """One line-up entry: ``build(prefill) -> (store, nbytes)``; ``budget`` a fraction of
    the dense bf16 bytes or None for native points; ``family`` for the table and plot."""
    name: str
    family: str
    budget: Optional[float]
    build: Callable
    protects: bool = False       # can keep a caller-marked span (the retrieval probe)


class Infeasible(ValueError):
    """A budget the sliding-window layers' windows alone exceed (they are kept as the model
    holds them, so nothing is left for the full-attention layers)."""


@dataclass
class Prefill:
    """What one dense prefill leaves. ``keys``/``values`` (kv_heads, T, d), ``queries``
    (the trailing ones, (q_heads, w, d)) and ``stats`` cover the full-attention layers
    only (``store_layers``: the model layers they are; every layer for a model without
    sliding windows): they are what every method compresses. ``windows``: per
    sliding-window layer (``window_layers``), its dense (keys, values) as the model holds
    them (the last sliding_window − 1 states), the same for every method. ``last_logits``:
    the logits of the last context position; ``scale``: the model's softmax scale."""
    keys: list
    values: list
    queries: list
    stats: object
    last_logits: np.ndarray
    length: int
    trailing_queries: Optional[list] = None     # more of the last queries, when asked for
    ids: Optional[np.ndarray] = None            # the context's tokens and the model that ran
    model: object = None                        # them (the kvpress baselines prefill again)
    windows: list = dataclasses.field(default_factory=list)
    store_layers: tuple = ()
    window_layers: tuple = ()
    scale: Optional[float] = None
    window_bits: int = 16                       # the windows' storage: 16 = bf16, else the codec
    exact_windows: Optional[list] = None        # the model's own windows, when those are coded
    device: object = None                       # where the dense stores live (None: NumPy)
    # Spherical KV caches filled from this prefill, before any protection or compression,
    # by their settings (``_spherical_store``): every RDR point of a unit starts from a copy
    filled: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def reference(self) -> "Prefill":
        """This prefill with the model's own windows: what the dense reference (ΔPPL, KL,
        the dense greedy run) reads, so coded windows show as a cost of every method."""
        if self.exact_windows is None:
            return self
        return dataclasses.replace(self, windows=self.exact_windows, window_bits=16,
                                   exact_windows=None)

    @property
    def store_dense_bytes(self) -> int:
        """The full-attention layers' dense bf16 cache: keys and values, 2 bytes a coordinate."""
        H, T, d = self.keys[0].shape
        return 2 * len(self.keys) * H * T * d * 2

    @property
    def window_dense_bytes(self) -> int:
        """The sliding-window layers' windows at bf16."""
        return sum(2 * k.size * 2 for k, _ in self.windows)

    @property
    def window_bytes(self) -> int:
        """The windows as every method holds them: bf16, or with ``window_bits`` < 16 the
        spherical codec's codes and fp16 scales, plus each row's float32 means."""
        if self.window_bits >= 16:
            return self.window_dense_bytes
        from spherical_kv_ref.codec import vector_bytes
        total = 0
        for k, _ in self.windows:
            H, n, d = k.shape
            total += 2 * H * n * vector_bytes(self.window_bits, d) + 2 * H * d * 4
        return total

    @property
    def dense_bytes(self) -> int:
        """The dense bf16 cache of the prefill as the model holds it, every layer: the
        full-attention layers' T states and the windows. Every budget and bytes fraction is
        of this total (docs/evaluate.md "Sliding-window models")."""
        return self.store_dense_bytes + self.window_dense_bytes

    def store_budget(self, fraction: float) -> float:
        """The bytes left to the full-attention layers by a budget of ``fraction`` of the
        total: fraction · dense_bytes − window_bytes; ``Infeasible`` where nothing is left."""
        left = fraction * self.dense_bytes - self.window_bytes
        if left <= 0:
            raise Infeasible(f"a budget of {100 * fraction:g} % ({fraction * self.dense_bytes:.0f} "
                             f"bytes) is not above the sliding windows' {self.window_bytes} bytes")
        return left


def _dense_store(keys, values, keep, num_q_heads, nbytes, device=None):
    """The kept states as a ``DenseStore`` (NumPy), or with a torch ``device`` as its twin
    holding them there (``device_store.DeviceDenseStore``)."""
    from spherical_kv_ref.hf import DenseStore
    k = [[kl[h][keep_l[h]] for h in range(kl.shape[0])] for kl, keep_l in zip(keys, keep)]
    v = [[vl[h][keep_l[h]] for h in range(vl.shape[0])] for vl, keep_l in zip(values, keep)]
    if device is None:
        return DenseStore(k, v, num_q_heads, nbytes)
    from spherical_kv_eval.device_store import DeviceDenseStore
    return DeviceDenseStore(k, v, num_q_heads, nbytes, device=device)


def _rdr_policy(recent: int = 32) -> CompressPolicy:
    """The evaluation's RDR protection: 4 sinks, the last ``recent`` tokens, the attention
    estimate from the last OBSERVE prefill queries."""
    return CompressPolicy(sinks=4, recent=recent, window=OBSERVE)


def page_bytes_for(head_dim: int) -> int:
    """The evaluation's page size: 2 KiB at head_dim 64 (SmolLM2), scaled with head_dim
    above it (8 KiB at 256, Gemma-3), so a page holds about as many states of a tier at
    every head_dim and the padding inside a page stays small: at head_dim 256 a 2 KiB page
    holds 3 states of the 8/8 tier (516 bytes each: 24 % of the page unused) and 7 of 4/4
    (11 %), against 15 and 30 states (3 % and 0.4 %) at head_dim 64."""
    return 2048 * max(1, int(head_dim) // 64)


def _spherical_store(prefill: Prefill, cfg, ladder, budget_bytes, *, protect=(), centre=True,
                     policy=None, page_bytes=None, seed=0, extra_tokens=512):
    from spherical_kv_ref.hf import SphericalStore, fill_cache, observing, rope_frequencies
    L = len(prefill.keys)
    H, T, d = prefill.keys[0].shape
    page_bytes = page_bytes or page_bytes_for(d)
    # room for the context and the tokens scoring/generation append (at the top tier)
    per_page = max(1, page_bytes // ladder.bytes_per_state(ladder.top, d))
    pool = (L * H * ((T + extra_tokens) // per_page + len(ladder) + 2) + 16) * page_bytes
    policy = observing(policy or _rdr_policy(), prefill.queries[0].shape[1])
    # the same prefill encoded with the same settings is the same cache: encoded once per
    # unit, each method compresses its own copy (fill_cache then protect, as in one call)
    key = (tuple(ladder.tiers), centre, policy, page_bytes, seed, pool, cfg.num_attention_heads)
    if key not in prefill.filled:
        kv = SphericalKVCache(L, H, d, ladder, page_bytes=page_bytes, pool_bytes=pool, seed=seed,
                              num_q_heads=cfg.num_attention_heads, centre=centre,
                              softmax_scale=prefill.scale, rope_inv_freq=rope_frequencies(cfg),
                              policy=policy)
        prefill.filled[key] = (kv, fill_cache(kv, prefill.keys, prefill.values, prefill.queries))
    kv, seq = copy.deepcopy(prefill.filled[key])
    for a, b in protect:
        kv.protect(seq, a, b)
    if budget_bytes is not None:
        kv.compress(seq, int(budget_bytes))
    if prefill.device is None:
        store = SphericalStore(kv, seq)
    else:
        from spherical_kv_eval.device_store import DeviceSphericalStore
        store = DeviceSphericalStore(kv, seq, device=prefill.device)
    return store, kv.bytes_in_use(seq) + prefill.window_bytes


def _compressed_store(c, nq, window_bytes=0, device=None):
    """(store, bytes) of a baseline's CompressedKV: its kept states, as it holds them (on
    ``device``, ``_dense_store``); the bytes add the sliding windows' ``window_bytes``."""
    return (_dense_store([l.keys for l in c.layers], [l.values for l in c.layers],
                         [l.keep for l in c.layers], nq, c.nbytes, device=device),
            c.nbytes + window_bytes)


def _at_store_budget(m, pre: Prefill):
    """The evicting method ``m`` (a budget fraction of the total) as a copy whose fraction
    is of the full-attention layers, the windows' bytes taken off first (the same as ``m``
    for a model without sliding windows)."""
    if not pre.windows or m.budget is None:
        return m
    m = copy.copy(m)
    m.budget = min(1.0, pre.store_budget(m.budget) / pre.store_dense_bytes)
    return m


def lineup(cfg, budgets, kivi_residual=32, rdr_extra=(), rdr_recent=(32,), peers=True):
    """Baselines (spherical_kv_eval/baselines) + Spherical KV at fixed tiers and with RDR (at
    ``budgets`` and the extra points ``rdr_extra``; one RDR method per protected recent window
    in ``rdr_recent``, the first unnamed: ``skv-rdr@20%``, the others ``skv-rdr@20%+r256``).
    ``peers``: also kvpress's presses at ``budgets`` (``kvpress-snapkv@25%``, ...) where
    kvpress is installed, and transformers' QuantizedCache (``hf-hqq4``, ``hf-hqq2``) where
    hqq is (``baselines.peers``; without them they are absent, ``main`` says so)."""
    from spherical_kv_eval import baselines as B
    from spherical_kv_eval.baselines import peers as P
    nq = cfg.num_attention_heads
    methods = []
    # kvpress's presses run in the line-up where it is installed: then the project's own
    # SnapKV and StreamingLLM (the same methods, held to kvpress's in the tests) stay out
    with_peers = peers and P.kvpress_available() and not _has_windows(cfg)
    for m in B.standard_methods(budgets, kivi_residual=kivi_residual):
        if with_peers and isinstance(m, (B.SnapKV, B.StreamingLLM)):
            continue
        family = type(m).__name__.lower()

        def build(pre, m=m, protect=()):
            mm = _at_store_budget(m, pre)
            return _compressed_store(mm.compress(pre.keys, pre.values,
                                                 pre.stats if mm.needs_stats else None), nq,
                                     pre.window_bytes, device=pre.device)
        methods.append(Method(m.name, family, m.budget, build))
    # kvpress presses run their own prefill over every layer: on a sliding-window model they
    # would not see the windows as the evaluation keeps them, so they stay out there
    if with_peers:
        for m in P.peer_methods(budgets):
            def build(pre, m=m, protect=()):
                return _compressed_store(m.compress(pre.keys, pre.values,
                                                    m.select(pre.model, pre.ids)), nq,
                                         device=pre.device)
            methods.append(Method(m.name, m.family, m.budget, build))
    # transformers' QuantizedCache (HQQ), where hqq is installed: it quantizes the prefill
    # the evaluation made, on the peer device (a CUDA run is far faster than a CPU core)
    if peers and P.quantized_cache_available():
        for m in P.quantized_cache_methods():
            def build(pre, m=m, protect=()):
                on = copy.copy(m)
                on.device = str(pre.model.device)
                return _compressed_store(on.compress(pre.keys, pre.values), nq, pre.window_bytes,
                                         device=pre.device)
            methods.append(Method(m.name, m.family, None, build))
    for bits in (4, 3, 2):
        ladder = TierLadder([(bits, bits), (16, 16)])

        def build(pre, ladder=ladder, protect=()):
            # the whole context at one tier: no RDR, no protection, so no centring (centring
            # only pays with sinks protected, docs/format.md "Centring"); new tokens enter at the fp16
            # top tier, as in every other method
            store, _ = _spherical_store(pre, cfg, ladder, None, centre=False,
                                        policy=CompressPolicy(sinks=0, recent=0, window=OBSERVE))
            store.kv.demote_all(store.seq, 1)
            return store, store.nbytes() + pre.window_bytes
        methods.append(Method(f"skv-fixed-{bits}/{bits}", "skv-fixed", None, build))
    for b in sorted(set(budgets) | set(rdr_extra), reverse=True):
        for i, recent in enumerate(rdr_recent):
            def build(pre, b=b, recent=recent, protect=()):
                return _spherical_store(pre, cfg, TierLadder(), pre.store_budget(b), protect=protect,
                                        policy=_rdr_policy(recent))
            name = f"skv-rdr@{round(b * 100)}%" + (f"+r{recent}" if i else "")
            methods.append(Method(name, "skv-rdr", b, build, protects=True))
    return methods


def _coded_window(layer: int, k: np.ndarray, v: np.ndarray, bits: int):
    """A window's keys and values (H, n, d) as the spherical codec at ``bits`` holds them
    (uniform codebook, centred on the window's mean, the model layer's own rotation seed):
    what attention from the codes computes is attention over these."""
    from spherical_kv_ref.codec import SphericalCodec
    from spherical_kv_ref.rotation import KEY_SALT, VALUE_SALT
    out = []
    for x, salt in ((k, KEY_SALT), (v, VALUE_SALT)):
        rows = []
        for h in range(x.shape[0]):
            c = SphericalCodec(x.shape[2], bits, 0, layer=layer, head=h, salt=salt, codebook="uniform")
            rows.append(c.decode(c.encode(x[h], mean=x[h].mean(axis=0))))
        out.append(np.stack(rows).astype(np.float32))
    return tuple(out)


def _has_windows(cfg) -> bool:
    types = getattr(cfg, "layer_types", None) or ()
    return any(t == "sliding_attention" for t in types)
