"""The user-space path's slots in files that outlive the daemon, as the XDP program's pinned maps do.

A member that lost a result asks again (a re-read, or its contribution retransmitted); if the
daemon restarted in between and its user-space slots started empty, nobody can answer and the job
deadlocks a chunk short. So each job's slot arrays (the fast path's ``bi``, ``bu``, ``steps`` and
``values``) and its counters live in memory-mapped ``.npy`` files under ``[state] dir``/userspace:
every change is in the page cache at once, a SIGKILL loses nothing, and the next daemon maps them
again. A ``meta.json`` says whose they are (the job's identity, its shapes, the boot): a job
recreated under the same id, other shapes, or a reboot (the kernel's slots are empty then too)
start afresh.
"""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def boot_id() -> str:
    try:
        return _BOOT_ID.read_text().strip()
    except OSError:
        return ""


class SlotFiles:
    """One job's arrays, mapped from ``folder``: ``array(name, dtype, shape)`` gives each (as it
    was kept when ``restored``, else zeros).

    A new array is a sparse file: its pages take neither disk nor the daemon's memory until
    written, so an idle job's slots cost nothing (aggctl bench memory). ``remove`` deletes the
    files; the pages go when the last map of them does."""

    def __init__(self, folder: Path, identity: str, shapes: dict) -> None:
        self.folder = Path(folder)
        self.identity = identity
        meta = {"identity": identity, "boot": boot_id(), "shapes": {k: list(v) for k, v in shapes.items()}}
        try:
            kept = json.loads((self.folder / "meta.json").read_text())
        except (OSError, ValueError):
            kept = None
        self.restored = kept == meta
        if not self.restored:
            if kept is not None:
                log.info("user-space slots in %s belong to another job or boot: starting afresh", self.folder)
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder.mkdir(parents=True, mode=0o700)
            (self.folder / "meta.json").write_text(json.dumps(meta))

    def array(self, name: str, dtype, shape) -> np.ndarray:
        path = self.folder / f"{name}.npy"
        if self.restored:
            try:
                a = np.lib.format.open_memmap(path, mode="r+")
                if a.dtype == np.dtype(dtype) and a.shape == tuple(shape):
                    return a
            except (OSError, ValueError):
                pass
            log.warning("%s is unreadable or of another shape: that array starts afresh", path)
        return np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=tuple(shape))

    def read(self, name: str) -> np.ndarray:
        """A copy of array ``name`` as the file holds it, read rather than mapped (so looking at
        it leaves no pages of the file resident in the daemon)."""
        return np.load(self.folder / f"{name}.npy")

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
