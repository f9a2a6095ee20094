"""The aggd wire protocol, written once.

Everything else is derived from this module: the Python codec (``codec.py``), the numpy dtype the
client uses to build whole windows of packets at once, the C header of the XDP program
(``xdp/aggd_proto.h``) and the P4 header (``aggd/dataplane/p4/programs/aggd_proto.p4``). ``tests/unit/test_protocol_codegen.py``
fails when a generated file drifts from this definition. ``docs/protocol.md`` explains the fields.

Header fields are big-endian (network order) so a switch parser reads them natively. The payload is
an array of little-endian int32: both ends of every deployment we target (x86/ARM workers, the
XDP aggregator) are little-endian, so the aggregator's per-element loop needs no byte swaps.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

MAGIC = 0xA66D
#: 2: contributions and re-reads carry the sender's member tag (``contributors``; see ``HEADER``)
VERSION = 2

#: UDP port the aggregator listens on; results go to the job's ``result_port``.
DEFAULT_PORT = 47000
DEFAULT_RESULT_PORT = 47001
#: int32 values in one packet unless configured otherwise.
DEFAULT_ELEMENTS = 256
#: Largest payload a frame in one page holds: native XDP on veth takes a program without
#: multi-buffer support up to an MTU of 3506 (a page less XDP headroom and skb_shared_info), room
#: for 859 int32 after the headers; 832 = 13 * 64 keeps P4's 64-lane passes whole (see
#: docs/protocol.md). Above it the XDP program is built for multi-buffer frames (XDP "frags").
PAGE_MAX_ELEMENTS = 832
#: That MTU: 4096 - 256 XDP headroom - 320 skb_shared_info - 14 Ethernet, what the kernel accepts for
#: a native program without multi-buffer support on veth.
PAGE_MAX_MTU = 3506
#: Largest MTU native XDP serves (a multi-buffer program): the Ethernet jumbo frame real NICs offer.
NATIVE_MAX_MTU = 9000
#: Largest payload native XDP takes: what a NATIVE_MAX_MTU frame holds after the IP and UDP headers
#: (28 bytes) and aggd's (40, checked against HEADER below). Larger packets amortise the per-packet
#: cost (docs/benchmarks.md, "The XDP loop").
NATIVE_MAX_ELEMENTS = (NATIVE_MAX_MTU - 28 - 40) // 4
#: Largest payload of all ("jumbo" packets, 32 KiB: a 32,808-byte UDP payload in one IP datagram):
#: XDP in generic (skb) mode sees such a packet as one linear buffer, and the XDP program's payload
#: loops (ELEMS iterations each) pass the verifier up to here (16,000 does not: its 1M-instruction
#: limit). The user-space path takes it too.
MAX_ELEMENTS = 8192
#: Members of a job are tracked by a 64-bit bitmap in every slot and every result.
MAX_MEMBERS = 64
MAX_JOBS = 256
#: Versions of a job's strategy table kept at once (a ring; see the strategies issue).
STRATEGY_VERSIONS = 4
#: ``skip`` saturates here: "the chunk's previous round is at least this many rounds back".
SKIP_MAX = 0xFFFF
#: The most rounds a member has outstanding (sent, its result not all in) under any strategy
#: (``ssp:2``'s three, ``async``'s three), and always a window of consecutive rounds: a member sends
#: round ``R + RESULT_WINDOW`` only once it holds every result of round R. So an aggregator keeps a
#: released ``ssp``/``async`` round for re-reads until every awaited member sent it such a round
#: (docs/protocol.md, rule 3).
RESULT_WINDOW = 3
#: Exponent sent with an all-zero chunk: larger than any real one, so it never lowers the sum's scale.
ZERO_EXPONENT = 0x3FFF


class MsgType(enum.IntEnum):
    CONTRIB = 1  #: worker -> aggregator: one chunk of one round
    RESULT = 2   #: aggregator -> job's group: the released sum
    REREAD = 3   #: worker -> aggregator: send me the released result again (I contributed)
    NACK = 4     #: aggregator -> worker: refused; ``code`` says why
    JOIN = 5     #: worker -> daemon: rank + job token in the payload; always handled in user space
    JOIN_ACK = 6 #: daemon -> worker: accepted (job parameters in the payload) or refused (``code``)
    SHARDS = 7   #: member -> daemon: a sharded job's agreed shard map (JSON payload), never answered


class Flag(enum.IntFlag):
    RETRANSMIT = 0x01  #: this contribution was sent before (loss recovery)
    OVERFLOW = 0x02    #: a sum does not fit int32 (its low 32 bits are sent): not to be trusted
    USERSPACE = 0x04   #: served by the daemon's user-space path, not the kernel
    CARRIED = 0x08     #: the result holds contributions carried from an earlier round
    REREAD = 0x10      #: a result re-sent for a worker that lost it
    #: the sender sends its next key of a slot only once its previous key there is answered, so
    #: its later round proves it holds the slot's earlier results (rule 3's ``held``)
    ORDERED = 0x20


class NackCode(enum.IntEnum):
    NONE = 0
    UNKNOWN_JOB = 1
    NOT_MEMBER = 2
    BAD_CHUNK = 3
    STALE = 4
    BAD_TOKEN = 5
    BAD_REQUEST = 6      #: a malformed JOIN: answered, with the reason, rather than ignored


class Precision(enum.IntEnum):
    """A job's contribution width, carried in the ``code`` byte of contributions, re-reads and results.

    b-bit contributions are summed exactly into 2b-bit results (a sum of n b-bit values fits
    b + ceil(log2 n) bits, so 8-bit contributions of up to 258 terms fit 16 bits): the aggregator adds
    narrow values into wide lanes and never rescales. INT32 is the original format (32-bit results).
    """
    INT32 = 0   #: int32 contributions, int32 results
    INT16 = 1   #: int16 contributions, int32 results
    INT8 = 2    #: int8 contributions, int16 results


@dataclass(frozen=True)
class Lanes:
    """The payload types of one precision (little-endian numpy type strings)."""
    bits: int           #: bits of a contribution value
    contrib: str        #: numpy dtype of a contribution (and re-read) payload value
    result: str         #: numpy dtype of a result payload value

    @property
    def contrib_bytes(self) -> int:
        return int(self.contrib[-1])

    @property
    def result_bytes(self) -> int:
        return int(self.result[-1])

    @property
    def per_lane(self) -> int:
        """Values a packet carries for each of the aggregator's ``E`` int32 lanes: as many as fill
        the lane's four bytes in the result, so every result payload is ``4 * E`` bytes (an 8-bit
        job's packet holds ``2 * E`` values; docs/protocol.md, "Precision")."""
        return 4 // self.result_bytes

    @property
    def contrib_max(self) -> int:
        """Largest magnitude a contribution value may have (symmetric range)."""
        return (1 << (self.bits - 1)) - 1

    @property
    def result_max(self) -> int:
        return (1 << (8 * self.result_bytes - 1)) - 1


