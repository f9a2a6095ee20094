"""A data-parallel training loop in numpy that is right under every aggd strategy.

Each worker holds a replica of the model, takes an SGD step on a mini-batch of its own shard and
allreduces, with ``op="mean"`` (each chunk divided by the number of contributions its result holds,
``n_contrib``), one tensor with two parts, each starting on a packet boundary: ``P``, the model its
step started from, and ``U = -lr * g``, the step. Then:

* in step (the result answers the round right after the last one it applied): ``model += mean U``,
  the steps of the round's contributions averaged by their true count (``sync``: the world;
  ``quorum:k``: k plus any late contribution carried in; ``wbsp``: every local step pushed in);
  under ``sync`` this is plain synchronous SGD and every replica is bit-identical;
* out of step (a straggler under ``quorum`` is answered by a newer round than the one it sent to),
  an ``async`` running sum, and every ``resync_every`` rounds for everybody:
  ``model = mean P + mean U``, the members' mean model, which puts a straggler back in step at once
  (averaging gradients alone would leave it behind by every update it missed);
* ``ssp:s``, ``async``, ``wbsp``: a member keeps stepping while the strategy admits (``must_wait``
  is false); a result replaces the model, plus its own steps not answered yet. Accuracy is measured
  on the model the results define (``G``), not on a member's unanswered local steps.

The gloo baseline (:class:`GlooExchange`, always in step) sends ``U`` only. The exchange is anything
with ``allreduce_async(x, op)``, ``must_wait()``, ``round`` and ``strategy`` (an
``aggd_client.AggClient``, or :class:`GlooExchange`). Compute is simulated by a sleep of
``compute_s`` a step (times the worker's slowdown) on top of the real forward/backward, so a
benchmark controls the compute/communication ratio on a 2-core machine.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np

from aggd_client.protocol import StrategyKind

from aggd.training.data import Batches, Dataset
from aggd.training.networks import MLP

#: Each part of a contribution starts on a multiple of this many values (a packet boundary for
#: every packet size that divides it: 64, 128, 256, 512).
PAD = 512


@dataclass(frozen=True)
class TrainConfig:
    rounds: int = 300                   #: allreduce rounds of training (after a warm-up round)
    lr: float = 0.5
    lr_final: float = 0.1               #: linear decay from lr to this over the second half
    batch: int = 16                     #: examples per worker and step
    hidden: int = 64
    compute_s: float = 0.02             #: simulated compute a step (seconds)
    slow: float = 1.0                   #: this worker's slowdown factor ...
    slow_from: int = 0                  #: ... from this round ...
    slow_until: int | None = None       #: ... to this one (None: to the end)
    eval_every: int = 5                 #: evaluate the replica every this many rounds
    resync_every: int = 20              #: every this many rounds all replicas take the mean model
    seed: int = 0
    #: send the step alone (as gloo does), not the model with it: under sync the replicas never
    #: need the model, and a per-member bound (docs/protocol.md, "Bounds") then bounds steps alone
    step_only: bool = False
    #: a faulty member: from this round on it sends its step times ``corrupt_scale`` (None: never)
    corrupt_from: int | None = None
    corrupt_scale: float = -10.0

    def slowness(self, round_: int) -> float:
        if round_ < self.slow_from or (self.slow_until is not None and round_ >= self.slow_until):
            return 1.0
        return self.slow

    def learning_rate(self, round_: int) -> float:
        half = self.rounds / 2
        if round_ <= half:
            return self.lr
        return self.lr + (self.lr_final - self.lr) * min(1.0, (round_ - half) / half)


def make_model(data: Dataset, cfg: TrainConfig) -> MLP:
    return MLP((data.features, cfg.hidden, data.classes), seed=cfg.seed)


class _Done:
    """A finished handle for exchanges that reduce synchronously."""
    __slots__ = ("result", "round", "strategy", "n_contrib")

    def __init__(self, result, round_, strategy, n_contrib):
        self.result, self.round, self.strategy, self.n_contrib = result, round_, strategy, n_contrib

    def done(self) -> bool:
        return True

    def wait(self, timeout=None):
        return self.result


class GlooExchange:
    """torch.distributed's allreduce (gloo backend) behind the exchange interface: the baseline."""

    strategy = "gloo"

    def __init__(self, rank: int, world: int, init_method: str, timeout_s: float = 120.0):
        import datetime

        import torch
        import torch.distributed as dist

        self._torch, self._dist = torch, dist
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        self.world = world
        self.round = 0

    def allreduce_async(self, x: np.ndarray, op: str = "mean"):
        t = self._torch.from_numpy(np.array(x, np.float32))
        self._dist.all_reduce(t)
        out = t.numpy()
        if op == "mean":
            out /= self.world
        h = _Done(out, self.round, "gloo", np.array([self.world]))
        self.round += 1
        return h

    def allreduce(self, x, op: str = "mean"):
        return self.allreduce_async(x, op).wait()

    def must_wait(self) -> bool:
        return False

    def close(self) -> None:
        self._dist.destroy_process_group()


