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

import json
import logging
import threading
import time
from typing import Sequence

import numpy as np

from .client import AggClient, AllreduceHandle, WouldBlock
from .errors import AggdError
from .membership import client_for, join, request_join
from .protocol import Header, MsgType
from .shard_map import ShardMap
from .scales import ChunkScales, PartScales
from .shard_policy import RebalancePolicy
from .protocol.definition import RESULT_WINDOW, ZERO_EXPONENT, StrategyKind
from .strategy import StrategyInfo

log = logging.getLogger(__name__)

#: How long a wait on one aggregator's answers lasts before the next aggregator's are read, while
#: several are outstanding (each client makes progress only inside its own calls).
POLL_SLICE = 0.002
#: Seconds between the leader's JOINs to a failed-over aggregator (the first one that many seconds
#: after the failover), doubled each time that aggregator fails again, up to PROBE_MAX.
PROBE_EVERY = 5.0
PROBE_MAX = 300.0
#: Calls whose parts a member keeps copies of for failover (``ShardedClient._keep``), by the
#: strategy in force: how many calls apart its members may be when an aggregator dies. Blocking
#: calls under ``sync``, ``ssp`` and ``wbsp`` keep them within one call (a round is released only
#: once every member is in it); ``async`` answers at once, a member up to RESULT_WINDOW rounds
#: behind; a ``quorum`` straggler is let that far behind too (farther, a failover fails).
KEEP_CALLS = {StrategyKind.ASYNC: RESULT_WINDOW + 1, StrategyKind.QUORUM: RESULT_WINDOW + 1}


def send_report(client: AggClient, *, version: int, call: int, weights: Sequence[float], index: int,
                rates: Sequence[float | None], reason: str = "") -> None:
    """One shard report (docs/protocol.md, "Shard reports") from ``client``'s member address to its
    aggregator's daemon, which is aggregator ``index`` of the map. Best effort: never answered."""
    body = {"version": int(version), "call": int(call), "weights": list(weights), "index": int(index),
            "rates": list(rates), "reason": reason[:256]}
    msg = Header(type=MsgType.SHARDS, job=client._job, rank=client._rank, contributors=client._tag).pack()
    try:
        client._sock.sendto(msg + json.dumps(body).encode(), client._server)
    except OSError:
        pass


