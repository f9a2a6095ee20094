"""A PyTorch DDP communication hook that allreduces gradient buckets through aggd.

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from aggd_client import join
    from aggd_client.torch_hook import register

    dist.init_process_group("gloo", ...)          # DDP still broadcasts the initial model with it
    model = DDP(net)
    client = join(("10.0.0.1", 47000), "resnet", rank=rank, token=TOKEN)
    register(model, client)                        # model.register_comm_hook(state, aggd_hook)

Each bucket DDP hands the hook (a flat gradient tensor) becomes one aggd round with ``op="mean"``:
the result is the sum of the members' buckets divided, chunk by chunk, by the number of
contributions it holds (``n_contrib``: the world under ``sync``; fewer or more under ``quorum`` and
``wbsp``), which is what DDP's own allreduce hook computes (sum / world) when everybody contributes.

Dtypes: float32 and float16 buckets go as they are (the client quantises float16 directly);
bfloat16 has no numpy type, so a bfloat16 bucket is converted to float32 for quantisation and the
result back to bfloat16. The result is within ``quant.error_bound`` of the exact mean plus the
rounding to the bucket's dtype.

Threads: the hook returns at once with a ``torch.futures.Future``; a background thread (one per
state, the only user of the ``AggClient``, which is not thread-safe) reduces the buckets in the
order DDP launches them, which is the same on every rank, and completes the futures. Backward
computation of later buckets overlaps the reduction of earlier ones. ``threaded=False`` reduces
inside the hook instead. ``close()`` stops the thread; a script that ends without it has it stopped
by an ``atexit`` handler before the interpreter finalizes (``aggd_client.torch.shutdown``: a
daemon thread completing a future while the interpreter finalized aborted the process,
"terminate called without an active exception").

Error feedback: when the client's job is narrow (``precision`` 8 or 16) each bucket's rounding
residual is kept and added to its next reduction, and every ``reset_every`` (16) reductions of a
bucket the residuals are reduced and applied too (``aggd_client.feedback``: CSER's error reset);
the key is the bucket's index and size (DDP's first step has one bucket of every parameter, which
it then rebuilds into buckets by size: bucket 0 changes size once). ``error_feedback=False`` turns
it off, ``True`` forces it on (int32).

Strategies: every member must reduce the same sequence of buckets. Under ``quorum`` and ``async`` a
straggler's round may be answered by a newer round; with one bucket per step (a large
``bucket_cap_mb``) that is simply a newer mean gradient and is used, with several buckets it would
be another bucket, and the hook raises instead of returning it. With several buckets it does not
happen: under ``quorum`` the members say their sizes differ and the aggregator keeps each round for
its stragglers, under ``async`` a released round is kept until every member holds it (both tested
with DDP's two buckets a step and a straggler: docs/pytorch.md).
"""
from __future__ import annotations

import queue
import threading

import numpy as np

from .feedback import DEFAULT_RESET_EVERY, ErrorFeedback
from .protocol.definition import Precision
from .torch import shutdown
from .torch.convert import from_numpy, to_numpy as _to_numpy
from .torch.work import raising

__all__ = ["AggdHookState", "aggd_hook", "register", "reduce_tensor"]


def reduce_tensor(client, tensor, op: str = "mean", feedback: ErrorFeedback | None = None, key=None):
    """Allreduce one tensor through ``client`` (an ``AggClient``), with error feedback under
    ``key`` when ``feedback`` is given; returns (tensor of the input's dtype and shape, round that
    answered, round asked)."""
    arr, dtype = _to_numpy(tensor)
    asked = client.round
    flat = np.ascontiguousarray(arr).reshape(-1)
    if feedback is not None:
        out = feedback.allreduce(flat, key, op)
        h = feedback.last_handle
    else:
        h = client.allreduce_async(flat, op)
        out = h.wait()
    return from_numpy(out, dtype, tensor.shape), h.round, asked


def narrow(client) -> bool:
    """Whether ``client``'s job is narrower than int32 (error feedback's default)."""
    return getattr(client, "precision", Precision.INT32) != Precision.INT32


