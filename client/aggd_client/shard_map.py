"""The shard map: weights of a job's aggregators, and the cut of a tensor among them (whole chunks,
largest remainder, exact fractions so every member cuts alike; docs/protocol.md, "Several
aggregators"). Pure."""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import numpy as np


@dataclass(frozen=True)
class ShardMap:
    """Weights of the aggregators, in the order of the clients (or servers) they go with."""

    weights: tuple[float, ...]
    version: int = 0

    def __post_init__(self) -> None:
        w = tuple(self.weights)
        if not w:
            raise ValueError("a shard map needs at least one aggregator")
        for i, x in enumerate(w):
            if isinstance(x, bool) or not isinstance(x, (int, float, Fraction)) or not np.isfinite(float(x)) or x < 0:
                raise ValueError(f"weight {i} must be a finite number >= 0, not {x!r}")
        if not sum(w) > 0:
            raise ValueError("at least one weight must be above 0")
        object.__setattr__(self, "weights", w)

    @classmethod
    def even(cls, k: int) -> "ShardMap":
        return cls((1,) * k)

    def chunk_counts(self, chunks: int) -> tuple[int, ...]:
        """Chunks each aggregator owns of a tensor of ``chunks`` chunks: proportional to the weights,
        rounded by largest remainder (ties to the lower index)."""
        w = [Fraction(x) for x in self.weights]
        total = sum(w)
        quotas = [chunks * x / total for x in w]
        counts = [int(q) for q in quotas]
        order = sorted(range(len(w)), key=lambda i: (-(quotas[i] - counts[i]), i))
        for i in order[:chunks - sum(counts)]:
            counts[i] += 1
        return tuple(counts)

    def cuts(self, n: int, elements: int) -> tuple[int, ...]:
        """Value offsets ``c``: aggregator ``i`` owns values ``c[i]:c[i + 1]`` of a tensor of ``n``."""
        if elements < 1:
            raise ValueError("elements must be at least 1")
        out, at = [0], 0
        for k in self.chunk_counts(-(-n // elements)):
            at += k
            out.append(min(at * elements, n))
        return tuple(out)
