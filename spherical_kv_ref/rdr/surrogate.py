"""The distortion surrogate D[i, t] of RDR and its per-tier error constants (docs/rdr.md §1)."""
from __future__ import annotations

import numpy as np

def _stat(name, x, n):
    a = np.asarray(x, dtype=np.float64)
    if a.ndim > 1:
        raise ValueError(f"{name} must be a scalar or 1-D per-state array, got shape {a.shape}")
    a = np.broadcast_to(a, (n,)) if a.ndim == 0 else a
    if a.shape != (n,):
        raise ValueError(f"{name} has {a.shape[0]} entries, expected {n} (one per state)")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name} has NaN or infinite entries (first at state "
                         f"{int(np.flatnonzero(~np.isfinite(a))[0])})")
    if np.any(a < 0):
        raise ValueError(f"{name} must be non-negative")
    return a

#: log of float64's largest value: e^x overflows past it
LOG_FLOAT_MAX = float(np.log(np.finfo(float).max))
#: the ceiling of every surrogate distortion: float64's largest value / 2^64, so that the
#: solvers' sums over up to 2^64 states and their differences stay finite. An entry there
#: is an error past measure (a key tier whose logit error is astronomically large, as
#: with key norms in the hundreds): evicting, or a tier below the ceiling, is preferred
DISTORTION_MAX = float(np.ldexp(np.finfo(float).max, -64))


