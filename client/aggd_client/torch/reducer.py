"""The reduction thread of an "aggd" process group: the only user of its ``AggClient`` (which is
not thread-safe). ``submit`` queues an allreduce and returns a future at once; the thread reduces
the queued allreduces one at a time in submission order (which is the same on every rank, as
``torch.distributed`` requires of collectives), so the caller's computation overlaps the
reduction (``async_op=True``, DDP's buckets).

Each allreduce is one aggd round: its tensors, flattened and concatenated (one dtype), staged to
host memory (``convert.stage_in``), reduced with op ``"sum"`` or ``"mean"`` (each chunk divided by
the number of contributions its result holds, ``n_contrib``), and copied back into the tensors.

Error feedback (``feedback``, on by default for a job of precision 8 or 16): each allreduce's
rounding residual is kept under the key ``(data_ptr, numel, dtype)`` of its tensor (a tuple of those
for several) and added to the next allreduce of that key; every ``error_reset``-th one also reduces
and applies the residuals (``aggd_client.feedback``).

Failures: a round that fails (the aggregator refuses or does not answer for ``give_up_after``, or
the group's ``timeout`` passes since it was submitted) completes its future with the error; the
client's rounds are then out of step with the other ranks', so every later allreduce fails at once
with an error naming the first one. Nothing hangs past the timeout.

Exit: the thread is a daemon thread, stopped by ``close`` (``destroy_process_group``) or, when the
script ends without it, by an ``atexit`` handler before the interpreter finalizes (``shutdown``:
completing a future while the interpreter finalizes aborted the process).
"""
from __future__ import annotations

import collections
import queue
import threading
import time
import weakref

import numpy as np

from . import shutdown
from .convert import stage_in, stage_out

__all__ = ["AggdBackendError", "Reducer", "last_round_info"]

_last: dict | None = None
_last_lock = threading.Lock()


def last_round_info() -> dict | None:
    """What answered this process's newest aggd allreduce (any group), or None before any:
    ``round_asked``, ``round_answered`` (later under quorum/async when a straggler got a newer
    result), ``strategy`` (that governed the answering round, e.g. ``"quorum:3"``),
    ``strategy_in_force`` (the client's newest), ``n_contrib`` (``min``/``max``/``mean`` over the
    chunks: contributions each chunk's result holds), ``chunks``, ``elements``, ``op``, ``seconds``."""
    with _last_lock:
        return None if _last is None else dict(_last, n_contrib=dict(_last["n_contrib"]))


class AggdBackendError(RuntimeError):
    """An aggd allreduce failed (the message says why, and which round)."""


class _Exiting(Exception):
    """The process is exiting (``shutdown``): the thread leaves without touching torch again."""


