"""Decode benchmark on one GPU: ADA paged decode vs copy bandwidth, torch SDPA bf16,
FlashInfer paged decode (bf16, fp8 e4m3) and the "decompress to HBM, then attend" path.

Shapes of one Llama-3.1-8B layer (32 query heads, 8 kv-heads, d = 128). Every timing is the
median of CUDA-event timings with the L2 flushed (a 256 MiB memset) before each repetition.
Writes a list of rows (method, batch, context, tiers, codebook, us, bytes_read, gbps,
copy_gbps, speedup_vs_sdpa_bf16; on ADA rows also the decode path, the split count and the
speedups against FlashInfer bf16 and fp8 measured in the same process) as JSON, and prints a
table. ADA and encode rows are
repeated per codebook (``--codebooks``): Lloyd–Max decodes on the table path, uniform on
the affine path (cupy_kernels/csrc/ada_decode.cuh).

    PYTHONPATH=. python3 validation/decode_bench.py --out validation/results/kernels/decode_h200.json
    PYTHONPATH=. python3 validation/decode_bench.py --quality   # CPU only: codebook quality
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from validation.decode_cases import (BENCH_GEOMETRIES, BENCH_LADDER as LADDER, BENCH_TIERS as TIERS, ada_step,
                                     bench_ladder,
                                encode_inputs, encode_keys_values, encoded_pool, rdr_mix)

SHAPES = [(32, 8192), (8, 32768), (2, 131072), (1, 131072)]
# The layer's (query heads, kv-heads, head dim): one of BENCH_GEOMETRIES, set by --geometry
# before anything is built (the script's functions read these three).
HQ, HKV, D = BENCH_GEOMETRIES["llama8b"]


class Timer:
    def __init__(self, reps: int, flush: str = "write"):
        """flush: how L2 is emptied before each repetition: "write" zeroes a 256 MiB buffer
        (the usual way; its dirty lines are written back while the timed call runs), "read"
        sums it (clean lines only)."""
        import torch
        if flush not in ("write", "read"):
            raise ValueError(f"flush must be 'write' or 'read', got {flush!r}")
        self.torch = torch
        self.reps = reps
        self.flush = flush
        self.flush_buf = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    def __call__(self, fn, stream=None) -> float:
        """Median microseconds of fn() on the current torch stream."""
        torch = self.torch
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(self.reps):
            if self.flush == "write":
                self.flush_buf.zero_()
            else:
                self.flush_buf.view(torch.int64).sum()
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            times.append((a, b))
        torch.cuda.synchronize()
        return float(np.median([a.elapsed_time(b) for a, b in times]) * 1e3)


def copy_bandwidth(timer) -> float:
    """Device-to-device copy, GB/s counting bytes read + written."""
    torch = timer.torch
    n = 2 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    us = timer(lambda: dst.copy_(src))
    del src, dst
    return 2 * n / (us * 1e-6) / 1e9


def encode_bytes(lay) -> int:
    """Bytes an encode of keys and values moves: x read twice (float32), codes and scales
    written, head / page / slot indices read twice."""
    n = lay.dst_page.size
    return 2 * n * D * 4 + lay.cache_bytes + 3 * n * 4 * 2


def build_ada(batch, context, tiers_name, tables, seed=0, timer=None, order="shuffled",
              last_page_at=None):
    """Encodes random keys/values into a shuffled page pool with the encode kernel.
    Returns (state dict, (encode microseconds, encode bytes)): keys then values timed by
    ``timer`` (median of its repetitions, L2 flushed, the same bytes rewritten), or None
    without a timer. (A single launch timed right after a synchronize also counts the
    launcher's host-side work, 0.1-0.3 ms: the GPU waits for it.)"""
    from cupy_kernels.encode import raise_status
    state, encode, status = encoded_pool(batch, context, tiers_name, tables, seed, order,
                                         last_page_at, num_kv_heads=HKV)
    enc_us = timer(encode) if timer is not None else None
    raise_status(status)
    return state, (enc_us, encode_bytes(state["layout"]))


def tables_for(all_tables, tiers_name, codebook):
    """The kernel tables of a tier set's ladder (``bench_ladder``) and codebook, built once
    and kept in ``all_tables`` (keyed by (ladder, codebook))."""
    from cupy_kernels import kernel_tables
    ladder = bench_ladder(tiers_name)
    key = (tuple(ladder), codebook)
    if key not in all_tables:
        all_tables[key] = kernel_tables(ladder, D, codebook=codebook)
    return all_tables[key]


def encode_rows(shapes, tiers_list, codebooks, timer, copy_gbps, all_tables, note=None):
    """Encode-only timing: keys then values of every state of each (shape, tiers, codebook)
    into a shuffled pool (median of the timer's reps, L2 flushed)."""
    import cupy as cp
    from cupy_kernels.encode import raise_status
    rows = []
    for (batch, context), tiers_name, cb in [(s, t, c) for s in shapes for t in tiers_list
                                             for c in codebooks]:
        tables = tables_for(all_tables, tiers_name, cb)
        lay, inp = encode_inputs(batch, context, tiers_name, tables, num_kv_heads=HKV)
        nbytes = encode_bytes(lay)
        pages = cp.zeros((lay.page_tier.size, tables.page_bytes), cp.uint8)
        st = cp.zeros(1, cp.int32)
        us = timer(lambda: encode_keys_values(inp, tables, pages, st))
        raise_status(st)
        r = dict(method="ada_encode", batch=batch, context=context,
                 tiers=tiers_name, codebook=cb, us=round(us, 2), bytes_read=int(nbytes),
                 gbps=round(nbytes / (us * 1e-6) / 1e9, 1), copy_gbps=round(copy_gbps, 1),
                 pct_copy=round(100 * nbytes / (us * 1e-6) / 1e9 / copy_gbps, 1))
        if note:
            r["run"] = note
        rows.append(r)
        print(json.dumps(r), flush=True)
        del inp, pages
        cp.get_default_memory_pool().free_all_blocks()
    return rows


def decompress_path(state, tables, tiers_name, batch, context, q_t):
    """Reference path: unpack codes to dense bf16 K, V in HBM (torch ops), then SDPA."""
    import cupy as cp
    import torch
    import torch.nn.functional as F
    bits = LADDER[TIERS[tiers_name] - 1][0]
    lay = state["layout"]
    g = tables.geom[TIERS[tiers_name]]
    kw, vw, voff, ksoff, vsoff = int(g[3]), int(g[4]), int(g[5]), int(g[6]), int(g[7])
    words = state["pages"].view(cp.uint32)
    dpg, dsl = cp.asarray(lay.dst_page), cp.asarray(lay.dst_slot)
    kc = words[dpg[:, None], dsl[:, None] * kw + cp.arange(kw)[None, :]]
    vc = words[dpg[:, None], voff + dsl[:, None] * vw + cp.arange(vw)[None, :]]
    half = state["pages"].view(cp.float16)
    ks = half[dpg, ksoff // 2 + dsl]
    vs = half[dpg, vsoff // 2 + dsl]
    kc, vc, ks, vs = (torch.from_dlpack(a) for a in (kc, vc, ks, vs))
    levels = torch.tensor(tables.levels64[0 if bits == 2 else (2 if bits == 3 else 3), :2 ** bits],
                          dtype=torch.float32, device="cuda")
    h = torch.tensor(_hadamard(D), dtype=torch.float32, device="cuda")
    sk = torch.from_dlpack(state["sigma_k"])
    sv = torch.from_dlpack(state["sigma_v"])
    shifts2 = torch.arange(16, device="cuda", dtype=torch.int32) * 2
    shifts1 = torch.arange(32, device="cuda", dtype=torch.int32)
    shifts4 = torch.arange(8, device="cuda", dtype=torch.int32) * 4

    def unpack(words_t):
        w = words_t.view(torch.int32)
        if bits == 4:
            return ((w[:, :, None] >> shifts4) & 15).reshape(w.shape[0], D)
        if bits == 2:
            return ((w[:, :, None] >> shifts2) & 3).reshape(w.shape[0], D)
        lo = ((w[:, :D // 16, None] >> shifts2) & 3).reshape(w.shape[0], D)
        hi = ((w[:, D // 16:, None] >> shifts1) & 1).reshape(w.shape[0], D)
        return lo | (hi << 2)

    def dense(words_t, scale, sigma):
        y = levels[unpack(words_t).long()] * (scale.float()[:, None] / math.sqrt(D))
        x = (y @ h) * (1.0 / math.sqrt(D))
        x = x.view(batch, HKV, context, D) * sigma[None, :, None, :]
        return x.to(torch.bfloat16)

    def run():
        k = dense(kc, ks, sk)
        v = dense(vc, vs, sv)
        return F.scaled_dot_product_attention(q_t, k, v, enable_gqa=True)
    return run


def _hadamard(n):
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def flashinfer_runner(batch, context, dtype_name):
    import torch
    import flashinfer
    page = 16
    pps = context // page
    total = batch * pps
    kv = torch.randn(total, 2, page, HKV, D, dtype=torch.bfloat16, device="cuda")
    kv_dtype = torch.bfloat16
    if dtype_name == "fp8":
        kv = kv.to(torch.float8_e4m3fn)
        kv_dtype = torch.float8_e4m3fn
    indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * pps
    indices = torch.randperm(total, device="cuda").to(torch.int32)
    last = torch.full((batch,), page, dtype=torch.int32, device="cuda")
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    w.plan(indptr, indices, last, HQ, HKV, D, page, pos_encoding_mode="NONE",
           q_data_type=torch.bfloat16, kv_data_type=kv_dtype)
    q = torch.randn(batch, HQ, D, dtype=torch.bfloat16, device="cuda")
    nbytes = kv.numel() * kv.element_size() + q.numel() * 2 + (indices.numel() + 2 * batch + 1) * 4
    return (lambda: w.run(q, kv)), nbytes


def quality_table(n: int = 2048, m: int = 32, seed: int = 0):
    """CPU, float64 reference: relative attention-output error ||o_hat - o|| / ||o|| (mean
    over m query heads) of the uniform and the Lloyd–Max codebooks at 2/3/4 bits, keys and
    values at the same bits (same bytes per state for both codebooks), on
    * random: Gaussian keys, values and queries (n states, d = 128);
    * spiky: heavy-tailed keys and values (Student t, 3 degrees of freedom) with 4 outlier
      channels x8, and queries equal to noisy copies of 8 keys, so that attention is peaked."""
    from spherical_kv_ref import SphericalCodec
    from spherical_kv_ref.ada import mixed_tier_attention
    rng = np.random.default_rng(seed)
    d = D
    data = {}
    k = rng.normal(size=(n, d)); v = rng.normal(size=(n, d)); q = rng.normal(size=(m, d))
    data["random"] = (q, k, v)
    k = rng.standard_t(3, size=(n, d)); v = rng.standard_t(3, size=(n, d))
    out_ch = rng.choice(d, 4, replace=False)
    k[:, out_ch] *= 8.0; v[:, out_ch] *= 8.0
    q = 3.0 * k[rng.choice(n, m)] + rng.normal(scale=0.5, size=(m, d))
    data["spiky"] = (q, k, v)
    rows = []
    for name, (q, k, v) in data.items():
        sc = 1.0 / np.sqrt(d)
        z = sc * q @ k.T
        p = np.exp(z - z.max(1, keepdims=True)); p /= p.sum(1, keepdims=True)
        exact = p @ v
        for bits in (2, 3, 4):
            for kind in ("lloyd-max", "uniform"):
                kc = SphericalCodec(d, bits, seed=seed, salt=0, codebook=kind)
                vc = SphericalCodec(d, bits, seed=seed, salt=1, codebook=kind)
                got = mixed_tier_attention(q, [(kc.encode(k), vc.encode(v), kc, vc)])
                err = np.linalg.norm(got - exact, axis=1) / np.linalg.norm(exact, axis=1)
                rows.append(dict(data=name, bits=bits, codebook=kind,
                                 rel_err_mean=float(err.mean()), rel_err_max=float(err.max())))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="validation/results/kernels/decode_h200.json")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shapes", default="all", help="'all' or e.g. 32x8192,1x131072")
    ap.add_argument("--tiers", default="4/4,3/3,2/2,rdr-mix",
                    help="tier sets: 4/4, 3/3, 2/2, rdr-mix, or 8/4 (the plugin's default, its own ladder)")
    ap.add_argument("--flashinfer", action="store_true")
    ap.add_argument("--codebooks", default="lloyd-max,uniform")
    ap.add_argument("--encode-only", action="store_true",
                    help="time only the encode kernel; no decode")
    ap.add_argument("--run-note", default=None, help="a label stored in every encode row")
    ap.add_argument("--geometry", default="llama8b", choices=sorted(BENCH_GEOMETRIES),
                    help="the layer's heads and head dim (validation.decode_cases.BENCH_GEOMETRIES)")
    ap.add_argument("--quality", action="store_true",
                    help="CPU only: attention error of the codebooks (no GPU, no timing)")
    args = ap.parse_args(argv)
    if args.quality:
        for r in quality_table():
            print(json.dumps(r))
        return 0
    global HQ, HKV, D
    HQ, HKV, D = BENCH_GEOMETRIES[args.geometry]
    import cupy as cp
    import torch
    import torch.nn.functional as F
    from cupy_kernels.ada_decode import decode_path

    shapes = SHAPES if args.shapes == "all" else [tuple(int(v) for v in s.split("x"))
                                                  for s in args.shapes.split(",")]
    tiers_list = [t for t in args.tiers.split(",") if t]
    timer = Timer(args.reps)
    copy_gbps = copy_bandwidth(timer)
    print(f"copy bandwidth (read + write): {copy_gbps:.0f} GB/s", flush=True)
    codebooks = [c for c in args.codebooks.split(",") if c]
    all_tables = {}                  # (ladder, codebook) -> kernel tables, built on first use
    if args.encode_only:
        rows = encode_rows(shapes, tiers_list, codebooks, timer, copy_gbps, all_tables,
                           note=args.run_note)
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
        return 0
    rows = []
    for batch, context in shapes:
        torch.manual_seed(0)
        q_t = torch.randn(batch, HQ, 1, D, dtype=torch.bfloat16, device="cuda")
        k = torch.randn(batch, HKV, context, D, dtype=torch.bfloat16, device="cuda")
        v = torch.randn_like(k)
        sdpa_bytes = 2 * k.numel() * 2 + q_t.numel() * 2 + batch * HQ * D * 2
        sdpa_us = timer(lambda: F.scaled_dot_product_attention(q_t, k, v, enable_gqa=True))
        del k, v

        fi_us = {}   # FlashInfer times of this shape, this process

        def row(method, tiers, us, nbytes, codebook=None):
            r = dict(method=method, batch=batch, context=context, tiers=tiers,
                     geometry=args.geometry, heads=[HQ, HKV, D],
                     codebook=codebook, us=round(us, 2),
                     bytes_read=int(nbytes), gbps=round(nbytes / (us * 1e-6) / 1e9, 1),
                     copy_gbps=round(copy_gbps, 1),
                     speedup_vs_sdpa_bf16=round(sdpa_us / us, 3))
            if method == "ada":
                for name, t in fi_us.items():
                    r[f"speedup_vs_flashinfer_{name}"] = round(t / us, 3)
            rows.append(r)
            print(json.dumps(r), flush=True)

        row("sdpa_bf16", "bf16", sdpa_us, sdpa_bytes)
        if args.flashinfer:
            for name in ("bf16", "fp8"):
                try:
                    t0 = time.time()
                    fn, nb = flashinfer_runner(batch, context, name)
                    fn()
                    torch.cuda.synchronize()
                    print(f"flashinfer {name} ready in {time.time() - t0:.1f} s", flush=True)
                    fi_us[name] = timer(fn)
                    row(f"flashinfer_{name}", "bf16" if name == "bf16" else "fp8_e4m3", fi_us[name], nb)
                    del fn
                except Exception as e:  # report, never hide: the row says why it is missing
                    print(f"flashinfer {name} unavailable: {type(e).__name__}: {e}"[:400], flush=True)
                    rows.append(dict(method=f"flashinfer_{name}", batch=batch,
                                     context=context,
                                     tiers=name, us=None, bytes_read=None, gbps=None,
                                     copy_gbps=round(copy_gbps, 1), speedup_vs_sdpa_bf16=None,
                                     error=f"{type(e).__name__}: {e}"[:300]))
        q_c = cp.from_dlpack(q_t[:, :, 0, :].float().contiguous())
        for tiers_name, cb in [(t, c) for t in tiers_list for c in codebooks]:
            tables = tables_for(all_tables, tiers_name, cb)
            state, (enc_us, enc_bytes) = build_ada(batch, context, tiers_name, tables, timer=timer)
            lay = state["layout"]
            row("ada_encode", tiers_name, enc_us, enc_bytes, cb)
            run, out, splits = ada_step(state, tables, q_c, batch)
            meta = (lay.indptr.size + 3 * lay.indices.size) * 4
            nbytes = lay.cache_bytes + q_c.size * 4 + meta + out.size * 4
            us = timer(run)
            row("ada", tiers_name, us, nbytes, cb)
            rows[-1]["path"] = decode_path(tables).name
            rows[-1]["splits"] = splits
            rows[-1]["cache_bytes"] = lay.cache_bytes
            rows[-1]["default"] = True   # the one kernel of the path (plot_decode reads it)
            del run
            if tiers_name in TIERS and cb == codebooks[0]:
                try:
                    fn = decompress_path(state, tables, tiers_name, batch, context, q_t)
                    row("decompress_then_sdpa", tiers_name, timer(fn), lay.cache_bytes + sdpa_bytes, cb)
                    del fn
                except Exception as e:
                    print(f"decompress path failed: {type(e).__name__}: {e}"[:300], flush=True)
            del state, out
            with open(args.out, "w") as f:   # rows so far survive a stage time limit
                json.dump(rows, f, indent=1)
            cp.get_default_memory_pool().free_all_blocks()
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    print()
    print(f"{'method':24s} {'B':>3s} {'ctx':>7s} {'tiers':>9s} {'codebook':>12s} {'us':>9s} "
          f"{'GB/s':>7s} {'%copy':>6s} {'x sdpa':>7s} {'x fi16':>7s} {'x fi8':>7s}")
    for r in rows:
        cb = r.get("codebook") or "-"
        if r["us"] is None:
            print(f"{r['method']:24s} {r['batch']:3d} {r['context']:7d} {r['tiers']:>9s} {cb:>12s}  unavailable")
            continue
        print(f"{r['method']:24s} {r['batch']:3d} {r['context']:7d} {r['tiers']:>9s} {cb:>12s} "
              f"{r['us']:9.1f} {r['gbps']:7.0f} {100 * r['gbps'] / r['copy_gbps']:6.1f} "
              f"{r['speedup_vs_sdpa_bf16']:7.2f} {r.get('speedup_vs_flashinfer_bf16') or 0:7.2f} "
              f"{r.get('speedup_vs_flashinfer_fp8') or 0:7.2f}")
    from validation.plot_decode import plot
    png = Path(args.out).with_suffix(".png")
    plot(rows, png)
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