class AggdHookState:
    """What ``aggd_hook`` needs: the ``AggClient`` of this rank and the reduction thread."""

    def __init__(self, client, *, op: str = "mean", threaded: bool = True,
                 error_feedback: bool | None = None, reset_every: int | None = DEFAULT_RESET_EVERY):
        if op not in ("mean", "sum"):
            raise ValueError(f"op must be 'mean' or 'sum', not {op!r}")
        self.client = client
        on = narrow(client) if error_feedback is None else bool(error_feedback)
        #: the buckets' error feedback (None: off), keyed by bucket index
        self.feedback = ErrorFeedback(client, reset_every) if on else None
        self.op = op
        self.threaded = threaded
        self.buckets_seen: set[int] = set()
        self.stats = {"buckets": 0, "elements": 0, "newer_answers": 0}
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._exiting = False

    def _reduce(self, index: int, tensor):
        res, answered, asked = reduce_tensor(self.client, tensor, self.op, self.feedback,
                                             (index, tensor.numel()))
        if answered != asked:
            self.stats["newer_answers"] += 1
            if len(self.buckets_seen) > 1:
                raise RuntimeError(
                    f"bucket {index} (round {asked}) was answered by round {answered}: under "
                    f"{self.client.strategy} a straggler gets the newest result, which is another bucket "
                    f"when a step has {len(self.buckets_seen)}; use one bucket (a large bucket_cap_mb) "
                    f"or a strategy that waits (sync, ssp, wbsp)")
        self.stats["buckets"] += 1
        self.stats["elements"] += tensor.numel()
        return res

    def submit(self, index: int, tensor):
        """A future for the reduction of ``tensor`` (bucket ``index``)."""
        import torch

        fut = torch.futures.Future()
        self.buckets_seen.add(index)
        if not self.threaded:
            try:
                fut.set_result(self._reduce(index, tensor))
            except Exception as exc:
                fut.set_exception(exc)
            return raising(fut)
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="aggd-ddp-hook", daemon=True)
                self._thread.start()
                shutdown.track(self)
        self._queue.put((index, tensor, fut))
        # DDP reads the future in C++: a failure set on it would be taken for its tensor ("Unable
        # to cast ... to Tensor"); the continuation's is an error it raises from backward()
        return raising(fut)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None or self._exiting:
                return
            index, tensor, fut = item
            try:
                res = self._reduce(index, tensor)
            except Exception as exc:  # the future carries it to DDP, which raises in backward
                if self._exiting:
                    return
                fut.set_exception(exc)
            else:
                # set_result runs C++ with the GIL released; at exit that aborted (torch.shutdown)
                if self._exiting:
                    return
                fut.set_result(res)

    def close(self) -> None:
        """Stop the reduction thread (the client stays open: the caller owns it)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=10)
            self._thread = None
        shutdown.untrack(self)

    def stop_for_exit(self, timeout: float) -> None:
        """The process is exiting (``aggd_client.torch.shutdown``'s atexit handler): queued buckets
        are dropped, the one under way completes no future, and the thread is joined."""
        self._exiting = True
        thread = self._thread
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout)
        shutdown.untrack(self)


def aggd_hook(state: AggdHookState, bucket):
    """The DDP communication hook: ``ddp_model.register_comm_hook(state, aggd_hook)``."""
    return state.submit(bucket.index(), bucket.buffer())


def register(ddp_model, client, *, op: str = "mean", threaded: bool = True,
             error_feedback: bool | None = None, reset_every: int | None = DEFAULT_RESET_EVERY) -> AggdHookState:
    """Register ``aggd_hook`` on ``ddp_model`` with a new state for ``client``; returns the state.
    ``error_feedback``: None (on for a narrow job), True or False; ``reset_every``: its ``H``."""
    state = AggdHookState(client, op=op, threaded=threaded, error_feedback=error_feedback,
                          reset_every=reset_every)
    ddp_model.register_comm_hook(state, aggd_hook)
    return state
