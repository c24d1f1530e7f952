"""Encode/append kernels on the GPU (cupy_kernels/encode.py; skipped without a device)."""
from . import gpu, gpu_us


class Encode:
    """Keys only (encode_into_pages), or keys and values in one launch (encode_kv_into_pages)."""
    params = ([1 << 16, 1 << 20], ["4/4", "rdr-mix"], ["key", "key+value"])
    param_names = ["states", "tiers", "parts"]
    timeout = 300

    def setup(self, states, tiers, parts):
        self.parts = parts
        cp = gpu()
        from cupy_kernels import kernel_tables
        from validation.decode_cases import BENCH_D, BENCH_HKV, BENCH_LADDER, bench_layout
        self.cp = cp
        self.tables = kernel_tables(BENCH_LADDER, BENCH_D)
        lay = bench_layout(1, states // BENCH_HKV, tiers, self.tables)
        self.pages = cp.zeros((lay.page_tier.size, self.tables.page_bytes), cp.uint8)
        self.page_tier = cp.asarray(lay.page_tier)
        self.sigma = cp.ones((BENCH_HKV, BENCH_D), cp.float32)
        self.head, self.page, self.slot = (cp.asarray(a) for a in (lay.state_head, lay.dst_page, lay.dst_slot))
        self.x = cp.random.standard_normal((lay.dst_page.size, BENCH_D), dtype=cp.float32)
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
        return gpu_us(self.cp, self._encode)
    track_gpu_us.unit = "us"
