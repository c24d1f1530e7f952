"""numba CPU fast paths for encode and logits, tested equal to the float64 reference.

Same arithmetic as ``SphericalCodec.encode`` / ``.logits`` (docs/format.md), compiled and
parallel over vectors. The reference stays the specification; these are for throughput.
"""
from __future__ import annotations

import numba
import numpy as np

from .codec import FP16_MAX, Encoded, SphericalCodec, as_float_matrix


@numba.njit(cache=True, inline="always")
def _code_at(row, j, bits, w2):
    """Code of coordinate j from one vector's packed words (bits 1, 2, 3, 4, 8)."""
    if bits == 3:
        lo = (row[(2 * j) >> 5] >> ((2 * j) & 31)) & 3
        hi = (row[w2 + (j >> 5)] >> (j & 31)) & 1
        return lo | (hi << 2)
    return (row[(j * bits) >> 5] >> ((j * bits) & 31)) & ((1 << bits) - 1)


@numba.njit(cache=True)
def _fwht_inplace(y):
    d = y.shape[0]
    h = 1
    while h < d:
        for start in range(0, d, 2 * h):
            for i in range(start, start + h):
                a = y[i]
                b = y[i + h]
                y[i] = a + b
                y[i + h] = a - b
        h *= 2


@numba.njit(cache=True, parallel=True)
def _encode_kernel(x, mean, signs, matrix, mid, levels, bits, words, w2):
    n, d = x.shape
    codes = np.zeros((n, words), dtype=np.uint32)
    scale = np.zeros(n, dtype=np.float64)
    sqrt_d = np.sqrt(d)
    for i in numba.prange(n):
        v = x[i] - mean
        if signs.shape[0] == d:
            y = v * signs
            _fwht_inplace(y)
            y /= sqrt_d
        else:
            y = matrix @ v
        r = np.sqrt(np.sum(y * y))
        if r == 0.0:
            continue
        acc = 0.0
        for j in range(d):
            c = np.searchsorted(mid, sqrt_d * (y[j] / r))
            acc += levels[c] * levels[c]
            if bits == 3:
                codes[i, (2 * j) >> 5] |= np.uint32(c & 3) << np.uint32((2 * j) & 31)
                codes[i, w2 + (j >> 5)] |= np.uint32(c >> 2) << np.uint32(j & 31)
            else:
                codes[i, (j * bits) >> 5] |= np.uint32(c) << np.uint32((j * bits) & 31)
        scale[i] = r / np.sqrt(acc / d)
    return codes, scale


@numba.njit(cache=True, parallel=True)
def _logits_kernel(table, codes, scale, bits, w2):
    m, d, _ = table.shape
    n = codes.shape[0]
    out = np.empty((m, n))
    for i in numba.prange(n):
        row = codes[i]
        for h in range(m):
            acc = 0.0
            for j in range(d):
                acc += table[h, j, _code_at(row, j, bits, w2)]
            out[h, i] = acc * scale[i]
    return out


def encode(codec: SphericalCodec, x, mean=None) -> Encoded:
    """``codec.encode(x, mean)`` compiled: same codes and scales (quantised tiers only)."""
    if codec.bits == 16:
        return codec.encode(x, mean)
    x = as_float_matrix(x, "x", codec.dim)
    mean32 = codec._mean32(mean)
    mu = np.zeros(codec.dim) if mean32 is None else mean32.astype(np.float64)
    rot = codec.rotation
    signs = rot.signs.astype(np.float64) if rot.kind == "hadamard" else np.zeros(0)
    matrix = rot.matrix if rot.kind == "haar" else np.zeros((1, 1))
    mid = 0.5 * (codec.levels[1:] + codec.levels[:-1])
    w2 = -(-2 * codec.dim // 32)
    codes, scale = _encode_kernel(x, mu, signs, matrix, mid, codec.levels, codec.bits,
                                  codec.words, w2)
    if np.any(scale > FP16_MAX):
        raise ValueError("a vector norm is too large for an fp16 scale (max scale 65504); "
                         "rescale the input")
    return Encoded(scale.astype(np.float16), codes, codec.bits, codec.dim, mean32, codec.key)


def logits(codec: SphericalCodec, q, enc: Encoded) -> np.ndarray:
    """``codec.logits(q, enc)`` compiled, (m, n) float64."""
    if codec.bits == 16:
        return codec.logits(q, enc)
    codec._check_encoded(enc)
    q = as_float_matrix(q, "q", codec.dim)
    qr = codec.rotation.apply(q)
    table = qr[:, :, None] * (codec.levels / np.sqrt(codec.dim))[None, None, :]
    out = _logits_kernel(np.ascontiguousarray(table), np.ascontiguousarray(enc.codes),
                         enc.scale.astype(np.float64), codec.bits, -(-2 * codec.dim // 32))
    if enc.mean is not None:
        out += (q @ enc.mean.astype(np.float64))[:, None]
    return out