LANES: dict[Precision, Lanes] = {
    Precision.INT32: Lanes(32, "<i4", "<i4"),
    Precision.INT16: Lanes(16, "<i2", "<i4"),
    Precision.INT8: Lanes(8, "<i1", "<i2"),
}


def values_per_packet(elements: int, precision: int) -> int:
    """Values a packet of a job of ``precision`` carries on an aggregator of ``elements`` lanes."""
    return elements * LANES[Precision(precision)].per_lane


#: An 8-bit sum is exact in the XDP program's 16-bit field only up to this many contributions (each
#: added as value + 128, 0..255: 256 * 255 < 2**16): a result holding more is flagged OVERFLOW
#: (docs/protocol.md, "Precision").
INT8_MAX_CONTRIBUTIONS = 256
#: ``bits`` (what users and configs say: 32, 16, 8) to the wire's Precision
PRECISION_OF_BITS: dict[int, Precision] = {lanes.bits: p for p, lanes in LANES.items()}


class StrategyKind(enum.IntEnum):
    SYNC = 0
    QUORUM = 1
    SSP = 2
    ASYNC = 3
    WBSP = 4


class DropReason(enum.IntEnum):
    """Why the data plane dropped a packet; one counter each (shared by XDP, P4 and the model)."""
    TOO_SHORT = 0
    BAD_MAGIC = 1
    BAD_VERSION = 2
    BAD_TYPE = 3
    BAD_COUNT = 4        #: element count beyond the packet or beyond the configured maximum
    UNKNOWN_JOB = 5
    BAD_RANK = 6         #: rank out of the job's range
    NOT_MEMBER = 7       #: sender is not the registered address of that rank
    BAD_CHUNK = 8        #: chunk outside the job's slots
    DUPLICATE = 9        #: a retransmission of a contribution already counted
    STALE = 10           #: a contribution for a round the slot has moved past
    BUSY = 11            #: the slot still holds an unreleased earlier round
    NOT_READY = 12       #: a re-read of a result not released yet
    BAD_TAG = 13         #: the member tag is not the one its JOIN was given (forged or stale): never NACKed
    BAD_PRECISION = 14   #: the ``code`` byte is not the job's Precision (a worker of another build or job)
    OUT_OF_BOUNDS = 15   #: a contribution with a value beyond its job's per-member bound (counted per member)
    BAD_STEP = 16        #: a wbsp step (step > 0) to a robust job, which takes one contribution per member


