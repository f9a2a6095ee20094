"""One daemon an interface: a second aggd started on an interface another serves (by hand beside
the service, or a duplicate start) would attach its program over the first's, fail to bind the
port, and detach on its way out, leaving the first serving without its kernel data plane. So a
start first takes an exclusive lock (flock) for its interface, and for its pinned maps, in
``/run/aggd``; the lock goes with the process, however it ends."""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_DIR = Path("/run/aggd")


class InstanceLocked(Exception):
    """Another running aggd holds the lock; the message names it and the key."""


def claim(key: str, what: str, directory: Path = LOCK_DIR) -> int:
    """Take the lock for ``key`` (any text naming a resource, e.g. "netns/ifname") and return its
    file descriptor, kept open for the daemon's life; ``what`` (a config key and value) is named in
    the refusal."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / ("lock." + "".join(c if c.isalnum() or c in "-_." else "_" for c in key))
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise InstanceLocked(f"another aggd (pid {holder}) serves {what}: stop it first "
                             f"(`systemctl stop aggd`), or give this one another") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd
