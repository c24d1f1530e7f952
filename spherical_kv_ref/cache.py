"""SphericalKVCache: the compressed KV cache an engine holds per model (docs/paged.md, docs/rdr.md).

A cache owns one page pool (``paged.PagedKV``) shared by all its sequences. A row of the
pool is one (sequence, layer, kv-head). Per row the cache keeps, beside its page table,
the centring means μ_K, μ_V (float32, fixed by the row's first appended chunk). New states
enter at the top tier; ``compress`` runs RDR over every layer and kv-head of a sequence and
applies the answer (evict, demote; never promote); ``decode`` runs the paged decode for
the query heads of every kv-head of one layer (GQA: a group of query heads shares its
kv-head's pages).

Bytes. ``bytes_in_use(seq)`` is what the pool really holds for the sequence: pages ×
page_bytes, padding of partly filled pages included (the means and page metadata are not
counted). ``compress(seq, budget_bytes)`` guarantees ``bytes_in_use(seq) <= budget_bytes``
afterwards, because RDR charges exactly that page count.

Errors. Every public method validates before it changes anything; an error (ValueError,
or ``paged.PoolExhaustedError`` which is one) leaves the cache as it was.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np

from .ada import mixed_tier_attention, softmax_scale_of
from .codec import SphericalCodec, as_real_array, check_finite, whole as _whole
from .paged import PagedKV, PageTable, stored_rotated
from .paged_decode import PagedDecodeTables, paged_decode
from .rotation import KEY_SALT, VALUE_SALT
from .tiers import TierLadder

__all__ = ["CompressPolicy", "CompressReport", "LayerPageTable", "SphericalKVCache",
           "RowForCompress", "CompressPlan", "plan_compress", "compress_method",
           "set_cache_settings", "tier_pages", "tiers_by_row"]


@dataclass(frozen=True)
class CompressPolicy:
    """How the cache protects states and when it re-runs RDR by itself.

    sinks: the first ``sinks`` tokens of every layer are protected (attention sinks; with
        centring on they are the largest-error vectors, docs/format.md "Centring").
    recent: the last ``recent`` tokens of every layer are protected (the recent window).
    window: how many recent queries per (sequence, layer) are kept, from ``decode`` and
        ``observe``, to estimate attention probabilities for RDR.
    every: re-run ``compress(seq, budget_bytes)`` automatically once this many tokens have
        been appended to the last layer since the previous compress (None: only when asked).
    budget_bytes: the budget of the automatic runs (required with ``every``).
    method: the RDR solver, "fast" or "milp".
    prior: weight of a uniform prior mixed into the attention estimate,
        p̂ = (1 − prior)·p_window + prior/n. The window sees a few queries; the queries
        that come later attend elsewhere too, and a state the window never looked at is
        not worthless. Measured on SmolLM2/Austen (docs/rdr.md): 0.2 cut ΔPPL at 25 % and
        15 % budgets by about half against 0, and did not hurt at 10 %.
    coherence: charge evictions with the row's measured coherence factor (the output
        shifts of evicted states share a direction and add up, code errors do not;
        docs/rdr.md §1). Measured on SmolLM2/Austen (4K contexts) it is about 8–60 per
        row, and with it the next-token KL divergence fell 3–4× at 10–25 % budgets
        (docs/rdr.md §5). False gives the independent-errors surrogate.
    key_term: "lognormal" (default) or "linear", the key-error term of
        ``rdr.distortion``: at 2 bits the logit error is large enough that the
        first-order term underestimates it several times.
    horizon: 0 (default): the attention estimate reads the recorded queries where they
        were recorded. N > 0: they are first carried through RoPE to the next N decode
        positions (``rdr.statistics.future_queries``: the recent queries' mean and
        covariance rotated to the positions to come and averaged; the cache needs
        ``rope_inv_freq``). On SmolLM2/Austen it raised the greedy margin error against
        the last-N estimate (docs/rdr.md §5), so it is off by default.
    """
    sinks: int = 4
    recent: int = 32
    window: int = 8
    every: Optional[int] = None
    budget_bytes: Optional[int] = None
    method: str = "fast"
    prior: float = 0.2
    coherence: bool = True
    key_term: str = "lognormal"
    horizon: int = 0

    def __post_init__(self):
        if not isinstance(self.coherence, (bool, np.bool_)):
            raise ValueError(f"policy.coherence must be True or False, got {self.coherence!r}")
        if self.key_term not in ("linear", "lognormal"):
            raise ValueError(f"policy.key_term must be 'linear' or 'lognormal', got {self.key_term!r}")
        if not (0.0 <= float(self.prior) <= 1.0):
            raise ValueError(f"policy.prior must be in [0, 1], got {self.prior!r}")
        for name in ("sinks", "recent", "window", "horizon"):
            v = getattr(self, name)
            if int(v) != v or v < 0:
                raise ValueError(f"policy.{name} must be a non-negative integer, got {v!r}")
        if self.every is not None:
            if int(self.every) != self.every or self.every < 1:
                raise ValueError(f"policy.every must be a positive integer or None, got {self.every!r}")
            if self.budget_bytes is None:
                raise ValueError("policy.every needs policy.budget_bytes (the budget of the automatic runs)")
        if self.budget_bytes is not None and (int(self.budget_bytes) != self.budget_bytes
                                              or self.budget_bytes < 0):
            raise ValueError(f"policy.budget_bytes must be a non-negative integer, got {self.budget_bytes!r}")
        if self.method not in ("fast", "milp"):
            raise ValueError(f"policy.method must be 'fast' or 'milp', got {self.method!r}")


@dataclass(frozen=True)
class CompressReport:
    """What one ``compress`` did. Byte figures are pages × page_bytes."""
    bytes_before: int
    bytes_after: int
    budget_bytes: int
    states_before: int
    states_kept: int
    states_demoted: int
    allocation: Optional["rdr.Allocation"]

    def __repr__(self) -> str:
        # a summary: the allocation's per-state tiers (one entry per state) stay in .allocation
        a = self.allocation
        how = "no allocation" if a is None else (
            f"{a.method}, {'optimal' if a.optimal else 'not proved optimal'}, gap {a.gap:.3g}")
        return (f"CompressReport(bytes {self.bytes_before} -> {self.bytes_after} of budget "
                f"{self.budget_bytes}; states {self.states_before} -> {self.states_kept} kept, "
                f"{self.states_demoted} demoted; {how})")


@dataclass(frozen=True)
class LayerPageTable:
    """The page table of one layer over rows (sequence, kv-head), the kernels' input.

    indptr, indices, last_page_len: docs/format.md CSR; rows ordered sequence-major, then
    kv-head. mean_k, mean_v: float32 (rows, d), zeros where centring is off."""
    indptr: np.ndarray
    indices: np.ndarray
    last_page_len: np.ndarray
    mean_k: np.ndarray
    mean_v: np.ndarray


@dataclass(frozen=True)
class RowForCompress:
    """One (sequence, layer, kv-head) row as ``plan_compress`` reads it: ``tier`` (n,) the
    states' current tiers; ``protected`` (n,) bool, or None for a row without states;
    ``stats`` the six arrays of ``rdr.statistics.row_statistics``."""
    key: tuple
    tier: np.ndarray
    protected: Optional[np.ndarray]
    stats: Optional[tuple]


@dataclass(frozen=True)
class CompressPlan:
    """``plan_compress``'s answer: per row its new tiers (None for a row without states),
    the solver's allocation, and the counts of the report."""
    tiers: list
    allocation: object
    states_before: int
    demoted: int


