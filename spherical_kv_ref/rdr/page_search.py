"""Page-aware search of RDR's fast solver (docs/rdr.md §4, step 6).

The paged problem splits by group once each group's page total is fixed: with
f_g(p) = the least distortion of group g's free states in p pages (page counts per tier
y_t with Σ y_t = p, each assignment under its slot caps P_t·y_t solved exactly),

    optimum = min Σ_g f_g(p_g)   subject to   Σ_g p_g ≤ ⌊budget / page_bytes⌋,

a knapsack over the page total solved by dynamic programming (:func:`_choose_pages`).
f_g(p) is the least, over page counts per tier y with Σ y = p, of the capped assignment
(:func:`_group_transport`, exact). Upper profiles: pages added one at a time from the least
the group needs, with page moves between tiers (:func:`_profiles`). Lower: the same
knapsack over lower bounds of f_g, the group's own LP relaxation raised where the knapsack
needs it (:func:`refine_lower`): on the totals it chooses, Benders' cuts, each solved
assignment's slot prices (:func:`_prices`) bounding every vector from below, the
least-bounded vector (:func:`_least_bounded`, branch and bound) solved next until the
bound meets the best value (then f_g(p) is exact). When the chosen totals are all exact,
the knapsack's value is the optimum.
"""
from __future__ import annotations

import numba
import numpy as np


#: cuts of the upper search kept per group, to start the lower bound's refinement from
MAX_CUTS = 1024
#: local-search rounds per page total of the upper search
SWAP_ROUNDS = 1
#: groups given more pages than this by steps 1–5 are searched around those page counts,
#: WINDOW totals up and down, instead of from the least they need
FROM_LEAST = 32
WINDOW = 2
#: ... after up to this many rounds of page moves at those page counts
SEED_ROUNDS = 3


