"""The kernel launchers' input checks on random good and bad inputs (docs/design.md §6: launchers
validate with ValueError before any launch). On the host the checks run through NumPy
(``page_table_faults``, ``input_faults``: the same code CuPy runs on the device); on the
GPU the launchers must refuse the same inputs and leave ``out`` and the pool untouched."""
import re

import numpy as np
import pytest
from hypothesis import given, strategies as st

from cupy_kernels.ada_decode import (PAGE_TABLE_FAULTS, page_table_faults,
                                     raise_page_table_faults)
from cupy_kernels.encode import input_faults

from strategies_kernels import BREAKAGES, TABLES, break_table, page_tables


def _faults(t):
    return page_table_faults(np, t["page_tier"], t["page_count"], t["indptr"], t["indices"],
                             TABLES.geom, TABLES.num_tiers, t["indptr"].size - 1,
                             finite=(t["q"], t["mean_k"], t["mean_v"]))


@given(table=page_tables(), how=st.sampled_from(sorted(BREAKAGES)), seed=st.integers(0, 2 ** 16))
def test_page_table_checks_pass_good_tables_and_catch_each_breakage(table, how, seed):
    before = {k: v.copy() for k, v in table.items()}
    assert not _faults(table).any(), "a valid page table was flagged"
    raise_page_table_faults(_faults(table))
    bad = break_table(table, how, np.random.default_rng(seed))
    if bad is None:
        return
    flags = _faults(bad)
    assert flags[BREAKAGES[how]], f"{how} was not flagged: {flags}"
    msg = "NaN or Inf" if BREAKAGES[how] == 5 else PAGE_TABLE_FAULTS[BREAKAGES[how]]
    with pytest.raises(ValueError, match="bad page table|NaN or Inf"):
        raise_page_table_faults(flags)
    if flags.sum() == 1:
        with pytest.raises(ValueError, match=re.escape(msg)):
            raise_page_table_faults(flags)
    for k, v in before.items():                        # checking writes nothing
        np.testing.assert_array_equal(table[k], v)


@given(n=st.integers(0, 50), bound=st.integers(1, 30), seed=st.integers(0, 2 ** 16),
       bad=st.sampled_from(["none", "negative", "past", "nan", "inf"]),
       dtype=st.sampled_from([np.int32, np.int64]))
def test_index_and_finiteness_checks(n, bound, seed, bad, dtype):
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, bound, n).astype(dtype)
    x = rng.standard_normal((max(n, 1), 8)).astype(np.float32)
    if n and bad == "negative":
        idx[int(rng.integers(n))] = -1
    elif n and bad == "past":
        idx[int(rng.integers(n))] = bound + int(rng.integers(0, 5))
    elif bad in ("nan", "inf"):
        x.reshape(-1)[int(rng.integers(x.size))] = np.nan if bad == "nan" else np.inf
    msgs = input_faults(np, [(idx, bound, "an index is outside")], finite=(x,))
    want = []
    if n and bad in ("negative", "past"):
        want.append("an index is outside")
    if bad in ("nan", "inf"):
        want.append("NaN")
    assert len(msgs) == len(want) and all(w in m for w, m in zip(want, msgs)), (msgs, want)


@pytest.mark.gpu
@given(table=page_tables(), how=st.sampled_from(sorted(BREAKAGES)), seed=st.integers(0, 2 ** 16))
def test_ada_decode_refuses_bad_tables_before_launch(table, how, seed):
    """On the device: a broken table or a NaN/Inf query or mean is a ValueError and ``out``
    keeps what it held."""
    import cupy as cp
    from cupy_kernels import ada_decode
    bad = break_table(table, how, np.random.default_rng(seed))
    if bad is None:
        return
    rows = bad["q"].shape[0]
    pages = cp.zeros((bad["page_tier"].shape[0], TABLES.page_bytes), cp.uint8)
    sigma = cp.ones((1, TABLES.dim), cp.float32)
    out = cp.full((rows, 4, TABLES.dim), 7.0, cp.float32)
    with pytest.raises(ValueError):
        ada_decode(cp.asarray(bad["q"]), pages, cp.asarray(bad["page_tier"]), cp.asarray(bad["page_count"]),
                   cp.asarray(bad["indptr"]), cp.asarray(bad["indices"]), TABLES, sigma, sigma,
                   num_kv_heads=1, mean_k=cp.asarray(bad["mean_k"]), mean_v=cp.asarray(bad["mean_v"]),
                   out=out)
    assert bool(cp.all(out == 7.0))


@given(seed=st.integers(0, 2 ** 16), n=st.integers(1, 30))
def test_slot_checks_flag_free_pages_unknown_tiers_and_slots_past_the_page(seed, n):
    """The encode and re-tier launchers' destination (and source) checks, on the host: a page
    must carry a tier of the ladder, a slot must lie in 0..P(tier) - 1; each breakage is
    flagged under its own message and good (page, slot) pairs pass."""
    from cupy_kernels.encode import slot_checks
    rng = np.random.default_rng(seed)
    T = TABLES.num_tiers
    tier = rng.integers(1, T + 1, 12).astype(np.int32)
    page = rng.integers(0, 12, n).astype(np.int32)
    cap = TABLES.geom[tier[page], 2]
    slot = (rng.random(n) * cap).astype(np.int32)
    assert input_faults(np, slot_checks(np, page, slot, tier, TABLES, "dst")) == []
    i = int(rng.integers(n))
    bad_tier = tier.copy()
    bad_tier[page[i]] = int(rng.choice([0, T + 1, -3]))
    msgs = input_faults(np, slot_checks(np, page, slot, bad_tier, TABLES, "dst"))
    assert any("dst_page is free or has an unknown tier" in m for m in msgs), msgs
    bad_slot = slot.copy()
    bad_slot[i] = int(rng.choice([-1, cap[i], cap[i] + 7]))
    msgs = input_faults(np, slot_checks(np, page, bad_slot, tier, TABLES, "src"))
    assert msgs == ["a src_slot is outside its page (0..P-1 of the page's tier)"], msgs


@given(table=page_tables(), which=st.integers(0, 2))
def test_a_nan_is_refused_naming_the_array_it_is_in(table, which):
    t = dict(table)
    names = ("q", "mean_k", "mean_v")
    a = t[names[which]].copy()
    if not a.size:
        return
    a.reshape(-1)[a.size // 2] = np.nan
    t[names[which]] = a
    with pytest.raises(ValueError, match=rf"^{names[which]} contains NaN or Inf"):
        raise_page_table_faults(_faults(t))
