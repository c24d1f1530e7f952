"""Spherical codec: radius + packed direction code, and logits straight from the codes.

Implements the encoding and storage format of docs/format.md (centring, rotation, scale, scalar codes). The error
analysis behind ``logit_error_bound`` and ``expected_sq_logit_error`` is in docs/ada.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from . import codebooks
from .rotation import KEY_SALT, Rotation

BITS = (1, 2, 3, 4, 8, 16)
FP16_MAX = 65504.0
FP16_HALF_ULP_REL = 2.0 ** -11     # |x − fp16(x)| ≤ 2^-11·|fp16(x)| for normal fp16(x)
FP16_HALF_ULP_ABS = 2.0 ** -25     # half of the smallest subnormal spacing
_SLACK = 1e-9                       # float64 rounding of the reference arithmetic itself


def whole(name: str, v, lo: int = 0, hi=None) -> int:
    """v as an int, which it must be (a Python or NumPy integer, not a bool or a float),
    in lo..hi−1 (hi None: no upper bound); ValueError naming ``name`` otherwise."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {v!r}")
    v = int(v)
    if v < lo or (hi is not None and v >= hi):
        rng = f"{lo}..{hi - 1}" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be in {rng}, got {v}")
    return v


def _bits(bits) -> int:
    if isinstance(bits, (bool, np.bool_)) or not isinstance(bits, (int, np.integer)) or bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits!r}")
    return int(bits)