class ShardedClient:
    """``AggClient``'s API over several aggregators: ``allreduce``, ``allreduce_async``, ``close``.

    ``clients``: one ``AggClient`` per aggregator, of the same member (rank, world) and packet size;
    their results must not meet in one socket, so their (group, port) differ where they use groups.
    ``shard_map``: the weights (default: even). Use it as a context manager or ``close()`` it.

    Rebalancing (``rebalance_every=N``): calls are numbered from 0 (``calls``); at every N-th call
    the member ``leader`` (a rank) asks ``policy`` (default ``RebalancePolicy``), which has seen its
    own part timings, whether to move partitions, and publishes the map for the calls from there on
    under key ``<prefix><call>`` of ``store``; every member reads that key before it cuts the call.
    ``store`` is any store the members share with torch.distributed's ``Store`` API (``set``, and a
    ``get`` that waits for the key): under torchrun, the process group's store. So every call is cut
    by exactly one map, the same on every member, and a switch moves nothing in flight. ``history``
    lists ``(from call, map, reason)``.

    Failover (``failover_after=T``, every strategy; one call in flight a member): an aggregator
    every member has stalled on for T seconds is dropped by agreement (``_fail_over``). With
    ``rejoin`` (``join_all`` gives one) and agreed calls, the leader JOINs it again every
    ``probe_every`` seconds (None: never; the leader may still call ``revive``): once it answers,
    every member joins it at the next agreed call.
    """

    def __init__(self, clients: Sequence[AggClient], shard_map: ShardMap | None = None, *,
                 store=None, rebalance_every: int | None = None, policy: RebalancePolicy | None = None,
                 leader: int = 0, prefix: str = "aggd/shards/", failover_after: float | None = None,
                 rejoin=None, probe_every: float | None = PROBE_EVERY):
        self.clients = list(clients)
        if not self.clients:
            raise ValueError("a sharded client needs at least one aggregator's client")
        self.shard_map = ShardMap.even(len(self.clients)) if shard_map is None else shard_map
        if len(self.shard_map.weights) != len(self.clients):
            raise ValueError(f"the shard map has {len(self.shard_map.weights)} weights for "
                             f"{len(self.clients)} aggregators")
        first = self.clients[0]
        for c in self.clients[1:]:
            if c.precision != first.precision:
                raise ValueError(f"every aggregator's job must have one precision: int{first._lanes.bits} at "
                                 f"{first.server}, int{c._lanes.bits} at {c.server}")
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
        if rebalance_every is not None:
            if int(rebalance_every) < 1:
                raise ValueError(f"rebalance_every must be at least 1, not {rebalance_every}")
            if store is None:
                raise ValueError("rebalancing needs a store every member shares (torch.distributed's "
                                 "TCPStore, or the process group's store under torchrun)")
            if not 0 <= int(leader) < first._world:
                raise ValueError(f"leader must be a rank in 0..{first._world - 1}, not {leader}")
        if failover_after is not None:
            if not float(failover_after) > 0:
                raise ValueError(f"failover_after must be a positive number of seconds, not {failover_after}")
            if store is None:
                raise ValueError("failover needs a store every member shares (torch.distributed's TCPStore, "
                                 "or the process group's store under torchrun)")
            if len(self.clients) < 2:
                raise ValueError("failover needs at least two aggregators")
        if probe_every is not None and not float(probe_every) > 0:
            raise ValueError(f"probe_every must be a positive number of seconds or None, not {probe_every}")
        if len(self.clients) > 1:
            # An aggregator's rounds hold parts the map cut, whose sizes change with the map
            # (rebalancing, failover, a failed aggregator's part sent again): a quorum straggler
            # must not move to a round it saw, which may hold another part (catch_up=False).
            for c in self.clients:
                c._uniform = False
        self.failover_after = None if failover_after is None else float(failover_after)
        # the leader's probes of failed-over aggregators (``_probe_failed``): when each is due, how
        # often each has failed, which are under way (a probe's thread writes _revive: _lock)
        self.probe_every = None if probe_every is None else float(probe_every)
        self._probe_due: dict[int, float] = {}
        self._failures: dict[int, int] = {}
        self._probing: set[int] = set()
        self._lock = threading.Lock()
        self.dead: set[int] = set()          # aggregators failed over (never used again)
        self._epoch = 0                      # failovers agreed so far (the store's key space)
        self._switch: tuple[int, ShardMap, str] | None = None   # a map to take from a call on
        # copies of the last calls' parts (aggregator -> call -> (values, n_contrib)), and those of
        # a failed aggregator's parts taken from another member for calls this one has yet to make
        self._kept: dict[int, dict[int, tuple[np.ndarray, np.ndarray]]] = {}
        self._inherited: dict[tuple[int, int], tuple[bytes, np.ndarray]] = {}
        self._inherit_before: dict[int, int] = {}   # failed aggregator -> F: its parts before F inherited
        self._store, self._prefix = store, prefix
        # rejoin(i) -> (server, JobInfo, member address, client options): a failed aggregator back
        self._rejoin_fn = rejoin
        self._revive: dict[int, float | None] = {}   # the leader's requests: aggregator -> weight
        self._add: list[tuple[tuple[str, int], float | None]] = []   # the leader's: new aggregators
        self._asked: tuple[float, ...] | None = None   # the leader's: weights asked for (set_weights)
        self._every = None if rebalance_every is None else int(rebalance_every)
        self._leader = int(leader)
        self.policy = policy if policy is not None else (
            RebalancePolicy(len(self.clients)) if self._every else None)
        self.calls = 0
        self.history: list[tuple[int, ShardMap, str]] = [(0, self.shard_map, "the map given")]

    # -- the AggClient API ----------------------------------------------------------------------
    @property
    def elements(self) -> int:
        return self.clients[0]._elements

    @property
    def rank(self) -> int:
        return self.clients[0]._rank

    @property
    def precision(self):
        """The job's contribution precision (every aggregator's job has the same)."""
        return self.clients[0].precision

    @property
    def round(self) -> int:
        """The number the next call gets (calls so far): what ``ShardedHandle.round`` answers."""
        return self.calls

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
        return any(c.must_wait() for i, c in enumerate(self.clients) if i not in self.dead)

    def allreduce(self, array, op: str = "sum", *, out: np.ndarray | None = None,
                  residual: np.ndarray | None = None, scales: PartScales | None = None) -> np.ndarray:
        return self.allreduce_async(array, op, out=out, residual=residual, scales=scales).wait()

    def allreduce_async(self, array, op: str = "sum", *, block: bool = True,
                        out: np.ndarray | None = None, residual: np.ndarray | None = None,
                        scales: PartScales | None = None) -> "ShardedHandle":
        """Start one call: each aggregator's partition goes through its client (see the module).
        ``residual``: as ``AggClient.allreduce_async``'s, each partition's part written by its
        client (a failed-over part's by the replacement's). ``scales``: an earlier call's handle's
        ``scales``, each part's passed to its client where the parts are cut alike."""
        a = np.asarray(array)
        if residual is not None and (not isinstance(residual, np.ndarray) or residual.size != a.size
                                     or not residual.flags.c_contiguous):
            raise ValueError(f"residual must be a C-contiguous array of {a.size} values")
        res = None if residual is None else residual.reshape(-1)

        def part(lo, hi):
            return None if res is None else res[lo:hi]

        def scale(lo, hi):
            return None if scales is None else scales.part(lo, hi)
        if not block and self.must_wait():
            raise WouldBlock("an aggregator's client cannot start a round yet")
        if self._every and self.calls and self.calls % self._every == 0:
            self._agree(self.calls)
        call = self.calls
        self.calls += 1
        if self._switch is not None and call >= self._switch[0]:
            _, new, reason = self._switch
            self._switch = None
            self.shard_map = new
            self.history.append((call, new, reason))
        m = self.shard_map
        if len(self.clients) == 1:
            return ShardedHandle(self, call, m, None, [(0, 0, a.size, self.clients[0].allreduce_async(
                a, op, out=out, residual=residual, scales=scale(0, a.size)))])
        flat = np.ascontiguousarray(a).reshape(-1)
        if out is not None and (out.shape != a.shape or out.dtype != a.dtype or not out.flags.c_contiguous):
            raise ValueError(f"out must be C-contiguous with the input's shape {a.shape} and dtype {a.dtype}")
        result = np.empty(a.shape, a.dtype) if out is None else out
        dest = result.reshape(-1)
        cuts = m.cuts(flat.size, self.elements)
        parts = []
        for i, c in enumerate(self.clients):
            lo, hi = cuts[i], cuts[i + 1]
            if hi > lo and i not in self.dead:
                parts.append((i, lo, hi, c.allreduce_async(flat[lo:hi], op, out=dest[lo:hi], residual=part(lo, hi),
                                                           scales=scale(lo, hi))))
        settled = []
        for i in sorted(self.dead):  # a failed-over aggregator's part, while the map still has one:
            lo, hi = cuts[i], cuts[i + 1]    # one more round on the replacement, after its own part,
            if hi <= lo:                     # unless another member got its result before it failed
                continue
            copy = self._inherited.pop((i, call), None)
            if copy is not None:
                settled.append((len(parts), copy))
                parts.append((i, lo, hi, None))
                continue
            if call < self._inherit_before.get(i, -1):   # sent again, it would break the replacement's order
                raise AggdError(f"call {call}: aggregator {i} failed and no member had its part of this call")
            j = self._replacement()
            parts.append((j, lo, hi, self.clients[j].allreduce_async(flat[lo:hi], op, out=dest[lo:hi],
                                                                     residual=part(lo, hi))))
        if not parts:  # an empty tensor: the first aggregator answers it as it would alone
            j = self._replacement() if 0 in self.dead else 0
            return ShardedHandle(self, call, m, None, [(j, 0, 0, self.clients[j].allreduce_async(
                a, op, out=out, residual=residual))])
        h = ShardedHandle(self, call, m, result, parts, flat=flat, dest=dest, op=op)
        h._residual = res
        for j, (data, counts) in settled:
            h._settle_part(j, data, counts)
        return h

    def _agree(self, call: int) -> None:
        """The map for calls from ``call`` on: the leader decides and publishes, everyone reads."""
        key = f"{self._prefix}{call}"
        if self.rank == self._leader:
            d = self.policy.decide(self.shard_map)
            chosen, reason, back = d.shard_map or self.shard_map, d.reason, []
            if self._asked is not None and self._switch is None:
                chosen = ShardMap(tuple(0 if i in self.dead else w for i, w in enumerate(self._asked)),
                                  self.shard_map.version + 1)
                reason = f"weights {chosen.weights} asked for"
                self._asked = None
            added = []
            if self._add and self._switch is None:
                weights = list(chosen.weights)
                for server, weight in self._add:
                    weights.append(weight or max(weights))
                    added.append(list(server))
                self._add.clear()
                chosen = ShardMap(tuple(weights), chosen.version + 1)
                reason = f"aggregator{'s' if len(added) > 1 else ''} {', '.join(f'{h}:{p}' for h, p in added)} added"
            self._probe_failed()
            with self._lock:
                # not while a failover's map is pending, nor while a probe of that aggregator is in
                # flight: its JOIN, answered after ours, would move our member address to its port
                revive = {i: w for i, w in self._revive.items() if i not in self._probing} \
                    if self._switch is None else {}
                for i in revive:
                    del self._revive[i]
            if revive:
                back = sorted(i for i in revive if i in self.dead)
                weights = list(chosen.weights)
                for i in back:
                    weights[i] = revive[i] or max(weights)
                if back:
                    chosen = ShardMap(tuple(weights), chosen.version + 1)
                    reason = (f"{reason}; " if added else "") + \
                        f"aggregator{'s' if len(back) > 1 else ''} {', '.join(map(str, back))} back"
            log.info("shard map at call %d: %s", call, reason)
            self._store.set(key, json.dumps({"version": chosen.version, "weights": list(chosen.weights),
                                             "reason": reason, "revive": back, "add": added}))
        if self.failover_after is not None:
            # between calls, a failover may be under way: the members a call behind need this one
            everyone = range(self.clients[0]._world)
            while not self._store.check([key]):
                if any(self._store.check([f"{self._prefix}failover/{self._epoch}/{r}"]) for r in everyone):
                    self._fail_over(None, list(range(len(self.clients))))
                else:
                    time.sleep(0.005)
        doc = json.loads(self._store.get(key))
        if self.rank == self._leader:
            self._report(call, doc)
        for server in doc.get("add", []):
            self._join_new((str(server[0]), int(server[1])), call)
        for i in doc.get("revive", []):
            self._rejoin(i, call)
        if doc["version"] == self.shard_map.version:
            return
        new = ShardMap(tuple(doc["weights"]), int(doc["version"]))
        if len(new.weights) != len(self.clients):
            raise ValueError(f"the store's shard map {key} has {len(new.weights)} weights for "
                             f"{len(self.clients)} aggregators")
        self.shard_map = new
        self.history.append((call, new, doc["reason"]))
        log.info("shard map version %d from call %d: %s", new.version, call, doc["reason"])

    def _report(self, call: int, doc: dict) -> None:
        """Tell every live aggregator host's daemon the map agreed at ``call`` and each host's rate as
        this member measures it (docs/protocol.md, "Shard reports": aggctl and the metrics show them).
        Best effort: a lost report is replaced by the next one."""
        rates = list(self.policy.rates) if self.policy is not None else []
        rates = [None if r is None else float(r) for r in rates] + [None] * (len(doc["weights"]) - len(rates))
        for i, c in enumerate(self.clients):
            if i not in self.dead and i < len(doc["weights"]):
                send_report(c, version=doc["version"], call=call, weights=doc["weights"], index=i,
                            rates=rates[:len(doc["weights"])], reason=str(doc.get("reason", "")))

    # -- failover and back ---------------------------------------------------------------------------
    def _leader_request(self, what: str) -> None:
        """A change only the leader asks for, published at the next agreed call."""
        if self.rank != self._leader:
            raise ValueError(f"only the leader (rank {self._leader}) {what}")
        if not self._every:
            raise ValueError(f"the leader {what} at agreed calls: it needs rebalance_every")

    def revive(self, aggregator: int, weight: float | None = None) -> None:
        """(The leader.) Bring a failed-over aggregator back at the next agreed call: every member
        joins it again (``rejoin``: ``join_all`` gives one), they agree on its first round through
        the store, and the map gives it ``weight`` (default the largest weight in use)."""
        self._leader_request("brings an aggregator back")
        if aggregator not in self.dead:
            raise ValueError(f"aggregator {aggregator} has not failed (failed: {sorted(self.dead)})")
        with self._lock:
            self._revive[aggregator] = weight

    def _probe_failed(self) -> None:
        """(The leader, at an agreed call.) JOIN each failed-over aggregator every ``probe_every``
        seconds, in the background: one that answers is brought back at the next agreed call, as
        ``revive`` does. An aggregator that fails again is probed half as often each time (at most
        PROBE_MAX s apart), so a host that keeps failing does not stall the job at every return."""
        if self.probe_every is None or self._rejoin_fn is None or not self._every:
            return
        now = time.monotonic()
        with self._lock:
            due = [i for i in sorted(self.dead - self._probing - set(self._revive))
                   if now >= self._probe_due.setdefault(i, now + self._probe_gap(i))]
            self._probing.update(due)
        for i in due:
            threading.Thread(target=self._probe, args=(i,), name=f"aggd-probe-{i}", daemon=True).start()

    def _probe_gap(self, i: int) -> float:
        return min(self.probe_every * 2 ** (self._failures.get(i, 1) - 1), PROBE_MAX)

    def _probe(self, i: int) -> None:
        try:
            self._rejoin_fn(i)      # a JOIN answered: the daemon is up, the job there, our token good
        except Exception as exc:  # noqa: BLE001 - no answer, or a refusal: try again later
            log.info("aggregator %d still failed (%s); next probe in %.0f s", i, exc, self._probe_gap(i))
            with self._lock:
                self._probe_due[i] = time.monotonic() + self._probe_gap(i)
                self._probing.discard(i)
            return
        log.warning("aggregator %d answers again: back at the next agreed call", i)
        with self._lock:
            self._revive.setdefault(i, None)
            self._probe_due.pop(i, None)
            self._probing.discard(i)

    def set_weights(self, weights: Sequence[float]) -> None:
        """(The leader.) The map's weights from the next agreed call (a 0 drains that aggregator:
        scale in); failed aggregators stay at 0."""
        self._leader_request("sets the weights")
        m = ShardMap(tuple(weights))
        if len(m.weights) != len(self.clients):
            raise ValueError(f"{len(m.weights)} weights for {len(self.clients)} aggregators")
        self._asked = m.weights

    def add_aggregator(self, server: tuple[str, int], weight: float | None = None) -> None:
        """(The leader.) Scale out: at the next agreed call every member joins the job on ``server``
        too (the job registered there with the same token), and the map gives it ``weight``
        (default the largest weight in use)."""
        self._leader_request("adds an aggregator")
        self._add.append(((str(server[0]), int(server[1])), weight))

    def _joined(self, target, call: int, what: str) -> AggClient:
        """A client of aggregator ``target`` (an index, or a new server), its first round agreed."""
        if self._rejoin_fn is None:
            raise AggdError(f"aggregator {target} is in the map, but this member cannot join it "
                            f"(ShardedClient needs rejoin=; join_all gives one)")
        server, info, address, options = self._rejoin_fn(target)
        key = f"{self._prefix}{what}/{call}/{len(self.clients) if what == 'add' else target}/"
        self._store.set(f"{key}{self.rank}", str(int(info.round)))
        first = max(int(self._store.get(f"{key}{r}")) for r in range(self.clients[0]._world))
        client = client_for(server, info, address, self.rank, first_round=first,
                            **{"strategy": info.strategy, **options, "catch_up": False})
        if info.elements != self.elements or info.world != self.clients[0]._world:
            client.close()
            raise AggdError(f"the job on {server[0]}:{server[1]} has {info.world} members and {info.elements} "
                            f"values a packet, not {self.clients[0]._world} and {self.elements}")
        return client

    def _rejoin(self, i: int, call: int) -> None:
        """Join aggregator ``i`` again and start its rounds where every member agrees."""
        self.clients[i] = self._joined(i, call, "revive")
        self.dead.discard(i)
        self._probe_due.pop(i, None)
        log.warning("aggregator %d back from call %d", i, call)

    def _join_new(self, server: tuple[str, int], call: int) -> None:
        """Scale out: one more aggregator from ``call`` on."""
        self.clients.append(self._joined(server, call, "add"))
        if self.policy is not None:
            self.policy.grow()
        log.warning("aggregator %s:%d added from call %d", server[0], server[1], call)

    def _replacement(self) -> int:
        """The aggregator that takes a failed one's parts: the first live one the map gives weight."""
        live = [i for i, w in enumerate(self.shard_map.weights) if w > 0 and i not in self.dead]
        if not live:
            live = [i for i in range(len(self.clients)) if i not in self.dead]
        if not live:
            raise AggdError("every aggregator of the job has failed")
        return live[0]

    def _keep(self, call: int, parts, dest: np.ndarray, settled: dict, strategy: StrategyInfo | None) -> None:
        """Copies of a finished call's parts: a member calls behind may need them (``_fail_over``),
        as many calls back as the strategy lets members be apart (KEEP_CALLS)."""
        depth = KEEP_CALLS.get(strategy.kind, 1) if strategy is not None else 1
        for j, (i, lo, hi, h) in enumerate(parts):
            counts = settled[j] if j in settled else np.asarray(h.n_contrib)
            self._kept.setdefault(i, {}).setdefault(call, (dest[lo:hi].copy(), counts.copy()))
        for calls in self._kept.values():
            for c in [c for c in calls if c <= call - depth]:
                del calls[c]

    def _fail_over(self, handle: "ShardedHandle | None", stalled: list[int]) -> None:
        """Agree through the store on which aggregators have failed and go on without them.

        When an aggregator dies every member ends up stalled on it, each in its call: under ``sync``
        (``ssp``, ``wbsp``) in one call ``F`` or the one before, under ``async`` or ``quorum`` up to
        KEEP_CALLS calls apart (a fast member got answers the others have yet to ask for). Each
        reports its call and its stalled aggregators; the failed ones are those every member has
        stalled on (another may only be waiting for the members behind). ``F`` is the newest call
        reported: nobody has the failed aggregators' parts of it, and the lowest-ranked member at
        ``F`` has those of every earlier call (it finished them) and kept copies. Members behind take
        the parts of their calls before ``F`` from the store, now or when they make them; at ``F``
        every member sends the failed aggregators' parts again as one more round on the replacement
        (after its own part, so its rounds keep one order on every member); from ``F + 1`` the map
        gives the failed aggregators weight 0. ``handle`` None: a member between calls (waiting for
        the leader's map at call ``self.calls``), which has stalled on nothing and may be the one
        that hands out the earlier calls' parts."""
        epoch = self._epoch
        key = f"{self._prefix}failover/{epoch}/"
        call = self.calls if handle is None else handle.call
        if handle is not None and self.calls > call + 1:
            raise AggdError(f"failover {epoch}: member {self.rank} has calls {call} to {self.calls - 1} in flight; "
                            f"failover needs one call in flight a member (wait for each before the next)")
        self._store.set(f"{key}{self.rank}", json.dumps({"call": call, "stalled": stalled}))
        world = self.clients[0]._world
        reports = [json.loads(self._store.get(f"{key}{r}")) for r in range(world)]
        self._epoch += 1
        dead = set.intersection(*(set(r["stalled"]) for r in reports)) - self.dead
        if not dead or not set(range(len(self.clients))) - self.dead - dead:
            # none, or every one: members waiting for one another (a slow member under sync, a
            # full window under async), or the network down -- nothing a failover could mend
            log.warning("failover %d: %s aggregator every member stalled on (%s); waiting on", epoch,
                        "no" if not dead else "every", reports)
            return
        calls = {r["call"] for r in reports}
        last, first = max(calls), min(calls)
        live = [c for i, c in enumerate(self.clients) if i not in self.dead | dead]
        kind = live[0].strategy.kind if live else StrategyKind.SYNC
        depth = KEEP_CALLS.get(kind, 1)
        if last - first > depth and kind != StrategyKind.QUORUM:
            raise AggdError(f"failover {epoch}: members are more than {depth} call{'s' if depth > 1 else ''} "
                            f"apart under {live[0].strategy if live else 'sync'} ({sorted(calls)})")
        ahead = min(r for r, rep_ in enumerate(reports) if rep_["call"] == last)
        self.dead |= dead
        for i in dead:
            self._failures[i] = self._failures.get(i, 0) + 1
        weights = tuple(0 if i in self.dead else w for i, w in enumerate(self.shard_map.weights))
        if not any(weights):
            weights = tuple(0 if i in self.dead else 1 for i in range(len(self.clients)))
        behind = f"calls {first} to {last}" if last - first > 1 else f"call {first}"
        reason = (f"aggregator{'s' if len(dead) > 1 else ''} {', '.join(map(str, sorted(dead)))} stopped answering "
                  f"(every member stalled on it in {behind if len(calls) > 1 else f'call {last}'}): failed over")
        log.warning("%s; the map drops it from call %d", reason, last + 1)
        self._switch = (last + 1, ShardMap(weights, self.shard_map.version + 1), reason)
        for i in sorted(dead):
            c = self.clients[i]
            c._give_up = 1e-3   # nothing will answer: close without waiting for the rounds in flight
            try:
                c.close()
            except Exception:  # noqa: BLE001 - a dead aggregator's client closes as it can
                pass
        if call == last and len(calls) > 1 and self.rank == ahead:
            for i in sorted(dead):   # the members behind take these
                for c in range(first, last):
                    kept = self._kept.get(i, {}).get(c)
                    if kept is None:   # (a call that gave aggregator i no part: nothing to take)
                        continue
                    self._store.set(f"{key}part/{i}/{c}", kept[0].tobytes())
                    self._store.set(f"{key}n_contrib/{i}/{c}", kept[1].astype(np.uint16).tobytes())
                self._store.set(f"{key}parts/{i}", json.dumps(sorted(c for c in self._kept.get(i, {})
                                                                     if first <= c < last)))
        if call < last:   # the failed aggregators' parts of our calls before F, as the member ahead got them
            for i in sorted(dead):
                have = set(json.loads(self._store.get(f"{key}parts/{i}")))
                for c in range(call, last):
                    took = c if c in have else max(have) if kind == StrategyKind.QUORUM and have else None
                    # (max: a quorum straggler farther behind, answered with the newest as a quorum does)
                    if took is None:       # a call that gave aggregator i no part, or a copy missing
                        if handle is not None and c == call and any(agg == i for agg, *_ in handle._parts):
                            raise AggdError(f"failover {epoch}: no member has aggregator {i}'s part of call {c}")
                        continue
                    copy = (self._store.get(f"{key}part/{i}/{took}"),
                            np.frombuffer(self._store.get(f"{key}n_contrib/{i}/{took}"), np.uint16))
                    if handle is not None and c == call:
                        handle._settle(i, *copy)
                    else:
                        self._inherited[(i, c)] = copy
        self._inherit_before.update({i: last for i in dead})
        if handle is not None and call == last:
            handle._redo(sorted(dead), self._replacement())

    def _observed(self, values: list[int], seconds: list[float]) -> None:
        if self.policy is not None:
            self.policy.observe(values, seconds)

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
    """One sharded call to come: ``wait(timeout=None)``, ``done()``; once done ``round`` (the
    call's number, see below), ``rounds`` (each part's round on its aggregator), ``n_contrib`` (per
    chunk of the whole tensor, in order), ``strategy`` (the first part's) and ``shard_map`` (the
    map that cut it)."""

    def __init__(self, owner: ShardedClient, call: int, shard_map: ShardMap, result: np.ndarray | None,
                 parts: list[tuple[int, int, int, AllreduceHandle]], *, flat: np.ndarray | None = None,
                 dest: np.ndarray | None = None, op: str = "sum"):
        self._owner = owner
        self.call = call
        self._flat, self._dest, self._op = flat, dest, op
        self._settled: dict[int, np.ndarray] = {}   # part index -> n_contrib taken from another member
        self.shard_map = shard_map
        self._result = result
        self._parts = parts
        self._start = time.monotonic()
        self._took: dict[int, float] = {}   # part index -> seconds from the call to its result

    def _mark(self, j: int) -> None:
        if j not in self._took:
            self._took[j] = time.monotonic() - self._start
            if len(self._took) == len(self._parts):   # every part answered: one observation
                if self._owner.failover_after is not None and self._dest is not None:
                    self._owner._keep(self.call, self._parts, self._dest, self._settled, self.strategy)
                k = len(self._owner.clients)
                values, seconds = [0] * k, [0.0] * k
                for p, (i, lo, hi, h) in enumerate(self._parts):
                    if h is None:   # taken from another member: says nothing of an aggregator's rate
                        continue
                    values[i] += hi - lo
                    seconds[i] = max(seconds[i], self._took[p])
                self._owner._observed(values, seconds)

    def done(self) -> bool:
        ready = True
        for j, (_, _, _, h) in enumerate(self._parts):
            if j in self._took:
                continue
            if h.done():
                if h._round.error is None:
                    self._mark(j)
            else:
                ready = False
        return ready

    def _stalled(self, progress: dict[int, tuple[int, float]], now: float) -> list[int]:
        """Aggregators of pending parts that have answered nothing for ``failover_after`` s."""
        out = set()
        for j in range(len(self._parts)):
            if j in self._took:
                continue
            have = self._parts[j][3]._round.n_have
            seen, since = progress.get(j, (-1, now))
            if have != seen:
                progress[j] = (have, now)
            elif now - since >= self._owner.failover_after:
                out.add(self._parts[j][0])
        return sorted(out)

    def _settle(self, i: int, data: bytes, counts: np.ndarray) -> None:
        """Aggregator ``i``'s part, as another member got it (``ShardedClient._fail_over``)."""
        for j, (agg, lo, hi, h) in enumerate(self._parts):
            if agg == i:
                self._settle_part(j, data, counts)

    def _settle_part(self, j: int, data: bytes, counts: np.ndarray) -> None:
        agg, lo, hi, _ = self._parts[j]
        values = np.frombuffer(data, self._dest.dtype)
        if values.size != hi - lo:   # a quorum straggler's older call, answered with a newer one's
            raise AggdError(f"call {self.call}: aggregator {agg} failed, and the part another member got has "
                            f"{values.size} values, not {hi - lo} (a call of another tensor)")
        self._dest[lo:hi] = values
        self._settled[j] = counts
        self._mark(j)

    def _redo(self, dead: list[int], replacement: int) -> None:
        """The failed aggregators' parts again, as one more round each on ``replacement``."""
        c = self._owner.clients[replacement]
        for j, (agg, lo, hi, h) in enumerate(self._parts):
            if agg in dead and j not in self._took:
                res = getattr(self, "_residual", None)
                self._parts[j] = (replacement, lo, hi,
                                  c.allreduce_async(self._flat[lo:hi], self._op, out=self._dest[lo:hi],
                                                    residual=None if res is None else res[lo:hi]))

    def wait(self, timeout: float | None = None) -> np.ndarray:
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = [j for j in range(len(self._parts)) if j not in self._took]
        progress: dict[int, tuple[int, float]] = {}
        failover = self._owner.failover_after is not None and self._dest is not None
        while pending:
            if failover:
                stalled = self._stalled(progress, time.monotonic())
                if stalled:
                    self._owner._fail_over(self, stalled)
                    progress.clear()
                    pending = [j for j in range(len(self._parts)) if j not in self._took]
                    continue
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"{len(pending)} of {len(self._parts)} aggregators have not answered "
                                   f"within {timeout} s")
            for j in list(pending):
                h = self._parts[j][3]
                try:
                    if len(pending) == 1 and not failover:
                        h.wait(left)  # raises TimeoutError itself
                    else:
                        h.wait(POLL_SLICE if left is None else min(POLL_SLICE, left))
                except TimeoutError:
                    if len(pending) == 1 and not failover:
                        raise
                    continue
                self._mark(j)
                pending.remove(j)
        if self._result is None:
            return self._parts[0][3].wait()
        return self._result

    @property
    def round(self) -> int:
        """The call's number; one more when a part was answered by a newer round of its aggregator
        than the one it asked for (a quorum/async straggler: the result may hold another call's
        tensor), as ``AllreduceHandle.round`` is then above the round asked."""
        newer = any(h.round != h._round.number for _, _, _, h in self._parts if h is not None)
        return self.call + (1 if newer else 0)

    @property
    def rounds(self) -> list[int]:
        """Each part's round on its aggregator, in tensor order (None: a failed aggregator's part
        taken from another member)."""
        return [None if h is None else h.round for _, _, _, h in sorted(self._parts, key=lambda p: p[1])]

    @property
    def n_contrib(self) -> np.ndarray:
        order = sorted(range(len(self._parts)), key=lambda j: self._parts[j][1])   # tensor order
        return np.concatenate([self._settled[j] if j in self._settled else np.asarray(self._parts[j][3].n_contrib)
                               for j in order])

    @property
    def scales(self) -> PartScales:
        """Once done: each part's ``AllreduceHandle.scales``, by its value range (``aggd_client.scales``)."""
        out, E = {}, self._owner.elements
        for _, lo, hi, h in self._parts:
            sc = None if h is None else h.scales
            if sc is None:  # a part taken from another member: every chunk of it without a scale
                none = np.full(-(-(hi - lo) // E), ZERO_EXPONENT, np.int32)
                sc = ChunkScales(E, none, none)
            out[(lo, hi)] = sc
        return PartScales(out)

    @property
    def strategy(self) -> StrategyInfo | None:
        return next((h.strategy for _, _, _, h in self._parts if h is not None), None)

    def __repr__(self) -> str:
        return f"<ShardedHandle {len(self._parts)} partitions {'done' if self.done() else 'pending'}>"


def join_all(servers: Sequence[tuple[str, int]], job: int | str, rank: int, token: str, *,
             weights: Sequence[float] | None = None, bind_host: str = "0.0.0.0", timeout: float = 5.0,
             store=None, rebalance_every: int | None = None, failover_after: float | None = None,
             probe_every: float | None = PROBE_EVERY, **client_options) -> ShardedClient:
    """Join job ``job`` (name or id) on every aggregator in ``servers`` with its one token, and
    return a ``ShardedClient`` over them (``weights``: the shard map's, default even; ``store``,
    ``rebalance_every``, ``failover_after`` and ``probe_every``: see ``ShardedClient``; it joins a
    failed aggregator again once the leader's probe finds it back, or the leader calls ``revive``)."""
    clients: list[AggClient] = []
    try:
        for server in servers:
            clients.append(join(server, job, rank, token, bind=(bind_host, 0), timeout=timeout, **client_options))
        return ShardedClient(clients, None if weights is None else ShardMap(tuple(weights)), store=store,
                             rebalance_every=rebalance_every, failover_after=failover_after,
                             probe_every=probe_every, rejoin=rejoiner(servers, job, rank, token, bind_host, timeout, client_options))
    except BaseException:
        for c in clients:
            c.close()
        raise


def rejoiner(servers: Sequence[tuple[str, int]], job: int | str, rank: int, token: str, bind_host: str,
             timeout: float, client_options: dict):
    """``ShardedClient``'s ``rejoin``: JOIN aggregator ``i`` again, or a new one (a server: it then
    becomes the next index), from a new port of ``bind_host``."""
    known = list(servers)

    def rejoin(target):
        if isinstance(target, int):
            server = known[target]
        else:
            server = tuple(target)
            known.append(server)
        info, address = request_join(server, job, rank, token, bind=(bind_host, 0), timeout=timeout)
        return server, info, address, dict(client_options)
    return rejoin
