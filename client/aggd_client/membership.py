"""Joining a job the aggd daemon manages: ``join(server, job, rank, token)`` -> a ready AggClient.

The exchange (docs/protocol.md, "Joining"): the worker sends a JOIN message from its member address
(the socket its contributions will leave from); the daemon checks the token and the rank, registers
the source address as that rank's member address (so the data plane accepts its packets and drops
anyone else's claiming the rank) and answers with a JOIN_ACK carrying the job's parameters, or with
a refusal ``code``. Both payloads are UTF-8 JSON objects after the usual 40-byte header: joining
happens once per worker, and JSON lets the answer grow without a protocol version bump.

The encoders and decoders here are the only definition of the two payloads; the daemon imports them.
"""
from __future__ import annotations

import json
import select
import socket
import time
from dataclasses import dataclass, field

from . import quant
from .client import AggClient
from .errors import BadTokenError, NoAnswerError, NotMemberError, ProtocolError, UnknownJobError
from .protocol import HEADER_SIZE, Header
from .protocol.definition import MsgType, NackCode

#: ``job`` header field of a JOIN that names its job in the payload instead.
JOB_BY_NAME = 0xFFFF
MAX_JOIN_BYTES = 1400  # one unfragmented datagram


@dataclass(frozen=True)
class JobInfo:
    """A job's parameters as the daemon's JOIN_ACK gives them."""
    job: int
    name: str
    world: int
    group: tuple[str, int] | None  #: results' multicast group; None: unicast to each member
    port: int               #: UDP port contributions go to (the aggd port, or the user-space port)
    elements: int
    slots: int
    max_chunks: int
    strategy: str
    strategy_version: int
    gso: bool = True        #: false when the aggregator runs XDP in generic mode
    #: The round the member's next allreduce gets: 0 for a new job; a member that rejoins a running
    #: job starts where the job is.
    round: int = 0
    #: The member's tag: every contribution carries it (docs/protocol.md, "Member tags"); a packet
    #: with the member's address and another tag is dropped. Secret: not shown in ``repr``.
    tag: int = field(default=0, repr=False)
    #: Contributions per member every round of the job is quantised for, whatever the strategy
    #: (docs/protocol.md, "Quantisation and the error bound").
    headroom: int = quant.MAX_HEADROOM
    #: Workers whose contributions one result holds: ``world``, or for a rack job under an upper
    #: aggregator every worker under it (docs/protocol.md, "Two levels"); 0: not said (``world``).
    span: int = 0
    #: Bits of a contribution value (32, 16 or 8: the job's ``Precision``; results are twice as wide
    #: for 16 and 8); absent from the JOIN_ACK: 32.
    precision: int = 32
    #: How the job combines a round's contributions: "sum", or a robust job's "median" or
    #: "trimmed:t" (docs/protocol.md, "Robust jobs"): its results are the statistic times
    #: ``n_contrib``, so the client treats them as sums either way. Absent: "sum".
    combine: str = "sum"
    #: Contributions of a narrow job carry room for their result: a payload as long as the result's,
    #: its values first (the aggregator's frames cannot grow: native XDP on veth). Absent: false.
    room: bool = False

    @classmethod
    def from_json(cls, d: dict) -> "JobInfo":
        try:
            return cls(job=int(d["job"]), name=str(d["name"]), world=int(d["world"]),
                       group=None if d["group"] is None else (str(d["group"][0]), int(d["group"][1])),
                       port=int(d["port"]),
                       elements=int(d["elements"]), slots=int(d["slots"]), max_chunks=int(d["max_chunks"]),
                       strategy=str(d["strategy"]), strategy_version=int(d["strategy_version"]),
                       gso=bool(d.get("gso", True)), round=int(d.get("round", 0)),
                       tag=_tag(d.get("tag", "0")), headroom=int(d.get("headroom", quant.MAX_HEADROOM)),
                       span=int(d.get("span", 0)),
                       precision=quant.LANES[quant.precision_of(int(d.get("precision", 32)))].bits,
                       combine=str(d.get("combine", "sum")), room=_flag(d.get("room", False), "room"))
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise ProtocolError(f"malformed JOIN_ACK payload ({exc!r}): {d!r}") from None


