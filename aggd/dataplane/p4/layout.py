"""What the P4 backend uses of the aggd P4 programs: table, action, register and counter names, the
widths it writes, and the index arithmetic of registers and counters.

The P4 sources (``aggd/dataplane/p4/programs/``) declare these objects; the P4Info (``aggd/dataplane/p4/programs/v1model/aggd.p4info.txtpb``)
describes them to the control plane; ``tests/p4/test_p4info.py`` checks that all three agree. Ids are
never written here: the backend looks every name up in the P4Info it is given.
"""
from __future__ import annotations

from dataclasses import dataclass

from aggd_client import protocol as proto

#: Control instance that holds the aggd pipeline inside the ingress (names below are under it).
PIPE = "AggdIngress.aggd"
INGRESS = "AggdIngress"

BANKS = 4
NO_JOB = proto.MAX_JOBS
JOB_ROWS = proto.MAX_JOBS + 1
COUNTER_STRIDE = 16      #: job_counters row length (>= len(Counter))
DROP_STRIDE = 32         #: drops row length (>= len(DropReason))
FLOOD_GROUP = 0x0200     #: multicast group flooding non-aggd traffic
MAX_PORT = (1 << 9) - 1  #: v1model ports are bit<9>
BANK_EMPTY, BANK_OPEN, BANK_RELEASED = 0, 1, 2   #: bank_state values (common/layout.p4)


def job_group(job: int) -> int:
    """Multicast group of a job's results (0 means none in v1model, so job + 1)."""
    return job + 1


@dataclass(frozen=True)
class Match:
    name: str
    bitwidth: int
    kind: str            #: "exact", "range", "lpm", "ternary"


@dataclass(frozen=True)
class Param:
    name: str
    bitwidth: int


@dataclass(frozen=True)
class TableUse:
    name: str
    match: tuple[Match, ...]
    actions: dict[str, tuple[Param, ...]]     #: action name -> its parameters


#: Tables the backend writes, with the match fields and actions it uses.
TABLES: dict[str, TableUse] = {t.name: t for t in (
    TableUse(f"{PIPE}.aggd_service",
             (Match("hdr.ipv4.dst_addr", 32, "exact"), Match("hdr.udp.dst_port", 16, "exact")),
             {f"{PIPE}.aggd_serve": ()}),
    TableUse(f"{PIPE}.jobs", (Match("hdr.aggd.job", 16, "exact"),),
             {f"{PIPE}.set_job": (Param("world", 8), Param("all_members", 64), Param("n_slots", 32),
                                  Param("slot_base", 32), Param("switch_slots", 32), Param("max_chunks", 32),
                                  Param("group_ip", 32), Param("group_mac", 48), Param("result_port", 16),
                                  Param("mcast_grp", 16))}),
    TableUse(f"{PIPE}.members", (Match("hdr.aggd.job", 16, "exact"), Match("hdr.aggd.rank", 16, "exact")),
             {f"{PIPE}.set_member": (Param("ip", 32), Param("port", 16), Param("tag", 64))}),
    TableUse(f"{PIPE}.strategy", (Match("hdr.aggd.job", 16, "exact"), Match("meta.s_round", 32, "range")),
             {f"{PIPE}.set_strategy": (Param("version", 16), Param("kind", 8), Param("param", 8),
                                       Param("timeout_us", 32))}),
    TableUse(f"{INGRESS}.forward", (Match("hdr.ethernet.dst_addr", 48, "exact"),),
             {f"{INGRESS}.l2_forward": (Param("port", 9),), f"{INGRESS}.l2_flood": (),
              f"{INGRESS}.drop": ()}),
)}

SERVICE = f"{PIPE}.aggd_service"
JOBS = f"{PIPE}.jobs"
MEMBERS = f"{PIPE}.members"
STRATEGY = f"{PIPE}.strategy"
FORWARD = f"{INGRESS}.forward"

