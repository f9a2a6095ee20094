"""Run aggregation jobs in a lab: the XDP aggregator on the lab's ``agg0`` and worker processes in
the worker namespaces. Shared by the netns tests, ``aggctl bench`` and ``aggctl demo``."""
from __future__ import annotations

import contextlib
import ipaddress
import signal
import sys
import time
import types
from dataclasses import dataclass
from typing import Callable

from aggd_client import protocol as proto

from aggd.core.robust import parse_combine
from aggd.dataplane.xdp.loader import XdpDataPlane
from aggd.lab.namespaces import Lab
from aggd.lab.processes import LabProcesses, WorkerRun  # noqa: F401 (WorkerRun: run_workers' runs)

WORKER_PORT = 40000
STORE_PORT = 29650


@dataclass
class LabJob:
    """A job over some of the lab's workers (``ranks[i]`` is the lab worker index of rank ``i``)."""
    job: int
    workers: list[int]
    slots: int = 1024
    max_chunks: int = 1 << 24
    group: tuple[str, int] = ("239.77.0.1", proto.DEFAULT_RESULT_PORT)
    port: int = WORKER_PORT
    kernel_slots: int | None = None
    #: Join the daemon's job ``name`` with ``token`` (aggd_client.join) instead of being told the
    #: job's parameters; the daemon registers the members as they join.
    name: str | None = None
    token: str | None = None
    #: Sharded over the lab's first len(weights) aggregators with these weights (aggd_client.shards);
    #: None: the one aggregator. Aggregator i's members use port ``port + i`` and its results the
    #: group ``group_of(i)``.
    weights: tuple[float, ...] | None = None
    #: Move partitions between the aggregators every this many calls (aggd_client.shards), agreeing
    #: through a torch TCPStore the first worker serves on STORE_PORT.
    rebalance_every: int | None = None
    #: Fail over from an aggregator that answers nothing for this many seconds (aggd_client.shards),
    #: agreeing through the same store.
    failover_after: float | None = None
    #: Seconds between rank 0's JOINs to a failed aggregator (None: never; ``--revive`` brings it back).
    probe_every: float | None = None
    #: Served by the lab's aggregator ``aggregator`` (one aggregator: no ``weights``).
    aggregator: int = 0
    #: Rank ``i`` contributes the tensors of worker ``tensor_rank_base + i`` (a rack job: the
    #: racks' workers are one span of tensors, whose sum every worker checks).
    tensor_rank_base: int = 0
    #: Bits a contribution value (docs/protocol.md, "Precision"; a joined job's JOIN_ACK says).
    precision: int = 32
    #: How rounds are combined: "sum", or a robust job's (docs/protocol.md, "Robust jobs").
    combine: str = "sum"

    @property
    def world(self) -> int:
        return len(self.workers)

    @property
    def aggregators(self) -> int:
        return 1 if self.weights is None else len(self.weights)

    def group_of(self, i: int) -> tuple[str, int]:
        ip = ipaddress.IPv4Address(self.group[0]) + (i << 8)   # 239.77.i.x
        return str(ip), self.group[1]

    def config(self, lab: Lab, aggregator: int = 0):
        """What aggregator ``aggregator`` installs for this job."""
        members = {rank: (lab.worker_ip(w), self.port + aggregator) for rank, w in enumerate(self.workers)}
        return types.SimpleNamespace(job=self.job, world=self.world, slots=self.slots,
                                     max_chunks=self.max_chunks, group=self.group_of(aggregator), members=members,
                                     kernel_slots=self.kernel_slots,
                                     precision=int(proto.PRECISION_OF_BITS[self.precision]),
                                     combine=parse_combine(self.combine))


@contextlib.contextmanager
def xdp_aggregator(lab: Lab, *, elements: int = proto.DEFAULT_ELEMENTS, mode: str = "native",
                   total_slots: int = 4096, aggregator: int = 0):
    """The XDP program attached to the interface of the lab's aggregator ``aggregator``, detached on
    exit."""
    dp = XdpDataPlane(lab.agg_ifname, mode=mode, elements=elements, total_slots=total_slots,
                      netns=lab.agg_ns_of(aggregator))
    try:
        yield dp
    finally:
        dp.close()


