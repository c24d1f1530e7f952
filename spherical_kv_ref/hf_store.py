"""The context stores of the transformers integration: what a layer's new tokens attend to
besides themselves, after ``SphericalCache.compress`` or ``set_store`` (``spherical_kv_ref.hf``).

``SphericalStore`` reads a compressed sequence of a ``SphericalKVCache`` (the NumPy
reference; ``cupy_kernels.hf_store.GpuSphericalStore`` is its GPU twin), ``DenseStore``
explicit keys and values (the evaluation's baselines). Each returns its attention output with
the log-sum-exps the integration merges with the new chunk's part (``ada.merge_attention``). NumPy only:
torch and transformers are imported by ``spherical_kv_ref.hf``, not here.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from .cache import CompressPolicy, SphericalKVCache
from .codec import as_real_array, check_finite, whole
from .rotation import KEY_SALT, VALUE_SALT


def _softmax_part(q, k, v, scale, causal_offset=None):
    """Attention of q (G, T, d) over k, v (n, d) with lse; causal_offset: query t sees keys
    ≤ t + offset (None: all keys)."""
    G, T, d = q.shape
    z = scale * (q.reshape(G * T, d) @ k.T).reshape(G, T, -1)
    if causal_offset is not None:
        t = np.arange(T)[:, None]
        z = np.where(np.arange(k.shape[0])[None, :] <= t + causal_offset, z, -np.inf)
    zmax = z.max(axis=2, keepdims=True)
    e = np.exp(z - zmax)
    den = e.sum(axis=2, keepdims=True)
    out = ((e / den).reshape(G * T, -1) @ v).reshape(G, T, d)
    return out, (zmax + np.log(den))[..., 0]


def _chunk_part(q, k, v, k_held, v_held, scale):
    """Causal attention of a chunk's queries q (G, T, d) over the chunk itself: token t reads
    tokens s < t as held by the store (k_held, v_held (T, d)) and itself exactly (k, v):
    what a one-token decode step at t sees. Returns out (G, T, d), lse (G, T)."""
    G, T, d = q.shape
    z = scale * np.einsum("gtd,sd->gts", q, k_held)
    diag = np.arange(T)
    z[:, diag, diag] = scale * np.einsum("gtd,td->gt", q, k)
    z = np.where(diag[None, :] <= diag[:, None], z, -np.inf)
    zmax = z.max(axis=2, keepdims=True)
    e = np.exp(z - zmax)
    den = e.sum(axis=2, keepdims=True)
    p = e / den
    self_w = p[:, diag, diag]
    p[:, diag, diag] = 0.0
    out = np.einsum("gts,sd->gtd", p, v_held) + self_w[..., None] * v[None]
    return out, (zmax + np.log(den))[..., 0]


def _real_rows(x, name: str) -> np.ndarray:
    """x as a finite real (n, d) array; ValueError naming ``name`` otherwise (the codec's
    checks, ``as_real_array`` and ``check_finite``, plus the shape)."""
    a = as_real_array(x, name)
    if a.ndim != 2:
        raise ValueError(f"{name}: every kv-head must be a real (n, d) array, got {a.dtype} "
                         f"{a.shape}")
    check_finite(a, name)
    return a


class _Rows:
    """A (n, d) float64 array that grows at the end in amortised O(1) per row (decode
    appends one token per step; re-concatenating a 4K-state row every step costs more
    than the attention itself)."""

    def __init__(self, a):
        self._buf = np.array(a, np.float64)        # a copy: the store owns its rows
        self._n = self._buf.shape[0]

    @property
    def rows(self) -> np.ndarray:
        return self._buf[:self._n]

    def extend(self, x) -> None:
        x = np.asarray(x, np.float64)
        need = self._n + x.shape[0]
        if need > self._buf.shape[0]:
            grown = np.empty((max(need, 2 * self._buf.shape[0], 16), self._buf.shape[1]))
            grown[:self._n] = self._buf[:self._n]
            self._buf = grown
        self._buf[self._n:need] = x
        self._n = need


class ContextStore:
    """What a layer's new tokens attend to besides themselves. Subclasses implement
    ``attend`` (q (num_q_heads, T, d) → out, lse over the stored states), ``append``
    (k, v (num_kv_heads, T, d) → the same as the store now holds them) and ``nbytes``."""

    num_q_heads: int
    num_kv_heads: int

    def attend(self, layer: int, q: np.ndarray, scale: float):
        raise NotImplementedError

    def append(self, layer: int, k: np.ndarray, v: np.ndarray):
        """Store a chunk; return its (k, v) as held (what later tokens will read)."""
        raise NotImplementedError

    def nbytes(self) -> int:
        raise NotImplementedError


def _check_store(store, num_q_heads: int, num_kv_heads: int, num_layers: int) -> None:
    """ValueError naming ``store`` unless it is a context store (a ContextStore, or any object
    with its methods and head counts) of the model's heads (and, if it says, of its store
    layers)."""
    if not (all(callable(getattr(store, m, None)) for m in ("attend", "append", "nbytes"))
            and hasattr(store, "num_q_heads") and hasattr(store, "num_kv_heads")):
        raise ValueError(f"store must be a ContextStore (attend, append, nbytes and the head "
                         f"counts), got {type(store).__name__}")
    if (store.num_q_heads, store.num_kv_heads) != (num_q_heads, num_kv_heads):
        raise ValueError(f"store holds {store.num_kv_heads} kv-heads for {store.num_q_heads} query "
                         f"heads; the model has {num_kv_heads} for {num_q_heads}")
    layers = getattr(store, "num_layers", None)
    if layers is not None and layers != num_layers:
        raise ValueError(f"store holds {layers} layers; the model has {num_layers} "
                         f"full-attention layers")


class DenseStore(ContextStore):
    """Explicit keys/values per layer and kv-head: ``keys[layer]`` is a (num_kv_heads, n, d)
    array or a list of per-head (n_h, d) arrays (evicting methods keep different tokens per
    head; evicted states are simply absent — keys are post-RoPE, so order does not
    matter). ``bytes_per_state`` counts appended tokens (default bf16 keys + values)."""

    def __init__(self, keys, values, num_q_heads: int, nbytes: int,
                 bytes_per_state: Optional[int] = None):
        num_q_heads = whole("num_q_heads", num_q_heads, 1)
        nbytes = whole("nbytes", nbytes, 0)
        if bytes_per_state is not None:
            bytes_per_state = whole("bytes_per_state", bytes_per_state, 0)
        rows = {}
        for name, per_layer in (("keys", keys), ("values", values)):
            try:
                rows[name] = [[_Rows(_real_rows(x, f"{name}[{i}]")) for x in layer]
                              for i, layer in enumerate(per_layer)]
            except TypeError:
                raise ValueError(f"{name} must hold per layer (num_kv_heads, n, d) arrays or lists "
                                 f"of per-head (n, d) arrays") from None
        k, v = rows["keys"], rows["values"]
        if not k or not k[0]:
            raise ValueError("keys must hold at least one layer of at least one kv-head")
        shape = [[r.rows.shape for r in layer] for layer in k]
        d = shape[0][0][1]
        if [[r.rows.shape for r in layer] for layer in v] != shape:
            raise ValueError("keys and values must have the same layers, heads and shapes")
        if any(len(layer) != len(k[0]) or any(sh[1] != d for sh in layer) for layer in shape):
            raise ValueError("keys must hold the same kv-heads and head dim in every layer")
        if num_q_heads % len(k[0]):
            raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of the "
                             f"{len(k[0])} kv-heads of keys")
        self.keys, self.values = k, v
        self.num_kv_heads = len(self.keys[0])
        self.num_q_heads = num_q_heads
        self.num_layers = len(self.keys)
        self._nbytes = nbytes
        self._per_state = 4 * d if bytes_per_state is None else bytes_per_state

    def attend(self, layer, q, scale):
        G = self.num_q_heads // self.num_kv_heads
        out = np.empty(q.shape)
        lse = np.empty(q.shape[:2])
        for h in range(self.num_kv_heads):
            k, v = self.keys[layer][h].rows, self.values[layer][h].rows
            sl = slice(h * G, (h + 1) * G)
            if k.shape[0] == 0:
                out[sl], lse[sl] = 0.0, -np.inf
                continue
            out[sl], lse[sl] = _softmax_part(q[sl], k, v, scale)
        return out, lse

    def append(self, layer, k, v):
        for h in range(self.num_kv_heads):
            self.keys[layer][h].extend(k[h])
            self.values[layer][h].extend(v[h])
        self._nbytes += k.shape[0] * k.shape[1] * self._per_state
        return k, v

    def nbytes(self):
        return self._nbytes


class SphericalStore(ContextStore):
    """The compressed context of one sequence of a ``SphericalKVCache``.

    ``attend`` computes the same function as ``SphericalKVCache.decode`` (logits from
    codes, value sum in rotated coordinates, Π_Vᵀ once, + μ_V), but for many queries at
    once: per (layer, kv-head) it keeps the kept states' rotated code points s·ĉ (what the
    codes name) and forms logits with one matrix product. On a CPU that is the fast way to
    evaluate the reference function for a 256-token chunk; tests pin it to the paged
    decode. New tokens go into the pages at the top tier, and into the snapshot."""

    def __init__(self, kv: SphericalKVCache, seq: int):
        self.kv, self.seq = kv, int(seq)
        self.num_q_heads, self.num_kv_heads = kv.num_q_heads, kv.num_kv_heads
        self.num_layers = kv.num_layers
        self._snap = [None] * kv.num_layers

    def _snapshot(self, layer):
        if self._snap[layer] is None:
            rows = []
            for h in range(self.kv.num_kv_heads):
                ks, vs = [], []
                for t, (ke, ve, _) in self.kv.paged.gather((self.seq, layer, h)).items():
                    kb, vb = self.kv.ladder.bits(t)
                    kc = self.kv.codec(layer, h, kb, KEY_SALT)
                    vc = self.kv.codec(layer, h, vb, VALUE_SALT)
                    ks.append(ke.scale.astype(np.float64)[:, None] * kc.rotated_points(ke))
                    vs.append(ve.scale.astype(np.float64)[:, None] * vc.rotated_points(ve))
                d = self.kv.head_dim
                rows.append((_Rows(np.concatenate(ks) if ks else np.zeros((0, d))),
                             _Rows(np.concatenate(vs) if vs else np.zeros((0, d)))))
            self._snap[layer] = rows
        return self._snap[layer]

    def attend(self, layer, q, scale):
        kv, s = self.kv, self.kv._seq(self.seq)
        G = kv.group_size
        kb, vb = kv.ladder.bits(kv.ladder.top)
        out = np.empty(q.shape)
        lse = np.empty(q.shape[:2])
        for h, (kbuf, vbuf) in enumerate(self._snapshot(layer)):
            qh = q[h * G:(h + 1) * G]
            if kbuf.rows.shape[0] == 0:
                out[h * G:(h + 1) * G], lse[h * G:(h + 1) * G] = 0.0, -np.inf
                continue
            qr = kv.codec(layer, h, kb, KEY_SALT).rotation.apply(qh)
            o, l = self._softmax(qr, kbuf, vbuf, scale)
            if kv.centre:       # the logit shift q·μ_K keeps lse equal to the reference's
                l = l + scale * np.einsum("gtd,d->gt", qh, s.mean_k[layer, h].astype(np.float64))
            o = kv.codec(layer, h, vb, VALUE_SALT).rotation.inverse(o)
            if kv.centre:
                o = o + s.mean_v[layer, h].astype(np.float64)
            out[h * G:(h + 1) * G], lse[h * G:(h + 1) * G] = o, l
        return out, lse

    def _softmax(self, q, k, v, scale):
        """Attention of the rotated queries q (G, T, d) over one kv-head's snapshot rows k, v:
        (out, lse) as NumPy (``spherical_kv_eval.device_store`` holds the rows on a device)."""
        return _softmax_part(q, k.rows, v.rows, scale)

    def append(self, layer, k, v):
        kv = self.kv
        encoded = kv._append(self.seq, layer, k, v)
        kb, vb = kv.ladder.bits(kv.ladder.top)
        held_k, held_v = np.empty(k.shape), np.empty(v.shape)
        for h, (ke, ve) in enumerate(encoded):     # the top-tier codes the pages now hold
            kc, vc = kv.codec(layer, h, kb, KEY_SALT), kv.codec(layer, h, vb, VALUE_SALT)
            held_k[h], held_v[h] = kc.decode(ke), vc.decode(ve)
            if self._snap[layer] is not None:
                row = self._snap[layer][h]
                row[0].extend(ke.scale.astype(np.float64)[:, None] * kc.rotated_points(ke))
                row[1].extend(ve.scale.astype(np.float64)[:, None] * vc.rotated_points(ve))
        return held_k, held_v

    def nbytes(self):
        return self.kv.bytes_in_use(self.seq)


def observing(policy: Optional[CompressPolicy], observe: int) -> CompressPolicy:
    """``policy`` (None: the default) with a query window of at least ``observe``, so that
    RDR's estimate reads every one of the ``observe`` queries ``fill_cache`` records (the
    window would otherwise keep only its own last few of them)."""
    policy = policy or CompressPolicy()
    return dataclasses.replace(policy, window=max(policy.window, int(observe)))


def fill_cache(kv: SphericalKVCache, keys, values, queries=None, protect=()) -> int:
    """Put a dense prefill into a new sequence of ``kv`` and return its id.

    keys, values: per layer (num_kv_heads, n, d); queries: per layer the observation window
    (num_q_heads, w, d) or None, recorded for RDR's attention estimate; protect: token
    spans [start, stop) kept at the top tier."""
    seq = kv.new_sequence()
    for layer, (k, v) in enumerate(zip(keys, values)):
        kv.append(seq, layer, k, v)
        q = None if queries is None else queries[layer]
        for t in range(0 if q is None else q.shape[1]):
            kv.observe(seq, layer, q[:, t])
    for a, b in protect:
        kv.protect(seq, a, b)
    return seq
