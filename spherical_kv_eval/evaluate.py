"""Real-model evaluation: Spherical KV against the baselines (the library's main job).

``spherical-kv evaluate`` (= ``python -m spherical_kv_eval.evaluate``): SmolLM2-135M-Instruct on
Jane Austen. For each context length T and window of the corpus: one dense prefill of
T tokens; every method compresses that prefill cache (bytes counted as each method
stores them, against the dense bf16 cache = 100 %); then, through the compressed cache
(the ``spherical_kv`` attention of ``spherical_kv_ref.hf``: stored context + the new
chunk, merged exactly):

* ΔPPL: perplexity of the next C tokens (teacher forced) vs the dense cache, in %;
  mean and spread (max − min) over windows;
* KL: mean next-token KL(dense ‖ method) over those C positions, in nats (every
  position's whole distribution counts, so it is far less noisy than ΔPPL), and top-1
  agreement: the share of positions where both predict the same token;
* retrieval probe: R random words planted at T/8 and repeated after the context; the
  mean loss on the repeat (Spherical KV also with the planted span protected);
* greedy agreement: common prefix of G greedy tokens with dense, over G, averaged over
  the windows (one prompt per window), read off one teacher-forced pass along the dense
  greedy tokens (``greedy_on_dense_path``), with the share of those G positions where the
  method picks dense's token (tie-robust) and the RMS change of the greedy margin; with
  ``--defer N`` every method compresses only after N tokens generated on the dense cache
  (its estimate from their queries) and the G tokens after those are compared;
* attention-output relative error over the context, for the queries of the C scored
  tokens (queries the compression never saw; every 4th position), averaged over layers.

Writes ``evaluate.json``, ``evaluate_meta.json``, ``evaluate.md``, ``pareto.png`` and
``greedy.png`` under ``--out`` (default ``./spherical-kv-results/``; ``quick/`` in it for
``--quick``) and says where.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
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


# ----------------------------------------------------------------------------- helpers

def _progress(iterable, **kw):
    try:
        from tqdm.auto import tqdm
        return tqdm(iterable, **kw)
    except ImportError:               # tqdm is a dependency; stay usable without it
        return iterable


def _dense_store(keys, values, keep, num_q_heads, nbytes):
    from spherical_kv_ref.hf import DenseStore
    k = [[kl[h][keep_l[h]] for h in range(kl.shape[0])] for kl, keep_l in zip(keys, keep)]
    v = [[vl[h][keep_l[h]] for h in range(vl.shape[0])] for vl, keep_l in zip(values, keep)]
    return DenseStore(k, v, num_q_heads, nbytes)


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
    kv = SphericalKVCache(L, H, d, ladder, page_bytes=page_bytes, pool_bytes=pool, seed=seed,
                          num_q_heads=cfg.num_attention_heads, centre=centre,
                          softmax_scale=prefill.scale, rope_inv_freq=rope_frequencies(cfg),
                          policy=observing(policy or _rdr_policy(), prefill.queries[0].shape[1]))
    seq = fill_cache(kv, prefill.keys, prefill.values, prefill.queries, protect)
    if budget_bytes is not None:
        kv.compress(seq, int(budget_bytes))
    return SphericalStore(kv, seq), kv.bytes_in_use(seq) + prefill.window_bytes


def _compressed_store(c, nq, window_bytes=0):
    """(store, bytes) of a baseline's CompressedKV: its kept states, as it holds them; the
    bytes add the sliding windows' ``window_bytes``."""
    return _dense_store([l.keys for l in c.layers], [l.values for l in c.layers],
                        [l.keep for l in c.layers], nq, c.nbytes), c.nbytes + window_bytes


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
                                     pre.window_bytes)
        methods.append(Method(m.name, family, m.budget, build))
    # kvpress presses run their own prefill over every layer: on a sliding-window model they
    # would not see the windows as the evaluation keeps them, so they stay out there
    if with_peers:
        for m in P.peer_methods(budgets):
            def build(pre, m=m, protect=()):
                return _compressed_store(m.compress(pre.keys, pre.values,
                                                    m.select(pre.model, pre.ids)), nq)
            methods.append(Method(m.name, m.family, m.budget, build))
    # transformers' QuantizedCache (HQQ), where hqq is installed: it quantizes the prefill
    # the evaluation made, on the peer device (a CUDA run is far faster than a CPU core)
    if peers and P.quantized_cache_available():
        for m in P.quantized_cache_methods():
            def build(pre, m=m, protect=()):
                on = copy.copy(m)
                on.device = str(pre.model.device)
                return _compressed_store(on.compress(pre.keys, pre.values), nq, pre.window_bytes)
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


# ----------------------------------------------------------------------------- the model

