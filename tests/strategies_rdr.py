"""Hypothesis strategies for RDR (tests/test_rdr.py): tiny problems that brute force or the
MILP can check."""
import numpy as np
from hypothesis import strategies as st

from spherical_kv_ref import rdr


@st.composite
def tiny_problems(draw, max_states=10, max_tiers=4, paged=None):
    """An rdr.Problem with 1..max_states states and 1..max_tiers tiers (+ evict).

    Distortions on a coarse grid (ties happen, as they do with quantised statistics),
    costs in no particular order, 1–3 groups, some states protected, pages or none, and a
    budget between what the protected states need and what keeping all at the top costs."""
    n = draw(st.integers(1, max_states))
    k = draw(st.integers(2, max_tiers + 1))
    d = np.array(draw(st.lists(st.lists(st.integers(0, 400), min_size=k, max_size=k),
                               min_size=n, max_size=n)), dtype=np.float64) / 8.0
    cost = np.array([0] + draw(st.lists(st.integers(1, 24), min_size=k - 1, max_size=k - 1)))
    group = np.array(draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)))
    protected = np.array(draw(st.lists(st.sampled_from([False, False, False, True]),
                                       min_size=n, max_size=n)))
    use_pages = draw(st.booleans()) if paged is None else paged
    page = int(cost.max()) + draw(st.integers(0, 2 * int(cost.max()))) if use_pages else None
    base = rdr.Problem(d, cost, group, protected, 10**9, page)
    top = np.full(n, k - 1)
    extra = draw(st.integers(0, base.bytes_of(top) - base.protected_bytes + 8))
    return rdr.Problem(d, cost, group, protected, base.protected_bytes + extra, page)


@st.composite
def coarse_paged_problems(draw, max_states=8, max_tiers=3):
    """A paged rdr.Problem whose groups hold a few pages: 1–3 groups, pages of 1–4 top-tier
    states, costs increasing with the tier, distortions falling with it (as the surrogate's
    do) on a coarse grid, and a budget of a few pages above what the protected need."""
    n = draw(st.integers(1, max_states))
    k = draw(st.integers(2, max_tiers + 1))
    steps = sorted(draw(st.lists(st.integers(1, 12), min_size=k - 1, max_size=k - 1,
                                 unique=True)))
    cost = np.array([0] + steps)
    page = int(cost[-1]) * draw(st.integers(1, 4)) + draw(st.integers(0, int(cost[-1]) - 1))
    rows = [sorted(draw(st.lists(st.integers(0, 300), min_size=k, max_size=k)), reverse=True)
            for _ in range(n)]
    d = np.array(rows, dtype=np.float64) / 8.0
    group = np.array(draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)))
    protected = np.array(draw(st.lists(st.sampled_from([False, False, False, True]),
                                       min_size=n, max_size=n)))
    base = rdr.Problem(d, cost, group, protected, 10**9, page)
    extra = draw(st.integers(0, 4))
    return rdr.Problem(d, cost, group, protected, base.protected_bytes + extra * page, page)


@st.composite
def degenerate_problems(draw, max_states=12, max_tiers=4):
    """An rdr.Problem of the kinds real statistics degenerate into, small enough for the
    MILP: distortions all zero; tied: one row of reals for every state (a move between two
    tiers costs every state the same); multiples: that row times 1 or 2 per state (ties
    that cancel only up to rounding: what crashed the transport, docs/rdr.md §4); nearly
    tied: multiples with each entry moved by a few 1e-7 relative. At the scale of
    statistics without queries (~1e-6) or of 1; groups of one state or 1–3 groups, some
    protected states; pages most of the time; a budget exactly at the protected states'
    bytes a quarter of the time, else anywhere up to all at the top tier."""
    # (sampled_from draws sizes about evenly; integers() favours the smallest)
    n = draw(st.sampled_from(range(1, max_states + 1)))
    k = draw(st.sampled_from(range(2, max_tiers + 2)))
    kind = draw(st.sampled_from(["zero", "tied", "multiples", "nearly tied"]))
    # the numbers from a seed (as the statistics' are: reals whose differences round), the
    # structure from hypothesis
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    row = rng.exponential(1.0, k)
    if draw(st.booleans()):
        row = np.sort(row)[::-1]               # falling with the tier, as the surrogate's rows
    times = np.ones(n) if kind == "tied" else rng.choice([1.0, 2.0], n)
    d = times[:, None] * row * draw(st.sampled_from([1.0, 1e-6]))
    if kind == "zero":
        d[:] = 0.0
    elif kind == "nearly tied":
        d *= 1.0 + 1e-7 * rng.integers(-3, 4, (n, k))
    cost = np.concatenate([[0], rng.integers(1, 25, k - 1)])
    groups = draw(st.sampled_from([None, 1, 2, 3]))       # None: one state a group
    group = np.arange(n) if groups is None else rng.integers(0, groups, n)
    protected = rng.random(n) < draw(st.sampled_from([0.0, 0.2, 0.5]))
    use_pages = draw(st.sampled_from([True, True, True, False]))
    page = int(cost.max() + rng.integers(0, 2 * cost.max() + 1)) if use_pages else None
    base = rdr.Problem(d, cost, group, protected, 10**9, page)
    room = base.bytes_of(np.full(n, k - 1)) - base.protected_bytes
    at_protected = draw(st.sampled_from([False, False, False, True]))
    extra = 0 if at_protected else int(rng.integers(0, room + 9))
    return rdr.Problem(d, cost, group, protected, base.protected_bytes + extra, page)
