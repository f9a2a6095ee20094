"""Members of a job as threads of one process, against aggregators on loopback: ``run_ranks`` runs
one function per member (results by rank, the first member's exception raised), ``DictStore`` is
the store they share (torch.distributed's ``Store`` calls the sharded client uses),
``userspace_aggregators`` starts real user-space aggregators and ``sharded_members`` makes each
member's ``ShardedClient`` over them."""
from __future__ import annotations

import contextlib
import threading


def run_ranks(clients, work, timeout: float = 120.0) -> list:
    """``work(rank, clients[rank])`` in a thread per rank; their results in rank order."""
    out, errs = [None] * len(clients), [None] * len(clients)

    def one(r):
        try:
            out[r] = work(r, clients[r])
        except BaseException as e:  # noqa: BLE001 (raised below)
            errs[r] = e

    threads = [threading.Thread(target=one, args=(r,)) for r in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    for e in errs:
        if e is not None:
            raise e
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"a member's work did not end within {timeout} s")
    return out


class DictStore:
    """``set``, ``get`` (waits for the key), ``check`` (are all these keys there) in memory."""

    def __init__(self, timeout: float = 30.0):
        self.data: dict = {}
        self.cond = threading.Condition()
        self.timeout = timeout

    def set(self, key, value):
        with self.cond:
            self.data[key] = value.encode() if isinstance(value, str) else bytes(value)
            self.cond.notify_all()

    def get(self, key):
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.data, timeout=self.timeout):
                raise TimeoutError(f"no key {key} in the store within {self.timeout} s")
            return self.data[key]

    def check(self, keys):
        with self.cond:
            return all(k in self.data for k in keys)


@contextlib.contextmanager
def userspace_aggregators(count: int, elements: int):
    """``count`` real user-space aggregators (aggd.dataplane.userspace.server) on 127.0.0.1."""
    from aggd.dataplane.userspace.server import UserspaceAggregator

    started = []
    try:
        for _ in range(count):
            a = UserspaceAggregator(bind=("127.0.0.1", 0), elements=elements)
            a.start()
            started.append(a)
        yield started
    finally:
        for a in started:
            a.close()


def sharded_members(aggs, job: int, world: int, elements: int, *, slots: int = 16, give_up_after: float = 10.0,
                    strategy: str = "sync", precision: int = 32, **sharded) -> list:
    """Per rank a ShardedClient (``sharded``: its keyword arguments) over one AggClient an aggregator
    of ``aggs``, the job installed on each with those members, under ``strategy``, of contributions
    of ``precision`` bits."""
    from aggd.core import strategy as strat
    from aggd.core.model import JobConfig
    from aggd_client import AggClient
    from aggd_client.shards import ShardedClient

    from aggd_client.quant import precision_of

    per_rank = [[AggClient(a.address, job, r, world, bind=("127.0.0.1", 0), slots=slots, give_up_after=give_up_after,
                           strategy=strategy, precision=precision, elements=elements, seed=r)
                 for a in aggs] for r in range(world)]
    for i, a in enumerate(aggs):
        a.add_job(JobConfig(job=job, world=world, slots=slots, max_chunks=1 << 20, strategy=strat.parse(strategy),
                            members={r: per_rank[r][i].address for r in range(world)}, elements=elements,
                            precision=precision_of(precision)))
    return [ShardedClient(cs, **sharded) for cs in per_rank]


def run_and_close(clients, work, timeout: float = 120.0) -> list:
    """``run_ranks``, then every client closed (also when a member failed)."""
    try:
        return run_ranks(clients, work, timeout)
    finally:
        for c in clients:
            c.close()