def distortion(attn_prob, query_sq_norm, key_radius, value_norm, value_residual,
               key_error, value_error, dim, softmax_scale=None, eviction_factor=1.0,
               key_term="linear"):
    """Surrogate attention-output error D[i, t] per state and option (docs/rdr.md).

        D[i, 0] = κ_i · p_i² · ‖v_i − o‖²                                     (evicted)
        D[i, t] = p_i² · ( s² · Q_i² · r_i² · eK[t]/d · ‖v_i − o‖²  +  ‖v_i‖² · eV[t] )

    with s the softmax scale (logits are s·q·k), eK[t], eV[t] = E[ε_θ²] of tier t's key and
    value codes. First-order expected squared change of the attention output o = Σ_j p_j v_j;
    with ``softmax_scale=1`` it is the design's formula verbatim (Q² of a pre-scaled query).

    attn_prob, query_sq_norm, key_radius, value_norm, value_residual: (n,) or scalars — the
    estimated attention probability p_i (GQA-group mean), ‖q‖² estimate of the head (raw
    query), key radius r_i (after centring), ‖v_i‖ (after centring) and ‖v_i − o‖.
    key_error, value_error: (T,) E[ε_θ²] of the key and value code of tiers 1..T (plain
    arrays; :func:`tier_error_constants` builds them from a ladder).
    dim: head dimension d. softmax_scale: default 1/√d.
    eviction_factor: κ_i ≥ 1, scalar or (n,): how much more the evictions of a row cost
    than their independent squares. Code errors come from random rotations and add in
    quadrature; the output shifts of evicted states do not (they share a direction), and
    ``SphericalKVCache`` measures κ per row on its observed queries (docs/rdr.md §1).
    key_term: "linear" (the first-order term σ², σ² = s²·Q²·r²·eK/d the logit-error
    variance) or "lognormal": E[(e^δ − 1)²] = e^{2σ²} − 2e^{σ²/2} + 1 for δ ~ N(0, σ²),
    the squared change of the state's softmax weight to all orders (equal to σ² + O(σ⁴);
    at 2 bits on SmolLM2 σ² reaches ~1, where it is several times the first-order term).
    Returns D (n, T+1) float64, column 0 = evict, every entry at most ``DISTORTION_MAX``
    (finite statistics always give a finite problem, however large).
    """
    if key_term not in ("linear", "lognormal"):
        raise ValueError(f"key_term must be 'linear' or 'lognormal', got {key_term!r}")
    dim = int(dim)
    if dim < 1:
        raise ValueError(f"dim must be a positive integer, got {dim}")
    n = np.asarray(attn_prob).shape[0] if np.ndim(attn_prob) else None
    for x in (query_sq_norm, key_radius, value_norm, value_residual):
        if n is None and np.ndim(x):
            n = np.asarray(x).shape[0]
    n = 1 if n is None else n
    p = _stat("attn_prob", attn_prob, n)
    q2 = _stat("query_sq_norm", query_sq_norm, n)
    r = _stat("key_radius", key_radius, n)
    vn = _stat("value_norm", value_norm, n)
    res = _stat("value_residual", value_residual, n)
    ek = np.asarray(key_error, dtype=np.float64)
    ev = np.asarray(value_error, dtype=np.float64)
    if ek.ndim != 1 or ev.shape != ek.shape or ek.size == 0:
        raise ValueError(f"key_error and value_error must be 1-D of equal length T >= 1, "
                         f"got shapes {ek.shape} and {ev.shape}")
    if not (np.all(np.isfinite(ek)) and np.all(np.isfinite(ev))) or np.any(ek < 0) or np.any(ev < 0):
        raise ValueError("key_error and value_error must be finite and non-negative")
    s = 1.0 / np.sqrt(dim) if softmax_scale is None else float(softmax_scale)
    if not np.isfinite(s) or s <= 0:
        raise ValueError(f"softmax_scale must be positive and finite, got {softmax_scale!r}")
    kappa = _stat("eviction_factor", eviction_factor, n)
    if np.any(kappa < 1.0):
        raise ValueError("eviction_factor must be >= 1 (evictions add at least in quadrature)")
    p2 = p * p
    res2 = res * res
    out = np.empty((n, ek.size + 1))
    out[:, 0] = kappa * p2 * res2
    logit_var = (s * s) * q2 * r * r / dim                  # E[δ²] per unit E[ε_θ²]
    sigma2 = logit_var[:, None] * ek[None, :]
    if key_term == "lognormal":
        # e^{2σ²} overflows past σ² ≈ 354.9 (the term is then past float's range: its
        # largest value); without the cut, past σ² ≈ 1419.6 both terms overflow and inf − inf
        # would be NaN
        big = 2.0 * sigma2 > LOG_FLOAT_MAX
        with np.errstate(over="ignore", invalid="ignore"):
            lognormal = np.expm1(2.0 * sigma2) - 2.0 * np.expm1(0.5 * sigma2)
        sigma2 = np.where(big, DISTORTION_MAX, np.minimum(lognormal, DISTORTION_MAX))
    with np.errstate(over="ignore"):            # an inf here is capped (no 0 · inf: p ≤ 1)
        inner = res2[:, None] * sigma2 + (vn * vn)[:, None] * ev[None, :]
    out[:, 1:] = p2[:, None] * np.minimum(inner, DISTORTION_MAX)
    return np.minimum(out, DISTORTION_MAX, out=out)


def tier_error_constants(ladder, dim, error=None, kind="lloyd-max"):
    """(eK, eV), each (T,): E[ε_θ²] of the key and value code of every tier of a ladder.

    ladder: sequence of (key_bits, value_bits), tiers 1..T. error: callable
    ``error(bits, dim) -> E[ε_θ²]``, or a mapping bits → constant; by default the codec's
    ``codebooks.expected_sq_angle_error(bits, dim, kind)`` (imported here, lazily).
    """
    pairs = [tuple(int(b) for b in pair) for pair in ladder]
    if not pairs or any(len(pair) != 2 for pair in pairs):
        raise ValueError("ladder must be a non-empty sequence of (key_bits, value_bits)")
    if error is None:
        from ..codebooks import expected_sq_angle_error

        def error(bits, d):
            return expected_sq_angle_error(bits, d, kind)
    elif not callable(error):
        table = dict(error)

        def error(bits, d):
            if bits not in table:
                raise ValueError(f"no error constant given for {bits} bits")
            return table[bits]
    cache = {}
    for b in {b for pair in pairs for b in pair}:
        cache[b] = float(error(b, int(dim)))
    return (np.array([cache[k] for k, _ in pairs]), np.array([cache[v] for _, v in pairs]))
