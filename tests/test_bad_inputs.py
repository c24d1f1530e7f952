"""The bad-input matrix: every public entry point × every kind of bad argument it can get.

Each row of ENTRIES is one entry point: a name, how to build the object it is called on
(None: a plain function), the call with good arguments as its defaults, and which
arguments get which kinds of bad value. Every (entry, argument, kind) must raise a
ValueError (``raises`` for another documented type) whose message names the argument,
and leave the object, and the arguments it was given, exactly as they were.
"non-contiguous" is the one kind that must be accepted: the same answer as the
contiguous input. A new entry point joins by one line in ENTRIES.
"""
import copy
import inspect
import pickle
import re
from dataclasses import dataclass, field, replace
from typing import Callable, Dict, Optional, Tuple

import numpy as np
import pytest

import spherical_kv_ref as skv
from spherical_kv_ref import Encoded, SphericalCodec, TierLadder, rdr
from spherical_kv_ref.cache import CompressPolicy, SphericalKVCache
from spherical_kv_ref.paged import PoolExhaustedError

import cupy_kernels as ck

try:
    import torch
    import transformers
except ImportError:           # the hf rows skip themselves (HF)
    torch = transformers = None

from strategies_paged import assert_cache_same, cache_snapshot, snapshot

D = 16
RNG = np.random.default_rng(0)
X = RNG.standard_normal((5, D))                       # rows of vectors
KV = RNG.standard_normal((2, 3, D))                   # (kv-heads, tokens, d)
Q4 = RNG.standard_normal((4, D))                      # (query heads, d)
CODEC = SphericalCodec(D, 4, seed=1)
ENC = CODEC.encode(X)
TOP = SphericalCodec(D, 16, seed=1)
LADDER = TierLadder([(2, 2), (4, 4), (16, 16)])
GPU_Q = RNG.standard_normal((1, 8, 64)).astype(np.float32)     # ada_decode's q: (batch, Hq, d)
GPU_MEAN = RNG.standard_normal((2, 64)).astype(np.float32)      # ada_decode's means: (rows, d)
GPU = (pytest.mark.gpu,)
HF = (pytest.mark.skipif(transformers is None, reason="torch and transformers are not installed"),)
# the encode and re-tier launchers' pool: 4 pages of 1024 bytes at tiers 3 (16/16, 4 slots),
# 2 (4/4, 15 slots), 1 (2/2, 28 slots) and free
POOL_TIER = np.array([3, 2, 1, 0], np.int32)
ENC_X = RNG.standard_normal((4, 64)).astype(np.float32)          # 4 vectors of d = 64
ENC_SIG = np.where(RNG.random((2, 64)) < 0.5, -1.0, 1.0).astype(np.float32)   # 2 kv-heads
ENC_MEAN = RNG.standard_normal((3, 64)).astype(np.float32)
ENC_HEAD, ENC_PAGE, ENC_SLOT = (np.array(a, np.int32) for a in ([0, 1, 0, 1], [0, 0, 1, 2], [0, 1, 0, 0]))
ENC_MI = np.array([0, 1, 2, 0], np.int32)
# the cache the kernels read (head dim 64), and pack_pages' encoded chunks
KV64 = RNG.standard_normal((2, 3, 64))
C64 = {b: SphericalCodec(64, b, seed=1) for b in (2, 4)}
E64 = {b: c.encode(RNG.standard_normal((3, 64))) for b, c in C64.items()}
PACK_ROWS = [[(2, E64[4], E64[4])], [(1, E64[2], E64[2])]]

# the kinds of bad value
NAN, INF, DTYPE, SHAPE, NONCONTIG, EMPTY, INDEX, FREED, FLOAT = (
    "NaN", "Inf", "wrong dtype", "wrong shape", "non-contiguous", "empty", "out-of-range index",
    "freed sequence", "float for an integer")
ARRAY = (NAN, INF, DTYPE, SHAPE, NONCONTIG, EMPTY)
INT = (INDEX, FLOAT)
SEQ = (INDEX, FLOAT, FREED)
LIVE, DEAD = 0, 1                                     # the cache fixture's sequences

#: what a message may call an argument besides its own name
ALIASES = {"seq": "seq|sequence", "seqs": "seqs|sequence"}


def _cache(kv=KV, page_bytes=256):
    """Two layers, two kv-heads: sequence LIVE holds kv (as keys, kv - 1 as values), DEAD is
    freed. Head dim and page size from the arguments."""
    c = SphericalKVCache(2, 2, kv.shape[-1], LADDER, page_bytes=page_bytes,
                         pool_bytes=page_bytes * 40, num_q_heads=4, seed=2,
                         policy=CompressPolicy(sinks=1, recent=2))
    a, b = c.new_sequence(), c.new_sequence()
    for layer in range(2):
        c.append(a, layer, kv, kv - 1)
    c.free(b)
    assert (a, b) == (LIVE, DEAD)
    return c


def _cache64():
    """_cache at head dim 64 (the kernels' head dims) and pages of 1024 bytes."""
    return _cache(KV64, 1024)


def _pickled(obj):
    return pickle.dumps(obj)


ROW = (0, 0, 0)                                       # the paged fixture's row
TOP_ENC = TOP.encode(X)                               # 5 states at LADDER's top tier (16/16)


def _paged():
    """A PagedKV of LADDER at d = 16 holding one row of 5 top-tier states."""
    p = skv.paged.PagedKV(LADDER, D, 256, 40)
    p.add_row(ROW)
    p.append(ROW, TOP_ENC, TOP_ENC, np.arange(5))
    return p


def _paged_state(p):
    return pickle.dumps(snapshot(p))


# the transformers integration (spherical_kv_ref.hf): the tiny Llama config of tests/test_hf*.py
# (2 layers, 4 query / 2 kv-heads, head_dim 16); no model is run
HF_K = torch.as_tensor(RNG.standard_normal((1, 2, 5, D)), dtype=torch.float32) if torch else None
HF_ROWS = [RNG.standard_normal((2, 3, D)) for _ in range(2)]


def _hf_config():
    return transformers.LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=128,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, max_position_embeddings=256)


def _hf_cache():
    """A dense SphericalCache holding 5 tokens of both layers."""
    from spherical_kv_ref.hf import SphericalCache
    c = SphericalCache(_hf_config(), page_bytes=256)
    for layer in range(2):
        c.update(HF_K, HF_K - 1, layer)
    return c


def _hf_store(keys=None, num_q_heads=4):
    from spherical_kv_ref.hf import DenseStore
    return DenseStore(HF_ROWS if keys is None else keys, HF_ROWS if keys is None else keys,
                      num_q_heads, 0)


