"""Where ``DeviceKVCache.compress`` spends its time: a cache of the Llama-3.1-8B shape (32
layers, 8 kv-heads, d 128) holding ``--batch`` sequences of ``--context`` random states at the
top tier of the default ladder, 32 observed queries per layer, then RDR to ``--fraction`` of
the bf16 bytes with the device solver, one sequence after another (``--together``: in one
``compress_all``), under torch's profiler.
Prints the parts' seconds (wall, and the GPU's busy time inside each) and the ops that take the most
CUDA and host time.

    PYTHONPATH=. python3 lab/profile_compress.py --batch 8 --context 32768
"""
from __future__ import annotations

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--fraction", type=float, default=0.2)
    ap.add_argument("--rows", type=int, default=30, help="ops printed per table")
    ap.add_argument("--syncs", type=int, default=0, metavar="K",
                    help="also list the K source lines of the compress path that make the host "
                         "wait for the GPU most often (torch's sync debug mode, one unprofiled "
                         "compress)")
    ap.add_argument("--host", type=int, default=0, metavar="K",
                    help="also list the K Python functions with the most host time in one "
                         "unprofiled compress (cProfile: a torch op's own time there is its "
                         "launch, or its wait where it reads the GPU's results)")
    ap.add_argument("--together", action="store_true",
                    help="the profiled sequences in one compress_all (the batched decision)")
    args = ap.parse_args()
    import torch
    from cupy_kernels.device_cache import DeviceKVCache
    from spherical_kv_ref.tiers import TierLadder
    L, H, Hq, d = 32, 8, 32, 128
    ladder = TierLadder()
    per = ladder.states_per_page(ladder.top, d, 4096)
    pages = int(args.batch * L * H * (-(-(args.context + 64) // per)) * 1.35)
    cache = DeviceKVCache(L, H, d, ladder, pool_bytes=pages * 4096, num_q_heads=Hq,
                          codebook="uniform")
    g = torch.Generator(device="cuda").manual_seed(2)
    fill = lambda: filled(cache, L, H, Hq, d, args.context, g)
    seqs = [fill() for _ in range(args.batch)]
    cache.compress(seqs[0], budget_fraction=args.fraction, method="device")   # warm-up
    cache.compress_seconds.clear()
    t0 = time.perf_counter()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        if args.together:
            cache.compress_all(seqs[1:], budget_fraction=args.fraction, method="device")
        else:
            for s in seqs[1:]:
                cache.compress(s, budget_fraction=args.fraction, method="device")
        torch.cuda.synchronize()
    took = time.perf_counter() - t0
    n = len(seqs) - 1
    print(f"{n} sequences of {L * H * args.context} states{' together' if args.together else ''}: "
          f"{took:.2f} s (profiled), parts "
          + ", ".join(f"{k} {v:.2f} s" for k, v in cache.compress_seconds.items()))
    table = prof.key_averages()
    busy = part_busy(prof.events(), n)
    print(table.table(sort_by="self_cuda_time_total", row_limit=args.rows))
    print(table.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    cache.compress_seconds.clear()
    extra = fill()
    t0 = time.perf_counter()
    cache.compress(extra, budget_fraction=args.fraction, method="device")
    torch.cuda.synchronize()
    print(f"one sequence unprofiled: {time.perf_counter() - t0:.3f} s, parts "
          + ", ".join(f"{k} {v:.3f} s" for k, v in cache.compress_seconds.items()))
    print("one sequence: part, unprofiled wall s, GPU busy s (the profiled run's kernels, per "
          "sequence), the share of the wall the GPU waits for the host")
    for name, wall in cache.compress_seconds.items():
        if name in busy:
            idle = 1 - busy[name] / max(wall, 1e-9)
            print(f"  {name:12s} {wall:7.3f}  {busy[name]:7.3f}  {idle:6.1%}")
    if args.syncs:
        print_sync_sites(cache, fill(), args)
    if args.host:
        print_host_time(cache, fill(), args)


def filled(cache, L, H, Hq, d, context, g):
    """A new sequence of ``context`` random top-tier states per row and 32 observed queries
    per layer."""
    import torch
    s = cache.new_sequence()
    for layer in range(L):
        k = torch.randn((H, context, d), device="cuda", generator=g)
        cache.append(s, layer, k, torch.randn((H, context, d), device="cuda", generator=g))
        cache.observe(s, layer, torch.randn((32, Hq, d), device="cuda", generator=g))
    torch.cuda.synchronize()
    return s


def part_busy(events, n: int) -> dict:
    """Per part of the profiled compress (compress_all's named ranges), the GPU seconds of the
    kernels and copies launched inside it, per sequence (n sequences profiled). The profiler
    slows the host, not the kernels, so this compares with an unprofiled wall."""
    from torch.autograd import DeviceType
    out, every = {}, 0.0
    for e in events:
        if e.device_type == DeviceType.CPU:
            if e.name.startswith("compress."):
                name = e.name.split(".", 1)[1]
                out[name] = out.get(name, 0.0) + e.device_time_total / 1e6 / max(n, 1)
        elif not getattr(e, "is_user_annotation", False):
            every += e.device_time_total / 1e6 / max(n, 1)
    # a kernel the profiler could not tie to the range that launched it counts in no part
    print(f"GPU time per sequence: {every:.3f} s in all, {sum(out.values()):.3f} s inside "
          f"the parts' ranges")
    return out


def print_host_time(cache, s, args) -> None:
    """cProfile of one unprofiled compress of sequence s: the functions with the most own
    host time (a torch op's is its launch, or its wait for the GPU)."""
    import cProfile
    import io
    import pstats
    import torch
    pr = cProfile.Profile()
    pr.enable()
    cache.compress(s, budget_fraction=args.fraction, method="device")
    torch.cuda.synchronize()
    pr.disable()
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(args.host)
    print(out.getvalue())


def print_sync_sites(cache, s, args) -> None:
    """A compress of sequence s with torch's sync debug mode on: every host wait for the GPU
    (synchronize, a copy to or from pageable host memory, nonzero, .item()) warns, and the
    warnings are counted by the project's source line that made them."""
    import collections
    import warnings
    import torch
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            cache.compress(s, budget_fraction=args.fraction, method="device")
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sites = collections.Counter(f"{w.filename.rsplit('/', 2)[-1]}:{w.lineno}" for w in caught
                                if "synchroniz" in str(w.message))
    print(f"host waits in one compress: {sum(sites.values())}, at {len(sites)} lines; the most "
          f"frequent:")
    for site, n in sites.most_common(args.syncs):
        print(f"  {n:5d}  {site}")


if __name__ == "__main__":
    main()
