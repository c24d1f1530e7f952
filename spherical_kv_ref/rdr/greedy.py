"""RDR's fast solver: lower convex hulls, the greedy (the LP optimum and the certificate), page
repair and fill (docs/rdr.md §4, steps 1–5); the page-count search of step 6 is in page_search.py."""
from __future__ import annotations

from typing import Optional

import numba
import numpy as np

from .page_search import group_order, search_pages
from .problem import Problem, make_allocation, trivial_tiers

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


def solve_fast(problem: Problem, max_search_work: Optional[float] = None) -> Allocation:
    """Hull → greedy (LP optimum, the certificate) → page repair → fill (docs/rdr.md §4);
    the page-aware search while its work stays within ``max_search_work``."""
    max_search_work = _search_limit(max_search_work)   # a bad limit fails before any work
    n, k = problem.n, problem.num_options
    top = k - 1
    free = np.flatnonzero(~problem.protected).astype(np.int64)
    if free.size == 0:
        tier = trivial_tiers(problem)
        return make_allocation(problem, tier, problem.objective_of(tier), "fast", True)
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
        gorder, gstart = group_order(fgroup, problem.num_groups)
        _fill_free_slots(problem.distortion, free, gorder, gstart, ftier, counts, per)
    tier[free] = ftier
    if page_bytes:
        obj = problem.objective_of(tier)
        if obj > 0 and obj - lower > SEARCH_GAP * obj and search_fits(free.size, max_search_work):
            seed_y = np.zeros_like(counts)
            seed_y[:, 1:] = (counts[:, 1:] + per[1:] - 1) // per[1:]
            better, lower = search_pages(problem, free, fgroup, lower, sorted_state,
                                         sorted_cost, seg_gain[srt], seed_y)
            if better is not None and problem.objective_of(better) < obj:
                tier = better
    return make_allocation(problem, tier, lower, "fast", None)


#: fast runs the page-count search (step 6) only when its certificate leaves more than this
#: relative gap: the search cannot win more than the gap, and with many pages per group
#: (the serving case) the greedy is already that close
SEARCH_GAP = 1e-5
#: ... and only while its work, about (free states) × (capped assignments per group), stays
#: below this: about 125 assignments per group in a window around steps 1–5's page counts
SEARCH_MAX_WORK = 1e7
_SEARCH_WORK_PER_STATE = 125


def search_fits(num_free: int, max_search_work=None) -> bool:
    """Whether the page-aware search's work on ``num_free`` free states stays within
    ``max_search_work`` (None: the default ``SEARCH_MAX_WORK``)."""
    return num_free * _SEARCH_WORK_PER_STATE <= _search_limit(max_search_work)


def _search_limit(max_search_work) -> float:
    """``max_search_work`` checked: None is the default, else a number >= 0 (inf allowed)."""
    if max_search_work is None:
        return SEARCH_MAX_WORK
    bad = ValueError(f"max_search_work must be a number >= 0, got {max_search_work!r}")
    try:
        limit = float(max_search_work)
    except (TypeError, ValueError):
        raise bad from None
    if not limit >= 0:                        # NaN and negatives
        raise bad
    return limit


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
