"""A synthetic RDR case, declared once for tests, benchmarks and validation."""
from __future__ import annotations

import numpy as np

from .problem import Problem
from .surrogate import distortion, tier_error_constants

#: The documented example ladder and the E[ε_θ²] of its codes (docs/ada.md values at large d;
#: fp16 from its rounding), so the case does not depend on the codec's numerics.
EXAMPLE_LADDER = ((2, 2), (3, 3), (4, 4), (8, 8), (16, 16))
EXAMPLE_ERROR = {2: 0.12, 3: 0.035, 4: 0.0095, 8: 3.7e-5, 16: 2e-8}


def _example_bytes(bits, dim):
    return 2 * dim if bits == 16 else 4 * ((bits * dim + 31) // 32) + 2


def synthetic_problem(num_states, num_groups=16, dim=128, budget_fraction=0.2,
                      page_bytes=4096, sinks=4, recent=16, seed=0):
    """A surrogate-shaped RDR instance: num_states split evenly over num_groups groups of
    tokens, heavy-tailed attention, log-normal radii and norms, the example ladder, sinks
    and a recent window protected; budget = budget_fraction of keeping every state at the
    top tier. Deterministic in seed."""
    rng = np.random.default_rng(np.random.SeedSequence([0x5D5, num_states, num_groups, seed]))
    n = int(num_states)
    group = np.repeat(np.arange(num_groups), -(-n // num_groups))[:n]
    pos = np.arange(n) - np.searchsorted(group, group)
    size = np.bincount(group, minlength=num_groups)[group]
    logit = rng.gumbel(size=n) * 2.0 + np.where(pos < sinks, 6.0, 0.0)
    p = np.exp(logit - logit.max())
    p /= np.bincount(group, weights=p)[group]
    layer_scale = rng.lognormal(0.0, 0.5, num_groups)[group]
    q2 = float(dim) * layer_scale
    r = rng.lognormal(np.log(np.sqrt(dim)), 0.3, n)
    vn = rng.lognormal(0.0, 0.4, n)
    res = vn * rng.uniform(0.5, 1.5, n)
    ek, ev = tier_error_constants(EXAMPLE_LADDER, dim, error=EXAMPLE_ERROR)
    d = distortion(p, q2, r, vn, res, ek, ev, dim)
    cost = np.array([0] + [_example_bytes(kb, dim) + _example_bytes(vb, dim)
                           for kb, vb in EXAMPLE_LADDER])
    protected = (pos < sinks) | (pos >= size - recent)
    budget = int(budget_fraction * n * cost[-1])
    return Problem(d, cost, group, protected, budget, page_bytes)
