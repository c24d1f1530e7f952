"""Page-aware search of RDR's fast solver (docs/rdr.md §4, step 6): per group, page counts per
tier with the exact best assignment under their slot caps; one choice per group by a
knapsack over the page total."""
from __future__ import annotations

import numba
import numpy as np

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
