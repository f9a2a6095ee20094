"""Members that went silent, and members that keep pace again: pure decisions over the data planes'
per-member rows (``DataPlane.member_stats``: rank, last_round, last_ns, ...) and their open rounds
(``DataPlane.open_rounds``: round, bitmap, t_first).

A dead worker under ``sync`` (or ``ssp``, ``wbsp``) stalls every other member: its round never
completes. The daemon declares a member gone when a round has waited for it longer than
``max(silent_after_s, silent_steps x the job's usual step)`` and it has sent nothing for as long;
rounds then stop waiting for it (``aggd.core.model.AggregatorModel.set_awaited``), and the round
the others are stuck in is released at their next retransmission. A job that pauses (an
evaluation, a checkpoint) has no open round and loses nobody; under ``quorum`` a round does not
wait long for anyone. A member declared gone whose contributions reach the job's newest round
again, once every other member is ``readmit_rounds`` past the round it left (or rejoined) at, is
awaited again.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DepartureRules:
    #: Seconds a member may be silent before it is declared gone, at least; 0: never by itself.
    silent_after_s: float = 5.0
    #: ... and at least this many of the job's usual steps (the median member's).
    silent_steps: float = 20.0
    #: Rounds every other member must be past the round a gone member left (or rejoined) at before
    #: it is awaited again.
    readmit_rounds: int = 2

    def threshold_s(self, step_s: float | None) -> float:
        """How long a member may be silent, given the job's usual step (None: not known yet)."""
        return max(self.silent_after_s, self.silent_steps * step_s if step_s else 0.0)


@dataclass(frozen=True)
class Silent:
    rank: int
    silent_s: float      #: since its last contribution
    threshold_s: float
    last_round: int
    waiting_round: int   #: the newest open round that waits for it

    def reason(self) -> str:
        return (f"silent for {self.silent_s:.1f} s (limit {self.threshold_s:.1f} s; last contribution in round "
                f"{self.last_round}) while round {self.waiting_round} waits for it")


def silent_members(rows: list[dict], open_rounds: list[tuple[int, int, int]], now_ns: int, awaited: int,
                   rules: DepartureRules, step_s: float | None = None, since_ns: int = 0,
                   starting: int = 0) -> list[Silent]:
    """The awaited members to declare gone: missing from a round that has been open (with some
    awaited member in it) longer than the threshold, and silent as long. A member that never
    contributed is starting (the job waits for it, as at any start) and is left to the operator;
    so are the members in ``starting`` (a bitmap: those a restart under way waits for,
    ``Restart.waiting_for``). ``rows`` and ``open_rounds`` read at ``now_ns``, on the data plane's
    clock (CLOCK_MONOTONIC). Nothing before ``since_ns`` counts (the daemon's start: members wait
    through a restart)."""
    if rules.silent_after_s <= 0:
        return []
    limit = rules.threshold_s(step_s)
    waited_for, newest = 0, None
    for round_, bitmap, t_first in open_rounds:
        if bitmap & awaited and (now_ns - max(t_first, since_ns)) / 1e9 >= limit:
            waited_for |= awaited & ~bitmap
            newest = round_ if newest is None else max(newest, round_)
    out = []
    for r in rows:
        rank = int(r["rank"])
        if not waited_for >> rank & 1:
            continue
        if r["last_round"] is None or starting >> rank & 1:   # not (re)started yet: the job waits
            continue
        silent = (now_ns - max(r["last_ns"], since_ns)) / 1e9
        if silent >= limit:
            out.append(Silent(rank, silent, limit, r["last_round"], newest))
    return out


@dataclass(frozen=True)
class Restart:
    """Members of a job restarting together (a training script run again, torchrun restarting the
    group): the round each of them starts at, the job's newest round when the first rejoined, and
    the ranks that have rejoined."""
    round: int
    top: int | None
    ranks: frozenset[int]

    def under_way(self, newest: dict[int, int]) -> bool:
        """Whether members may still join it: every member not in it has sent nothing from its round
        on (``newest``: each rank's newest round), so they have not been running meanwhile, only
        not restarted yet. A survivor that goes on ends it: a member restarting later starts after
        the survivors' rounds."""
        return all(v < self.round for r, v in newest.items() if r not in self.ranks)

    def waiting_for(self, world: int) -> int:
        """The members it waits for (not rejoined yet), as a bitmap: starting, as at a job's start."""
        return ((1 << world) - 1) & ~sum(1 << r for r in self.ranks)


def restart_of(current: Restart | None, rank: int, newest: dict[int, int], top: int | None) -> Restart:
    """The restart a member rejoining (its previous self joined before) belongs to: the one under
    way, if ``rank`` has not rejoined it yet; else a new one from the round after the job's newest
    (``top``). So members that rejoin one by one, the first already sending, start at one round,
    as their calls line up: each starting after the newest round sent would put every member a
    round past the last, and each round would wait for members that never send it."""
    if current is not None and rank not in current.ranks and current.under_way(newest):
        return Restart(current.round, current.top, current.ranks | {rank})
    return Restart(0 if top is None else top + 1, top, frozenset({rank}))


