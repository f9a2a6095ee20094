"""The "aggd" ``torch.distributed`` process group: ``allreduce`` (and ``allreduce_coalesced``) go
through the aggd job; every other collective is delegated to an inner gloo group.

``AggdProcessGroup`` subclasses ``torch.distributed.ProcessGroup`` in Python (torch accepts that
from a registered backend's creator and calls the Python methods, from Python and from C++ such as
DDP's reducer). At construction (inside ``init_process_group``) it:

1. reads its settings (``settings.Settings``: pg_options, then ``AGGD_*``);
2. makes the inner gloo group over ``PrefixStore("aggd/<attempt>/", store)`` (``attempt``: torchrun's
   ``TORCHELASTIC_RESTART_COUNT``, as torchrun keeps its store across restarts);
3. JOINs the job as its group rank (``membership.request_join``) and checks the job's world is the
   group's size;
4. agrees with the other ranks (a MAX over gloo) on the first round: a job's new members start at 0,
   and members that rejoin (a torchrun restart) start where the job is, which the JOIN answer says;
5. starts the reduction thread (``reducer.Reducer``) that owns the ``AggClient``, with error
   feedback (``aggd_client.feedback``) when the settings ask for it (by default for a job of
   precision 8 or 16).

Gloo is used only by explicit delegation from the Python methods below: registering it as the
group's backend for the other collectives deadlocked under load (the GIL held while waiting for
gloo's queue).
"""
from __future__ import annotations

import os
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from ..membership import client_for, request_join
from .reducer import AggdBackendError, Reducer
from .settings import Settings
from .work import AggdWork

__all__ = ["AggdProcessGroup", "create", "OPS"]

#: torch reduce ops aggd serves -> the client's op.
OPS = {"SUM": "sum", "AVG": "mean"}

#: Collectives served by the inner gloo group: the name on ``ProcessGroup`` -> gloo's.
DELEGATED = {name: name for name in (
    "broadcast", "allgather", "_allgather_base", "allgather_coalesced", "barrier", "monitored_barrier",
    "reduce", "gather", "scatter", "reduce_scatter", "_reduce_scatter_base", "alltoall", "alltoall_base",
    "send", "recv", "recv_anysource")}
DELEGATED.update({"all_gather_single": "_allgather_base", "reduce_scatter_single": "_reduce_scatter_base",
                  "all_to_all_single": "alltoall_base"})
#: Collectives neither aggd nor gloo serves: refused with their name.
UNSERVED = ("allgather_into_tensor_coalesced", "all_gather_single_coalesced",
            "reduce_scatter_tensor_coalesced", "reduce_scatter_single_coalesced")

#: (server, job) pairs joined by a live group of this process: a second group on the same job
#: would take over the first one's member addresses.
_in_use: set = set()
_in_use_lock = threading.Lock()


def _op_name(op) -> str:
    for name in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"):
        if op == getattr(dist.ReduceOp, name):
            return name
    return str(op)


