"""Codec derived from ``definition.HEADER``: struct format, numpy dtype, encode/decode."""
from __future__ import annotations

import struct
from dataclasses import field, make_dataclass

import numpy as np

from . import definition as d

_STRUCT_CODES = {"u8": "B", "u16": "H", "u32": "I", "u64": "Q", "i16": "h"}
_NP_CODES = {"u8": "u1", "u16": ">u2", "u32": ">u4", "u64": ">u8", "i16": ">i2"}

HEADER_STRUCT = struct.Struct(">" + "".join(_STRUCT_CODES[f.ctype] for f in d.HEADER))
HEADER_SIZE = HEADER_STRUCT.size
HEADER_DTYPE = np.dtype([(f.name, _NP_CODES[f.ctype]) for f in d.HEADER])
PAYLOAD_DTYPE = np.dtype("<i4")

assert HEADER_SIZE == sum(d.SIZES[f.ctype] for f in d.HEADER) == HEADER_DTYPE.itemsize
assert HEADER_SIZE % 8 == 0, "keep the payload 8-byte aligned relative to the header"


def payload_dtype(precision: int = d.Precision.INT32, result: bool = False) -> np.dtype:
    """The payload's value type: a contribution's (or re-read's) of ``precision``, or its result's."""
    lanes = d.LANES[d.Precision(precision)]
    return np.dtype(lanes.result if result else lanes.contrib)


def packet_dtype(elements: int, precision: int = d.Precision.INT32, result: bool = False,
                 room: bool = False) -> np.dtype:
    """One whole aggd message (header + payload) as a numpy record, for vectorised building: a
    contribution of ``precision`` (or its result, ``result=True``). ``room``: a contribution as long
    as its result, its values first (the JOIN_ACK's ``room``; docs/protocol.md, "Precision")."""
    values = payload_dtype(precision, result)
    if not room:
        return np.dtype([("hdr", HEADER_DTYPE), ("payload", values, (elements,))])
    width = max(values.itemsize, payload_dtype(precision, True).itemsize)
    return np.dtype({"names": ["hdr", "payload"], "formats": [HEADER_DTYPE, (values, (elements,))],
                     "offsets": [0, HEADER_SIZE], "itemsize": HEADER_SIZE + width * elements})


_DEFAULTS = {"magic": d.MAGIC, "version": d.VERSION, "type": int(d.MsgType.CONTRIB)}


def _pack(self) -> bytes:
    return HEADER_STRUCT.pack(*(getattr(self, f.name) for f in d.HEADER))


@classmethod
def _unpack(cls, data: bytes | memoryview):
    if len(data) < HEADER_SIZE:
        raise ValueError(f"aggd header needs {HEADER_SIZE} bytes, got {len(data)}")
    return cls(*HEADER_STRUCT.unpack_from(data))


#: The header as a dataclass, one attribute per wire field (derived, like everything here).
Header = make_dataclass(
    "Header", [(f.name, int, field(default=_DEFAULTS.get(f.name, 0))) for f in d.HEADER],
    namespace={"pack": _pack, "unpack": _unpack, "__module__": __name__,
               "__doc__": "An aggd header; ``pack()`` / ``Header.unpack(data)``."})


def encode(header: Header, payload: np.ndarray | None = None) -> bytes:
    """The message's bytes; the payload is written in the type ``header.code`` says (a NACK's code
    is not a precision: NACKs carry no payload)."""
    if payload is None:
        return header.pack()
    kind = header.type in (d.MsgType.CONTRIB, d.MsgType.REREAD, d.MsgType.RESULT)
    dtype = payload_dtype(header.code, header.type == d.MsgType.RESULT) if kind else PAYLOAD_DTYPE
    return header.pack() + np.ascontiguousarray(payload, dtype=dtype).tobytes()


def decode(data: bytes | memoryview) -> tuple[Header, np.ndarray]:
    """Header and payload values, read in the type the header's ``code`` says for contributions,
    re-reads and results (int32 when it names no precision)."""
    hdr = Header.unpack(data)
    dtype = PAYLOAD_DTYPE
    if hdr.type in (d.MsgType.CONTRIB, d.MsgType.REREAD, d.MsgType.RESULT) and hdr.code in d.LANES:
        dtype = payload_dtype(hdr.code, hdr.type == d.MsgType.RESULT)
    payload = np.frombuffer(data, dtype=dtype, offset=HEADER_SIZE,
                            count=(len(data) - HEADER_SIZE) // dtype.itemsize)
    return hdr, payload
