"""What the data-plane equivalence tests share (tests/bpf/test_model_equivalence.py,
tests/p4/test_p4_equivalence.py): the frames they send, how a message is described in a failure,
the fixture tables and the randomised traffic of tests/fixtures/traffic.py played
through a side-by-side harness (an object with ``start``, ``set_strategy``, ``send``,
``check_counters`` and ``model``)."""
from __future__ import annotations

import collections
import socket
import struct

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

from aggd.core.model import TableEntry
from aggd.core.strategy import StrategyTable, from_entry, parse
from aggd.testing.frames import AGG_IP, AGG_MAC, worker_addr
from aggd_client import protocol as proto

from tests.bpf.conftest import ELEMENTS
from tests.fixtures.scenarios import SCENARIOS, Depart, Scenario, Swap, T0_NS, check, entry
from tests.fixtures.traffic import Sent, Traffic, layout_of, swap_table

KINDS = ("sync", "quorum", "ssp", "async", "wbsp")
MIN_OPS, MAX_OPS = 20, 80   #: packets per sequence
STRANGER_MAC = "02:00:00:00:09:09"


def member(rank: int) -> tuple[str, int]:
    return worker_addr(rank)[1:]


def mac_bytes(text: str) -> bytes:
    return bytes.fromhex(text.replace(":", ""))


MACS = {member(r): worker_addr(r)[0] for r in range(proto.MAX_MEMBERS)}
_AGG_MAC = mac_bytes(AGG_MAC)
_AGG_IP = socket.inet_aton(AGG_IP)


def ip_checksum(header: bytes) -> int:
    s = sum(struct.unpack("!10H", header))
    s = (s & 0xFFFF) + (s >> 16)
    s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def frame(data: bytes, src: tuple[str, int]) -> bytes:
    """Ethernet/IPv4/UDP around an aggd message, from ``src`` to the aggregator's port."""
    udp_len = 8 + len(data)
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + udp_len, 0, 0, 64, 17, 0, socket.inet_aton(src[0]), _AGG_IP)
    ip = ip[:10] + struct.pack("!H", ip_checksum(ip)) + ip[12:]
    eth = _AGG_MAC + mac_bytes(MACS.get(src, STRANGER_MAC)) + b"\x08\x00"
    return eth + ip + struct.pack("!HHHH", src[1], proto.DEFAULT_PORT, udp_len, 0) + data


def describe(msg: bytes | None) -> str:
    if not msg or len(msg) < proto.HEADER_SIZE:
        return repr(msg)
    hdr, payload = proto.decode(msg)
    return f"{hdr} payload[:4]={payload[:4].tolist()}"


def play_scenario(h, name: str) -> None:
    """One fixture table of tests/fixtures/scenarios.py through ``h``, with its expectations."""
    sc: Scenario = SCENARIOS[name]
    h.start(sc.world, sc.slots, sc.max_chunks, list(sc.table))
    for i, step in enumerate(sc.steps):
        if isinstance(step, Swap):
            h.set_strategy(list(step.entries))
            continue
        if isinstance(step, Depart):
            h.set_awaited(step.awaited)
            continue
        t_us, p, exp = step
        v = h.send(p.build(ELEMENTS), member(p.rank), T0_NS + t_us * 1000, f"step {i}: {p}")
        check(v, exp, ELEMENTS, where=f"step {i}: {p}")
    h.check_counters(name)


# ---------------------------------------------------------------------------------------------
# Randomised sequences.

def table_for(kind: str, shape: int) -> list[TableEntry]:
    if kind == "quorum":
        k, timeout = 1 + (shape >> 9) % 4, ("10ms", "1ms")[(shape >> 11) % 2]
        return [entry(f"quorum:{k}:{timeout}")]
    if kind == "ssp":
        return [entry(f"ssp:{(shape >> 9) % 3}")]
    return [entry(kind)]


