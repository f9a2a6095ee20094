"""``aggctl bench shards``: one job sharded over three XDP aggregators, one of them behind a slower
link, cut evenly and rebalanced (docs/sharding.md).

Every run builds the same lab (``workers`` workers, three aggregator namespaces with the XDP program
on their interfaces), limits the bridge's link towards each aggregator (a token bucket:
``rates`` Mbit/s, the slow one a quarter of the others by default; the bridge does not flood the
other aggregators' result multicast onto it, as a switch with IGMP snooping would not), and reduces
one float32 tensor ``calls`` times:

* ``even``: the shard map's weights fixed at 1, 1, 1;
* ``rebalanced``: from 1, 1, 1, the members' rebalancing policy (``aggd_client.shard_policy``)
  moves partitions every ``rebalance_every`` calls, agreeing through torch's TCPStore.

A call's time is the slowest member's; a run's ``seconds_per_allreduce`` the median of its last
``steady`` calls (after the policy has settled). ``speedup`` is even over rebalanced.

``run_scale`` scales the job out and in while it runs, through real daemons (one an aggregator
namespace, the job registered on each with one token): the members start on two, the leader adds the
third at ``add_at`` and drains it at ``drain_at``; the row has each phase's median call time.
"""
from __future__ import annotations

import contextlib
import statistics
from dataclasses import dataclass

from aggd.lab.daemon import daemons_on
from aggd.lab.namespaces import Lab
from aggd.lab.runner import LabJob, run_workers, xdp_aggregator

MODES = ("even", "rebalanced")
JOB = 1


class BenchError(RuntimeError):
    pass


@dataclass(frozen=True)
class Config:
    workers: int = 4
    elements_total: int = 1 << 20          #: float32 values a tensor
    calls: int = 40
    steady: int = 12                       #: calls at the end a run's time is the median of
    rates: tuple[float, ...] = (400.0, 400.0, 100.0)   #: Mbit/s towards each aggregator
    rebalance_every: int = 4
    elements: int = 256                    #: int32 values a packet
    slots: int = 256


@contextlib.contextmanager
def _shaped_lab(cfg: Config, lab_name: str):
    """A fresh lab, an aggregator a rate, each link towards one limited to its rate and carrying its
    own aggregator's traffic only."""
    with Lab(lab_name, cfg.workers, mtu=1500, aggregators=len(cfg.rates)) as lab:
        lab.keep_multicast_from_aggregators()
        for i, rate in enumerate(cfg.rates):
            lab.set_aggregator_rate(i, rate)
        yield lab


def run_mode(cfg: Config, mode: str, lab_name: str) -> dict:
    """One run: a fresh lab, the rates set, the job cut ``mode``'s way."""
    k = len(cfg.rates)
    with _shaped_lab(cfg, lab_name) as lab, contextlib.ExitStack() as stack:
        planes = [stack.enter_context(xdp_aggregator(lab, aggregator=i, elements=cfg.elements, total_slots=cfg.slots))
                  for i in range(k)]
        job = LabJob(job=JOB, workers=list(range(cfg.workers)), slots=cfg.slots, weights=(1,) * k,
                     rebalance_every=cfg.rebalance_every if mode == "rebalanced" else None)
        for i, dp in enumerate(planes):
            dp.install_job(job.config(lab, aggregator=i))
        runs = run_workers(lab, job, timeout=900, elements=cfg.elements,
                           extra=["--sizes", str(cfg.elements_total), "--rounds", str(cfg.calls),
                                  "--check", "last", "--give-up-after", "60"])
    per_call, maps = _call_seconds(runs, cfg.calls, mode)
    seconds = statistics.median(per_call[-cfg.steady:])
    return {"mode": mode, "workers": cfg.workers, "bytes": 4 * cfg.elements_total, "rates_mbit": list(cfg.rates),
            "calls": cfg.calls, "seconds_per_allreduce": seconds,
            "algbw_gbps": 4 * cfg.elements_total * 8 / seconds / 1e9, "final_weights": maps[-1],
            "seconds_per_call": per_call, "max_abs_error": max(r.records[-1]["max_abs_error"] for r in runs),
            "error_bound": min(r.records[-1]["error_bound"] for r in runs)}


