"""RDR on the device (cupy_kernels.rdr_device) against the reference, run with torch on the
CPU (the functions are device-agnostic): batched statistics and the surrogate equal the
reference's; the LP-greedy answer fits the paged budget, never promotes, keeps protected
states, and its lower bound is below the host solvers' objectives."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cupy_kernels import rdr_device  # noqa: E402
from spherical_kv_ref import rdr  # noqa: E402
from spherical_kv_ref.rdr.statistics import row_statistics  # noqa: E402
from spherical_kv_ref.tiers import TierLadder  # noqa: E402


@pytest.mark.parametrize("queries", [True, False])
def test_batched_statistics_equal_the_reference(queries):
    rng = np.random.default_rng(0)
    R, n, d, m = 3, 97, 16, 12
    yk = rng.standard_normal((R, n, d)) * 2
    yv = rng.standard_normal((R, n, d))
    qr = rng.standard_normal((R, m, d)) * 3 if queries else None
    cand = rng.random((R, n)) < 0.8
    got = rdr_device.row_statistics(torch.tensor(yk), torch.tensor(yv),
                                    None if qr is None else torch.tensor(qr), 0.25, 0.2,
                                    torch.tensor(cand))
    for i in range(R):
        want = row_statistics(yk[i], yv[i], None if qr is None else qr[i], 0.25, 0.2,
                              cand[i] if queries else None)
        p, q2, r, vn, res, kappa = (x[i] for x in got)
        for g, w in zip((p, q2, r, vn, res, kappa), want):
            np.testing.assert_allclose(np.asarray(g), w, rtol=1e-10, atol=1e-300)


def test_distortion_equals_the_reference():
    rng = np.random.default_rng(1)
    n, d = 200, 64
    p, r, vn, res = (rng.random(n) for _ in range(4))
    q2, kappa = rng.random(n) * 9, 1 + rng.random(n) * 4
    ek, ev = rdr.tier_error_constants(TierLadder().tiers, d, kind="uniform")
    for term in ("linear", "lognormal"):
        want = rdr.distortion(p, q2, r, vn, res, ek, ev, d, softmax_scale=0.125,
                              eviction_factor=kappa, key_term=term)
        got = rdr_device.distortion(*(torch.tensor(x) for x in (p, q2, r, vn, res)), ek, ev, d,
                                    0.125, torch.tensor(kappa), term)
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-12)


def _greedy_problem(seed, groups=4, pb=1024, d=64):
    """A random allocation problem (rdr.Problem) with states at mixed current tiers, a few
    protected, and the per-state page shares the device solver charges."""
    rng = np.random.default_rng(seed)
    lad = TierLadder()
    T = lad.top
    cost = lad.costs(d)
    n = int(rng.integers(40, 400))
    group = rng.integers(0, groups, n)
    D = np.sort(rng.random((n, T + 1)) ** 3, axis=1)[:, ::-1].copy()
    cur = np.where(rng.random(n) < 0.7, T, rng.integers(1, T + 1, n))
    D = np.where(np.arange(T + 1)[None, :] > cur[:, None], D[np.arange(n), cur][:, None] * 1.5 + 1, D)
    prot = (rng.random(n) < 0.1) & (cur == T)
    problem = rdr.Problem(D, cost, group, prot, int(rng.uniform(0.2, 0.7) * n * cost[T]), pb)
    per = problem.states_per_page
    share = [0.0] + [pb / per[t] for t in range(1, T + 1)]
    return problem, D, cur, prot, group, share, T


@pytest.mark.parametrize("seed", range(6))
def test_greedy_answer_is_feasible_and_its_bound_holds(seed):
    problem, D, cur, prot, group, share, T = _greedy_problem(seed)
    pb, groups = problem.page_bytes, 4
    tier, obj, lb = rdr_device.greedy_allocation(
        torch.tensor(D), torch.tensor(cur), torch.tensor(prot), torch.tensor(group), share, pb,
        float(problem.budget_bytes), groups)
    tier = tier.numpy()
    assert problem.bytes_of(tier) <= problem.budget_bytes
    assert np.all(tier[prot] == T) and np.all(tier <= cur)
    assert obj == pytest.approx(problem.objective_of(tier))
    fast = rdr.solve(problem, "fast")
    assert lb <= fast.objective * (1 + 1e-9) and lb <= obj * (1 + 1e-12)


def test_greedy_over_several_problems_solves_each_as_alone():
    """Three problems in one call (the sequences of a batch, each its own budget): the same
    tiers, objective and bound as three calls."""
    parts = [_greedy_problem(seed) for seed in (11, 12, 13)]
    alone = []
    for problem, D, cur, prot, group, share, _ in parts:
        alone.append(rdr_device.greedy_allocation(
            torch.tensor(D), torch.tensor(cur), torch.tensor(prot), torch.tensor(group), share,
            problem.page_bytes, float(problem.budget_bytes), 4))
    cat = lambda i: torch.tensor(np.concatenate([p[i] for p in parts]))
    groups = torch.tensor(np.concatenate([p[4] + 4 * k for k, p in enumerate(parts)]))
    segment = torch.tensor(np.concatenate([np.full(p[1].shape[0], k) for k, p in enumerate(parts)]))
    tier, obj, lb = rdr_device.greedy_allocation(
        cat(1), cat(2), cat(3), groups, parts[0][5], parts[0][0].page_bytes,
        [float(p[0].budget_bytes) for p in parts], 12, segment=segment)
    assert torch.equal(tier, torch.cat([a[0] for a in alone]))
    assert obj == pytest.approx([a[1] for a in alone], rel=1e-12)
    assert lb == pytest.approx([a[2] for a in alone], rel=1e-9)
    # the problems' states interleaved (no problem one slice): the same answer, state by state
    mix = torch.as_tensor(np.random.default_rng(5).permutation(segment.numel()))
    tier2, obj2, lb2 = rdr_device.greedy_allocation(
        cat(1)[mix], cat(2)[mix], cat(3)[mix], groups[mix], parts[0][5], parts[0][0].page_bytes,
        [float(p[0].budget_bytes) for p in parts], 12, segment=segment[mix])
    assert torch.equal(tier2, tier[mix])
    assert obj2 == pytest.approx(obj, rel=1e-12) and lb2 == pytest.approx(lb, rel=1e-9)


def test_greedy_refuses_a_budget_below_the_protected_states():
    D = torch.rand((10, 3), dtype=torch.float64)
    prot = torch.ones(10, dtype=torch.bool)
    with pytest.raises(ValueError, match="protected states"):
        rdr_device.greedy_allocation(D, torch.full((10,), 2), prot, torch.zeros(10, dtype=torch.long),
                                     [0.0, 100.0, 200.0], 1024, 100.0, 1)


@pytest.mark.parametrize("n", [1, 4095, 4096, 4097, 3 * 4096 + 17])
def test_the_chunked_prefix_sum_is_the_prefix_sum(n):
    from cupy_kernels.rdr_device import _cumsum
    x = torch.as_tensor(np.random.default_rng(n).random(n) * 4096.0)
    torch.testing.assert_close(_cumsum(x), torch.cumsum(x, dim=0), rtol=1e-12, atol=1e-6)


def test_distortion_of_huge_key_errors_is_the_ceiling_not_nan():
    """The lognormal key term past float's range (e^{2σ²} and e^{σ²/2} both overflow when
    σ² > 1419.6) is rdr.surrogate's ceiling on the host and the device, never inf − inf =
    NaN, and a product past float's range (‖v − o‖ of 1e4 here) is capped the same way."""
    n = 5
    p, q2, vn, res = np.full(n, 0.1), np.full(n, 64.0), np.ones(n), np.array([1.0] * 4 + [1e4])
    r = np.array([1.0, 1e3, 1e5, 1e8, 1e8])          # logit error variance up to ~1e16
    ek, ev = rdr.tier_error_constants(TierLadder().tiers, 64, kind="uniform")
    want = rdr.distortion(p, q2, r, vn, res, ek, ev, 64, softmax_scale=0.125, key_term="lognormal")
    got = rdr_device.distortion(*(torch.tensor(x) for x in (p, q2, r, vn, res)), ek, ev, 64,
                                0.125, torch.ones(n, dtype=torch.float64), "lognormal").numpy()
    assert not np.isnan(want).any() and not np.isnan(got).any()
    assert np.isfinite(want).all()
    np.testing.assert_allclose(got, want, rtol=1e-12)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(3, 97, 16, 12), (4, 1000, 128, 128), (2, 4099, 64, 33)])
