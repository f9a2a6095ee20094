"""The lines lab child processes (workers, observers, aggregators) write to their pipes, read as
they come by one thread per pipe.

Draining at once matters twice over: a child blocked on a full pipe (a busy observer, a chatty
worker) stalls or loses what it should record, and a buffered ``readline`` behind a selector holds
back lines that arrived together until the next write.
"""
from __future__ import annotations

import subprocess
import threading
import time
from collections import deque
from typing import Callable, Iterable


class PipeLines:
    """Every line of ``stream`` (text or bytes; kept as text with its newline), the last ``keep`` of
    them (None: all). ``on_line(line)`` is called for each, under ``lock`` when given (callbacks of
    several pipes then never run at once); the first exception it raises is re-raised by ``join``
    while the pipe is still drained."""

    def __init__(self, stream, on_line: Callable[[str], None] | None = None, *,
                 lock: threading.Lock | None = None, keep: int | None = None) -> None:
        self.lines: deque[str] = deque(maxlen=keep)
        self.error: BaseException | None = None
        self._on_line, self._lock = on_line, lock
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for raw in stream:
            line = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
            self.lines.append(line)
            if self._on_line is None or self.error is not None:
                continue
            try:
                if self._lock is None:
                    self._on_line(line)
                else:
                    with self._lock:
                        self._on_line(line)
            except BaseException as e:  # noqa: BLE001 - reported by join(); keep draining
                self.error = e

    def join(self, timeout: float | None = None) -> list[str]:
        """The lines so far, after waiting up to ``timeout`` s for the end of the stream."""
        self._thread.join(timeout)
        if self.error is not None:
            raise self.error
        return list(self.lines)

    def text(self, timeout: float | None = None) -> str:
        return "".join(self.join(timeout))


def wait_all(procs: Iterable[subprocess.Popen], deadline: float, what: str) -> list[int]:
    """Return codes of ``procs``, waiting until ``deadline`` (time.monotonic()); TimeoutError naming
    ``what`` when one is still running then."""
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"{what} still running after the deadline") from None
    return codes
