"""When to move partitions between a job's aggregators: observations in, a new shard map out. Pure
(no I/O, no clock): ``aggd_client.shards`` feeds it a member's own timings and asks it at agreed
calls; tests feed it reference sequences.

An observation is, per aggregator, the values its part held and the seconds the part took from the
call to its last result. A part takes a fixed cost (the round trip, the call's own work) plus its
values over the aggregator's service rate, so the policy fits ``seconds = fixed + values / rate``
per aggregator over exponentially weighted observations, and takes the rate from the slope once
its parts' sizes spread enough to show one (values over seconds before that). Values over seconds
alone counts the fixed cost against the aggregator with the smaller part: with small tensors its
rate looked lower the less it had, and the map ran away to 978:22 between two equal hosts. The
policy measures the map in force by the time each part is expected to take, its share over its
rate. When the slowest part is expected to take more than ``1 + tolerance`` times
the fastest for ``patience`` checks running (hysteresis: one noisy round moves nothing), it proposes
weights proportional to the rates, in whole thousandths, no share below ``floor`` (a slow
aggregator keeps a trickle, so its rate stays measured). A drained aggregator (weight 0) stays
drained: the policy never gives it weight back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .shard_map import ShardMap

RESOLUTION = 1000   #: weights are whole parts of this
#: The parts' sizes must spread by this much of their mean (a standard deviation) for a slope.
SPREAD = 0.1


@dataclass(frozen=True)
class Decision:
    shard_map: ShardMap | None   #: the map to switch to, or None: keep the one in force
    reason: str


class RebalancePolicy:
    """``observe(values, seconds)`` after calls, ``decide(current)`` at the agreed ones."""

    def __init__(self, aggregators: int, *, alpha: float = 0.5, tolerance: float = 0.25, patience: int = 2,
                 floor: float = 0.02):
        if aggregators < 1:
            raise ValueError("aggregators must be at least 1")
        if not 0 < alpha <= 1 or tolerance <= 0 or patience < 1 or not 0 <= floor < 1 / aggregators:
            raise ValueError("alpha in (0, 1], tolerance > 0, patience >= 1, floor in [0, 1/aggregators)")
        self.k, self.alpha, self.tolerance, self.patience, self.floor = aggregators, alpha, tolerance, patience, floor
        self.rates: list[float | None] = [None] * aggregators
        #: per aggregator, the weighted sums of the fit: weight, values, seconds, values^2, values x seconds
        self._sums: list[list[float]] = [[0.0] * 5 for _ in range(aggregators)]
        self.streak = 0

    def grow(self) -> None:
        """One more aggregator (scale out): its rate is not known yet."""
        self.k += 1
        self.rates.append(None)
        self._sums.append([0.0] * 5)
        self.streak = 0

    def observe(self, values: Sequence[int], seconds: Sequence[float]) -> None:
        """One call: the values each aggregator's part held (0: it had none) and its seconds."""
        if len(values) != self.k or len(seconds) != self.k:
            raise ValueError(f"one observation an aggregator ({self.k})")
        for i, (n, t) in enumerate(zip(values, seconds)):
            if n <= 0 or not t > 0:
                continue
            sums = self._sums[i]
            for j, x in enumerate((1.0, n, t, n * n, n * t)):
                sums[j] = (1 - self.alpha) * sums[j] + self.alpha * x
            self.rates[i] = self._rate(sums)

    @staticmethod
    def _rate(sums: list[float]) -> float:
        """The service rate the weighted observations give: one over the fitted slope of seconds
        against values when the values spread by at least SPREAD of their mean and the slope is
        positive; else values over seconds."""
        w, sx, sy, sxx, sxy = sums
        mean_x, mean_y = sx / w, sy / w
        var_x = sxx / w - mean_x * mean_x
        if var_x > (SPREAD * mean_x) ** 2:
            slope = (sxy / w - mean_x * mean_y) / var_x
            if slope > 0:
                return 1.0 / slope
        return sx / sy

    def decide(self, current: ShardMap) -> Decision:
        if len(current.weights) != self.k:
            raise ValueError(f"the map has {len(current.weights)} weights for {self.k} aggregators")
        total = sum(current.weights)
        live = [i for i, w in enumerate(current.weights) if w > 0]
        unknown = [i for i in live if self.rates[i] is None]
        if unknown:
            self.streak = 0
            return Decision(None, f"no service rate yet for aggregator{'s' if len(unknown) > 1 else ''} "
                                  f"{', '.join(map(str, unknown))}")
        if len(live) < 2:
            return Decision(None, "one aggregator in use: nothing to balance")
        expected = {i: current.weights[i] / total / self.rates[i] for i in live}
        slow = max(live, key=lambda i: (expected[i], -i))
        fast = min(live, key=lambda i: (expected[i], i))
        ratio = expected[slow] / expected[fast]
        if ratio <= 1 + self.tolerance:
            self.streak = 0
            return Decision(None, f"balanced: the slowest part takes {ratio:.2f}x the fastest's time "
                                  f"(tolerance {1 + self.tolerance:.2f}x)")
        self.streak += 1
        if self.streak < self.patience:
            return Decision(None, f"aggregator {slow}'s part takes {ratio:.2f}x aggregator {fast}'s: "
                                  f"{self.streak} of {self.patience} checks before moving partitions")
        self.streak = 0
        new = self._weights(live)
        if new == tuple(current.weights):
            return Decision(None, f"aggregator {slow}'s part takes {ratio:.2f}x aggregator {fast}'s, "
                                  f"but the rates give the same weights {new}")
        return Decision(ShardMap(new, current.version + 1),
                        f"aggregator {slow}'s part takes {ratio:.2f}x aggregator {fast}'s: weights "
                        f"{tuple(current.weights)} -> {new} (rates {', '.join(f'{r:.3g}' for r in self.rates if r)} "
                        f"values/s)")

    def _weights(self, live: list[int]) -> tuple[int, ...]:
        """Shares proportional to the rates of the aggregators in use, none below ``floor``, in
        whole thousandths summing to RESOLUTION (largest remainder, ties to the lower index)."""
        rate_sum = sum(self.rates[i] for i in live)
        share = {i: self.rates[i] / rate_sum for i in live}
        low = [i for i in live if share[i] < self.floor]
        if low:  # lift those to the floor, take it from the others in proportion
            rest = [i for i in live if i not in low]
            spare = 1 - self.floor * len(low)
            rest_sum = sum(share[i] for i in rest)
            share = {**{i: self.floor for i in low}, **{i: share[i] / rest_sum * spare for i in rest}}
        quotas = {i: share[i] * RESOLUTION for i in live}
        out = {i: int(q) for i, q in quotas.items()}
        for i in sorted(live, key=lambda i: (-(quotas[i] - out[i]), i))[:RESOLUTION - sum(out.values())]:
            out[i] += 1
        return tuple(out.get(i, 0) for i in range(self.k))