class FeedbackExchange:
    """An aggd client of a narrow job (8 or 16 bits) with error feedback and error reset
    (``aggd_client.feedback.ErrorFeedback``; ``reset_every=None``: plain stochastic rounding, no
    feedback): one tensor, reduced synchronously, so ``sync`` jobs only. It sends the step ``U``
    alone (``sends_model`` False), as gloo does: a model quantised to 8 bits at every resync would
    lose what error feedback keeps, and under ``sync`` the replicas never need one."""

    sends_model = False

    def __init__(self, client, feedback: bool = True, reset_every: int | None = None):
        from aggd_client.feedback import DEFAULT_RESET_EVERY, ErrorFeedback

        self.client = client
        self.feedback = ErrorFeedback(client, DEFAULT_RESET_EVERY if reset_every is None else reset_every) \
            if feedback else None
        self.round = 0

    @property
    def strategy(self):
        return self.client.strategy

    @property
    def job_info(self):
        return self.client.job_info

    @property
    def stats(self) -> dict:
        return self.client.stats

    def allreduce_async(self, x: np.ndarray, op: str = "mean"):
        if self.feedback is not None and self.round > 0:   # round 0 is the model (the start barrier)
            out = self.feedback.allreduce(x, key="step", op=op)
        else:
            out = self.client.allreduce(x, op=op)
        h = _Done(out, self.round, self.client.strategy, None)
        self.round += 1
        return h

    def must_wait(self) -> bool:
        return False

    def close(self) -> None:
        self.client.close()


