"""Scalar codebooks for one coordinate of a uniform point on S^{d−1} (docs/format.md "Scalar codebook").

If u is uniform on the sphere, t = √d·u_j has density
    f_d(t) = c_d · (1 − t²/d)^((d−3)/2)  on [−√d, √d],   c_d = Γ(d/2) / (√(πd) Γ((d−1)/2)),
with E[t²] = 1. Both the cell probability and the cell's first moment have closed forms:
    F(t) = ½ + ½·sign(t)·I_{t²/d}(½, (d−1)/2)              (regularised incomplete beta)
    M(t) = ∫_{−√d}^{t} s f_d(s) ds = −c_d · d/(d−1) · (1 − t²/d)^((d−1)/2),
so Lloyd–Max iterates on exact integrals, no quadrature.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
from scipy import linalg, optimize, special

BITS = (1, 2, 3, 4, 8)
KINDS = ("lloyd-max", "uniform")


def _check(bits: int, dim: int, kind: str) -> None:
    if bits not in BITS:
        raise ValueError(f"codebook bits must be one of {BITS}, got {bits!r}")
    if int(dim) != dim or dim < 4:
        raise ValueError(f"codebook dim must be an integer >= 4, got {dim!r}")
    if kind not in KINDS:
        raise ValueError(f"codebook kind must be one of {KINDS}, got {kind!r}")


def marginal_pdf(t: np.ndarray, dim: int) -> np.ndarray:
    """Density f_d(t) of √d·u_j for u uniform on S^{d−1}."""
    t = np.asarray(t, dtype=np.float64)
    logc = special.gammaln(dim / 2) - special.gammaln((dim - 1) / 2) - 0.5 * np.log(np.pi * dim)
    inside = np.abs(t) < np.sqrt(dim)
    base = np.where(inside, 1.0 - t * t / dim, 1.0)
    return np.where(inside, np.exp(logc) * base ** ((dim - 3) / 2), 0.0)


def marginal_cdf(t: np.ndarray, dim: int) -> np.ndarray:
    t = np.clip(np.asarray(t, dtype=np.float64), -np.sqrt(dim), np.sqrt(dim))
    x = np.minimum(t * t / dim, 1.0)     # (√d)² can round just above d
    return 0.5 + 0.5 * np.sign(t) * special.betainc(0.5, (dim - 1) / 2, x)


def marginal_first_moment(t: np.ndarray, dim: int) -> np.ndarray:
    """M(t) = ∫_{−√d}^{t} s f_d(s) ds (closed form)."""
    t = np.clip(np.asarray(t, dtype=np.float64), -np.sqrt(dim), np.sqrt(dim))
    logc = special.gammaln(dim / 2) - special.gammaln((dim - 1) / 2) - 0.5 * np.log(np.pi * dim)
    return -np.exp(logc) * dim / (dim - 1) * np.maximum(1.0 - t * t / dim, 0.0) ** ((dim - 1) / 2)


def boundaries(levels: np.ndarray, dim: int) -> np.ndarray:
    """Cell edges (L+1,) of nearest-level quantisation: ±√d outside, midpoints inside."""
    mid = 0.5 * (levels[1:] + levels[:-1])
    return np.concatenate([[-np.sqrt(dim)], mid, [np.sqrt(dim)]])


def cell_moments(levels: np.ndarray, dim: int):
    """(P_i, m_i): probability and first moment of t over each level's cell."""
    e = boundaries(levels, dim)
    return np.diff(marginal_cdf(e, dim)), np.diff(marginal_first_moment(e, dim))


def mse(levels: np.ndarray, dim: int) -> float:
    """E[(t − C(t))²] under f_d with nearest-level quantisation (E[t²] = 1)."""
    p, m = cell_moments(levels, dim)
    return float(1.0 - np.sum(2.0 * levels * m - levels * levels * p))


def _centroids(levels: np.ndarray, dim: int) -> np.ndarray:
    p, m = cell_moments(levels, dim)
    c = m / p
    return 0.5 * (c - c[::-1])                 # the density is even: keep the codebook odd


