"""Hypothesis strategies shared by the codec, attention and kernel tests."""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

DIMS = (64, 128, 256, 96)          # 96: not a power of two (dense Haar rotation)
CODE_BITS = (1, 2, 3, 4, 8)
ALL_BITS = CODE_BITS + (16,)


@st.composite
def vectors(draw, dim=None, min_rows=1, max_rows=24):
    """Rows that stress the codec: Gaussian, spikes (one huge channel), near-zero,
    fp16-extreme norms, exact zeros, and a constant offset (what centring removes)."""
    d = draw(st.sampled_from(DIMS)) if dim is None else dim
    n = draw(st.integers(min_rows, max_rows))
    seed = draw(st.integers(0, 2 ** 32 - 1))
    kind = draw(st.sampled_from(["gauss", "spike", "tiny", "huge", "zeros", "offset", "sparse"]))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d))
    if kind == "spike":
        x[:, rng.integers(d)] *= draw(st.floats(10, 1e3))
    elif kind == "tiny":
        x *= draw(st.sampled_from([1e-3, 1e-5, 1e-7, 1e-9]))
    elif kind == "huge":
        # norms up to a few thousand: rotated coordinates stay inside fp16
        x *= draw(st.sampled_from([1e2, 1e3])) / np.sqrt(d)
    elif kind == "zeros":
        x[rng.random(n) < 0.5] = 0.0
    elif kind == "offset":
        x += rng.standard_normal(d) * 5
    elif kind == "sparse":
        x *= rng.random((n, d)) < 0.05
    return x


@st.composite
def codec_params(draw, bits=ALL_BITS):
    return {"dim": draw(st.sampled_from(DIMS)), "bits": draw(st.sampled_from(bits)),
            "seed": draw(st.integers(0, 1000))}
