"""One job on several aggregator hosts (sharding): each tensor is cut into contiguous partitions, one
an aggregator, by a *shard map* of weights; the worker sends each partition to its owner through
that aggregator's own ``AggClient`` and gathers the results into one array.

Every aggregator is a normal aggd with the job registered (same members, same strategy, one token:
``aggctl jobs create NAME --token T`` on each host). Each sees a round of every call that gives it
at least one chunk, with its partition as the tensor; as every member cuts the same tensor by the
same map, they all give each aggregator the same rounds. One aggregator is ``AggClient`` itself.

The cut is on packet boundaries (a partition is whole chunks of ``elements`` values, the last one
holding the tensor's tail), and the chunk counts follow the weights by largest remainder, exactly
(fractions), so every member computes the same cut on any machine. A tensor with fewer chunks than
aggregators leaves some without a partition: those are not used for that call.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from fractions import Fraction
from typing import Sequence

import numpy as np

from .client import AggClient, AllreduceHandle, WouldBlock
from .strategy import StrategyInfo

#: How long a wait on one aggregator's answers lasts before the next aggregator's are read, while
#: several are outstanding (each client makes progress only inside its own calls).
POLL_SLICE = 0.002


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


class ShardedClient:
    """``AggClient``'s API over several aggregators: ``allreduce``, ``allreduce_async``, ``close``.

    ``clients``: one ``AggClient`` per aggregator, of the same member (rank, world) and packet size;
    their results must not meet in one socket, so their (group, port) differ where they use groups.
    ``shard_map``: the weights (default: even). Use it as a context manager or ``close()`` it.
    """

    def __init__(self, clients: Sequence[AggClient], shard_map: ShardMap | None = None):
        self.clients = list(clients)
        if not self.clients:
            raise ValueError("a sharded client needs at least one aggregator's client")
        self.shard_map = ShardMap.even(len(self.clients)) if shard_map is None else shard_map
        if len(self.shard_map.weights) != len(self.clients):
            raise ValueError(f"the shard map has {len(self.shard_map.weights)} weights for "
                             f"{len(self.clients)} aggregators")
        first = self.clients[0]
        for c in self.clients[1:]:
            if (c._rank, c._world, c._elements) != (first._rank, first._world, first._elements):
                raise ValueError(f"every aggregator's client must be the same member with the same packet "
                                 f"size: rank/world/elements {first._rank}/{first._world}/{first._elements} "
                                 f"at {first.server}, {c._rank}/{c._world}/{c._elements} at {c.server}")
        servers = [c.server for c in self.clients]
        if len(set(servers)) != len(servers):
            raise ValueError(f"an aggregator appears twice: {servers}")
        groups = [c._group for c in self.clients if getattr(c, "_group", None) is not None]
        if len(set(groups)) != len(groups):
            raise ValueError(f"two aggregators send results to one group and port {groups}: give each "
                             f"aggregator host its own [jobs] group_base (or result_port)")

    # -- the AggClient API ----------------------------------------------------------------------
    @property
    def elements(self) -> int:
        return self.clients[0]._elements

    @property
    def strategy(self) -> StrategyInfo:
        return self.clients[0].strategy

    @property
    def stats(self) -> dict:
        out: dict = {}
        for c in self.clients:
            for k, v in c.stats.items():
                out[k] = out.get(k, 0) + v
        return out

    def must_wait(self) -> bool:
        return any(c.must_wait() for c in self.clients)

    def allreduce(self, array, op: str = "sum", *, out: np.ndarray | None = None) -> np.ndarray:
        return self.allreduce_async(array, op, out=out).wait()

    def allreduce_async(self, array, op: str = "sum", *, block: bool = True,
                        out: np.ndarray | None = None) -> "ShardedHandle":
        """Start one call: each aggregator's partition goes through its client (see the module)."""
        a = np.asarray(array)
        if not block and self.must_wait():
            raise WouldBlock("an aggregator's client cannot start a round yet")
        if len(self.clients) == 1:
            return ShardedHandle(a, None, [(0, a.size, self.clients[0].allreduce_async(a, op, out=out))])
        flat = np.ascontiguousarray(a).reshape(-1)
        result = np.empty(a.shape, a.dtype) if out is None else out
        if out is not None and (out.shape != a.shape or out.dtype != a.dtype or not out.flags.c_contiguous):
            raise ValueError(f"out must be C-contiguous with the input's shape {a.shape} and dtype {a.dtype}")
        dest = result.reshape(-1)
        cuts = self.shard_map.cuts(flat.size, self.elements)
        parts = []
        for i, c in enumerate(self.clients):
            lo, hi = cuts[i], cuts[i + 1]
            if hi > lo:
                parts.append((lo, hi, c.allreduce_async(flat[lo:hi], op, out=dest[lo:hi])))
        if not parts:  # an empty tensor: the first aggregator answers it as it would alone
            return ShardedHandle(a, None, [(0, 0, self.clients[0].allreduce_async(a, op, out=out))])
        return ShardedHandle(a, result, parts)

    def close(self) -> None:
        errors = []
        for c in self.clients:
            try:
                c.close()
            except Exception as e:  # close every client, then report the first failure
                errors.append(e)
        if errors:
            raise errors[0]

    def __enter__(self) -> "ShardedClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<ShardedClient {[c.server for c in self.clients]} weights {self.shard_map.weights}>"


