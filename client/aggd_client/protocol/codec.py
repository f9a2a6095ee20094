"""Codec derived from ``definition.HEADER``: struct format, numpy dtype, encode/decode."""
from __future__ import annotations

import struct
from dataclasses import dataclass, field, fields as dc_fields

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


def packet_dtype(elements: int) -> np.dtype:
    """One whole aggd message (header + payload) as a numpy record, for vectorised building."""
    return np.dtype([("hdr", HEADER_DTYPE), ("payload", PAYLOAD_DTYPE, (elements,))])


@dataclass
class Header:
    magic: int = d.MAGIC
    version: int = d.VERSION
    type: int = d.MsgType.CONTRIB
    job: int = 0
    rank: int = 0
    round: int = 0
    chunk: int = 0
    count: int = 0
    strategy_version: int = 0
    exponent: int = 0
    flags: int = 0
    code: int = 0
    contributors: int = 0
    n_contrib: int = 0
    step: int = 0
    reserved: int = 0

    def pack(self) -> bytes:
        return HEADER_STRUCT.pack(*(getattr(self, f.name) for f in d.HEADER))

    @classmethod
    def unpack(cls, data: bytes | memoryview) -> "Header":
        if len(data) < HEADER_SIZE:
            raise ValueError(f"aggd header needs {HEADER_SIZE} bytes, got {len(data)}")
        return cls(*HEADER_STRUCT.unpack_from(data))


assert [f.name for f in dc_fields(Header)] == [f.name for f in d.HEADER]


def encode(header: Header, payload: np.ndarray | None = None) -> bytes:
    body = b"" if payload is None else np.ascontiguousarray(payload, dtype=PAYLOAD_DTYPE).tobytes()
    return header.pack() + body


def decode(data: bytes | memoryview) -> tuple[Header, np.ndarray]:
    hdr = Header.unpack(data)
    payload = np.frombuffer(data, dtype=PAYLOAD_DTYPE, offset=HEADER_SIZE,
                            count=(len(data) - HEADER_SIZE) // 4)
    return hdr, payload
