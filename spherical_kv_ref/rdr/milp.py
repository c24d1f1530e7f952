"""RDR's exact solver: the paged multiple-choice knapsack as a MILP for HiGHS through
scipy.optimize.milp (docs/rdr.md §3)."""
from __future__ import annotations

import warnings

import numpy as np

from .greedy import solve_fast
from .problem import Problem, make_allocation, trivial_tiers

def solve_milp(problem: Problem, time_limit=None, mip_rel_gap=0.0):
    from scipy import sparse
    from scipy.optimize import Bounds, LinearConstraint, milp

    n, k = problem.n, problem.num_options
    top = k - 1
    free = np.flatnonzero(~problem.protected)
    nf = free.size
    if nf == 0:
        tier = trivial_tiers(problem)
        return make_allocation(problem, tier, problem.objective_of(tier), "milp", True)
    d_free = problem.distortion[free]
    const = float(problem.distortion[problem.protected, top].sum())
    # HiGHS's tolerances are absolute (1e-7 on costs): scale so that the optimum is about
    # one unit per state, from the LP bound of the fast path; surrogate distortions span
    # many decades, and a scale set by the largest would flatten the small ones to zero
    fast = solve_fast(problem)
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
            return make_allocation(problem, fast.tier, bound, "milp", True)
        bound = getattr(res, "mip_dual_bound", None)
        bound = const + scale * bound if bound is not None and np.isfinite(bound) else 0.0
        return make_allocation(problem, fast.tier, max(bound, fast.lower_bound), "milp", False)
    x = np.rint(res.x[:num_x]).reshape(nf, k)
    tier = np.full(n, top, dtype=np.int64)
    tier[free] = np.argmax(x, axis=1)
    bound = getattr(res, "mip_dual_bound", None)
    bound = const + scale * bound if bound is not None and np.isfinite(bound) else 0.0
    if problem.objective_of(tier) > fast.objective:     # HiGHS's tolerances, at worst
        tier = fast.tier
    return make_allocation(problem, tier, max(bound, fast.lower_bound), "milp", res.status == 0)


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
