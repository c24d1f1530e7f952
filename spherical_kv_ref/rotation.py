"""Seeded orthogonal rotations Π (docs/format.md "Rotation").

A power-of-two dimension gets the randomized Hadamard rotation Π = H·diag(σ)/√d, applied
in O(d log d); any other dimension (or ``kind="haar"``) gets a dense Haar-random
orthogonal matrix. Both are exactly orthogonal up to float64 rounding, so q·k = (Πq)·(Πk).
"""
from __future__ import annotations

import numpy as np

KEY_SALT = 0
VALUE_SALT = 1


def is_power_of_two(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def hadamard_transform(x: np.ndarray) -> np.ndarray:
    """Unnormalised fast Walsh–Hadamard transform along the last axis (natural order).

    x: (..., d) with d a power of two. Returns H x in float64, H[i, j] = (−1)^popcount(i&j).
    """
    y = np.array(x, dtype=np.float64, copy=True)
    d = y.shape[-1]
    if not is_power_of_two(d):
        raise ValueError(f"hadamard_transform needs a power-of-two length, got {d}")
    lead = y.shape[:-1]
    h = 1
    while h < d:
        # Butterfly on pairs (i, i+h) inside blocks of 2h: the same order the kernels use.
        y = y.reshape(*lead, d // (2 * h), 2, h)
        a = y[..., 0, :].copy()
        b = y[..., 1, :]
        y[..., 0, :] = a + b
        y[..., 1, :] = a - b
        y = y.reshape(*lead, d)
        h *= 2
    return y


def rotation_rng(seed: int, layer: int = 0, head: int = 0, salt: int = KEY_SALT):
    """The generator every rotation of (model seed, layer, kv-head, key/value) draws from."""
    for name, v in (("seed", seed), ("layer", layer), ("head", head), ("salt", salt)):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {v!r}")
    return np.random.default_rng(np.random.SeedSequence([int(seed), int(layer), int(head), int(salt)]))


class Rotation:
    """Π for one (seed, layer, kv-head, salt). ``apply`` maps rows x → Πx, ``inverse`` y → Πᵀy.

    kind: "auto" (Hadamard when d is a power of two, else Haar), "hadamard" or "haar".
    """

    def __init__(self, dim: int, seed: int = 0, layer: int = 0, head: int = 0,
                 salt: int = KEY_SALT, kind: str = "auto"):
        if int(dim) != dim or dim < 2:
            raise ValueError(f"dim must be an integer >= 2, got {dim!r}")
        dim = int(dim)
        if kind == "auto":
            kind = "hadamard" if is_power_of_two(dim) else "haar"
        if kind not in ("hadamard", "haar"):
            raise ValueError(f"rotation kind must be 'auto', 'hadamard' or 'haar', got {kind!r}")
        if kind == "hadamard" and not is_power_of_two(dim):
            raise ValueError(f"a Hadamard rotation needs a power-of-two dim, got {dim}")
        self.dim, self.kind = dim, kind
        rng = rotation_rng(seed, layer, head, salt)
        if kind == "hadamard":
            self.signs = (1 - 2 * rng.integers(0, 2, dim)).astype(np.int8)
            self.matrix = None
        else:
            g = rng.standard_normal((dim, dim))
            qm, rm = np.linalg.qr(g)
            self.matrix = qm * np.sign(np.diag(rm))[None, :]
            self.signs = None

    def apply(self, x: np.ndarray) -> np.ndarray:
        """Rows of x (..., d) → rows of Πx, float64."""
        x = np.asarray(x, dtype=np.float64)
        if self.kind == "hadamard":
            return hadamard_transform(x * self.signs) / np.sqrt(self.dim)
        return x @ self.matrix.T

    def inverse(self, y: np.ndarray) -> np.ndarray:
        """Rows of y (..., d) → rows of Πᵀy, float64."""
        y = np.asarray(y, dtype=np.float64)
        if self.kind == "hadamard":
            return hadamard_transform(y) * self.signs / np.sqrt(self.dim)
        return y @ self.matrix

    def dense(self) -> np.ndarray:
        """Π as a (d, d) matrix (tests and analysis)."""
        return self.apply(np.eye(self.dim)).T
