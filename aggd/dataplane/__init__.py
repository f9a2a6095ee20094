"""Data planes behind one interface: the XDP program (``xdp``), the P4 program on a switch (``p4``)
and the user-space path (``userspace``), which serves what the other two pass on.

The deciding logic (job registry, strategies, policies, metrics) talks only to :class:`DataPlane`;
``aggd.daemon.service`` picks the fast one from ``[dataplane] kind`` and runs the user-space path
beside it, looping over both. What one data plane cannot
tell (a P4 target without per-member counters, say) reads as ``None``: absent, never made up.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Iterable

from aggd_client import protocol as proto


def checked_job(cfg, error: type[Exception], no_group: str) -> tuple[int, int, int]:
    """(job, world, slots this data plane holds) from a job config with ``job, world, slots, group``
    (optionally ``kernel_slots``: None for all of them, 0 for none); ``error`` says what is wrong,
    ``no_group`` why a job without a multicast group cannot run here."""
    job, world = int(cfg.job), int(cfg.world)
    if not 0 <= job < proto.MAX_JOBS:
        raise error(f"job id must be 0..{proto.MAX_JOBS - 1}, not {job}")
    if not 1 <= world <= proto.MAX_MEMBERS:
        raise error(f"job {job}: world must be 1..{proto.MAX_MEMBERS}, not {world}")
    if cfg.group is None:
        raise error(f"job {job}: {no_group}")
    wanted = getattr(cfg, "kernel_slots", None)
    return job, world, min(int(cfg.slots if wanted is None else wanted), int(cfg.slots))


def rounds_by_member(banks: Iterable[tuple[int, int]]) -> tuple[int | None, dict[int, int]]:
    """(highest round, {rank: highest round it contributed to}) from the (round, bitmap) of every
    non-empty bank: how each data plane reads a job's progress from its slots."""
    top, per_rank = None, {}
    for rnd, bits in banks:
        top = rnd if top is None else max(top, rnd)
        rank = 0
        while bits:
            if bits & 1:
                per_rank[rank] = max(per_rank.get(rank, rnd), rnd)
            bits >>= 1
            rank += 1
    return top, per_rank


def holding(planes: tuple, job) -> tuple:
    """Of the service's ``planes`` (the fast one first, then user space), those that hold some of
    ``job``'s slots (``job.kernel_slots``: how many the fast one holds)."""
    fast, *rest = planes
    return ((fast,) if job.kernel_slots else ()) + tuple(rest)


def max_round(planes: Iterable["DataPlane"], job) -> int | None:
    """The highest round any member of ``job`` (``id``) sent to any of ``planes``; None: none yet."""
    tops = [t for t in (p.max_round(job.id) for p in planes) if t is not None]
    return max(tops) if tops else None


def member_rows(planes: Iterable["DataPlane"], job) -> list[dict] | None:
    """Per rank of ``job`` (``id``, ``world``), the ``member_stats`` rows of ``planes`` summed;
    None when none of them keeps them."""
    rows = None
    for plane in planes:
        mine = plane.member_stats(job.id, job.world)
        if mine is not None:
            rows = mine if rows is None else [merge_member_rows(a, b) for a, b in zip(rows, mine)]
    return rows


def merge_member_rows(a: dict, b: dict) -> dict:
    """One member's ``member_stats`` row from two data planes' (the kernel's and user space's)."""
    rounds = [x for x in (a.get("last_round"), b.get("last_round")) if x is not None]
    return {"rank": a["rank"], "contributions": a["contributions"] + b["contributions"],
            "lag_ns_sum": a["lag_ns_sum"] + b["lag_ns_sum"], "late": a["late"] + b["late"],
            "last_round": max(rounds) if rounds else None, "last_ns": max(a["last_ns"], b["last_ns"]),
            "offences": a.get("offences", 0) + b.get("offences", 0),
            "score_terms": _merge_terms(a.get("score_terms"), b.get("score_terms"))}


def _merge_terms(a: tuple | None, b: tuple | None) -> tuple | None:
    """A robust job's score terms (only user space keeps them) from two planes' rows."""
    if a is None or b is None:
        return a if b is None else b
    return tuple(x + y for x, y in zip(a, b))


class DataPlaneError(RuntimeError):
    """A data plane refused or failed an operation (XdpError, P4Error)."""


@dataclass
class JobStats:
    """A job's data-plane counters, keyed by protocol ``Counter`` and ``DropReason`` names.
    ``untracked``: counters this data plane does not keep (absent, not zero)."""
    counters: dict[str, int] = field(default_factory=dict)
    drops: dict[str, int] = field(default_factory=dict)
    untracked: frozenset = frozenset()