class Runner:
    """Prefill, score and generate with one model through ``spherical_kv`` attention."""

    def __init__(self, model, tokenizer, prefill_chunk: Optional[int] = None, window_bits: int = 16,
                 peer_device: Optional[str] = None):
        import torch
        from spherical_kv_ref.hf import use_spherical_attention
        self.torch, self.model, self.tok = torch, model, tokenizer
        self.cfg = model.config
        # the model the kvpress baselines run their own prefills with: this one, or a copy on
        # ``peer_device`` (e.g. "cuda"; only which states they keep comes back)
        self.peer_model = model if peer_device is None else copy.deepcopy(model).to(peer_device)
        # A sliding-window layer's prefill in one pass costs O(T²) (sdpa walks the whole
        # banded mask); in chunks of C it costs O(T·(C + window)): 2048 for such models. A
        # model without windows runs its prefill in one pass (the committed runs' numbers).
        self.prefill_chunk = prefill_chunk or (PREFILL_CHUNK if _has_windows(self.cfg) else None)
        # how every method holds the sliding windows: 16 = bf16 as the model does, 8/4/... =
        # the spherical codec at that tier, centred on each window's mean (the same function
        # as attending from the codes; their bytes count)
        self.window_bits = int(window_bits)
        use_spherical_attention(model)
        warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated")

    def prefill(self, ids: np.ndarray, stats_stride: int = 4, trailing: int = 0,
                observe: int = OBSERVE) -> Prefill:
        """The dense prefill of ``ids``; ``observe``: how many of the last queries make the
        attention estimates (RDR's, and the evicting baselines' statistics); ``trailing``:
        also keep that many of the last queries of every layer (``Prefill.trailing_queries``,
        (num_q_heads, n, d) float32)."""
        from spherical_kv_ref.hf import SphericalCache
        from spherical_kv_eval.baselines import attention_stats
        from spherical_kv_eval.model import recording_attention
        torch = self.torch
        cache = SphericalCache(self.cfg, observe=observe, budget_fraction=None)
        full, slide = cache.store_layers, cache.window_layers
        # the full-attention layers' queries, as their attention receives them (after any
        # QK-norm and the layer's RoPE), recorded during the prefill itself
        step = self.prefill_chunk or len(ids)
        # chunked: only the last position's logits (a chunk's all would be 2048 x vocab
        # floats, 2.1 GB with Gemma's 262K vocabulary); one pass: the logits as before, bit
        # for bit (one row's product differs from the whole matrix's in the last bits)
        keep = {"logits_to_keep": 1} if self.prefill_chunk else {}
        parts = {l: [] for l in full}
        for a in range(0, len(ids), step):
            with recording_attention(self.model, layers=full) as seen, torch.no_grad():
                logits = self.model(torch.as_tensor(ids[a:a + step])[None], past_key_values=cache,
                                    **keep).logits[0, -1]
            for l in full:
                parts[l].append(seen[l][0])
        keys, values = zip(*[cache.dense_kv(l) for l in full])
        keys = [k.astype(np.float32) for k in keys]
        queries = [p[0] if len(p) == 1 else np.concatenate(p, axis=1) for p in parts.values()]
        parts.clear()
        scale = cache.scaling
        stats = attention_stats(queries, keys, window=observe, query_stride=stats_stride,
                                scale=scale)
        windows = [tuple(x.astype(np.float32) for x in cache.dense_kv(l)) for l in slide]
        exact_windows = None
        if self.window_bits < 16:
            exact_windows = windows
            windows = [_coded_window(l, k, v, self.window_bits) for l, (k, v) in zip(slide, windows)]
        return Prefill(keys, [v.astype(np.float32) for v in values],
                       [cache.observed[l].astype(np.float64) for l in full], stats,
                       logits.double().numpy(), len(ids),
                       [q[:, -trailing:] for q in queries] if trailing else None,
                       np.asarray(ids), self.peer_model, windows=windows, store_layers=full,
                       window_layers=slide, scale=scale, window_bits=self.window_bits,
                       exact_windows=exact_windows)

    def _cache(self, store, pre: "Prefill"):
        """A transformers cache ``pre.length`` tokens in: the full-attention layers read
        ``store``, the sliding-window layers a copy of the prefill's windows."""
        from spherical_kv_ref.hf import SphericalCache
        return SphericalCache.from_store(self.cfg, store, pre.length,
                                         windows=[(k.copy(), v.copy()) for k, v in pre.windows])

    def logprobs(self, store, pre: Prefill, cont: np.ndarray) -> np.ndarray:
        """Log-probabilities (len(cont), vocab) of the next token at each position of
        ``cont`` after the stored context (the first from the dense prefill logits, the
        rest teacher-forced through the store)."""
        torch = self.torch
        cache = self._cache(store, pre)
        with torch.no_grad():
            lg = self.model(torch.as_tensor(cont[:-1])[None], past_key_values=cache).logits[0].double()
        lg = torch.cat([torch.as_tensor(pre.last_logits)[None], lg])
        return torch.log_softmax(lg, dim=-1).numpy()

    def score(self, store, pre: Prefill, cont: np.ndarray) -> np.ndarray:
        """NLL per token of ``cont`` after the stored context."""
        return -self.logprobs(store, pre, cont)[np.arange(len(cont)), cont]

    def greedy(self, store, pre: Prefill, steps: int, margins: bool = False):
        """``steps`` greedy tokens through ``store``; with ``margins`` also, per token, the
        gap between the top two logits it was chosen from (a near-tie when small)."""
        torch = self.torch
        cache = self._cache(store, pre)
        tok = int(np.argmax(pre.last_logits))
        out = [tok]
        top2 = np.sort(pre.last_logits)[-2:]
        gaps = [float(top2[1] - top2[0])]
        threads = torch.get_num_threads()
        torch.set_num_threads(1)     # one-token steps: extra threads only fight numpy's (2.6x slower)
        try:
            with torch.no_grad():
                for _ in range(steps - 1):
                    lg = self.model(torch.tensor([[tok]]), past_key_values=cache).logits[0, -1]
                    tok = int(torch.argmax(lg))
                    out.append(tok)
                    if margins:
                        t2 = torch.topk(lg, 2).values
                        gaps.append(float(t2[0] - t2[1]))
        finally:
            torch.set_num_threads(threads)
        return (np.array(out), np.array(gaps)) if margins else np.array(out)


def _exact_store(pre: Prefill):
    """The uncompressed prefill (float32 keys/values as the model computed them)."""
    from spherical_kv_ref.hf import DenseStore
    return DenseStore(pre.keys, pre.values, pre.queries[0].shape[0], 0)


class _RecordingStore:
    """A store that passes everything to ``inner`` and keeps every query it is asked to
    attend with, per layer: the queries of the scored tokens, for ``attention_error``."""

    def __init__(self, inner):
        self.inner = inner
        self.num_q_heads, self.num_kv_heads = inner.num_q_heads, inner.num_kv_heads
        self.queries = {}

    def attend(self, layer, q, scale):
        self.queries.setdefault(layer, []).append(np.array(q))
        return self.inner.attend(layer, q, scale)

    def append(self, layer, k, v):
        return self.inner.append(layer, k, v)

    def nbytes(self):
        return self.inner.nbytes()


