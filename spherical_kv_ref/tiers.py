"""The tier ladder: (key_bits, value_bits) per tier and exact bytes per state (docs/format.md "Tier ladder and pages")."""
from __future__ import annotations

import numpy as np

from .codec import BITS, vector_bytes, whole


class TierLadder:
    """Tiers 1..T as (key_bits, value_bits), ascending in bytes; tier 0 means evicted.

    The last tier is the top tier where protected states live. Configuration, not code:
    any list of bit pairs from {1, 2, 3, 4, 8, 16} whose bytes strictly increase."""

    DEFAULT = ((2, 2), (3, 2), (4, 2), (4, 3), (4, 4), (8, 8), (16, 16))

    def __init__(self, tiers=DEFAULT):
        tiers = [tuple(int(b) for b in t) for t in tiers]
        if not tiers:
            raise ValueError("a tier ladder needs at least one tier")
        for t in tiers:
            if len(t) != 2 or t[0] not in BITS or t[1] not in BITS:
                raise ValueError(f"each tier is (key_bits, value_bits) with bits in {BITS}, got {t}")
        sizes = [vector_bytes(k, 64) + vector_bytes(v, 64) for k, v in tiers]
        if any(b <= a for a, b in zip(sizes, sizes[1:])):
            raise ValueError(f"tiers must be strictly ascending in bytes, got {tiers}")
        self.tiers = tuple(tiers)

    def __len__(self) -> int:
        return len(self.tiers)

    def __repr__(self) -> str:
        return f"TierLadder({list(self.tiers)})"

    @property
    def top(self) -> int:
        """Index of the top tier (= number of tiers)."""
        return len(self.tiers)

    def bits(self, tier: int):
        """(key_bits, value_bits) of tier 1..T."""
        return self.tiers[whole("tier", tier, 1, len(self.tiers) + 1) - 1]

    def bytes_per_state(self, tier: int, dim: int) -> int:
        """Bytes of one (key, value) state at this tier: codes + fp16 scales; 0 if evicted."""
        if whole("tier", tier, 0, len(self.tiers) + 1) == 0:
            return 0
        kb, vb = self.bits(tier)
        return vector_bytes(kb, dim) + vector_bytes(vb, dim)

    def costs(self, dim: int) -> np.ndarray:
        """Bytes per state for options 0..T (column order of an RDR problem), int64."""
        return np.array([self.bytes_per_state(t, dim) for t in range(len(self.tiers) + 1)], np.int64)

    def states_per_page(self, tier: int, dim: int, page_bytes: int) -> int:
        """States one page of this tier holds (docs/format.md "Pages")."""
        per = self.bytes_per_state(tier, dim)
        if per == 0:
            raise ValueError("evicted states occupy no page")
        return states_per_page(per, page_bytes, tier)


def states_per_page(state_bytes: int, page_bytes: int, tier: int) -> int:
    """⌊page_bytes / state_bytes⌋, the states one page of a tier holds (docs/format.md
    "Pages"); ValueError if not one fits. The rule every page geometry follows
    (``paged.tier_layout``)."""
    n = whole("page_bytes", page_bytes, 1) // state_bytes
    if n < 1:
        raise ValueError(f"page_bytes={page_bytes} cannot hold one state of tier {tier} "
                         f"({state_bytes} bytes)")
    return n
