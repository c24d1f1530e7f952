"""Named cases declared once: the conformance vectors, the unit tests and the benchmarks
all build their inputs from here, so they cannot drift apart.

A case is (op, shape parameters, seed). ``build(case)`` returns the inputs and the
reference outputs as a dict of NumPy arrays; ``TOLERANCE[op]`` says how a port must match
(integers and fp16 exactly, float64 outputs to a relative tolerance).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from .ada import attention
from .codec import SphericalCodec
from .rotation import KEY_SALT, VALUE_SALT

OPS = ("encode", "logits", "attention")
# Relative tolerance for float outputs of a port computing in float64 / float32.
TOLERANCE = {"encode": 0.0, "logits": 1e-12, "attention": 1e-12}


@dataclass(frozen=True)
class Case:
    op: str
    dim: int
    key_bits: int
    value_bits: int = 0
    n: int = 17
    m: int = 4
    seed: int = 0
    centred: bool = True
    spike: bool = False          # one huge channel in the keys (a hard, real-model-like input)

    @property
    def name(self) -> str:
        bits = f"k{self.key_bits}" + (f"v{self.value_bits}" if self.value_bits else "")
        extra = ("_c" if self.centred else "") + ("_spike" if self.spike else "")
        return f"{self.op}_d{self.dim}_{bits}_n{self.n}_m{self.m}_s{self.seed}{extra}"

    def params(self) -> dict:
        return asdict(self)


def _inputs(case: Case):
    rng = np.random.default_rng(np.random.SeedSequence([case.seed, case.dim, case.n]))
    k = rng.standard_normal((case.n, case.dim)) + 0.5
    if case.spike:
        k[:, 0] *= 40.0
    v = rng.standard_normal((case.n, case.dim))
    q = rng.standard_normal((case.m, case.dim))
    return q, k, v


def _stored(prefix: str, codec: SphericalCodec, enc) -> dict:
    """The arrays a port needs to reproduce one encoded set: scale, codes, and the codec's
    levels, rotation signs and the centring mean where they exist."""
    out = {f"{prefix}_scale": enc.scale, f"{prefix}_codes": enc.codes}
    for name, a in (("levels", codec.levels), ("signs", codec.signs), ("mean", enc.mean)):
        if a is not None:
            out[f"{prefix}_{name}"] = a
    return out


def build(case: Case) -> dict:
    """Inputs and reference outputs of one case, as named NumPy arrays."""
    if case.op not in OPS:
        raise ValueError(f"unknown op {case.op!r}; expected one of {OPS}")
    q, k, v = _inputs(case)
    kc = SphericalCodec(case.dim, case.key_bits, case.seed, salt=KEY_SALT)
    ke = kc.encode(k, mean=k.mean(axis=0) if case.centred else None)
    out = {"k": k, **_stored("key", kc, ke)}
    if case.op in ("logits", "attention"):
        out["q"] = q
    if case.op == "logits":
        out["logits"] = kc.logits(q, ke)
    if case.op == "attention":
        vc = SphericalCodec(case.dim, case.value_bits, case.seed, salt=VALUE_SALT)
        ve = vc.encode(v, mean=v.mean(axis=0) if case.centred else None)
        out.update(v=v, attention=attention(q, ke, ve, kc, vc), **_stored("value", vc, ve))
    return out


CASES = (
    [Case("encode", d, b, n=n, seed=s, centred=c)
     for d, n in ((64, 1), (128, 17), (96, 33)) for b in (1, 2, 3, 4, 8, 16)
     for s, c in ((0, False), (1, True))]
    + [Case("encode", 128, 4, n=97, seed=2, spike=True)]
    + [Case("logits", d, b, n=97, m=4, seed=3) for d in (64, 128) for b in (2, 3, 4, 16)]
    + [Case("attention", d, kb, vb, n=n, m=m, seed=5)
       for d, n, m in ((64, 17, 3), (128, 97, 4)) for kb, vb in ((4, 2), (3, 3), (4, 4), (8, 8), (16, 16))]
)
