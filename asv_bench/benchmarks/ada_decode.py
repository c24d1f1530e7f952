"""ADA paged decode kernels on the GPU (cupy_kernels/ada_decode.py; skipped without a device).

Shapes of one Llama-3.1-8B layer (validation.decode_cases BENCH_*). GPU time comes from CUDA events
around a captured decode graph; ``track_gbps`` is the bytes the decode must read (valid codes
+ scales + queries + page tables) over that time.
"""
from . import gpu, gpu_us


class AdaDecode:
    params = ([(8, 32768), (1, 131072)], ["4/4", "2/2", "rdr-mix"], ["lloyd-max", "uniform"])
    param_names = ["batch_context", "tiers", "codebook"]
    timeout = 300

    def setup(self, batch_context, tiers, codebook):
        cp = gpu()
        from cupy_kernels import kernel_tables
        from validation.decode_cases import BENCH_D, BENCH_HQ, BENCH_LADDER, ada_step, encoded_pool
        self.cp = cp
        batch, context = batch_context
        self.tables = kernel_tables(BENCH_LADDER, BENCH_D, codebook=codebook)
        state, _, _ = encoded_pool(batch, context, tiers, self.tables)
        lay = state["layout"]
        q = cp.random.standard_normal((batch, BENCH_HQ, BENCH_D), dtype=cp.float32)
        self.run, self.out, _ = ada_step(state, self.tables, q, batch)
        self.nbytes = lay.cache_bytes + q.size * 4 + (lay.indptr.size + 3 * lay.indices.size) * 4

    def track_gpu_us(self, batch_context, tiers, codebook):
        return gpu_us(self.cp, self.run, reps=20, warm=True)
    track_gpu_us.unit = "us"

    def track_gbps(self, batch_context, tiers, codebook):
        return self.nbytes / (gpu_us(self.cp, self.run, reps=20, warm=True) * 1e-6) / 1e9
    track_gbps.unit = "GB/s"


class AdaDecodeD256:
    """The head_dim-256 layer of BENCH_GEOMETRIES["d256"] (16 query, 8 kv-heads), uniform
    codebook (the affine kernel, whose fast pages at this dim are docs/PERF_NOTES.md "Head dim
    256"); timed as AdaDecode."""
    params = ([(8, 32768), (1, 131072)], ["4/4", "rdr-mix"])
    param_names = ["batch_context", "tiers"]
    timeout = 300

    def setup(self, batch_context, tiers):
        cp = gpu()
        from cupy_kernels import kernel_tables
        from validation.decode_cases import BENCH_GEOMETRIES, BENCH_LADDER, ada_step, encoded_pool
        hq, hkv, d = BENCH_GEOMETRIES["d256"]
        batch, context = batch_context
        tables = kernel_tables(BENCH_LADDER, d, codebook="uniform")
        state, _, _ = encoded_pool(batch, context, tiers, tables, num_kv_heads=hkv)
        q = cp.random.standard_normal((batch, hq, d), dtype=cp.float32)
        self.cp, self.run = cp, ada_step(state, tables, q, batch)[0]

    def track_gpu_us(self, batch_context, tiers):
        return gpu_us(self.cp, self.run, reps=20, warm=True)
    track_gpu_us.unit = "us"
