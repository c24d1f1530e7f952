"""RDR's problem and answer types (docs/rdr.md §2): :class:`Problem` validates
and derives the page geometry, :class:`Allocation` carries a solver's answer and certificate."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..codec import as_real_array

def _as_int_bytes(name, x):
    a = np.asarray(x, dtype=np.float64)
    if not np.all(np.isfinite(a)) or np.any(a != np.floor(a)):
        raise ValueError(f"{name} must be whole numbers of bytes, got {x!r}")
    return a.astype(np.int64)


@dataclass(frozen=True, eq=False)
class Problem:
    """One RDR instance (docs/rdr.md §2). Validated on construction; always feasible.

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

    tier: (n,) integer option per state (0 = evicted; int64, int8 from the device cache's
    device solver). objective: Σ D[i, tier_i].
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


def make_allocation(problem, tier, lower_bound, method, optimal):
    """The Allocation of ``tier`` with its certificate; RuntimeError if it is infeasible (a
    solver's bug, never the caller's)."""
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


def trivial_tiers(problem):
    """Allocation when no free state can be upgraded (empty problem, or all protected)."""
    tier = np.zeros(problem.n, dtype=np.int64)
    tier[problem.protected] = problem.num_options - 1
    return tier
