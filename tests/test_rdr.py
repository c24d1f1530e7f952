"""RDR (docs/design.md §5, §7): surrogate, exact and fast solvers, certificate, statistics, masks."""
import os
import pathlib
import signal
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, strategies as st
from scipy.optimize import linprog

from spherical_kv_ref import rdr
from spherical_kv_ref.rdr import statistics as rs
from spherical_kv_ref.rdr.page_search import (_group_transport, _least_bounded, _prices,
                                              _refine_total)
from strategies_rdr import coarse_paged_problems, degenerate_problems, tiny_problems

REL = 1e-9


# ---------------------------------------------------------------- independent references

def paged_bytes(p, tier):
    """Bytes of an allocation, computed here from the definition (docs/rdr.md §2)."""
    total = 0
    for g in np.unique(p.group):
        for t in range(1, p.num_options):
            count = int(np.sum((p.group == g) & (tier == t)))
            if p.page_bytes is None:
                total += count * int(p.cost[t])
            elif count:
                per = p.page_bytes // int(p.cost[t])
                total += -(-count // per) * p.page_bytes
    return total


def brute_force(p):
    """Optimum over every assignment of the free states (chunked enumeration)."""
    n, k = p.distortion.shape
    free = np.flatnonzero(~p.protected)
    fixed = float(p.distortion[p.protected, k - 1].sum())
    labels = np.unique(p.group)
    gi = np.searchsorted(labels, p.group)
    prot_counts = np.zeros((labels.size, k))
    np.add.at(prot_counts[:, k - 1], gi[p.protected], 1)
    best = np.inf
    total = k ** free.size
    for lo in range(0, total, 1 << 17):
        code = np.arange(lo, min(total, lo + (1 << 17)))
        obj = np.full(code.size, fixed)
        counts = np.broadcast_to(prot_counts.ravel(), (code.size, prot_counts.size)).copy()
        for j, i in enumerate(free):
            t = (code // k ** j) % k
            obj += p.distortion[i, t]
            counts[np.arange(code.size), gi[i] * k + t] += 1
        counts = counts.reshape(code.size, labels.size, k)[:, :, 1:]
        if p.page_bytes is None:
            used = (counts * p.cost[1:]).sum(axis=(1, 2))
        else:
            per = p.page_bytes // p.cost[1:]
            used = (np.ceil(counts / per) * p.page_bytes).sum(axis=(1, 2))
        ok = used <= p.budget_bytes
        if ok.any():
            best = min(best, obj[ok].min())
    return best


def lp_relaxation(p):
    """Optimum of the LP relaxation of the paged model, by a dense linprog formulation."""
    n, k = p.distortion.shape
    free = np.flatnonzero(~p.protected)
    fixed = float(p.distortion[p.protected, k - 1].sum())
    if free.size == 0:
        return fixed
    eff = np.array([0.0] + [p.page_bytes / (p.page_bytes // c) if p.page_bytes else float(c)
                            for c in p.cost[1:]])
    c = p.distortion[free].ravel()
    a_eq = np.kron(np.eye(free.size), np.ones(k))
    a_ub = np.tile(eff, free.size)[None, :]
    b_ub = [p.budget_bytes - p.protected.sum() * eff[-1]]
    res = linprog(c, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=np.ones(free.size),
                  bounds=(0, 1), method="highs")
    assert res.status == 0
    return fixed + res.fun


def close(a, b, scale):
    return abs(a - b) <= REL * max(1.0, abs(scale))


# ---------------------------------------------------------------- tiny instances

@given(tiny_problems())
def test_milp_equals_brute_force(p):
    best = brute_force(p)
    alloc = rdr.solve(p, method="milp")
    assert close(alloc.objective, best, best)
    assert alloc.optimal
    assert alloc.bytes == paged_bytes(p, alloc.tier) <= p.budget_bytes
    assert np.all(alloc.tier[p.protected] == p.num_options - 1)


@given(tiny_problems())
def test_fast_feasible_bounded_and_gap_true(p):
    best = brute_force(p)
    alloc = rdr.solve(p, method="fast")
    tier = alloc.tier
    assert tier.shape == (p.n,) and tier.min() >= 0 and tier.max() < p.num_options
    assert np.all(tier[p.protected] == p.num_options - 1)
    assert alloc.bytes == paged_bytes(p, tier) <= p.budget_bytes
    objective = p.distortion[np.arange(p.n), tier].sum()
    assert close(alloc.objective, objective, objective)
    # the certificate: a true lower bound, at least the LP of the paged model (the page
    # search can only raise it), and an honest gap
    assert alloc.lower_bound <= best + REL * max(1.0, best)
    assert alloc.objective >= alloc.lower_bound
    assert alloc.lower_bound >= lp_relaxation(p) - REL * max(1.0, best)
    expected_gap = (objective - alloc.lower_bound) / objective if objective > 0 else 0.0
    assert abs(alloc.gap - expected_gap) <= 1e-12
    assert alloc.objective >= best - REL * max(1.0, best)


@given(tiny_problems(paged=False))
def test_fast_without_pages_within_one_segment_of_lp(p):
    # with no pages, fast's answer is within one segment of the LP optimum: the gap it
    # reports is bounded by the largest single distortion saving of one state
    alloc = rdr.solve(p, method="fast")
    d = p.distortion[~p.protected]
    biggest = float((d[:, :1] - d.min(axis=1, keepdims=True)).max()) if d.size else 0.0
    assert alloc.objective - alloc.lower_bound <= biggest + REL * max(1.0, alloc.objective)


# ---------------------------------------------------------------- random instances

def random_problem(seed, n=40, groups=3, page_bytes=64, budget=None):
    rng = np.random.default_rng(seed)
    d = np.sort(rng.exponential(1.0, (n, 5)), axis=1)[:, ::-1] * rng.exponential(1.0, (n, 1))
    cost = np.array([0, 6, 9, 13, 20])
    protected = rng.random(n) < 0.1
    group = rng.integers(0, groups, n)
    b = int(budget if budget is not None else rng.integers(100, 400))
    return rdr.Problem(d, cost, group, protected, b, page_bytes)


@pytest.mark.parametrize("page_bytes", [None, 64])
@pytest.mark.parametrize("seed", range(3))
def test_more_budget_never_more_distortion(seed, page_bytes):
    base = random_problem(seed, page_bytes=page_bytes, budget=10**6)
    start = base.protected_bytes
    prev_milp = prev_lb = np.inf
    for budget in np.linspace(start, start + 500, 8).astype(int):
        p = rdr.Problem(base.distortion, base.cost, base.group, base.protected, budget, page_bytes)
        exact = rdr.solve(p, method="milp")
        fast = rdr.solve(p, method="fast")
        assert exact.bytes <= budget and fast.bytes <= budget
        assert exact.objective <= prev_milp * (1 + REL) + REL
        assert fast.lower_bound <= prev_lb * (1 + REL) + REL
        assert fast.lower_bound <= exact.objective * (1 + REL) + REL <= fast.objective * (1 + 2 * REL) + 2 * REL
        prev_milp, prev_lb = exact.objective, fast.lower_bound


def test_fast_close_to_milp_on_synthetic_case():
    p = rdr.synthetic_problem(1000, num_groups=1)
    fast, exact = rdr.solve(p, "fast"), rdr.solve(p, "milp", mip_rel_gap=1e-7)
    assert fast.bytes <= p.budget_bytes and exact.bytes <= p.budget_bytes
    assert exact.objective <= fast.objective * (1 + 1e-7)
    assert (fast.objective - exact.objective) / exact.objective < 1e-3
    assert fast.lower_bound <= exact.objective * (1 + 1e-9)


def test_deterministic():
    p = rdr.synthetic_problem(3000, num_groups=4)
    a, b = rdr.solve(p), rdr.solve(p)
    assert np.array_equal(a.tier, b.tier) and a.objective == b.objective


# ---------------------------------------------------------------- edges and errors

def test_protected_over_budget_names_bytes():
    d = np.ones((10, 3))
    cost = np.array([0, 10, 30])
    prot = np.zeros(10, bool)
    prot[:4] = True
    with pytest.raises(ValueError, match=r"need 120 bytes"):
        rdr.Problem(d, cost, np.zeros(10, int), prot, 119, None)
    # with pages of 64 bytes, 2 top-tier states per page: 4 protected = 2 pages = 128 bytes
    with pytest.raises(ValueError, match=r"need 128 bytes"):
        rdr.Problem(d, cost, np.zeros(10, int), prot, 127, 64)
    assert rdr.Problem(d, cost, np.zeros(10, int), prot, 128, 64).protected_bytes == 128


@pytest.mark.parametrize("method", ["fast", "milp"])
def test_empty_problem_and_zero_budget(method):
    empty = rdr.Problem(np.zeros((0, 3)), [0, 4, 8], np.zeros(0, int), np.zeros(0, bool), 100)
    a = rdr.solve(empty, method=method)
    assert a.tier.shape == (0,) and a.objective == 0 and a.bytes == 0 and a.gap == 0
    d = np.arange(12.0).reshape(4, 3)
    zero = rdr.Problem(d, [0, 4, 8], np.zeros(4, int), np.zeros(4, bool), 0, 16)
    a = rdr.solve(zero, method=method)
    assert np.all(a.tier == 0) and a.bytes == 0 and a.objective == d[:, 0].sum()
    assert a.gap == 0


def test_bad_input_errors():
    d = np.ones((3, 3))
    g = np.zeros(3, int)
    pr = np.zeros(3, bool)
    bad = d.copy()
    bad[1, 2] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        rdr.Problem(bad, [0, 1, 2], g, pr, 10)
    with pytest.raises(ValueError, match="non-negative"):
        rdr.Problem(-d, [0, 1, 2], g, pr, 10)
    with pytest.raises(ValueError, match="cost"):
        rdr.Problem(d, [1, 1, 2], g, pr, 10)
    with pytest.raises(ValueError, match="cost"):
        rdr.Problem(d, [0, 1.5, 2], g, pr, 10)
    with pytest.raises(ValueError, match="cost must have"):
        rdr.Problem(d, [0, 1], g, pr, 10)
    with pytest.raises(ValueError, match="budget_bytes"):
        rdr.Problem(d, [0, 1, 2], g, pr, -1)
    with pytest.raises(ValueError, match="budget_bytes"):
        rdr.Problem(d, [0, 1, 2], g, pr, float("nan"))
    with pytest.raises(ValueError, match="page_bytes"):
        rdr.Problem(d, [0, 1, 20], g, pr, 100, page_bytes=16)
    with pytest.raises(ValueError, match="group"):
        rdr.Problem(d, [0, 1, 2], np.zeros(2, int), pr, 10)
    with pytest.raises(ValueError, match="protected"):
        rdr.Problem(d, [0, 1, 2], g, np.zeros(3, int), 10)
    p = rdr.Problem(d, [0, 1, 2], g, pr, 10)
    with pytest.raises(ValueError, match="method"):
        rdr.solve(p, method="greedy")
    with pytest.raises(ValueError, match="milp options"):
        rdr.solve(p, method="milp", threads=4)
    with pytest.raises(ValueError, match="fast options"):
        rdr.solve(p, method="fast", time_limit=4)
    for bad in (-1, float("nan"), "many"):
        with pytest.raises(ValueError, match="max_search_work"):
            rdr.solve(p, method="fast", max_search_work=bad)


def test_the_page_search_runs_within_its_work_limit():
    """max_search_work = 0 skips the page-aware search (step 6), inf runs it at any size;
    on an instance it improves, the default (it fits the limit) gives the searched answer."""
    from spherical_kv_ref.rdr import greedy
    p = rdr.synthetic_problem(2000, 16, page_bytes=4096, seed=0)
    searched, skipped = rdr.solve(p), rdr.solve(p, "fast", max_search_work=0)
    assert greedy.search_fits(int((~p.protected).sum()))
    assert searched.objective < 0.5 * skipped.objective
    assert rdr.solve(p, "fast", max_search_work=np.inf).objective == searched.objective
    for a in (searched, skipped):
        assert a.lower_bound <= a.objective and a.bytes <= p.budget_bytes


# ---------------------------------------------------------------- surrogate

def _attention(logits, v):
    p = np.exp(logits - logits.max())
    p /= p.sum()
    return p, p @ v


def test_surrogate_formula_and_first_order_logit_effect():
    rng = np.random.default_rng(3)
    n, dim = 12, 16
    v = rng.standard_normal((n, dim))
    logits = rng.standard_normal(n)
    p, o = _attention(logits, v)
    res = np.linalg.norm(v - o, axis=1)
    # a logit error δ on state i moves the output by p_i (v_i − o) δ to first order
    i, delta = 5, 1e-5
    bumped = logits.copy()
    bumped[i] += delta
    _, o2 = _attention(bumped, v)
    assert np.allclose(o2 - o, p[i] * (v[i] - o) * delta, rtol=1e-4, atol=1e-14)
    # evicting state i moves it by p_i (o − v_i) / (1 − p_i) exactly; D(evict) is its leading term
    keep = np.arange(n) != i
    _, o3 = _attention(logits[keep], v[keep])
    assert np.allclose(o3 - o, p[i] * (o - v[i]) / (1 - p[i]))
    ek, ev = np.array([0.12, 0.01]), np.array([0.3, 0.02])
    q2, r = 4.0, rng.uniform(1, 2, n)
    vn = np.linalg.norm(v, axis=1)
    d = rdr.distortion(p, q2, r, vn, res, ek, ev, dim)
    assert d.shape == (n, 3)
    assert np.allclose(d[:, 0], p**2 * res**2)
    s2 = 1.0 / dim
    want = p[:, None]**2 * (s2 * q2 * r[:, None]**2 * ek / dim * res[:, None]**2
                            + vn[:, None]**2 * ev)
    assert np.allclose(d[:, 1:], want)
    # softmax_scale = 1 is docs/design.md §5's formula verbatim
    d1 = rdr.distortion(p, q2, r, vn, res, ek, ev, dim, softmax_scale=1.0)
    assert np.allclose(d1[:, 1:] - p[:, None]**2 * vn[:, None]**2 * ev,
                       p[:, None]**2 * q2 * r[:, None]**2 * ek / dim * res[:, None]**2)


def test_surrogate_matches_expected_error_of_random_key_perturbation():
    # E‖Δo‖² over random key errors of squared norm r²ε² in a uniform direction equals the
    # surrogate's key term to first order (the value term is checked by the formula test)
    rng = np.random.default_rng(7)
    n, dim, trials = 8, 32, 4000
    k = rng.standard_normal((n, dim))
    v = rng.standard_normal((n, dim))
    q = rng.standard_normal(dim)
    s = 1 / np.sqrt(dim)
    p, o = _attention(s * k @ q, v)
    eps2, i = 1e-6, 2
    r = np.linalg.norm(k[i])
    u = rng.standard_normal((trials, dim))
    u *= (r * np.sqrt(eps2)) / np.linalg.norm(u, axis=1, keepdims=True)
    err = []
    for e in u:
        kk = k.copy()
        kk[i] += e
        err.append(np.sum((_attention(s * kk @ q, v)[1] - o) ** 2))
    res = np.linalg.norm(v[i] - o)
    d = rdr.distortion(p[i], q @ q, r, 0.0, res, [eps2], [0.0], dim)
    assert d[0, 1] == pytest.approx(np.mean(err), rel=0.1)


def test_eviction_factor_scales_only_the_eviction_column():
    rng = np.random.default_rng(11)
    n, dim = 6, 16
    args = (rng.uniform(0.01, 0.3, n), 3.0, rng.uniform(1, 2, n), rng.uniform(1, 2, n),
            rng.uniform(0.5, 1, n), [0.1, 0.01], [0.2, 0.02], dim)
    base = rdr.distortion(*args)
    kappa = rng.uniform(1, 50, n)
    got = rdr.distortion(*args, eviction_factor=kappa)
    assert np.allclose(got[:, 0], kappa * base[:, 0])
    assert np.array_equal(got[:, 1:], base[:, 1:])
    with pytest.raises(ValueError, match="eviction_factor must be >= 1"):
        rdr.distortion(*args, eviction_factor=0.5)
    with pytest.raises(ValueError, match="eviction_factor"):
        rdr.distortion(*args, eviction_factor=[1.0, np.nan, 1, 1, 1, 1])


def test_evictions_of_a_shared_direction_add_up():
    # states whose values share one direction: evicting m of them shifts the output by the
    # sum of their shifts, (Σp)²‖o − v‖², not by Σ p²‖o − v‖²: the first-order surrogate's
    # independent-error sum is short by Σp²/... = m for equal p, which κ measures
    rng = np.random.default_rng(12)
    n, dim, m = 40, 8, 10
    v = rng.standard_normal((n, dim))
    v[:m] = v[0]
    logits = rng.standard_normal(n)
    logits[:m] = -1.0
    p, o = _attention(logits, v)
    keep = np.arange(n) >= m
    _, o2 = _attention(logits[keep], v[keep])
    exact = np.sum((o2 - o) ** 2)
    independent = np.sum(p[:m] ** 2 * np.sum((v[:m] - o) ** 2, axis=1))
    coherent = np.sum((p[:m].sum() * o - p[:m] @ v[:m]) ** 2)
    assert coherent == pytest.approx(m * independent)
    assert exact == pytest.approx(coherent / (1 - p[:m].sum()) ** 2)


def test_surrogate_rejects_nan_statistics():
    with pytest.raises(ValueError, match="key_radius"):
        rdr.distortion([0.5, 0.5], 1.0, [1.0, np.nan], [1, 1], [1, 1], [0.1], [0.1], 8)
    with pytest.raises(ValueError, match="attn_prob"):
        rdr.distortion([0.5, -0.5], 1.0, [1.0, 1], [1, 1], [1, 1], [0.1], [0.1], 8)
    with pytest.raises(ValueError, match="entries"):
        rdr.distortion([0.5, 0.5], 1.0, [1.0, 1, 1], [1, 1], [1, 1], [0.1], [0.1], 8)


def test_surrogate_of_huge_finite_statistics_is_finite_and_capped():
    """Keys with norms in the hundreds (no queries seen: Q² is the keys' mean r²) put the
    lognormal key term far past float's range; every entry stays at most DISTORTION_MAX, a
    zero probability gives 0 (never 0 · inf), and a sum over 2^32 capped states is finite."""
    from spherical_kv_ref.rdr.surrogate import DISTORTION_MAX
    p = np.array([0.0, 0.3, 1.0, 1.0])
    r = np.array([800.0, 800.0, 800.0, 1.0])
    ek, ev = rdr.tier_error_constants([(2, 2), (4, 4), (16, 16)], 64)
    D = rdr.distortion(p, 800.0 ** 2, r, np.full(4, 1e4), np.full(4, 1e4), ek, ev, 64,
                       key_term="lognormal")
    assert np.isfinite(D).all() and (D <= DISTORTION_MAX).all()
    assert (D[0] == 0).all()                                   # p = 0: nothing to lose
    assert D[1, 1] == D[1, 2] == 0.09 * DISTORTION_MAX          # 2 and 4 bits past measure
    assert D[1, 0] < D[1, 1] and D[1, 3] < 1e-200 * D[1, 1]   # evicting and 16 bits measured
    assert D[3, 1] < DISTORTION_MAX * 1e-200                   # a small key is measured as ever
    assert np.isfinite(np.float64(2.0 ** 32) * DISTORTION_MAX)


def test_compress_of_keys_with_norms_in_the_hundreds_succeeds():
    """The regression: such keys made every quantised tier's distortion inf, and compress
    refused a finite input with "distortion has NaN or infinite entries"."""
    import spherical_kv_ref as skv
    rng = np.random.default_rng(0)
    k, v = rng.standard_normal((2, 2, 300, 64)) * 100.0      # key norms ~800
    cache = skv.SphericalKVCache(num_layers=1, num_kv_heads=2, head_dim=64)
    seq = cache.new_sequence()
    cache.append(seq, 0, k, v)
    report = cache.compress(seq, budget_fraction=0.25)
    assert report.bytes_after <= report.budget_bytes
    assert np.isfinite(report.allocation.objective)
    assert np.isfinite(cache.decode(seq, 0, rng.standard_normal((2, 64)))).all()


def test_tier_error_constants():
    ek, ev = rdr.tier_error_constants([(4, 2), (16, 16)], 128, error={2: 0.12, 4: 0.01, 16: 0.0})
    assert np.array_equal(ek, [0.01, 0.0]) and np.array_equal(ev, [0.12, 0.0])
    ek, ev = rdr.tier_error_constants([(3, 3)], 64, error=lambda b, d: b / d)
    assert ek[0] == ev[0] == 3 / 64
    with pytest.raises(ValueError, match="no error constant"):
        rdr.tier_error_constants([(3, 3)], 64, error={2: 0.1})


# ---------------------------------------------------------------- statistics and masks

def test_window_attention_causal_gqa_average():
    rng = np.random.default_rng(1)
    hk, g, w, n, dim = 2, 3, 4, 9, 8
    q = rng.standard_normal((hk * g, w, dim))
    k = rng.standard_normal((hk, n, dim))
    p, q_sq = rs.window_attention(q, k)
    assert p.shape == (hk, n)
    assert np.allclose(p.sum(axis=1), 1.0)
    for h in range(hk):
        acc = np.zeros(n)
        for head in range(h * g, (h + 1) * g):
            for j in range(w):
                seen = n - w + j + 1
                a, _ = _attention(q[head, j] @ k[h, :seen].T / np.sqrt(dim), np.eye(seen))
                acc[:seen] += a
        assert np.allclose(p[h], acc / (g * w))
        assert np.isclose(q_sq[h], np.mean(np.sum(q[h * g:(h + 1) * g] ** 2, axis=-1)))
    with pytest.raises(ValueError, match="multiple"):
        rs.window_attention(q[:5], k)


def test_accumulator_averages_over_steps_seen():
    acc = rs.AttentionAccumulator(num_q_heads=2, num_kv_heads=1)
    acc.update(np.array([[0.5, 0.5], [0.7, 0.3]]))
    acc.update(np.array([[0.2, 0.2, 0.6], [0.4, 0.2, 0.4]]))
    want = np.array([[(0.6 + 0.3) / 2, (0.4 + 0.2) / 2, 0.5]])
    assert np.allclose(acc.mean(), want)
    with pytest.raises(ValueError, match="fewer"):
        acc.update(np.ones((2, 2)))


def test_output_statistics():
    v = np.array([[[1.0, 0.0], [0.0, 1.0]]])
    vn, res = rs.output_statistics(np.array([[3.0, 1.0]]), v)
    assert np.allclose(vn, 1.0)
    o = np.array([0.75, 0.25])
    assert np.allclose(res, np.linalg.norm(v[0] - o, axis=1))


def test_masks():
    assert rs.sink_mask(5, 2).tolist() == [True, True, False, False, False]
    assert rs.recent_mask(5, 2).tolist() == [False, False, False, True, True]
    assert not rs.recent_mask(5, 0).any() and rs.recent_mask(3, 10).all()
    assert rs.span_mask(6, [(1, 2), (4, 6)]).tolist() == [False, True, False, False, True, True]
    with pytest.raises(ValueError, match="span"):
        rs.span_mask(4, [(2, 5)])
    r = np.ones((2, 50))
    r[1, 7] = 30.0
    vn = np.linspace(1, 2, 50)[None, :].repeat(2, axis=0)
    m = rs.outlier_mask(r, vn)
    assert m.shape == (2, 50) and m.sum() == 1 and m[1, 7]
    combined = rs.sink_mask(50, 4) | rs.recent_mask(50, 8) | m
    assert combined.shape == (2, 50) and combined[0, :4].all() and combined[1, 7]


# ---------------------------------------------------------------- page-count search

def _capped_optimum(d, cap):
    """Least Σ d[j, t_j] with at most cap[t] states at each tier t >= 1, by enumeration."""
    m, k = d.shape
    best = np.inf
    for code in range(k ** m):
        t = np.array([(code // k ** j) % k for j in range(m)], dtype=np.int64)
        if np.all(np.bincount(t, minlength=k)[1:] <= cap[1:]):
            best = min(best, float(d[np.arange(m), t].sum()))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_group_transport_optimal_under_caps_and_its_prices_bound(seed):
    # the assignment of one group under fixed page counts (a transportation problem) is
    # exact: equal to brute force over every assignment that respects the slot caps
    rng = np.random.default_rng(seed)
    m, k = int(rng.integers(1, 7)), int(rng.integers(2, 5))
    d = np.round(rng.exponential(1.0, (m, k)) * 8) / 8     # ties, as with quantised statistics
    cap = np.concatenate([[m], rng.integers(0, m + 1, k - 1)])
    rows = np.arange(m, dtype=np.int64)
    tier = np.empty(m, dtype=np.int64)
    total = _group_transport(d, rows, cap.astype(np.int64), tier)
    assert np.all(np.bincount(tier, minlength=k)[1:] <= cap[1:])
    assert total == pytest.approx(d[rows, tier].sum(), rel=1e-12)
    assert total == pytest.approx(_capped_optimum(d, cap), rel=1e-9, abs=1e-12)
    # its slot prices: the dual equals the optimum here, and bounds it at any other caps
    mu = np.empty(k)
    a = _prices(d, rows, cap.astype(np.int64), tier, mu)
    assert np.all(mu >= 0)
    assert a - mu[1:] @ cap[1:] == pytest.approx(total, rel=1e-9, abs=1e-12)
    other = np.concatenate([[m], rng.integers(0, m + 1, k - 1)])
    assert a - mu[1:] @ other[1:] <= _capped_optimum(d, other) + 1e-9


def _vectors(p, lo_top, hi):
    """Every page count vector y (y[0] unused) with Σ y = p, y_t ≤ hi[t−1], y_T ≥ lo_top."""
    k = hi.size + 1
    for y in np.ndindex(*(hi + 1)):
        if sum(y) == p and y[-1] >= lo_top:
            yield np.array((0,) + y, dtype=np.int64)


def _group_case(seed):
    """One group of 6–14 free states, 2–4 tiers with pages of 1–4 states each, and a few
    protected states at the top."""
    rng = np.random.default_rng(seed)
    m, k = int(rng.integers(6, 15)), int(rng.integers(3, 6))
    d = np.sort(np.round(rng.exponential(1.0, (m, k)) * 16) / 16, axis=1)[:, ::-1].copy()
    per = np.concatenate([[0], np.sort(rng.integers(1, 5, k - 1))[::-1]]).astype(np.int64)
    prot = int(rng.integers(0, 3))
    lo_top = -(-prot // per[-1])
    hi = -(-np.full(k - 1, m) // per[1:])
    hi[-1] = -(-(m + prot) // per[-1])
    return d, np.arange(m, dtype=np.int64), per, prot, lo_top, hi.astype(np.int64)


def _exact_total(d, rows, per, prot, y):
    cap = y * per
    cap[-1] -= prot
    return _group_transport(d, rows, cap, np.empty(rows.size, dtype=np.int64))


@pytest.mark.parametrize("seed", range(12))
def test_least_bounded_vector_found_by_branch_and_bound(seed):
    # the branch and bound over page count vectors finds the least of the cuts' bound
    # max_c (a_c − Σ_t mu_ct·cap_t), as listing every vector of the total does
    d, rows, per, prot, lo_top, hi = _group_case(seed)
    k = d.shape[1]
    rng = np.random.default_rng(100 + seed)
    vecs = [y for p in range(lo_top, int(hi.sum()) + 1) for y in _vectors(p, lo_top, hi)]
    cut_a, cut_mu = [], []
    for i in rng.choice(len(vecs), min(5, len(vecs)), replace=False):
        cap = vecs[i] * per
        cap[-1] -= prot
        tier, mu = np.empty(rows.size, dtype=np.int64), np.empty(k)
        _group_transport(d, rows, cap, tier)
        cut_a.append(_prices(d, rows, cap, tier, mu))
        cut_mu.append(mu.copy())
    cut_a, cut_mu = np.array(cut_a), np.array(cut_mu)
    for p in range(lo_top, int(hi.sum()) + 1):
        listed = [max(a - mu[1:] @ (y[1:] * per[1:]) + mu[-1] * prot
                      for a, mu in zip(cut_a, cut_mu)) for y in _vectors(p, lo_top, hi)]
        y = np.zeros(k, dtype=np.int64)
        low = _least_bounded(cut_a, cut_mu, cut_a.size, per, prot, lo_top, hi, p, np.inf, y,
                             10**6)
        assert low == pytest.approx(min(listed), rel=1e-12, abs=1e-12)
        assert y.sum() == p and np.all(y[1:] <= hi) and y[-1] >= lo_top
        assert _least_bounded(cut_a, cut_mu, cut_a.size, per, prot, lo_top, hi, p, min(listed),
                              y, 10**6) == min(listed)     # nothing below the threshold


@pytest.mark.parametrize("seed", range(12))
def test_refined_total_bounds_and_finds_the_group_optimum(seed):
    # Benders' cuts on one page total: the bound never exceeds the least capped optimum
    # over every vector of that total (brute force), and it closes on it here
    d, rows, per, prot, lo_top, hi = _group_case(seed)
    k = d.shape[1]
    for p in range(lo_top, int(hi.sum()) + 1):
        exact = min(_exact_total(d, rows, per, prot, y) for y in _vectors(p, lo_top, hi))
        cut_a, cut_mu = np.empty(64), np.empty((64, k))
        low, best, y, nc, solved = _refine_total(d, rows, prot, per, lo_top, hi, p, cut_a,
                                                 cut_mu, 0, np.inf, np.zeros(k, np.int64), 60)
        assert low <= exact * (1 + 1e-12) + 1e-12
        assert best == pytest.approx(exact, rel=1e-12, abs=1e-12)
        assert _exact_total(d, rows, per, prot, y) == pytest.approx(best, rel=1e-12, abs=1e-12)
        assert low == pytest.approx(exact, rel=1e-9, abs=1e-12) and solved <= 60


@pytest.mark.parametrize("groups", [2, 3])
def test_fast_matches_milp_when_groups_hold_few_pages(groups):
    # 1000 states over 2–3 groups at 4 KiB pages: a handful of pages per group, where the
    # greedy alone was 3 % worse than the optimum; the page-count search closes it
    p = rdr.synthetic_problem(1000, num_groups=groups)
    fast, exact = rdr.solve(p, "fast"), rdr.solve(p, "milp", mip_rel_gap=1e-6)
    assert fast.bytes <= p.budget_bytes and exact.optimal
    assert fast.objective <= exact.objective * (1 + 1e-4)
    assert fast.lower_bound <= exact.objective * (1 + 1e-9)


def test_milp_never_worse_than_fast_and_bound_honest():
    p = rdr.synthetic_problem(2000, num_groups=4)
    fast, exact = rdr.solve(p, "fast"), rdr.solve(p, "milp", mip_rel_gap=1e-4)
    assert exact.optimal and exact.objective <= fast.objective
    assert exact.lower_bound <= exact.objective
    assert exact.gap <= 1e-4 + 1e-12


# ---------------------------------------------------------------- coarse pages (properties)

@given(coarse_paged_problems())
def test_fast_within_its_reported_gap_of_brute_force_with_coarse_pages(p):
    best = brute_force(p)
    alloc = rdr.solve(p, method="fast")
    assert alloc.bytes == paged_bytes(p, alloc.tier) <= p.budget_bytes
    assert alloc.lower_bound <= best + REL * max(1.0, best)
    # the answer is no further from the optimum than the gap it reports
    assert alloc.objective - best <= alloc.gap * alloc.objective + REL * max(1.0, best)


@given(coarse_paged_problems(), st.integers(1, 3))
def test_more_budget_never_more_distortion_with_pages(p, more_pages):
    richer = rdr.Problem(p.distortion, p.cost, p.group, p.protected,
                         p.budget_bytes + more_pages * p.page_bytes, p.page_bytes)
    a, b = rdr.solve(p, method="fast"), rdr.solve(richer, method="fast")
    assert b.objective <= a.objective * (1 + REL) + REL
    assert b.lower_bound <= a.objective * (1 + REL) + REL


@given(coarse_paged_problems())
def test_protected_over_budget_error_names_the_bytes_needed(p):
    need = p.protected_bytes
    if need == 0:
        return
    with pytest.raises(ValueError, match=rf"protected states alone need {need} bytes"):
        rdr.Problem(p.distortion, p.cost, p.group, p.protected, need - 1, p.page_bytes)


# ---------------------------------------------------------------- degenerate problems

@given(degenerate_problems())
def test_fast_agrees_with_milp_on_degenerate_problems(p):
    # all-zero, tied and nearly tied distortions, groups of one state, budgets at the
    # protected bytes: what the statistics of a cache that recorded no query look like
    fast, exact = rdr.solve(p, "fast"), rdr.solve(p, "milp")
    assert fast.bytes == paged_bytes(p, fast.tier) <= p.budget_bytes
    assert np.all(fast.tier[p.protected] == p.num_options - 1)
    assert exact.optimal
    tol = REL * max(fast.objective, exact.objective)      # relative: distortions of ~1e-6
    assert fast.lower_bound <= exact.objective + tol
    assert exact.objective <= fast.objective + tol
    assert fast.objective - exact.objective <= fast.gap * fast.objective + tol


#: One group of the compress problem that crashed the fast solver (SIGSEGV, SIGBUS or a
#: hang): SmolLM2-135M's layer 0, kv-head 0 after a 200-token prefill of the GPL-3 text
#: with no query recorded (``SphericalCache(config, observe=0)``), so its distortions are
#: those of uniform attention (docs/rdr.md §5). Two of its states make a cycle of moves
#: between two tiers whose costs cancel; rounding summed them below zero, and the
#: transport's chain, before it refused to revisit a tier, ran round the cycle, pushing
#: onto a heap past its end. 199 states (36 protected), 8 options, pages of 4096 bytes; it
#: crashed at 5 to 12 pages (``compress(budget_fraction=0.5)`` gave the whole problem,
#: 90 such groups, 585 pages).
NO_QUERIES = pathlib.Path(__file__).parent / "data" / "rdr_smollm2_no_queries.npz"


def no_queries_problems(pages=range(3, 14)):
    """The NO_QUERIES group at budgets of ``pages`` pages (3: its protected states' bytes;
    13: every state at the top tier)."""
    with np.load(NO_QUERIES) as z:
        d, cost, protected, page = z["distortion"], z["cost"], z["protected"], int(z["page_bytes"])
    group = np.zeros(len(d), dtype=np.int64)
    return [rdr.Problem(d, cost, group, protected, n * page, page) for n in pages]


#: the child of :func:`fast_in_child`: solves the problems of one .npz file
_CHILD = """
import sys
import numpy as np
from spherical_kv_ref import rdr
with np.load(sys.argv[1]) as z:
    tiers = []
    for i in range(int(z["count"])):
        page = int(z[f"page_bytes{i}"])
        p = rdr.Problem(z[f"distortion{i}"], z[f"cost{i}"], z[f"group{i}"], z[f"protected{i}"],
                        int(z[f"budget{i}"]), page or None)
        tiers.append(rdr.solve(p, "fast").tier)
np.savez(sys.argv[2], *tiers)
"""


def fast_in_child(problems, folder, env=None, timeout=300):
    """``rdr.solve(p, "fast").tier`` of every problem, solved in a child process (its
    environment updated by ``env``), so that a crash (SIGSEGV, SIGBUS) or a hang fails the
    test instead of ending the test run. The child imports the package this test imports.
    ``timeout`` (s) leaves room for numba to compile the solver on a cold cache."""
    fields = {"count": len(problems)}
    for i, p in enumerate(problems):
        fields.update({f"distortion{i}": p.distortion, f"cost{i}": p.cost, f"group{i}": p.group,
                       f"protected{i}": p.protected, f"budget{i}": p.budget_bytes,
                       f"page_bytes{i}": p.page_bytes or 0})
    src, dst = folder / "problems.npz", folder / "tiers.npz"
    np.savez(src, **fields)
    root = str(pathlib.Path(rdr.__file__).parents[2])
    child_env = dict(os.environ, **(env or {}))
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    try:
        run = subprocess.run([sys.executable, "-c", _CHILD, str(src), str(dst)], env=child_env,
                             capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the fast solver hung: no answer in {timeout} s")
    if run.returncode != 0:
        how = (f"signal {signal.Signals(-run.returncode).name}" if run.returncode < 0
               else f"exit code {run.returncode}")
        pytest.fail(f"the fast solver's process ended with {how}:\n{run.stderr[-3000:]}")
    with np.load(dst) as z:
        return [z[f"arr_{i}"] for i in range(len(problems))]


def test_fast_solves_the_no_queries_problem_that_crashed_it(tmp_path):
    problems = no_queries_problems()
    for p, tier in zip(problems, fast_in_child(problems, tmp_path)):
        exact = rdr.solve(p, "milp")
        assert p.is_feasible(tier) and exact.optimal
        assert p.objective_of(tier) <= exact.objective * (1 + REL)


def test_fast_stays_in_bounds_with_numba_bounds_checking(tmp_path, request):
    """The fast solver compiled with numba's bounds checking (an index out of bounds raises
    IndexError instead of reading or writing past an array's end), on that problem, a
    synthetic one with few pages per group (the page search runs) and random ones with and
    without pages: the same tiers as the unchecked build. Numba's cache does not tell the
    two builds apart, so the checked one keeps its own, in pytest's cache folder (a fresh
    one where pytest runs without its cache)."""
    problems = (no_queries_problems((3, 8, 13)) + [rdr.synthetic_problem(600, num_groups=3)]
                + [random_problem(seed, page_bytes=page) for seed, page in ((0, 64), (1, None))])
    pytest_cache = getattr(request.config, "cache", None)
    cache = pytest_cache.mkdir("numba-boundscheck") if pytest_cache else tmp_path / "numba"
    checked = fast_in_child(problems, tmp_path,
                            {"NUMBA_BOUNDSCHECK": "1", "NUMBA_CACHE_DIR": str(cache)})
    for p, tier in zip(problems, checked):
        assert np.array_equal(tier, rdr.solve(p, "fast").tier)


def _rope_matrix(pos, inv_freq):
    """RoPE at position pos as a d × d matrix (rotate-half layout), built coordinate pair by pair."""
    half = len(inv_freq)
    R = np.zeros((2 * half, 2 * half))
    for i, f in enumerate(inv_freq):
        c, s = np.cos(pos * f), np.sin(pos * f)
        R[i, i], R[i, i + half], R[i + half, i], R[i + half, i + half] = c, -s, s, c
    return R


def test_rope_shift_moves_a_rotated_query_to_a_later_position():
    rng = np.random.default_rng(11)
    f = rs.rope_inv_freq(16, 100000.0)
    assert f[0] == 1.0 and f[-1] == pytest.approx(100000.0 ** (-14 / 16))
    raw = rng.standard_normal((3, 16))
    pos = np.array([0, 7, 1999])
    post = np.stack([_rope_matrix(p, f) @ q for p, q in zip(pos, raw)])
    moved = rs.rope_shift(post, np.array([5, 0.5, 37]), f)
    want = np.stack([_rope_matrix(p + s, f) @ q for p, s, q in zip(pos, [5, 0.5, 37], raw)])
    assert np.allclose(moved, want, atol=1e-12)
    assert np.allclose(np.linalg.norm(moved, axis=1), np.linalg.norm(raw, axis=1))
    with pytest.raises(ValueError, match="frequencies"):
        rs.rope_shift(post, 1, f[:-1])
    with pytest.raises(ValueError, match="even"):
        rs.rope_inv_freq(15)


def test_future_queries_carry_the_recent_moments_to_the_positions_to_come():
    """The second moment of the carried queries is (1/K)·Σ_k R(f_k) M R(f_k)ᵀ, with M the
    pre-RoPE queries' second moment (μμᵀ + Σ) and f_k the K future positions."""
    rng = np.random.default_rng(12)
    d, m, L, H, K = 8, 5, 40, 24, 4
    f = rs.rope_inv_freq(d, 500.0)
    raw = rng.standard_normal((m, d)) + 2.0
    post = np.stack([_rope_matrix(L - m + j, f) @ raw[j] for j in range(m)])
    fq = rs.future_queries(post, f, H, points=K)
    assert fq.shape == (m * K, d)
    future = L - 1 + (np.arange(K) + 0.5) * H / K
    M = raw.T @ raw / m
    want = sum(_rope_matrix(p, f) @ M @ _rope_matrix(p, f).T for p in future) / K
    assert np.allclose(fq.T @ fq / (m * K), want, atol=1e-10)
    mean = sum(_rope_matrix(p, f) @ raw.mean(axis=0) for p in future) / K
    assert np.allclose(fq.mean(axis=0), mean, atol=1e-10)
    with pytest.raises(ValueError, match="positive"):
        rs.future_queries(post, f, 0)
