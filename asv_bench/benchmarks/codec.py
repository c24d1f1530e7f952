"""Encode and logits throughput of the reference codec and its numba fast path (CPU)."""
import numpy as np

import spherical_kv_ref as skv
from spherical_kv_ref import codec_numba


class Encode:
    params = ([64, 128], [2, 3, 4], ["reference", "numba"])
    param_names = ["dim", "bits", "path"]

    def setup(self, dim, bits, path):
        self.codec = skv.SphericalCodec(dim, bits, seed=0)
        self.x = np.random.default_rng(0).standard_normal((4096, dim))
        self.encode = self.codec.encode if path == "reference" else (lambda x: codec_numba.encode(self.codec, x))
        self.encode(self.x[:8])                     # compile / warm caches outside the timing

    def time_encode(self, dim, bits, path):
        self.encode(self.x)

    def track_vectors_per_second(self, dim, bits, path):
        import time
        t = time.perf_counter()
        self.encode(self.x)
        return len(self.x) / (time.perf_counter() - t)
    track_vectors_per_second.unit = "vectors/s"


class Logits:
    params = ([64, 128], [3, 4], ["reference", "numba"])
    param_names = ["dim", "bits", "path"]

    def setup(self, dim, bits, path):
        rng = np.random.default_rng(1)
        self.codec = skv.SphericalCodec(dim, bits, seed=0)
        self.enc = self.codec.encode(rng.standard_normal((8192, dim)))
        self.q = rng.standard_normal((4, dim))       # one GQA group of query heads
        self.logits = self.codec.logits if path == "reference" else (lambda q, e: codec_numba.logits(self.codec, q, e))
        self.logits(self.q, self.enc.take(slice(0, 8)))

    def time_logits(self, dim, bits, path):
        self.logits(self.q, self.enc)