#: Registers the backend reads or writes: name -> value width in bits.
REG_JOB_COUNTERS = f"{PIPE}.job_counters"
REG_MAX_ROUND = f"{PIPE}.max_round"
REG_CLOCK = f"{PIPE}.clock"
REG_SLOT_LOCK = f"{PIPE}.slot_lock"
REG_SLOT_PENDING = f"{PIPE}.slot_pending"   #: a key rule 3 refused, plus one (0: none)
REG_SLOT_SHARED = f"{PIPE}.slot_shared"     #: Slot.shared: 1, else 0
REG_BANK_STATE = f"{PIPE}.bank_state"
REG_BANK_ROUND = f"{PIPE}.bank_round"
REG_BANK_BITMAP = f"{PIPE}.bank_bitmap"
REG_LANE0 = f"{PIPE}.lane_0"
REG_LATE_ROUND = f"{PIPE}.late_round"     #: index slot * 64 + rank; 0: no late memory
#: lane_0 stands for every v1model lane: exact 64-bit sums (TNA_REGISTERS: 32-bit lanes, which wrap)
REGISTERS: dict[str, int] = {
    REG_JOB_COUNTERS: 64, REG_MAX_ROUND: 32, REG_CLOCK: 48, REG_SLOT_LOCK: 1, REG_BANK_STATE: 8,
    REG_BANK_ROUND: 32, REG_BANK_BITMAP: 64, REG_LANE0: 64, REG_LATE_ROUND: 64, REG_SLOT_PENDING: 64,
    REG_SLOT_SHARED: 8,
}
#: Every per-bank register of a slot (the P4 program declares them; the backend clears bank_state,
#: slot_lock, slot_pending and slot_shared when a job's slots are handed out, which makes the others unread until
#: rewritten).
BANK_REGISTERS: dict[str, int] = {
    "bank_state": 8, "bank_round": 32, "bank_chunk": 32, "bank_bitmap": 64, "bank_late": 64,
    "bank_n": 16, "bank_exp": 16, "bank_flags": 8, "bank_version": 16, "bank_kind": 8, "bank_param": 8,
    "bank_timeout": 32, "bank_t_first": 48, "bank_unannounced": 8, "bank_holding": 8, "bank_held": 64,
    "bank_count": 16, "bank_carried": 16,
}
#: Per member of a slot (index slot * 64 + rank), its late memory (docs/protocol.md, rule 4): the round
#: + 1 (0: none) and, by the chunk's index in the slot, its step-0 contributions to that round refused
#: busy and carried with nothing to answer. The backend clears late_round, which makes the others unread.
SLOT_MEMBER_REGISTERS: dict[str, int] = {"late_round": 64, "late_refused": 64, "late_carried": 64}

#: Counters: name -> unit ("PACKETS").
CTR_DROPS = f"{PIPE}.drops"
COUNTERS: dict[str, str] = {CTR_DROPS: "PACKETS"}


def counter_index(bucket: int, counter: int) -> int:
    return bucket * COUNTER_STRIDE + counter


def drop_index(bucket: int, reason: int) -> int:
    return bucket * DROP_STRIDE + reason


def bank_index(slot: int, bank: int) -> int:
    return slot * BANKS + bank


def lane_register(i: int) -> str:
    return f"{PIPE}.lane_{i}"


# ---------------------------------------------------------------------------------------------
# The Tofino program (aggd/dataplane/p4/programs/tna/aggd.p4): same tables, its own registers and counters.

#: Per-job event counters (packets): only the counters that grow by one a packet.
TNA_CTR_EVENTS = f"{PIPE}.job_events"
TNA_COUNTED = ("RX_PACKETS", "CONTRIBUTIONS", "RELEASED", "REREADS", "TO_USERSPACE")
TNA_BANKS = 2
TNA_REG_BANK_ROUND = f"{PIPE}.bank_round"      #: round + 1 of a bank; 0 = empty
TNA_REG_BANK_RELEASED = f"{PIPE}.bank_released"
TNA_COUNTERS: dict[str, str] = {CTR_DROPS: "PACKETS", TNA_CTR_EVENTS: "PACKETS"}
TNA_REGISTERS: dict[str, int] = {TNA_REG_BANK_ROUND: 32, TNA_REG_BANK_RELEASED: 8, REG_LANE0: 32}
#: The sender's bit, split in two 32-bit halves (the TNA program has no 64-bit shift): a const-like
#: table the backend fills once, rank -> (bit in ranks 0..31, bit in ranks 32..63).
TNA_RANK_BITS = f"{PIPE}.rank_bits"
TABLES_TNA: dict[str, TableUse] = {TNA_RANK_BITS: TableUse(
    TNA_RANK_BITS, (Match("hdr.aggd.rank", 16, "exact"),), {f"{PIPE}.rank_bit": (Param("lo", 32), Param("hi", 32))})}
