"""Two levels of aggregators under simulated workers: racks of workers, each rack's aggregator
forwarding complete rounds to one upper aggregator and relaying its results (docs/protocol.md,
"Two levels").

Deterministic for a seed: a discrete-event network with random delays and losses (every copy of
a multicast lost on its own), workers that follow the client's rules for ``sync`` (each call's
chunks in order, at most ``slots`` in flight, ``skip`` per chunk, retransmission after a timeout,
flagged), and any data planes with the reference model's ``process(data, src, now) -> Verdict``:
the model itself, or the XDP program through BPF_PROG_TEST_RUN. Every contribution is exponent 0
and small, so the exact sum is known: ``run`` returns what every worker got.
"""
from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field

import numpy as np

from aggd.core.model import AggregatorModel, JobConfig, Upstream
from aggd_client.protocol import Flag, Header, MsgType, PAYLOAD_DTYPE

UPPER = ("10.9.0.1", 47000)
UPPER_JOB = 7
RACK_JOB = 3
GROUP = ("239.77.0.3", 47001)
UPPER_GROUP = ("239.77.9.7", 47001)


def rack_addr(r: int) -> tuple[str, int]:
    return (f"10.8.{r}.1", 47000)


def worker_addr(r: int, m: int) -> tuple[str, int]:
    return (f"10.8.{r}.{m + 10}", 40000 + m)


def rack_tag(r: int) -> int:
    return 0x5EED0000 + r


def rack_config(r: int, members: int, *, slots: int, max_chunks: int = 1 << 16) -> JobConfig:
    """Rack ``r``'s job: its workers, its group, an upper aggregator not linked yet."""
    return JobConfig(job=RACK_JOB, world=members, slots=slots, max_chunks=max_chunks,
                     members={m: worker_addr(r, m) for m in range(members)}, group=GROUP,
                     upstream=Upstream(UPPER))


def link(r: int) -> Upstream:
    """What rack ``r``'s daemon learns from the upper aggregator's JOIN_ACK."""
    return Upstream(UPPER, UPPER_JOB, r, rack_tag(r))


def upper_config(racks: int, *, slots: int, max_chunks: int = 1 << 16) -> JobConfig:
    return JobConfig(job=UPPER_JOB, world=racks, slots=slots, max_chunks=max_chunks,
                     members={r: rack_addr(r) for r in range(racks)}, group=UPPER_GROUP,
                     tags={r: rack_tag(r) for r in range(racks)})


def contribution(r: int, m: int, members: int, round_: int, chunk: int, elements: int) -> np.ndarray:
    """Worker (r, m)'s values: small, distinct per worker, round and chunk."""
    g = r * members + m
    return (np.arange(elements, dtype=np.int64) * 3 + g * 1000 + round_ * 17 + chunk * 5 - 40).astype(PAYLOAD_DTYPE)


@dataclass
class Worker:
    r: int
    m: int
    calls: list[int]                        #: chunks of each call
    got: dict = field(default_factory=dict)  #: (round, chunk) -> (values, header)
    sent: dict = field(default_factory=dict)  #: (round, chunk) -> time last sent
    last_round_of_chunk: dict = field(default_factory=dict)
    skips: dict = field(default_factory=dict)  #: (round, chunk) -> its skip
    call: int = 0
    next_chunk: int = 0

    @property
    def done(self) -> bool:
        return self.call >= len(self.calls)


