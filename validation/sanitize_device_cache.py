"""A small run of every device-cache path for compute-sanitizer (validation/gpu_suite.sh
sanitize-dc): appends across page boundaries, decode, both compress solvers, compress_all of
two sequences with each solver, a decode plan with appends and decodes, close and free.
Exits non-zero on any error."""
import numpy as np
import torch

from cupy_kernels.device_cache import DeviceKVCache
from spherical_kv_ref.cache import CompressPolicy


def main():
    rng = np.random.default_rng(0)
    for d in (64, 128, 256):
        L, H, G = 2, 2, 2
        c = DeviceKVCache(L, H, d, num_q_heads=H * G, pool_bytes=8 << 20,
                          policy=CompressPolicy(sinks=2, recent=8, window=4))
        seqs = [c.new_sequence() for _ in range(6)]
        for s, t in zip(seqs, (37, 70) * 3):
            for layer in range(L):
                k = torch.tensor(rng.standard_normal((H, t, d)), device="cuda")
                c.append(s, layer, k, k * 0.5 + 1)
                c.observe(s, layer, torch.tensor(rng.standard_normal((4, H * G, d)), device="cuda"))
        c.compress(seqs[0], c.bytes_in_use(seqs[0]) // 2)
        c.compress(seqs[1], c.bytes_in_use(seqs[1]) // 2, method="device")
        # two sequences in one batched decision per solver (one statistics call per layer);
        # each gets the budget the shorter one held at compress above (same protected states)
        c.compress_all(seqs[2:4], c.bytes_in_use(seqs[2]) // 2, method="device")
        c.compress_all(seqs[4:6], c.bytes_in_use(seqs[4]) // 2)
        q = torch.tensor(rng.standard_normal((len(seqs), H * G, d)), device="cuda")
        for layer in range(L):
            c.decode(seqs, layer, q)
        step = c.decode_step(seqs, 20)
        for i in range(20):
            step.set_step(i)
            step.slots()
            for layer in range(L):
                kv = torch.tensor(rng.standard_normal((len(seqs), H, d)), device="cuda")
                step.attend(layer, q, kv, kv)
        step.close()
        for s in seqs:
            c.free(s)
        torch.cuda.synchronize()
    print("device cache paths ran")


if __name__ == "__main__":
    main()
