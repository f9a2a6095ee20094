"""The ``Work`` the "aggd" process group returns: a ``torch.futures.Future`` completed by the
reduction thread (``reducer``), or by the inner gloo group's work for the collectives it serves.

``torch.distributed``'s ``_create_work_from_future`` is not used: its work's ``wait()`` returns True
after the future failed (the error surfaced later, as a crash inside DDP). ``AggdWork.wait`` raises
the future's error. Its ``timeout`` argument is ignored: the reduction thread fails every round
after the group's timeout itself, so a wait never outlasts it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["AggdWork", "completed_work", "failed_work"]


class AggdWork(dist._Work):
    """A collective's work over ``fut`` (its value: the list of output tensors)."""

    def __init__(self, fut: torch.futures.Future, what: str = "allreduce"):
        super().__init__()
        self._fut = fut
        self._what = what

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - the group's timeout is enforced upstream
        # Waiting on a continuation re-raises the future's error here (a failed future's own
        # wait from this override did not reliably surface it).
        self._fut.then(lambda f: f.wait()).wait()
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
