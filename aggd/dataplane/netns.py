"""Entering a network namespace from one thread: the data planes attach, and the daemon serves,
in the namespace the config names (``dataplane.netns``); the lab uses it too."""
from __future__ import annotations

import ctypes
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

NETNS_DIR = Path("/run/netns")
_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


@contextmanager
def in_netns(ns_name: str) -> Iterator[None]:
    """Run the body with the calling THREAD in network namespace ``ns_name``, then switch back.

    Sockets created inside stay in that namespace after the block; subprocesses started inside
    inherit it. Other threads are unaffected (setns is per thread), hence /proc/thread-self.
    """
    target = os.open(NETNS_DIR / ns_name, os.O_RDONLY)  # FileNotFoundError: no such namespace
    saved = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        _setns(target)
        try:
            yield
        finally:
            _setns(saved)
    finally:
        os.close(target)
        os.close(saved)


def netns_exists(ns_name: str) -> bool:
    return (NETNS_DIR / ns_name).exists()
