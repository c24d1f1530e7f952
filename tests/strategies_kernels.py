"""Hypothesis strategies for the kernel launchers' input checks (tests/test_launcher_checks.py):
valid page pools and CSR page tables, and the ways one goes bad."""
import numpy as np
from hypothesis import strategies as st

from cupy_kernels.kernel_tables import kernel_tables

TABLES = kernel_tables([(2, 2), (4, 4), (16, 16)], 64, page_bytes=1024, codebook="uniform")

#: page table breakages, each with the index of the PAGE_TABLE_FAULTS flag it must raise
BREAKAGES = {"indptr_start": 0, "indptr_end": 1, "indptr_decreasing": 2, "index_negative": 3,
             "index_past_pool": 3, "free_page": 4, "unknown_tier": 4, "empty_page": 4,
             "count_past_capacity": 4, "nan_query": 5, "inf_mean": 5}


@st.composite
def page_tables(draw, tables=TABLES):
    """A pool of 1..40 pages (random tiers, counts in 1..P(tier), some free) and rows of a
    CSR table over distinct used pages (rows may be empty), with queries and means."""
    num_pages = draw(st.integers(1, 40))
    seed = draw(st.integers(0, 2 ** 32 - 1))
    rng = np.random.default_rng(seed)
    T = tables.num_tiers
    tier = rng.integers(0, T + 1, num_pages).astype(np.int32)          # 0: free
    cap = tables.geom[tier, 2]
    count = np.where(tier > 0, rng.integers(1, np.maximum(cap, 1) + 1), 0).astype(np.int32)
    used = rng.permutation(np.flatnonzero(tier > 0))
    rows = draw(st.integers(1, 6))
    cuts = np.sort(rng.integers(0, used.size + 1, rows - 1))
    indptr = np.concatenate([[0], cuts, [used.size]]).astype(np.int32)
    q = rng.standard_normal((rows, 4, tables.dim)).astype(np.float32)
    mean = rng.standard_normal((rows, tables.dim)).astype(np.float32)
    return dict(page_tier=tier, page_count=count, indptr=indptr, indices=used.astype(np.int32),
                q=q, mean_k=mean, mean_v=mean.copy())


def break_table(t, how, rng, tables=TABLES):
    """A copy of page table t broken one way (BREAKAGES), or None where t cannot be broken
    that way (e.g. no page referenced)."""
    t = {k: v.copy() for k, v in t.items()}
    ix, ip = t["indices"], t["indptr"]
    n = t["page_tier"].shape[0]
    if how == "indptr_start":
        ip[0] = int(rng.integers(1, 5)) if rng.random() < 0.5 else -1
    elif how == "indptr_end":
        ip[-1] += int(rng.choice([-1, 1, 7]))
    elif how == "indptr_decreasing":
        if ip.size < 3 or ip[-1] == 0:
            return None
        i = int(rng.integers(1, ip.size - 1))
        ip[i] = ip[i + 1] + 1
    elif how in ("index_negative", "index_past_pool"):
        if ix.size == 0:
            return None
        ix[int(rng.integers(ix.size))] = -int(rng.integers(1, 100)) if how == "index_negative" \
            else n + int(rng.integers(0, 100))
    elif how in ("free_page", "unknown_tier", "empty_page", "count_past_capacity"):
        if ix.size == 0:
            return None
        p = int(ix[int(rng.integers(ix.size))])
        if how == "free_page":
            t["page_tier"][p] = 0
        elif how == "unknown_tier":
            t["page_tier"][p] = tables.num_tiers + int(rng.integers(1, 5))
        elif how == "empty_page":
            t["page_count"][p] = int(rng.integers(-3, 1))
        else:
            t["page_count"][p] = tables.states_per_page(int(t["page_tier"][p])) + int(rng.integers(1, 50))
    elif how == "nan_query":
        t["q"].reshape(-1)[int(rng.integers(t["q"].size))] = np.nan
    elif how == "inf_mean":
        t["mean_v"].reshape(-1)[int(rng.integers(t["mean_v"].size))] = -np.inf
    return t