class ShardedHandle:
    """One sharded call to come: ``wait(timeout=None)``, ``done()``; once done ``rounds`` (each
    aggregator's round that answered its partition, None where it had none), ``n_contrib`` (per
    chunk of the whole tensor, in order) and ``strategy`` (the first partition's)."""

    def __init__(self, array: np.ndarray, result: np.ndarray | None,
                 parts: list[tuple[int, int, AllreduceHandle]]):
        self._shape = array.shape
        self._result = result
        self._parts = parts

    def done(self) -> bool:
        return all(h.done() for _, _, h in self._parts)

    def wait(self, timeout: float | None = None) -> np.ndarray:
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = [h for _, _, h in self._parts]
        while pending:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"{len(pending)} of {len(self._parts)} aggregators have not answered "
                                   f"within {timeout} s")
            if len(pending) == 1:
                pending[0].wait(left)  # raises TimeoutError itself
                pending = []
                continue
            for h in list(pending):
                try:
                    h.wait(POLL_SLICE if left is None else min(POLL_SLICE, left))
                except TimeoutError:
                    continue
                pending.remove(h)
        if self._result is None:
            return self._parts[0][2].wait()
        return self._result

    @property
    def rounds(self) -> list[int]:
        return [h.round for _, _, h in self._parts]

    @property
    def n_contrib(self) -> np.ndarray:
        return np.concatenate([np.asarray(h.n_contrib) for _, _, h in self._parts])

    @property
    def strategy(self) -> StrategyInfo | None:
        return self._parts[0][2].strategy

    def __repr__(self) -> str:
        return f"<ShardedHandle {len(self._parts)} partitions {'done' if self.done() else 'pending'}>"


def join_all(servers: Sequence[tuple[str, int]], job: int | str, rank: int, token: str, *,
             weights: Sequence[float] | None = None, bind_host: str = "0.0.0.0", timeout: float = 5.0,
             **client_options) -> ShardedClient:
    """Join job ``job`` (name or id) on every aggregator in ``servers`` with its one token, and
    return a ``ShardedClient`` over them (``weights``: the shard map's; default even)."""
    from .membership import join

    clients: list[AggClient] = []
    try:
        for server in servers:
            clients.append(join(server, job, rank, token, bind=(bind_host, 0), timeout=timeout, **client_options))
        return ShardedClient(clients, None if weights is None else ShardMap(tuple(weights)))
    except BaseException:
        for c in clients:
            c.close()
        raise
