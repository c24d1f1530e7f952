"""Rate–Distortion Retention: what to keep, and at which tier, under a byte budget (DESIGN §5, §7).

Every state i = (layer, kv-head, token) takes one option t ∈ {0 = evict, 1..T = tiers}; option
t costs ``cost[t]`` bytes and adds ``distortion[i, t]`` to the objective (the surrogate of
:func:`distortion`, derived in docs/rdr.md). The problem is a multiple-choice knapsack with
page padding:

    minimise   Σ_i D[i, t_i]
    subject to t_i = T for protected i,
               bytes(t) ≤ budget_bytes,

    bytes(t) = Σ_{g, t≥1} ⌈n_{g,t} / P_t⌉ · page_bytes,   P_t = ⌊page_bytes / cost[t]⌋,

where n_{g,t} counts the states of group g (one (layer, kv-head) of one sequence) at tier t:
states of one group and tier share pages, a page is paid for whole, evicted states cost
nothing. Without pages (``page_bytes=None``), bytes(t) = Σ_i cost[t_i].

Two solvers, one answer type (:class:`Allocation`):

* ``"milp"``: the exact model for HiGHS (scipy.optimize.milp) — one-hot binaries per free
  state, integer page counts per (group, tier). The oracle of the tests.
* ``"fast"``: lower convex hull per state, greedy by distortion saved per byte (the LP
  optimum of the relaxation), then page repair and a greedy fill; numba, no Python loop
  over states. Its certificate's ``lower_bound`` is the optimum of the LP relaxation of the
  *paged* model that ``"milp"`` solves, so it bounds the paged optimum from below.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numba
import numpy as np

from .codec import as_real_array

__all__ = ["Problem", "Allocation", "solve", "distortion", "tier_error_constants"]


# --------------------------------------------------------------------------------------------
# Distortion surrogate (docs/rdr.md)
# --------------------------------------------------------------------------------------------

def _stat(name, x, n):
    a = np.asarray(x, dtype=np.float64)
    if a.ndim > 1:
        raise ValueError(f"{name} must be a scalar or 1-D per-state array, got shape {a.shape}")
    a = np.broadcast_to(a, (n,)) if a.ndim == 0 else a
    if a.shape != (n,):
        raise ValueError(f"{name} has {a.shape[0]} entries, expected {n} (one per state)")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name} has NaN or infinite entries (first at state "
                         f"{int(np.flatnonzero(~np.isfinite(a))[0])})")
    if np.any(a < 0):
        raise ValueError(f"{name} must be non-negative")
    return a


def distortion(attn_prob, query_sq_norm, key_radius, value_norm, value_residual,
               key_error, value_error, dim, softmax_scale=None, eviction_factor=1.0,
               key_term="linear"):
    """Surrogate attention-output error D[i, t] per state and option (DESIGN §5, docs/rdr.md).

        D[i, 0] = κ_i · p_i² · ‖v_i − o‖²                                     (evicted)
        D[i, t] = p_i² · ( s² · Q_i² · r_i² · eK[t]/d · ‖v_i − o‖²  +  ‖v_i‖² · eV[t] )

    with s the softmax scale (logits are s·q·k), eK[t], eV[t] = E[ε_θ²] of tier t's key and
    value codes. First-order expected squared change of the attention output o = Σ_j p_j v_j;
    with ``softmax_scale=1`` it is DESIGN §5's formula verbatim (Q² of a pre-scaled query).

    attn_prob, query_sq_norm, key_radius, value_norm, value_residual: (n,) or scalars — the
    estimated attention probability p_i (GQA-group mean), ‖q‖² estimate of the head (raw
    query), key radius r_i (after centring), ‖v_i‖ (after centring) and ‖v_i − o‖.
    key_error, value_error: (T,) E[ε_θ²] of the key and value code of tiers 1..T (plain
    arrays; :func:`tier_error_constants` builds them from a ladder).
    dim: head dimension d. softmax_scale: default 1/√d.
    eviction_factor: κ_i ≥ 1, scalar or (n,): how much more the evictions of a row cost
    than their independent squares. Code errors come from random rotations and add in
    quadrature; the output shifts of evicted states do not (they share a direction), and
    ``SphericalKVCache`` measures κ per row on its observed queries (docs/rdr.md §1).
    key_term: "linear" (the first-order term σ², σ² = s²·Q²·r²·eK/d the logit-error
    variance) or "lognormal": E[(e^δ − 1)²] = e^{2σ²} − 2e^{σ²/2} + 1 for δ ~ N(0, σ²),
    the squared change of the state's softmax weight to all orders (equal to σ² + O(σ⁴);
    at 2 bits on SmolLM2 σ² reaches ~1, where it is several times the first-order term).
    Returns D (n, T+1) float64, column 0 = evict.
    """
    if key_term not in ("linear", "lognormal"):
        raise ValueError(f"key_term must be 'linear' or 'lognormal', got {key_term!r}")
    dim = int(dim)
    if dim < 1:
        raise ValueError(f"dim must be a positive integer, got {dim}")
    n = np.asarray(attn_prob).shape[0] if np.ndim(attn_prob) else None
    for x in (query_sq_norm, key_radius, value_norm, value_residual):
        if n is None and np.ndim(x):
            n = np.asarray(x).shape[0]
    n = 1 if n is None else n
    p = _stat("attn_prob", attn_prob, n)
    q2 = _stat("query_sq_norm", query_sq_norm, n)
    r = _stat("key_radius", key_radius, n)
    vn = _stat("value_norm", value_norm, n)
    res = _stat("value_residual", value_residual, n)
    ek = np.asarray(key_error, dtype=np.float64)
    ev = np.asarray(value_error, dtype=np.float64)
    if ek.ndim != 1 or ev.shape != ek.shape or ek.size == 0:
        raise ValueError(f"key_error and value_error must be 1-D of equal length T >= 1, "
                         f"got shapes {ek.shape} and {ev.shape}")
    if not (np.all(np.isfinite(ek)) and np.all(np.isfinite(ev))) or np.any(ek < 0) or np.any(ev < 0):
        raise ValueError("key_error and value_error must be finite and non-negative")
    s = 1.0 / np.sqrt(dim) if softmax_scale is None else float(softmax_scale)
    if not np.isfinite(s) or s <= 0:
        raise ValueError(f"softmax_scale must be positive and finite, got {softmax_scale!r}")
    kappa = _stat("eviction_factor", eviction_factor, n)
    if np.any(kappa < 1.0):
        raise ValueError("eviction_factor must be >= 1 (evictions add at least in quadrature)")
    p2 = p * p
    res2 = res * res
    out = np.empty((n, ek.size + 1))
    out[:, 0] = kappa * p2 * res2
    logit_var = (s * s) * q2 * r * r / dim                  # E[δ²] per unit E[ε_θ²]
    sigma2 = logit_var[:, None] * ek[None, :]
    if key_term == "lognormal":
        with np.errstate(over="ignore"):
            sigma2 = np.minimum(np.expm1(2.0 * sigma2) - 2.0 * np.expm1(0.5 * sigma2), np.finfo(float).max)
    out[:, 1:] = p2[:, None] * (res2[:, None] * sigma2 + (vn * vn)[:, None] * ev[None, :])
    return out


def tier_error_constants(ladder, dim, error=None, kind="lloyd-max"):
    """(eK, eV), each (T,): E[ε_θ²] of the key and value code of every tier of a ladder.

    ladder: sequence of (key_bits, value_bits), tiers 1..T. error: callable
    ``error(bits, dim) -> E[ε_θ²]``, or a mapping bits → constant; by default the codec's
    ``codebooks.expected_sq_angle_error(bits, dim, kind)`` (imported here, lazily).
    """
    pairs = [tuple(int(b) for b in pair) for pair in ladder]
    if not pairs or any(len(pair) != 2 for pair in pairs):
        raise ValueError("ladder must be a non-empty sequence of (key_bits, value_bits)")
    if error is None:
        from .codebooks import expected_sq_angle_error

        def error(bits, d):
            return expected_sq_angle_error(bits, d, kind)
    elif not callable(error):
        table = dict(error)

        def error(bits, d):
            if bits not in table:
                raise ValueError(f"no error constant given for {bits} bits")
            return table[bits]
    cache = {}
    for b in {b for pair in pairs for b in pair}:
        cache[b] = float(error(b, int(dim)))
    return (np.array([cache[k] for k, _ in pairs]), np.array([cache[v] for _, v in pairs]))


# --------------------------------------------------------------------------------------------
# Problem and allocation
# --------------------------------------------------------------------------------------------

def _as_int_bytes(name, x):
    a = np.asarray(x, dtype=np.float64)
    if not np.all(np.isfinite(a)) or np.any(a != np.floor(a)):
        raise ValueError(f"{name} must be whole numbers of bytes, got {x!r}")
    return a.astype(np.int64)


@dataclass(frozen=True, eq=False)
class Problem:
    """One RDR instance (DESIGN §7). Validated on construction; always feasible.

    distortion: (n, T+1) float, finite and >= 0; column 0 = evict, column T = top tier.
    cost: (T+1,) whole bytes per state; cost[0] = 0, cost[t] > 0.
    group: (n,) int labels of the page-sharing group of each state ((layer, kv-head) of one
        sequence); any integers, only equality matters.
    protected: (n,) bool; protected states are kept at the top tier T.
    budget_bytes: total bytes allowed (>= 0), padding of partly filled pages included.
    page_bytes: page size in bytes, or None for no page padding (bytes = Σ cost).
    """

    distortion: np.ndarray
    cost: np.ndarray
    group: np.ndarray
    protected: np.ndarray
    budget_bytes: int
    page_bytes: int | None = None
    # derived, filled by __post_init__
    group_index: np.ndarray = field(init=False, repr=False)
    num_groups: int = field(init=False)
    states_per_page: np.ndarray = field(init=False, repr=False)
    effective_cost: np.ndarray = field(init=False, repr=False)

    def __post_init__(self):
        d = as_real_array(self.distortion, "distortion").astype(np.float64)
        if d.ndim != 2 or d.shape[1] < 2:
            raise ValueError(f"distortion must be (n, T+1) with T >= 1, got shape {d.shape}")
        n, k = d.shape
        bad = ~np.isfinite(d)
        if bad.any():
            i = int(np.flatnonzero(bad.any(axis=1))[0])
            raise ValueError(f"distortion has NaN or infinite entries (first at state {i})")
        if np.any(d < 0):
            raise ValueError("distortion must be non-negative")
        cost = _as_int_bytes("cost", self.cost)
        if cost.shape != (k,):
            raise ValueError(f"cost must have T+1 = {k} entries, got shape {cost.shape}")
        if cost[0] != 0 or np.any(cost[1:] <= 0):
            raise ValueError(f"cost[0] (evict) must be 0 and every tier cost > 0, got {cost}")
        group = np.asarray(self.group)
        if group.shape != (n,) or (n and not np.issubdtype(group.dtype, np.integer)):
            raise ValueError(f"group must be (n,) = ({n},) integers, got {group.shape} {group.dtype}")
        prot = np.asarray(self.protected)
        if prot.shape != (n,) or (n and prot.dtype != np.bool_):
            raise ValueError(f"protected must be (n,) = ({n},) bool, got {prot.shape} {prot.dtype}")
        prot = prot.astype(bool)
        budget = float(self.budget_bytes)
        if not np.isfinite(budget) or budget < 0:
            raise ValueError(f"budget_bytes must be finite and >= 0, got {self.budget_bytes!r}")
        budget = int(np.floor(budget))
        page = self.page_bytes
        if page is not None:
            page = int(_as_int_bytes("page_bytes", page))
            if page < cost.max():
                raise ValueError(f"page_bytes = {page} cannot hold one state of the largest "
                                 f"tier ({int(cost.max())} bytes)")
            per_page = np.zeros(k, dtype=np.int64)
            per_page[1:] = page // cost[1:]
            eff = np.zeros(k)
            eff[1:] = page / per_page[1:]
        else:
            per_page = np.zeros(k, dtype=np.int64)
            eff = cost.astype(np.float64)
        labels, gidx = np.unique(group, return_inverse=True) if n else (np.zeros(0), np.zeros(0, np.int64))
        object.__setattr__(self, "distortion", d)
        object.__setattr__(self, "cost", cost)
        object.__setattr__(self, "group", group)
        object.__setattr__(self, "protected", prot)
        object.__setattr__(self, "budget_bytes", budget)
        object.__setattr__(self, "page_bytes", page)
        object.__setattr__(self, "group_index", gidx.astype(np.int64).reshape(n))
        object.__setattr__(self, "num_groups", int(labels.size))
        object.__setattr__(self, "states_per_page", per_page)
        object.__setattr__(self, "effective_cost", eff)
        need = self.protected_bytes
        if need > budget:
            raise ValueError(f"protected states alone need {need} bytes "
                             f"({int(prot.sum())} states at the top tier"
                             f"{', page padding included' if page is not None else ''}), "
                             f"more than budget_bytes = {budget}")

    @property
    def n(self) -> int:
        return self.distortion.shape[0]

    @property
    def num_options(self) -> int:
        """T + 1 (evict and the T tiers)."""
        return self.distortion.shape[1]

    @property
    def protected_bytes(self) -> int:
        """Bytes the protected states need by themselves at the top tier (padding included)."""
        tier = np.zeros(self.n, dtype=np.int64)
        tier[self.protected] = self.num_options - 1
        return self.bytes_of(tier)

    def counts(self, tier) -> np.ndarray:
        """(num_groups, T+1) int: how many states of each group sit at each option."""
        k = self.num_options
        flat = np.bincount(self.group_index * k + tier, minlength=self.num_groups * k)
        return flat.reshape(self.num_groups, k)

    def bytes_of(self, tier) -> int:
        """Bytes of an allocation: Σ_{g,t>=1} ⌈n_{g,t}/P_t⌉·page_bytes, or Σ_i cost[t_i]."""
        tier = self._check_tier(tier)
        if self.page_bytes is None:
            return int(self.cost[tier].sum())
        c = self.counts(tier)[:, 1:]
        per = self.states_per_page[1:]
        pages = (c + per - 1) // per
        return int(pages.sum()) * self.page_bytes

    def objective_of(self, tier) -> float:
        """Σ_i distortion[i, tier_i]."""
        tier = self._check_tier(tier)
        return float(self.distortion[np.arange(self.n), tier].sum())

    def is_feasible(self, tier) -> bool:
        """Budget respected (padding included) and every protected state at the top tier."""
        tier = self._check_tier(tier)
        return (self.bytes_of(tier) <= self.budget_bytes
                and bool(np.all(tier[self.protected] == self.num_options - 1)))

    def _check_tier(self, tier):
        tier = np.asarray(tier)
        if tier.shape != (self.n,) or (self.n and not np.issubdtype(tier.dtype, np.integer)):
            raise ValueError(f"tier must be (n,) = ({self.n},) integers, got {tier.shape}")
        if self.n and (tier.min() < 0 or tier.max() >= self.num_options):
            raise ValueError(f"tier entries must lie in 0..{self.num_options - 1}")
        return tier.astype(np.int64)


@dataclass(frozen=True)
class Allocation:
    """A solver's answer and its certificate.

    tier: (n,) int64 option per state (0 = evicted). objective: Σ D[i, tier_i].
    lower_bound: a proven lower bound of the optimum of the paged problem ("fast": the LP
    relaxation of the paged model; "milp": HiGHS's dual bound). gap: (objective −
    lower_bound) / objective (0 when objective is 0). bytes: bytes of the allocation,
    page padding included. optimal: the solver proved optimality (within its gap tolerance).
    """

    tier: np.ndarray
    objective: float
    lower_bound: float
    gap: float
    bytes: int
    method: str
    optimal: bool


def _allocation(problem, tier, lower_bound, method, optimal):
    obj = problem.objective_of(tier)
    lb = min(float(lower_bound), obj)   # guard rounding noise of the bound's last bits
    gap = (obj - lb) / obj if obj > 0 else 0.0
    if optimal is None:                 # "fast" knows it is optimal only when the gap closes
        optimal = gap == 0.0
    used = problem.bytes_of(tier)
    if used > problem.budget_bytes or not np.all(tier[problem.protected] == problem.num_options - 1):
        raise RuntimeError(f"{method} produced an infeasible allocation ({used} bytes for "
                           f"budget {problem.budget_bytes}); this is a bug")
    return Allocation(tier=tier, objective=obj, lower_bound=lb, gap=gap, bytes=used,
                      method=method, optimal=optimal)


def solve(problem: Problem, method: str = "fast", **options) -> Allocation:
    """Solve an RDR problem (DESIGN §5). method: "fast" (default) or "milp".

    "milp" options: time_limit (s), mip_rel_gap (default 0: prove optimality).
    """
    if not isinstance(problem, Problem):
        raise ValueError(f"solve expects an rdr.Problem, got {type(problem).__name__}")
    if method == "fast":
        if options:
            raise ValueError(f"method 'fast' takes no options, got {sorted(options)}")
        return _solve_fast(problem)
    if method == "milp":
        unknown = set(options) - {"time_limit", "mip_rel_gap"}
        if unknown:
            raise ValueError(f"unknown milp options {sorted(unknown)}")
        return _solve_milp(problem, **options)
    raise ValueError(f"method must be 'fast' or 'milp', got {method!r}")


def _trivial(problem):
    """Allocation when no free state can be upgraded (empty problem, or all protected)."""
    tier = np.zeros(problem.n, dtype=np.int64)
    tier[problem.protected] = problem.num_options - 1
    return tier


# --------------------------------------------------------------------------------------------
# Exact: MILP (HiGHS)
# --------------------------------------------------------------------------------------------

def _solve_milp(problem: Problem, time_limit=None, mip_rel_gap=0.0):
    from scipy import sparse
    from scipy.optimize import Bounds, LinearConstraint, milp

    n, k = problem.n, problem.num_options
    top = k - 1
    free = np.flatnonzero(~problem.protected)
    nf = free.size
    if nf == 0:
        tier = _trivial(problem)
        return _allocation(problem, tier, problem.objective_of(tier), "milp", True)
    d_free = problem.distortion[free]
    const = float(problem.distortion[problem.protected, top].sum())
    # HiGHS's tolerances are absolute (1e-7 on costs): scale so that the optimum is about
    # one unit per state, from the LP bound of the fast path; surrogate distortions span
    # many decades, and a scale set by the largest would flatten the small ones to zero
    fast = _solve_fast(problem)
    lp = fast.lower_bound - const
    scale = lp / nf if lp > 0 else (float(d_free.max()) or 1.0)

    g = problem.group_index[free]
    num_x = nf * k
    rows, cols, vals = [], [], []
    # one option per free state
    rows.append(np.repeat(np.arange(nf), k))
    cols.append(np.arange(num_x))
    vals.append(np.ones(num_x))
    lo = [np.ones(nf)]
    hi = [np.ones(nf)]
    next_row = nf
    prot_top = np.bincount(problem.group_index[problem.protected],
                           minlength=problem.num_groups)
    if problem.page_bytes is None:
        rows.append(np.full(num_x, next_row))
        cols.append(np.arange(num_x))
        vals.append(np.tile(problem.cost.astype(np.float64), nf))
        lo.append([-np.inf])
        hi.append([problem.budget_bytes - problem.cost[top] * prot_top.sum()])
        num_y = 0
        y_ub = np.zeros(0)
    else:
        G, T = problem.num_groups, k - 1
        per = problem.states_per_page[1:]
        num_y = G * T
        # states of group g at tier t (t >= 1) fit in P_t · y[g, t] slots
        fi = np.repeat(np.arange(nf), T)
        tt = np.tile(np.arange(1, k), nf)
        rows.append(next_row + g[fi] * T + (tt - 1))
        cols.append(fi * k + tt)
        vals.append(np.ones(fi.size))
        rows.append(next_row + np.arange(num_y))
        cols.append(num_x + np.arange(num_y))
        vals.append(-np.tile(per, G).astype(np.float64))
        rhs = np.zeros((G, T))
        rhs[:, T - 1] = -prot_top
        lo.append(np.full(num_y, -np.inf))
        hi.append(rhs.ravel())
        next_row += num_y
        rows.append(np.full(num_y, next_row))
        cols.append(num_x + np.arange(num_y))
        vals.append(np.full(num_y, float(problem.page_bytes)))
        lo.append([-np.inf])
        hi.append([float(problem.budget_bytes)])
        size = np.bincount(problem.group_index, minlength=G)
        y_ub = np.ceil(size[:, None] / per[None, :]).ravel()
    next_row += 1
    a = sparse.csr_array((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                         shape=(next_row, num_x + num_y))
    c = np.concatenate([d_free.ravel() / scale, np.zeros(num_y)])
    ub = np.concatenate([np.ones(num_x), y_ub])
    opts = {"mip_rel_gap": float(mip_rel_gap)}
    if time_limit is not None:
        opts["time_limit"] = float(time_limit)
    # HiGHS also stops at an absolute gap of 1e-6 by default; set it to 0 so that
    # mip_rel_gap=0 means proven optimal (scipy passes the option through, with a warning)
    opts["mip_abs_gap"] = 0.0
    # fast's answer as a cutoff (scipy cannot pass HiGHS a starting solution): nodes that
    # cannot beat it by more than the requested gap are pruned; if nothing can, HiGHS
    # reports the cutoff problem infeasible, which proves fast's answer within the gap
    fast_s = (fast.objective - const) / scale
    rel = float(mip_rel_gap)
    cutoff = fast_s * (1.0 - rel) if rel > 0 else fast_s * (1.0 + 1e-9) + 1e-9
    opts["objective_bound"] = cutoff
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Unrecognized options", category=RuntimeWarning)
        res = _run_highs(milp, c, num_x, num_y, Bounds(np.zeros(c.size), ub),
                         LinearConstraint(a, np.concatenate(lo), np.concatenate(hi)), opts)
    if res.x is None:
        if res.status == 2:     # no allocation beats the cutoff: fast's is within the gap
            bound = const + scale * min(cutoff, fast_s)
            return _allocation(problem, fast.tier, bound, "milp", True)
        bound = getattr(res, "mip_dual_bound", None)
        bound = const + scale * bound if bound is not None and np.isfinite(bound) else 0.0
        return _allocation(problem, fast.tier, max(bound, fast.lower_bound), "milp", False)
    x = np.rint(res.x[:num_x]).reshape(nf, k)
    tier = np.full(n, top, dtype=np.int64)
    tier[free] = np.argmax(x, axis=1)
    bound = getattr(res, "mip_dual_bound", None)
    bound = const + scale * bound if bound is not None and np.isfinite(bound) else 0.0
    if problem.objective_of(tier) > fast.objective:     # HiGHS's tolerances, at worst
        tier = fast.tier
    return _allocation(problem, tier, max(bound, fast.lower_bound), "milp", res.status == 0)


def _run_highs(milp, c, num_x, num_y, bounds, constraints, opts):
    """With pages, only the page counts need to be integer: once they are fixed, what is left
    is one assignment per group (each state to one option, each (group, tier) to at most
    P_t·y slots), a bipartite transportation matrix, totally unimodular, so every basic
    solution is integral. Declaring the one-hot variables continuous is then exact and
    leaves HiGHS a few hundred integer variables instead of n·(T+1). Without pages the
    budget row couples all states and every variable stays integer."""
    integrality = np.ones(c.size)
    if num_y:
        integrality[:num_x] = 0
    res = milp(c, integrality=integrality, bounds=bounds, constraints=constraints, options=opts)
    if res.x is not None and num_y:
        x = res.x[:num_x]
        if np.abs(x - np.rint(x)).max() > 1e-6:     # a non-basic optimum: ask for binaries
            res = milp(c, integrality=np.ones(c.size), bounds=bounds,
                       constraints=constraints, options=opts)
    return res


# --------------------------------------------------------------------------------------------
# Fast: convex hull + greedy (LP optimum) + page repair + fill
# --------------------------------------------------------------------------------------------

@numba.njit(cache=True)
def _hulls(d, free, order, ce):
    """Lower convex hull of (effective cost, distortion) of every free state.

    Options are visited in ascending effective cost (``order``, shared by all states).
    Returns vert (nf, K) option ids along the hull from evict, nv (nf,) hull sizes, and for
    the segments between consecutive vertices their gain per byte (strictly decreasing along
    a hull, so any sort by gain keeps each state's segments in hull order)."""
    nf = free.size
    k = order.size
    vert = np.zeros((nf, k), dtype=np.int64)
    nv = np.zeros(nf, dtype=np.int64)
    gain = np.zeros((nf, k - 1))
    for f in range(nf):
        i = free[f]
        m = 0
        for j in range(k):
            o = order[j]
            if m > 0 and ce[vert[f, m - 1]] == ce[o]:
                if d[i, o] >= d[i, vert[f, m - 1]]:
                    continue
                m -= 1                               # same cost, lower distortion
            # pop while the last vertex is not strictly below the chord to o
            while m >= 2:
                a = vert[f, m - 2]
                b = vert[f, m - 1]
                s_ab = (d[i, b] - d[i, a]) / (ce[b] - ce[a])
                s_bo = (d[i, o] - d[i, b]) / (ce[o] - ce[b])
                if s_ab >= s_bo:
                    m -= 1
                else:
                    break
            vert[f, m] = o
            m += 1
        # keep the descending part only: a segment must lower the distortion
        nv[f] = 1
        for j in range(1, m):
            a = vert[f, j - 1]
            b = vert[f, j]
            s = (d[i, b] - d[i, a]) / (ce[b] - ce[a])
            if s >= 0.0:
                break
            gain[f, j - 1] = -s
            nv[f] = j + 1
    return vert, nv, gain


@numba.njit(cache=True)
def _segments(nv, gain):
    """Flatten the hull segments: (state, gain) of every segment, state-major."""
    total = 0
    for f in range(nv.size):
        total += nv[f] - 1
    seg_state = np.empty(total, dtype=np.int64)
    seg_gain = np.empty(total)
    s = 0
    for f in range(nv.size):
        for j in range(nv[f] - 1):
            seg_state[s] = f
            seg_gain[s] = gain[f, j]
            s += 1
    return seg_state, seg_gain


@numba.njit(cache=True)
def _vertex_at_prefix(m, sorted_state, nf):
    """Hull vertex of every free state when the first m segments (in gain order) are taken:
    how many of its segments the prefix holds (they are its first ones, in hull order)."""
    v = np.zeros(nf, dtype=np.int64)
    for r in range(m):
        v[sorted_state[r]] += 1
    return v


@numba.njit(cache=True)
def _paged_bytes_at(m, sorted_state, vert, fgroup, base_counts, per, page_bytes):
    counts = base_counts.copy()
    v = _vertex_at_prefix(m, sorted_state, fgroup.size)
    for f in range(fgroup.size):
        counts[fgroup[f], vert[f, v[f]]] += 1
    pages = 0
    for g in range(counts.shape[0]):
        for t in range(1, counts.shape[1]):
            pages += (counts[g, t] + per[t] - 1) // per[t]
    return pages * page_bytes


@numba.njit(cache=True)
def _fill(start, sorted_state, v, vert, nv, fgroup, counts, cost, per, page_bytes, used, budget):
    """Walk the segments after the prefix in gain order; take each one whose exact byte
    change (new page opened, old page freed) still fits the budget, else freeze its state
    (its later segments need this one). Updates v and counts in place; returns bytes used."""
    frozen = np.zeros(nv.size, dtype=np.bool_)
    paged = page_bytes > 0
    for s in range(start, sorted_state.size):
        if not paged and used == budget:
            break       # whole bytes, every hull step costs >= 1: nothing fits any more
        f = sorted_state[s]
        if frozen[f] or v[f] + 1 >= nv[f]:
            continue
        a = vert[f, v[f]]
        b = vert[f, v[f] + 1]
        g = fgroup[f]
        if paged:
            delta = 0
            if counts[g, b] % per[b] == 0:
                delta += page_bytes
            if a != 0 and (counts[g, a] - 1) % per[a] == 0:
                delta -= page_bytes
        else:
            delta = cost[b] - cost[a]
        if used + delta <= budget:
            used += delta
            counts[g, a] -= 1
            counts[g, b] += 1
            v[f] += 1
        else:
            frozen[f] = True
    return used


def _solve_fast(problem: Problem) -> Allocation:
    """Hull → greedy (LP optimum, the certificate) → page repair → fill (docs/rdr.md §4)."""
    n, k = problem.n, problem.num_options
    top = k - 1
    free = np.flatnonzero(~problem.protected).astype(np.int64)
    if free.size == 0:
        tier = _trivial(problem)
        return _allocation(problem, tier, problem.objective_of(tier), "fast", True)
    ce = problem.effective_cost
    order = np.argsort(ce, kind="stable").astype(np.int64)
    vert, nv, gain = _hulls(problem.distortion, free, order, ce)
    seg_state, seg_gain = _segments(nv, gain)
    # greedy order: most distortion saved per byte first (the LP relaxation's order); the
    # gains along one hull strictly decrease, so each state's segments stay in hull order
    srt = np.argsort(-seg_gain)
    sorted_state, sorted_cost = _sort_segments(srt, seg_state, nv, vert, ce)
    budget = problem.budget_bytes
    free_budget = budget - int(problem.protected.sum()) * ce[top]
    cum = np.cumsum(sorted_cost)
    m_lp = int(np.searchsorted(cum, free_budget, side="right"))

    # LP optimum: the prefix m_lp plus a fraction of the next segment (evaluated as a sum
    # over states, not as base − Σ gains, to avoid cancellation)
    v = _vertex_at_prefix(m_lp, sorted_state, free.size)
    rows = np.arange(free.size)
    tier = np.full(n, top, dtype=np.int64)
    tier[free] = vert[rows, v]
    lower = problem.objective_of(tier)
    if m_lp < srt.size:
        spare = free_budget - (cum[m_lp - 1] if m_lp > 0 else 0.0)
        lower -= max(spare, 0.0) * seg_gain[srt[m_lp]]

    fgroup = problem.group_index[free]
    base_counts = np.zeros((problem.num_groups, k), dtype=np.int64)
    base_counts[:, top] = np.bincount(problem.group_index[problem.protected],
                                      minlength=problem.num_groups)
    m = m_lp
    if problem.page_bytes is None:
        page_bytes, per = 0, np.ones(k, dtype=np.int64)
    else:
        page_bytes, per = problem.page_bytes, problem.states_per_page
        # page repair: step the prefix back by the bytes it overshoots (padding), until it
        # fits; prefix 0 (protected states only) fits by construction of Problem
        used = _paged_bytes_at(m, sorted_state, vert, fgroup, base_counts, per, page_bytes)
        while used > budget:
            target = (cum[m - 1] if m > 0 else 0.0) - (used - budget)
            m = min(m - 1, int(np.searchsorted(cum, target, side="right")))
            used = _paged_bytes_at(m, sorted_state, vert, fgroup, base_counts, per, page_bytes)
        if m != m_lp:
            v = _vertex_at_prefix(m, sorted_state, free.size)
    ftier = vert[rows, v]
    tier[free] = ftier
    counts = problem.counts(tier)
    used = problem.bytes_of(tier)
    # fill: keep walking the greedy order with exact byte changes (pages opened or freed)
    _fill(m, sorted_state, v, vert, nv, fgroup, counts, problem.cost, per, page_bytes,
          used, budget)
    ftier = vert[rows, v]
    if page_bytes:
        gorder, gstart = _group_order(fgroup, problem.num_groups)
        _fill_free_slots(problem.distortion, free, gorder, gstart, ftier, counts, per)
    tier[free] = ftier
    if page_bytes:
        obj = problem.objective_of(tier)
        if obj > 0 and obj - lower > _SEARCH_GAP * obj and free.size <= _SEARCH_MAX_STATES:
            lam = seg_gain[srt[m_lp]] if m_lp < srt.size else 0.0
            better = _search_pages(problem, free, gorder, gstart, counts, lam)
            if better is not None and problem.objective_of(better) < obj:
                tier = better
    return _allocation(problem, tier, lower, "fast", None)


#: fast runs the page-count search only when its certificate leaves more than this relative
#: gap: the search cannot win more than the gap, and with many pages per group (the serving
#: case) the greedy is already that close
_SEARCH_GAP = 1e-5
#: ... and only up to this many free states: the search costs about a quarter second per
#: group of 500 states on one core (23 s for 90 groups of a 512-token prefill of SmolLM2),
#: far more than it can win where groups hold many pages
_SEARCH_MAX_STATES = 20_000


def _search_pages(problem, free, gorder, gstart, counts, lam, max_rounds=8):
    """Step 6 (docs/rdr.md §4): per group, candidate page counts by local search around the
    current ones, each with its exact best assignment; then one candidate per group by a
    knapsack over the page total. Returns the tiers, or None if nothing fits (cannot
    happen: the current page counts are candidates)."""
    k, top = problem.num_options, problem.num_options - 1
    per = problem.states_per_page
    prot_top = np.bincount(problem.group_index[problem.protected], minlength=problem.num_groups)
    y_now = np.zeros_like(counts)
    y_now[:, 1:] = (counts[:, 1:] + per[1:] - 1) // per[1:]
    lam_page = lam * problem.page_bytes
    c_group, c_pages, c_dist, c_y = [], [], [], []
    for g in range(problem.num_groups):
        rows = free[gorder[gstart[g]:gstart[g + 1]]]
        pg, dist, ys = _page_search(problem.distortion, rows, int(prot_top[g]), per,
                                    y_now[g], lam_page, max_rounds)
        c_group.append(np.full(pg.size, g))
        c_pages.append(pg)
        c_dist.append(dist)
        c_y.append(ys)
    c_pages = np.concatenate(c_pages)
    chosen = _choose_pages(np.concatenate(c_group), c_pages, np.concatenate(c_dist),
                           problem.num_groups, problem.budget_bytes // problem.page_bytes)
    if np.any(chosen < 0):
        return None
    c_y = np.concatenate(c_y)
    tier = np.full(problem.n, top, dtype=np.int64)
    cap = np.zeros(k, dtype=np.int64)
    for g in range(problem.num_groups):
        rows = free[gorder[gstart[g]:gstart[g + 1]]]
        y = c_y[chosen[g]]
        cap[1:] = y[1:] * per[1:]
        cap[top] -= prot_top[g]
        part = np.empty(rows.size, dtype=np.int64)
        _group_transport(problem.distortion, rows, cap, part)
        tier[rows] = part
    return tier


@numba.njit(cache=True)
def _sort_segments(srt, seg_state, nv, vert, ce):
    """State and effective byte cost of every hull segment, in the greedy order srt."""
    nf = nv.size
    first = np.empty(nf, dtype=np.int64)
    total = 0
    for f in range(nf):
        first[f] = total
        total += nv[f] - 1
    sorted_state = np.empty(srt.size, dtype=np.int64)
    sorted_cost = np.empty(srt.size)
    for r in range(srt.size):
        s = srt[r]
        f = seg_state[s]
        j = s - first[f]
        sorted_state[r] = f
        sorted_cost[r] = ce[vert[f, j + 1]] - ce[vert[f, j]]
    return sorted_state, sorted_cost


@numba.njit(cache=True)
def _group_order(fgroup, num_groups):
    """Counting sort of the free states by group: (order, start offsets (G+1,))."""
    start = np.zeros(num_groups + 1, dtype=np.int64)
    for f in range(fgroup.size):
        start[fgroup[f] + 1] += 1
    for g in range(num_groups):
        start[g + 1] += start[g]
    fill = start[:-1].copy()
    order = np.empty(fgroup.size, dtype=np.int64)
    for f in range(fgroup.size):
        g = fgroup[f]
        order[fill[g]] = f
        fill[g] += 1
    return order, start


@numba.njit(cache=True)
def _fill_free_slots(d, free, gorder, gstart, ftier, counts, per):
    """Use the empty slots of partly filled pages, which are paid for already: for every
    (group, tier b), top tier first, move the states of that group that gain most from
    option b into its free slots. Leaving a page never costs bytes, so the budget holds;
    repeated while something moves (a move frees a slot elsewhere), at most 4 passes."""
    k = counts.shape[1]
    for _ in range(4):
        moved = False
        for g in range(counts.shape[0]):
            for b in range(k - 1, 0, -1):
                slots = -(-counts[g, b] // per[b]) * per[b] - counts[g, b]
                if slots == 0:
                    continue
                best_gain = np.empty(slots)
                best_f = np.empty(slots, dtype=np.int64)
                nb = 0
                for idx in range(gstart[g], gstart[g + 1]):
                    f = gorder[idx]
                    a = ftier[f]
                    if a == b:
                        continue
                    gain = d[free[f], a] - d[free[f], b]
                    if gain <= 0.0 or (nb == slots and gain <= best_gain[nb - 1]):
                        continue
                    j = nb if nb < slots else nb - 1     # insertion into a sorted top list
                    while j > 0 and best_gain[j - 1] < gain:
                        if j < slots:
                            best_gain[j] = best_gain[j - 1]
                            best_f[j] = best_f[j - 1]
                        j -= 1
                    best_gain[j] = gain
                    best_f[j] = f
                    if nb < slots:
                        nb += 1
                for j in range(nb):
                    f = best_f[j]
                    counts[g, ftier[f]] -= 1
                    counts[g, b] += 1
                    ftier[f] = b
                    moved = True
        if not moved:
            break


# --------------------------------------------------------------------------------------------
# Fast, step 6: page-count search per group (docs/rdr.md §4)
# --------------------------------------------------------------------------------------------

@numba.njit(cache=True)
def _group_transport(d, rows, cap, tier, max_sweeps=40, eps=1e-2):
    """Best assignment of one group's free states to options under slot caps, exactly.

    rows: (m,) rows of d (the group's free states); cap: (K,) slots per option (cap[0] is
    ignored: evicting is always allowed). Writes tier (m,) and returns Σ D.
    Once the page counts are fixed this is a transportation problem; it is solved by its
    dual: a price mu[t] per slot of tier t, every state at its cheapest option under
    D + mu. Prices only rise: an overfull tier's price is raised to the smallest value that
    sends its excess states to their next-best options (an exact threshold, not a step).
    When no tier is overfull every state is at its priced optimum and every priced tier is
    full (a price is raised only to make its tier exactly full, and a tier fills up only
    afterwards), the complementary slackness of the transportation LP, so the assignment is
    optimal; the matrix is totally unimodular, so integral. If max_sweeps do not settle it,
    the excess states are evicted: still feasible, no longer proven optimal."""
    m = rows.size
    k = d.shape[1]
    mu = np.zeros(k)
    count = np.zeros(k, dtype=np.int64)
    tiny = 0.0
    for j in range(m):
        tiny += d[rows[j], 0]
    tiny *= 1e-12 / max(m, 1)
    for j in range(m):
        i = rows[j]
        best = 0
        for t in range(1, k):
            if d[i, t] < d[i, best]:
                best = t
        tier[j] = best
        count[best] += 1
    leave = np.empty(m)
    alt = np.empty(m, dtype=np.int64)
    who = np.empty(m, dtype=np.int64)
    for _ in range(max_sweeps):
        moved = False
        for t in range(1, k):
            excess = count[t] - cap[t]
            if excess <= 0:
                continue
            moved = True
            nt = 0
            for j in range(m):
                if tier[j] != t:
                    continue
                i = rows[j]
                here = d[i, t] + mu[t]
                best_s = 0
                best_v = d[i, 0]
                for s in range(1, k):
                    if s != t and d[i, s] + mu[s] < best_v:
                        best_v = d[i, s] + mu[s]
                        best_s = s
                leave[nt] = best_v - here
                alt[nt] = best_s
                who[nt] = j
                nt += 1
            order = np.argsort(leave[:nt], kind="mergesort")
            # raise a little past the threshold: without the margin a unit can cycle
            # through the tiers with ever smaller raises (as in an auction)
            theta = max(leave[order[excess - 1]], 0.0)
            mu[t] += theta + eps * (theta + mu[t]) + tiny
            for r in range(excess):
                j = who[order[r]]
                tier[j] = alt[order[r]]
                count[alt[order[r]]] += 1
            count[t] -= excess
        if not moved:
            break
    for t in range(k - 1, 0, -1):           # not settled: move the excess where it loses least
        excess = count[t] - cap[t]
        if excess <= 0:
            continue
        nt = 0
        for j in range(m):
            if tier[j] != t:
                continue
            i = rows[j]
            best_s = 0
            for s in range(1, k):
                if s != t and count[s] < cap[s] and d[i, s] < d[i, best_s]:
                    best_s = s
            leave[nt] = d[i, best_s] - d[i, t]
            alt[nt] = best_s
            who[nt] = j
            nt += 1
        order = np.argsort(leave[:nt], kind="mergesort")
        for r in range(excess):
            s = alt[order[r]]
            if s != 0 and count[s] >= cap[s]:
                s = 0                       # filled by an earlier move of this loop
            tier[who[order[r]]] = s
            count[s] += 1
        count[t] -= excess
    total = 0.0
    for j in range(m):
        total += d[rows[j], tier[j]]
    return total


@numba.njit(cache=True)
def _page_search(d, rows, prot_top, per, y0, lam_page, max_rounds):
    """Local search over one group's page counts y (K,) (y[0] unused), minimising
    transport(y) + lam_page·Σy from y0, by the moves y_t ± 1 and (y_a − 1, y_b + 1).
    Returns every evaluated (pages, distortion) and its y, for the global selection."""
    k = y0.size
    m = rows.size
    top = k - 1
    lo = np.zeros(k, dtype=np.int64)
    hi = np.zeros(k, dtype=np.int64)
    for t in range(1, k):
        hi[t] = (m + (prot_top if t == top else 0) + per[t] - 1) // per[t]
    lo[top] = (prot_top + per[top] - 1) // per[top]
    cap_n = 1 + max_rounds * (2 * (k - 1) + (k - 1) * (k - 2))
    ys = np.zeros((cap_n, k), dtype=np.int64)
    dist = np.empty(cap_n)
    pages = np.empty(cap_n, dtype=np.int64)
    cap = np.zeros(k, dtype=np.int64)
    tier = np.empty(m, dtype=np.int64)
    y = y0.copy()
    for t in range(1, k):
        cap[t] = y[t] * per[t] - (prot_top if t == top else 0)
    ys[0] = y
    dist[0] = _group_transport(d, rows, cap, tier)
    pages[0] = y[1:].sum()
    best_f = dist[0] + lam_page * pages[0]
    ne = 1
    cand = y.copy()
    for _ in range(max_rounds):
        best_e = -1
        for a in range(k):              # a: tier that loses a page (0: none)
            for b in range(k):          # b: tier that gains a page (0: none)
                if a == b:
                    continue
                cand[:] = y
                if a > 0:
                    cand[a] -= 1
                if b > 0:
                    cand[b] += 1
                ok = True
                for t in range(1, k):
                    if cand[t] < lo[t] or cand[t] > hi[t]:
                        ok = False
                if not ok:
                    continue
                for t in range(1, k):
                    cap[t] = cand[t] * per[t] - (prot_top if t == top else 0)
                ys[ne] = cand
                dist[ne] = _group_transport(d, rows, cap, tier)
                pages[ne] = cand[1:].sum()
                f = dist[ne] + lam_page * pages[ne]
                if f < best_f * (1.0 - 1e-12):
                    best_f = f
                    best_e = ne
                ne += 1
        if best_e < 0:
            break
        y[:] = ys[best_e]
    return pages[:ne], dist[:ne], ys[:ne]


@numba.njit(cache=True)
def _choose_pages(cand_group, cand_pages, cand_dist, num_groups, max_pages):
    """Multiple-choice knapsack over groups, by dynamic programming over the page total:
    one candidate per group, Σ pages ≤ max_pages, least Σ distortion. Candidates are
    sorted by group. Returns the chosen candidate of every group (-1: none feasible)."""
    inf = np.inf
    start = np.zeros(num_groups + 1, dtype=np.int64)
    for c in range(cand_group.size):
        start[cand_group[c] + 1] += 1
    for g in range(num_groups):
        start[g + 1] += start[g]
    best = np.full(max_pages + 1, inf)
    best[0] = 0.0
    pick = np.full((num_groups, max_pages + 1), -1, dtype=np.int64)
    nxt = np.empty(max_pages + 1)
    for g in range(num_groups):
        nxt[:] = inf
        for c in range(start[g], start[g + 1]):
            w = cand_pages[c]
            v = cand_dist[c]
            for b in range(w, max_pages + 1):
                if best[b - w] + v < nxt[b]:
                    nxt[b] = best[b - w] + v
                    pick[g, b] = c
        best[:] = nxt
    chosen = np.full(num_groups, -1, dtype=np.int64)
    b = 0
    for j in range(1, max_pages + 1):
        if best[j] < best[b]:
            b = j
    if best[b] == inf:
        return chosen
    for g in range(num_groups - 1, -1, -1):
        c = pick[g, b]
        chosen[g] = c
        b -= cand_pages[c]
    return chosen


# --------------------------------------------------------------------------------------------
# A synthetic case, declared once for tests, benchmarks and validation
# --------------------------------------------------------------------------------------------

#: DESIGN §7's example ladder and the E[ε_θ²] of its codes (DESIGN §3 values at large d;
#: fp16 from its rounding), so the case does not depend on the codec's numerics.
EXAMPLE_LADDER = ((2, 2), (3, 3), (4, 4), (8, 8), (16, 16))
EXAMPLE_ERROR = {2: 0.12, 3: 0.035, 4: 0.0095, 8: 3.7e-5, 16: 2e-8}


def _example_bytes(bits, dim):
    return 2 * dim if bits == 16 else 4 * ((bits * dim + 31) // 32) + 2


def synthetic_problem(num_states, num_groups=16, dim=128, budget_fraction=0.2,
                      page_bytes=4096, sinks=4, recent=16, seed=0):
    """A surrogate-shaped RDR instance: num_states split evenly over num_groups groups of
    tokens, heavy-tailed attention, log-normal radii and norms, the example ladder, sinks
    and a recent window protected; budget = budget_fraction of keeping every state at the
    top tier. Deterministic in seed."""
    rng = np.random.default_rng(np.random.SeedSequence([0x5D5, num_states, num_groups, seed]))
    n = int(num_states)
    group = np.repeat(np.arange(num_groups), -(-n // num_groups))[:n]
    pos = np.arange(n) - np.searchsorted(group, group)
    size = np.bincount(group, minlength=num_groups)[group]
    logit = rng.gumbel(size=n) * 2.0 + np.where(pos < sinks, 6.0, 0.0)
    p = np.exp(logit - logit.max())
    p /= np.bincount(group, weights=p)[group]
    layer_scale = rng.lognormal(0.0, 0.5, num_groups)[group]
    q2 = float(dim) * layer_scale
    r = rng.lognormal(np.log(np.sqrt(dim)), 0.3, n)
    vn = rng.lognormal(0.0, 0.4, n)
    res = vn * rng.uniform(0.5, 1.5, n)
    ek, ev = tier_error_constants(EXAMPLE_LADDER, dim, error=EXAMPLE_ERROR)
    d = distortion(p, q2, r, vn, res, ek, ev, dim)
    cost = np.array([0] + [_example_bytes(kb, dim) + _example_bytes(vb, dim)
                           for kb, vb in EXAMPLE_LADDER])
    protected = (pos < sinks) | (pos >= size - recent)
    budget = int(budget_fraction * n * cost[-1])
    return Problem(d, cost, group, protected, budget, page_bytes)
