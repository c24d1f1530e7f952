"""Quantizing baselines: dense bf16, fp8 e4m3, KIVI-style asymmetric 2/4-bit.

All keep every state; they differ in how many bytes one state costs and in the error
they add. Byte counting is in docs/baselines.md and in each class docstring.
"""
from __future__ import annotations

import math

import numpy as np

from .base import BF16_BYTES, CompressedLayer, KVMethod, bf16_round

__all__ = ["Dense", "FP8E4M3", "KIVI", "FP8_MAX", "fp8_e4m3_round", "asymmetric_quantize"]

FP8_MAX = 448.0  # largest finite e4m3 ("fn" variant: no infinities, one NaN code)
_FP8_MANTISSA_BITS = 3
_FP8_MIN_NORMAL_EXP = -6  # bias 7: exponent field 1 -> 2^-6; field 0 is subnormal


class Dense(KVMethod):
    """The uncompressed bf16 cache: the 100 % byte reference.

    Keys and values are rounded to bf16 (what the cache stores); 2 bytes per element.
    """

    name = "dense-bf16"

    def _compress_layer(self, layer, keys, values, stats):
        keep = np.ones(keys.shape[:2], dtype=bool)
        return CompressedLayer(bf16_round(keys), bf16_round(values), keep,
                               2 * keys.size * BF16_BYTES)


def fp8_e4m3_round(x: np.ndarray) -> np.ndarray:
    """x rounded to the nearest OCP fp8 e4m3 value, ties to even, saturating at ±448.

    Normal numbers: |x| = 1.m × 2^e with e in [-6, 8] and 3 mantissa bits, so the step
    is 2^(e-3); below 2^-6 the subnormal step 2^-9 applies. Magnitudes past 448 clamp
    to 448 (saturating conversion, as used for scaled KV caches). Returns float64.
    """
    a = np.abs(np.asarray(x, dtype=np.float64))
    if not np.isfinite(a).all():
        raise ValueError("fp8 rounding of NaN or Inf is not defined here")
    _, e = np.frexp(a)                 # a = m · 2^e, m in [0.5, 1): exponent of 1.m is e-1
    exp = np.maximum(e - 1, _FP8_MIN_NORMAL_EXP)
    step = np.ldexp(1.0, exp - _FP8_MANTISSA_BITS)
    r = np.minimum(np.round(a / step) * step, FP8_MAX)  # np.round: half to even; exact
    return np.copysign(r, x)


class FP8E4M3(KVMethod):
    """fp8 e4m3 with one float32 scale per (layer, kv-head, K or V).

    ``scale = amax / 448`` over that head's T×d block, ``x̂ = e4m3(x / scale) · scale``.
    Bytes: 1 per element + 4 per scale (2 scales per kv-head per layer).
    """

    name = "fp8-e4m3"
    SCALE_BYTES = 4

    def _quantize(self, x: np.ndarray) -> np.ndarray:
        out = np.empty_like(x)
        for h in range(x.shape[0]):
            amax = float(np.abs(x[h]).max())
            scale = np.float32(amax / FP8_MAX) if amax > 0 else np.float32(1.0)
            out[h] = fp8_e4m3_round(x[h].astype(np.float64) / scale) * scale
        return out

    def _compress_layer(self, layer, keys, values, stats):
        keep = np.ones(keys.shape[:2], dtype=bool)
        nbytes = 2 * keys.size + 2 * keys.shape[0] * self.SCALE_BYTES
        return CompressedLayer(self._quantize(keys), self._quantize(values), keep, nbytes)


def _fp16_toward(x: np.ndarray, direction: float) -> np.ndarray:
    """x rounded to fp16, then moved one fp16 step toward ``direction`` if it landed on
    the wrong side of x (so the result is <= x for -inf, >= x for +inf)."""
    h = np.asarray(x, dtype=np.float64).astype(np.float16)
    if not np.isfinite(h).all():
        raise ValueError("KIVI scale or zero point does not fit in fp16 (|x| > 65504)")
    wrong = (h > x) if direction < 0 else (h < x)
    h = np.where(wrong, np.nextafter(h, np.float16(direction)), h)
    return h