def search_pages(problem, free, fgroup, lower_lp, sorted_state, sorted_cost, sorted_gain,
                 seed_y):
    """Step 6 (docs/rdr.md §4). free: (nf,) rows of the free states; fgroup: their group
    index. lower_lp: the LP certificate; sorted_*: the free states' hull segments in the
    greedy's order (state, effective bytes, gain per byte); seed_y: (G, K) page counts of
    steps 1–5's answer (y[:, 0] unused): groups of up to FROM_LEAST pages are searched from
    the least they need up to a quarter more pages than these, larger ones in a window of
    WINDOW totals around them.
    Returns (tier (n,) or None, lower_bound): the allocation of the knapsack over the
    groups' page profiles, and the larger of lower_lp and the knapsack over the groups'
    lower bounds."""
    d, k = problem.distortion, problem.num_options
    top = k - 1
    G = problem.num_groups
    per = problem.states_per_page
    max_pages = problem.budget_bytes // problem.page_bytes
    prot_top = np.bincount(problem.group_index[problem.protected], minlength=G)
    gorder, gstart = group_order(fgroup, G)
    size = np.diff(gstart)
    lo = (prot_top + per[top] - 1) // per[top]
    # tier pages beyond what every free state at that tier would need never help
    hi = (size[:, None] + per[None, 1:] - 1) // per[None, 1:]
    hi[:, -1] = (size + prot_top + per[top] - 1) // per[top]
    best = np.argmin(d[free], axis=1) if free.size else free
    need = np.zeros((G, k), dtype=np.int64)
    np.add.at(need, (fgroup, best), 1)
    need[:, top] += prot_top
    useful = ((need[:, 1:] + per[None, 1:] - 1) // per[None, 1:]).sum(axis=1)
    p_hi = np.minimum(np.maximum(useful, lo), lo + max_pages - int(lo.sum()))
    const = float(d[problem.protected, top].sum())
    seed_pages = seed_y[:, 1:].sum(axis=1)
    from_seed = seed_pages > FROM_LEAST
    p_up = np.minimum(p_hi, seed_pages + 2 + seed_pages // 4)
    cut_a, cut_mu = np.empty((G, MAX_CUTS)), np.empty((G, MAX_CUTS, k))
    ncut = np.zeros(G, dtype=np.int64)
    ub, ys = _profiles(d, free, gorder, gstart, prot_top, per, lo, hi, p_hi, p_up, SWAP_ROUNDS,
                       from_seed, seed_y.astype(np.int64), WINDOW, SEED_ROUNDS, cut_a, cut_mu, ncut)
    # lower bounds of f_g: the group's LP, raised by Benders' cuts where the knapsack needs it
    lbp = _group_lp_profiles(problem, free, fgroup, prot_top, p_hi, sorted_state, sorted_cost,
                             sorted_gain)
    refine_lower(problem, free, gorder, gstart, prot_top, lo, hi, lbp, ub, ys, max_pages,
                 [(cut_a[g, :ncut[g]], cut_mu[g, :ncut[g]]) for g in range(G)])
    # the knapsack over lower bounds: every page total of every group a candidate
    pc = p_hi.max() + 1
    cand_group = np.repeat(np.arange(G), pc)
    cand_pages = np.tile(np.arange(pc), G)
    chosen_lb = _choose_pages(cand_group, cand_pages, lbp.ravel(), G, max_pages)
    lower = lower_lp
    if np.all(chosen_lb >= 0):
        lower = max(lower_lp, const + float(lbp.ravel()[chosen_lb].sum()))
    chosen = _choose_pages(cand_group, cand_pages, ub.ravel(), G, max_pages)
    if np.any(chosen < 0):
        return None, lower
    tier = np.full(problem.n, top, dtype=np.int64)
    cap = np.zeros(k, dtype=np.int64)
    for g in range(G):
        rows = free[gorder[gstart[g]:gstart[g + 1]]]
        y = ys[g, cand_pages[chosen[g]]]
        cap[1:] = y[1:] * per[1:]
        cap[top] -= prot_top[g]
        part = np.empty(rows.size, dtype=np.int64)
        _group_transport(d, rows, cap, part)
        tier[rows] = part
    return tier, lower


def _group_lp_profiles(problem, free, fgroup, prot_top, p_hi, sorted_state, sorted_cost,
                       sorted_gain):
    """lp[g, p]: the LP relaxation of group g alone in p pages (y real, so Σ_t n_t/P_t ≤ p):
    the group's hull segments in gain order while they fit p·page_bytes, less the protected
    states' share. A lower bound of f_g(p); +inf where p cannot hold the protected states."""
    k = problem.num_options
    G = problem.num_groups
    out = np.full((G, p_hi.max() + 1), np.inf)
    if free.size == 0:
        return out
    d = problem.distortion
    ce = problem.effective_cost
    base = np.bincount(fgroup, weights=d[free, 0], minlength=G)
    _lp_profiles(sorted_state, sorted_cost, sorted_gain, fgroup, base,
                 prot_top * ce[k - 1], float(problem.page_bytes), p_hi, out)
    return out


@numba.njit(cache=True)
def _lp_profiles(sorted_state, sorted_cost, sorted_gain, fgroup, base, prot_bytes, page,
                 p_hi, out):
    G = base.size
    cum_c = np.zeros(G)
    cum_s = np.zeros(G)
    nxt = np.zeros(G, dtype=np.int64)
    for g in range(G):                      # page totals that cannot hold the protected
        while nxt[g] <= p_hi[g] and nxt[g] * page < prot_bytes[g] * (1.0 - 1e-12):
            nxt[g] += 1
    for r in range(sorted_state.size):
        g = fgroup[sorted_state[r]]
        c = sorted_cost[r]
        s = sorted_gain[r] * c
        while nxt[g] <= p_hi[g] and cum_c[g] + c > nxt[g] * page - prot_bytes[g]:
            frac = max(nxt[g] * page - prot_bytes[g] - cum_c[g], 0.0) / c
            out[g, nxt[g]] = base[g] - cum_s[g] - frac * s
            nxt[g] += 1
        cum_c[g] += c
        cum_s[g] += s
    for g in range(G):
        while nxt[g] <= p_hi[g]:
            out[g, nxt[g]] = base[g] - cum_s[g]
            nxt[g] += 1


@numba.njit(cache=True)
def _eval(d, rows, prot_top, per, y, cap, tier, mu):
    """Capped optimum of one group at page counts y; fills mu with its optimal slot prices
    and returns (value, A), the cut value = A − Σ_t mu[t]·cap[t] (:func:`_prices`)."""
    k = y.size
    for t in range(1, k):
        cap[t] = y[t] * per[t]
    cap[k - 1] -= prot_top
    v = _group_transport(d, rows, cap, tier)
    return v, _prices(d, rows, cap, tier, mu)


@numba.njit(cache=True)
def _prices(d, rows, cap, tier, mu):
    """Optimal dual prices of a solved capped assignment: mu[t] = the least extra distortion
    of freeing one slot of tier t (a shortest chain of moves from t to a free slot or to
    eviction; 0 where a slot is free). A tier without slots gets the least price that keeps
    every state away. For any mu ≥ 0, A − Σ_t mu[t]·cap'[t] with A = Σ_j min_t (D[j, t] +
    mu[t]) is a lower bound of the capped optimum at every cap' (weak duality); with these
    prices it is exact at cap. Returns A."""
    m = rows.size
    k = d.shape[1]
    inf = np.inf
    count = np.zeros(k, dtype=np.int64)
    w = np.full((k, k), inf)
    for j in range(m):
        a = tier[j]
        count[a] += 1
        if a == 0:
            continue
        i = rows[j]
        for b in range(k):
            if b != a and (b == 0 or cap[b] > 0):
                w[a, b] = min(w[a, b], d[i, b] - d[i, a])
    mu[0] = 0.0
    for t in range(1, k):
        mu[t] = 0.0 if (cap[t] > 0 and count[t] < cap[t]) else inf
    for _ in range(k):
        for a in range(1, k):
            if cap[a] <= 0:
                continue
            for b in range(k):
                if w[a, b] < inf and mu[b] < inf and w[a, b] + mu[b] < mu[a]:
                    mu[a] = w[a, b] + mu[b]
    for t in range(1, k):
        if cap[t] > 0:
            mu[t] = max(mu[t], 0.0) if mu[t] < inf else 0.0
    total = 0.0
    for t in range(1, k):
        if cap[t] <= 0:
            mu[t] = 0.0
    for j in range(m):
        i = rows[j]
        u = d[i, 0]
        for t in range(1, k):
            if cap[t] > 0:
                u = min(u, d[i, t] + mu[t])
        total += u
        for t in range(1, k):
            if cap[t] <= 0:
                mu[t] = max(mu[t], u - d[i, t])
    return total


@numba.njit(cache=True)
def _add_cut(cut_a, cut_mu, nc, a, mu):
    """Keep one more cut (a, mu) while there is room; returns the new count."""
    if nc >= cut_a.size:
        return nc
    cut_a[nc] = a
    cut_mu[nc] = mu
    return nc + 1


@numba.njit(cache=True)
def _step(d, rows, prot, per, y, hi_g, low, sign, rounds, cap, tier, mu, cand, best_y,
          cut_a, cut_mu, nc):
    """One page more (sign 1) or less (sign −1) for y, in the tier where it helps most,
    then page moves between tiers (:func:`_improve`). Updates y; returns (value, nc)."""
    k = y.size
    best_v = np.inf
    for t in range(1, k):
        if (sign > 0 and y[t] >= hi_g[t - 1]) or (sign < 0 and y[t] <= low[t]):
            continue
        cand[:] = y
        cand[t] += sign
        v, a = _eval(d, rows, prot, per, cand, cap, tier, mu)
        nc = _add_cut(cut_a, cut_mu, nc, a, mu)
        if v < best_v:
            best_v = v
            best_y[:] = cand
    if best_v == np.inf:
        return best_v, nc
    y[:] = best_y
    return _improve(d, rows, prot, per, y, hi_g, low, best_v, rounds, cap, tier, mu, cand,
                    best_y, cut_a, cut_mu, nc)


@numba.njit(cache=True)
def _improve(d, rows, prot, per, y, hi_g, low, best_v, rounds, cap, tier, mu, cand, best_y,
             cut_a, cut_mu, nc):
    """Move one page from a tier to another while that lowers the distortion, at most
    ``rounds`` times (best move each round). Updates y; returns (value, nc)."""
    k = y.size
    best_y[:] = y
    for _ in range(rounds):
        improved = False
        for s in range(1, k):
            if y[s] <= low[s]:
                continue
            for b in range(1, k):
                if b == s or y[b] >= hi_g[b - 1]:
                    continue
                cand[:] = y
                cand[s] -= 1
                cand[b] += 1
                v, a = _eval(d, rows, prot, per, cand, cap, tier, mu)
                nc = _add_cut(cut_a, cut_mu, nc, a, mu)
                if v < best_v * (1.0 - 1e-12):
                    best_v = v
                    best_y[:] = cand
                    improved = True
        if not improved:
            break
        y[:] = best_y
    return best_v, nc


@numba.njit(cache=True)
def _profiles(d, free, gorder, gstart, prot_top, per, lo, hi, p_hi, p_up, rounds, from_seed,
              y_seed, window, seed_rounds, cut_a, cut_mu, ncut):
    """Per group g and page total p (lo[g] ≤ p ≤ p_hi[g]): ub[g, p] the least distortion
    found with Σ y = p and ys[g, p] its page counts (inf where none was tried).

    From the least vector, pages are added one at a time (the tier that lowers the
    distortion most), each step followed by page moves between tiers while they help (at
    most ``rounds``), up to p_up[g]; on the groups marked from_seed (many pages), from
    y_seed[g] instead (if its total lies in lo[g]..p_hi[g]), ``window`` totals up and down.
    Every capped assignment solved gives optimal slot prices, hence a cut, a linear lower
    bound of the capped optimum of every vector (:func:`_prices`): group g's first ones are
    kept in cut_a[g], cut_mu[g] (ncut[g] of them) for the lower bound (:func:`refine_lower`)."""
    G = gstart.size - 1
    k = per.size
    top = k - 1
    pc = 0
    for g in range(G):
        pc = max(pc, p_hi[g] + 1)
    ub = np.full((G, pc), np.inf)
    ys = np.zeros((G, pc, k), dtype=np.int64)
    cap = np.zeros(k, dtype=np.int64)
    y = np.zeros(k, dtype=np.int64)
    cand = np.zeros(k, dtype=np.int64)
    best_y = np.zeros(k, dtype=np.int64)
    mu = np.zeros(k)
    for g in range(G):
        m = gstart[g + 1] - gstart[g]
        rows = np.empty(m, dtype=np.int64)
        for j in range(m):
            rows[j] = free[gorder[gstart[g] + j]]
        tier = np.empty(m, dtype=np.int64)
        low = np.zeros(k, dtype=np.int64)
        low[top] = lo[g]
        ga, gmu = cut_a[g], cut_mu[g]
        nc = 0
        p0 = 0
        for t in range(1, k):
            p0 += y_seed[g, t]
        # (a seed outside the totals searched has no slot in ub: searched from the least)
        if from_seed[g] and lo[g] <= p0 <= p_hi[g]:
            # many pages: search a window of totals around steps 1–5's page counts
            y[:] = y_seed[g]
            v, a = _eval(d, rows, prot_top[g], per, y, cap, tier, mu)
            nc = _add_cut(ga, gmu, nc, a, mu)
            v, nc = _improve(d, rows, prot_top[g], per, y, hi[g], low, v, seed_rounds, cap, tier,
                             mu, cand, best_y, ga, gmu, nc)
            ub[g, p0] = v
            ys[g, p0] = y
            for sign in (1, -1):
                y[:] = ys[g, p0]
                for step in range(1, window + 1):
                    p = p0 + sign * step
                    if p < lo[g] or p > p_hi[g]:
                        break
                    v, nc = _step(d, rows, prot_top[g], per, y, hi[g], low, sign, rounds, cap,
                                  tier, mu, cand, best_y, ga, gmu, nc)
                    if v == np.inf:
                        break
                    ub[g, p] = v
                    ys[g, p] = y
        else:
            y[:] = low
            v, a = _eval(d, rows, prot_top[g], per, y, cap, tier, mu)
            nc = _add_cut(ga, gmu, nc, a, mu)
            ub[g, lo[g]] = v
            ys[g, lo[g]] = y
            for p in range(lo[g] + 1, p_up[g] + 1):
                v, nc = _step(d, rows, prot_top[g], per, y, hi[g], low, 1, rounds, cap, tier,
                              mu, cand, best_y, ga, gmu, nc)
                if v == np.inf:
                    break
                ub[g, p] = v
                ys[g, p] = y
        ncut[g] = nc
    return ub, ys


@numba.njit(cache=True)
def group_order(fgroup, num_groups):
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
def _heap_move(key, who, stamp, h, dst, src):
    key[h, dst] = key[h, src]
    who[h, dst] = who[h, src]
    stamp[h, dst] = stamp[h, src]


@numba.njit(cache=True)
def _heap_push(key, who, stamp, size, h, kv, j, st):
    """Heap h of (key, state, version) entries, least key on top: insert one. The caller
    makes room (:func:`_group_transport` grows the heaps before each chain); a full heap is
    an error, never a write past its end."""
    n = size[h]
    if n >= key.shape[1]:
        raise IndexError("rdr: a transport heap is full")
    size[h] = n + 1
    while n > 0:
        parent = (n - 1) // 2
        if key[h, parent] <= kv:
            break
        _heap_move(key, who, stamp, h, n, parent)
        n = parent
    key[h, n] = kv
    who[h, n] = j
    stamp[h, n] = st


@numba.njit(cache=True)
def _heap_pop(key, who, stamp, size, h):
    """Remove the top entry of heap h (nothing on an empty heap)."""
    if size[h] == 0:
        return
    n = size[h] - 1
    size[h] = n
    kv, j, st = key[h, n], who[h, n], stamp[h, n]
    pos = 0
    while True:
        c = 2 * pos + 1
        if c >= n:
            break
        if c + 1 < n and key[h, c + 1] < key[h, c]:
            c += 1
        if key[h, c] >= kv:
            break
        _heap_move(key, who, stamp, h, pos, c)
        pos = c
    key[h, pos] = kv
    who[h, pos] = j
    stamp[h, pos] = st


@numba.njit(cache=True)
def _is_ancestor(pred, b, a):
    """Whether tier b lies on the chain of predecessors from tier a (a itself included).
    pred is a forest (-1 at its roots), so the walk ends within pred.size steps."""
    node = a
    for _ in range(pred.size):
        if node == b:
            return True
        node = pred[node]
        if node < 0:
            return False
    return True                             # not reached: a forest has no longer chain


@numba.njit(cache=True)
def _group_transport(d, rows, cap, tier):
    """Best assignment of one group's free states to options under slot caps, exactly.

    rows: (m,) rows of d (the group's free states); cap: (K,) slots per option (cap[0] is
    ignored: evicting is always allowed). Writes tier (m,) and returns Σ D.
    Once the page counts are fixed this is a transportation problem (m unit sources, K
    sinks), solved by successive shortest paths: states enter one at a time, each along
    the cheapest chain "the new state takes a slot of tier a, a state of a moves to b, …,
    ending where a slot is free (evicting always is)". The chain is a shortest path over
    the K tiers (Bellman–Ford; an edge a → b costs the least D[j, b] − D[j, a] over the
    states j at a, kept in one heap per (a, b)). Each step keeps the partial assignment
    optimal for the states entered so far, the classical invariant of the method, so the
    final one is optimal (integral: the matrix is totally unimodular).

    A chain never revisits a tier, whatever the data: a relaxation a → b that would make b
    its own predecessor (b already on a's chain) is refused, so the predecessors stay a
    forest and a chain holds at most K links. In exact arithmetic no such relaxation
    improves anything (the partial assignment being optimal, no cycle of moves is
    negative); in floating point, two tied moves between two tiers can cancel to −1 ulp,
    and without the guard the chain ran round them, pushing onto a heap past its end."""
    m = rows.size
    k = d.shape[1]
    count = np.zeros(k, dtype=np.int64)
    version = np.zeros(m, dtype=np.int64)
    hc = 8
    key = np.empty((k * k, hc))
    who = np.empty((k * k, hc), dtype=np.int64)
    stamp = np.empty((k * k, hc), dtype=np.int64)
    size = np.zeros(k * k, dtype=np.int64)
    dist = np.empty(k)
    pred = np.empty(k, dtype=np.int64)
    predj = np.empty(k, dtype=np.int64)
    inf = np.inf
    for s in range(m):
        i = rows[s]
        for b in range(k):
            dist[b] = d[i, b] if (b == 0 or cap[b] > 0) else inf
            pred[b] = -1
        for _ in range(k - 1):
            changed = False
            for a in range(1, k):
                if dist[a] == inf or count[a] < cap[a]:
                    continue                # a slot is free at a: the chain can end there
                for b in range(k):
                    if b == a or (b > 0 and cap[b] <= 0):
                        continue
                    h = a * k + b
                    while size[h] > 0 and (tier[who[h, 0]] != a or version[who[h, 0]] != stamp[h, 0]):
                        _heap_pop(key, who, stamp, size, h)     # a state that has moved on
                    if size[h] == 0:
                        continue
                    v = dist[a] + key[h, 0]
                    if v < dist[b] and not _is_ancestor(pred, b, a):
                        dist[b] = v
                        pred[b] = a
                        predj[b] = who[h, 0]
                        changed = True
            if not changed:
                break
        end = 0
        for c in range(1, k):
            if count[c] < cap[c] and dist[c] < dist[end]:
                end = c
        if size.max() + 1 > hc:             # room for this chain's pushes (one per heap)
            grown = 2 * hc + k * k
            key2 = np.empty((k * k, grown))
            who2 = np.empty((k * k, grown), dtype=np.int64)
            stamp2 = np.empty((k * k, grown), dtype=np.int64)
            key2[:, :hc] = key
            who2[:, :hc] = who
            stamp2[:, :hc] = stamp
            key, who, stamp, hc = key2, who2, stamp2, grown
        node = end
        count[end] += 1
        for _ in range(k):                  # at most K links: the chain never revisits a tier
            a = pred[node]
            j = s if a < 0 else predj[node]
            tier[j] = node
            if a >= 0:
                version[j] += 1
            if node > 0:
                ij = rows[j]
                for b in range(k):
                    if b != node:
                        _heap_push(key, who, stamp, size, node * k + b, d[ij, b] - d[ij, node],
                                   j, version[j])
            if a < 0:
                break
            node = a                        # a gave its slot to j's successor: count unchanged
    total = 0.0
    for j in range(m):
        total += d[rows[j], tier[j]]
    return total


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
        if c < 0:                   # not reached (a finite total has a pick in every group),
            chosen[:] = -1          # but never an index of -1
            return chosen
        chosen[g] = c
        b -= cand_pages[c]
    return chosen


#: the lazy refinement of the lower bound (:func:`refine_lower`): rounds of "knapsack over
#: the lower bounds, then Benders' cuts on the page totals it chose that are still open"
REFINE_ROUNDS = 40
#: ... while the capped assignments it solves stay below this many states in all
REFINE_WORK = 3e7
#: ... and at most this many assignments per page total and round
REFINE_ITERS = 16
#: nodes of one branch and bound over a total's page count vectors, at most
BB_NODES = 200_000


def refine_lower(problem, free, gorder, gstart, prot_top, lo, hi, lbp, ub, ys, max_pages,
                 cuts):
    """Raise the groups' lower bounds lbp[g, p] where the knapsack over them needs it
    (docs/rdr.md §4, the certificate). Each round solves the knapsack over lbp; on every
    group whose chosen total p is still open (lbp < ub there), Benders' cuts run on that
    total, with the least-bounded vector found by branch and bound over the page counts
    (:func:`_least_bounded`) instead of a list, so any number of vectors is covered. Every
    cut of a group is kept and bounds every total of it; cuts[g] = (a, mu) are the ones the
    upper search made. Stops when the chosen totals are all closed (the knapsack's value is
    then the optimum) or the work is spent. Updates lbp, ub, ys in place."""
    d, k = problem.distortion, problem.num_options
    G = problem.num_groups
    per = problem.states_per_page
    pc = lbp.shape[1]
    cand_group = np.repeat(np.arange(G), pc)
    cand_pages = np.tile(np.arange(pc), G)
    pools = [(a.copy(), mu.copy(), a.size) for a, mu in cuts]
    work = 0.0
    for _ in range(REFINE_ROUNDS):
        chosen = _choose_pages(cand_group, cand_pages, lbp.ravel(), G, max_pages)
        if np.any(chosen < 0):
            return
        todo = []
        for g in range(G):
            p = int(cand_pages[chosen[g]])
            if ub[g, p] == np.inf or lbp[g, p] < ub[g, p] - _CLOSE * abs(ub[g, p]):
                todo.append((g, p))
        if not todo:
            return
        for g, p in todo:
            rows = free[gorder[gstart[g]:gstart[g + 1]]]
            if work + rows.size * REFINE_ITERS > REFINE_WORK:
                return
            cut_a, cut_mu, nc = pools[g]
            if cut_a.size < nc + REFINE_ITERS + 1:
                grow = 2 * cut_a.size + REFINE_ITERS
                a2, m2 = np.empty(grow), np.empty((grow, k))
                a2[:nc], m2[:nc] = cut_a[:nc], cut_mu[:nc]
                cut_a, cut_mu = a2, m2
            low, best, y, nc, solved = _refine_total(
                d, rows, int(prot_top[g]), per, int(lo[g]), hi[g], p, cut_a, cut_mu, nc,
                ub[g, p], ys[g, p].copy(), REFINE_ITERS)
            pools[g] = (cut_a, cut_mu, nc)
            work += rows.size * solved
            lbp[g, p] = max(lbp[g, p], low)
            if best < ub[g, p]:
                ub[g, p] = best
                ys[g, p] = y


#: a total is closed when its lower bound is within this relative distance of its best value
_CLOSE = 1e-12


@numba.njit(cache=True)
def _refine_total(d, rows, prot, per, lo_top, hi_g, p, cut_a, cut_mu, nc, ub, y_ub, iters):
    """Benders' cuts on one group's page total p: solve the vector of least bound under the
    cuts (:func:`_least_bounded`), add its cut, until no vector's bound is below the best
    value found or ``iters`` assignments are solved. cut_a/cut_mu hold nc cuts (room for
    iters more). Returns (lower bound of f_g(p), best value, its vector, nc, solved)."""
    k = per.size
    cap = np.zeros(k, dtype=np.int64)
    tier = np.empty(rows.size, dtype=np.int64)
    mu = np.zeros(k)
    y = np.zeros(k, dtype=np.int64)
    best_y = y_ub.copy()
    solved = 0
    while True:
        thresh = ub - _CLOSE * abs(ub) if ub < np.inf else np.inf
        low = _least_bounded(cut_a, cut_mu, nc, per, prot, lo_top, hi_g, p, thresh, y,
                             BB_NODES)
        if low == -np.inf and nc > 0:
            return low, ub, best_y, nc, solved      # the search ran out of nodes
        if low >= thresh:
            return min(ub, thresh), ub, best_y, nc, solved   # no vector bounded below best
        if solved == iters:
            return low, ub, best_y, nc, solved
        v, a = _eval(d, rows, prot, per, y, cap, tier, mu)
        solved += 1
        if nc < cut_a.size:
            cut_a[nc] = a
            cut_mu[nc] = mu
            nc += 1
        if v < ub:
            ub = v
            best_y[:] = y


@numba.njit(cache=True)
def _least_bounded(cut_a, cut_mu, nc, per, prot, lo_top, hi_g, p, thresh, y_out,
                   max_nodes):
    """min over page counts y (y_t ≤ hi_g[t−1], y_T ≥ lo_top, Σ_{t≥1} y_t = p) of the cuts'
    bound max_c (a_c + mu_cT·prot − Σ_t mu_ct·per_t·y_t), by depth-first branch and bound
    over the tiers below the top (the top takes the rest), searching only below thresh.
    A node's bound is max over cuts of that cut's least value over the node's vectors (a
    linear function over a box cut by the total: greedy, the largest weights filled first).
    Writes the minimiser to y_out and returns the minimum; returns thresh (y_out untouched)
    if no vector is bounded below it. No cuts: every vector is unbounded (−inf). Visits at
    most max_nodes nodes; beyond, returns −inf (the search proved nothing)."""
    k = per.size
    top = k - 1
    w = np.empty((nc, k))
    const = np.empty(nc)
    for c in range(nc):
        const[c] = cut_a[c] + cut_mu[c, top] * prot
        w[c, 0] = 0.0
        for t in range(1, k):
            w[c, t] = cut_mu[c, t] * per[t]
    # every cut's tiers by weight, largest first (the greedy's order)
    order = np.empty((nc, k - 1), dtype=np.int64)
    for c in range(nc):
        order[c] = np.argsort(-w[c, 1:]) + 1
    partial = np.zeros((k, max(nc, 1)))      # partial[s, c]: Σ_{t ≤ s} w[c, t]·y_t
    y = np.zeros(k, dtype=np.int64)
    best = thresh
    # suffix capacities of the free tiers s+1..top-1, for feasibility of the rest
    room = np.zeros(k + 1, dtype=np.int64)
    for t in range(top - 1, 0, -1):
        room[t] = room[t + 1] + hi_g[t - 1]
    if p < lo_top or p > room[1] + hi_g[top - 1]:
        return best
    if top == 1:                             # one tier: its count is the total
        bound = -np.inf
        for c in range(nc):
            bound = max(bound, const[c] - w[c, 1] * p)
        if bound < best:
            best = bound
            y_out[1] = p
        return best
    s = 1                                    # the tier being branched on
    y[1] = -1
    nodes = 0
    rest = np.zeros(k + 1, dtype=np.int64)   # rest[s]: pages left for tiers s..top
    rest[1] = p
    while s >= 1:
        y[s] += 1
        r = rest[s] - y[s]                  # pages left for tiers s+1..top
        if y[s] > hi_g[s - 1] or r < lo_top:
            s -= 1                           # this tier's values are exhausted: back up
            continue
        if r > room[s + 1] + hi_g[top - 1]:
            continue                         # the rest cannot hold the pages left
        nodes += 1
        if nodes > max_nodes:
            return -np.inf                   # out of work: no bound (valid, useless)
        # the node's bound: max over cuts of the least of the cut over the rest
        bound = -np.inf
        for c in range(nc):
            part = partial[s - 1, c] + w[c, s] * y[s]
            partial[s, c] = part
            if s == top - 1:
                val = const[c] - part - w[c, top] * r
            else:
                gain = w[c, top] * lo_top
                left = r - lo_top
                for j in range(k - 1):
                    t = order[c, j]
                    if t <= s or left == 0:
                        continue
                    room_t = hi_g[t - 1] - (lo_top if t == top else 0)
                    take = min(left, room_t)
                    gain += w[c, t] * take
                    left -= take
                val = const[c] - part - gain
            if val > bound:
                bound = val
                if bound >= best:
                    break
        if bound >= best:
            continue                         # nothing below best in this subtree
        if s == top - 1:
            if r <= hi_g[top - 1]:
                best = bound
                for t in range(1, top):
                    y_out[t] = y[t]
                y_out[top] = r
            continue
        s += 1                               # branch on the next tier
        rest[s] = r
        y[s] = -1
    return best
