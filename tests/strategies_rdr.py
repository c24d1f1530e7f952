"""Hypothesis strategies for RDR (tests/test_rdr.py): tiny problems a brute force can check."""
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
