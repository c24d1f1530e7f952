"""RDR on the device: the per-state statistics, the distortion surrogate and an LP-greedy
allocation, as torch float64 tensors on the GPU (docs/rdr.md; docs/design.md §5, §8).

``row_statistics`` is ``spherical_kv_ref.rdr.statistics.row_statistics`` for a batch of
rows of equal length (the rows of one layer after a prefill), ``distortion`` is
``rdr.distortion``; both are tested equal to the reference. ``greedy_allocation`` solves the
problem ``rdr.Problem`` states, with nothing leaving the device but the answer:

* per state, the lower convex hull of its options (cost, distortion), options above its
  current tier removed (never promote);
* every hull step as one increment (bytes, distortion saved), all of them sorted by
  distortion saved per byte and taken in that order while they fit: the LP relaxation's
  optimum, rounded down to whole steps;
* bytes are charged per state at its page share page_bytes / P_t; the cut in slope order
  is the largest whose paged bytes (padding of partly filled pages included) fit, found by
  bisection between the cut that fits with one page per (group, tier) set aside and the cut
  that fits at page shares;
* certificate: the LP relaxation at the whole budget with the same per-state shares is a
  lower bound of the paged optimum (a feasible paged allocation pays at least its shares).

It is the first stage of the host's ``"fast"`` solver without its page repair and search,
so its gap is larger (reported with every answer); its point is time: the host solver spends
~20 s on the 8.4M states of one 32K-token Llama-8B sequence, this one milliseconds.
"""
from __future__ import annotations

import numpy as np

from spherical_kv_ref.rdr.surrogate import DISTORTION_MAX, LOG_FLOAT_MAX

from ._module import RDR_HULL_OPTIONS


def _torch():
    import torch
    return torch


def upload(x, device, dtype=None):
    """A host array (or list) as a tensor on ``device`` without making the host wait: on
    CUDA through page-locked memory, queued behind the stream's work (a pageable copy first
    waits for that work to finish, and the GPU then idles while the host catches up). Not
    for use inside a CUDA graph capture."""
    torch = _torch()
    t = torch.as_tensor(np.ascontiguousarray(np.asarray(x, dtype)))
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _cumsum(x, chunk: int = 4096):
    """Inclusive prefix sum of a long 1-D tensor. torch scans a 1-D tensor as one row (54 ms
    over the ~59M increments of a 32K-token Llama-8B sequence on the H200); here rows of
    ``chunk`` are scanned in parallel, then each row gets the sum of the rows before it."""
    torch = _torch()
    n = x.numel()
    if n <= chunk:
        return torch.cumsum(x, dim=0)
    y = torch.nn.functional.pad(x, (0, (-n) % chunk)).view(-1, chunk).cumsum(dim=1)
    y[1:] += y[:-1, -1].cumsum(dim=0)[:, None]
    return y.view(-1)[:n]


def _slice_sums(x, bounds):
    """Sums of x[bounds[s]:bounds[s + 1]] for each s (an empty slice sums to 0), (S,) of
    x's dtype (bool: int64 counts)."""
    torch = _torch()
    if x.dtype == torch.bool:
        x = x.to(torch.int64)
    if len(bounds) < 2:
        return torch.zeros(0, dtype=x.dtype, device=x.device)
    return torch.stack([x[a:b].sum() for a, b in zip(bounds[:-1], bounds[1:])])


