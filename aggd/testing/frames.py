"""Build and parse whole Ethernet frames carrying aggd messages (scapy), for BPF_PROG_TEST_RUN."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Raw

from aggd_client import protocol as proto

AGG_MAC, AGG_IP = "02:00:00:00:00:01", "10.77.0.1"


def worker_addr(rank: int) -> tuple[str, str, int]:
    """(mac, ip, port) of a fixture worker."""
    return f"02:00:00:00:01:{rank:02x}", f"10.77.0.{10 + rank}", 40000 + rank


def frame(hdr: proto.Header, payload=None, *, elements: int | None = None, src=None,
          dport: int = proto.DEFAULT_PORT) -> bytes:
    """A frame from worker ``src`` (defaults to the rank's fixture address) to the aggregator.
    ``elements`` pads the payload with zeros to that many int32 values."""
    mac, ip, port = src or worker_addr(hdr.rank)
    values = np.zeros(0, np.int32) if payload is None else np.asarray(payload, dtype=np.int32)
    if elements is not None and len(values) < elements:
        values = np.concatenate([values, np.zeros(elements - len(values), np.int32)])
    return raw_frame(proto.encode(hdr, values), src=(mac, ip, port), dport=dport)


def raw_frame(body: bytes, *, src: tuple[str, str, int], dport: int = proto.DEFAULT_PORT) -> bytes:
    """A frame from ``src`` (mac, ip, port) to the aggregator carrying ``body`` as its UDP payload."""
    mac, ip, port = src
    return bytes(Ether(src=mac, dst=AGG_MAC) / IP(src=ip, dst=AGG_IP, ttl=64) /
                 UDP(sport=port, dport=dport) / Raw(body))


@dataclass
class Parsed:
    eth_src: str
    eth_dst: str
    ip_src: str
    ip_dst: str
    sport: int
    dport: int
    ip_checksum_ok: bool
    hdr: proto.Header
    payload: np.ndarray
    udp_checksum_ok: bool | None = None  # None: no checksum (0)
    ip_id: int = 0
    ip_df: bool = False


def parse(data: bytes) -> Parsed:
    pkt = Ether(data)
    ip, udp = pkt[IP], pkt[UDP]
    ip_id, df, udp_check = ip.id, bool(ip.flags & 0x2), udp.chksum
    check = ip.chksum
    del ip.chksum
    ok = IP(bytes(ip))[IP].chksum == check
    udp_ok = None
    if udp_check:
        again = IP(bytes(ip))
        del again[UDP].chksum
        udp_ok = IP(bytes(again))[UDP].chksum == udp_check
    hdr, payload = proto.decode(bytes(udp.payload))
    return Parsed(pkt.src, pkt.dst, ip.src, ip.dst, udp.sport, udp.dport, ok, hdr, payload.copy(), udp_ok,
                  ip_id, df)


def udp_checksum_ok(data: bytes) -> bool | None:
    """Whether the UDP checksum of an Ethernet/IPv4 frame verifies; None when it carries none (0)."""
    udp_len = int.from_bytes(data[38:40], "big")
    seg = data[34:34 + udp_len]
    if seg[6:8] == b"\0\0":
        return None
    words = data[26:34] + b"\0\x11" + udp_len.to_bytes(2, "big") + seg + b"\0" * (udp_len & 1)
    total = int(np.frombuffer(words, ">u2").sum(dtype=np.uint64))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return total == 0xFFFF