class Reducer:
    def __init__(self, client, timeout: float, *, accept_newer: bool = False, name: str = "aggd",
                 feedback=None):
        self.client = client
        #: ``feedback.ErrorFeedback`` over ``client`` (None: off), keyed by the tensors' addresses
        self.feedback = feedback
        #: keys whose tensors were freed (appended by their finalizers, in the freeing thread): their
        #: residuals are dropped before the next reduction, so a new tensor at a freed one's address
        #: starts from none (it inherited the old one's residual, and its call count)
        self._freed: collections.deque = collections.deque()
        self._watched: set = set()
        self.timeout = float(timeout)
        self.accept_newer = accept_newer
        self.name = name
        self.last_info: dict | None = None
        self.broken: BaseException | None = None
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"{name}-reducer", daemon=True)
        self._closed = False
        self._exiting = False
        self._thread.start()
        shutdown.track(self)

    def submit(self, tensors: list, op: str):
        """A future (value: ``tensors``, reduced in place) for the allreduce of ``tensors``."""
        import torch

        fut = torch.futures.Future()
        if self._closed:
            fut.set_exception(AggdBackendError(f"{self.name}: the process group was shut down"))
            return fut
        self._queue.put((tensors, op, fut, time.monotonic() + self.timeout))
        return fut

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None or self._exiting:
                return
            tensors, op, fut, deadline = item
            try:
                self._reduce(tensors, op, deadline)
            except _Exiting:
                return
            except BaseException as exc:  # noqa: BLE001 - the future carries it to wait()
                if self.broken is None:
                    self.broken = exc
                if self._exiting:
                    return
                fut.set_exception(exc)
            else:
                # set_result runs C++ with the GIL released; at exit that aborted (shutdown)
                if self._exiting:
                    return
                fut.set_result(tensors)

    def _reduce(self, tensors: list, op: str, deadline: float) -> None:
        global _last
        if self.broken is not None:
            raise AggdBackendError(f"{self.name}: an earlier allreduce failed, the group cannot go on "
                                   f"({type(self.broken).__name__}: {self.broken})")
        started = time.monotonic()
        if started >= deadline:
            raise AggdBackendError(f"{self.name}: allreduce timed out: the group's timeout "
                                   f"({self.timeout:g} s) passed while it waited for earlier ones")
        flat, dtype = stage_in(tensors)
        client = self.client
        asked = client.round
        try:
            if self.feedback is not None:
                key = self._feedback_key(tensors)
                out = self.feedback.allreduce(flat, key, op, timeout=max(deadline - time.monotonic(), 0.001))
                handle = self.feedback.last_handle
            else:
                handle = client.allreduce_async(flat, op)
                out = handle.wait(timeout=max(deadline - time.monotonic(), 0.001))
        except TimeoutError:
            raise AggdBackendError(
                f"{self.name}: allreduce of round {asked} ({flat.size} values) timed out after the "
                f"group's timeout ({self.timeout:g} s) under strategy {client.strategy}") from None
        except Exception as exc:
            raise AggdBackendError(f"{self.name}: allreduce of round {asked} failed: "
                                   f"{type(exc).__name__}: {exc}") from exc
        n = np.asarray(handle.n_contrib)
        info = {"round_asked": asked, "round_answered": handle.round,
                "strategy": str(handle.strategy) if handle.strategy is not None else None,
                "strategy_in_force": str(client.strategy),
                "n_contrib": {"min": int(n.min()) if n.size else 0, "max": int(n.max()) if n.size else 0,
                              "mean": float(n.mean()) if n.size else 0.0},
                "chunks": int(n.size), "elements": int(flat.size), "op": op,
                "seconds": time.monotonic() - started}
        self.last_info = info
        with _last_lock:
            _last = info
        if handle.round != asked and not self.accept_newer:
            raise AggdBackendError(
                f"{self.name}: round {asked} was answered by round {handle.round} (under {handle.strategy} a "
                f"straggler gets the newest result, which may hold another tensor); set AGGD_ACCEPT_NEWER=1 "
                f"when every allreduce reduces the same tensor, or use a strategy that waits (sync, ssp, wbsp)")
        if self._exiting:   # torch's copy releases the GIL too
            raise _Exiting()
        stage_out(tensors, out, dtype)

    def _feedback_key(self, tensors: list):
        """The error feedback key of ``tensors`` (their addresses, sizes and dtypes); the residual of
        a key whose tensor was freed since is dropped first, and a new key is forgotten when its
        first tensor is freed (the next tensor at that address is another one)."""
        while self._freed:
            k = self._freed.popleft()
            self._watched.discard(k)
            self.feedback.forget(k)
        parts = tuple((t.data_ptr(), t.numel(), str(t.dtype)) for t in tensors)
        key = parts[0] if len(parts) == 1 else parts
        if key not in self._watched:
            self._watched.add(key)
            weakref.finalize(tensors[0], self._freed.append, key)
        return key

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread after the queued allreduces; close the client (unless a round failed:
        its unanswered contributions would be retried until give_up_after)."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout)
        shutdown.untrack(self)
        if self.broken is None and not self._thread.is_alive():
            self.client.close()

    def stop_for_exit(self, timeout: float) -> None:
        """The process is exiting (``shutdown``'s atexit handler): the queued allreduces are
        dropped, the one under way completes no future, and the thread is joined (``timeout``)."""
        self._exiting = True
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout)
        shutdown.untrack(self)