def test_statistics_kernels_on_cuda_equal_the_reference(shape):
    """On CUDA the softmax and the per-state sums are rdr_stats.cuh's kernels, not torch ops:
    the same figures as the reference row by row, and as the torch path on the CPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("cupy")
    rng = np.random.default_rng(sum(shape))
    R, n, d, m = shape
    yk = rng.standard_normal((R, n, d)) * 2
    yv = rng.standard_normal((R, n, d))
    qr = rng.standard_normal((R, m, d)) * 3
    cand = rng.random((R, n)) < 0.8
    dev = lambda x: torch.tensor(x, device="cuda")
    got = [x.cpu() for x in rdr_device.row_statistics(dev(yk), dev(yv), dev(qr), 0.25, 0.2,
                                                      dev(cand))]
    host = rdr_device.row_statistics(torch.tensor(yk), torch.tensor(yv), torch.tensor(qr), 0.25,
                                     0.2, torch.tensor(cand))
    for g, h in zip(got, host):
        np.testing.assert_allclose(g.numpy(), h.numpy(), rtol=1e-10, atol=1e-300)
    for i in range(R):
        want = row_statistics(yk[i], yv[i], qr[i], 0.25, 0.2, cand[i])
        for g, w in zip((x[i] for x in got), want):
            np.testing.assert_allclose(np.asarray(g), w, rtol=1e-10, atol=1e-300)


@pytest.mark.gpu
def test_hull_kernel_equals_the_torch_ops_and_the_answer_is_the_same():
    """On CUDA, the default ladder's hull is rdr_stats.cuh's kernel: bit for bit the torch ops'
    keep, nxt and pos (distortions with ties, options above the current tier, every current
    tier), and greedy_allocation gives the CPU's tiers, objective and bound."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("cupy")
    rng = np.random.default_rng(5)
    T = TierLadder().top
    n = 20011
    D = np.sort(np.round(rng.random((n, T + 1)) ** 3 * 8) / 8, axis=1)[:, ::-1].copy()
    D[rng.random(n) < 0.2] = rng.random((1, T + 1))        # repeated rows
    cur = rng.integers(0, T + 1, n)
    c = torch.tensor([0.0] + [float(x) for x in np.cumsum(rng.integers(8, 40, T))],
                     dtype=torch.float64)
    want = rdr_device._hull(torch.tensor(D), torch.tensor(cur), c)
    got = rdr_device._hull(torch.tensor(D, device="cuda"), torch.tensor(cur, device="cuda"),
                           c.cuda())
    for g, w in zip(got, want):
        assert torch.equal(g.cpu(), w)
    for seed in (21, 22):
        problem, D, cur, prot, group, share, _ = _greedy_problem(seed)
        args = (D, cur, prot, group)
        host = rdr_device.greedy_allocation(*(torch.tensor(x) for x in args), share,
                                            problem.page_bytes, float(problem.budget_bytes), 4)
        dev = rdr_device.greedy_allocation(*(torch.tensor(x, device="cuda") for x in args), share,
                                           problem.page_bytes, float(problem.budget_bytes), 4)
        assert torch.equal(dev[0].cpu(), host[0])
        assert dev[1] == pytest.approx(host[1], rel=1e-12)
        assert dev[2] == pytest.approx(host[2], rel=1e-9)


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [False, True])
def test_many_problems_on_cuda_give_the_cpu_s_answer(interleaved):
    """On CUDA each bisection step counts the (group, tier) bins in one kernel
    (rdr_cut_counts_kernel, atomics aggregated per warp), where the CPU runs bincount: forty
    problems in one call, their states one slice each or interleaved, get the CPU's tiers,
    objectives and bounds."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("cupy")
    parts = [_greedy_problem(seed) for seed in range(30, 70)]
    cat = lambda i: np.concatenate([p[i] for p in parts])
    groups = np.concatenate([p[4] + 4 * k for k, p in enumerate(parts)])
    segment = np.concatenate([np.full(p[1].shape[0], k) for k, p in enumerate(parts)])
    arrays = [cat(1), cat(2), cat(3), groups, segment]
    if interleaved:
        mix = np.random.default_rng(3).permutation(segment.size)
        arrays = [a[mix] for a in arrays]
    budgets = [float(p[0].budget_bytes) for p in parts]
    answers = []
    for device in ("cpu", "cuda"):
        D, cur, prot, group, seg = (torch.tensor(a, device=device) for a in arrays)
        answers.append(rdr_device.greedy_allocation(D, cur, prot, group, parts[0][5],
                                                    parts[0][0].page_bytes, budgets,
                                                    4 * len(parts), segment=seg))
    host, dev = answers
    assert torch.equal(dev[0].cpu(), host[0])
    assert dev[1] == pytest.approx(host[1], rel=1e-12)
    assert dev[2] == pytest.approx(host[2], rel=1e-9)


def test_kernel_arguments_refuse_host_tensors_and_pass_scalars_through():
    # the kernels read device addresses: a host tensor among the arguments is refused before
    # any launch, and scalars and addresses taken before pass through unchanged
    with pytest.raises(ValueError, match="CUDA device"):
        rdr_device._kernel_args((torch.zeros(4), np.int64(4)))
    args = rdr_device._kernel_args((np.int64(7), np.uint64(0), np.float64(0.5)))
    assert tuple(args) == (np.int64(7), np.uint64(0), np.float64(0.5))
    assert args.tensors == ()