def attention_error(store, pre: Prefill, queries) -> float:
    """‖o_store − o_dense‖/‖o_dense‖ over the context (the stored states only, exact dense
    as truth) for ``queries[layer]`` (q_heads, n, d), averaged over layers."""
    dense = _exact_store(pre)
    errs = []
    scale = pre.scale if pre.scale is not None else 1.0 / math.sqrt(pre.keys[0].shape[2])
    for layer, q in enumerate(queries):
        ref, _ = dense.attend(layer, q, scale)
        got, _ = store.attend(layer, q, scale)
        errs.append(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    return float(np.mean(errs))


# ----------------------------------------------------------------------------- main

def corpus_tokens(tokenizer, need: int, special: bool = True) -> tuple[np.ndarray, str]:
    """The corpus as tokens (at least ``need``) and its source; ``special=False``: without
    the tokenizer's special tokens (a model whose contexts each start with BOS gets it
    from ``window``, not once at the start of the corpus)."""
    from spherical_kv_eval.data import load_austen
    corpus = load_austen()
    text = corpus.joined()
    kw = {} if special else {"add_special_tokens": False}
    ids = np.array(tokenizer(text[: max(need * 8, 200000)], **kw)["input_ids"], dtype=np.int64)
    if len(ids) < need:
        ids = np.array(tokenizer(text, **kw)["input_ids"], dtype=np.int64)
    if len(ids) < need:
        raise ValueError(f"the corpus has {len(ids)} tokens, the evaluation needs {need}")
    return ids, corpus.source


def window(ids: np.ndarray, s: int, T: int, C: int, bos=None) -> tuple[np.ndarray, np.ndarray]:
    """(context, continuation) of the window at corpus token ``s``: T context tokens and the
    C after them; with ``bos`` (a token id) the context is BOS and T − 1 corpus tokens."""
    if bos is None:
        return ids[s:s + T], ids[s + T:s + T + C]
    return np.concatenate([[bos], ids[s:s + T - 1]]), ids[s + T - 1:s + T - 1 + C]


def probe_context(ids: np.ndarray, T: int, R: int, rng, bos=None) -> tuple[np.ndarray, np.ndarray, int]:
    """(context, repeat, start): R corpus tokens drawn at random (random words) planted at
    T/8 into a context of T corpus tokens (BOS first where given); the repeat is the same R
    tokens."""
    span = rng.choice(ids, size=R, replace=False)
    ctx = window(ids, 0, T, 0, bos)[0].copy()
    start = T // 8
    ctx[start:start + R] = span
    return ctx, span, start


_WORKER = {}


def _methods(cfg, args) -> list:
    """The line-up of a run: ``lineup`` at its budgets, kept to ``--methods`` prefixes."""
    return [m for m in lineup(cfg, args.budgets, rdr_extra=args.rdr_extra,
                              rdr_recent=args.rdr_recent, peers=getattr(args, "peers", True))
            if not args.methods or any(m.name.startswith(p) for p in args.methods)]


def _worker_setup(threads: Optional[int], model_name: str = "smollm2", window_bits: int = 16,
                  peer_device: Optional[str] = None) -> None:
    """Load the model once per process (``threads``: torch threads, None = leave;
    ``peer_device``: where the kvpress baselines' prefills run, ``Runner``)."""
    if _WORKER:
        return
    import torch
    from spherical_kv_eval.model import load_model
    if threads:
        torch.set_num_threads(threads)
    model, tok = load_model(model_name)
    _WORKER.update(runner=Runner(model, tok, window_bits=window_bits, peer_device=peer_device),
                   cfg=model.config, tok=tok)


def _unit(job) -> dict:
    """One (context length, window): a dense prefill, then every method through its own
    compressed copy. Window ``"probe"``: the retrieval probe of that context length.
    Returns per-method results. A job ``(T, w, start, args, ids, position, part)`` with
    ``args.method_parts`` = N > 1 runs every N-th method of the line-up from the ``part``-th
    on (its own prefill, the same for every part)."""
    t0 = time.time()
    out = _unit_results(job)
    out["seconds"] = round(time.time() - t0, 1)
    return out


def _method_parts(args) -> int:
    """How many units each window's line-up is split over (``--method-parts``, at least 1)."""
    return max(1, getattr(args, "method_parts", 1) or 1)


def _unit_results(job) -> dict:
    T, w, s, args, ids, position, *rest = job
    part, parts = (rest[0] if rest else 0), _method_parts(args)
    extra = tuple(rest[1]) if len(rest) > 1 and rest[1] else ()
    runner, cfg = _WORKER["runner"], _WORKER["cfg"]
    if extra:           # a supplement: only these methods (the line-up grew since the log)
        methods = [m for m in _methods(cfg, args) if m.name in extra]
    else:
        methods = _methods(cfg, args)[part::parts]
    out = {"T": T, "w": w, "part": part, "parts": parts, "methods": {},
           "attempted": [m.name for m in methods]}
    if extra:
        out["extra"] = list(extra)
    bos = getattr(args, "bos", None)
    if w == "probe":        # one planted context per context length
        pctx, span, p0 = probe_context(ids[s:], T, args.probe, np.random.default_rng([args.seed, T]),
                                       bos)
        ppre = runner.prefill(pctx)
        for m in _progress(methods, desc=f"T={T} probe", leave=False, position=position):
            try:
                pstore, _ = m.build(ppre)
            except Infeasible:
                continue
            r = out["methods"][m.name] = {}
            r["ret"] = float(runner.score(pstore, ppre, span)[1:].mean())
            if m.protects:
                pstore, _ = m.build(ppre, protect=[(p0, p0 + args.probe)])
                r["ret_p"] = float(runner.score(pstore, ppre, span)[1:].mean())
        return out
    ctx, cont = window(ids, s, T, args.continuation, bos)
    pre = runner.prefill(ctx)
    out["window_bytes"] = pre.window_bytes / pre.dense_bytes
    rec = _RecordingStore(_exact_store(pre))
    dense_lp = runner.logprobs(rec, pre.reference(), cont)
    # the scored tokens' own queries (every 8th): what later decoding asks of the context
    future_q = [q[0][:, ::8] for _, q in sorted(rec.queries.items())]
    if args.generate:
        gpre = pre
        if args.defer:      # compress after the first ``defer`` tokens, generated densely
            first = runner.greedy(_exact_store(pre), pre.reference(), args.defer)
            gpre = runner.prefill(np.concatenate([ctx, first]), observe=args.defer)
        ref_tokens, ref_gaps = runner.greedy(_exact_store(gpre), gpre.reference(), args.generate,
                                             margins=True)
        out["dense_gaps"] = [float(g) for g in ref_gaps]
    out["dense_nll"] = float(-dense_lp[np.arange(len(cont)), cont].mean())
    for m in _progress(methods, desc=f"T={T} window {w + 1}", leave=False, position=position):
        try:
            store, nbytes = m.build(pre)
        except Infeasible:          # the windows alone exceed this budget: no point
            continue
        r = out["methods"][m.name] = {}
        fresh = None                                    # the greedy run's store
        if args.generate:
            fresh = m.build(gpre)[0] if args.defer else copy.deepcopy(store)   # scoring appends
        r["bytes"] = nbytes / pre.dense_bytes
        r["store_bytes"] = (nbytes - pre.window_bytes) / pre.store_dense_bytes
        r["err"] = attention_error(store, pre, future_q)
        lp = runner.logprobs(store, pre, cont)
        r["nll"] = float(-lp[np.arange(len(cont)), cont].mean())
        r["kl"] = float(np.mean(np.sum(np.exp(dense_lp) * (dense_lp - lp), axis=1)))
        r["top1"] = float(np.mean(lp.argmax(axis=1) == dense_lp.argmax(axis=1)))
        if args.generate:
            r.update(greedy_on_dense_path(runner.logprobs(fresh, gpre, ref_tokens), ref_tokens, ref_gaps))
    return out


def greedy_on_dense_path(lp: np.ndarray, ref_tokens: np.ndarray, ref_gaps: np.ndarray) -> dict:
    """A method's greedy agreement with dense, read off one teacher-forced pass along the
    dense greedy tokens (``lp``: log-probs (G, vocab) of that pass, ``Runner.logprobs``).

    No store compresses or evicts while it generates: each appends the generated tokens'
    keys and values one by one, the same way in one chunk as in G steps. So up to its first
    disagreement the method's own greedy run *is* the dense run, with exactly these logits,
    and the common prefix is the first position where ``argmax lp`` leaves ``ref_tokens``
    (``tests/test_evaluate.py`` checks this against stepping). One chunk instead of G
    one-token steps is what lets the default run afford four windows.
    Returns ``agree`` (common prefix / G), ``gap`` (dense's own top-2 logit gap where the
    method left it; None: never left), ``tokens`` (share of the G positions where the
    method's next token is dense's, given dense's prefix: the tie-robust companion, since
    one near-tie of the dense run ends every lossy method's common prefix at the same place)
    and ``margin_err``: the RMS over the G positions of the change the method makes to the
    margin the greedy choice is made on (dense's token against the best other token; dense's
    own margin is ``ref_gaps``). A position flips exactly when the change exceeds dense's
    margin there, so this is the error to set against the dense run's near-ties.
    """
    rows = np.arange(len(ref_tokens))
    hit = lp.argmax(axis=1) == ref_tokens
    miss = np.flatnonzero(~hit)
    first = int(miss[0]) if miss.size else len(hit)
    others = lp.copy()
    others[rows, ref_tokens] = -np.inf
    margin = lp[rows, ref_tokens] - others.max(axis=1)
    return {"agree": first / len(hit), "gap": float(ref_gaps[first]) if miss.size else None,
            "tokens": float(hit.mean()),
            "margin_err": float(np.sqrt(np.mean((margin - ref_gaps) ** 2)))}


def _gap_summary(gaps: np.ndarray) -> dict:
    """The dense greedy runs' top-2 logit gaps: the share of positions under a few gaps, and
    the smallest ones (the near-ties a perturbed cache flips first)."""
    return {"positions": int(gaps.size),
            "share_below": {str(g): float(np.mean(gaps < g)) for g in (0.01, 0.02, 0.05, 0.1, 0.2)},
            "smallest": [float(g) for g in np.sort(gaps)[:8]]}


def _main_setup(procs: int, model_name: str = "smollm2", window_bits: int = 16,
                peer_device: Optional[str] = None):
    """(model config, tokenizer) for the main process of a run. With one process the units
    run here too, so the model is loaded once, for them as well; with more, the workers load
    their own and this process keeps only the config and the tokenizer."""
    if procs <= 1:
        _worker_setup(None, model_name, window_bits, peer_device)
        return _WORKER["cfg"], _WORKER["tok"]
    from spherical_kv_eval.model import load_model
    model, tok = load_model(model_name)
    return model.config, tok


def window_starts(num_ids: int, T: int, continuation: int, windows: int) -> np.ndarray:
    """Where the ``windows`` windows of T context + ``continuation`` tokens start: evenly
    over the corpus tokens, neither end included."""
    return np.linspace(0, num_ids - T - continuation - 1, windows + 2)[1:-1].astype(int)


def run_windows(tok, args, unit):
    """The lab scripts' loop: ``args.windows`` windows of ``args.context`` tokens (and
    ``args.continuation`` more) spread over the corpus, the first ``args.first`` of them, each
    a job (T, window, start, args, ids) run by ``unit`` over ``args.jobs`` worker processes."""
    T = args.context
    ids, _ = corpus_tokens(tok, (T + args.continuation) * (args.windows + 1))
    starts = window_starts(len(ids), T, args.continuation, args.windows)
    jobs = [(T, w, int(s), args, ids) for w, s in enumerate(starts)][:args.first]
    return _pool_run(jobs, args.jobs, unit=unit)


def _pool_run(jobs, procs: int, unit=None, model_name: str = "smollm2", window_bits: int = 16,
              peer_device: Optional[str] = None, done: Optional[Callable] = None):
    """Run ``unit`` (default ``_unit``) over the jobs, in ``procs`` worker processes of one
    thread each (two processes on two cores beat one process of two threads: numpy's BLAS
    and torch's threads fight); ``done(result)``, if given, is called on each result as it
    comes (in this process)."""
    unit = _unit if unit is None else unit
    done = done or (lambda result: None)
    if procs <= 1:
        _worker_setup(None, model_name, window_bits, peer_device)
        out = []
        for j in jobs:
            out.append(unit(j))
            done(out[-1])
        return out
    import multiprocessing as mp
    saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    os.environ.update({k: "1" for k in saved})          # the workers' BLAS reads this at import
    try:
        with mp.get_context("spawn").Pool(procs, initializer=_worker_setup,
                                     initargs=(1, model_name, window_bits, peer_device)) as pool:
            out = []
            for result in _progress(pool.imap_unordered(unit, jobs), total=len(jobs),
                                    desc="(context, window) units", position=procs):
                out.append(result)
                done(result)
            return out
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def layer_summary(cfg) -> dict:
    """Which model layers are full attention (compressed by every method) and which attend
    a sliding window (kept as the model holds them), and what the budgets are of."""
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    full = [i for i, t in enumerate(types) if t != "sliding_attention"]
    slide = [i for i, t in enumerate(types) if t == "sliding_attention"]
    out = {"full_attention": full, "sliding_attention": slide}
    if slide:
        out["sliding_window"] = int(cfg.sliding_window)
        out["budget_of"] = ("the whole dense bf16 cache as the model holds it: the "
                            "full-attention layers' context and the sliding layers' windows; "
                            "the windows are kept at bf16 by every method and their bytes "
                            "come off each budget first")
    return out


# the settings a (context, window) unit's result depends on (the context lengths are the
# units' own): a run resumes only units made with the same ones
UNIT_SETTINGS = ("model", "budgets", "rdr_extra", "rdr_recent", "windows",
                 "continuation", "generate", "defer", "probe", "methods", "peers", "seed",
                 "window_bits")


class UnitLog:
    """``units.jsonl`` under a run's folder: its first line the unit settings, then one line
    per finished (context, window) unit, appended as each ends, so an interrupted run (or
    one split with ``--max-units``) goes on with ``--resume`` where it stopped. Without
    ``resume`` the log is started afresh; with it, a log made with other settings is
    refused (nothing is mixed)."""

    def __init__(self, path: Path, settings: dict, resume: bool):
        self.path, self.done = path, {}
        settings = json.loads(json.dumps(settings))          # as it reads back
        if resume and path.exists():
            text = path.read_text()
            if text and not text.endswith("\n"):     # cut off mid-line: later lines start anew
                with path.open("a") as f:
                    f.write("\n")
            lines = text.splitlines()
            first = json.loads(lines[0]) if lines else {}
            if first.get("settings") != settings:
                diff = sorted(k for k in set(settings) | set(first.get("settings") or {})
                              if settings.get(k) != (first.get("settings") or {}).get(k))
                raise ValueError(f"--resume: {path} was made with other settings ({', '.join(diff)} "
                                 f"differ); run without --resume to start afresh")
            for line in lines[1:]:
                try:
                    u = json.loads(line)
                except json.JSONDecodeError:        # a line cut off by the interruption
                    continue
                self.done[self._key(u)] = u
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"settings": settings}) + "\n")

    def add(self, unit: dict) -> None:
        self.done[self._key(unit)] = unit
        with self.path.open("a") as f:
            f.write(json.dumps(unit) + "\n")

    @staticmethod
    def _key(unit: dict) -> tuple:
        return (unit["T"], unit["w"], unit.get("part", 0), unit.get("parts", 1),
                tuple(unit.get("extra", ())))

    def find(self, T, w, part: int, parts: int) -> Optional[dict]:
        """The logged unit holding part ``part`` of ``parts`` of (T, w): that part, or the
        window whole (a unit of one part), or None."""
        return self.done.get((T, w, part, parts, ())) or self.done.get((T, w, 0, 1, ()))

    def supplements(self, T, w) -> list:
        """The logged supplements of (T, w): units of methods the line-up gained later."""
        return [u for k, u in self.done.items() if k[:2] == (T, w) and k[4]]