def _masked_median(x, mask):
    """Per row of x (R, n): numpy's median over the entries where mask is True (NaN where
    fewer than one), and the count."""
    torch = _torch()
    k = mask.sum(dim=1)
    s = torch.where(mask, x, torch.full_like(x, float("inf"))).sort(dim=1).values
    lo = torch.clamp((k - 1) // 2, min=0)
    hi = torch.clamp(k // 2, min=0)
    a = s.gather(1, lo[:, None])[:, 0]
    b = s.gather(1, hi[:, None])[:, 0]
    return torch.where(k % 2 == 1, a, 0.5 * (a + b)), k


def _launch(name: str, blocks, args) -> None:
    """rdr_stats.cuh's kernel ``name`` on torch's current stream: ``blocks(threads)`` gives
    its grid; its arguments go through ``_kernel_args``."""
    from ._module import constants, rdr_kernel
    from .torch_ops import torch_stream
    threads = constants()["RDR_STATS_THREADS"]
    params = _kernel_args(args)
    with torch_stream():
        rdr_kernel(name)(blocks(threads), (threads,), tuple(params))


class _KernelArgs(tuple):
    """Kernel arguments with their tensors' device addresses in place of the tensors, which
    it holds (``tensors``) so that no address outlives its memory while the arguments live."""
    tensors: tuple


def _kernel_args(args) -> _KernelArgs:
    """``args`` with each torch tensor (CUDA, laid out as its kernel reads it) as its device
    address, a uint64 passed by value as a pointer parameter (as the NULL pointers elsewhere
    are), the rest (scalars, addresses taken before) as they are. A DLPack view costs the
    host tens of microseconds a tensor, an address next to nothing; the kernels run on
    torch's stream, where the caching allocator reuses freed memory only after them."""
    torch = _torch()
    out = _KernelArgs(np.uint64(a.data_ptr()) if isinstance(a, torch.Tensor) else a
                      for a in args)
    out.tensors = tuple(a for a in args if isinstance(a, torch.Tensor))
    if any(not t.is_cuda for t in out.tensors):
        raise ValueError("a device kernel's tensor arguments must be on a CUDA device")
    return out


def stored_states(pool, page, slot, tier, geom, levels, dim: int):
    """(yk, yv) (n, d) float64: the rotated, centred points of states of any tiers, read
    from the page pool (uint8 (pages, page_bytes), CUDA) at (page, slot, tier) (n,) in one
    kernel; ``DeviceKVCache.stored_rotated``'s values bit for bit. geom: the tiers' geometry
    rows (int32 (T+1, stride), ``kernel_tables``), levels: float64 (T+1, 2, RDR_LEVELS),
    each (tier, key/value) part's codebook."""
    import math
    torch = _torch()
    n = int(page.numel())
    yk = torch.empty((n, dim), dtype=torch.float64, device=pool.device)
    yv = torch.empty_like(yk)
    if n:
        long = lambda x: x.to(torch.int64).contiguous()
        _launch("skv::rdr_rotated_kernel", lambda t: ((n * dim + t - 1) // t,),
                (pool.view(torch.int32), np.int64(pool.shape[1] // 4), long(page), long(slot),
                 long(tier), geom, np.int32(geom.shape[1]), levels, np.int32(dim),
                 np.float64(1.0 / math.sqrt(dim)), np.int64(n), yk, yv))
    return yk, yv


def _softmax_prior_(z, softmax_scale: float, prior: float):
    """In place on z (R, m, n), the raw logits q·k: P = (1 − prior)·softmax(s·z) + prior/n
    along the states, the reference's order of operations. One kernel on CUDA (the scale
    applied as it reads z, so no pass of its own)."""
    torch = _torch()
    n = z.shape[2]
    if z.is_cuda and softmax_scale > 0:
        z = z.contiguous()
        _launch("skv::rdr_softmax_kernel", lambda t: (z.shape[0] * z.shape[1],),
                (z, np.int64(n), np.float64(softmax_scale), np.float64(1.0 - prior),
                 np.float64(prior / n)))
        return z
    z.mul_(softmax_scale)
    z.sub_(z.amax(dim=2, keepdim=True)).exp_()
    z.div_(z.sum(dim=2, keepdim=True))
    return z.mul_(1.0 - prior).add_(prior / n)


def _state_sums(P, G, o2, vn):
    """Per state, means over the row's queries: p2 = P², e = P²·d2 and e_evict =
    P²·d2 / max(1 − P, 1e-12)², d2 = max(‖v‖² − 2·G + ‖o‖², 0) = ‖v − o‖². P, G (R, m, n)
    with G = o·vᵀ, o2 (R, m), vn (R, n); three (R, n). One kernel on CUDA (no (R, m, n)
    temporaries)."""
    torch = _torch()
    R, m, n = P.shape
    if P.is_cuda:
        out = torch.empty((3, R, n), dtype=torch.float64, device=P.device)
        _launch("skv::rdr_state_sums_kernel", lambda t: ((n + t - 1) // t, R),
                [x.contiguous() for x in (P, G, o2, vn)]
                + [np.int32(R), np.int32(m), np.int64(n), out[0], out[1], out[2]])
        return out[0], out[1], out[2]
    dist2 = torch.clamp(vn[:, None, :] ** 2 - 2.0 * G + o2[:, :, None], min=0.0)
    w = P * P
    t = w * dist2
    return w.mean(dim=1), t.mean(dim=1), (t / torch.clamp(1.0 - P, min=1e-12) ** 2).mean(dim=1)


def row_statistics(yk, yv, qr, softmax_scale: float, prior: float, candidates=None):
    """Surrogate inputs of R rows at once: yk, yv (R, n, d) float64, the stored rotated
    centred states; qr (R, m, d) the recorded queries in the keys' rotated frame, or None;
    candidates (R, n) bool or None. Returns p, r, vn, res, kappa (R, n) and q2 (R,), the
    reference's figures row by row. The products are three batched GEMMs (logits, outputs,
    o·vᵀ); everything per (query, state) happens in two passes (``_softmax_prior_`` in place,
    ``_state_sums``), so two (R, m, n) arrays live at once."""
    torch = _torch()
    R, n, _ = yk.shape
    r = yk.norm(dim=2)
    vn = yv.norm(dim=2)
    if qr is None or qr.shape[1] == 0:
        p = torch.full((R, n), 1.0 / n, dtype=torch.float64, device=yk.device)
        res = (yv - torch.einsum("rn,rnd->rd", p, yv)[:, None, :]).norm(dim=2)
        return p, (r * r).mean(dim=1), r, vn, res, torch.ones_like(r)
    P = _softmax_prior_(torch.bmm(qr, yk.transpose(1, 2)), softmax_scale, prior)   # (R, m, n)
    o = torch.bmm(P, yv)                                                           # (R, m, d)
    p2, e, e_evict = _state_sums(P, torch.bmm(o, yv.transpose(1, 2)), (o * o).sum(dim=2), vn)
    tiny = np.finfo(float).tiny
    kappa = torch.where(e > tiny, e_evict / torch.clamp(e, min=tiny), torch.ones_like(e))
    if candidates is not None:
        kappa = kappa * _coherence(P, o, yv, e, p2, candidates)[:, None]
    p = torch.sqrt(p2)
    res = torch.sqrt(e / torch.clamp(p2, min=tiny))
    return p, (qr * qr).sum(dim=2).mean(dim=1), r, vn, res, torch.clamp(kappa, min=1.0)


def _coherence(P, o, values, e, p2, candidates):
    """``rdr.statistics.eviction_coherence`` per row (R,), with S the candidates at or below
    their median p2: Σ_S P·(o − v) as (P·1_S)·o − P·(1_S v), and the independent part
    mean_q Σ_S P²‖o − v‖² as Σ_S e (e = the per-state mean over queries), so no (R, m, n)
    array beyond P."""
    torch = _torch()
    med, k = _masked_median(p2, candidates)
    S = (candidates & (p2 <= med[:, None])).to(P.dtype)                           # (R, n)
    shift = torch.bmm(P, S[:, :, None]) * o - torch.bmm(P, values * S[:, :, None])
    coherent = (shift * shift).sum(dim=2).mean(dim=1)
    independent = (e * S).sum(dim=1)
    ratio = torch.clamp(coherent / torch.where(independent > 0, independent, torch.ones_like(independent)), min=1.0)
    return torch.where((k >= 2) & (independent > 0), ratio, torch.ones_like(ratio))


def distortion(p, q2, r, vn, res, key_error, value_error, dim: int, softmax_scale: float,
               eviction_factor, key_term: str = "lognormal"):
    """``rdr.distortion`` on (n,) tensors (q2 per state): D (n, T+1) float64."""
    torch = _torch()
    ek = upload(key_error, p.device, np.float64)
    ev = upload(value_error, p.device, np.float64)
    p2 = p * p
    res2 = res * res
    out = torch.empty((p.shape[0], ek.numel() + 1), dtype=torch.float64, device=p.device)
    out[:, 0] = eviction_factor * p2 * res2
    sigma2 = ((softmax_scale ** 2) * q2 * r * r / dim)[:, None] * ek[None, :]
    if key_term == "lognormal":
        lognormal = torch.clamp(torch.expm1(2.0 * sigma2) - 2.0 * torch.expm1(0.5 * sigma2),
                                max=DISTORTION_MAX)
        sigma2 = torch.where(2.0 * sigma2 > LOG_FLOAT_MAX,     # rdr.surrogate's cut: no inf − inf
                             torch.full_like(sigma2, DISTORTION_MAX), lognormal)
    inner = res2[:, None] * sigma2 + (vn * vn)[:, None] * ev[None, :]
    out[:, 1:] = p2[:, None] * inner.clamp_(max=DISTORTION_MAX)     # rdr.surrogate's ceiling
    return out.clamp_(max=DISTORTION_MAX)


def _hull(D, cur, c):
    """Per state, the lower convex hull in (cost, D) of its options at or below its current
    tier (never promote): keep (n, T+1) bool, its points; nxt (n, T+1) int8, each point's next
    hull point (-1 after the last); pos (n, T+1) int8, each point's rank along the hull. A
    point is kept unless an earlier one has no more distortion, or it lies on or above the
    chord of two kept points around it. One kernel on CUDA for the default ladder's T + 1
    (rdr_stats.cuh's rdr_hull_kernel, bit for bit these ops); else column-wise torch ops,
    ~60 passes over strided (n,) columns."""
    torch = _torch()
    n, T1 = D.shape
    dev = D.device
    if D.is_cuda and T1 in RDR_HULL_OPTIONS and n:
        keep = torch.empty((n, T1), dtype=torch.bool, device=dev)
        nxt = torch.empty((n, T1), dtype=torch.int8, device=dev)
        pos = torch.empty((n, T1), dtype=torch.int8, device=dev)
        _launch(f"skv::rdr_hull_kernel<{T1}>", lambda t: ((n + t - 1) // t,),
                (D.to(torch.float64).contiguous(), cur.to(torch.int64).contiguous(),
                 c.to(torch.float64).contiguous(), np.int64(n), keep, nxt, pos))
        return keep, nxt, pos
    allowed = torch.arange(T1, device=dev)[None, :] <= cur[:, None]
    big = torch.finfo(torch.float64).max
    Dm = torch.where(allowed, D, torch.full_like(D, big))
    keep = allowed.clone()
    for j in range(1, T1):
        keep[:, j] &= ~(Dm[:, :j] <= Dm[:, j:j + 1]).any(dim=1)
    for j in range(1, T1 - 1):
        for a in range(0, j):
            for b in range(j + 1, T1):
                chord = Dm[:, a] + (Dm[:, b] - Dm[:, a]) * ((c[j] - c[a]) / (c[b] - c[a]))
                on = keep[:, a] & keep[:, b] & (Dm[:, j] >= chord)
                keep[:, j] &= ~on
    # (n, T+1) tables hold tiers and ranks in the narrowest type: at 67M states (a batch of
    # 32K-token Llama-8B sequences) each int64 table would be 4.3 GB
    nxt = torch.full((n, T1), -1, dtype=torch.int8, device=dev)
    last = torch.full((n,), -1, dtype=torch.int8, device=dev)
    for j in range(T1 - 1, -1, -1):
        nxt[:, j] = last
        last = torch.where(keep[:, j], torch.full_like(last, j), last)
    # rank of each kept point along its hull (a running count over the T+1 columns: torch's
    # scan over rows this short took 86 ms at 16.8M states on an H100)
    pos = torch.empty((n, T1), dtype=torch.int8, device=dev)
    pos[:, 0] = keep[:, 0].to(torch.int8) - 1
    for j in range(1, T1):
        pos[:, j] = pos[:, j - 1] + keep[:, j].to(torch.int8)
    return keep, nxt, pos


def greedy_allocation(D, cur, protected, group, share, page_bytes: int, budget,
                      num_groups: int, segment=None):
    """Tiers (n,) int64 (device) for free states with distortion D (n, T+1), current tiers
    cur (n,), protected (n,) bool (kept at the top tier T), group ids (n,) in
    [0, num_groups), per-state byte shares share (T+1,) (share[0] = 0), within ``budget``
    bytes paged (page padding of every (group, tier) set aside). Returns (tier, objective,
    lower_bound) with the LP bound described in the module docstring; ValueError if the
    protected states alone exceed the budget.

    Several problems at once (the sequences of a batch, each with its own budget): segment
    (n,) int64 in [0, S) names each state's problem (a group lies in one), budget is then
    S budgets, and objective and lower_bound are lists of S; every problem is solved as it
    would be alone, with one sort and one bisection (of S cuts) for all of them."""
    torch = _torch()
    dev = D.device
    n, T1 = D.shape
    T = T1 - 1
    alone = segment is None
    if alone:
        segment = torch.zeros(n, dtype=torch.long, device=dev)
        budget = [budget]
    S = len(budget)
    bud = upload(budget, dev, np.float64)
    c = upload(share, dev, np.float64)
    free = ~protected
    keep, nxt, pos = _hull(D, cur, c)
    step_from = keep & (nxt >= 0) & free[:, None]
    si, sj = torch.nonzero(step_from, as_tuple=True)
    sk = nxt[si, sj].long()
    dbytes = c[sk] - c[sj]
    saved = D[si, sj] - D[si, sk]
    slope = saved / dbytes
    # bytes: protected states stay at their tiers, padding set aside
    pb = float(page_bytes)
    zeros = lambda dt=torch.float64: torch.zeros(S, dtype=dt, device=dev)
    # per-problem sums. Where each problem's states are one slice (the device cache's
    # layout) they are sums of slices; index_add_ into S bins would have every state's add
    # contend for S addresses (float64 atomics: ~50 ms per sum over 8.4M states on an H100)
    contiguous = S == 1 or bool((segment[1:] >= segment[:-1]).all())
    if contiguous:
        bounds = torch.searchsorted(segment, torch.arange(S + 1, device=dev)).tolist()
        state_sum = lambda x: _slice_sums(x, bounds)
    else:
        state_sum = lambda x: zeros(x.dtype).index_add_(0, segment, x)
    fixed = state_sum(torch.where(protected, c[cur], 0.0))
    group_seg = torch.zeros(num_groups, dtype=torch.long, device=dev).scatter_(0, group, segment)
    slack = pb * T * torch.bincount(group_seg, minlength=S).double()
    room_lp = bud - fixed
    short = torch.nonzero(room_lp < 0).squeeze(1).tolist()
    if short:
        i = short[0]
        raise ValueError(f"the protected states alone need {float(fixed[i]):.0f} bytes (at page "
                         f"shares), more than the budget of {budget[i]} bytes"
                         + ("" if alone else f" (problem {i})"))
    # slope order within each problem, the problems one after another. The increments come
    # in state order (nonzero is row-major), so where each problem's states are contiguous
    # and in order (as the device cache lays a batch out) each problem's increments are one
    # slice, sorted alone: one sort's work in all, not a global sort and a second by problem
    inc_seg = segment[si]
    if contiguous:
        m = torch.diff(torch.searchsorted(inc_seg, torch.arange(S + 1, device=dev)))
    else:
        m = torch.bincount(inc_seg, minlength=S)
    start = torch.cumsum(m, 0) - m
    inc_bounds = [0] + (start + m).tolist()        # each problem's increments, in order
    if contiguous:
        order = torch.empty_like(si)
        for a, b in zip(inc_bounds[:-1], inc_bounds[1:]):
            if b > a:
                order[a:b] = a + torch.sort(slope[a:b], descending=True, stable=True).indices
    else:
        order = torch.sort(slope, descending=True, stable=True).indices
        order = order[torch.sort(inc_seg[order], stable=True).indices]
    seg = inc_seg[order]
    cum_all = _cumsum(dbytes[order])
    before_seg = torch.where(start > 0, cum_all[(start - 1).clamp(min=0)], zeros())
    cum = cum_all - before_seg[seg]
    base_tier = torch.where(protected, cur, torch.zeros_like(cur))
    per = upload([1] + [round(pb / float(x)) for x in share[1:]], dev, np.int64)

    # a state's increments run along its hull with falling slopes, so in slope order they
    # come in hull order: after the first k increments of its problem a state has taken
    # those of rank < k
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=dev) - start[seg]
    ranks = torch.full((n, T1), order.numel(), dtype=torch.int32, device=dev)
    ranks[si, pos[si, sj].long()] = rank.to(torch.int32)
    ki, kj = torch.nonzero(keep, as_tuple=True)
    hull = torch.zeros((n, T1), dtype=torch.int8, device=dev)
    hull[ki, pos[ki, kj].long()] = kj.to(torch.int8)    # the p-th hull point's tier

    def tiers_after(k):
        """Every state's tier once the first k[s] increments of each problem s are taken."""
        reach = hull.gather(1, (ranks < k[segment][:, None]).sum(dim=1, keepdim=True))[:, 0].long()
        return torch.where(free, reach, base_tier)

    fused = D.is_cuda and T1 in RDR_HULL_OPTIONS and n
    if fused:
        long = lambda x: x.to(torch.int64).contiguous()
        fused_args = _kernel_args((ranks.contiguous(), hull.contiguous(), free.contiguous(),
                                  long(base_tier), long(group), long(segment)))

    def counts_at(k):
        """States per (group, tier) once the first k[s] increments of each problem s are
        taken: one kernel on CUDA (no host wait), else bincount of tiers_after."""
        if not fused:
            return torch.bincount(group * T1 + tiers_after(k), minlength=num_groups * T1)
        counts = torch.zeros(num_groups * T1, dtype=torch.int64, device=dev)
        _launch(f"skv::rdr_cut_counts_kernel<{T1}>", lambda t: ((n + t - 1) // t,),
                fused_args + (k.to(torch.int64).contiguous(), np.int64(n), counts))
        return counts

    def paged(k):
        """Each problem's paged bytes after its first k[s] increments (S,)."""
        counts = counts_at(k).view(num_groups, T1)
        pages = ((counts[:, 1:] + per[1:] - 1) // per[1:]).sum(dim=1)
        return zeros().index_add_(0, group_seg, pages.double()) * pb

    # per problem, the most increments whose paged bytes fit: at least those that fit with
    # every (group, tier)'s padding set aside, at most those that fit at page shares
    count = lambda mask: _slice_sums(mask, inc_bounds)     # increments in slope order, by problem
    lo = count(cum <= torch.clamp(room_lp - slack, min=0.0)[seg])
    hi = count(cum <= room_lp[seg])
    lo = torch.where(paged(lo) > bud, torch.zeros_like(lo), lo)
    # each step at least halves every problem's range, so bit_length(widest range) steps
    # end them all: one host wait for the count, none per step
    for _ in range(int((hi - lo).max()).bit_length()):
        active = lo < hi
        mid = torch.where(active, (lo + hi + 1) // 2, lo)
        fits = paged(mid) <= bud
        lo = torch.where(active & fits, mid, lo)
        hi = torch.where(active & ~fits, mid - 1, hi)
    tier = tiers_after(lo)
    objective = state_sum(D.gather(1, tier[:, None])[:, 0])
    # LP bound at the whole room: whole increments while they fit, then a fraction of the next
    within = cum <= room_lp[seg]
    base = state_sum(torch.where(free, D[:, 0], D.gather(1, cur[:, None])[:, 0]))
    got = _slice_sums(torch.where(within, saved[order], 0.0), inc_bounds)
    k = count(within)
    nxt_inc = (start + k).clamp(max=max(order.numel() - 1, 0))
    has_next = k < m
    if order.numel():
        prior = torch.where(k > 0, cum[(start + k - 1).clamp(min=0)], zeros())
        frac = (room_lp - prior) / dbytes[order[nxt_inc]]
        got = got + torch.where(has_next, frac * saved[order[nxt_inc]], zeros())
    bound = torch.minimum(base - got, objective)
    if alone:
        return tier, float(objective[0]), float(bound[0])
    return tier, objective.tolist(), bound.tolist()