def _flag(value, key: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, not {value!r}")
    return value


def _tag(text) -> int:
    """The JOIN_ACK's ``tag``: 16 hex digits (a u64)."""
    if not isinstance(text, str) or not 1 <= len(text) <= 16:
        raise ValueError(f"tag must be up to 16 hex digits, not {text!r}")
    return int(text, 16)


# -- messages ------------------------------------------------------------------------------------

def encode_join(job: int | str, rank: int, token: str) -> bytes:
    """A JOIN for job id ``job`` (an int) or job name ``job`` (a str)."""
    body: dict = {"token": token}
    if isinstance(job, str):
        body["job"] = job
        job_field = JOB_BY_NAME
    else:
        job_field = int(job)
    return Header(type=MsgType.JOIN, job=job_field, rank=int(rank)).pack() + json.dumps(body).encode()


#: A JOIN's payload is small (a token, a job name): anything longer is refused unread.
MAX_JOIN_PAYLOAD = 512
MAX_TOKEN = 128
MAX_JOB_NAME = 64


def _text(body: dict, key: str, limit: int, what: str) -> str:
    v = body.get(key)
    if not isinstance(v, str) or not v or len(v) > limit:
        raise ValueError(f"{what} must be a string of 1..{limit} characters")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} is not valid Unicode") from None
    return v


def decode_join(data: bytes) -> tuple[Header, int | str, str]:
    """(header, job id or name, token) of a JOIN; ValueError with a one-line reason if malformed
    (bounded: the payload is read only up to MAX_JOIN_PAYLOAD bytes, so no nesting is deep)."""
    hdr = Header.unpack(data)
    raw = bytes(data[HEADER_SIZE:])
    if len(raw) > MAX_JOIN_PAYLOAD:
        raise ValueError(f"a JOIN payload has at most {MAX_JOIN_PAYLOAD} bytes, not {len(raw)}")
    try:
        body = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ValueError("a JOIN payload is a UTF-8 JSON object") from None
    if not isinstance(body, dict):
        raise ValueError("a JOIN payload is a JSON object")
    token = _text(body, "token", MAX_TOKEN, "the token")
    job: int | str = hdr.job
    if hdr.job == JOB_BY_NAME:
        job = _text(body, "job", MAX_JOB_NAME, "the job's name (a JOIN by name)")
    return hdr, job, token


def encode_join_ack(job: int, rank: int, code: int, body: dict) -> bytes:
    """A JOIN_ACK: ``code`` 0 and the job's parameters, or a NackCode and ``{"error": message}``."""
    return Header(type=MsgType.JOIN_ACK, job=job, rank=rank, code=int(code)).pack() + json.dumps(body).encode()


def decode_join_ack(data: bytes) -> tuple[Header, dict]:
    hdr = Header.unpack(data)
    try:
        body = json.loads(bytes(data[HEADER_SIZE:]).decode() or "{}")
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"malformed JOIN_ACK payload: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"malformed JOIN_ACK payload: {body!r}")
    return hdr, body


# -- the worker side -----------------------------------------------------------------------------

