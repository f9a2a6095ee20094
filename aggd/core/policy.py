"""Dynamic hybrid synchronization: when to switch a job's strategy because of stragglers.

A policy is plain data (the ``[policy]`` section of the daemon's config, :class:`PolicyRules`); the
logic (:class:`JobPolicy`) takes the straggler detector's observations (``aggd.core.straggler``) one by
one and answers with a :class:`Decision` (switch to this strategy, for this reason) or None. It does
no I/O, so it is tested against reference sequences of observations. The daemon's
``aggd.daemon.policy_runner.PolicyRunner`` is the one I/O edge: a thread that reads the data plane's
per-member counters, runs the detector and the policy of every job, and applies decisions through
the service's hot swap.

The rules (defaults in brackets, all in the config):

* a member is *slow* while the detector flags it: its steps take at least ``slow_factor`` [1.5]
  times the median member's;
* a job running its own strategy (``sync``) whose slow members have all been slow for
  ``slow_rounds`` [8] rounds, and that are at most ``max_stragglers`` [a quarter of the world, at
  least one], switches to ``switch_to`` [``quorum:n-s``: releases without the ``s`` stragglers,
  whose late gradients are carried into the next round; ``n`` is the world size]. More slow members
  than that is a slow job, not a straggler: nothing changes;
* a job the policy switched goes back to its own strategy once every member has been even (below
  ``even_factor`` [1.35] times the median: hysteresis, so an estimate near ``slow_factor`` does not
  flap the job) for ``even_rounds`` [30] rounds, *and* over the last ``even_rounds`` rounds under
  the switched strategy every member made at least ``1 / even_factor`` as many contributions as the
  median member (members declared gone aside). The readings alone are not evidence enough under a
  quorum: the detector's rate view forgives one round's worth of contributions an interval (a
  snapshot may fall between members' sends), so with few rounds an interval it reads a steady
  straggler well below its rate (1.6x as about 1.2x at 5 rounds an interval), and the job went back
  to ``sync``, where the waiting showed again, then to the quorum again. Counted over
  ``even_rounds`` rounds, a snapshot's phase weighs one contribution at either end. The job also
  follows a change in the number of stragglers (``quorum:n-s`` names another quorum) once that
  holds for ``slow_rounds``;
* no two switches of a job less than ``min_rounds_between`` [20] rounds or ``min_seconds_between``
  [2] seconds apart, and ``settle_rounds`` [4] rounds after a switch takes effect are not judged
  (members adapt to the new strategy);
* the policy manages jobs whose own strategy is ``sync`` and whose name matches ``jobs`` [``*``];
  a strategy set by hand (``aggctl strategy set``) becomes the job's own and resets the policy.

Every decision carries its reason (``rank 3 (3.1x) slower than 1.5x the median for 12 rounds``);
the runner logs it and keeps the last ones for ``aggctl workers`` and ``aggctl status``.
"""
from __future__ import annotations

import fnmatch
import math
import re
from dataclasses import dataclass, field, fields
from statistics import median
from typing import Any, Mapping

from aggd_client.protocol import StrategyKind

from aggd.core import strategy as strat
from aggd.core.straggler import DetectorConfig, Observation, slowdown_text


_TEMPLATE = re.compile(r"\bn\s*-\s*s\b|\bn\s*-\s*(\d+)\b|\bn\b")


class PolicyError(ValueError):
    pass


def fill(template: str, world: int, stragglers: int) -> str:
    """``quorum:n-s`` -> ``quorum:3`` for a world of 4 with one straggler; ``n`` is the world size,
    ``s`` the number of stragglers. Any strategy text without them passes unchanged."""
    def sub(m: re.Match) -> str:
        if m.group(0).replace(" ", "") == "n-s":
            return str(world - stragglers)
        if m.group(1) is not None:
            return str(world - int(m.group(1)))
        return str(world)
    text = _TEMPLATE.sub(sub, template.strip().lower())
    return str(strat.parse(text).validate(world))


