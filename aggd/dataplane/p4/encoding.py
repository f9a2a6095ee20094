"""Values on the wire of P4Runtime: canonical bytestrings, and the addresses the tables match on as
integers."""
from __future__ import annotations

import ipaddress

from aggd.dataplane.p4 import P4Error


def encode(value: int, bitwidth: int) -> bytes:
    """Canonical P4Runtime bytestring: big-endian, no leading zero bytes (one byte for 0)."""
    value = int(value)
    if value < 0 or value >> bitwidth:
        raise P4Error(f"value {value} does not fit {bitwidth} bits")
    return value.to_bytes(max(1, (value.bit_length() + 7) // 8), "big")


def decode(data: bytes) -> int:
    return int.from_bytes(data, "big")


def ip_int(ip: str) -> int:
    return int(ipaddress.IPv4Address(ip))


def mac_int(mac: str | bytes) -> int:
    if isinstance(mac, bytes):
        return int.from_bytes(mac, "big")
    return int(mac.replace(":", ""), 16)


def multicast_mac(group_ip: str) -> int:
    ip = ip_int(group_ip)
    return 0x01005E000000 | (ip & 0x7FFFFF)