def keeps_pace(rows: list[dict], rank: int, since_round: int, awaited: int, rules: DepartureRules,
               open_rounds: list[tuple[int, int, int]] | None = None) -> bool:
    """Whether gone member ``rank`` may be awaited again: its newest round is the job's newest,
    every awaited member has sent a round ``readmit_rounds`` past ``since_round`` (the round the
    member left or rejoined at), and (given the job's ``open_rounds``) no round it skipped is still
    open: a job that runs rounds in parallel (ssp, async handles) may have one, which would then
    wait for a contribution that never comes (``skipped_round_open``)."""
    by_rank = {int(r["rank"]): r for r in rows}
    me = by_rank.get(rank)
    if me is None or me["last_round"] is None:
        return False
    rounds = [r["last_round"] for r in rows if r["last_round"] is not None]
    if me["last_round"] < max(rounds):
        return False
    others = [by_rank[k]["last_round"] for k in by_rank if awaited >> k & 1 and k != rank]
    if not all(o is not None and o >= since_round + rules.readmit_rounds for o in others):
        return False
    return open_rounds is None or skipped_round_open(open_rounds, rank, since_round) is None


def skipped_round_open(open_rounds: list[tuple[int, int, int]], rank: int, since_round: int) -> int | None:
    """The oldest open round before ``since_round`` (the round gone member ``rank`` left or rejoined
    at) without its contribution, or None: awaiting the member again would make that round wait
    for it."""
    skipped = [r for r, bitmap, _ in open_rounds if r < since_round and not bitmap >> rank & 1]
    return min(skipped) if skipped else None


@dataclass(frozen=True)
class Offender:
    """A member whose contributions went beyond its job's bound (docs/protocol.md, "Bounds") often
    enough to be quarantined."""
    rank: int
    offences: int        #: since it was last let in
    bounds: str          #: the job's, e.g. "max_abs 0.6" or "max_abs 0.6, max_norm 3"

    def reason(self) -> str:
        return (f"out of bounds: {self.offences} contributions beyond the job's {self.bounds}; "
                f"quarantined until readmitted by hand")


def bounds_text(max_abs: float | None, max_norm: float | None) -> str:
    """A job's bounds as an Offender names them."""
    return ", ".join(f"{k} {v:g}" for k, v in (("max_abs", max_abs), ("max_norm", max_norm)) if v is not None)


def offenders(rows: list[dict], gone: dict[int, dict], counted: dict[int, int], quarantine_after: int,
              bounds: str) -> list[Offender]:
    """The members to quarantine: not gone, with ``quarantine_after`` or more ``offences`` (the
    data planes' count of contributions dropped out of bounds) over ``counted[rank]`` (the count
    when it was last let back in; 0 if never). ``quarantine_after`` 0: nobody."""
    if quarantine_after <= 0:
        return []
    out = []
    for r in rows:
        rank, n = int(r["rank"]), int(r.get("offences", 0)) - counted.get(int(r["rank"]), 0)
        if rank not in gone and n >= quarantine_after:
            out.append(Offender(rank, n, bounds))
    return out


def zeno_score(now: tuple | None, then: tuple | None, rho: float) -> float | None:
    """A member's Zeno-style score over a window of a robust job's releases: from its score terms
    at the window's end ``now`` and start ``then`` (``member_stats`` ``score_terms``: sums of
    ``<x, m>``, ``<x, x>``, ``<m, m>``; ``aggd.core.robust.score_terms``),
    ``(Δ<x, m> - rho·Δ<x, x>) / Δ<m, m>``: about 1 - rho·(1 + noise) for an honest member, negative
    for one that points away from the job's statistic or is far larger than it. None: no release
    with its row in the window."""
    if now is None:
        return None
    d = [a - b for a, b in zip(now, then or (0.0, 0.0, 0.0))]
    if d[2] <= 0.0:
        return None
    return (d[0] - rho * d[1]) / d[2]


#: A window's score below this counts against a member. An honest member scores about 1, but near
#: convergence its gradient is mostly noise and a window's score can dip below 0 (-0.2 seen); a
#: member sending its gradient backwards scores -1 - rho or less, one sending it times -10 about -15.
SUSPECT_SCORE = -0.5


@dataclass(frozen=True)
class Suspect:
    """A member of a robust job whose score stayed below SUSPECT_SCORE long enough to be quarantined."""
    rank: int
    score: float         #: in the last window
    windows: int         #: in a row below SUSPECT_SCORE
    rho: float
    combine: str

    def reason(self) -> str:
        return (f"robust score {self.score:.2f} below {SUSPECT_SCORE:g} in {self.windows} policy windows in a row "
                f"((<x, m> - {self.rho:g}|x|^2) / |m|^2, m the job's {self.combine} result); "
                f"quarantined until readmitted by hand")


class ScoreWatch:
    """One robust job's score windows: ``observe`` each policy tick with the members' rows; it
    names the members whose score was below SUSPECT_SCORE in ``after`` windows in a row (a window
    without a release of theirs neither counts nor breaks the run)."""

    def __init__(self, rho: float, after: int, combine: str) -> None:
        self.rho, self.after, self.combine = rho, after, combine
        self.then: dict[int, tuple] = {}
        self.run: dict[int, int] = {}
        self.last: dict[int, float] = {}    #: each member's latest score, for aggctl

    def observe(self, rows: list[dict], gone: dict[int, dict]) -> list[Suspect]:
        out = []
        for r in rows:
            rank, terms = int(r["rank"]), r.get("score_terms")
            score = zeno_score(terms, self.then.get(rank), self.rho)
            if terms is not None:
                self.then[rank] = tuple(terms)
            if score is None:
                continue
            self.last[rank] = score
            # a gone member's run starts again when it is let back in
            self.run[rank] = self.run.get(rank, 0) + 1 if score < SUSPECT_SCORE and rank not in gone else 0
            if self.after > 0 and self.run[rank] >= self.after:
                out.append(Suspect(rank, score, self.run[rank], self.rho, self.combine))
        return out
