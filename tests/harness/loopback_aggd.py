"""A daemon-like aggregator on 127.0.0.1 for the PyTorch backend's tests (tests/train): the job
registry answering JOINs as ``aggd.daemon.service`` does (``registry.answer_join``, the rejoin
round from the data plane's newest round) in front of a user-space aggregator
(``aggd.dataplane.userspace.server``), without namespaces or root. Jobs get results by unicast
(no multicast on loopback)."""
from __future__ import annotations

from aggd.core.model import JobConfig
from aggd.core.registry import Limits, Registry, answer_join
from aggd.dataplane import max_round
from aggd.dataplane.userspace.server import UserspaceAggregator
from aggd_client.protocol import MsgType, NackCode

ELEMENTS = 256


class LoopbackAggd:
    """``with LoopbackAggd() as agg: job = agg.create_job("j", 2); env = agg.env(job)``."""

    def __init__(self, elements: int = ELEMENTS):
        self.registry = Registry(Limits(kernel_budget=0, elements=elements, port=0, userspace_port=1,
                                        result_port=47001))
        self.agg = UserspaceAggregator(("127.0.0.1", 0), elements=elements,
                                       handlers={int(MsgType.JOIN): self._on_join})
        self.elements = elements

    def _round_of(self, outcome, rank: int) -> int:
        job = outcome.job
        if rank not in job.gone and not outcome.rejoined:
            return 0
        top = max_round([self.agg], job)
        return 0 if top is None else top + 1

    def _on_join(self, data, src):
        reply, outcome = answer_join(self.registry, data, src, round_of=self._round_of)
        if outcome is not None and outcome.code == NackCode.NONE and outcome.changed:
            rank = int.from_bytes(bytes(data[6:8]), "big")
            self.agg.set_member(outcome.job.id, rank, src, outcome.job.members[rank].tag)
        return reply

    @property
    def address(self) -> tuple[str, int]:
        return self.agg.address

    def create_job(self, name: str, world: int, *, strategy: str = "sync", slots: int = 64,
                   token: str | None = None):
        job = self.registry.create(name, world, strategy=strategy, slots=slots, token=token)
        job.port = self.agg.address[1]
        job.group = None
        self.agg.add_job(JobConfig(job=job.id, world=world, slots=slots, max_chunks=1 << 20, members={},
                                   elements=self.elements))
        return job

    def env(self, job) -> dict[str, str]:
        """The AGGD_* settings of a worker of ``job``."""
        return {"AGGD_SERVER": f"127.0.0.1:{self.address[1]}", "AGGD_JOB": job.name, "AGGD_TOKEN": job.token,
                "AGGD_BIND": "127.0.0.1", "AGGD_GIVE_UP_AFTER": "20"}

    def start(self) -> "LoopbackAggd":
        self.agg.start()
        return self

    def close(self) -> None:
        self.agg.close()

    def __enter__(self) -> "LoopbackAggd":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
