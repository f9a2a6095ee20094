"""Stop the threads that complete torch futures (the backend's reduction thread, ``reducer.Reducer``,
and the DDP hook's, ``torch_hook.AggdHookState``) before the interpreter finalizes.

Why: those threads are daemon threads, and completing a ``torch.futures.Future`` from one
(``set_result``, ``set_exception``) runs C++ with the GIL released: ``markCompleted`` wakes the
waiter (DDP's reducer in the main thread) and then runs and frees the future's callbacks (the
``then`` continuation of ``work.raising``), which takes the GIL again. When the main thread, woken,
ran to the end of the script first, the interpreter is finalizing by then; CPython (before 3.14)
ends a daemon thread that asks for the GIL during finalization with ``pthread_exit``, whose forced
unwinding through torch's noexcept destructor (``PythonFunctionGuard``, ``gil_scoped_release``)
is ``std::terminate``: "terminate called without an active exception", SIGABRT, after the script
had finished and printed its results (about 1 run in 20 of a 2-rank torchrun job; a daemon thread
completing a future just before the script ends: 51 of 60).

``atexit`` handlers run before finalization starts (after the non-daemon threads are joined), with
every thread still able to take the GIL, so one handler stops every live thread here: it says the
process is exiting (the thread then completes no more futures and reduces nothing more) and joins
it, for at most ``JOIN_SECONDS`` each. ``destroy_process_group`` (the backend) and
``AggdHookState.close`` (the hook) stop them earlier, in the ordinary way.
"""
from __future__ import annotations

import atexit
import threading
import weakref

__all__ = ["JOIN_SECONDS", "track", "untrack", "stop_all"]

#: How long the exit handler waits for one thread (one in the middle of a round waits for its
#: answer or its deadline; past this the process exits anyway).
JOIN_SECONDS = 5.0

_live: "weakref.WeakSet" = weakref.WeakSet()
_lock = threading.Lock()


def track(owner) -> None:
    """Stop ``owner``'s thread at exit: ``owner.stop_for_exit(timeout)`` is called then."""
    with _lock:
        _live.add(owner)


def untrack(owner) -> None:
    with _lock:
        _live.discard(owner)


@atexit.register
def stop_all(timeout: float = JOIN_SECONDS) -> None:
    """Stop every tracked thread (the exit handler; callable any time)."""
    with _lock:
        owners = list(_live)
    for owner in owners:
        try:
            owner.stop_for_exit(timeout)
        except Exception:  # noqa: BLE001 - at exit: the others must still be stopped
            pass