def _attempted(units) -> set:
    """The methods the units ran (or found infeasible); a unit logged before units said so
    ran those it holds."""
    return {name for u in units for name in u.get("attempted", u["methods"])}


def _merge_parts(units: list) -> dict:
    """One (length, window) unit from its parts (the same unit, alone, when it is whole):
    their methods together, the prefill's figures from the first, checked equal in every
    part (each part ran the same prefill; a difference would mix two computations)."""
    units = list({id(u): u for u in units}.values())
    if len(units) == 1:
        return units[0]
    out = dict(units[0], methods={}, seconds=sum(u.get("seconds", 0.0) for u in units))
    for u in units:
        for k in ("dense_nll", "dense_gaps", "window_bytes"):
            if not _same_figure(u.get(k), units[0].get(k)):
                raise RuntimeError(f"the parts of unit (T={u['T']}, window {u['w']}) disagree "
                                   f"on {k}: their prefills differ")
        out["methods"].update(u["methods"])
    return out


def _same_figure(a, b) -> bool:
    """Whether two parts' prefill figures come from one computation: equal, or within
    float32 rounding (the same run on another host's BLAS build differs in the last bits;
    another window, model or setting differs by far more)."""
    if a is None or b is None:
        return a is b
    return np.allclose(np.asarray(a, float), np.asarray(b, float), rtol=1e-5, atol=1e-6)


def _supplements(log: UnitLog, jobs, parts: int, names) -> list:
    """The supplement jobs ``(T, w, start, args, ids, 0, methods)`` of every window whose
    logged units (all its parts there) lack some of the line-up's ``names``."""
    out = []
    for T, w, s, args, ids, _ in [j for j in jobs if j[5] == 0]:
        logged = [log.find(T, w, k, parts) for k in range(parts)]
        if None in logged:
            continue
        have = _attempted(logged + log.supplements(T, w))
        lacking = tuple(n for n in names if n not in have)
        if lacking:
            out.append((T, w, s, args, ids, 0, lacking))
    return out


class Unfinished(RuntimeError):
    """A run split with ``--max-units`` still has units to do (``--resume`` goes on)."""


