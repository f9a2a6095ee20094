"""The ``Work`` the "aggd" process group returns, over a ``torch.futures.Future`` completed by the
reduction thread (``reducer``).

Errors must reach C++ consumers as errors. ``Future.set_exception`` from Python stores the exception
as the future's *value* (unwrapped into a raise only by Python's ``wait``), so C++ sees a future that
succeeded: DDP's reducer then parses the exception object as its tensors and crashes (a segfault in
``parseCppCommHookResult``), and ``_create_work_from_future``'s ``wait()`` returns True. The future
this work exposes is therefore a continuation, ``fut.then(lambda f: f.wait())``: when ``fut`` failed,
the continuation raises, and torch records that as a real C++ error on the continuation, which
DDP's ``value()`` and our ``wait()`` rethrow (as RuntimeError "Got the following error when running
the callback: ..."). ``wait``'s ``timeout`` argument is ignored: the reduction thread fails every
round after the group's timeout itself, so a wait never outlasts it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["AggdWork", "completed_work", "failed_work", "raising"]


def _unwrap(f: torch.futures.Future):
    return f.wait()   # raises the reduction's error inside the continuation


def raising(fut: torch.futures.Future) -> torch.futures.Future:
    """``fut``'s continuation, whose failure C++ consumers (DDP) see as an error (module docstring)."""
    return fut.then(_unwrap)


class AggdWork(dist._Work):
    """A collective's work over ``fut`` (its value: the list of output tensors)."""

    def __init__(self, fut: torch.futures.Future, what: str = "allreduce"):
        super().__init__()
        self._fut = raising(fut)   # a failure of `fut` becomes a C++ error (module docstring)
        self._what = what

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - the group's timeout is enforced upstream
        self._fut.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        return self._fut

    def is_completed(self) -> bool:
        return self._fut.done()

    def is_success(self) -> bool:
        if not self._fut.done():
            return False
        try:
            self._fut.wait()
            return True
        except Exception:  # noqa: BLE001
            return False

    def exception(self):
        if not self._fut.done():
            return None
        try:
            self._fut.wait()
            return None
        except Exception as exc:  # noqa: BLE001
            return exc

    def result(self):
        return self._fut.wait()

    def __repr__(self) -> str:
        state = "done" if self._fut.done() else "pending"
        return f"<AggdWork {self._what} {state}>"


def completed_work(value, what: str = "allreduce") -> AggdWork:
    fut = torch.futures.Future()
    fut.set_result(value)
    return AggdWork(fut, what)


def failed_work(exc: BaseException, what: str = "allreduce") -> AggdWork:
    fut = torch.futures.Future()
    fut.set_exception(exc)
    return AggdWork(fut, what)