@dataclass
class Tree:
    racks: list            #: rack planes (process(data, src, now) -> Verdict)
    upper: object          #: the upper plane
    members: int           #: workers a rack
    elements: int
    slots: int
    loss: float = 0.0
    seed: int = 0
    timeout: int = 40
    #: (plane, verdict) of every answer the planes gave, for checks on the bytes
    seen: list = field(default_factory=list)

    def run(self, calls: list[int], max_time: int = 200_000) -> list[Worker]:
        rng = random.Random(self.seed)
        workers = [Worker(r, m, list(calls)) for r in range(len(self.racks)) for m in range(self.members)]
        by_addr = {worker_addr(w.r, w.m): w for w in workers}
        events: list = []
        seq = [0]

        def send(t, dest, src, data):
            if rng.random() < self.loss:
                return
            seq[0] += 1
            heapq.heappush(events, (t + rng.randint(1, 4), seq[0], dest, src, data))

        def answer(t, plane_addr, verdict, sender, fanout):
            if verdict.action != "tx":
                return
            if verdict.dest == "group":
                for a in fanout:
                    send(t, a, plane_addr, verdict.out)
            else:
                for a in verdict.addrs:
                    send(t, a if verdict.dest == "upstream" else sender, plane_addr, verdict.out)

        def contribute(t, w, round_, chunk, again):
            if not again:       # rounds since this chunk's previous one (a retransmission says it again)
                w.skips[(round_, chunk)] = round_ - w.last_round_of_chunk.get(chunk, -1) - 1
                w.last_round_of_chunk[chunk] = round_
            skip = w.skips[(round_, chunk)]
            hdr = Header(type=MsgType.CONTRIB, job=RACK_JOB, rank=w.m, round=round_, chunk=chunk,
                         count=self.elements, flags=Flag.RETRANSMIT if again else 0, skip=skip)
            data = hdr.pack() + contribution(w.r, w.m, self.members, round_, chunk, self.elements).tobytes()
            w.sent[(round_, chunk)] = t
            send(t, rack_addr(w.r), worker_addr(w.r, w.m), data)

        def pump(t, w):
            """Send what the worker may: the chunks of its call, at most ``slots`` in flight."""
            while not w.done:
                n = w.calls[w.call]
                if w.next_chunk >= n:
                    if all((w.call, c) in w.got for c in range(n)):
                        w.call, w.next_chunk = w.call + 1, 0
                        continue
                    return
                c = w.next_chunk
                if c >= self.slots and (w.call, c - self.slots) not in w.got:
                    return
                contribute(t, w, w.call, c, again=False)
                w.next_chunk += 1

        for w in workers:
            pump(0, w)
        t = 0
        while not all(w.done for w in workers):
            if t > max_time:
                raise AssertionError(f"stalled at time {t}: {[(w.r, w.m, w.call) for w in workers]}")
            while events and events[0][0] <= t:
                _, _, dest, src, data = heapq.heappop(events)
                if dest == UPPER:
                    v = self.upper.process(data, src, t)
                    self.seen.append(("upper", v))
                    answer(t, UPPER, v, src, [rack_addr(r) for r in range(len(self.racks))])
                elif dest in [rack_addr(r) for r in range(len(self.racks))]:
                    r = int(dest[0].split(".")[2])
                    v = self.racks[r].process(data, src, t)
                    self.seen.append((r, v))
                    answer(t, dest, v, src, [worker_addr(r, m) for m in range(self.members)])
                elif dest in by_addr:
                    w = by_addr[dest]
                    h = Header.unpack(data)
                    if h.type == MsgType.RESULT and (h.round, h.chunk) in w.sent:
                        w.got.setdefault((h.round, h.chunk),
                                         (np.frombuffer(data, PAYLOAD_DTYPE, offset=40).copy(), h))
                        pump(t, w)
            for w in workers:                       # retransmission
                for key, sent_at in list(w.sent.items()):
                    if key not in w.got and t - sent_at >= self.timeout:
                        contribute(t, w, key[0], key[1], again=True)
            t += 1
        return workers


def model_tree(racks: int, members: int, *, elements: int = 8, slots: int = 4) -> tuple[list, AggregatorModel]:
    """Rack models (the daemon's user-space path, linked) and an upper model (the kernel's rules)."""
    rack_planes = []
    for r in range(racks):
        m = AggregatorModel(elements, userspace=True)
        m.add_job(rack_config(r, members, slots=slots))
        m.set_upstream(RACK_JOB, link(r))
        rack_planes.append(m)
    upper = AggregatorModel(elements)
    upper.add_job(upper_config(racks, slots=slots))
    return rack_planes, upper


def exact(workers: list[Worker], members: int, racks: int, round_: int, chunk: int, elements: int) -> np.ndarray:
    return sum(contribution(r, m, members, round_, chunk, elements).astype(np.int64)
               for r in range(racks) for m in range(members))