def run(args) -> list[dict]:
    from spherical_kv_eval.model import MODELS
    t0 = time.time()
    spec = MODELS[args.model]
    peer_device = getattr(args, "peer_device", None)
    parts = _method_parts(args)
    cfg, tok = _main_setup(args.jobs, args.model, args.window_bits, peer_device)
    args.bos = tok.bos_token_id if spec.bos else None
    methods = _methods(cfg, args)
    jobs = []
    for T in args.contexts:
        # each context length's windows depend on it alone (not on the other lengths of the
        # run), so a run of more lengths holds a run of fewer, and --resume can add lengths
        ids, source = corpus_tokens(tok, (T + args.continuation) * (args.windows + 1),
                                    special=not spec.bos)
        starts = window_starts(len(ids), T, args.continuation, args.windows)
        windows = [(T, w, int(s)) for w, s in enumerate(starts)]
        if args.probe:                          # --probe 0: no retrieval probe
            windows.append((T, "probe", int(starts[0])))
        jobs += [(T, w, s, args, ids, k) for T, w, s in windows for k in range(parts)]
    # longest first (a window costs about three probes), so the two processes end together
    jobs.sort(key=lambda j: -j[0] * (1 if j[1] == "probe" else 3))
    log = UnitLog(args.out / "units.jsonl", {k: getattr(args, k, None) for k in UNIT_SETTINGS},
                  getattr(args, "resume", False))
    todo = [j for j in jobs if log.find(j[0], j[1], j[5], parts) is None]
    resumed = len(jobs) - len(todo)
    # a line-up grown since the log was made (a new baseline): each logged window runs only
    # the methods it lacks, in a supplement unit of its own, merged with the rest below
    names = [m.name for m in methods]
    supplements = _supplements(log, jobs, parts, names)
    todo += supplements
    if getattr(args, "max_units", None) is not None:
        todo = todo[:args.max_units]
    if len(todo) < len(jobs) + len(supplements):
        new = f" ({len(supplements)} for methods new to the line-up)" if supplements else ""
        _say(f"{len(jobs) + len(supplements)} units{new}: {resumed} resumed from {log.path}, "
             f"{len(todo)} to run now, {len(jobs) + len(supplements) - resumed - len(todo)} "
             f"left for later")
    todo = [j[:5] + (i % max(args.jobs, 1),) + j[5:] for i, j in enumerate(todo)]
    if todo:
        _pool_run(todo, args.jobs, model_name=args.model, window_bits=args.window_bits,
                  peer_device=peer_device, done=log.add)
    missing = (sum(log.find(j[0], j[1], j[5], parts) is None for j in jobs)
               + len(_supplements(log, jobs, parts, names)))
    if missing:
        raise Unfinished(f"{missing} of {len(jobs) + len(supplements)} units still to run: the "
                         f"same command with --resume goes on ({log.path})")
    # one unit per (length, window), its parts' methods together; the log may hold other
    # lengths too
    units = [_merge_parts([log.find(T, w, k, parts) for k in range(parts)] + log.supplements(T, w))
             for T, w in dict.fromkeys((j[0], j[1]) for j in jobs)]
    rows, infeasible = [], {}
    for T in args.contexts:
        mine = sorted((u for u in units if u["T"] == T and u["w"] != "probe"), key=lambda u: u["w"])
        probe = [u for u in units if u["T"] == T and u["w"] == "probe"]
        ppl_dense = np.exp(np.array([u["dense_nll"] for u in mine]))
        window_share = float(np.mean([u["window_bytes"] for u in mine]))
        for m in methods:
            if any(m.name not in u["methods"] for u in mine):    # the windows exceed its budget
                infeasible.setdefault(str(T), []).append(m.name)
                continue
            rs = [u["methods"][m.name] for u in mine + probe if m.name in u["methods"]]
            get = lambda k: [r[k] for r in rs if k in r]
            dppl = (np.exp(np.array(get("nll"))) / ppl_dense - 1) * 100
            rows.append({
                "method": m.name, "family": m.family, "budget_fraction": m.budget,
                "bytes_fraction": float(np.mean(get("bytes"))), "context": int(T),
                "store_bytes_fraction": float(np.mean(get("store_bytes"))),
                "window_bytes_fraction": window_share,
                "windows": len(mine), "ppl_dense": float(ppl_dense.mean()),
                "delta_ppl_pct": float(dppl.mean()),
                "delta_ppl_spread": float(dppl.max() - dppl.min()),
                "delta_ppl_ci95": ci95(dppl),
                "delta_ppl_windows": [float(x) for x in dppl],
                "retrieval_loss": float(np.mean(get("ret"))) if get("ret") else None,
                "retrieval_loss_protected": float(np.mean(get("ret_p"))) if get("ret_p") else None,
                "greedy_agreement": float(np.mean(get("agree"))) if get("agree") else None,
                "greedy_agreement_ci95": ci95(get("agree")),
                "greedy_agreement_windows": get("agree"),
                "greedy_dense_gap_at_divergence": [r.get("gap") for r in rs if "agree" in r],
                "greedy_token_agreement": float(np.mean(get("tokens"))) if get("tokens") else None,
                "greedy_token_agreement_ci95": ci95(get("tokens")),
                "greedy_margin_err": float(np.mean(get("margin_err"))) if get("margin_err") else None,
                "greedy_margin_err_ci95": ci95(get("margin_err")),
                "greedy_margin_err_windows": get("margin_err"),     # for window-paired CIs
                "attn_out_rel_err": float(np.mean(get("err"))),
                "attn_out_rel_err_ci95": ci95(get("err")),
                "kl_nats": float(np.mean(get("kl"))),
                "kl_nats_ci95": ci95(get("kl")),
                "kl_windows": get("kl"),
                "top1_agreement": float(np.mean(get("top1"))),
                "top1_agreement_ci95": ci95(get("top1")),
            })
    print(f"{len(methods)} methods x {len(units)} units (context x (windows + probe)) done "
          f"({time.time() - t0:.0f} s)", file=sys.stderr)
    meta = {"model": spec.title, "corpus": source, "continuation": args.continuation,
            "generate": args.generate, "defer": args.defer, "probe_tokens": args.probe, "seed": args.seed,
            "windows": args.windows, "processes": args.jobs, "seconds": round(time.time() - t0, 1),
            "unit_seconds": round(sum(u.get("seconds", 0.0) for u in units), 1),
            "units_resumed": resumed,       # of len(units), made by earlier parts of the run
            "peer_device": peer_device or "cpu",
            "layers": dict(layer_summary(cfg), window_bits=args.window_bits), "infeasible": infeasible}
    if args.generate:     # how close to a tie the dense greedy runs come (their top-2 logit gaps)
        meta["dense_greedy_gaps"] = {
            str(T): _gap_summary(np.concatenate([u["dense_gaps"] for u in units
                                                 if u["T"] == T and u["w"] != "probe"]))
            for T in args.contexts}
    return rows, meta


