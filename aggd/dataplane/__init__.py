"""Data planes behind one interface: the XDP program, the user-space path, and (later) P4.

The deciding logic (job registry, strategies, policies) talks only to :class:`DataPlane`.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field


@dataclass
class JobStats:
    """A job's data-plane counters, keyed by protocol ``Counter`` and ``DropReason`` names."""
    counters: dict[str, int] = field(default_factory=dict)
    drops: dict[str, int] = field(default_factory=dict)


class DataPlane(abc.ABC):
    """What the daemon needs from a data plane."""

    @abc.abstractmethod
    def install_job(self, cfg) -> None:
        """Install (or replace) a job: its config, members and a fresh slot pool."""

    @abc.abstractmethod
    def remove_job(self, job: int) -> None:
        """Remove a job and free its slots."""

    @abc.abstractmethod
    def job_stats(self, job: int | None) -> JobStats:
        """Counters of a job; ``None`` for packets that never reached a job."""

    @abc.abstractmethod
    def close(self) -> None:
        """Detach and release everything this data plane holds."""