@lru_cache(maxsize=None)
def _lloyd_max(bits: int, dim: int) -> np.ndarray:
    """Fixed point x = G(x) of the Lloyd map (centroids of the midpoint cells).

    A few plain Lloyd steps, then Newton on G(x) − x with G's exact tridiagonal Jacobian:
    ∂c_i/∂e_{i+1} = f(e_{i+1})(e_{i+1} − c_i)/P_i, ∂c_i/∂e_i = f(e_i)(c_i − e_i)/P_i, and
    each inner edge is the midpoint of its two levels (∂e/∂x = ½)."""
    n = 2 ** bits
    q = (np.arange(n) + 0.5) / n
    levels = np.sqrt(2.0) * special.erfinv(2.0 * q - 1.0)   # Gaussian quantiles as a start
    levels = np.clip(levels, -0.99 * np.sqrt(dim), 0.99 * np.sqrt(dim))
    for _ in range(20):
        levels = _centroids(levels, dim)
    best_err, best, stall = np.inf, levels, 0
    for _ in range(60):
        g = _centroids(levels, dim)
        resid = g - levels
        err = np.max(np.abs(resid))
        if err < 1e-13:
            return g
        stall = 0 if err < 0.5 * best_err else stall + 1
        if err < best_err:
            best_err, best = err, g
        if stall > 4:                            # at the float64 rounding floor
            break
        e = boundaries(levels, dim)
        p, _ = cell_moments(levels, dim)
        f = marginal_pdf(e, dim)
        upper = f[1:] * (e[1:] - g) / p          # ∂c_i/∂e_{i+1}
        lower = f[:-1] * (g - e[:-1]) / p        # ∂c_i/∂e_i
        # (J − I) is tridiagonal: solve it banded, O(2^bits)
        band = np.zeros((3, n))
        band[1, :] = -1.0
        band[1, :-1] += 0.5 * upper[:-1]
        band[0, 1:] += 0.5 * upper[:-1]          # row i, column i+1
        band[1, 1:] += 0.5 * lower[1:]
        band[2, :-1] += 0.5 * lower[1:]          # row i+1, column i
        step = linalg.solve_banded((1, 1), band, -resid)
        levels = levels + step
        levels = 0.5 * (levels - levels[::-1])
    if best_err < 1e-10:
        return best
    raise RuntimeError(f"Lloyd–Max did not converge for bits={bits}, dim={dim}")


@lru_cache(maxsize=None)
def _uniform(bits: int, dim: int) -> np.ndarray:
    n = 2 ** bits
    grid = (2 * np.arange(n) + 1 - n) / n

    def cost(alpha):
        return mse(alpha * grid, dim)

    res = optimize.minimize_scalar(cost, bounds=(1e-3, np.sqrt(dim)), method="bounded",
                                   options={"xatol": 1e-12})
    return res.x * grid


def codebook(bits: int, dim: int, kind: str = "lloyd-max") -> np.ndarray:
    """The 2^bits ascending levels (float64) for t = √d·u_j. Returns a fresh copy."""
    _check(bits, dim, kind)
    levels = _lloyd_max(bits, int(dim)) if kind == "lloyd-max" else _uniform(bits, int(dim))
    return levels.copy()


def quantize(t: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """Nearest level index; a tie at a midpoint goes to the lower code (docs/format.md)."""
    mid = 0.5 * (levels[1:] + levels[:-1])
    return np.searchsorted(mid, t, side="left").astype(np.uint8 if len(levels) <= 256 else np.uint16)


@lru_cache(maxsize=None)
def _angle_error_moments(bits: int, dim: int, kind: str, samples: int = 1 << 16):
    """(E[ε²], E[ε⁴]) for u uniform on S^{d−1}, by a seeded Monte Carlo over the codebook.

    ε = ‖u − ĉ/‖ĉ‖‖ with ĉ = C[Q(√d u)]/√d (bits 16: ĉ = fp16(u)). The draw is fixed
    (seed 0), so the constant is a deterministic function of (bits, dim, kind).
    """
    rng = np.random.default_rng(np.random.SeedSequence([0xA11, bits, dim]))
    levels = None if bits == 16 else codebook(bits, dim, kind)
    acc2 = acc4 = 0.0
    chunk = max(1, (1 << 22) // dim)
    done = 0
    while done < samples:
        k = min(chunk, samples - done)
        g = rng.standard_normal((k, dim))
        u = g / np.linalg.norm(g, axis=1, keepdims=True)
        if bits == 16:
            c = u.astype(np.float16).astype(np.float64)
        else:
            c = levels[quantize(np.sqrt(dim) * u, levels)]
        cos = np.sum(u * c, axis=1) / np.linalg.norm(c, axis=1)
        eps2 = np.maximum(2.0 - 2.0 * cos, 0.0)
        acc2 += eps2.sum()
        acc4 += (eps2 * eps2).sum()
        done += k
    return acc2 / samples, acc4 / samples


def expected_sq_angle_error(bits: int, dim: int, kind: str = "lloyd-max") -> float:
    """E[ε_θ²] over u uniform on S^{d−1} for a (bits, dim, kind) code (docs/ada.md).

    bits in {1, 2, 3, 4, 8} or 16 (the fp16 top tier)."""
    if bits != 16:
        _check(bits, dim, kind)
    return float(_angle_error_moments(int(bits), int(dim), kind if bits != 16 else "fp16")[0])


def expected_fourth_angle_error(bits: int, dim: int, kind: str = "lloyd-max") -> float:
    """E[ε_θ⁴], the second term of the exact expected logit error (docs/ada.md)."""
    if bits != 16:
        _check(bits, dim, kind)
    return float(_angle_error_moments(int(bits), int(dim), kind if bits != 16 else "fp16")[1])


def leading_order_sq_angle_error(bits: int, dim: int, kind: str = "lloyd-max") -> float:
    """Closed-form large-d value 2 − 2·E[tC(t)]/√E[C(t)²] (= 2 − 2√(1 − D) for Lloyd–Max)."""
    levels = codebook(bits, dim, kind)
    p, m = cell_moments(levels, dim)
    return float(2.0 - 2.0 * np.sum(levels * m) / np.sqrt(np.sum(levels * levels * p)))