def write_reports(rows, meta, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "evaluate.json").write_text(json.dumps(rows, indent=1) + "\n")
    (out / "evaluate_meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    corpus = ("Jane Austen's novels" if meta["corpus"].startswith("debian:")
              else f"fallback text ({meta['corpus']})")
    lines = [f"# Spherical KV vs baselines — {meta['model']}, {corpus}",
             "", f"Next {meta['continuation']} tokens scored; greedy {meta['generate']} tokens"
             + (f" after {meta['defer']} generated on the dense cache (compression deferred to then)"
                if meta.get("defer") else "") + "; "
             f"probe of {meta['probe_tokens']} planted tokens; " + _time_line(meta), ""]
    for T in sorted({r["context"] for r in rows}):
        lines += [f"## Context {T} tokens", ""]
        mine = [r for r in rows if r["context"] == T]
        share = max((r.get("window_bytes_fraction") or 0.0) for r in mine)
        if share:
            lay = meta.get("layers", {})
            lines += [f"Sliding-window layers {lay.get('sliding_attention')} hold "
                      f"{100 * share:.1f} % of the dense cache (their windows, "
                      + ("at bf16" if lay.get("window_bits", 16) >= 16 else
                         f"in the {lay['window_bits']}-bit spherical code") +
                      f" in every method); every budget and bytes % is of the whole cache, the windows' "
                      f"bytes taken off first; the full-attention layers "
                      f"{lay.get('full_attention')} get the rest." +
                      (f" Budgets the windows alone exceed: "
                       f"{', '.join(meta['infeasible'][str(T)])}." if str(T) in meta.get("infeasible", {}) else ""),
                      ""]
        head = ["method", "bytes % of bf16"] + (["full-attn layers %"] if share else []) + [
            "ΔPPL %", "spread", "KL (nats)", "top-1 agree", "retrieval loss", "protected",
            "greedy agree", "greedy tokens", "margin err", "attn err"]
        lines += ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
        for r in sorted(mine, key=lambda r: -r["bytes_fraction"]):
            store = [f"{100 * r['store_bytes_fraction']:.1f}"] if share else []
            cells = [r["method"], f"{100 * r['bytes_fraction']:.1f}"] + store + [
                _with_ci(r["delta_ppl_pct"], r.get("delta_ppl_ci95"), 2),
                f"{r['delta_ppl_spread']:.2f}",
                _with_ci(r["kl_nats"], r.get("kl_nats_ci95"), 4),
                _with_ci(r["top1_agreement"], r.get("top1_agreement_ci95"), 3),
                _with_ci(r["retrieval_loss"], None, 3),
                _with_ci(r["retrieval_loss_protected"], None, 3),
                _with_ci(r["greedy_agreement"], r.get("greedy_agreement_ci95"), 2),
                _with_ci(r["greedy_token_agreement"], r.get("greedy_token_agreement_ci95"), 3),
                _with_ci(r.get("greedy_margin_err"), r.get("greedy_margin_err_ci95"), 4),
                _with_ci(r["attn_out_rel_err"], r.get("attn_out_rel_err_ci95"), 3)]
            lines.append("| " + " | ".join(cells) + " |")
        lines += ["", f"± : half-width of the 95 % confidence interval of the mean over the "
                      f"{mine[0]['windows']} windows (Student's t)"
                      + ("; the retrieval probe is one planted context per length, so it has none"
                         if any(r["retrieval_loss"] is not None for r in mine) else "") + ".", ""]
        pairs = rdr_against_baselines(mine)
        if pairs:
            lines += ["Each baseline point against the RDR point (10-50 % budgets) with the most "
                      "bytes not above its own: the difference RDR − baseline, paired by window, "
                      "with its 95 % CI; **lower** / **higher**: the CI excludes 0, *tie*: it "
                      "holds 0.", "",
                      "| baseline | bytes % | RDR point | bytes % | ΔPPL % | KL (nats) | margin err | "
                      "ΔPPL lower in |",
                      "|---|---:|---|---:|---:|---:|---:|---:|"]
            for p in pairs:
                a, b = p["rdr"], p["baseline"]
                cells = [_paired_cell(p["by_metric"][k], digits)
                         for k, digits in (("delta_ppl_pct", 2), ("kl_nats", 4),
                                           ("greedy_margin_err", 4))]
                lines.append(f"| {b['method']} | {100 * b['bytes_fraction']:.1f} | {a['method']} | "
                             f"{100 * a['bytes_fraction']:.1f} | " + " | ".join(cells)
                             + f" | {p['lower']}/{p['windows']} |")
            lines.append("")
            for key, label in (("delta_ppl_pct", "ΔPPL"), ("kl_nats", "KL"),
                               ("greedy_margin_err", "margin error")):
                v = [p["by_metric"][key]["verdict"] for p in pairs if p["by_metric"][key]]
                if v:
                    lines.append(f"{label}: RDR lower by the CI than {v.count('lower')} of the "
                                 f"{len(v)} baseline points, tied with {v.count('tie')}, higher "
                                 f"than {v.count('higher')}.")
            lines.append("")
        target = greedy_target(mine)
        if target is not None:
            lines += [f"Greedy target (after-prefill protocol): {target['rdr']}'s margin error "
                      f"{target['rdr_value']:.4f} against {target['fp8']}'s {target['fp8_value']:.4f}; "
                      f"difference {_paired_cell(target, 4)}: "
                      + ("met" if target["met"] else "not met")
                      + (" (the CI holds 0)" if target["verdict"] == "tie" else "") + ".", ""]
    (out / "evaluate.md").write_text("\n".join(lines))
    plot_reports(rows, out)


def _time_line(meta) -> str:
    """How long the run took: this command's seconds, and for a run resumed from earlier
    parts the units' own seconds (summed over the worker processes) too."""
    if not meta.get("units_resumed"):
        return f"run took {meta['seconds']} s."
    return (f"the units took {meta.get('unit_seconds')} s of worker time in all (this command "
            f"{meta['seconds']} s; {meta['units_resumed']} units came from earlier parts of the run).")


def _with_ci(value, half, digits: int) -> str:
    """A table cell: ``value`` with ``± half`` (its 95 % CI) where there is one."""
    if value is None:
        return "—"
    return f"{value:.{digits}f}" + ("" if half is None else f" ± {half:.{digits}f}")


def _paired_cell(p: Optional[dict], digits: int) -> str:
    """A paired difference as ``+0.12 ± 0.05 **lower**`` (bold where the CI excludes 0)."""
    if p is None:
        return "—"
    if p["ci95"] is None:
        return f"{p['diff']:+.{digits}f}"
    mark = {"tie": "*tie*"}.get(p["verdict"], f"**{p['verdict']}**")
    return f"{p['diff']:+.{digits}f} ± {p['ci95']:.{digits}f} {mark}"


# the per-window figures a claim is paired on: (row key of the mean, row key of the windows)
PAIRED = (("delta_ppl_pct", "delta_ppl_windows"), ("kl_nats", "kl_windows"),
          ("greedy_margin_err", "greedy_margin_err_windows"))


def paired_difference(a: dict, b: dict, key: str) -> Optional[dict]:
    """Row ``a`` − row ``b`` on ``key`` (one of ``PAIRED``), paired by window: mean, standard
    error, 95 % CI half-width, the windows where ``a`` is lower, and the verdict: "lower"
    or "higher" where the CI excludes 0, "tie" where it holds 0. None where either row
    lacks that figure's per-window values (older runs, no greedy run)."""
    windows = dict(PAIRED)[key]
    x, y = a.get(windows), b.get(windows)
    if not x or not y or len(x) != len(y):
        return None
    d = np.asarray(x, float) - np.asarray(y, float)
    half = ci95(d)
    verdict = ("—" if half is None else "lower" if d.mean() + half < 0
               else "higher" if d.mean() - half > 0 else "tie")
    return {"diff": float(d.mean()), "windows": len(d), "ci95": half, "verdict": verdict,
            "se": float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else float("nan"),
            "lower": int(np.sum(d < 0))}


def rdr_against_baselines(rows) -> list[dict]:
    """The claim "RDR below every baseline at the same or more bytes", point by point for one
    context length: each baseline point (neither RDR nor dense) against the RDR point of the
    10-50 % budgets with the most bytes not above its own, with the window-paired
    differences RDR − baseline of ΔPPL (the top-level ``diff``, ``se``, ``ci95``, ``lower``,
    ``verdict``), of KL and of the greedy margin error (``by_metric``, ``paired_difference``).
    Rows without per-window ΔPPLs (older runs) give nothing."""
    rdr = sorted((r for r in rows if r["family"] == "skv-rdr" and "delta_ppl_windows" in r
                  and 0.1 - 1e-9 <= (r["budget_fraction"] or 0) <= 0.5 + 1e-9),
                 key=lambda r: r["bytes_fraction"])
    out = []
    for b in sorted(rows, key=lambda r: -r["bytes_fraction"]):
        if b["family"] in ("skv-rdr", "dense") or "delta_ppl_windows" not in b:
            continue
        within = [a for a in rdr if a["bytes_fraction"] <= b["bytes_fraction"] + 1e-3]
        if not within:
            continue
        a = within[-1]
        by_metric = {k: paired_difference(a, b, k) for k, _ in PAIRED}
        if by_metric["delta_ppl_pct"] is None:
            continue
        out.append(dict(by_metric["delta_ppl_pct"], rdr=a, baseline=b, by_metric=by_metric))
    return out