def run_workers(lab: Lab, job: LabJob, *, timeout: float = 300, elements: int = proto.DEFAULT_ELEMENTS,
                gso: bool = True, extra: list[str] = (), server_port: int = proto.DEFAULT_PORT,
                on_record: Callable[[int, dict], None] | None = None,
                env: dict[str, str] | None = None) -> list[WorkerRun]:
    """Start one ``aggd.lab.worker`` per member, wait for all, return their records.

    ``on_record(rank, record)`` is called as each worker reports (progress bars)."""
    with LabProcesses(lab, f"lab workers of job {job.job}", on_record=on_record, env=env) as workers:
        k = job.aggregators
        first = job.aggregator if job.weights is None else 0
        servers = ",".join(f"{lab.agg_ip_of(first + i)}:{server_port}" for i in range(k))
        shards = [] if job.weights is None else ["--weights", ",".join(str(w) for w in job.weights)]
        if job.rebalance_every is not None:
            shards += ["--rebalance-every", str(job.rebalance_every)]
        if job.failover_after is not None:
            shards += ["--failover-after", str(job.failover_after)]
        if job.probe_every is not None:
            shards += ["--probe-every", str(job.probe_every)]
        if job.rebalance_every is not None or job.failover_after is not None:
            shards += ["--store", f"{lab.worker_ip(job.workers[0])}:{STORE_PORT}"]
        for rank, w in enumerate(job.workers):
            if job.token is not None:
                who = ["--job", job.name if job.name is not None else str(job.job), "--token", job.token]
            else:
                groups = ",".join(f"{g[0]}:{g[1]}" for g in map(job.group_of, range(k)))
                who = ["--job", str(job.job), "--world", str(job.world), "--group", groups,
                       "--elements", str(elements), "--slots", str(job.slots), "--precision", str(job.precision),
                       "--combine", job.combine]
            workers.start(lab.worker_ns(w), [
                sys.executable, "-m", "aggd.lab.worker", "--server", servers,
                "--bind", f"{lab.worker_ip(w)}:{job.port}", "--rank", str(rank),
                "--tensor-rank", str(job.tensor_rank_base + rank), *who, *shards,
                *([] if gso else ["--no-gso"]), *extra])
        return workers.wait(timeout)


class StrategyRun:
    """Workers of ``aggd.lab.strategy_worker`` plus an observer of the job's group, in a lab.

    ``start()`` launches them; ``finish()`` waits for the workers, stops the observer and returns
    (worker records by rank, observed releases)."""

    def __init__(self, lab: Lab, job: LabJob, observer_worker: int, *, steps: int, delay: float,
                 slow: dict[int, float] | None = None, jitter: float = 0.0, slow_steps: str = "",
                 give_up_after: float = 30.0, sizes: str | None = None):
        self.lab, self.job, self.obs_w = lab, job, observer_worker
        self.args = dict(steps=steps, delay=delay, slow=slow or {}, jitter=jitter, slow_steps=slow_steps,
                         give_up_after=give_up_after, sizes=sizes)
        self.workers = LabProcesses(lab, f"strategy workers of job {job.job}")
        self.observer = LabProcesses(lab, f"observer of job {job.job}")

    def start(self) -> "StrategyRun":
        lab, job, a = self.lab, self.job, self.args
        self.observer.start(lab.worker_ns(self.obs_w), [
            sys.executable, "-m", "aggd.lab.strategy_worker", "observer", "--group", f"{job.group[0]}:{job.group[1]}",
            "--iface-ip", lab.worker_ip(self.obs_w), "--job", str(job.job)])
        assert self.observer.first_record(0).get("ready")
        for rank, w in enumerate(job.workers):
            argv = [sys.executable, "-m", "aggd.lab.strategy_worker", "worker",
                    "--server", f"{lab.agg_ip}:{proto.DEFAULT_PORT}", "--group", f"{job.group[0]}:{job.group[1]}",
                    "--bind", f"{lab.worker_ip(w)}:{job.port}", "--job", str(job.job), "--rank", str(rank),
                    "--world", str(job.world), "--steps", str(a["steps"]), "--delay", str(a["delay"]),
                    "--slow", str(a["slow"].get(rank, 1.0)), "--jitter", str(a["jitter"]), "--seed", "7",
                    "--give-up-after", str(a["give_up_after"]), "--slots", str(job.slots)]
            if a["slow_steps"] and rank in a["slow"]:
                argv += ["--slow-steps", a["slow_steps"]]
            if a["sizes"]:
                argv += ["--sizes", a["sizes"]]
            self.workers.start(lab.worker_ns(w), argv)
        return self

    def running(self) -> bool:
        return self.workers.running()

    def finish(self, timeout: float = 300) -> tuple[dict[int, list[dict]], list[dict], dict[int, str]]:
        records, errors = {}, {}
        try:
            for run in self.workers.wait(timeout):
                records[run.rank] = run.records
                if run.returncode != 0:
                    errors[run.rank] = run.stderr[-3000:]
            time.sleep(0.3)  # let the last releases reach the observer
        finally:
            self.workers.kill()
            self.observer.kill(signal.SIGTERM, timeout=10)
        observed = self.observer.wait(10)[0].records
        releases = [r for r in observed if "round" in r]
        return records, releases, errors
