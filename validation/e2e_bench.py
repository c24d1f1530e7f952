"""End-to-end decode throughput on one GPU: a Llama-3.1-8B-shaped model whose whole decode
step runs as one CUDA graph, over (a) a dense bf16 cache with torch SDPA, (b) FlashInfer's
paged decode over bf16 and fp8 pages (``flashinfer-bf16``, ``flashinfer-fp8``), (c) the device
cache at 4/4 (uniform codebook) and (d) RDR at a fraction of the bf16 bytes after a real
prefill (docs/PERF_NOTES.md, "End to end").

The weights are random bf16: decode throughput does not depend on their values (the same
matrices are read and multiplied whatever they hold), and neither does a cache's speed
depend on what its states hold, so (a) and (c) fill their caches with random states; (d)
prefills the model (sdpa, through ``DeviceSphericalCache``) so that RDR decides from the
states and queries the model makes. One process, one GPU; each row: tokens/s, ms per step
(median of CUDA-event timings of graph replays), resident KV bytes per token (pages, page
metadata, page tables and means counted; dense: its static buffers), prefill and compress
seconds where they ran.

    python -m validation.e2e_bench --out e2e_h200.json [--shapes 32x8192,8x32768,2x131072,1x131072]
        [--methods dense,ada44,rdr] [--equal-memory] [--plot e2e_h200.png]
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

# Llama-3.1-8B's published configuration (its config.json)
LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                  high_freq_factor=4.0, original_max_position_embeddings=8192),
                tie_word_embeddings=False)
GIB = 1 << 30


def build_model(layers: int | None = None):
    import torch
    import transformers
    cfg = dict(LLAMA_8B)
    if layers:
        cfg["num_hidden_layers"] = layers
    config = transformers.LlamaConfig(**cfg)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    return model


class Step:
    """One decode step of the model over a cache, written from the model's own modules so
    that attention is the only part that differs between methods."""

    def __init__(self, model, batch: int, attend):
        import torch
        self.m = model.model
        self.head = model.lm_head
        self.attend = attend
        cfg = model.config
        self.Hq, self.H, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.ids = torch.zeros((batch, 1), dtype=torch.long, device="cuda")
        self.pos = torch.zeros((batch, 1), dtype=torch.long, device="cuda")

    def __call__(self):
        import torch
        x = self.m.embed_tokens(self.ids)
        cos, sin = self.m.rotary_emb(x, self.pos)
        B = x.shape[0]
        for i, layer in enumerate(self.m.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = a.q_proj(h).view(B, 1, self.Hq, self.d).transpose(1, 2)
            k = a.k_proj(h).view(B, 1, self.H, self.d).transpose(1, 2)
            v = a.v_proj(h).view(B, 1, self.H, self.d).transpose(1, 2)
            c, s = cos[:, None], sin[:, None]
            q = q * c + _rotate_half(q) * s
            k = k * c + _rotate_half(k) * s
            o = self.attend(i, q[:, :, 0], k[:, :, 0], v[:, :, 0])        # (B, Hq, d)
            x = x + a.o_proj(o.to(x.dtype).reshape(B, 1, self.Hq * self.d))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        logits = self.head(self.m.norm(x))
        return torch.argmax(logits[:, -1], dim=-1)


def _rotate_half(x):
    import torch
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def dense_bytes_per_token(cfg) -> int:
    """bf16 keys and values of every layer and kv-head."""
    return 2 * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim


class Dense:
    """bf16 K/V buffers (L, B, H, context + steps, d) and SDPA over all of them (no mask, so
    torch picks its flash kernel; a static cache reads its whole buffer too, and a mask would
    only slow it): each step reads context + steps positions, at most ``steps`` more than the
    context, the write of the step's token included."""

    def __init__(self, model, batch, context, steps):
        import torch
        cfg = model.config
        L, H, d = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
        n = context + steps
        g = torch.Generator(device="cuda").manual_seed(1)
        self.k = torch.randn((L, batch, H, n, d), device="cuda", dtype=torch.bfloat16, generator=g)
        self.v = torch.randn((L, batch, H, n, d), device="cuda", dtype=torch.bfloat16, generator=g)
        self.at = torch.zeros(1, dtype=torch.long, device="cuda")
        self.context, self.n = context, n
        self.scale = cfg.head_dim ** -0.5
        self.bytes_per_token = dense_bytes_per_token(cfg)

    def set_step(self, i):
        self.at.fill_(self.context + i)

    form = "rows"

    def __call__(self, layer, q, k, v):
        import torch
        self.k[layer].index_copy_(2, self.at, k[:, :, None])
        self.v[layer].index_copy_(2, self.at, v[:, :, None])
        B, Hq, d = q.shape
        H = k.shape[1]
        if self.form == "rows":
            # GQA decode: a kv-head's G query heads are G query rows over its one K/V read
            o = torch.nn.functional.scaled_dot_product_attention(
                q.view(B, H, Hq // H, d), self.k[layer], self.v[layer], scale=self.scale)
            return o.reshape(B, Hq, d)
        o = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, None], self.k[layer], self.v[layer], scale=self.scale, enable_gqa=True)
        return o[:, :, 0]