def greedy_target(rows) -> Optional[dict]:
    """The greedy target for one context length: RDR's greedy margin error at the
    largest RDR point within 20 % of the bytes against fp8-e4m3's (50 %), paired by window.
    ``met``: the mean difference is ≤ 0; ``verdict``: what its 95 % CI says. None without
    both points or without a greedy run."""
    rdr = [r for r in rows if r["family"] == "skv-rdr" and r["bytes_fraction"] <= 0.20 + 1e-3
           and r.get("greedy_margin_err_windows")]
    fp8 = [r for r in rows if r["family"] == "fp8e4m3" and r.get("greedy_margin_err_windows")]
    if not rdr or not fp8:
        return None
    a = max(rdr, key=lambda r: r["bytes_fraction"])
    p = paired_difference(a, fp8[0], "greedy_margin_err")
    return dict(p, rdr=a["method"], fp8=fp8[0]["method"], met=p["diff"] <= 0,
                rdr_value=a["greedy_margin_err"], fp8_value=fp8[0]["greedy_margin_err"])


def ci95(x) -> Optional[float]:
    """Half-width of the 95 % confidence interval of the mean of ``x`` (Student's t with
    n − 1 degrees of freedom; the windows are the samples); None for fewer than 2."""
    x = np.asarray(x, float)
    if x.size < 2:
        return None
    from scipy.stats import t
    return float(t.ppf(0.975, x.size - 1) * x.std(ddof=1) / math.sqrt(x.size))


PARETO_METRICS = [("delta_ppl_pct", "ΔPPL vs dense, % (symmetric log)", "symlog", (1.0, "target: ΔPPL 1 %")),
                  ("kl_nats", "next-token KL(dense ‖ method), nats (log)", "log", None)]
GREEDY_METRICS = [("greedy_agreement", "greedy agreement: common prefix / generated", "linear",
                   (0.9, "target: agreement 0.9")),
                  ("greedy_margin_err", "RMS change of the greedy margin, logits (log)", "log", None)]
# each plotted figure's 95 % CI half-width in a row (error bars)
CI_KEYS = {"delta_ppl_pct": "delta_ppl_ci95", "kl_nats": "kl_nats_ci95",
           "greedy_agreement": "greedy_agreement_ci95", "greedy_margin_err": "greedy_margin_err_ci95"}
# one marker shape per method family, so points that coincide stay told apart
# (kvpress's presses by their press name; the peers' lines are dashed)
MARKERS = {"skv-rdr": "o", "skv-fixed": "s", "fp8e4m3": "D", "kivi": "^", "h2o": "v",
           "snapkv": "P", "streamingllm": "X", "expected": "<", "tova": ">", "knorm": "h",
           "observed": "*", "adakv-expected": "d", "adakv-snapkv": "p", "hf-quantized-hqq": "8"}
COLORS = {"fp8e4m3": "tab:blue", "h2o": "tab:orange", "kivi": "tab:green", "skv-fixed": "tab:red",
          "skv-rdr": "tab:purple", "snapkv": "tab:brown", "streamingllm": "tab:pink",
          "expected": "tab:olive", "tova": "tab:cyan", "knorm": "tab:gray", "observed": "black",
          "adakv-expected": "darkgoldenrod", "adakv-snapkv": "navy", "hf-quantized-hqq": "teal"}
NUDGE = 0.012     # points of one family shift by up to ±NUDGE·x sideways (log x): ties stay visible


def _padded_limits(axis, values, pad=0.06):
    """(low, high) holding every value with ``pad`` of the span either side, measured in
    the axis's own scale (log, symlog or linear), so no marker is cut by the frame."""
    t = axis.get_transform()
    lo, hi = (float(v) for v in t.transform(np.array([min(values), max(values)], dtype=float)))
    span = (hi - lo) or abs(hi) or 1.0
    out = t.inverted().transform(np.array([lo - pad * span, hi + pad * span]))
    return float(out[0]), float(out[1])


