"""ADA paged decode and encode kernels on the GPU (skipped where CuPy sees no device).

Shapes of one Llama-3.1-8B layer (32 query heads, 8 kv-heads, d = 128). GPU time comes from
CUDA events around a captured decode graph; ``track_gbps`` is the bytes the decode must read
(valid codes + scales + queries + page tables) over that time.
"""
import numpy as np

HQ, HKV, D = 32, 8, 128
LADDER = [(2, 2), (3, 3), (4, 4), (8, 8), (16, 16)]


def _gpu():
    try:
        import cupy as cp
        if cp.cuda.runtime.getDeviceCount() == 0:
            raise NotImplementedError("no CUDA device")
        return cp
    except ImportError:
        raise NotImplementedError("CuPy is not installed")
    except Exception as e:  # no driver
        raise NotImplementedError(str(e))


class AdaDecode:
    params = ([(8, 32768), (1, 131072)], ["4/4", "2/2", "rdr-mix"], ["lloyd-max", "uniform"])
    param_names = ["batch_context", "tiers", "codebook"]
    timeout = 300

    def setup(self, batch_context, tiers, codebook):
        cp = _gpu()
        from cupy_kernels import kernel_tables
        from validation.decode_bench import ada_step, build_ada
        self.cp = cp
        batch, context = batch_context
        self.tables = kernel_tables(LADDER, D, codebook=codebook)
        self.state, _ = build_ada(batch, context, tiers, self.tables)
        q = cp.random.standard_normal((batch, HQ, D), dtype=cp.float32)
        self.run, self.out, _ = ada_step(self.state, self.tables, q, batch)
        lay = self.state["layout"]
        self.nbytes = lay.cache_bytes + q.size * 4 + (lay.indptr.size + 3 * lay.indices.size) * 4

    def _gpu_us(self, reps=20):
        cp = self.cp
        self.run()
        times = []
        for _ in range(reps):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record()
            self.run()
            b.record()
            b.synchronize()
            times.append(cp.cuda.get_elapsed_time(a, b) * 1e3)
        return float(np.median(times))

    def track_gpu_us(self, batch_context, tiers, codebook):
        return self._gpu_us()
    track_gpu_us.unit = "us"

    def track_gbps(self, batch_context, tiers, codebook):
        return self.nbytes / (self._gpu_us() * 1e-6) / 1e9
    track_gbps.unit = "GB/s"


class Encode:
    """Keys only (encode_into_pages), or keys and values in one launch (encode_kv_into_pages)."""
    params = ([1 << 16, 1 << 20], ["4/4", "rdr-mix"], ["key", "key+value"])
    param_names = ["states", "tiers", "parts"]
    timeout = 300

    def setup(self, states, tiers, parts):
        self.parts = parts
        cp = _gpu()
        from cupy_kernels import kernel_tables
        from cupy_kernels.cases import synthetic_layout
        from validation.decode_bench import TIERS, rdr_mix
        self.cp = cp
        self.tables = kernel_tables(LADDER, D)
        context = states // HKV
        counts = rdr_mix(context) if tiers == "rdr-mix" else {TIERS[tiers]: context}
        lay = synthetic_layout(1, HKV, context, self.tables, counts)
        self.pages = cp.zeros((lay.page_tier.size, self.tables.page_bytes), cp.uint8)
        self.page_tier = cp.asarray(lay.page_tier)
        self.sigma = cp.ones((HKV, D), cp.float32)
        self.head, self.page, self.slot = (cp.asarray(a) for a in (lay.state_head, lay.dst_page, lay.dst_slot))
        self.x = cp.random.standard_normal((lay.dst_page.size, D), dtype=cp.float32)
        self.status = cp.zeros(1, cp.int32)
        self._encode()

    def _encode(self):
        from cupy_kernels import encode_into_pages, encode_kv_into_pages
        if self.parts == "key":
            encode_into_pages(self.x, self.pages, self.page_tier, self.tables, self.sigma,
                              self.head, self.page, self.slot, part="key", check=False,
                              status=self.status)
        else:
            encode_kv_into_pages(self.x, self.x, self.pages, self.page_tier, self.tables,
                                 self.sigma, self.sigma, self.head, self.page, self.slot,
                                 check=False, status=self.status)

    def track_gpu_us(self, states, tiers, parts):
        cp = self.cp
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        self._encode()
        b.record()
        b.synchronize()
        return cp.cuda.get_elapsed_time(a, b) * 1e3
    track_gpu_us.unit = "us"