def request_join(server: tuple[str, int], job: int | str, rank: int, token: str, *,
                 bind: tuple[str, int] = ("0.0.0.0", 0), timeout: float = 5.0,
                 retry_every: float = 0.25) -> tuple[JobInfo, tuple[str, int]]:
    """Send a JOIN from ``bind`` until the daemon answers; return (job info, the bound address).

    Raises BadTokenError, NotMemberError or UnknownJobError when refused (with the daemon's reason),
    NoAnswerError after ``timeout`` seconds without an answer."""
    server = (socket.gethostbyname(server[0]), int(server[1]))
    msg = encode_join(job, rank, token)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.bind((bind[0], int(bind[1])))
        deadline = time.monotonic() + timeout
        next_send = 0.0
        while True:
            now = time.monotonic()
            if now >= deadline:
                raise NoAnswerError(server, job, timeout, f"rank {rank} sent JOIN and got no JOIN_ACK")
            if now >= next_send:
                try:
                    sock.sendto(msg, server)
                except OSError:
                    pass  # e.g. ECONNREFUSED from an earlier ICMP: the daemon may be starting
                next_send = now + retry_every
            ready, _, _ = select.select([sock], [], [], max(0.0, min(next_send, deadline) - now))
            if not ready:
                continue
            try:
                data, src = sock.recvfrom(65535)
            except OSError:
                continue
            if src[0] != server[0] or len(data) < HEADER_SIZE:
                continue
            hdr, body = decode_join_ack(data)
            if hdr.type != MsgType.JOIN_ACK or hdr.rank != rank:
                continue
            local = sock.getsockname()
            if local[0] == "0.0.0.0":
                probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                probe.connect(server)
                local = (probe.getsockname()[0], local[1])
                probe.close()
            if hdr.code != NackCode.NONE:
                _raise_refusal(server, job, rank, local, hdr.code, body.get("error", ""))
            return JobInfo.from_json(body), (local[0], local[1])
    finally:
        sock.close()


def _raise_refusal(server, job, rank, address, code: int, reason: str):
    errors = {NackCode.BAD_TOKEN: BadTokenError, NackCode.NOT_MEMBER: NotMemberError,
              NackCode.UNKNOWN_JOB: UnknownJobError}
    cls = errors.get(code)
    if cls is None:
        raise ProtocolError(f"aggregator {server[0]}:{server[1]} refused the join of rank {rank} to job "
                            f"{job} with code {code}: {reason}")
    raise cls(server, job, rank, address, reason)


def join(server: tuple[str, int], job: int | str, rank: int, token: str, *,
         bind: tuple[str, int] | None = ("0.0.0.0", 0), timeout: float = 5.0, **client_options) -> AggClient:
    """Join job ``job`` (its name or id) of the daemon at ``server`` as ``rank`` with the job's
    ``token``, and return an :class:`AggClient` set up with the job's parameters (its ``job_info``
    attribute holds them). The worker's member address is ``bind`` (port 0: one is picked and kept;
    None: any address, any port).

    ``client_options`` go to AggClient (``window``, ``retransmit_timeout``, ``give_up_after``, ``gso``);
    ``gso`` is turned off when the daemon says its data plane cannot take GSO batches.
    """
    info, address = request_join(server, job, rank, token, bind=("0.0.0.0", 0) if bind is None else bind,
                                 timeout=timeout)
    return client_for(server, info, address, rank, **client_options)


def client_for(server: tuple[str, int], info: JobInfo, address: tuple[str, int], rank: int,
               **client_options) -> AggClient:
    """The :class:`AggClient` of ``rank`` once ``request_join`` answered ``info`` for the JOIN sent
    from ``address`` (``join`` is both steps; a caller that must agree on something with the other
    ranks first, such as the first round after a restart, calls them apart). ``client_options``
    go to AggClient (``first_round`` overrides ``info.round``)."""
    client_options["gso"] = bool(client_options.get("gso", True)) and info.gso
    # The JOIN left from `address`, which is now the registered member address; the client's
    # socket takes it over (the join socket is closed, so the port is free again).
    client = AggClient((server[0], info.port), info.job, rank, info.world, group=info.group,
                       bind=address, elements=info.elements, slots=info.slots,
                       **{"first_round": info.round, "tag": info.tag, "headroom": info.headroom,
                          "span": info.span or None, "precision": info.precision, "room": info.room,
                          **client_options})
    client.job_info = info
    return client
