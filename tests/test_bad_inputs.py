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

from strategies_paged import assert_cache_same, cache_snapshot

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
GPU = (pytest.mark.gpu,)

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


def _cache():
    c = SphericalKVCache(2, 2, D, LADDER, page_bytes=256, pool_bytes=256 * 40, num_q_heads=4,
                         seed=2, policy=CompressPolicy(sinks=1, recent=2))
    a, b = c.new_sequence(), c.new_sequence()
    for layer in range(2):
        c.append(a, layer, KV, KV - 1)
    c.free(b)
    assert (a, b) == (LIVE, DEAD)
    return c


def _pickled(obj):
    return pickle.dumps(obj)


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
    from cupy_kernels.cases import build_case, to_device
    import cupy as cp
    case = build_case(1, 2, 4, 64, [20, 30], LADDER, [2, 3], seed=3, codebook="uniform")
    dev = to_device(case)
    dev["case"], dev["out"] = case, cp.full((1, 8, 64), 7.0, cp.float32)
    return dev


def _run_gpu_case(dev, **arrays):
    """ada_decode on the case, with q or indices replaced (NumPy in, moved to the device)."""
    import cupy as cp
    from cupy_kernels.cases import run_case
    d = dict(dev)
    for k, a in arrays.items():
        if a is not None:
            d[k] = cp.asarray(a)
    return run_case(dev["case"], d, out=dev["out"]).get()


def _gpu_out(dev):
    return None if dev is None else dev["out"].get().tobytes()


ENTRIES = [
    # the codec (DESIGN §7)
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
    # the cache (DESIGN §7)
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
    E("cache.num_states", _cache, lambda c, seq=LIVE, layer=0: c.num_states(seq, layer), seq=SEQ, layer=INT),
    E("cache.page_table", _cache, lambda c, seqs=LIVE, layer=0: c.page_table(seqs, layer), seqs=(INDEX, FREED),
      layer=INT),
    E("cache.codec", _cache, lambda c, layer=0, head=1, bits=4, salt=0: c.codec(layer, head, bits, salt),
      layer=INT, head=INT, bits=INT, vals={("bits", INDEX): (5,)}),
    E("cache.free", _cache, lambda c, seq=LIVE: c.free(seq), seq=SEQ),
    # RDR (DESIGN §5)
    E("rdr.Problem", None, lambda _, distortion=np.ones((3, 3)), cost=np.array([0, 4, 8]):
      rdr.Problem(distortion, cost, np.zeros(3, np.int64), np.zeros(3, bool), 24, None),
      distortion=(NAN, INF, DTYPE, SHAPE, NONCONTIG), cost=(NAN, SHAPE),
      vals={("distortion", SHAPE): (np.ones(3), np.ones((3, 1)))}),
    # kernel launchers (DESIGN §6): host-side set-up here, the launches in the GPU suite
    E("kernel_tables", None, lambda _, dim=64, page_bytes=1024: ck.kernel_tables(LADDER, dim, page_bytes),
      dim=INT, page_bytes=INT, vals={("dim", INDEX): (96, 0), ("page_bytes", INDEX): (8, 1000)}),
    E("ada_decode", _gpu_case, lambda dev, q=GPU_Q: _run_gpu_case(dev, q=q), state=_gpu_out, marks=GPU,
      q=(NAN, INF, DTYPE, SHAPE, NONCONTIG)),
    E("ada_decode (indices)", _gpu_case, lambda dev, indices=None: _run_gpu_case(dev, indices=indices),
      state=_gpu_out, marks=GPU, indices=(INDEX, DTYPE),
      vals={("indices", INDEX): (np.full(4, 10 ** 6, np.int32), np.full(4, -1, np.int32)),
            ("indices", DTYPE): (np.zeros(4, np.float32),)}),
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
    elif isinstance(a, tuple):
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
    if kind == NONCONTIG:          # accepted, with the contiguous input's answer
        want = entry.call(entry.make() if entry.make else None)
        for value in bad_values(entry, arg, kind, good):
            o = entry.make() if entry.make else None
            _same(entry.call(o, **{arg: value}), want)
        return
    name = entry.alias or ALIASES.get(arg, arg)
    before = entry.state(obj)
    if kind == EMPTY:              # accepted with an empty answer, or refused naming the argument
        for value in bad_values(entry, arg, kind, good):
            try:
                entry.call(obj, **{arg: value})
            except ValueError as e:
                assert re.search(rf"\b({name})\b", str(e)), str(e)
            _check_state(entry, before, entry.state(obj))
        return
    for value in bad_values(entry, arg, kind, good):
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
    named here: no argument to get wrong, not an entry point, or (cupy_kernels) launchers
    whose checks tests/test_launcher_checks.py fuzzes and that have no row yet."""
    rows = {e.name.split(" ")[0] for e in ENTRIES}
    exempt = {"Encoded", "cache.new_sequence", "cache.sequences", "codebooks", "rotation",
              "__version__", "paged", "rdr",
              "TierLadder", "KernelTables", "PackedPages", "DecodeWorkspace"}
    no_row_yet = {"encode_into_pages", "encode_kv_into_pages", "retier", "decode_cache",
                  "kernel_inputs", "upload_pool", "make_workspace", "choose_splits",
                  "pack_pages", "rotation_signs"}
    public = set(skv.__all__) | {"SphericalKVCache"} | set(ck.__all__)
    for prefix, cls in (("cache", SphericalKVCache), ("codec", SphericalCodec)):
        public |= {f"{prefix}.{m}" for m, _ in inspect.getmembers(cls, inspect.isfunction)
                   if not m.startswith("_")}
    missing = {n for n in public - exempt - no_row_yet if n not in rows and f"codec.{n}" not in rows}
    assert not missing, f"public entry points without a row in ENTRIES: {sorted(missing)}"