@dataclass(frozen=True)
class PolicyRules:
    """The declarative policy (see the module docstring); ``from_mapping`` checks a config's dict."""
    slow_factor: float = 1.5
    even_factor: float = 1.35
    slow_rounds: int = 8
    switch_to: str = "quorum:n-s"
    even_rounds: int = 30
    max_stragglers: float = 0.25
    min_rounds_between: int = 20
    min_seconds_between: float = 2.0
    settle_rounds: int = 4
    jobs: str = "*"

    def __post_init__(self):
        problems = []
        if not self.slow_factor > 1.0:
            problems.append(f"slow_factor must be above 1, not {self.slow_factor}")
        if not 1.0 < self.even_factor <= self.slow_factor:
            problems.append(f"even_factor must be above 1 and at most slow_factor, not {self.even_factor}")
        for name in ("slow_rounds", "even_rounds", "min_rounds_between", "settle_rounds"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must not be negative, not {getattr(self, name)}")
        if not 0 < self.max_stragglers < 1:
            problems.append(f"max_stragglers is a fraction of the world in (0, 1), not {self.max_stragglers}")
        if self.min_seconds_between < 0:
            problems.append("min_seconds_between must not be negative")
        try:
            for world in (2, 4, 64):
                fill(self.switch_to, world, 1)
        except strat.StrategyError as exc:
            problems.append(f"switch_to {self.switch_to!r}: {exc}")
        if problems:
            raise PolicyError("; ".join(problems))

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> "PolicyRules":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PolicyError(f"unknown policy keys {unknown} (known: {', '.join(sorted(known))})")
        return cls(**{k: v for k, v in data.items()})

    def detector(self) -> DetectorConfig:
        return DetectorConfig(slow_factor=self.slow_factor)

    def allowed_stragglers(self, world: int) -> int:
        return max(1, int(world * self.max_stragglers))

    def manages(self, name: str, own_strategy: str) -> bool:
        return fnmatch.fnmatchcase(name, self.jobs) and strat.parse(own_strategy).kind == StrategyKind.SYNC


@dataclass(frozen=True)
class Decision:
    strategy: str                 #: what to switch to (text form)
    reason: str
    round: int                    #: the round observed when deciding
    stragglers: tuple[int, ...]
    back: bool                    #: True: back to the job's own strategy

    def to_json(self) -> dict:
        return {"strategy": self.strategy, "reason": self.reason, "round": self.round,
                "stragglers": list(self.stragglers), "back": self.back}


@dataclass
class JobPolicy:
    """The policy's state for one job. ``step(obs, current, now)`` -> Decision or None; once the
    decision is applied, ``applied(decision, from_round, now)`` (or ``failed``)."""
    rules: PolicyRules
    own: str = "sync"                       #: the job's own strategy (set by its owner)
    switched: str | None = None             #: what the policy switched to, while it is in force
    stragglers: tuple[int, ...] = ()        #: ranks the switch was made for
    slow_since: dict[int, int] = field(default_factory=dict)   #: rank -> first round seen slow
    even_since: int | None = None           #: first round of the current all-even stretch
    last_switch_round: int | None = None    #: from_round of the last switch
    last_switch_t: float | None = None
    note: str = ""                          #: why nothing happens, when something could
    #: (round, each member's cumulative contributions, None for a gone one) at the observations
    #: since the switched strategy took effect: the rates a return to the job's own is judged on
    counted: list[tuple[int, tuple[int | None, ...]]] = field(default_factory=list)

    @property
    def in_force(self) -> str:
        return self.switched or self.own

    def _reset_tracking(self) -> None:
        self.slow_since.clear()
        self.even_since = None

    def sync_with(self, current: str) -> None:
        """The strategy the data planes run now; a change nobody here made is the owner's."""
        if current != self.in_force:
            self.own, self.switched, self.stragglers = current, None, ()
            self._reset_tracking()
            self.counted.clear()
            self.note = f"strategy set to {current} by hand: it is the job's own now"

    def _may_switch(self, obs: Observation, now: float) -> str | None:
        """None if a switch is allowed now, else why not."""
        r = self.rules
        if self.last_switch_round is not None:
            if obs.round < self.last_switch_round + r.settle_rounds:
                return "settling after the last switch"
            if obs.round < self.last_switch_round + r.min_rounds_between:
                return f"at most one switch per {r.min_rounds_between} rounds"
        if self.last_switch_t is not None and now - self.last_switch_t < r.min_seconds_between:
            return f"at most one switch per {r.min_seconds_between:g} s"
        return None

    def _count(self, obs: Observation) -> None:
        """Keep the contribution counters of an observation made under the switched strategy."""
        if self.switched is None or (self.last_switch_round is not None and obs.round < self.last_switch_round):
            return
        counts = tuple(None if w.gone else w.contributions for w in obs.workers)
        if self.counted and (len(self.counted[-1][1]) != len(counts) or any(
                a is not None and b is not None and a < b for a, b in zip(counts, self.counted[-1][1]))):
            self.counted.clear()    # counters that went backwards: the job's maps were reset
        self.counted.append((obs.round, counts))
        limit = obs.round - self.rules.even_rounds
        while len(self.counted) > 1 and self.counted[1][0] <= limit:
            del self.counted[0]     # the newest one at least even_rounds old is all a judgement needs

    def _behind(self, obs: Observation) -> str | None:
        """Why the rates under the switched strategy do not allow going back (a member made fewer than
        1/even_factor of the median member's contributions over the last even_rounds rounds, or
        they were not counted that long yet); None if they allow it."""
        r = self.rules
        start = [c for c in self.counted if c[0] <= obs.round - r.even_rounds]
        if not start:
            return f"contributions under {self.switched} not counted for {r.even_rounds} rounds yet"
        r0, before = start[-1]
        now = self.counted[-1][1]
        made = {i: a - b for i, (a, b) in enumerate(zip(now, before)) if a is not None and b is not None}
        if not made or median(made.values()) <= 0:
            return None             # nothing counted: the rates say nothing
        med = median(made.values())
        rank = min(made, key=lambda i: made[i])
        ratio = med / made[rank] if made[rank] > 0 else math.inf
        if ratio < r.even_factor:
            return None
        return (f"rank {rank} made 1/{ratio:.2f} of the median member's contributions over the last "
                f"{obs.round - r0} rounds under {self.switched} (not within {r.even_factor:g}x)")

    def step(self, obs: Observation, current: str, now: float) -> Decision | None:
        r = self.rules
        self.sync_with(current)
        self._count(obs)
        if self.last_switch_round is not None and obs.round < self.last_switch_round + r.settle_rounds:
            self._reset_tracking()  # the new strategy is not in force long enough to be judged
            return None
        slow = set(obs.stragglers)
        # hysteresis: while switched, a member is even again only below even_factor (an estimate
        # hovering around slow_factor must not flap the job between strategies)
        uneven = {w.rank for w in obs.workers if w.slowdown >= r.even_factor} if self.switched else slow
        for rank in list(self.slow_since):
            if rank not in slow:
                del self.slow_since[rank]
        for rank in slow:
            self.slow_since.setdefault(rank, obs.round - obs.rounds)
        if uneven:
            self.even_since = None
        elif self.even_since is None:
            self.even_since = obs.round - obs.rounds
        confirmed = tuple(sorted(k for k, v in self.slow_since.items() if obs.round - v >= r.slow_rounds))
        world = obs.world
        allowed = r.allowed_stragglers(world)

        target, back, why = None, False, ""
        if self.switched is None:
            if not confirmed or world < 2:
                self.note = ""
                return None
            if len(slow) > allowed:
                self.note = (f"{len(slow)} of {world} members slow: more than max_stragglers "
                             f"({allowed}), the job is slow rather than straggling; staying on {self.own}")
                return None
            target = fill(r.switch_to, world, len(confirmed))
            rounds = min(obs.round - self.slow_since[k] for k in confirmed)
            why = (f"{slowdown_text(obs, confirmed)} slower than {r.slow_factor:g}x the median for "
                   f"{rounds} rounds")
        else:
            even_long = not uneven and obs.round - self.even_since >= r.even_rounds
            behind = self._behind(obs) if even_long else None
            if even_long and behind is None:
                target, back = self.own, True
                why = (f"every member within {r.even_factor:g}x of the median for "
                       f"{obs.round - self.even_since} rounds, in step time and in contributions")
            elif confirmed and len(slow) <= allowed and set(confirmed) != set(self.stragglers):
                target = fill(r.switch_to, world, len(confirmed))
                if target == self.switched:
                    return None
                rounds = min(obs.round - self.slow_since[k] for k in confirmed)
                why = f"stragglers now {slowdown_text(obs, confirmed)} for {rounds} rounds"
            else:
                self.note = f"staying on {self.switched}: {behind}" if behind else ""
                return None
        blocked = self._may_switch(obs, now)
        if blocked:
            self.note = f"would switch to {target} ({why}) but {blocked}"
            return None
        if target == self.in_force:
            return None
        self.note = ""
        return Decision(target, why, obs.round, () if back else confirmed, back)

    def applied(self, decision: Decision, from_round: int, now: float) -> None:
        self.switched = None if decision.back else decision.strategy
        self.stragglers = decision.stragglers
        self.last_switch_round, self.last_switch_t = from_round, now
        self._reset_tracking()
        self.counted.clear()

    def failed(self, decision: Decision, error: str, now: float) -> None:
        self.note = f"could not switch to {decision.strategy}: {error}"
        self.last_switch_t = now  # do not retry at every tick

    def to_json(self) -> dict:
        return {"own": self.own, "in_force": self.in_force, "switched": self.switched is not None,
                "stragglers": list(self.stragglers), "note": self.note or None}


# -- the I/O edge: a thread of the daemon ------------------------------------------------------------

def rules_from_config(pc) -> PolicyRules:
    """PolicyRules from the config's ``[policy]`` section (``aggd.daemon.config.PolicyConfig``)."""
    names = {f.name for f in fields(PolicyRules)}
    return PolicyRules(**{k: getattr(pc, k) for k in names if hasattr(pc, k)})