def _hf_state(c):
    """What a SphericalCache holds: per layer its tensors and lengths, the recorded queries,
    the store and the compressed cache (None before compress)."""
    def arr(t):
        return None if t is None else t.detach().numpy().tobytes()
    layers = [(arr(lay.keys), arr(lay.values), getattr(lay, "length", None), lay.is_initialized)
              for lay in c.layers]
    return pickle.dumps((layers, [None if q is None else q.tobytes() for q in c.observed],
                         c.store is None, c.kv is None, c.seq))


def _as_numpy(pair):
    return tuple(t.detach().numpy().copy() for t in pair)


def _tensor_bad(t):
    """The bad values of a (1, H, T, d) float tensor argument, by kind."""
    nan, inf = t.clone(), t.clone()
    nan[0, 1, 2, 3], inf[0, 0, 4, 0] = float("nan"), float("-inf")
    return {NAN: (nan,), INF: (inf,), DTYPE: (t.long(), t.numpy(), t.to(torch.complex64)),
            SHAPE: (t[..., :-1], t[:, :1], t[None], torch.cat([t, t]), t[0]),
            NONCONTIG: (t.transpose(2, 3).contiguous().transpose(2, 3), t.repeat_interleave(2, dim=-1)[..., ::2]),
            EMPTY: (t[:, :, :0],)}


@dataclass(frozen=True)
class Derive:
    """A bad value made from the object a case is called on (``fn(obj)``), for arguments whose
    good value lives in it (a GPU case's page table)."""
    fn: Callable


