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
"""
from __future__ import annotations

import contextlib
import statistics
from dataclasses import dataclass

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


def run_mode(cfg: Config, mode: str, lab_name: str) -> dict:
    """One run: a fresh lab, the rates set, the job cut ``mode``'s way."""
    k = len(cfg.rates)
    with Lab(lab_name, cfg.workers, mtu=1500, aggregators=k) as lab, contextlib.ExitStack() as stack:
        lab.keep_multicast_from_aggregators()      # each link carries its own aggregator's traffic
        for i, rate in enumerate(cfg.rates):
            lab.set_aggregator_rate(i, rate)
        planes = [stack.enter_context(xdp_aggregator(lab, aggregator=i, elements=cfg.elements, total_slots=cfg.slots))
                  for i in range(k)]
        job = LabJob(job=JOB, workers=list(range(cfg.workers)), slots=cfg.slots, weights=(1,) * k,
                     rebalance_every=cfg.rebalance_every if mode == "rebalanced" else None)
        for i, dp in enumerate(planes):
            dp.install_job(job.config(lab, aggregator=i))
        runs = run_workers(lab, job, timeout=900, elements=cfg.elements,
                           extra=["--sizes", str(cfg.elements_total), "--rounds", str(cfg.calls),
                                  "--check", "last", "--give-up-after", "60"])
    for r in runs:
        if r.returncode != 0 or len(r.records) != cfg.calls:
            raise BenchError(f"{mode}: rank {r.rank} failed:\n{r.stderr[-2000:]}")
        if not (r.records[-1]["within_bound"] and r.records[-1]["shape_ok"]):
            raise BenchError(f"{mode}: rank {r.rank}'s last sum is outside the bound: {r.records[-1]}")
    per_call = [max(r.records[i]["seconds"] for r in runs) for i in range(cfg.calls)]
    weights = [r.records[-1]["shard_weights"] for r in runs]
    if any(w != weights[0] for w in weights):
        raise BenchError(f"{mode}: members ended with different shard maps: {weights}")
    seconds = statistics.median(per_call[-cfg.steady:])
    return {"mode": mode, "workers": cfg.workers, "bytes": 4 * cfg.elements_total, "rates_mbit": list(cfg.rates),
            "calls": cfg.calls, "seconds_per_allreduce": seconds,
            "algbw_gbps": 4 * cfg.elements_total * 8 / seconds / 1e9, "final_weights": weights[0],
            "seconds_per_call": per_call, "max_abs_error": max(r.records[-1]["max_abs_error"] for r in runs),
            "error_bound": min(r.records[-1]["error_bound"] for r in runs)}


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


def plot(rows: list[dict], path: str) -> None:
    """Each call's time in both modes: the rebalanced run leaves the even split's time behind as
    the map moves partitions off the slow aggregator."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for row in rows:
        ax.plot(range(1, len(row["seconds_per_call"]) + 1), [s * 1e3 for s in row["seconds_per_call"]],
                marker=".", label=f"{row['mode']} (final weights {', '.join(f'{w:g}' for w in row['final_weights'])})")
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