class AggdProcessGroup(dist.ProcessGroup):
    def __init__(self, store, rank: int, size: int, timeout: timedelta, settings: Settings):
        super().__init__(rank, size)
        self._settings = settings
        self._timeout = timeout
        keys = [(server, settings.job) for server in settings.servers]
        with _in_use_lock:
            for server, job in keys:
                if (server, job) in _in_use:
                    raise ValueError(f"job {job!r} of {server[0]}:{server[1]} is already used by another aggd "
                                     f"process group of this process; give this group another job "
                                     f"(pg_options={{'job': ..., 'token': ...}})")
            _in_use.update(keys)
        key = tuple(keys)
        self._key = key
        try:
            # torchrun keeps one store across restarts: a prefix per attempt, or a restarted rank
            # would read the address the previous attempt's gloo published and fail to connect
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            self._gloo = dist.ProcessGroupGloo(dist.PrefixStore(f"aggd/{attempt}/", store), rank, size, timeout)
            joined = []   # (info, address) per server; with several, each from its own port
            host, port = settings.bind
            member = settings.member_rank(rank)   # a rack job's member is not the group's rank
            for i, server in enumerate(settings.servers):
                bind = (host, port + i if port else 0)
                info, address = request_join(server, settings.job, member, settings.token,
                                             bind=bind, timeout=settings.join_timeout)
                if (info.span or info.world) != size:
                    where = f" of {server[0]}:{server[1]}" if len(settings.servers) > 1 else ""
                    span = f" (its sums hold {info.span} workers)" if info.span and info.span != info.world else ""
                    raise ValueError(f"job {info.name!r}{where} has {info.world} members{span} but the process "
                                     f"group has {size} ranks (create the job with --world {size}, or a rack "
                                     f"job with --span {size})")
                joined.append((info, address))
            # every member starts each server's rounds where the furthest of them says
            first = torch.tensor([info.round for info, _ in joined], dtype=torch.int64)
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.MAX
            self._gloo.allreduce([first], opts).wait()
            clients = []
            try:
                for server, (info, address), start in zip(settings.servers, joined, first.tolist()):
                    clients.append(client_for(server, info, address, member, first_round=int(start),
                                              give_up_after=settings.give_up_after, catch_up=False,
                                              strategy=info.strategy, fast=True))
                if len(clients) == 1:
                    client = clients[0]
                else:
                    from ..shards import ShardedClient, ShardMap, rejoiner
                    shard_store = (dist.PrefixStore(f"aggd/{attempt}/shards/", store)
                                   if settings.rebalance_every or settings.failover_after else None)
                    # a failed-over server joined again (rank 0's probe found it back): from a new port
                    rejoin = rejoiner(settings.servers, settings.job, member, settings.token, host,
                                      settings.join_timeout, {"give_up_after": settings.give_up_after,
                                                              "catch_up": False, "fast": True})
                    client = ShardedClient(clients, None if settings.weights is None else ShardMap(settings.weights),
                                           store=shard_store, rebalance_every=settings.rebalance_every, prefix="",
                                           failover_after=settings.failover_after, rejoin=rejoin,
                                           probe_every=settings.probe_every)
            except BaseException:
                for c in clients:
                    c.close()
                raise
        except BaseException:
            with _in_use_lock:
                _in_use.difference_update(keys)
            raise
        info = joined[0][0]
        self.job_info = info
        self.first_round = int(first[0].item())
        feedback = None
        if settings.feedback_for(info.precision):
            from ..feedback import ErrorFeedback
            feedback = ErrorFeedback(client, settings.error_reset or None)
        self._reducer = Reducer(client, timeout.total_seconds(), accept_newer=settings.accept_newer,
                                name=f"aggd job {info.name} rank {rank}", feedback=feedback)

    # -- what torch asks of a process group --------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 - the C++ name, overridden through pybind
        return "aggd"

    @property
    def client(self):
        """The ``AggClient`` (used by the reduction thread: do not call it from elsewhere)."""
        return self._reducer.client

    @property
    def last_info(self) -> dict | None:
        return self._reducer.last_info

    # -- aggd's collective ---------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        tensors = list(tensors)
        op = dist.ReduceOp.SUM if opts is None else getattr(opts, "reduceOp", dist.ReduceOp.SUM)
        name = _op_name(op)
        if name not in OPS:
            raise ValueError(f"the aggd backend reduces with ReduceOp.SUM and ReduceOp.AVG, not ReduceOp.{name}")
        from .convert import check_tensors
        check_tensors(tensors)  # refused here, before anything is queued (the same on every rank)
        return AggdWork(self._reducer.submit(tensors, OPS[name]), "allreduce")

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    # -- life ------------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Called by ``destroy_process_group``: stop the reduction thread, close the client."""
        self._reducer.close()
        with _in_use_lock:
            _in_use.difference_update(self._key)
        try:
            self._gloo.shutdown()
        except Exception:  # noqa: BLE001 - gloo may not have it, or be gone already
            pass

    def abort(self) -> None:
        self.shutdown()


def _delegate(name: str, gloo_name: str):
    def method(self, *args, **kwargs):
        return getattr(self._gloo, gloo_name)(*args, **kwargs)
    method.__name__ = name
    method.__doc__ = f"``{name}`` by the inner gloo group (its ``{gloo_name}``)."
    return method


def _unserved(name: str):
    def method(self, *args, **kwargs):
        raise NotImplementedError(f"the aggd backend serves allreduce and delegates the other collectives "
                                  f"to gloo, which has no {name}")
    method.__name__ = name
    return method


for _name, _gloo_name in DELEGATED.items():
    setattr(AggdProcessGroup, _name, _delegate(_name, _gloo_name))
for _name in UNSERVED:
    setattr(AggdProcessGroup, _name, _unserved(_name))


def create(common_opts, backend_options=None) -> AggdProcessGroup:
    """The backend's creator (registered with ``extended_api=True``): ``backend_options`` is the
    ``pg_options`` given to ``init_process_group`` / ``new_group`` (a mapping or a Settings)."""
    settings = Settings.resolve(backend_options)
    return AggdProcessGroup(common_opts.store, common_opts.group_rank, common_opts.group_size,
                            common_opts.timeout, settings)


__all__ += ["AggdBackendError"]