def _padded(n: int, block: int = PAD) -> int:
    return -(-n // block) * block


def train(exchange, data: Dataset, rank: int, world: int, cfg: TrainConfig,
          report: Callable[[dict], None] | None = None, clock: Callable[[], float] = time.monotonic,
          sleep: Callable[[float], None] = time.sleep) -> dict:
    """Train this worker's replica for ``cfg.rounds`` rounds; returns a summary.

    ``report(record)`` gets a record after every evaluation: ``t`` (seconds since the warm-up round
    completed), ``round``, ``accuracy`` (test set), ``loss`` (the last batch's), ``strategy`` (in
    force, as the last result said), ``slow`` (this worker's slowdown then).
    """
    model = make_model(data, cfg)
    batches = Batches(data, rank, world, cfg.batch, cfg.seed)
    n = model.n_params
    # what goes out: the model the step started from (P) and the step (U), each starting on a
    # packet boundary so each part is quantised at its own scale; gloo (sync, never skips) needs U only
    with_model = not cfg.step_only and getattr(exchange, "sends_model", getattr(exchange, "strategy", None) != "gloo")
    off_u = _padded(n) if with_model else 0
    width = off_u + n
    # warm-up round: every replica starts from the same model, and the round is the start barrier
    first = np.zeros(width, np.float32)
    first[:n] = model.params
    if with_model:
        first[off_u:] = 0.0
    if cfg.step_only:
        # every replica starts from the same model already (make_model's seed): the round is the
        # barrier alone, and sends no model (a bound on steps would refuse one)
        exchange.allreduce_async(np.zeros(n, np.float32), "mean").wait()
    else:
        warm = exchange.allreduce_async(first if with_model else model.params.copy(), "mean").wait()
        model.params[:] = warm[:n]
    t0 = clock()
    G = model.params.astype(np.float64)        # the job's model as the results say
    mine = np.zeros(n, np.float64)             # my steps sent but not answered yet
    pending: deque = deque()                   # (handle, my step in it)

    def unanswered() -> np.ndarray:
        """My steps not answered yet, summed afresh from ``pending`` (oldest first): exactly 0
        once every step is answered. Kept as a running sum instead (``+= u`` at a send, ``-= u``
        at its answer), it would hold float64 rounding residue whenever two steps were pending
        at once, and G + residue cast to float32 differs from G's cast wherever G lies on a
        float32 rounding tie: replicas that applied the same results would differ."""
        total = np.zeros(n, np.float64)
        for _, u in pending:
            total += u
        return total
    st = {"round": 0, "results": 0, "steps": 0, "resyncs": 0}
    evals: list[dict] = []
    loss = float("nan")
    next_eval = cfg.eval_every

    def strategy_text() -> str:
        return str(getattr(exchange, "strategy", "?"))

    def apply_ready(block: bool) -> None:
        nonlocal G, mine
        while pending and (block or pending[0][0].done()):
            h, u = pending.popleft()
            res = h.wait()
            # the steps of one wbsp round (and rounds a newer result answered) share one result
            while pending and pending[0][0].done() and pending[0][0].wait() is res:
                h, u = pending.popleft()
            mine = unanswered()
            block = False
            if h.round <= st["round"]:
                continue  # already applied (a newer result answered an older round)
            U = res[off_u:].astype(np.float64)
            kind = getattr(getattr(h, "strategy", None), "kind", None)
            skipped = h.round != st["round"] + 1
            if with_model and (skipped or kind == StrategyKind.ASYNC or h.round % cfg.resync_every == 0):
                # out of step (a straggler answered by a newer round), an async running sum, or the
                # periodic resync: take the members' mean model plus the mean step
                G = res[:n].astype(np.float64) + U
                st["resyncs"] += 1
            else:
                G = G + U  # in step: the mean step of this round's contributions
            st["round"] = h.round
            st["results"] += 1
        model.params[:] = (G + mine).astype(np.float32)

    consensus = make_model(data, cfg)  # G as a model: what is evaluated (not my unanswered steps)

    def accuracy() -> float:
        consensus.params[:] = G
        return consensus.accuracy(data.x_test, data.y_test)

    def evaluate(round_: int) -> None:
        rec = {"rank": rank, "t": clock() - t0, "round": round_, "accuracy": accuracy(), "loss": loss,
               "strategy": strategy_text(), "slow": cfg.slowness(round_)}
        evals.append(rec)
        if report:
            report(rec)

    while True:
        apply_ready(block=False)
        while pending and exchange.must_wait():
            apply_ready(block=True)
        # must_wait() polls, and a result that came in then answers a round it had just found
        # unanswered: apply it now, so a step starts from the model of every result so far
        # (under sync, from the job's model: plain synchronous SGD), not from its own last step
        apply_ready(block=False)
        r = exchange.round
        if st["round"] >= next_eval:
            evaluate(st["round"])
            next_eval = (st["round"] // cfg.eval_every + 1) * cfg.eval_every
        if r > cfg.rounds:
            break
        sleep(cfg.compute_s * cfg.slowness(r))
        loss, g = model.loss_and_grad(*batches.next())
        u = -cfg.learning_rate(r) * g.astype(np.float64)
        if cfg.corrupt_from is not None and r >= cfg.corrupt_from:
            u = u * cfg.corrupt_scale     # a faulty (or hostile) member's step
        out = np.zeros(width, np.float32)
        if with_model:
            out[:n] = model.params
        out[off_u:] = u
        h = exchange.allreduce_async(out, "mean")
        pending.append((h, u))
        mine = unanswered()
        model.params[:] = (G + mine).astype(np.float32)
        st["steps"] += 1
    drained = True
    try:
        apply_ready(block=True)
    except Exception as exc:  # the others may be gone: a late straggler's last round is moot
        drained = f"{type(exc).__name__}: {exc}"
    final = accuracy()
    evals.append({"rank": rank, "t": clock() - t0, "round": st["round"], "accuracy": final,
                  "loss": loss, "strategy": strategy_text(), "slow": 1.0, "final": True})
    if report:
        report(evals[-1])
    return {"rank": rank, "seconds": clock() - t0, "final_accuracy": final, "rounds": st["round"],
            "results": st["results"], "steps": st["steps"], "resyncs": st["resyncs"], "drained": drained,
            "evals": evals, "params_sha": _digest(model.params)}


def _digest(a: np.ndarray) -> str:
    import hashlib
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()[:16]


def time_to_target(evals: list[dict], target: float) -> float | None:
    """Seconds until the first evaluation at or above ``target`` (None: never)."""
    for e in evals:
        if e["accuracy"] >= target:
            return e["t"]
    return None

