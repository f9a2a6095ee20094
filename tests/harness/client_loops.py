"""The client's loops of tests/client/test_client_async.py and test_client_async_userspace.py, run
against the reference model and against the user-space aggregator: ``Workers`` runs a function per
rank in threads, ``train`` is one training loop written once (push this step's gradient, apply the
previous step's average), ``check_training`` what every strategy promises of it, ``assert_close`` a
result against the exact sum of its contributions and its bound. Packets of ``E`` values."""
from __future__ import annotations

import threading
import time

import numpy as np

from aggd_client import AggClient, StrategyInfo, quant
from aggd_client.protocol.definition import StrategyKind

E = 32


def grad(rank: int, rnd: int, size: int = 4 * E - 5, step: int = 0) -> np.ndarray:
    """A deterministic gradient of ``rank`` for round ``rnd`` (and wbsp ``step``)."""
    rng = np.random.default_rng([rank, rnd, step, size])
    return rng.standard_normal(size).astype(np.float32)


class Workers:
    """Run ``fn(rank)`` for some ranks in threads; ``join()`` returns results or raises."""

    def __init__(self, fn, ranks):
        self.out, self.err = {}, {}

        def work(r):
            try:
                self.out[r] = fn(r)
            except BaseException as e:  # noqa: BLE001 - re-raised by join
                self.err[r] = e

        self.threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in ranks]
        for t in self.threads:
            t.start()

    def join(self, timeout: float = 60.0) -> dict:
        for t in self.threads:
            t.join(timeout)
        assert not any(t.is_alive() for t in self.threads), "a worker hung"
        for e in self.err.values():
            raise e
        return self.out


def result_bound(contribs, world: int, terms: int, n_contrib: int | None = None, mean: bool = False):
    """Per-element bound for a result holding ``contribs`` (each quantised with ``terms``)."""
    exps = np.stack([quant.quantise_flat(np.ravel(x), world, E, terms=terms)[1]
                     for x in contribs]).min(axis=0)
    n = len(contribs) if n_contrib is None else n_contrib
    b = np.repeat(quant.error_bound(world, exps, n), E)[:np.size(contribs[0])]
    b = b + n * np.spacing(np.sum([np.abs(x.astype(np.float64)) for x in contribs], axis=0))
    return b / n if mean else b


def assert_close(result, contribs, world, terms, mean=False, n_contrib=None):
    exact = np.sum([x.astype(np.float64) for x in contribs], axis=0)
    if mean:
        exact = exact / (len(contribs) if n_contrib is None else n_contrib)
    allowed = result_bound(contribs, world, terms, n_contrib, mean) + quant.output_rounding(result)
    err = np.abs(result.astype(np.float64) - exact)
    assert (err <= allowed).all(), f"error {err.max()} beyond the bound {allowed[np.argmax(err)]}"


def close_all(clients):
    for c in clients:
        c.close()


def train(c: AggClient, rank: int, rounds: int, delay: float, size: int = 3 * E + 7):
    """A training loop written once: push this step's gradient, apply the previous step's average
    when it is there, until the job has reduced ``rounds`` rounds. Returns [(handle, result)]."""
    applied, prev, step = [], None, 0
    while c.round < rounds:
        g = np.full(size, rank + 1 + 0.01 * step, np.float32)
        h = c.allreduce_async(g, op="mean")
        if prev is not None:
            applied.append((prev, prev.wait()))
        prev, step = h, step + 1
        time.sleep(delay)
    if prev is not None:
        applied.append((prev, prev.wait()))
    return applied


def check_training(out: dict, clients, strategy: str, rounds: int, world: int) -> None:
    kind = StrategyInfo.parse(strategy).kind
    for rank, applied in out.items():
        assert applied and clients[rank].round >= rounds
        handles = [h for h, _ in applied]
        assert all(h.done() for h in handles)
        for h, res in applied:
            assert np.isfinite(res).all() and (h.n_contrib >= 1).all()
            # a mean of some contributions, each between 1 and world + 0.01 * steps
            assert (res >= 1 - 1e-3).all() and (res <= world + 0.01 * 8 * rounds).all()
            assert h.strategy is not None and h.strategy.kind == kind
        if kind in (StrategyKind.SYNC, StrategyKind.SSP):  # every round sums every member, once
            assert [h.round for h in handles] == list(range(rounds))
            for h, res in applied:
                n = h.round
                exact = np.mean([r + 1 + 0.01 * n for r in range(world)])
                assert np.allclose(res, exact, rtol=1e-5)
                assert (h.n_contrib == world).all()


STRATEGIES = ["sync", "quorum:2", "ssp:1", "ssp:2", "async", "wbsp"]


DELAYS = {0: 0.0, 1: 0.002, 2: 0.02}  # rank 2 lags; rank 0 runs ahead