def asymmetric_quantize(x: np.ndarray, bits: int, axis: int):
    """Asymmetric min/max quantization of ``x`` with one (scale, zero) per slice along
    ``axis`` (the reduced axis is the group).

    ``zero = fp16(min)`` rounded down, ``scale = fp16((max - zero) / (2^bits - 1))``
    rounded up, so every x lies in [zero, zero + (2^bits - 1)·scale] and
    ``|x - x̂| <= scale / 2`` (before the float32 rounding of x̂).
    Returns (x̂ float32, codes uint8, scale fp16, zero fp16); scale and zero keep the
    reduced axis with length 1.
    """
    levels = (1 << bits) - 1
    x64 = x.astype(np.float64)
    lo = x64.min(axis=axis, keepdims=True)
    hi = x64.max(axis=axis, keepdims=True)
    zero = _fp16_toward(lo, -np.inf)
    scale = _fp16_toward((hi - zero.astype(np.float64)) / levels, np.inf)
    s64, z64 = scale.astype(np.float64), zero.astype(np.float64)
    safe = np.where(s64 > 0, s64, 1.0)
    codes = np.where(s64 > 0, np.clip(np.round((x64 - z64) / safe), 0, levels), 0)
    x_hat = (codes * s64 + z64).astype(np.float32)
    return x_hat, codes.astype(np.uint8), scale, zero


class KIVI(KVMethod):
    """KIVI-style asymmetric quantization (Liu et al., 2024).

    Keys per channel: one (scale, zero) per (kv-head, channel, group of ``group``
    tokens). Values per token: one (scale, zero) per (kv-head, token, group of
    ``group`` channels). Scale and zero point are fp16. Only whole key groups are
    quantized and at least the last ``residual`` tokens stay in full precision (bf16):
    ``n_quant = floor((T - residual) / group) · group`` tokens are quantized, the same
    tokens for K and V.

    Bytes per kv-head: K and V codes ``ceil(n_quant·d·bits/8)`` each; key scales+zeros
    ``(n_quant/group)·d·4``; value scales+zeros ``n_quant·(d/group)·4``; full-precision
    tail ``2·(T - n_quant)·d·2``.
    """

    PARAM_BYTES = 4  # fp16 scale + fp16 zero point

    def __init__(self, bits: int = 2, *, group: int = 32, residual: int = 32):
        if bits not in (2, 4):
            raise ValueError(f"KIVI supports 2 or 4 bits, got {bits}")
        if group < 1 or residual < 0:
            raise ValueError(f"group must be >= 1 and residual >= 0, got {group}, {residual}")
        self.bits, self.group, self.residual = bits, group, residual
        self.name = f"kivi{bits}" + (f"-g{group}-r{residual}" if (group, residual) != (32, 32)
                                     else "")

    def quantized_tokens(self, T: int) -> int:
        return max(0, (T - self.residual) // self.group) * self.group

    def _compress_layer(self, layer, keys, values, stats):
        H, T, d = keys.shape
        if d % self.group:
            raise ValueError(f"head_dim {d} is not a multiple of the value group {self.group}")
        nq, g = self.quantized_tokens(T), self.group
        k_hat, v_hat = bf16_round(keys), bf16_round(values)  # the full-precision tail
        if nq:
            kq = keys[:, :nq].reshape(H, nq // g, g, d)
            k_hat[:, :nq] = asymmetric_quantize(kq, self.bits, axis=2)[0].reshape(H, nq, d)
            vq = values[:, :nq].reshape(H, nq, d // g, g)
            v_hat[:, :nq] = asymmetric_quantize(vq, self.bits, axis=3)[0].reshape(H, nq, d)
        codes = 2 * math.ceil(nq * d * self.bits / 8)
        params = (nq // g) * d * self.PARAM_BYTES + nq * (d // g) * self.PARAM_BYTES
        tail = 2 * (T - nq) * d * BF16_BYTES
        keep = np.ones((H, T), dtype=bool)
        return CompressedLayer(k_hat, v_hat, keep, H * (codes + params + tail))