class FlashInfer:
    """FlashInfer's paged decode (``BatchDecodeWithPagedKVCacheWrapper``, NHD pages of 16
    tokens) over bf16 or fp8 e4m3 K/V, one pool per layer, every layer read through one page
    table, as engines run it: in the graph the step's token is written into its page slot by
    index (cast to the pool's type) and the wrapper's ``run`` reads the pages; outside it,
    per step, the wrapper's ``plan`` (page table and last-page lengths into the fixed
    buffers of its CUDA-graph mode). Random states, as the dense row's."""

    page = 16

    def __init__(self, model, batch, context, steps, dtype_name):
        import torch
        import flashinfer
        cfg = model.config
        L, H, d = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
        self.Hq, self.H, self.d, self.batch, self.context = cfg.num_attention_heads, H, d, batch, context
        self.dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float8_e4m3fn
        self.pps = -(-(context + steps) // self.page)          # pages per sequence, every step's
        total = batch * self.pps
        g = torch.Generator(device="cuda").manual_seed(1)
        self.kv = [torch.randn((total, 2, self.page, H, d), device="cuda", dtype=torch.bfloat16,
                               generator=g).to(self.dtype) for _ in range(L)]
        self.order = torch.randperm(total, generator=torch.Generator().manual_seed(1)).to(torch.int32)
        self.indptr = torch.zeros(batch + 1, dtype=torch.int32, device="cuda")
        self.indices = torch.zeros(total, dtype=torch.int32, device="cuda")
        self.last = torch.zeros(batch, dtype=torch.int32, device="cuda")
        self.tok_page = torch.zeros(batch, dtype=torch.long, device="cuda")
        self.tok_slot = torch.zeros(batch, dtype=torch.long, device="cuda")
        ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        self.w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            ws, "NHD", use_cuda_graph=True, use_tensor_cores=True, paged_kv_indptr_buffer=self.indptr,
            paged_kv_indices_buffer=self.indices, paged_kv_last_page_len_buffer=self.last)
        elem = self.kv[0].element_size()
        self.bytes_per_token = (2 * L * H * d * elem * self.pps * self.page / context
                                + 4 * (self.pps + 2) / context)          # pages + page table
        self.set_step(0)

    def set_step(self, i):
        import torch
        pos = self.context + i                      # the step's token
        n = pos // self.page + 1                    # pages each sequence reads
        table = self.order.view(self.batch, self.pps)[:, :n]
        indptr = torch.arange(self.batch + 1, dtype=torch.int32) * n
        last = torch.full((self.batch,), pos % self.page + 1, dtype=torch.int32)
        self.w.plan(indptr, table.reshape(-1).contiguous(), last, self.Hq, self.H, self.d, self.page,
                    pos_encoding_mode="NONE", q_data_type=torch.bfloat16, kv_data_type=self.dtype)
        self.tok_page.copy_(table[:, -1].long())
        self.tok_slot.fill_(pos % self.page)

    def __call__(self, layer, q, k, v):
        import torch
        kv = self.kv[layer]
        raw = kv.view(torch.uint8)           # index_put_ on bytes: no float8 kernel needed
        raw[self.tok_page, 0, self.tok_slot] = k.to(self.dtype).view(torch.uint8)
        raw[self.tok_page, 1, self.tok_slot] = v.to(self.dtype).view(torch.uint8)
        return self.w.run(q.contiguous(), kv)


class Ada:
    """The device cache's DecodeStep in the engine's order: append the token, then decode
    (the token reads itself from its code, as vLLM reads a quantized cache)."""

    def __init__(self, cache, seqs, steps):
        self.cache, self.step = cache, cache.decode_step(seqs, steps)

    def set_step(self, i):
        self.step.set_step(i)

    def __call__(self, layer, q, k, v):
        if layer == 0:
            self.step.slots()
        self.step.append(layer, k, v)
        return self.step.decode(layer, q)