def _call_seconds(runs, calls: int, what: str) -> tuple[list[float], list]:
    """Each call's time (the slowest member's) and the map that cut it, checked alike on every member."""
    for r in runs:
        if r.returncode != 0 or len(r.records) != calls:
            raise BenchError(f"{what}: rank {r.rank} failed:\n{r.stderr[-2000:]}")
        if not (r.records[-1]["within_bound"] and r.records[-1]["shape_ok"]):
            raise BenchError(f"{what}: rank {r.rank}'s last sum is outside the bound: {r.records[-1]}")
    maps = [[rec["shard_weights"] for rec in r.records] for r in runs]
    if any(m != maps[0] for m in maps):
        raise BenchError(f"{what}: members cut calls by different maps")
    return [max(r.records[i]["seconds"] for r in runs) for i in range(calls)], maps[0]


def run_scale(cfg: Config, lab_name: str, add_at: int, drain_at: int) -> dict:
    """Two aggregators, a third added at call ``add_at`` and drained at ``drain_at``, through daemons."""
    k = len(cfg.rates)
    with _shaped_lab(cfg, lab_name) as lab:
        with daemons_on(lab, prefix="aggdb-", jobs={"default_slots": cfg.slots}) as daemons:
            job = daemons[0].call("jobs.create", name="scale", world=cfg.workers)
            for d in daemons[1:]:
                d.call("jobs.create", name="scale", world=cfg.workers, token=job["token"])
            runs = run_workers(lab, LabJob(job=job["id"], workers=list(range(cfg.workers)), name="scale",
                                           token=job["token"], weights=(1,) * (k - 1),
                                           rebalance_every=cfg.rebalance_every),
                               timeout=900, extra=["--sizes", str(cfg.elements_total), "--rounds", str(cfg.calls),
                                                   "--check", "last", "--give-up-after", "60",
                                                   "--add", f"{add_at}:{lab.agg_ip_of(k - 1)}:{job['port']}",
                                                   "--set-weights", f"{drain_at}:{','.join(['1'] * (k - 1) + ['0'])}"])
    per_call, maps = _call_seconds(runs, cfg.calls, "scale")
    phase = ["before" if len(w) < k else "out" if w[-1] else "in" for w in maps]
    medians = {p: statistics.median([t for t, q in zip(per_call, phase) if q == p])
               for p in ("before", "out", "in") if p in phase}
    return {"mode": "scale", "workers": cfg.workers, "bytes": 4 * cfg.elements_total, "rates_mbit": list(cfg.rates),
            "calls": cfg.calls, "add_at": add_at, "drain_at": drain_at,
            "seconds_by_phase": {"2 aggregators": medians.get("before"), "3 aggregators": medians.get("out"),
                                 "drained to 2": medians.get("in")},
            "seconds_per_call": per_call, "weights_per_call": maps}


def run(cfg: Config, lab_name: str, on_row=None) -> list[dict]:
    """Both modes, one after the other on labs named ``lab_name``; rows, the last with ``speedup``."""
    rows = []
    for mode in MODES:
        row = run_mode(cfg, mode, lab_name)
        rows.append(row)
        if mode == "rebalanced":
            row["speedup_over_even"] = rows[0]["seconds_per_allreduce"] / row["seconds_per_allreduce"]
        if on_row is not None:
            on_row(row)
    return rows


def _label(row: dict) -> str:
    if row["mode"] == "scale":
        return f"a third aggregator added at call {row['add_at'] + 1}, drained at call {row['drain_at'] + 1}"
    return f"{row['mode']} (final weights {', '.join(f'{w:g}' for w in row['final_weights'])})"


def plot(rows: list[dict], path: str) -> None:
    """Each call's time in both modes: the rebalanced run leaves the even split's time behind as
    the map moves partitions off the slow aggregator."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for row in rows:
        ax.plot(range(1, len(row["seconds_per_call"]) + 1), [s * 1e3 for s in row["seconds_per_call"]],
                marker=".", label=_label(row))
    first = rows[0]
    ax.set_title(f"{first['workers']} workers, {first['bytes'] >> 20} MiB, links "
                 f"{'/'.join(f'{r:g}' for r in first['rates_mbit'])} Mbit/s")
    ax.set_xlabel("call")
    ax.set_ylabel("allreduce time (ms)")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