class DataPlane(abc.ABC):
    """What the daemon needs from a data plane."""

    @abc.abstractmethod
    def install_job(self, cfg) -> None:
        """Install (or replace) a job from ``job, world, slots, max_chunks, members, group`` and
        optionally ``tags`` (rank -> member tag), ``kernel_slots`` (the slots this data plane holds; 0: none, every chunk goes to
        the user-space path) and ``strategy``."""

    @abc.abstractmethod
    def remove_job(self, job: int) -> None:
        """Remove a job and free its slots."""

    @abc.abstractmethod
    def active_jobs(self) -> list[int]:
        """Ids of the installed jobs."""

    @abc.abstractmethod
    def allocation(self, job: int) -> tuple[int, int]:
        """(first slot, slots) the data plane holds for an installed job; (0, 0) otherwise."""

    @abc.abstractmethod
    def set_member(self, job: int, rank: int, addr: tuple[str, int] | None, tag: int = 0) -> None:
        """Register (None: clear) the address rank ``rank`` of ``job`` sends from and the tag its
        packets carry (docs/protocol.md, "Member tags"; 0: none)."""

    @abc.abstractmethod
    def set_strategy(self, job: int, entries) -> None:
        """Install a job's strategy table (``aggd.core.strategy.TableEntry`` rows, newest last)."""

    @abc.abstractmethod
    def clear_rounds(self, job: int) -> None:
        """Empty every slot of ``job``: the rounds in them, open or released, are forgotten (every
        member restarted, and the rounds their old selves left open will never complete). Members,
        strategy table and awaited members stay."""

    def set_awaited(self, job: int, awaited: int) -> None:
        """The members a round of ``job`` waits for: a bitmap of ranks, the world less the members
        declared gone (``aggd.core.model.AggregatorModel.set_awaited``)."""
        raise DataPlaneError(f"{type(self).__name__} cannot release rounds without a member")

    def set_upstream(self, job: int, upstream) -> None:
        """A rack job's link to its upper aggregator (``aggd.core.model.Upstream``): complete rounds
        go up there and its results come back down (docs/protocol.md, "Two levels"). A data plane
        that holds none of the job's slots has nothing to do; one that holds some and cannot forward
        refuses."""
        if self.allocation(job)[1]:
            raise DataPlaneError(f"{type(self).__name__} does not forward to an upper aggregator")

    def check_strategies(self, entries) -> None:
        """Raise DataPlaneError if this data plane cannot run these strategy rows (checked before
        anything changes anywhere)."""

    @abc.abstractmethod
    def job_stats(self, job: int | None) -> JobStats:
        """Counters of a job; ``None`` for packets that never reached a job."""

    @abc.abstractmethod
    def job_rounds(self, job: int) -> tuple[int | None, dict[int, int]]:
        """(highest round a slot of ``job`` holds, {rank: highest round it contributed to})."""

    def installed(self, job: int) -> tuple[int, int, int, int] | None:
        """(world, slots, first slot, slots held) of a job this data plane kept from an earlier
        daemon (pinned state), to decide whether it still matches the registry; None if unknown."""
        return None

    def max_round(self, job: int) -> int | None:
        """The highest round any member of ``job`` has sent, or None (also when not kept)."""
        return None

    def member_stats(self, job: int, world: int) -> list[dict] | None:
        """Per rank: contributions, lag_ns_sum, late, last_round, last_ns; None when not kept."""
        return None

    def open_rounds(self, job: int) -> list[tuple[int, int, int]] | None:
        """(round, bitmap of members in it, t_first ns on the data plane's clock) of every open
        round of ``job`` that waits for every awaited member (not quorum's; holding banks aside);
        None when not readable."""
        return None

    def open_slots(self, job: int) -> int | None:
        """How many of the slots this data plane holds for ``job`` hold an open round; None when
        not readable."""
        return None

    @property
    def attached(self) -> bool:
        """Whether packets reach the program (XDP attached, switch connected)."""
        return True

    def describe(self) -> dict:
        """What ``aggctl status`` shows of the data plane beyond the config."""
        return {}

    def stop(self, unpin: bool = False) -> None:
        """Stop (detach); ``unpin``: also drop state kept for a restart (the XDP pinned maps)."""
        self.close()

    @abc.abstractmethod
    def close(self) -> None:
        """Detach and release everything this data plane holds."""