def _f32(a, v, at=None):
    """A float32 copy of a with v at one entry (the middle one by default)."""
    a = np.array(a, np.float32)
    a.flat[a.size // 2 if at is None else at] = v
    return a


@dataclass
class Entry:
    """One entry point. ``call(obj, **args)``; good arguments are the defaults of ``call``'s
    keywords; ``bad`` maps an argument to the kinds it is tried with; ``values`` (``vals=``
    in E) gives an
    argument's out-of-range index (default: -1 and 10**6) or any other bad value by kind."""
    name: str
    make: Optional[Callable]
    call: Callable
    bad: Dict[str, Tuple[str, ...]]
    values: Dict[Tuple[str, str], tuple] = field(default_factory=dict)
    raises: type = ValueError
    state: Callable = _pickled
    marks: tuple = ()
    alias: Optional[str] = None      # what the message says instead of the argument's name


def E(name, make, call, vals=None, raises=ValueError, state=None, marks=(), alias=None, **bad):
    return Entry(name, make, call, bad, vals or {}, raises, state or
                 (cache_snapshot if make is _cache else _pickled), marks, alias)


def _gpu_case():
    from validation.decode_cases import build_case, to_device
    import cupy as cp
    case = build_case(1, 2, 4, 64, [20, 30], LADDER, [2, 3], seed=3, codebook="uniform")
    dev = to_device(case)
    dev["case"], dev["out"] = case, cp.full((1, 8, 64), 7.0, cp.float32)
    return dev


def _on_device(a):
    """A NumPy argument as a GPU caller would pass it: on the device, non-contiguous there if
    it is here; anything else (a scalar, an object) and an array of a dtype the device cannot
    hold (strings) as it is: the launcher must refuse that host array, naming the argument."""
    if not isinstance(a, np.ndarray) or a.dtype.kind not in "biufc":
        return a
    import cupy as cp
    if a.ndim and not a.flags.c_contiguous and a.shape[-1] > 1:
        return cp.asarray(np.repeat(a, 2, axis=-1))[..., ::2]   # the same values, strided
    return cp.asarray(a)


_ADA_ARRAYS = ("q", "pages", "page_tier", "page_count", "indptr", "indices", "sigma_k", "sigma_v")


def _run_gpu_case(dev, **args):
    """ada_decode on the case, with the given arguments replaced (None: the case's own; NumPy
    arrays go to the device by _on_device); returns the output on the host."""
    from cupy_kernels import ada_decode
    a = {k: dev[k] for k in _ADA_ARRAYS}
    kw = dict(num_kv_heads=dev["case"].num_kv_heads, mean_k=dev["mean_k"], mean_v=dev["mean_v"],
              out=dev["out"])
    for k, v in args.items():
        if v is not None:
            (a if k in a else kw)[k] = _on_device(v)
    out = ada_decode(*(a[k] for k in _ADA_ARRAYS[:6]), dev["case"].tables, a["sigma_k"],
                     a["sigma_v"], **kw)
    return out.get()


def _gpu_out(dev):
    return None if dev is None else dev["out"].get().tobytes()


def _packed(field, fn=lambda a: a):
    """Derive: fn of a copy of the GPU case's packed page table array ``field``."""
    return Derive(lambda dev: fn(getattr(dev["case"].packed, field).copy()))


def _first_page(field, v):
    """Derive: the case's ``field`` (page_tier, page_count) with v at the first page of indices."""
    def f(dev):
        p = dev["case"].packed
        a = getattr(p, field).copy()
        a[p.indices[0]] = v
        return a
    return Derive(f)


def _enc_tables():
    return ck.kernel_tables(LADDER, 64, 1024, codebook="uniform")


def _gpu_pool():
    """The encode and re-tier pool (POOL_TIER) on the device, its first page holding two
    states (encoded by encode_kv_into_pages) for the re-tier moves to read."""
    import cupy as cp
    tables = _enc_tables()
    pages, tier = cp.zeros((4, 1024), cp.uint8), cp.asarray(POOL_TIER)
    sig = cp.asarray(ENC_SIG)
    ck.encode_kv_into_pages(cp.asarray(ENC_X[:2]), cp.asarray(ENC_X[2:]), pages, tier, tables,
                            sig, sig, cp.asarray(ENC_HEAD[:2]), cp.zeros(2, cp.int32),
                            cp.arange(2, dtype=cp.int32))
    return {"tables": tables, "pages": pages, "page_tier": tier}


def _pool_bytes(dev):
    return None if dev is None else dev["pages"].get().tobytes()


def _launch(dev, fn, *names, **args):
    """A launcher on the GPU pool: fn(*inputs, pages, page_tier, tables, *rest, **keywords) with
    the arguments ``names`` positional in order (encode: x first; encode_kv: k, v first; retier:
    none first), the others keywords; pages and page_tier are the pool's unless given, every
    argument goes through _on_device. Returns the pool (what the launch wrote) on the host."""
    pages = dev["pages"] if args.get("pages") is None else _on_device(args["pages"])
    tier = _on_device(args["page_tier"]) if args.get("page_tier") is not None else dev["page_tier"]
    pos = [_on_device(args[n]) for n in names]
    kw = {k: _on_device(v) for k, v in args.items()
          if k not in names and k not in ("pages", "page_tier") and v is not None}
    if fn is ck.retier:
        fn(pages, tier, dev["tables"], *pos, **kw)
    elif fn is ck.encode_kv_into_pages:
        fn(pos[0], pos[1], pages, tier, dev["tables"], *pos[2:], **kw)
    else:
        fn(pos[0], pages, tier, dev["tables"], *pos[1:], **kw)
    return dev["pages"].get()


def _decode_cache_obj():
    import cupy as cp
    c = _cache64()
    return {"cache": c, "pool": ck.upload_pool(c), "out": cp.full((1, 4, 64), 7.0, cp.float32)}


def _decode_cache_state(o):
    return None if o is None else (o["out"].get().tobytes(), pickle.dumps(cache_snapshot(o["cache"])))


ENTRIES = [
    # the codec (docs/design.md §7)
    E("SphericalCodec", None, lambda _, dim=D, bits=4, seed=0: SphericalCodec(dim, bits, seed),
      dim=INT, bits=INT, seed=INT, vals={("bits", INDEX): (5, 0), ("dim", INDEX): (3, -1), ("seed", INDEX): (-1,)}),
    E("codec.encode", lambda: CODEC, lambda c, x=X, mean=X[0]: c.encode(x, mean=mean),
      x=ARRAY, mean=(NAN, INF, DTYPE, SHAPE), vals={("mean", SHAPE): (X[0, :-1], X[:2])}),
    E("codec.decode", lambda: CODEC, lambda c, enc=ENC: c.decode(enc), enc=(DTYPE, SHAPE, EMPTY, NONCONTIG)),
    E("codec.codes", lambda: CODEC, lambda c, enc=ENC: c.codes(enc), enc=(DTYPE, SHAPE, NONCONTIG)),
    E("codec.logits", lambda: CODEC, lambda c, q=Q4, enc=ENC: c.logits(q, enc), q=ARRAY, enc=(DTYPE, SHAPE, NONCONTIG)),
    E("codec.logit_error_bound", lambda: CODEC, lambda c, q=Q4, enc=ENC: c.logit_error_bound(q, enc),
      q=ARRAY, enc=(DTYPE, SHAPE)),
    E("codec.rotated_points", lambda: CODEC, lambda c, enc=ENC: c.rotated_points(enc), enc=(DTYPE, SHAPE)),
    E("codec.max_angle_error", lambda: CODEC, lambda c, enc=ENC: c.max_angle_error(enc), enc=(DTYPE, SHAPE)),
    E("codec.angle_error", lambda: CODEC, lambda c, x=X, enc=ENC: c.angle_error(x, enc), x=ARRAY, enc=(DTYPE,)),
    E("codec.rotate_query", lambda: CODEC, lambda c, q=Q4: c.rotate_query(q), q=ARRAY),
    E("codec.expected_sq_logit_error", lambda: CODEC, lambda c, q=Q4, k=X: c.expected_sq_logit_error(q, k),
      q=(NAN, INF, DTYPE, SHAPE, NONCONTIG), k=(NAN, INF, DTYPE, SHAPE, NONCONTIG)),
    E("code_words", None, lambda _, bits=4, dim=D: skv.code_words(bits, dim), bits=INT, dim=INT,
      vals={("bits", INDEX): (5,), ("dim", INDEX): (0, -1)}),
    E("vector_bytes", None, lambda _, bits=4, dim=D: skv.vector_bytes(bits, dim), bits=INT, dim=INT,
      vals={("bits", INDEX): (5,), ("dim", INDEX): (0, -1)}),
    E("pack_codes", None, lambda _, codes=CODEC.codes(ENC), bits=4: skv.pack_codes(codes, bits),
      codes=(DTYPE, SHAPE, EMPTY, INDEX, NONCONTIG), bits=INT,
      vals={("codes", INDEX): (CODEC.codes(ENC) + 16,), ("codes", DTYPE): (CODEC.codes(ENC) + 0.5,),
            ("codes", SHAPE): (CODEC.codes(ENC)[0],), ("bits", INDEX): (5,)}),
    E("unpack_codes", None, lambda _, words=ENC.codes, bits=4, dim=D: skv.unpack_codes(words, bits, dim),
      words=(DTYPE, SHAPE, EMPTY, NONCONTIG), bits=INT, dim=INT,
      vals={("words", DTYPE): (ENC.codes + 0.5,), ("bits", INDEX): (5,), ("dim", INDEX): (0, D + 64)}),
    # attention
    E("attention", None, lambda _, q=Q4, keys=ENC, values=ENC, softmax_scale=0.25:
      skv.attention(q, keys, values, CODEC, CODEC, softmax_scale), q=ARRAY, keys=(DTYPE, EMPTY),
      values=(DTYPE, SHAPE), softmax_scale=(NAN, INF, DTYPE)),
    E("dense_attention", None, lambda _, q=Q4, k=X, v=X: skv.dense_attention(q, k, v),
      q=(NAN, INF, DTYPE, NONCONTIG), k=(NAN, INF, DTYPE, SHAPE, NONCONTIG), v=(NAN, INF, DTYPE, SHAPE),
      vals={("v", SHAPE): (X[:-1], X[None])}),
    E("softmax", None, lambda _, z=X: skv.softmax(z), z=(NAN, DTYPE, NONCONTIG)),
    # tiers
    E("TierLadder.bits", lambda: LADDER, lambda l, tier=2: l.bits(tier), tier=INT),
    E("TierLadder.bytes_per_state", lambda: LADDER, lambda l, tier=2, dim=D: l.bytes_per_state(tier, dim),
      tier=INT, dim=INT, vals={("dim", INDEX): (0, -1)}),
    E("TierLadder.states_per_page", lambda: LADDER, lambda l, tier=2, dim=D, page_bytes=256:
      l.states_per_page(tier, dim, page_bytes), tier=INT, page_bytes=INT, vals={("page_bytes", INDEX): (0, 8)}),
    # the cache (docs/design.md §7)
    E("SphericalKVCache", None, lambda _, num_layers=2, head_dim=D, page_bytes=256, pool_bytes=4096,
      softmax_scale=None: SphericalKVCache(num_layers, 2, head_dim, LADDER, page_bytes=page_bytes,
                                           pool_bytes=pool_bytes, softmax_scale=softmax_scale),
      num_layers=INT, head_dim=INT, page_bytes=INT, pool_bytes=INT, softmax_scale=(NAN, INF, DTYPE),
      vals={("num_layers", INDEX): (0,), ("head_dim", INDEX): (2,), ("pool_bytes", INDEX): (16,),
            ("page_bytes", INDEX): (8, -1)}),
    E("cache.append", _cache, lambda c, seq=LIVE, layer=1, k=KV, v=KV: c.append(seq, layer, k, v),
      seq=SEQ, layer=INT, k=ARRAY, v=ARRAY),
    E("cache.append (pool full)", _cache, lambda c, seq=LIVE, layer=0, k=np.ones((2, 200, D)),
      v=np.ones((2, 200, D)): c.append(seq, layer, k, v), raises=PoolExhaustedError, k=(INDEX,),
      alias="page pool exhausted",
      vals={("k", INDEX): (np.ones((2, 200, D)),)}),
    E("cache.protect", _cache, lambda c, seq=LIVE, start=0, stop=2: c.protect(seq, start, stop),
      seq=SEQ, start=INT, stop=INT, vals={("stop", INDEX): (0, 4, 10 ** 6)}),
    E("cache.protected_mask", _cache, lambda c, seq=LIVE, layer=0, pos=np.arange(3):
      c.protected_mask(seq, layer, pos), seq=SEQ, layer=INT, pos=(DTYPE,)),
    E("cache.observe", _cache, lambda c, seq=LIVE, layer=0, q=Q4: c.observe(seq, layer, q),
      seq=SEQ, layer=INT, q=ARRAY),
    E("cache.decode", _cache, lambda c, seq=LIVE, layer=0, q=Q4: c.decode(seq, layer, q),
      seq=SEQ, layer=INT, q=ARRAY),
    E("cache.reference_decode", _cache, lambda c, seq=LIVE, layer=0, q=Q4: c.reference_decode(seq, layer, q),
      seq=SEQ, layer=INT, q=ARRAY),
    E("cache.compress", _cache, lambda c, seq=LIVE, budget_bytes=2048: c.compress(seq, budget_bytes),
      seq=SEQ, budget_bytes=(INDEX, FLOAT), vals={("budget_bytes", INDEX): (-1,),
                                                    ("budget_bytes", FLOAT): (0.25, 2048.0)}),
    E("cache.compress (fraction)", _cache, lambda c, seq=LIVE, budget_fraction=0.8:
      c.compress(seq, budget_fraction=budget_fraction), budget_fraction=(NAN, INF, INDEX, DTYPE),
      vals={("budget_fraction", INDEX): (-0.1, 1.5)}),
    E("cache.demote_all", _cache, lambda c, seq=LIVE, tier=2: c.demote_all(seq, tier), seq=SEQ, tier=INT),
    E("cache.bytes_in_use", _cache, lambda c, seq=LIVE: c.bytes_in_use(seq), seq=SEQ),
    E("cache.bf16_bytes", _cache, lambda c, seq=LIVE: c.bf16_bytes(seq), seq=SEQ),
    E("cache.num_states", _cache, lambda c, seq=LIVE, layer=0: c.num_states(seq, layer), seq=SEQ, layer=INT),
    E("cache.page_table", _cache, lambda c, seqs=LIVE, layer=0: c.page_table(seqs, layer), seqs=(INDEX, FREED),
      layer=INT),
    E("cache.codec", _cache, lambda c, layer=0, head=1, bits=4, salt=0: c.codec(layer, head, bits, salt),
      layer=INT, head=INT, bits=INT, vals={("bits", INDEX): (5,)}),
    E("cache.free", _cache, lambda c, seq=LIVE: c.free(seq), seq=SEQ),
    # RDR (docs/design.md §5)
    E("rdr.Problem", None, lambda _, distortion=np.ones((3, 3)), cost=np.array([0, 4, 8]):
      rdr.Problem(distortion, cost, np.zeros(3, np.int64), np.zeros(3, bool), 24, None),
      distortion=(NAN, INF, DTYPE, SHAPE, NONCONTIG), cost=(NAN, SHAPE),
      vals={("distortion", SHAPE): (np.ones(3), np.ones((3, 1)))}),
    # kernel launchers (docs/design.md §6): host-side set-up here, the launches in the GPU suite
    E("kernel_tables", None, lambda _, dim=64, page_bytes=1024: ck.kernel_tables(LADDER, dim, page_bytes),
      dim=INT, page_bytes=INT, vals={("dim", INDEX): (96, 0), ("page_bytes", INDEX): (8, 1000)}),
    E("ada_decode", _gpu_case, lambda dev, q=GPU_Q: _run_gpu_case(dev, q=q), state=_gpu_out, marks=GPU,
      q=(NAN, INF, DTYPE, SHAPE, NONCONTIG)),
    E("ada_decode (indices)", _gpu_case, lambda dev, indices=None: _run_gpu_case(dev, indices=indices),
      state=_gpu_out, marks=GPU, indices=(INDEX, DTYPE),
      vals={("indices", INDEX): (np.full(4, 10 ** 6, np.int32), np.full(4, -1, np.int32)),
            ("indices", DTYPE): (np.zeros(4, np.float32),)}),
    E("ada_decode (page table)", _gpu_case, lambda dev, page_tier=None, page_count=None, indptr=None:
      _run_gpu_case(dev, page_tier=page_tier, page_count=page_count, indptr=indptr), state=_gpu_out,
      marks=GPU, page_tier=(INDEX, DTYPE, SHAPE), page_count=(INDEX, DTYPE, SHAPE),
      indptr=(INDEX, DTYPE, SHAPE),
      vals={("page_tier", INDEX): (_first_page("page_tier", 0), _first_page("page_tier", 9)),
            ("page_tier", DTYPE): (_packed("page_tier", lambda a: a.astype(np.int64)),
                                   _packed("page_tier", lambda a: a.astype(str))),
            ("page_tier", SHAPE): (_packed("page_tier", lambda a: a[:-1]), _packed("page_tier", lambda a: a[None])),
            ("page_count", INDEX): (_first_page("page_count", 0), _first_page("page_count", 10 ** 6)),
            ("page_count", DTYPE): (_packed("page_count", lambda a: a.astype(np.float32)),),
            ("page_count", SHAPE): (_packed("page_count", lambda a: a[:-1]),),
            ("indptr", INDEX): (_packed("indptr", lambda a: a + 1), _packed("indptr", lambda a: a * 2),
                                _packed("indptr", lambda a: np.array([0, a[-1] + 1, a[-1]], np.int32))),
            ("indptr", DTYPE): (_packed("indptr", lambda a: a.astype(np.int64)),),
            ("indptr", SHAPE): (_packed("indptr", lambda a: a[:-1]), _packed("indptr", lambda a: a[None]))}),
    E("ada_decode (signs)", _gpu_case, lambda dev, sigma_k=None, sigma_v=None:
      _run_gpu_case(dev, sigma_k=sigma_k, sigma_v=sigma_v), state=_gpu_out, marks=GPU,
      sigma_k=(NAN, DTYPE, SHAPE), sigma_v=(NAN, DTYPE, SHAPE),
      vals={(s, kind): v for s in ("sigma_k", "sigma_v") for kind, v in (
          (NAN, (Derive(lambda dev, s=s: _f32(dev["case"].__dict__[s], np.nan)),)),
          (DTYPE, (Derive(lambda dev, s=s: dev["case"].__dict__[s].astype(np.float64)),
                   Derive(lambda dev, s=s: dev["case"].__dict__[s].astype(str)))),
          (SHAPE, (Derive(lambda dev, s=s: dev["case"].__dict__[s][:, :-1]),
                   Derive(lambda dev, s=s: dev["case"].__dict__[s][:1]),
                   Derive(lambda dev, s=s: dev["case"].__dict__[s][None]))))}),
    E("ada_decode (means)", _gpu_case, lambda dev, mean_k=GPU_MEAN, mean_v=GPU_MEAN:
      _run_gpu_case(dev, mean_k=mean_k, mean_v=mean_v), state=_gpu_out, marks=GPU,
      mean_k=ARRAY[:-1], mean_v=ARRAY[:-1],
      vals={(m, kind): (_f32(GPU_MEAN, v),) for m in ("mean_k", "mean_v")
            for kind, v in ((NAN, np.nan), (INF, -np.inf))}),
    E("ada_decode (scalars)", _gpu_case, lambda dev, softmax_scale=0.125, num_splits=2, num_kv_heads=2:
      _run_gpu_case(dev, softmax_scale=softmax_scale, num_splits=num_splits, num_kv_heads=num_kv_heads),
      state=_gpu_out, marks=GPU, softmax_scale=(NAN, INF, DTYPE), num_splits=INT, num_kv_heads=INT,
      vals={("num_splits", INDEX): (0, -1, 10 ** 6), ("num_kv_heads", INDEX): (0, 3, -1)}),
    E("ada_decode (outputs)", _gpu_case, lambda dev, out=None, lse=None, workspace=None, pages=None:
      _run_gpu_case(dev, out=out, lse=lse, workspace=workspace, pages=pages), state=_gpu_out, marks=GPU,
      out=(DTYPE, SHAPE), lse=(DTYPE, SHAPE), workspace=(DTYPE,), pages=(DTYPE, SHAPE),
      vals={("out", DTYPE): (np.zeros((1, 8, 64)),), ("out", SHAPE): (np.zeros((1, 8, 63), np.float32),
                                                                     np.zeros((8, 64), np.float32)),
            ("lse", DTYPE): (np.zeros((1, 8)),), ("lse", SHAPE): (np.zeros((1, 7), np.float32),
                                                                  np.zeros(8, np.float32)),
            ("workspace", DTYPE): ("ws", (2, None, None)),
            ("pages", DTYPE): (_packed("pages", lambda a: a.astype(np.float32)),),
            ("pages", SHAPE): (_packed("pages", lambda a: a[:, :-16]), _packed("pages", lambda a: a[None]))}),
    E("choose_splits", None, lambda _, rows=4, total_pages=64, min_pages_per_split=8, ctas_per_sm=2, waves=2:
      ck.choose_splits(rows, total_pages, min_pages_per_split, ctas_per_sm, waves),
      rows=INT, total_pages=INT, min_pages_per_split=INT, ctas_per_sm=INT, waves=INT,
      vals={("rows", INDEX): (-1,), ("total_pages", INDEX): (-1,), ("min_pages_per_split", INDEX): (0,),
            ("ctas_per_sm", INDEX): (0,), ("waves", INDEX): (0,)}),
    E("make_workspace", None, lambda _, rows=2, group=4, dim=64, num_splits=2:
      ck.make_workspace(rows, group, dim, num_splits), rows=INT, group=INT, dim=INT, num_splits=INT,
      vals={("rows", INDEX): (-1,), ("group", INDEX): (0, 10 ** 6), ("dim", INDEX): (0, 96),
            ("num_splits", INDEX): (0, 10 ** 6)}),
    # the encode launchers: pages and page_tier are the pool's unless given
    E("encode_into_pages", _gpu_pool, lambda dev, x=ENC_X, sigma=ENC_SIG, head=ENC_HEAD, dst_page=ENC_PAGE,
      dst_slot=ENC_SLOT, part="key", page_tier=POOL_TIER, pages=None:
      _launch(dev, ck.encode_into_pages, "x", "sigma", "head", "dst_page", "dst_slot", x=x, sigma=sigma,
              head=head, dst_page=dst_page, dst_slot=dst_slot, part=part, page_tier=page_tier, pages=pages),
      state=_pool_bytes, marks=GPU, x=ARRAY[:-1], sigma=(NAN, DTYPE, SHAPE), head=(INDEX, DTYPE, SHAPE),
      dst_page=(INDEX, DTYPE), dst_slot=(INDEX, DTYPE), part=(INDEX,), page_tier=(INDEX, DTYPE, SHAPE),
      pages=(DTYPE, SHAPE),
      vals={("sigma", NAN): (_f32(ENC_SIG, np.nan),), ("head", INDEX): (ENC_HEAD + 1, ENC_HEAD - 1),
            ("dst_page", INDEX): (ENC_PAGE + 2, ENC_PAGE - 1, ENC_PAGE * 0 + 3),
            ("dst_slot", INDEX): (np.array([0, 4, 0, 0], np.int32), np.array([0, 1, 0, -1], np.int32),
                                  np.array([0, 1, 15, 0], np.int32)),
            ("part", INDEX): ("query", 0), ("page_tier", INDEX): (np.array([3, 2, 7, 0], np.int32),
                                                                  np.array([0, 2, 1, 0], np.int32)),
            ("pages", DTYPE): (np.zeros((4, 1024), np.float32),),
            ("pages", SHAPE): (np.zeros((4, 1000), np.uint8), np.zeros((4, 2, 512), np.uint8))}),
    E("encode_into_pages (mean)", _gpu_pool, lambda dev, mean=ENC_MEAN, mean_index=ENC_MI:
      _launch(dev, ck.encode_into_pages, "x", "sigma", "head", "dst_page", "dst_slot", x=ENC_X, sigma=ENC_SIG,
              head=ENC_HEAD, dst_page=ENC_PAGE, dst_slot=ENC_SLOT, mean=mean, mean_index=mean_index),
      state=_pool_bytes, marks=GPU, mean=(NAN, INF, DTYPE, SHAPE, NONCONTIG), mean_index=(INDEX, DTYPE, SHAPE),
      vals={("mean", NAN): (_f32(ENC_MEAN, np.nan),), ("mean", INF): (_f32(ENC_MEAN, np.inf),),
            ("mean_index", INDEX): (ENC_MI + 1, ENC_MI - 1)}),
    E("encode_kv_into_pages", _gpu_pool, lambda dev, k=ENC_X, v=ENC_X[::-1].copy(), sigma_k=ENC_SIG,
      sigma_v=ENC_SIG[::-1].copy(), head=ENC_HEAD, dst_page=ENC_PAGE, dst_slot=ENC_SLOT:
      _launch(dev, ck.encode_kv_into_pages, "k", "v", "sigma_k", "sigma_v", "head", "dst_page", "dst_slot",
              k=k, v=v, sigma_k=sigma_k, sigma_v=sigma_v, head=head, dst_page=dst_page, dst_slot=dst_slot),
      state=_pool_bytes, marks=GPU, k=ARRAY[:-1], v=ARRAY[:-1], sigma_k=(NAN, DTYPE, SHAPE),
      sigma_v=(NAN, DTYPE, SHAPE), head=(INDEX, DTYPE), dst_page=(INDEX, DTYPE), dst_slot=(INDEX, DTYPE, SHAPE),
      vals={("sigma_k", NAN): (_f32(ENC_SIG, np.nan),), ("sigma_v", NAN): (_f32(ENC_SIG, -np.inf),),
            ("head", INDEX): (ENC_HEAD + 1,), ("dst_page", INDEX): (ENC_PAGE + 2, ENC_PAGE * 0 + 3),
            ("dst_slot", INDEX): (np.array([0, 4, 0, 0], np.int32), np.array([0, 1, 0, -1], np.int32))}),
    E("encode_kv_into_pages (means)", _gpu_pool, lambda dev, mean_k=ENC_MEAN, mean_v=ENC_MEAN, mean_index=ENC_MI:
      _launch(dev, ck.encode_kv_into_pages, "k", "v", "sigma_k", "sigma_v", "head", "dst_page", "dst_slot",
              k=ENC_X, v=ENC_X, sigma_k=ENC_SIG, sigma_v=ENC_SIG, head=ENC_HEAD, dst_page=ENC_PAGE,
              dst_slot=ENC_SLOT, mean_k=mean_k, mean_v=mean_v, mean_index=mean_index),
      state=_pool_bytes, marks=GPU, mean_k=(NAN, DTYPE, SHAPE), mean_v=(INF, DTYPE, SHAPE), mean_index=(INDEX,),
      vals={("mean_k", NAN): (_f32(ENC_MEAN, np.nan),), ("mean_v", INF): (_f32(ENC_MEAN, np.inf),),
            ("mean_index", INDEX): (ENC_MI + 1,)}),
    # re-tier: page 0 (16/16) holds two states; they move to pages 1 (4/4) and 2 (2/2)
    E("retier", _gpu_pool, lambda dev, src_page=np.zeros(2, np.int32), src_slot=np.arange(2, dtype=np.int32),
      dst_page=np.array([1, 2], np.int32), dst_slot=np.zeros(2, np.int32), pages=None:
      _launch(dev, ck.retier, "src_page", "src_slot", "dst_page", "dst_slot", src_page=src_page,
              src_slot=src_slot, dst_page=dst_page, dst_slot=dst_slot, pages=pages),
      state=_pool_bytes, marks=GPU, src_page=(INDEX, DTYPE, SHAPE, NONCONTIG), src_slot=(INDEX, DTYPE, SHAPE),
      dst_page=(INDEX, DTYPE, SHAPE), dst_slot=(INDEX, DTYPE, SHAPE, NONCONTIG), pages=(DTYPE, SHAPE),
      vals={("src_page", INDEX): (np.array([0, 4], np.int32), np.array([-1, 0], np.int32),
                                  np.array([3, 0], np.int32), np.array([2, 0], np.int32)),
            ("src_slot", INDEX): (np.array([0, 4], np.int32), np.array([-1, 1], np.int32)),
            ("dst_page", INDEX): (np.array([1, 4], np.int32), np.array([1, -1], np.int32),
                                  np.array([1, 3], np.int32)),
            ("dst_slot", INDEX): (np.array([15, 0], np.int32), np.array([0, -1], np.int32),
                                  np.array([0, 28], np.int32)),
            ("pages", DTYPE): (np.zeros((4, 256), np.int32),), ("pages", SHAPE): (np.zeros((4, 1008), np.uint8),)}),
    # the GPU decode of a reference cache, and its host-side inputs
    E("kernel_inputs", _cache64, lambda c, seqs=LIVE, layer=1: ck.kernel_inputs(c, seqs, layer),
      state=cache_snapshot, seqs=(INDEX, FREED, FLOAT), layer=INT),
    E("kernel_inputs (cache)", None, lambda _, cache=None: ck.kernel_inputs(cache, LIVE, 0), cache=(DTYPE,),
      vals={("cache", DTYPE): (np.zeros(3), "cache", None)}),
    E("upload_pool", None, lambda _, cache=None: ck.upload_pool(cache), cache=(DTYPE,),
      vals={("cache", DTYPE): (np.zeros(3), None)}),
    E("decode_cache", _decode_cache_obj, lambda o, seqs=LIVE, layer=1, q=GPU_Q[:, :4], pool=None:
      ck.decode_cache(o["cache"], seqs, layer, _on_device(q), pool=o["pool"] if pool is None else pool,
                      out=o["out"]).get(),
      state=_decode_cache_state, marks=GPU, seqs=(INDEX, FREED, FLOAT), layer=INT, q=ARRAY[:-1],
      pool=(DTYPE,), vals={("pool", DTYPE): ("pool",)}),
    # host-side page helpers
    E("pack_pages", None, lambda _, rows=PACK_ROWS, tables=None, num_pages=None, fill=0:
      ck.pack_pages(rows, _enc_tables() if tables is None else tables, num_pages, fill=fill),
      rows=(INDEX, DTYPE, SHAPE), tables=(DTYPE,), num_pages=INT, fill=INT,
      vals={("rows", INDEX): ([[(4, E64[4], E64[4])]], [[(0, E64[4], E64[4])]]),
            ("rows", DTYPE): ([[(2.0, E64[4], E64[4])]], [[(2, E64[4].codes, E64[4])]], [[2]]),
            ("rows", SHAPE): ([[(2, E64[4], E64[4].take(slice(0, 2)))]], [[(2, E64[2], E64[2])]]),
            ("tables", DTYPE): (LADDER, "tables"), ("num_pages", INDEX): (0, 1, -1),
            ("num_pages", FLOAT): (4.0,), ("fill", INDEX): (-1, 256)}),
    E("rotation_signs", None, lambda _, codecs=(CODEC, TOP): ck.rotation_signs(codecs), codecs=(DTYPE, SHAPE, EMPTY),
      vals={("codecs", DTYPE): ((X,), "ab", (SphericalCodec(24, 4, seed=1),)),
            ("codecs", SHAPE): ((CODEC, C64[4]),), ("codecs", EMPTY): ((),)}),
    # the page pool (spherical_kv_ref.paged.PagedKV): an unknown row key is refused by every method
    E("PagedKV.append", _paged, lambda p, key=ROW, keys=TOP_ENC, values=TOP_ENC, pos=np.arange(5, 10):
      p.append(key, keys, values, pos) and None, state=_paged_state, key=(INDEX,), keys=(DTYPE, SHAPE),
      values=(DTYPE, SHAPE), pos=(DTYPE, SHAPE, FLOAT),
      vals={("key", INDEX): ((0, 0, 1), 7), ("keys", SHAPE): (TOP_ENC.take(slice(0, 4)), ENC),
            ("values", SHAPE): (TOP_ENC.take(slice(0, 4)), ENC),
            ("pos", DTYPE): (np.arange(5.0, 10.0), np.array(list("abcde"))),
            ("pos", FLOAT): (np.arange(5, 10) + 0.5,),
            ("pos", SHAPE): (np.arange(5, 9), np.arange(5, 15).reshape(2, 5))}),
    E("PagedKV.add_row", _paged, lambda p, key=(0, 0, 1): p.add_row(key), state=_paged_state, key=(INDEX,),
      vals={("key", INDEX): (ROW,)}),
    E("PagedKV.pages_needed", _paged, lambda p, key=ROW, n=3: p.pages_needed(key, n), state=_paged_state,
      key=(INDEX,), n=INT, vals={("key", INDEX): (7,), ("n", INDEX): (-1,)}),
    *(E(f"PagedKV.{m}", _paged, lambda p, key=ROW, m=m: getattr(p, m)(key), state=_paged_state, key=(INDEX,),
        vals={("key", INDEX): ((0, 0, 1), None)}) for m in ("pages", "num_states", "states", "gather", "bytes")),
    # the transformers integration (spherical_kv_ref.hf)
    E("SphericalCache", None, lambda _, observe=32: __import__("spherical_kv_ref.hf").hf.SphericalCache(
        _hf_config(), observe=observe), observe=INT, vals={("observe", INDEX): (-1,)}, marks=HF),
    E("SphericalCache.update", _hf_cache, lambda c, key_states=HF_K, value_states=HF_K * 2, layer_idx=1:
      _as_numpy(c.update(key_states, value_states, layer_idx)), state=_hf_state, marks=HF,
      key_states=ARRAY, value_states=ARRAY, layer_idx=INT,
      vals={**{("key_states", k): v for k, v in _tensor_bad(HF_K).items()},
            **{("value_states", k): v for k, v in _tensor_bad(HF_K * 2).items()}} if torch else {}),
    E("SphericalCache.compress", _hf_cache, lambda c, budget_bytes=2048, protect=((0, 2),), method="fast":
      c.compress(budget_bytes, protect, method=method), state=_hf_state, marks=HF,
      budget_bytes=(INDEX, FLOAT), protect=(INDEX, DTYPE, SHAPE), method=(INDEX,),
      vals={("budget_bytes", INDEX): (-1,), ("budget_bytes", FLOAT): (0.25, 2048.0),
            ("protect", INDEX): (((0, 6),), ((-1, 2),), ((3, 1),), ((2, 2),)),
            ("protect", DTYPE): (((0.0, 2),), ((0, "2"),), 3, ("ab",)),
            ("protect", SHAPE): (((0, 1, 2),), ((0,),), (0, 2)), ("method", INDEX): ("bogus", 3)}),
    E("SphericalCache.compress (fraction)", _hf_cache, lambda c, budget_fraction=0.5:
      c.compress(budget_fraction=budget_fraction), state=_hf_state, marks=HF,
      budget_fraction=(NAN, INF, INDEX, DTYPE), vals={("budget_fraction", INDEX): (-0.1, 1.5)}),
    E("SphericalCache.compress (ladder)", _hf_cache, lambda c, ladder=LADDER: c.compress(2048, ladder=ladder),
      state=_hf_state, marks=HF, ladder=(DTYPE,), vals={("ladder", DTYPE): ("x", [(4, 4)])}),
    E("SphericalCache.dense_kv", _hf_cache, lambda c, layer=1: c.dense_kv(layer), state=_hf_state, marks=HF,
      layer=INT),
    E("SphericalCache.set_store", _hf_cache, lambda c, store=None: c.set_store(_hf_store() if store is None
                                                                              else store),
      state=_hf_state, marks=HF, store=(DTYPE, SHAPE),
      vals={("store", DTYPE): ("store", HF_ROWS), ("store", SHAPE): (Derive(lambda c: _hf_store(num_q_heads=2)),
                                                                     Derive(lambda c: _hf_store(HF_ROWS[:1])))}),
    E("SphericalCache.from_store", None, lambda _, store=None, length=3, windows=None:
      __import__("spherical_kv_ref.hf").hf.SphericalCache.from_store(
          _hf_config(), _hf_store() if store is None else store, length, windows), marks=HF,
      store=(DTYPE, SHAPE), length=INT, windows=(SHAPE,),
      vals={("store", DTYPE): ("store", HF_ROWS), ("store", SHAPE): (Derive(lambda _: _hf_store(HF_ROWS * 2)),),
            ("length", INDEX): (0, -1), ("length", FLOAT): (3.0,), ("windows", SHAPE): ([HF_ROWS],)}),
    E("DenseStore", None, lambda _, keys=HF_ROWS, values=HF_ROWS, num_q_heads=4, nbytes=0:
      __import__("spherical_kv_ref.hf").hf.DenseStore(keys, values, num_q_heads, nbytes), marks=HF,
      keys=(NAN, INF, DTYPE, SHAPE), values=(NAN, INF, SHAPE), num_q_heads=INT, nbytes=INT,
      vals={("keys", NAN): ([HF_ROWS[0], _f32(HF_ROWS[1], np.nan)],),
            ("keys", INF): ([_f32(HF_ROWS[0], np.inf), HF_ROWS[1]],),
            ("keys", DTYPE): ([HF_ROWS[0], HF_ROWS[1].astype(str)], [HF_ROWS[0], HF_ROWS[1] + 0j], 3),
            ("keys", SHAPE): ([HF_ROWS[0], HF_ROWS[1][:, :-1]], [HF_ROWS[0][:, :, :-1], HF_ROWS[1][:, :, :-1]],
                              [HF_ROWS[0][:1], HF_ROWS[1]], []),
            ("values", NAN): ([_f32(HF_ROWS[0], np.nan), HF_ROWS[1]],),
            ("values", INF): ([HF_ROWS[0], _f32(HF_ROWS[1], -np.inf)],),
            ("values", SHAPE): (HF_ROWS[:1], [HF_ROWS[0], HF_ROWS[1][:, :, :-1]]),
            ("num_q_heads", INDEX): (0, 3, -1), ("nbytes", INDEX): (-1,)}),
    E("rdr.solve", None, lambda _, method="fast": rdr.solve(rdr.Problem(
        np.ones((3, 3)), np.array([0, 4, 8]), np.zeros(3, np.int64), np.zeros(3, bool), 24, None), method=method),
      method=(INDEX,), vals={("method", INDEX): ("exact", 3)}),
]


# ---------------------------------------------------------------------------- bad values

def _float_array(g):
    return isinstance(g, np.ndarray) and g.dtype.kind == "f"


def bad_values(entry, arg, kind, good):
    """The bad values of one (argument, kind)."""
    if (arg, kind) in entry.values:
        return entry.values[arg, kind]
    if isinstance(good, Encoded):
        return {DTYPE: (good.codes,), SHAPE: (replace(good, codes=good.codes[:, :-1]),),
                EMPTY: (good.take(slice(0, 0)),),
                NONCONTIG: (replace(good, codes=np.repeat(good.codes, 2, axis=1)[:, ::2],
                                    scale=np.repeat(good.scale, 2)[::2]),)}[kind]
    if kind in (NAN, INF):
        if good is None or isinstance(good, (int, float)):
            return (float("nan") if kind == NAN else float("inf"),)
        a = np.array(good, np.float64)
        a.flat[a.size // 2] = np.nan if kind == NAN else np.inf
        return (a,)
    if kind == DTYPE:
        if good is None or isinstance(good, (int, float)):
            return ("0.5",)
        return (np.asarray(good) + 0j, np.asarray(good).astype(str))
    if kind == SHAPE:
        g = np.asarray(good)
        return (g[..., :-1], g[None])
    if kind == NONCONTIG:
        g = np.asarray(good)
        return (np.repeat(g, 2, axis=-1)[..., ::2],)
    if kind == EMPTY:
        g = np.asarray(good)
        return (g[..., :0, :] if g.ndim >= 2 else g[:0],)
    if kind == INDEX:
        return (-1, 10 ** 6)
    if kind == FLOAT:
        return (float(good),)
    if kind == FREED:
        return (DEAD,)
    raise AssertionError(kind)


def _same(a, b):
    if isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, b)
    elif isinstance(a, Encoded):
        for f in ("scale", "codes", "mean"):
            _same(getattr(a, f), getattr(b, f))
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif hasattr(a, "__dict__") and not isinstance(a, type):
        pass                                  # objects: their state is compared elsewhere
    else:
        np.testing.assert_equal(a, b)


CASES = [pytest.param(e, arg, kind, id=f"{e.name}-{arg}-{kind}", marks=e.marks)
         for e in ENTRIES for arg, kinds in e.bad.items() if kinds for kind in kinds]


@pytest.mark.parametrize("entry, arg, kind", CASES)
def test_bad_input_is_refused_naming_the_argument(entry, arg, kind):
    good = inspect.signature(entry.call).parameters[arg].default
    obj = entry.make() if entry.make else None

    def made(value, o):            # a Derive value: made from the object it is passed to
        return value.fn(o) if isinstance(value, Derive) else value
    if kind == NONCONTIG:          # accepted, with the contiguous input's answer
        want = entry.call(entry.make() if entry.make else None)
        for value in bad_values(entry, arg, kind, good):
            o = entry.make() if entry.make else None
            _same(entry.call(o, **{arg: made(value, o)}), want)
        return
    name = entry.alias or ALIASES.get(arg, arg)
    before = entry.state(obj)
    if kind == EMPTY:              # accepted with an empty answer, or refused naming the argument
        for value in bad_values(entry, arg, kind, good):
            value = made(value, obj)
            try:
                entry.call(obj, **{arg: value})
            except ValueError as e:
                assert re.search(rf"\b({name})\b", str(e)), str(e)
            _check_state(entry, before, entry.state(obj))
        return
    for value in bad_values(entry, arg, kind, good):
        value = made(value, obj)
        kept = copy.deepcopy(value)
        with pytest.raises(entry.raises) as err:
            entry.call(obj, **{arg: value})
        assert re.search(rf"\b({name})\b", str(err.value)), \
            f"{entry.name}({arg}={value!r:.60}): the message does not name {arg!r}: {err.value}"
        _check_state(entry, before, entry.state(obj))
        _same(kept, value)                    # the argument itself is untouched


def _check_state(entry, before, after):
    if entry.state is cache_snapshot:
        assert_cache_same(before, after)
    else:
        assert before == after, f"{entry.name} changed its object on a refused call"


def test_every_public_entry_point_is_in_the_matrix():
    """The public names of both packages and the cache's methods all have a row, or are
    named here: no argument to get wrong, or not an entry point."""
    rows = {e.name.split(" ")[0] for e in ENTRIES}
    exempt = {"Encoded", "cache.new_sequence", "cache.sequences", "codebooks", "rotation",
              "__version__", "paged", "rdr",
              "TierLadder", "KernelTables", "PackedPages", "DecodeWorkspace"}
    public = set(skv.__all__) | {"SphericalKVCache"} | set(ck.__all__)
    for prefix, cls in (("cache", SphericalKVCache), ("codec", SphericalCodec)):
        public |= {f"{prefix}.{m}" for m, _ in inspect.getmembers(cls, inspect.isfunction)
                   if not m.startswith("_")}
    missing = {n for n in public - exempt if n not in rows and f"codec.{n}" not in rows}
    assert not missing, f"public entry points without a row in ENTRIES: {sorted(missing)}"