def run_sequence(h, runs: collections.Counter, label: str, entries: list[TableEntry], shape: int,
                 ops: list[int], swaps: list[tuple[int, str, int]] = (), elements: int = ELEMENTS,
                 departures: list[tuple[int, int]] = (), precision: int = 0, bound=None,
                 norm_bound=None) -> None:
    """One sequence from a fresh job: ``shape`` picks world, slots, chunks and window; ``swaps``
    are (op index, strategy, rounds ahead) installed as new versions at round boundaries;
    ``departures`` (op index, rank) declare the rank gone, or back if it was (never the last one
    awaited); payloads have ``elements`` values (the data planes' packet size) of ``precision``
    (docs/protocol.md, "Precision"), ``bound`` and ``norm_bound`` the job's per-member bounds (each a
    ``model.Bound``: on the largest value, on the L2 norm). Counts the
    sequence in ``runs[label]``."""
    world, slots = (4, 4, 4, 3, 2, 1, 4, 4)[shape % 8], 1 + (shape >> 3) % 2
    chunks, window = (1, 2, 3, 4)[(shape >> 4) % 4], 1 + (shape >> 6) % 3
    traffic = Traffic(world=world, slots=slots, chunks=layout_of(shape, chunks), max_chunks=8, window=window, elements=elements,
                      addr_of=member, junk=True, precision=precision)
    h.start(world, slots, 8, entries, **({"precision": precision} if precision else {}),
            **({"bound": bound} if bound is not None else {}),
            **({"norm_bound": norm_bound} if norm_bound is not None else {}))
    table = StrategyTable(parse("sync"))
    table.entries = [(e.version, e.from_round, from_entry(e)) for e in entries]
    pending, leaving = sorted(swaps), sorted(departures)
    awaited = (1 << world) - 1
    for i, op in enumerate(ops):
        while pending and pending[0][0] <= i:
            _, text, ahead = pending.pop(0)
            h.set_strategy(swap_table(table, table.entries[-1][0] + 1, h.model, traffic, text, ahead))
        while leaving and leaving[0][0] <= i:
            toggled = awaited ^ (1 << leaving.pop(0)[1] % world)
            if toggled:
                awaited = toggled
                h.set_awaited(awaited)
        sent: Sent = traffic.next(op)
        where = f"{label} op {i} of shape={shape} ops={ops} swaps={swaps} table={entries}"
        traffic.observe(sent, h.send(sent.data, sent.src, sent.now_ns, where))
    h.check_counters(f"{label}: counters after shape={shape} ops={ops} swaps={swaps} table={entries}")
    runs[label] += 1


#: (shape, ops) of one sequence.
sequences = st.tuples(st.integers(0, 2**16 - 1), st.lists(st.integers(0, 2**32 - 1), min_size=MIN_OPS,
                                                         max_size=MAX_OPS))
SWAP_TEXTS = ("sync", "quorum:3:10ms", "quorum:2:1ms", "ssp:1", "ssp:2", "async", "wbsp")
#: (op index, strategy, rounds ahead) of the swaps in one sequence.
swaps = st.lists(st.tuples(st.integers(0, MAX_OPS - 1), st.sampled_from(SWAP_TEXTS), st.integers(0, 2)),
                 min_size=1, max_size=4)
#: (op index, rank) of the departures (and returns) in one sequence.
departures = st.lists(st.tuples(st.integers(0, MAX_OPS - 1), st.integers(0, 3)), min_size=1, max_size=4)

#: Sequences are long and their examples large; each test sets max_examples (and phases). The P4
#: tests take function-scoped fixtures, reset by ``start`` at each sequence.
SEQUENCE_SETTINGS = settings(deadline=None, database=None,
                             suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                    HealthCheck.function_scoped_fixture])
#: Shrinking a failing batch of sequences can take minutes per test; the failure message already
#: has the whole sequence (replay it with ``run_sequence``).
NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)