def code_words(bits: int, dim: int) -> int:
    """uint32 words per vector (docs/format.md "Packing")."""
    bits, dim = _bits(bits), whole("dim", dim, 1)
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits!r}")
    if bits == 3:
        return -(-2 * dim // 32) + -(-dim // 32)
    return -(-bits * dim // 32)


def vector_bytes(bits: int, dim: int) -> int:
    """Bytes one stored vector costs: packed codes plus its fp16 scale (none at 16 bits)."""
    return 4 * code_words(bits, dim) + (0 if bits == 16 else 2)


# ---------------------------------------------------------------------------- packing

def _pack_fields(codes: np.ndarray, bits: int) -> np.ndarray:
    n, d = codes.shape
    per_word = 32 // bits
    words = -(-d // per_word)
    padded = np.zeros((n, words * per_word), dtype=np.uint64)
    padded[:, :d] = codes
    padded = padded.reshape(n, words, per_word)
    shifts = (np.arange(per_word, dtype=np.uint64) * np.uint64(bits))
    return np.bitwise_or.reduce(padded << shifts, axis=2).astype(np.uint32)


def _unpack_fields(words: np.ndarray, bits: int, dim: int) -> np.ndarray:
    per_word = 32 // bits
    shifts = (np.arange(per_word, dtype=np.uint32) * np.uint32(bits))
    fields = (words[:, :, None] >> shifts) & np.uint32((1 << bits) - 1)
    return fields.reshape(words.shape[0], words.shape[1] * per_word)[:, :dim].astype(np.uint16)


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes (n, d) in [0, 2^bits) → packed uint32 words (n, code_words(bits, d))."""
    bits = _bits(bits)
    codes = as_real_array(codes, "codes")
    if codes.dtype.kind not in "iu" or codes.ndim != 2:
        raise ValueError(f"codes must be an integer array (n, d), got {codes.dtype} {codes.shape}")
    if codes.size and (codes.min() < 0 or codes.max() >= (1 << min(bits, 16))):
        raise ValueError(f"codes must be in 0..{(1 << min(bits, 16)) - 1} at {bits} bits")
    codes = codes.astype(np.uint64)
    if bits == 3:
        return np.concatenate([_pack_fields(codes & 3, 2), _pack_fields(codes >> 2, 1)], axis=1)
    return _pack_fields(codes, bits)


def unpack_codes(words: np.ndarray, bits: int, dim: int) -> np.ndarray:
    """Inverse of ``pack_codes``: (n, words) uint32 → (n, d) uint16 codes."""
    bits, dim = _bits(bits), whole("dim", dim, 1)
    words = as_real_array(words, "words")
    if words.dtype.kind not in "iu" or words.ndim != 2 or words.shape[1] != code_words(bits, dim):
        raise ValueError(f"words must be integer (n, {code_words(bits, dim)}) for {bits} bits at "
                         f"dim {dim}, got {words.dtype} {words.shape}")
    words = words.astype(np.uint32)
    if bits == 3:
        w2 = -(-2 * dim // 32)
        return _unpack_fields(words[:, :w2], 2, dim) | (_unpack_fields(words[:, w2:], 1, dim) << 2)
    return _unpack_fields(words, bits, dim)


def pack_fp16(y16: np.ndarray) -> np.ndarray:
    n, d = y16.shape
    if d % 2:
        y16 = np.concatenate([y16, np.zeros((n, 1), np.float16)], axis=1)
    return np.ascontiguousarray(y16).view(np.uint16).astype(np.uint32).reshape(n, y16.shape[1] // 2, 2) \
        .dot(np.array([1, 1 << 16], dtype=np.uint32)).astype(np.uint32)


def _unpack_fp16(words: np.ndarray, dim: int) -> np.ndarray:
    lo = (words & np.uint32(0xFFFF)).astype(np.uint16)
    hi = (words >> np.uint32(16)).astype(np.uint16)
    return np.stack([lo, hi], axis=2).reshape(words.shape[0], 2 * words.shape[1])[:, :dim].view(np.float16)


# ---------------------------------------------------------------------------- encoded

@dataclass(frozen=True)
class Encoded:
    """n vectors in the stored format. ``scale`` fp16 (n,), ``codes`` uint32 (n, words),
    ``bits`` per coordinate and ``dim`` of the codec that wrote them, ``mean`` float32 (d,)
    or None (the centring mean subtracted before coding). ``codec_key``: what else picks
    that codec, (seed, layer, head, salt, codebook, rotation kind), recorded by
    ``SphericalCodec.encode``; a codec with another key refuses the codes (ValueError).
    None (codes put together from pages) is not checked."""
    scale: np.ndarray
    codes: np.ndarray
    bits: int
    dim: int
    mean: Optional[np.ndarray] = None
    codec_key: Optional[tuple] = None

    @property
    def seed(self) -> Optional[int]:
        """The model seed of the codec that wrote the codes (None if not recorded)."""
        return None if self.codec_key is None else self.codec_key[0]

    def __len__(self) -> int:
        return int(self.scale.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes the n vectors occupy in pages (codes + scales; the mean is per sequence)."""
        return len(self) * vector_bytes(self.bits, self.dim)

    def take(self, index) -> "Encoded":
        """A subset of the vectors (same mean), e.g. the states RDR keeps."""
        return Encoded(self.scale[index], self.codes[index], self.bits, self.dim, self.mean,
                       self.codec_key)


def as_real_array(x, name: str) -> np.ndarray:
    """x as a NumPy array of reals (any float or integer dtype), not yet converted.

    Takes NumPy arrays, sequences and torch tensors (on any device, with or without grad;
    bfloat16 and the other dtypes NumPy lacks are upcast to float32, exactly) without
    importing torch. Anything else that is not real numbers → ValueError naming ``name``."""
    if type(x).__module__.split(".")[0] == "torch" and hasattr(x, "detach"):
        x = x.detach()
        if str(x.dtype) in _TORCH_UPCAST:
            x = x.float()
        x = x.cpu().numpy()
    try:
        a = np.asarray(x)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{name} must be an array of real numbers ({e})") from None
    if a.dtype.kind not in "fiu" or a.dtype == np.bool_:
        raise ValueError(f"{name} must be a real float array, got dtype {a.dtype}")
    return a


#: torch dtypes without a NumPy twin; float32 holds each of them exactly
_TORCH_UPCAST = ("torch.bfloat16", "torch.float8_e4m3fn", "torch.float8_e5m2",
                 "torch.float8_e4m3fnuz", "torch.float8_e5m2fnuz")


def check_finite(a: np.ndarray, name: str) -> None:
    """ValueError naming ``name`` and how many rows (along the first axis) hold NaN or Inf."""
    if not np.all(np.isfinite(a)):
        bad = int(np.count_nonzero(~np.isfinite(a.reshape(a.shape[0], -1)).all(axis=1))) if a.ndim else 1
        raise ValueError(f"{name} contains NaN or Inf in {bad} row(s)")


def as_float_matrix(x, name: str, dim: int) -> np.ndarray:
    a = as_real_array(x, name)
    if a.ndim != 2 or a.shape[1] != dim:
        raise ValueError(f"{name} must have shape (n, {dim}), got {a.shape}")
    a = a.astype(np.float64)
    check_finite(a, name)
    return a


class SphericalCodec:
    """One rotation + one codebook: encode/decode and logits from codes (docs/format.md, docs/ada.md).

    dim: head dimension d. bits: bits per coordinate, one of 1, 2, 3, 4, 8, 16
    (16 = fp16 of the rotated vector, the top tier). seed, layer, head, salt pick the
    rotation (docs/format.md). codebook: "lloyd-max" or "uniform". rotation: "auto",
    "hadamard" or "haar".
    """

    def __init__(self, dim: int, bits: int = 4, seed: int = 0, *, layer: int = 0,
                 head: int = 0, salt: int = KEY_SALT, codebook: str = "lloyd-max",
                 rotation: str = "auto"):
        bits = _bits(bits)
        dim = whole("dim", dim, 4)
        self.dim, self.bits, self.codebook_kind = dim, bits, codebook
        self.rotation = Rotation(self.dim, seed, layer, head, salt, rotation)
        # 16 bits store the rotated fp16 values: no codebook is involved
        self.key = (int(seed), int(layer), int(head), int(salt),
                    None if bits == 16 else codebook, self.rotation.kind)
        self.levels = None if bits == 16 else codebooks.codebook(bits, self.dim, codebook)
        self.words = code_words(self.bits, self.dim)

    # ------------------------------------------------------------------ properties
    @property
    def signs(self):
        """±1 (int8, (d,)) of the Hadamard rotation, None for a dense rotation."""
        return self.rotation.signs

    @property
    def bytes_per_vector(self) -> int:
        return vector_bytes(self.bits, self.dim)

    @property
    def expected_sq_angle_error(self) -> float:
        """E[ε_θ²] for this (bits, dim, codebook) over u uniform on the sphere."""
        return codebooks.expected_sq_angle_error(self.bits, self.dim, self.codebook_kind)

    # ------------------------------------------------------------------ encode / decode
    def _mean32(self, mean) -> Optional[np.ndarray]:
        if mean is None:
            return None
        m = as_float_matrix(np.asarray(mean).reshape(1, -1), "mean", self.dim)[0]
        return m.astype(np.float32)

    def encode(self, x, mean=None) -> Encoded:
        """x (n, d) float → Encoded. ``mean`` (d,) is rounded to float32, subtracted and
        recorded. NaN/Inf, a wrong shape or dtype, or a norm beyond fp16 → ValueError."""
        x = as_float_matrix(x, "x", self.dim)
        mean32 = self._mean32(mean)
        if mean32 is not None:
            x = x - mean32.astype(np.float64)
        y = self.rotation.apply(x)
        n = y.shape[0]
        if self.bits == 16:
            if np.any(np.abs(y) > FP16_MAX):
                raise ValueError("a rotated coordinate exceeds the fp16 range (65504); "
                                 "scale the input or use a quantised tier")
            return Encoded(np.ones(n, np.float16), pack_fp16(y.astype(np.float16)),
                           16, self.dim, mean32, self.key)
        r = np.sqrt(np.sum(y * y, axis=1))
        zero = r == 0.0
        u = y / np.where(zero, 1.0, r)[:, None]
        codes = codebooks.quantize(np.sqrt(self.dim) * u, self.levels)
        codes[zero] = 0
        chat_norm = np.sqrt(np.sum(self.levels[codes] ** 2, axis=1) / self.dim)
        scale = np.where(zero, 0.0, r / chat_norm)
        if np.any(scale > FP16_MAX):
            raise ValueError(f"a vector norm ({r.max():.6g}) is too large for an fp16 scale "
                             f"(max scale 65504); rescale the input")
        return Encoded(scale.astype(np.float16), pack_codes(codes, self.bits),
                       self.bits, self.dim, mean32, self.key)

    def _check_encoded(self, enc: Encoded, name: str = "enc") -> None:
        if not isinstance(enc, Encoded):
            raise ValueError(f"{name} must be an Encoded, got {type(enc).__name__}")
        if enc.bits != self.bits or enc.dim != self.dim:
            raise ValueError(f"{name} has bits={enc.bits}, dim={enc.dim}; this codec has "
                             f"bits={self.bits}, dim={self.dim}")
        if enc.codec_key is not None and enc.codec_key != self.key:
            names = ("seed", "layer", "head", "salt", "codebook", "rotation")
            diff = ", ".join(f"{n}={a!r} (this codec: {b!r})" for n, a, b in
                             zip(names, enc.codec_key, self.key) if a != b)
            raise ValueError(f"{name} was encoded by another codec: {diff}")
        if enc.codes.shape != (len(enc), self.words):
            raise ValueError(f"{name}.codes must have shape ({len(enc)}, {self.words}), got {enc.codes.shape}")

    def codes(self, enc: Encoded) -> np.ndarray:
        """Unpacked codes (n, d) (16 bits: the fp16 values' bit patterns)."""
        self._check_encoded(enc)
        if self.bits == 16:
            return _unpack_fp16(enc.codes, self.dim).view(np.uint16)
        return unpack_codes(enc.codes, self.bits, self.dim)

    def rotated_points(self, enc: Encoded) -> np.ndarray:
        """ĉ (n, d) in rotated coordinates, float64: C[c]/√d (16 bits: the fp16 values)."""
        self._check_encoded(enc)
        if self.bits == 16:
            return _unpack_fp16(enc.codes, self.dim).astype(np.float64)
        return self.levels[self.codes(enc)] / np.sqrt(self.dim)

    def decode(self, enc: Encoded) -> np.ndarray:
        """x̂ = Πᵀ(s·ĉ) + μ, (n, d) float64. For analysis and tests; attention never calls it."""
        self._check_encoded(enc)
        xr = enc.scale.astype(np.float64)[:, None] * self.rotated_points(enc)
        x = self.rotation.inverse(xr)
        return x if enc.mean is None else x + enc.mean.astype(np.float64)

    # ------------------------------------------------------------------ logits
    def rotate_query(self, q) -> np.ndarray:
        """Π q for rows of q (m, d), float64 — once per query per decode step."""
        return self.rotation.apply(as_float_matrix(q, "q", self.dim))

    def logits(self, q, enc: Encoded) -> np.ndarray:
        """ℓ̂[m, n] = s[n]·⟨Πq[m], ĉ[n]⟩ (+ q·μ when centred) — logits straight from codes.

        q: (m, d) float; enc: Encoded with n vectors. Returns (m, n) float64. Each term is
        a per-coordinate look-up in the table T[m, j, c] = (Πq)[m, j]·C[c]/√d; no key
        matrix is decoded (docs/ada.md)."""
        self._check_encoded(enc)
        q = as_float_matrix(q, "q", self.dim)
        qr = self.rotation.apply(q)
        out = np.empty((q.shape[0], len(enc)))
        if self.bits == 16:
            out[:] = qr @ self.rotated_points(enc).T
        else:
            table = qr[:, :, None] * (self.levels / np.sqrt(self.dim))[None, None, :]   # (m, d, L)
            codes = self.codes(enc)
            j = np.arange(self.dim)[None, :]
            step = max(1, (1 << 22) // max(1, q.shape[0] * self.dim))
            for a in range(0, len(enc), step):
                c = codes[a:a + step]
                out[:, a:a + step] = table[:, j, c].sum(axis=2)
        out *= enc.scale.astype(np.float64)[None, :]
        if enc.mean is not None:
            out += (q @ enc.mean.astype(np.float64))[:, None]
        return out

    # ------------------------------------------------------------------ error analysis
    def _radius_interval(self, enc: Encoded):
        """(r̃, Δr): the stored radius s·‖ĉ‖ and the most the true radius can differ from it
        given that s was rounded to fp16 (docs/ada.md)."""
        s = enc.scale.astype(np.float64)
        chat = np.linalg.norm(self.rotated_points(enc), axis=1)
        ds = np.maximum(s * FP16_HALF_ULP_REL, FP16_HALF_ULP_ABS)
        return s * chat, ds * chat * (1 + _SLACK) + _SLACK * s * chat

    def max_angle_error(self, enc: Encoded) -> np.ndarray:
        """Upper bound on ε_θ = ‖u − ĉ/‖ĉ‖‖ from the codes alone, (n,) float64.

        u lies on the unit sphere and in the code's cell (a box: each √d·u_j between its
        level's midpoints, |u_j| ≤ 1). ε² = 2 − 2⟨u, w⟩ with w = ĉ/‖ĉ‖, and any λ gives the
        Lagrangian lower bound min⟨u,w⟩ ≥ −λ + Σ_j min_{u_j ∈ cell_j}(w_j u_j + λu_j²)
        (weak duality for the constraint ‖u‖² = 1). The dual is concave in λ; a ternary
        search picks a good λ and every λ tried is a valid bound."""
        self._check_encoded(enc)
        if self.bits == 16:
            raise ValueError("max_angle_error is for quantised tiers; the fp16 tier is bounded "
                             "coordinate-wise in logit_error_bound")
        codes = self.codes(enc).astype(np.int64)
        edges = codebooks.boundaries(self.levels, self.dim) / np.sqrt(self.dim)
        edges[0], edges[-1] = -1.0, 1.0
        lo, hi = edges[codes], edges[codes + 1]
        w = self.levels[codes]
        w = w / np.linalg.norm(w, axis=1, keepdims=True)

        def dual(lam):                      # lam (n, 1) → (n,) lower bounds on min <u, w>
            lo_v = w * lo + lam * lo * lo
            hi_v = w * hi + lam * hi * hi
            best = np.minimum(lo_v, hi_v)
            pos = lam > 0
            ustar = np.clip(-w / (2 * np.where(pos, lam, 1.0)), lo, hi)
            in_v = w * ustar + lam * ustar * ustar
            best = np.where(pos, np.minimum(best, in_v), best)
            return best.sum(axis=1) - lam[:, 0]

        n = len(enc)
        a = np.full((n, 1), -4.0 * self.dim)
        b = np.full((n, 1), 4.0 * self.dim)
        bound = np.maximum(dual(np.zeros((n, 1))), -1.0)
        for _ in range(80):
            m1 = a + (b - a) / 3
            m2 = b - (b - a) / 3
            f1, f2 = dual(m1), dual(m2)
            bound = np.maximum(bound, np.maximum(f1, f2))
            left = (f1 < f2)[:, None]
            a = np.where(left, m1, a)
            b = np.where(left, b, m2)
        eps2 = np.clip(2.0 - 2.0 * bound, 0.0, 4.0)
        return np.sqrt(eps2) + _SLACK

    def logit_error_bound(self, q, enc: Encoded) -> np.ndarray:
        """Guaranteed |q·k − ℓ̂| for every pair, from q and the stored codes alone, (m, n).

        Quantised tiers: ‖q‖·(r̃ + Δr)·ε_max + ‖q‖·Δr (docs/ada.md, deterministic bound),
        with r̃ = s·‖ĉ‖ and Δr the fp16 rounding of s. fp16 tier: Σ_j |(Πq)_j|·δ_j with δ_j
        the fp16 rounding of the stored coordinate."""
        self._check_encoded(enc)
        q = as_float_matrix(q, "q", self.dim)
        qn = np.linalg.norm(q, axis=1)
        if self.bits == 16:
            yhat = np.abs(self.rotated_points(enc))
            delta = np.maximum(yhat * FP16_HALF_ULP_REL, FP16_HALF_ULP_ABS)
            qr = np.abs(self.rotation.apply(q))
            bound = qr @ delta.T
            return bound * (1 + _SLACK) + _SLACK * qn[:, None] * np.linalg.norm(yhat, axis=1)[None, :]
        rt, dr = self._radius_interval(enc)
        eps = self.max_angle_error(enc)
        return qn[:, None] * ((rt + dr) * eps + dr)[None, :]

    def angle_error(self, x, enc: Encoded) -> np.ndarray:
        """Exact ε_θ = ‖u − ĉ/‖ĉ‖‖ per vector, given the originals x (n, d) (0 for x = μ)."""
        x = as_float_matrix(x, "x", self.dim)
        self._check_encoded(enc)
        if len(enc) != x.shape[0]:
            raise ValueError(f"x has {x.shape[0]} rows, enc has {len(enc)} vectors")
        if enc.mean is not None:
            x = x - enc.mean.astype(np.float64)
        y = self.rotation.apply(x)
        r = np.linalg.norm(y, axis=1)
        u = y / np.where(r == 0, 1.0, r)[:, None]
        c = self.rotated_points(enc)
        cn = c / np.where(np.linalg.norm(c, axis=1) == 0, 1.0, np.linalg.norm(c, axis=1))[:, None]
        return np.where(r == 0, 0.0, np.linalg.norm(u - cn, axis=1))

    def expected_sq_logit_error(self, q, k) -> np.ndarray:
        """E over a Haar-random rotation of (q·k − ℓ̂)², fp16 scale rounding ignored, (m, n).

        = ‖k‖²·[ ‖q⊥‖²·(E[ε²] − E[ε⁴]/4)/(d − 1) + (q·k̂)²·E[ε⁴]/4 ] with k̂ = k/‖k‖ and
        q⊥ the part of q orthogonal to k (docs/ada.md). ≈ ‖q‖²‖k‖²·E[ε²]/d for large d."""
        q = as_float_matrix(q, "q", self.dim)
        k = as_float_matrix(k, "k", self.dim)
        e2 = codebooks.expected_sq_angle_error(self.bits, self.dim, self.codebook_kind)
        e4 = codebooks.expected_fourth_angle_error(self.bits, self.dim, self.codebook_kind)
        kn = np.linalg.norm(k, axis=1)
        par = (q @ k.T) / np.where(kn == 0, 1.0, kn)[None, :]
        perp2 = np.maximum(np.sum(q * q, axis=1)[:, None] - par ** 2, 0.0)
        return kn[None, :] ** 2 * (perp2 * (e2 - e4 / 4) / (self.dim - 1) + par ** 2 * e4 / 4)
