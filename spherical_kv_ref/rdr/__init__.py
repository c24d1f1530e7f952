"""Rate–Distortion Retention: what to keep, and at which tier, under a byte budget (docs/rdr.md).

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
  optimum of the relaxation), then page repair and a greedy fill; where groups hold few
  pages, a page-aware search (per-group page profiles, a knapsack over page totals);
  numba, no Python loop over states. Its certificate's ``lower_bound`` is the larger of the
  LP relaxation of the *paged* model that ``"milp"`` solves and the page search's bound,
  both lower bounds of the paged optimum.

The package, by concern: ``surrogate`` (the distortion model), ``problem`` (Problem,
Allocation), ``milp`` (the exact solver), ``greedy`` (the fast solver: hull, greedy, certificate), ``page_search``
(the page-aware search of the fast solver), ``statistics`` (the per-state statistics the
surrogate reads, and protection masks), ``synthetic`` (the case tests and benchmarks share).
"""
from __future__ import annotations

from .problem import Allocation, Problem
from .surrogate import distortion, tier_error_constants
from .synthetic import EXAMPLE_ERROR, EXAMPLE_LADDER, synthetic_problem
from .greedy import solve_fast
from .milp import solve_milp

__all__ = ["Problem", "Allocation", "solve", "distortion", "tier_error_constants",
           "synthetic_problem", "EXAMPLE_LADDER", "EXAMPLE_ERROR"]


def solve(problem: Problem, method: str = "fast", **options) -> Allocation:
    """Solve an RDR problem (docs/rdr.md). method: "fast" (default) or "milp".

    "fast" option: max_search_work, the most work (free states × 125) for which the
    page-aware search (step 6) runs (default 1e7, about 80,000 free states; ``inf``: always,
    as a study that wants the search's bound at any size; 0: never).
    "milp" options: time_limit (s), mip_rel_gap (default 0: prove optimality).
    """
    if not isinstance(problem, Problem):
        raise ValueError(f"solve expects an rdr.Problem, got {type(problem).__name__}")
    if method == "fast":
        unknown = set(options) - {"max_search_work"}
        if unknown:
            raise ValueError(f"unknown fast options {sorted(unknown)}")
        return solve_fast(problem, **options)
    if method == "milp":
        unknown = set(options) - {"time_limit", "mip_rel_gap"}
        if unknown:
            raise ValueError(f"unknown milp options {sorted(unknown)}")
        return solve_milp(problem, **options)
    raise ValueError(f"method must be 'fast' or 'milp', got {method!r}")