class Counter(enum.IntEnum):
    """Per-job data-plane counters (index into the counter array; drops are separate)."""
    RX_PACKETS = 0
    RX_BYTES = 1
    ELEMENTS = 2         #: int32 elements added into slots
    CONTRIBUTIONS = 3
    RELEASED = 4         #: results released (one per slot round)
    REREADS = 5          #: results re-sent on request
    OVERFLOWS = 6
    TO_USERSPACE = 7     #: packets passed up to the daemon (kernel cannot hold them)
    RETRANSMITS = 8
    CARRIED = 9          #: late contributions carried into a later round
    TIMEOUTS = 10        #: quorum rounds released by their deadline
    PARTIALS = 11        #: async running sums answered before the round was complete
    FORWARDED = 12       #: a rack's partial sums sent up to its upper aggregator (re-sends included)
    RELAYED = 13         #: the upper aggregator's results passed on to the rack's members
    UNCARRIED = 14       #: late quorum contributions answered but not added (no bank free to carry them)


@dataclass(frozen=True)
class Field:
    name: str
    ctype: str  # u8 u16 u32 u64 i16
    doc: str


#: The aggd header, in wire order. Sizes and alignment are checked in the codec.
HEADER: tuple[Field, ...] = (
    Field("magic", "u16", f"0x{MAGIC:04X}; anything else is dropped"),
    Field("version", "u8", f"protocol version, {VERSION}"),
    Field("type", "u8", "MsgType"),
    Field("job", "u16", "job id, 0..MAX_JOBS-1"),
    Field("rank", "u16", "sender's rank (contributions, re-reads); 0xFFFF in results"),
    Field("round", "u32", "the job's allreduce number"),
    Field("chunk", "u32", "packet-sized piece of the round's tensor; selects slot chunk % slots"),
    Field("count", "u16", "values that carry data (the payload may be padded beyond)"),
    Field("strategy_version", "u16", "strategy-table version that governs this round (results)"),
    Field("exponent", "i16", "values are int32 * 2**-exponent; the sum uses the smallest"),
    Field("flags", "u8", "Flag bits"),
    Field("code", "u8", "NACKs: NackCode; contributions, re-reads and results: the payload's "
                        "Precision (0 int32 in and out, 1 int16 in / int32 out, 2 int8 in / int16 out)"),
    Field("contributors", "u64", "results: bitmap of ranks summed (bit i = rank i); contributions and "
                                 "re-reads: the sender's member tag (JOIN_ACK ``tag``), 0 if it has none"),
    Field("n_contrib", "u16", "results: contributions summed (may exceed popcount under wbsp); "
                              "contributions: how many one holds (a rack aggregator's partial sum), "
                              "0 from a worker (counts as 1)"),
    Field("step", "u16", "local step within the round (wbsp); 0 otherwise"),
    Field("strategy", "u8", "StrategyKind that governed the round (results), so clients adapt"),
    Field("param", "u8", "that strategy's parameter: quorum k or ssp staleness"),
    Field("skip", "u16", "contributions and re-reads: rounds since the chunk's previous round that "
                         "did not include it (0 when it took part in the round before, or never "
                         "took part); SKIP_MAX: that many or more. 0 in results and NACKs"),
)

SIZES = {"u8": 1, "u16": 2, "u32": 4, "u64": 8, "i16": 2}
assert sum(SIZES[f.ctype] for f in HEADER) == 40, "NATIVE_MAX_ELEMENTS assumes a 40-byte header"
