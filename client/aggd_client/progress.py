"""The progress loop: all the client's work happens here, inside the caller's calls (there is no
thread): admit chunks, receive and hand on answers, scan for timeouts, and give up when no answer
comes.

``ProgressLoop`` is a mixin of ``AggClient``; ``_progress(until, timeout)`` is what ``wait``,
``done``, ``allreduce_async``, ``must_wait`` and ``close`` run. The give-up clock counts only the
time spent inside those calls.
"""
from __future__ import annotations

import time
from typing import Callable

from .errors import AggdError, NoAnswerError

#: A batch of answers smaller than this, while at least ``4 * SMALL_BATCH`` packets await theirs and
#: nothing can be sent, makes the client wait ``BATCH_WAIT`` s before reading again: each pass of
#: the progress loop costs tens of microseconds of Python, so passes of a few answers each (what
#: waking at every arrival gives when workers share cores) cost more CPU than the packets. The
#: answers pile up meanwhile (the window holds far more) and the wait gives the CPU to the others.
SMALL_BATCH = 16
BATCH_WAIT = 0.001
#: The shortest time between two scans for chunks to resend (each scan is a pass over the chunks
#: in flight).
SCAN_MIN = 0.001


def _never() -> bool:
    return False


class ProgressLoop:
    """The progress loop of ``AggClient`` (see the module's docstring)."""

    def _init_progress(self) -> None:
        self._last_progress = time.monotonic()
        self._away_since: float | None = None  # time outside calls does not count (give-up clock)
        self._next_scan = 0.0
        self._last_batch = 0  # messages the last receive took

    def _check_open(self) -> None:
        if self._closed:
            raise AggdError("the client is closed")

    def _poll(self) -> None:
        self._progress(_never, 0.0)

    def _progress(self, until: Callable[[], bool], timeout: float | None = None) -> bool:
        """Send, retransmit and receive until ``until()`` holds (True) or ``timeout`` seconds pass
        (False; None: no limit; 0: one pass that does not wait). A fatal error (NACK, no answer)
        fails every round in flight and is raised."""
        self._check_open()
        now = time.monotonic()
        if self._away_since is not None:
            self._last_progress += now - self._away_since
            self._away_since = None
        deadline = None if timeout is None else now + timeout
        try:
            self._receive(0.0)
            while True:
                if until():
                    return True
                more = self._admit()
                now = time.monotonic()
                if now >= self._next_scan:
                    # Answers already in our sockets come first: a worker that was off the CPU
                    # finds a backlog larger than one batch, and a scan before reading it would
                    # resend chunks whose answers are here (duplicates the aggregator drops).
                    while self._receive(0.0) >= self._receiver.full_at:
                        pass
                    if until():
                        return True
                    now = time.monotonic()
                    self._retransmit(now)
                    # every quarter timeout, or sooner where answers come faster (RACK finds a
                    # loss a round trip after it, not a timeout after)
                    srtt = self._rtt.srtt
                    self._next_scan = now + (self._scan_every if srtt is None else
                                             max(min(self._scan_every, 2 * srtt), SCAN_MIN))
                if until():
                    return True
                self._check_give_up(now)
                if deadline is not None and now >= deadline:
                    return False
                wait = 0.0
                if not more:
                    wait = min(self._next_scan, self._last_progress + self._give_up) - now
                    if deadline is not None:
                        wait = min(wait, deadline - now)
                    if self._last_batch < SMALL_BATCH and wait > BATCH_WAIT and \
                            sum(s.inflight for s in self._sends) >= 4 * SMALL_BATCH:
                        time.sleep(BATCH_WAIT)
                        wait -= BATCH_WAIT
                        self.stats["batch_waits"] += 1
                self._last_batch = self._receive(max(0.0, wait))
        except (AggdError, OSError) as e:
            self._fail_all(e)
            raise
        finally:
            self._away_since = time.monotonic()

    def _check_give_up(self, now: float) -> None:
        waited = now - self._last_progress
        if waited < self._give_up:
            return
        waiting = [r for r in self._rounds if not r.complete]
        if not waiting:
            return
        answered = sum(r.n_have for r in waiting)
        total = sum(r.n_chunks for r in waiting)
        nums = ", ".join(str(r.number) for r in waiting)
        detail = (f"rank {self._rank}, round{'s' if len(waiting) > 1 else ''} {nums}: {answered} "
                  f"of {total} chunks answered, {self.stats['retransmits']} retransmissions, "
                  f"strategy {self._strategy}")
        if self._last_send_error is not None:
            detail += f"; last send error: {self._last_send_error}"
        raise NoAnswerError(self._server, self._job, waited, detail)