def fill_ada(model, batch, context, ladder=None):
    """A 4/4 device cache holding ``context`` random states per row of ``batch`` sequences."""
    import torch
    from cupy_kernels.device_cache import DeviceKVCache
    from spherical_kv_ref.tiers import TierLadder
    cfg = model.config
    L, H, d = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    ladder = ladder or TierLadder([(4, 4)])
    per = ladder.states_per_page(ladder.top, d, 4096)
    pages = batch * L * H * (-(-(context + 64) // per)) + 16
    cache = DeviceKVCache(L, H, d, ladder, pool_bytes=pages * 4096, num_q_heads=cfg.num_attention_heads,
                          codebook="uniform")
    g = torch.Generator(device="cuda").manual_seed(2)
    seqs = []
    for _ in range(batch):
        s = cache.new_sequence()
        for layer in range(L):
            k = torch.randn((H, context, d), device="cuda", generator=g)
            v = torch.randn((H, context, d), device="cuda", generator=g)
            cache.append(s, layer, k, v)
        seqs.append(s)
    return cache, seqs


def time_graph(step, method, steps, reps):
    """Captures the step once, replays it ``reps`` times (step index i each), returns the
    median ms per step from CUDA events."""
    import torch
    method.set_step(0)
    for _ in range(2):                   # warm-up: kernels compiled and loaded
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    times = []
    for i in range(reps):
        method.set_step(i % steps)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    del graph
    return float(np.median(times[3:]))


def rdr_cache(model, batch, context, fraction, solver="device", each=True):
    """A real prefill of ``batch`` random-token sequences through ``DeviceSphericalCache``
    (one at a time, after a warm-up), then RDR to ``fraction`` of the bf16 bytes: (cache,
    seqs, prefill s, compress s, warm-up s, reports). ``each``: every sequence is compressed
    right after its own prefill (what a server admitting requests one by one does), so the
    pool holds one sequence at the top tier and the others at the budget; otherwise the whole
    batch is prefilled first and compressed in one ``compress_all``, which needs the batch at
    the top tier at once (more than an 80 GB card holds at (8, 32K) for Llama-8B)."""
    import torch
    from cupy_kernels.hf_device import DeviceSphericalCache
    from spherical_kv_ref.tiers import TierLadder
    cfg = model.config
    L, H, d = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    ladder = TierLadder()
    per = ladder.states_per_page(ladder.top, d, 4096)
    per_seq = L * H * (-(-(context + 64) // per)) * 4096
    # each: one sequence at the top tier, the others at the budget (with room for the page
    # padding of the ladder's tiers and the protected states)
    held = 1 + (batch - 1) * min(1.0, fraction + 0.1) if each else batch
    dc = DeviceSphericalCache(cfg, budget_fraction=fraction, pool_bytes=int(held * per_seq * 1.3),
                              codebook="uniform", compress_method=solver)
    g = torch.Generator(device="cuda").manual_seed(3)
    prefill = compress = 0.0
    with dc.bound(model), torch.no_grad():
        # the warm-up a server makes at start: one short prefill and its compress, so that
        # the kernels' first loads and the solver's first calls are not in the timed figures
        # (its time is reported apart, as warmup_s)
        t0 = time.perf_counter()
        model(torch.randint(0, cfg.vocab_size, (1, 2048), device="cuda", generator=g),
              past_key_values=dc, logits_to_keep=1)
        dc._compress()
        torch.cuda.synchronize()
        warmup = time.perf_counter() - t0
        dc.kv.free(dc.seqs[0])
        dc.seqs, dc.reports = [], []
        dc.kv.compress_seconds.clear()
        for b in range(batch):
            ids = torch.randint(0, cfg.vocab_size, (1, context), device="cuda", generator=g)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            sid = dc.kv.new_sequence()
            every = dc.seqs
            dc.seqs, dc.seen = [sid], 0
            model(ids, past_key_values=dc, logits_to_keep=1)
            dc.seqs = every + [sid]
            torch.cuda.synchronize()
            prefill += time.perf_counter() - t0
            if each or b == batch - 1:
                # the sequence just prefilled, or (not each) the whole batch after the last
                t0 = time.perf_counter()
                dc._compress(dc.seqs[-1:] if each else None)
                torch.cuda.synchronize()
                compress += time.perf_counter() - t0
    dc.decoding = True
    return dc.kv, dc.seqs, prefill, compress, warmup, dc.reports


def kv_bytes_per_token(cache, seqs, context):
    held = sum(cache.bytes_in_use(s) + cache.metadata_bytes(s) for s in seqs)
    return held / (len(seqs) * context)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file the rows are written to")
    p.add_argument("--shapes", default="32x8192,8x32768,2x131072,1x131072",
                   help="(batch)x(context) pairs, comma separated")
    p.add_argument("--methods", default="dense,ada44,rdr,rdr-host",
                   help="dense, ada44, rdr (device solver), rdr-host (the host's fast solver), "
                        "flashinfer-bf16, flashinfer-fp8 (where the flashinfer package imports)")
    p.add_argument("--rdr-shapes", default="32x8192,8x32768,2x131072,1x131072",
                   help="shapes RDR (device solver) runs at (the prefill is real)")
    p.add_argument("--rdr-host-shapes", default="1x32768",
                   help="shapes 'rdr-host' (the host's fast solver) runs at")
    p.add_argument("--rdr-fraction", type=float, default=0.2, help="RDR's budget, fraction of bf16 bytes")
    p.add_argument("--rdr-batch-compress", action="store_true",
                   help="RDR: prefill the whole batch, then compress it in one call (the pool "
                        "holds the batch at the top tier); default: each sequence right after "
                        "its own prefill")
    p.add_argument("--equal-memory", action="store_true",
                   help="also dense and 4/4 at 32K at the largest batch that fits --memory-gib")
    p.add_argument("--memory-gib", type=float, default=120.0, help="GPU memory for weights + KV")
    p.add_argument("--steps", type=int, default=32, help="planned decode steps (replayed in turn)")
    p.add_argument("--reps", type=int, default=30, help="timed graph replays per row")
    p.add_argument("--layers", type=int, default=None, help="fewer layers (a quick check)")
    p.add_argument("--plot", default=None, help="PNG of tokens/s against KV bytes per token")
    p.add_argument("--replot", action="store_true",
                   help="only redraw --plot from the rows already in --out (no GPU needed)")
    args = p.parse_args(argv)
    if args.replot:
        if not args.plot:
            p.error("--replot needs --plot")
        with open(args.out) as f:
            plot(json.load(f)["rows"], args.plot)
        return 0
    import torch
    torch.set_grad_enabled(False)
    model = build_model(args.layers)
    weights = sum(t.numel() * t.element_size() for t in model.parameters())
    rows = []
    methods = args.methods.split(",")

    def record(row):
        row.update(tokens_per_s=row["batch"] / (row["ms_per_step"] / 1e3), weights_bytes=weights,
                   gpu=torch.cuda.get_device_name(), random_weights=True)
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "config": LLAMA_8B, "note": "random bf16 weights: decode "
                       "throughput does not depend on their values"}, f, indent=1)

    def run(method_name, batch, context, equal_memory=False):
        import gc
        gc.collect()
        torch.cuda.empty_cache()
        extra = {}
        if method_name == "dense":
            meth = Dense(model, batch, context, args.steps)
            bpt = meth.bytes_per_token
        elif method_name.startswith("flashinfer"):
            meth = FlashInfer(model, batch, context, args.steps, method_name.split("-")[1])
            bpt = meth.bytes_per_token
        elif method_name == "ada44":
            cache, seqs = fill_ada(model, batch, context)
            meth = Ada(cache, seqs, args.steps)
            bpt = kv_bytes_per_token(cache, seqs, context)
        else:
            solver = "fast" if method_name == "rdr-host" else "device"
            each = not args.rdr_batch_compress
            cache, seqs, pre, comp, warm, reports = rdr_cache(
                model, batch, context, args.rdr_fraction, solver, each=each)
            meth = Ada(cache, seqs, args.steps)
            bpt = kv_bytes_per_token(cache, seqs, context)
            parts = getattr(cache, "compress_seconds", {})
            extra = dict(prefill_s=pre, compress_s=comp, compress_over_prefill=comp / pre,
                         warmup_s=warm,
                         compress_parts_s=parts,
                         solver=solver, compress_each=each, gap=float(np.mean([r.allocation.gap for r in reports])),
                         bytes_fraction_of_bf16=bpt / dense_bytes_per_token(model.config))
        step = Step(model, batch, meth)
        ms = time_graph(step, meth, args.steps, args.reps)
        if method_name == "dense":
            # SDPA's two GQA forms (query heads as rows of their kv-head, or enable_gqa): the
            # faster is the dense row
            meth.form = "gqa"
            other = time_graph(step, meth, args.steps, args.reps)
            extra = dict(sdpa_rows_ms=ms, sdpa_enable_gqa_ms=other)
            ms = min(ms, other)
        record(dict(method=method_name, batch=batch, context=context, ms_per_step=ms,
                    kv_bytes_per_token=bpt, equal_memory=equal_memory,
                    peak_gib=torch.cuda.max_memory_allocated() / GIB, **extra))
        if hasattr(meth, "step"):
            meth.step.close(0)
        del meth, step
        import gc
        gc.collect()
        import cupy
        cupy.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

    failed = []

    def attempt(method_name, batch, context, equal_memory=False):
        # one method failing (a peer's JIT build, an out-of-memory) must not cost the rows
        # after it: the error is printed and counted, and the run goes on
        try:
            run(method_name, batch, context, equal_memory)
        except Exception as e:           # noqa: BLE001 (reported, and the exit code says so)
            failed.append(f"{method_name} {batch}x{context}: {type(e).__name__}: {e}")
            print(f"FAILED {failed[-1]}", flush=True)
            import gc
            gc.collect()
            torch.cuda.empty_cache()

    for shape in args.shapes.split(","):
        batch, context = (int(x) for x in shape.split("x"))
        for m in methods:
            if m.startswith("rdr") and shape not in (args.rdr_shapes if m == "rdr"
                                                     else args.rdr_host_shapes).split(","):
                continue
            attempt(m, batch, context)
    if args.equal_memory:
        context = 32768
        room = args.memory_gib * GIB - weights - 2 * GIB        # activations and workspace
        dense_b = int(room // (dense_bytes_per_token(model.config) * (context + args.steps)))
        attempt("dense", dense_b, context, equal_memory=True)
        ada_seq = ada_bytes_per_seq(model, context + args.steps)
        attempt("ada44", int(room // ada_seq), context, equal_memory=True)
    if args.plot:
        plot(rows, args.plot)
    for f in failed:
        print(f"FAILED {f}")
    return 1 if failed else 0


def ada_bytes_per_seq(model, n):
    """Pool pages (4/4 at 4 KiB, one partial page per row) plus the page metadata."""
    from spherical_kv_ref.tiers import TierLadder
    cfg = model.config
    per = TierLadder([(4, 4)]).states_per_page(1, cfg.head_dim, 4096)
    rows = cfg.num_hidden_layers * cfg.num_key_value_heads
    pages = rows * -(-(n + 64) // per)
    return pages * (4096 + 12) + rows * 8 * cfg.head_dim


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 4.5))
    style = {"dense": ("tab:gray", "o"), "flashinfer-bf16": ("tab:green", "D"),
             "flashinfer-fp8": ("tab:olive", "d"), "ada44": ("tab:blue", "s"),
             "rdr": ("tab:red", "^"), "rdr-host": ("tab:orange", "v")}
    names = {"dense": "dense bf16 (SDPA)", "flashinfer-bf16": "FlashInfer paged bf16",
             "flashinfer-fp8": "FlashInfer paged fp8 e4m3", "ada44": "Spherical KV 4/4", "rdr": "RDR ~20 % (device solver)",
             "rdr-host": "RDR ~20 % (host solver)"}
    for m in style:
        pts = [r for r in rows if r["method"] == m]
        if not pts:
            continue
        c, mk = style[m]
        ax.scatter([r["kv_bytes_per_token"] / 1024 for r in pts], [r["tokens_per_s"] for r in pts],
                   color=c, marker=mk, label=names[m], s=40)
        for r in pts:
            ax.annotate(f"{r['batch']}×{r['context'] // 1024}K" + (" eq.mem" if r["equal_memory"] else ""),
                        (r["kv_bytes_per_token"] / 1024, r["tokens_per_s"]), fontsize=7,
                        xytext=(4, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("resident KV bytes per token (KiB, every byte counted)")
    ax.set_ylabel("decode tokens/s (whole model, one CUDA graph)")
    gpu = rows[0].get("gpu", "one GPU").replace("NVIDIA ", "") if rows else "one GPU"
    ax.set_title(f"Llama-3.1-8B shape, {gpu}: throughput against KV bytes")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=130)


if __name__ == "__main__":
    sys.exit(main())
