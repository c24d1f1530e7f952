"""Re-tier/compaction kernel on the GPU (cupy_kernels/retier.py; skipped without a device):
every state of a pool of 4/4 pages demoted to 2/2 (re-encoded) or compacted at 4/4 (copied)."""
from . import gpu, gpu_us


class Retier:
    params = ([1 << 16, 1 << 20], ["demote", "compact"])
    param_names = ["states", "move"]
    timeout = 300

    def setup(self, states, move):
        cp = gpu()
        import numpy as np
        from cupy_kernels import kernel_tables
        from validation.decode_cases import (BENCH_D, BENCH_HKV, BENCH_LADDER, BENCH_TIERS,
                                        encode_inputs, encode_keys_values)
        from cupy_kernels.encode import raise_status
        self.cp = cp
        self.tables = kernel_tables(BENCH_LADDER, BENCH_D)
        src, inp = encode_inputs(1, states // BENCH_HKV, "4/4", self.tables)
        dst_tier = BENCH_TIERS["2/2" if move == "demote" else "4/4"]
        per = self.tables.states_per_page(dst_tier)
        n = src.dst_page.size
        dst_pages = -(-n // per)
        self.pages = cp.zeros((src.page_tier.size + dst_pages, self.tables.page_bytes), cp.uint8)
        status = cp.zeros(1, cp.int32)
        encode_keys_values(inp, self.tables, self.pages[:src.page_tier.size], status)
        raise_status(status)
        tier = np.concatenate([src.page_tier, np.full(dst_pages, dst_tier, np.int32)])
        self.page_tier = cp.asarray(tier)
        k = np.arange(n)
        self.moves = (inp["dst_page"], inp["dst_slot"],
                      cp.asarray((src.page_tier.size + k // per).astype(np.int32)),
                      cp.asarray((k % per).astype(np.int32)))
        self.status = status
        self._retier()

    def _retier(self):
        from cupy_kernels import retier
        retier(self.pages, self.page_tier, self.tables, *self.moves, check=False,
               status=self.status)

    def track_gpu_us(self, states, move):
        return gpu_us(self.cp, self._retier)
    track_gpu_us.unit = "us"
