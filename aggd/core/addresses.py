"""``HOST:PORT`` text as the command lines and the config write it (``[::1]:9100`` for IPv6)."""
from __future__ import annotations


def host_port(text: str) -> tuple[str, int]:
    """``"10.0.0.1:4000"`` -> ``("10.0.0.1", 4000)``; ValueError for a missing or bad port."""
    host, sep, port = text.rpartition(":")
    if not sep:
        raise ValueError(f"{text!r} is not HOST:PORT")
    return host.strip("[]"), int(port)
