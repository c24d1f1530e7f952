"""The model side of the evaluation: ``Runner`` prefills, scores and generates with one
model through the ``spherical_kv`` attention; the corpus and its windows; the attention-output
error of a store."""
from __future__ import annotations

import copy
import math
import warnings
from typing import Optional

import numpy as np

from spherical_kv_eval.lineup import OBSERVE, PREFILL_CHUNK, Prefill, _coded_window, _has_windows


# ----------------------------------------------------------------------------- the model

DEVICES = ("cpu", "cuda")     # where a run's model runs (``--device``)


def check_device(device: str) -> str:
    """``device`` (one of ``DEVICES``) if torch can run on it here; ValueError otherwise,
    naming what is missing."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "cuda":
        import torch
        if not torch.cuda.is_available():
            build = "without CUDA" if torch.version.cuda is None else f"with CUDA {torch.version.cuda}"
            raise ValueError(f"--device cuda: torch {torch.__version__} (built {build}) sees no "
                             f"CUDA device here; run with --device cpu")
    return device


class Runner:
    """Prefill, score and generate with one model through ``spherical_kv`` attention.

    ``device``: where the model runs ("cpu" or "cuda"): its forward passes (the prefill, the
    dense reference, the scored and greedy passes), the attention statistics, the dense
    stores (the reference's and the baselines', ``Prefill.device``) and what kvpress's
    presses and the QuantizedCache run unless ``peer_device`` names another device.
    Spherical KV's sequences stay in the reference's NumPy cache (encoding, RDR, the pages
    and bytes); on a device their decoded code points are held there and attended to there
    (``device_store.DeviceSphericalStore``), so a store-phase attention call moves only its
    queries and output (``spherical_kv_ref.hf.spherical_attention``)."""

    def __init__(self, model, tokenizer, prefill_chunk: Optional[int] = None, window_bits: int = 16,
                 peer_device: Optional[str] = None, device: str = "cpu"):
        import torch
        from spherical_kv_ref.hf import use_spherical_attention
        self.device = torch.device(check_device(device))
        if self.device.type != "cpu":
            # float32 as on the CPU: no TF32 in the matrix products, so the rows agree
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
            # a copy: the process's loaded model (``load_model`` caches it) stays on the CPU
            model = copy.deepcopy(model).to(self.device)
        # where the attention statistics and the dense stores are computed: None = NumPy
        # (the reference, the CPU path), else torch on this device (``Prefill.device``)
        self.store_device = None if self.device.type == "cpu" else self.device
        self.torch, self.model, self.tok = torch, model, tokenizer
        self.cfg = model.config
        # the model the kvpress baselines run their own prefills with: this one, or a copy on
        # ``peer_device`` (e.g. "cuda"; only which states they keep comes back)
        self.peer_model = (model if peer_device is None or torch.device(peer_device) == self.device
                           else copy.deepcopy(model).to(peer_device))
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
                logits = self.model(self._ids(ids[a:a + step]), past_key_values=cache,
                                    **keep).logits[0, -1]
            for l in full:
                parts[l].append(seen[l][0])
        keys, values = zip(*[cache.dense_kv(l) for l in full])
        keys = [k.astype(np.float32) for k in keys]
        queries = [p[0] if len(p) == 1 else np.concatenate(p, axis=1) for p in parts.values()]
        parts.clear()
        scale = cache.scaling
        # on a GPU the statistics (quadratic in T) are computed there, in larger blocks
        on = self.store_device
        stats = attention_stats(queries, keys, window=observe, query_stride=stats_stride,
                                scale=scale, device=on, **({} if on is None else {"block": 1024}))
        windows = [tuple(x.astype(np.float32) for x in cache.dense_kv(l)) for l in slide]
        exact_windows = None
        if self.window_bits < 16:
            exact_windows = windows
            windows = [_coded_window(l, k, v, self.window_bits) for l, (k, v) in zip(slide, windows)]
        return Prefill(keys, [v.astype(np.float32) for v in values],
                       [cache.observed[l].astype(np.float64) for l in full], stats,
                       logits.double().cpu().numpy(), len(ids),
                       [q[:, -trailing:] for q in queries] if trailing else None,
                       np.asarray(ids), self.peer_model, windows=windows, store_layers=full,
                       window_layers=slide, scale=scale, window_bits=self.window_bits,
                       exact_windows=exact_windows, device=on)

    def _ids(self, ids) -> "torch.Tensor":
        """Token ids as the model's (1, n) input on its device."""
        return self.torch.as_tensor(ids)[None].to(self.device)

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
            lg = self.model(self._ids(cont[:-1]), past_key_values=cache).logits[0].double()
        lg = torch.cat([torch.as_tensor(pre.last_logits)[None].to(lg.device), lg])
        return torch.log_softmax(lg, dim=-1).cpu().numpy()

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
                    lg = self.model(self._ids([tok]), past_key_values=cache).logits[0, -1]
                    tok = int(torch.argmax(lg))
                    out.append(tok)
                    if margins:
                        t2 = torch.topk(lg, 2).values
                        gaps.append(float(t2[0] - t2[1]))
        finally:
            torch.set_num_threads(threads)
        return (np.array(out), np.array(gaps)) if margins else np.array(out)


def _exact_store(pre: Prefill):
    """The uncompressed prefill (float32 keys/values as the model computed them), on the
    prefill's device where it has one (``DeviceDenseStore``)."""
    from spherical_kv_ref.hf import DenseStore
    if pre.device is None:
        return DenseStore(pre.keys, pre.values, pre.queries[0].shape[0], 0)
    from spherical_kv_eval.device_store import DeviceDenseStore
    return DeviceDenseStore(pre.keys, pre.values, pre.queries[0].shape[0], 0, device=pre.device)


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