def compress_method(policy: CompressPolicy, method: Optional[str]) -> str:
    method = policy.method if method is None else method
    if method not in ("fast", "milp"):
        raise ValueError(f"method must be 'fast' or 'milp', got {method!r}")
    return method


def tier_pages(tiers, per) -> int:
    """Pages the states of one group fill at ``tiers`` (tier 0 = evicted, holds none), each
    tier's states sharing pages of per[t] states (``per[0]`` unused)."""
    c = np.bincount(np.asarray(tiers), minlength=len(per))[1:]
    return int(np.sum(-(-c // np.asarray(per[1:]))))


def tiers_by_row(rows, frees, tier, per, page_bytes: int, budget: int) -> tuple:
    """A solver's tiers over the free states of ``rows`` (in order; ``frees`` (n,) bool per
    row, None for a row without states) put back into each row's tiers, the others kept.
    Returns (tiers per row, states demoted). RuntimeError if the rows' pages exceed the
    budget: checked before the caller touches its pool (ceil is subadditive, so charging
    the fixed states' pages separately can only over-count)."""
    tiers, a, demoted, pages = [], 0, 0, 0
    for row, free in zip(rows, frees):
        if free is None:
            tiers.append(None)
            continue
        new = np.asarray(row.tier).copy()
        m = int(free.sum())
        new[free] = tier[a:a + m]
        a += m
        demoted += int(np.sum((new > 0) & (new < row.tier)))
        tiers.append(new)
        pages += tier_pages(new, per)
    if pages * page_bytes > budget:
        raise RuntimeError(f"RDR allocation needs {pages * page_bytes} bytes for budget {budget}; "
                           f"this is a bug")
    return tiers, demoted


def plan_compress(cache, rows: List[RowForCompress], budget: int, sid: int,
                  method: str) -> Optional[CompressPlan]:
    """RDR's decision for one sequence of a cache (the reference's or the device's: both
    hold ``ladder``, ``head_dim``, ``page_bytes``, ``codebook``, ``policy``,
    ``softmax_scale``, ``num_layers``, ``num_kv_heads``), from its rows in (layer, kv-head)
    order: builds one rdr.Problem (groups = rows, page padding charged), solves it and
    returns the new tiers (evict, demote, never promote). Protected states keep their tier.
    None when the sequence holds no state. ValueError naming the bytes needed if the
    protected states alone exceed the budget (nothing solved)."""
    from . import rdr       # imported here so that importing the package never needs the solver
    T, d, pb = cache.ladder.top, cache.head_dim, cache.page_bytes
    H = cache.num_kv_heads
    cost = cache.ladder.costs(d)
    per = np.array([0] + [cache.ladder.states_per_page(t, d, pb) for t in range(1, T + 1)])
    ek, ev = rdr.tier_error_constants(cache.ladder.tiers, d, kind=cache.codebook)
    dist, grp, prot, cur_all, frees = [], [], [], [], []
    fixed_pages = 0
    for row in rows:
        if row.protected is None:
            frees.append(None)
            continue
        _, layer, h = row.key
        pmask, cur = row.protected, row.tier
        p, q2, r, vn, res, kappa = row.stats
        D = rdr.distortion(p, q2, r, vn, res, ek, ev, d, softmax_scale=cache.softmax_scale,
                           eviction_factor=kappa, key_term=cache.policy.key_term)
        # options above the current tier would be promotions: make them strictly
        # dominated by the current tier, so no solver picks them
        up = np.arange(T + 1)[None, :] > cur[:, None]
        dcur = D[np.arange(len(cur)), cur]
        D = np.where(up, (dcur * (1 + 1e-6) + D[:, 0] + 1e-300)[:, None], D)
        fixed = pmask & (cur < T)    # protected but already demoted: stays as it is
        if np.any(fixed):
            fixed_pages += tier_pages(cur[fixed], per)
        free = ~fixed
        frees.append(free)
        dist.append(D[free])
        grp.append(np.full(int(free.sum()), layer * H + h, np.int64))
        prot.append(pmask[free])
        cur_all.append(cur[free])
    n_before = sum(len(row.tier) for row in rows if row.protected is not None)
    if n_before == 0:
        return None
    fixed_bytes = fixed_pages * pb
    D = np.concatenate(dist) if dist else np.zeros((0, T + 1))
    group = np.concatenate(grp) if grp else np.zeros(0, np.int64)
    protected = np.concatenate(prot) if prot else np.zeros(0, bool)
    cur_free = np.concatenate(cur_all) if cur_all else np.zeros(0, np.int64)
    # bytes the protected states need by themselves (top-tier ones share pages per group)
    top_counts = np.bincount(group[protected], minlength=cache.num_layers * H)
    need = fixed_bytes + int(np.sum(-(-top_counts // per[T]))) * pb
    if need > budget:
        raise ValueError(f"the protected states of sequence {sid} alone need {need} bytes "
                         f"(sinks, recent window and protected spans, page padding included), "
                         f"more than budget_bytes = {budget}")
    problem = rdr.Problem(D, cost, group, protected, budget - fixed_bytes, pb)
    alloc = rdr.solve(problem, method=method)
    tier = np.minimum(alloc.tier, cur_free)          # a no-op unless a solver misbehaves
    tiers, demoted = tiers_by_row(rows, frees, tier, per, pb, budget)
    return CompressPlan(tiers, alloc, n_before, demoted)


def set_cache_settings(cache, num_layers, num_kv_heads, head_dim, ladder, page_bytes,
                       pool_bytes, seed, num_q_heads, centre, policy, softmax_scale) -> tuple:
    """Checks a cache's constructor arguments (ValueError naming the argument) and sets
    num_layers, num_kv_heads, head_dim, num_q_heads, group_size, ladder, seed, centre,
    policy and softmax_scale on ``cache``: the one home of these checks for the reference
    cache and its device twin. Returns (page_bytes, pool_bytes) checked (pool default 64 MiB)."""
    cache.num_layers = _whole("num_layers", num_layers, 1)
    cache.num_kv_heads = _whole("num_kv_heads", num_kv_heads, 1)
    cache.head_dim = _whole("head_dim", head_dim, 4)
    cache.num_q_heads = cache.num_kv_heads if num_q_heads is None else _whole("num_q_heads", num_q_heads, 1)
    if cache.num_q_heads % cache.num_kv_heads:
        raise ValueError(f"num_q_heads ({cache.num_q_heads}) must be a multiple of "
                         f"num_kv_heads ({cache.num_kv_heads})")
    cache.group_size = cache.num_q_heads // cache.num_kv_heads
    cache.ladder = TierLadder() if ladder is None else ladder
    if not isinstance(cache.ladder, TierLadder):
        raise ValueError(f"ladder must be a TierLadder, got {type(cache.ladder).__name__}")
    page_bytes = _whole("page_bytes", page_bytes, 16)
    pool_bytes = 64 << 20 if pool_bytes is None else _whole("pool_bytes", pool_bytes, page_bytes)
    cache.seed = _whole("seed", seed, 0)
    cache.centre = bool(centre)
    cache.policy = CompressPolicy() if policy is None else policy
    if not isinstance(cache.policy, CompressPolicy):
        raise ValueError(f"policy must be a CompressPolicy, got {type(cache.policy).__name__}")
    cache.softmax_scale = float(softmax_scale_of(softmax_scale, cache.head_dim))
    return page_bytes, pool_bytes


class _Sequence:
    def __init__(self, num_layers, num_kv_heads, dim, window):
        self.length = np.zeros(num_layers, np.int64)
        self.mean_k = np.zeros((num_layers, num_kv_heads, dim), np.float32)
        self.mean_v = np.zeros((num_layers, num_kv_heads, dim), np.float32)
        self.has_mean = np.zeros(num_layers, bool)
        self.spans: List[tuple] = []
        self.queries = [deque(maxlen=max(window, 1)) for _ in range(num_layers)]
        self.since_compress = 0


class SphericalKVCache:
    """The compressed KV cache of one model (docs/paged.md).

    num_layers, num_kv_heads, head_dim: the model's KV shape. ladder: TierLadder (default
    ``TierLadder()``). page_bytes: page size (multiple of 16). pool_bytes: pool size, rounded
    down to whole pages (default 64 MiB). seed: the model seed of the rotations.
    num_q_heads: query heads (a multiple of num_kv_heads; default num_kv_heads).
    centre: subtract per-row means μ_K, μ_V (docs/format.md "Centring"; on by default).
    policy: CompressPolicy (default: 4 sinks and 32 recent tokens protected).
    softmax_scale: default 1/√head_dim. codebook: "uniform" (default) or "lloyd-max": the
    same bytes, the uniform codebook's decode is affine in the code (the GPU kernel's fast
    path, ~1.8x the Lloyd–Max look-up path at 4/4 bits) for 0–7 % more attention error
    (docs/PERF_NOTES.md, "Codebook quality": the default is the better codebook at the
    kernel's speed).
    num_splits: page splits per row in the paged decode (split-K). None (default): each
    decode picks its own, the CPU paged decode ``paged_decode.NUM_SPLITS`` and the GPU
    kernel by occupancy (``cupy_kernels.ada_decode.splits_for``); a number reaches both
    (``cupy_kernels.decode_cache``). It moves the result by rounding only."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int,
                 ladder: Optional[TierLadder] = None, page_bytes: int = 4096,
                 pool_bytes: Optional[int] = None, seed: int = 0, *,
                 num_q_heads: Optional[int] = None, centre: bool = True,
                 policy: Optional[CompressPolicy] = None, softmax_scale: Optional[float] = None,
                 codebook: str = "uniform", num_splits: Optional[int] = None,
                 rope_inv_freq: Optional[np.ndarray] = None):
        page_bytes, pool_bytes = set_cache_settings(
            self, num_layers, num_kv_heads, head_dim, ladder, page_bytes, pool_bytes, seed,
            num_q_heads, centre, policy, softmax_scale)
        self.codebook = codebook
        self.num_splits = None if num_splits is None else _whole("num_splits", num_splits, 1)
        self.rope_inv_freq = None
        if rope_inv_freq is not None:
            f = np.asarray(rope_inv_freq, dtype=np.float64)
            if f.shape != (self.head_dim // 2,) or not np.all(np.isfinite(f)):
                raise ValueError(f"rope_inv_freq must be {self.head_dim // 2} finite frequencies "
                                 f"(head_dim / 2), got shape {f.shape}")
            self.rope_inv_freq = f
        if self.policy.horizon and self.rope_inv_freq is None:
            raise ValueError("policy.horizon carries the queries through RoPE: the cache needs "
                             "rope_inv_freq (rdr.statistics.rope_inv_freq(head_dim, theta))")
        self.paged = PagedKV(self.ladder, self.head_dim, page_bytes, pool_bytes // page_bytes)
        self._tables = PagedDecodeTables(self.paged, codebook)
        self._codecs: Dict[tuple, SphericalCodec] = {}
        self._seqs: Dict[int, _Sequence] = {}
        self._next_seq = 0
        self._freed = set()

    # ------------------------------------------------------------------ helpers
    @property
    def page_bytes(self) -> int:
        return self.paged.pool.page_bytes

    @property
    def num_pages(self) -> int:
        return self.paged.pool.num_pages

    def codec(self, layer: int, head: int, bits: int, salt: int) -> SphericalCodec:
        """The codec of (layer, kv-head, bits, keys=KEY_SALT / values=VALUE_SALT), memoised."""
        k = (self._layer(layer), _whole("head", head, 0, self.num_kv_heads), bits, salt)
        if k not in self._codecs:
            self._codecs[k] = SphericalCodec(self.head_dim, bits, self.seed, layer=layer,
                                             head=head, salt=salt, codebook=self.codebook)
        return self._codecs[k]

    def _codec_for(self, layer, head):
        return lambda bits, salt: self.codec(layer, head, bits, salt)

    def _seq(self, seq) -> _Sequence:
        if isinstance(seq, (bool, np.bool_)) or not isinstance(seq, (int, np.integer)):
            raise ValueError(f"seq must be an integer sequence id, got {seq!r}")
        if int(seq) in self._seqs:
            return self._seqs[int(seq)]
        if int(seq) in self._freed:
            raise ValueError(f"sequence {int(seq)} has been freed")
        raise ValueError(f"unknown sequence {seq!r}")

    def _layer(self, layer) -> int:
        return _whole("layer", layer, 0, self.num_layers)

    def _queries(self, q) -> np.ndarray:
        a = as_real_array(q, "q")
        if a.shape != (self.num_q_heads, self.head_dim):
            raise ValueError(f"q must have shape (num_q_heads, head_dim) = "
                             f"({self.num_q_heads}, {self.head_dim}), got {a.shape}")
        a = a.astype(np.float64)
        check_finite(a, "q")
        return a

    def sequences(self) -> List[int]:
        return sorted(self._seqs)

    # ------------------------------------------------------------------ lifecycle
    def new_sequence(self) -> int:
        """Open a sequence; returns its id (0, 1, 2, … in order of creation)."""
        sid = self._next_seq
        self._next_seq += 1
        self._seqs[sid] = _Sequence(self.num_layers, self.num_kv_heads, self.head_dim, self.policy.window)
        for layer in range(self.num_layers):
            for h in range(self.num_kv_heads):
                self.paged.add_row((sid, layer, h))
        return sid

    def free(self, seq) -> None:
        """Return every page of a sequence to the pool; the id cannot be used again."""
        self._seq(seq)
        sid = int(seq)
        for layer in range(self.num_layers):
            for h in range(self.num_kv_heads):
                self.paged.free_row((sid, layer, h))
        del self._seqs[sid]
        self._freed.add(sid)

    # ------------------------------------------------------------------ append / protect
    def append(self, seq, layer, k, v) -> None:
        """Append t new tokens of one layer: k, v (num_kv_heads, t, head_dim), post-RoPE.

        They enter at the top tier at positions length..length+t−1 of that layer. The first
        chunk of a layer fixes its means μ_K, μ_V (per kv-head, over the chunk's tokens).
        May run an automatic compress (policy.every); if that fails, the append is undone too."""
        self._append(seq, layer, k, v)

    def _append(self, seq, layer, k, v) -> list:
        """``append``, returning the top-tier encodings it wrote, one (keys, values) pair of
        ``Encoded`` per kv-head (empty for t = 0)."""
        s = self._seq(seq)
        layer = self._layer(layer)
        sid = int(seq)
        H, d = self.num_kv_heads, self.head_dim
        arrays = []
        for name, x in (("k", k), ("v", v)):
            a = as_real_array(x, name)
            if a.ndim != 3 or a.shape[0] != H or a.shape[2] != d:
                raise ValueError(f"{name} must have shape (num_kv_heads, t, head_dim) = ({H}, t, {d}), "
                                 f"got {a.shape}")
            a = a.astype(np.float64)
            check_finite(a.swapaxes(0, 1), name)       # rows = tokens
            arrays.append(a)
        k, v = arrays
        if k.shape != v.shape:
            raise ValueError(f"k and v must have the same shape, got {k.shape} and {v.shape}")
        t = k.shape[1]
        if t == 0:
            return []
        first = self.centre and not s.has_mean[layer]
        if first:
            mk, mv = k.mean(axis=1).astype(np.float32), v.mean(axis=1).astype(np.float32)
        else:
            mk, mv = s.mean_k[layer], s.mean_v[layer]
        kb, vb = self.ladder.bits(self.ladder.top)
        encoded = []
        for h in range(H):      # encode all heads first: an encode error changes nothing
            encoded.append((self.codec(layer, h, kb, KEY_SALT).encode(k[h], mean=mk[h] if self.centre else None),
                            self.codec(layer, h, vb, VALUE_SALT).encode(v[h], mean=mv[h] if self.centre else None)))
        need = sum(self.paged.pages_needed((sid, layer, h), t) for h in range(H))
        if need > self.paged.pool.num_free:
            from .paged import PoolExhaustedError
            raise PoolExhaustedError(f"page pool exhausted: appending {t} token(s) to layer {layer} "
                                     f"needs {need} free pages, {self.paged.pool.num_free} of "
                                     f"{self.num_pages} are free")
        pos = s.length[layer] + np.arange(t)
        undo = [self.paged.append((sid, layer, h), ke, ve, pos) for h, (ke, ve) in enumerate(encoded)]
        saved = (s.has_mean[layer], s.mean_k[layer].copy(), s.mean_v[layer].copy(), s.since_compress)
        if first:
            s.mean_k[layer], s.mean_v[layer], s.has_mean[layer] = mk, mv, True
        s.length[layer] += t
        if layer == self.num_layers - 1:
            s.since_compress += t
        pol = self.policy
        if (pol.every is not None and s.since_compress >= pol.every
                and np.all(s.length == s.length[0])):
            try:
                self.compress(sid, pol.budget_bytes, method=pol.method)
            except ValueError:
                for h in range(H):
                    self.paged.undo_append((sid, layer, h), undo[h])
                s.has_mean[layer], s.mean_k[layer], s.mean_v[layer], s.since_compress = saved
                s.length[layer] -= t
                raise
        return encoded

    def protect(self, seq, start, stop) -> None:
        """Keep the tokens at positions start..stop−1 (every layer) at the top tier from now
        on. A state already demoted stays at its tier (nothing regains bits) but is no longer
        demoted or evicted; one already evicted stays evicted. The span must lie within the
        tokens appended so far (to the layer that holds the most): stop <= that length."""
        s = self._seq(seq)
        start = _whole("start", start, 0)
        stop = _whole("stop", stop, 0)
        if stop <= start:
            raise ValueError(f"protect needs start < stop, got [{start}, {stop})")
        length = int(s.length.max())
        if stop > length:
            raise ValueError(f"protect span [{start}, {stop}) goes past the sequence's {length} "
                             f"token(s): stop must be <= {length}")
        s.spans.append((start, stop))

    def protected_mask(self, seq, layer, pos) -> np.ndarray:
        """Which token positions of a layer are protected now (sinks, recent window, spans)."""
        s = self._seq(seq)
        layer = self._layer(layer)
        pos = as_real_array(pos, "pos")
        if pos.dtype.kind not in "iu":
            raise ValueError(f"pos must be integer token positions, got dtype {pos.dtype}")
        pos = pos.astype(np.int64)
        pol = self.policy
        m = (pos < pol.sinks) | (pos >= s.length[layer] - pol.recent)
        for a, b in s.spans:
            m |= (pos >= a) & (pos < b)
        return m

    # ------------------------------------------------------------------ queries
    def observe(self, seq, layer, q) -> None:
        """Record a query (num_q_heads, head_dim) for attention estimates without decoding."""
        s = self._seq(seq)
        layer = self._layer(layer)
        s.queries[layer].append(self._queries(q))

    def decode(self, seq, layer, q, record: bool = True) -> np.ndarray:
        """Attention output (num_q_heads, head_dim) float64 of one decode step of one layer.

        Query head j reads the pages of kv-head j // (num_q_heads/num_kv_heads) (GQA). The
        paged decode (paged_decode) walks each kv-head's pages once for its whole group.
        With ``record`` (default) the query is kept for RDR's attention estimates."""
        s = self._seq(seq)
        layer = self._layer(layer)
        q = self._queries(q)
        sid = int(seq)
        H, G, d = self.num_kv_heads, self.group_size, self.head_dim
        kb, vb = self.ladder.bits(self.ladder.top)
        qg = q.reshape(H, G, d)
        q_rot = np.stack([self.codec(layer, h, kb, KEY_SALT).rotate_query(qg[h]) for h in range(H)])
        q_mu = (np.einsum("hgd,hd->hg", qg, s.mean_k[layer].astype(np.float64))
                if self.centre else np.zeros((H, G)))
        table = self.paged.page_table([(sid, layer, h) for h in range(H)])
        try:
            acc, _ = paged_decode(self.paged, table, q_rot, q_mu, self._tables,
                                  self.softmax_scale, self.num_splits)
        except ValueError as e:
            raise ValueError(f"sequence {sid}, layer {layer}: {e}") from None
        out = np.empty((H, G, d))
        for h in range(H):
            out[h] = self.codec(layer, h, vb, VALUE_SALT).rotation.inverse(acc[h])
            if self.centre:
                out[h] += s.mean_v[layer, h].astype(np.float64)
        if record:
            s.queries[layer].append(q)
        return out.reshape(self.num_q_heads, d)

    def reference_decode(self, seq, layer, q) -> np.ndarray:
        """The decode specification (ada.mixed_tier_attention) over the same kept states,
        (num_q_heads, head_dim) float64; for tests and analysis. Records nothing."""
        s = self._seq(seq)
        layer = self._layer(layer)
        q = self._queries(q)
        sid, G = int(seq), self.group_size
        out = np.empty((self.num_q_heads, self.head_dim))
        for h in range(self.num_kv_heads):
            parts = []
            for t, (ke, ve, _) in self.paged.gather((sid, layer, h)).items():
                kb, vb = self.ladder.bits(t)
                parts.append((ke, ve, self.codec(layer, h, kb, KEY_SALT), self.codec(layer, h, vb, VALUE_SALT)))
            if not parts:
                raise ValueError(f"sequence {sid}, layer {layer}, kv-head {h} holds no kept state")
            out[h * G:(h + 1) * G] = mixed_tier_attention(
                q[h * G:(h + 1) * G], parts, s.mean_k[layer, h] if self.centre else None,
                s.mean_v[layer, h] if self.centre else None, self.softmax_scale)
        return out

    # ------------------------------------------------------------------ bytes, tables
    def bytes_in_use(self, seq=None) -> int:
        """Bytes the pool holds for a sequence (all sequences if None): pages × page_bytes."""
        if seq is None:
            return self.paged.pool.num_used * self.page_bytes
        self._seq(seq)
        sid = int(seq)
        return sum(self.paged.bytes((sid, l, h)) for l in range(self.num_layers)
                   for h in range(self.num_kv_heads))

    def num_states(self, seq, layer=None) -> int:
        """Kept states of a sequence (one layer, or all)."""
        self._seq(seq)
        layers = range(self.num_layers) if layer is None else [self._layer(layer)]
        return sum(self.paged.num_states((int(seq), l, h)) for l in layers for h in range(self.num_kv_heads))

    def page_table(self, seqs, layer) -> LayerPageTable:
        """The CSR page table of one layer over the rows (seq, kv-head) of the given
        sequences (an id or a list), with the rows' means: what the GPU kernel receives."""
        if isinstance(seqs, (int, np.integer)):
            seqs = [seqs]
        elif isinstance(seqs, (list, tuple, np.ndarray, range)):
            seqs = list(seqs)
        else:
            raise ValueError(f"seqs must be a sequence id or a list of them, got {seqs!r}")
        layer = self._layer(layer)
        ss = [self._seq(x) for x in seqs]
        t: PageTable = self.paged.page_table([(int(x), layer, h) for x in seqs
                                              for h in range(self.num_kv_heads)])
        mk = np.concatenate([s.mean_k[layer] for s in ss]) if ss else np.zeros((0, self.head_dim), np.float32)
        mv = np.concatenate([s.mean_v[layer] for s in ss]) if ss else np.zeros((0, self.head_dim), np.float32)
        return LayerPageTable(t.indptr, t.indices, t.last_page_len, mk, mv)

    # ------------------------------------------------------------------ compress
    def _row_statistics(self, sid, s, layer, h, st, candidates):
        """Per-state surrogate inputs of one row (rdr.statistics.row_statistics): the stored
        states as rotated float64 vectors on the host (decode never does), the group's
        recorded queries rotated alike; κ includes the row's coherence with
        ``policy.coherence``."""
        from .rdr.statistics import future_queries, row_statistics
        n = len(st)
        d = self.head_dim
        yk = np.empty((n, d))
        yv = np.empty((n, d))
        for t, (ke, ve, _) in self.paged.gather((sid, layer, h)).items():
            kb, vb = self.ladder.bits(t)
            sel = st.tier == t
            yk[sel] = stored_rotated(self.codec(layer, h, kb, KEY_SALT), ke)
            yv[sel] = stored_rotated(self.codec(layer, h, vb, VALUE_SALT), ve)
        qr = None
        if s.queries[layer]:
            G = self.group_size
            qs = np.stack(list(s.queries[layer]))[:, h * G:(h + 1) * G]       # (m, G, d)
            if self.policy.horizon:
                # the m recorded queries are those of the layer's last m positions
                qs = np.stack([future_queries(qs[:, g], self.rope_inv_freq, self.policy.horizon)
                               for g in range(G)], axis=1)
            qs = qs.reshape(-1, d)
            qr = self.codec(layer, h, 16, KEY_SALT).rotation.apply(qs)
        return row_statistics(yk, yv, qr, self.softmax_scale, self.policy.prior,
                              candidates if self.policy.coherence else None)

    def bf16_bytes(self, seq) -> int:
        """The bytes a bf16 cache would hold for the tokens appended to a sequence (2 bytes a
        coordinate, keys and values, every layer and kv-head, evicted states included): what
        ``budget_fraction`` is a fraction of."""
        s = self._seq(seq)
        return int(s.length.sum()) * self.num_kv_heads * 2 * 2 * self.head_dim

    def _budget(self, sid, budget_bytes, budget_fraction) -> int:
        if (budget_bytes is None) == (budget_fraction is None):
            raise ValueError("compress needs exactly one of budget_bytes (bytes) and "
                             "budget_fraction (a fraction of the bf16 bytes)")
        if budget_fraction is not None:
            f = budget_fraction
            if isinstance(f, (bool, np.bool_)) or not isinstance(f, (int, float, np.integer, np.floating)) \
                    or not 0.0 <= f <= 1.0:
                raise ValueError(f"budget_fraction must be a number in [0, 1], got {f!r}")
            return int(np.floor(float(f) * self.bf16_bytes(sid)))
        if isinstance(budget_bytes, (float, np.floating)):
            hint = (f"; for a fraction of the bf16 bytes pass budget_fraction={budget_bytes!r}"
                    if 0 < budget_bytes < 1 else "")
            raise ValueError(f"budget_bytes must be an integer number of bytes, got the float "
                             f"{budget_bytes!r}{hint}")
        return _whole("budget_bytes", budget_bytes, 0)

    def demote_all(self, seq, tier: int) -> None:
        """Fixed-rate compression without RDR: every unprotected state of a sequence above
        ``tier`` (1..top) is re-encoded at ``tier``; none is evicted, states at or below it
        stay. Tokens appended later still enter at the top tier. The pool is checked before
        anything changes (ValueError, nothing moved, if the new pages do not fit)."""
        s = self._seq(seq)
        tier = _whole("tier", tier, 1, self.ladder.top + 1)
        sid = int(seq)
        items = []
        for layer in range(self.num_layers):
            for h in range(self.num_kv_heads):
                key = (sid, layer, h)
                st = self.paged.states(key)
                if len(st) == 0:
                    continue
                keep = self.protected_mask(sid, layer, st.pos)
                new = np.where(keep, st.tier, np.minimum(st.tier, tier))
                items.append((key, new, self._codec_for(layer, h)))
        self.paged.retier(items)
        s.since_compress = 0

    def compress(self, seq, budget_bytes: Optional[int] = None, method: Optional[str] = None, *,
                 budget_fraction: Optional[float] = None) -> CompressReport:
        """RDR over every layer and kv-head of a sequence, applied (docs/rdr.md).

        The budget is ``budget_bytes`` (an integer number of bytes; a float is a ValueError,
        so that 0.25 is never read as 0 bytes) or ``budget_fraction`` in [0, 1] of
        ``bf16_bytes(seq)``, the bytes a bf16 cache of the same tokens would hold (rounded
        down to whole bytes): one of the two. The budget holds when compress returns; tokens
        appended later enter at the top tier and add their bytes (``policy.every`` re-runs
        compress as they come).

        Gathers per-state statistics (from the queries ``observe`` and ``decode`` recorded;
        a layer with none is scored as uniform attention, p = 1/n, docs/rdr.md §5), builds
        one rdr.Problem (groups = (layer, kv-head), page padding charged with page_bytes),
        solves it and applies the tiers: evict, demote (re-encoded from the stored state),
        never promote. Protected states (policy sinks and recent window, ``protect`` spans)
        stay where they are; at the top tier they are RDR's protected states. Afterwards
        bytes_in_use(seq) <= budget_bytes.
        ValueError naming the bytes needed if the protected states alone exceed the budget."""
        s = self._seq(seq)
        sid = int(seq)
        budget = self._budget(sid, budget_bytes, budget_fraction)
        method = compress_method(self.policy, method)
        rows = []
        for layer in range(self.num_layers):
            for h in range(self.num_kv_heads):
                key = (sid, layer, h)
                st = self.paged.states(key)
                if len(st) == 0:
                    rows.append(RowForCompress(key, st.tier, None, None))
                    continue
                pmask = self.protected_mask(sid, layer, st.pos)
                stats = self._row_statistics(sid, s, layer, h, st, ~pmask)
                rows.append(RowForCompress(key, st.tier, pmask, stats))
        before = self.bytes_in_use(sid)
        plan = plan_compress(self, rows, budget, sid, method)
        if plan is None:
            return CompressReport(before, before, budget, 0, 0, 0, None)
        items = [(row.key, new, self._codec_for(row.key[1], row.key[2]))
                 for row, new in zip(rows, plan.tiers) if new is not None]
        self.paged.retier(items)
        s.since_compress = 0
        after = self.bytes_in_use(sid)
        kept = self.num_states(sid)
        return CompressReport(before, after, budget, plan.states_before, kept, plan.demoted,
                              plan.allocation)
