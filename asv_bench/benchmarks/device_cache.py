"""The device cache's captured decode step (cupy_kernels/device_cache.py; skipped without a
device): one Llama-3.1-8B layer's attention for a batch, as a model's graph runs it per layer
(the step's slots, the append of its token, the decode), captured once in a CUDA graph and
timed by replays with CUDA events. ``track_gbps``: the pages the decode reads over that time.
"""
from . import gpu, gpu_us


class DeviceCacheStep:
    params = ([(8, 32768), (1, 131072)], ["4/4"])
    param_names = ["batch_context", "tiers"]
    timeout = 300

    def setup(self, batch_context, tiers):
        cp = gpu()
        import torch
        from cupy_kernels.device_cache import DeviceKVCache
        from spherical_kv_ref.tiers import TierLadder
        self.cp = cp
        batch, context = batch_context
        H, Hq, d = 8, 32, 128
        kb, vb = (int(b) for b in tiers.split("/"))
        ladder = TierLadder([(kb, vb)])
        per = ladder.states_per_page(1, d, 4096)
        pages = batch * H * (-(-(context + 64) // per)) + 8
        self.cache = DeviceKVCache(1, H, d, ladder, pool_bytes=pages * 4096, num_q_heads=Hq)
        g = torch.Generator(device="cuda").manual_seed(0)
        seqs = []
        for _ in range(batch):
            s = self.cache.new_sequence()
            self.cache.append(s, 0, torch.randn((H, context, d), device="cuda", generator=g),
                              torch.randn((H, context, d), device="cuda", generator=g))
            seqs.append(s)
        self.steps = 64
        self.step = self.cache.decode_step(seqs, self.steps)
        q = torch.randn((batch, Hq, d), device="cuda", generator=g)
        kv = torch.randn((2, batch, H, d), device="cuda", generator=g)

        def body():
            self.step.slots()
            self.step.append(0, kv[0], kv[1])
            return self.step.decode(0, q)
        self.step.set_step(0)
        body()
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            body()
        self.i = 0
        self.nbytes = self.cache.bytes_in_use()

    def _replay(self):
        self.step.set_step(self.i % self.steps)
        self.i += 1
        self.graph.replay()

    def teardown(self, batch_context, tiers):
        if getattr(self, "step", None) is not None:
            self.step.close(0)

    def track_gpu_us(self, batch_context, tiers):
        return gpu_us(self.cp, self._replay, reps=20, warm=True)
    track_gpu_us.unit = "us"

    def track_gbps(self, batch_context, tiers):
        return self.nbytes / (gpu_us(self.cp, self._replay, reps=20, warm=True) * 1e-6) / 1e9
    track_gbps.unit = "GB/s"