def plot(rows, path: Path, metrics=PARETO_METRICS) -> None:
    """Bytes vs each of ``metrics`` (one plot row each: key, label, y scale, labelled reference
    line or None), one line and marker shape per method family, one column per context
    length; the families' points are nudged slightly sideways so equal ones do not hide
    each other, and the axes hold every point and the reference line. Default: ΔPPL (top)
    and next-token KL (bottom); ``GREEDY_METRICS``: greedy agreement and margin error."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    contexts = sorted({r["context"] for r in rows})
    fig, axes = plt.subplots(len(metrics), len(contexts), figsize=(6 * len(contexts), 4.5 * len(metrics)),
                             squeeze=False)
    for row, (key, label, scale, ref) in enumerate(metrics):
        for ax, T in zip(axes[row], contexts):
            fams = {}
            for r in rows:
                if r["context"] == T and r["family"] != "dense" and r.get(key) is not None:
                    fams.setdefault(r["family"], []).append(r)
            ax.set_xscale("log")
            if scale == "symlog":
                ax.set_yscale("symlog", linthresh=0.1)    # ΔPPL can be slightly negative (noise)
                ax.axhline(0.0, color="k", lw=0.6)
            else:
                ax.set_yscale(scale)
            xs, ys = [], []
            for i, (fam, rs) in enumerate(sorted(fams.items())):
                rs.sort(key=lambda r: r["bytes_fraction"])
                shift = 1 + NUDGE * (2 * i / max(len(fams) - 1, 1) - 1)
                x = [100 * r["bytes_fraction"] * shift for r in rs]
                y = [max(r[key], 1e-5) if scale == "log" else r[key] for r in rs]
                peer = fam.startswith(("kvpress-", "hf-"))  # the field's own code: dashed
                style = fam.removeprefix("kvpress-")
                line, = ax.plot(x, y, marker=MARKERS.get(style, "o"),
                                color=COLORS.get(style), ms=7 if fam == "skv-rdr" else 6,
                                mfc="none" if fam != "skv-rdr" else None, mew=1.4,
                                ls="--" if peer else "-",
                                lw=2.5 if fam == "skv-rdr" else 1.2, label=fam)
                half = [r.get(CI_KEYS.get(key, "")) for r in rs]
                if all(h is not None for h in half):         # the 95 % CIs as error bars
                    lo = [min(h, v - 1e-5) if scale == "log" else h for h, v in zip(half, y)]
                    ax.errorbar(x, y, yerr=[lo, half], fmt="none", ecolor=line.get_color(),
                                alpha=0.45, lw=1, capsize=2)
                xs += x
                ys += y
            if ref is not None:
                value, text = ref
                ax.axhline(value, color="k", ls=":", lw=1.2, label=text)
                ys.append(value)
            if not xs:
                continue
            ax.set_xlim(*_padded_limits(ax.xaxis, xs))
            ax.set_ylim(*_padded_limits(ax.yaxis, ys, pad=0.08))
            lo, hi = ax.get_xlim()
            ticks = [t for t in (10, 15, 20, 25, 30, 40, 50, 65, 80, 100) if lo <= t <= hi]
            ax.set_xticks(ticks, [str(t) for t in ticks])
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set_xlabel("cache bytes, % of bf16 (all overheads counted)")
            ax.set_ylabel(label)
            ax.set_title(f"context {T} tokens")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_reports(rows, out: Path) -> list[Path]:
    """Draw ``pareto.png`` and, where the rows have greedy metrics, ``greedy.png`` under
    ``out``; returns the files written."""
    written = [out / "pareto.png"]
    plot(rows, written[0])
    if any(r.get("greedy_margin_err") is not None for r in rows):
        written.append(out / "greedy.png")
        plot(rows, written[-1], GREEDY_METRICS)
    return written


DEFAULT_OUT = Path("spherical-kv-results")   # in the working directory, never the committed results


def parse(argv):
    p = argparse.ArgumentParser(prog="spherical-kv evaluate", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="smoke test (a few minutes on 2 cores): 512-token contexts, one budget, "
                        "two windows; its numbers show the job runs, not how good the methods are")
    p.add_argument("--model", choices=("smollm2", "gemma3-270m"), default="smollm2",
                   help="smollm2: SmolLM2-135M-Instruct (default; contexts 2K and 4K, 8K with "
                        "--long); gemma3-270m: Gemma-3-270M, a sliding-window hybrid (contexts "
                        "8K, 16K and 32K; docs/evaluate.md \"Sliding-window models\")")
    p.add_argument("--long", action="store_true", help="also an 8K context (smollm2)")
    p.add_argument("--window-bits", type=int, choices=(16, 8, 4, 3, 2), default=16,
                   help="how every method holds a sliding-window model's windows: 16 = bf16 as "
                        "the model does (default), fewer = the spherical codec at that many bits, "
                        "centred (their bytes count in every method's)")
    p.add_argument("--contexts", "--context", type=int, nargs="+", default=None,
                   help="context lengths in tokens (BOS included for gemma3-270m)")
    p.add_argument("--budgets", type=float, nargs="+", default=[0.50, 0.25, 0.15, 0.10],
                   help="budgets of every evicting method and of RDR (fractions of bf16 bytes)")
    p.add_argument("--rdr-extra", type=float, nargs="*", default=[0.20],
                   help="extra RDR budgets (default 0.20: the iso-quality claim's point)")
    p.add_argument("--rdr-recent", type=int, nargs="+", default=[32],
                   help="protected recent windows of the RDR methods (tokens; the first is the "
                        "default method, each further one adds skv-rdr@B%%+rN)")
    p.add_argument("--windows", type=int, default=32,
                   help="windows of the corpus per context length (default 32: every figure "
                        "carries a 95 %% CI over them)")
    p.add_argument("--continuation", type=int, default=256)
    p.add_argument("--generate", type=int, default=128)
    p.add_argument("--defer", type=int, default=0,
                   help="greedy protocol: every method compresses after the first N tokens, "
                        "generated on the dense cache, its estimate from their queries; the "
                        "next --generate tokens are compared (default 0: right after the prefill)")
    p.add_argument("--probe", type=int, default=32)
    p.add_argument("--methods", nargs="*", default=None, help="name prefixes to keep")
    p.add_argument("--no-peers", dest="peers", action="store_false",
                   help="leave out the peer libraries' baselines: kvpress's presses "
                        "(kvpress-*) and transformers' QuantizedCache (hf-hqq*), in the line-up "
                        "by default where kvpress and hqq are installed: pip install "
                        "'spherical-kv[peers]'")
    p.add_argument("--peer-device", default=None,
                   help="torch device of the kvpress baselines' own prefills and of the "
                        "QuantizedCache's quantization (default: the CPU, as the rest of the "
                        "run; e.g. cuda: only what they keep comes back)")
    p.add_argument("--resume", action="store_true",
                   help="go on with the units already under --out (units.jsonl) made with the "
                        "same settings, after an interruption or a --max-units part")
    p.add_argument("--max-units", type=int, default=None,
                   help="run at most this many of the units still to do, then stop (a long run "
                        "in parts; --resume goes on, and the last part writes the reports)")
    p.add_argument("--method-parts", type=int, default=1,
                   help="split each window's line-up into N units (every N-th method, each "
                        "with its own prefill), so that no unit runs longer than a part of a "
                        "run may (long contexts under --max-units)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                   help="worker processes, one thread each (default: 2, or 1 on one core)")
    p.add_argument("--out", type=Path, default=None,
                   help=f"results folder (default: $SPHERICAL_KV_RESULTS or ./{DEFAULT_OUT}/, "
                        f"with --quick its quick/ subfolder)")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="where the corpus and the model's float32 copy (~0.5 GB) are kept "
                        "(default: $SPHERICAL_KV_CACHE or ~/.cache/spherical_kv)")
    p.add_argument("--replot", action="store_true",
                   help="only redraw the figures from the evaluate.json under --out (no model run)")
    a = p.parse_args(argv)
    if a.quick:
        a.contexts = a.contexts or [512]
        a.budgets, a.rdr_extra = [0.25], []
        a.windows, a.continuation, a.generate, a.probe = 2, 32, 8, 16
    from spherical_kv_eval.model import MODELS
    if a.model == "gemma3-270m":
        a.contexts = a.contexts or [8192, 16384, 32768]
    a.contexts = a.contexts or ([2048, 4096] + ([8192] if a.long else []))
    top = MODELS[a.model].max_context
    if max(a.contexts) > top:
        p.error(f"{a.model}'s context is {top} tokens; --contexts must not exceed it")
    if max(a.continuation, a.generate, a.probe) > 512:
        p.error("--continuation, --generate and --probe are at most 512 tokens "
                "(the page pools are sized for 512 appended tokens)")
    if a.out is None:
        a.out = Path(os.environ.get("SPHERICAL_KV_RESULTS") or DEFAULT_OUT)
        if a.quick:
            a.out = a.out / "quick"
    return a


def _say(msg: str) -> None:
    print(f"spherical-kv evaluate: {msg}", file=sys.stderr, flush=True)


def main(argv=None) -> int:
    args = parse(argv)
    if args.replot:
        rows = json.loads((args.out / "evaluate.json").read_text())
        for f in plot_reports(rows, args.out):
            print(f"wrote {f}")
        return 0
    if args.cache_dir is not None:          # read by this process and the worker processes
        os.environ["SPHERICAL_KV_CACHE"] = str(args.cache_dir)
    from .data import cache_dir
    from .model import MODELS, describe_model
    _say(f"model: {describe_model(args.model)}; corpus and model copy under {cache_dir()} (~0.5 GB "
         f"once; --cache-dir or SPHERICAL_KV_CACHE moves it; weights from "
         f"'{MODELS[args.model].packages[0]}')")
    if args.quick:
        _say("--quick is a smoke test: 512-token contexts, 2 windows, 32 scored tokens; its "
             "numbers show that the job runs, not how well the methods do (run without --quick "
             "for the results)")
    from .baselines.peers import kvpress_available, quantized_cache_available
    if args.peers and not kvpress_available():
        _say("the kvpress baselines (kvpress-snapkv, ...) need the Python package 'kvpress' "
             "(pip install 'spherical-kv[peers]'); this run leaves them out")
    if args.peers and not quantized_cache_available():
        _say("transformers' QuantizedCache baselines (hf-hqq4, hf-hqq2) need the Python package "
             "'hqq' (pip install 'spherical-kv[peers]'); this run leaves them out")
    try:
        rows, meta = run(args)
    except Unfinished as e:
        _say(str(e))
        return 0
    write_reports(rows, meta, args.out)
    print((args.out / "evaluate.md").read_text())
    files = ", ".join(sorted(f.name for f in args.out.iterdir() if f.is_file()))
    _say(f"results written to {args.out.resolve()}/ ({files})"
         + (" -- smoke-test numbers (--quick)" if args.quick else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
