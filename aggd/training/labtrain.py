"""Train the digits MLP with N workers in a lab: an aggd daemon on the aggregator namespace, one
``aggd.training.worker`` per worker namespace. Shared by ``aggctl bench stragglers``, ``aggctl demo``
and the training tests.

``lab_daemon`` is the lab's ``aggd`` (``aggd.lab.daemon.LabDaemon``: XDP in native mode on
``agg0``, maps pinned in a private bpffs folder, control socket in a temporary folder) with the
straggler policy on. ``run()`` creates a job for one (strategy, scenario), starts the workers
(``aggd.lab.processes``), collects their records and deletes the job, so one daemon serves a whole
benchmark. The ``dynamic`` strategy is a ``sync`` job whose
name the daemon's policy manages (``policy.jobs``); every other job is left alone.
"""
from __future__ import annotations

import os
import secrets
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

from aggd.daemon.control import ControlError
from aggd.lab.daemon import LabDaemon
from aggd.lab.namespaces import Lab
from aggd.lab.processes import LabProcesses

#: The job names the policy of a ``lab_daemon`` manages (the dynamic runs).
DYNAMIC_PREFIX = "dyn"
GLOO_PORT = 29500


@dataclass(frozen=True)
class Scenario:
    """Which worker is slow, how much, and when (as fractions of the run's rounds)."""
    name: str
    slow: float = 1.0
    start: float = 0.0
    end: float | None = None
    description: str = ""

    def rounds(self, total: int) -> tuple[int, int | None]:
        return int(self.start * total), (None if self.end is None else int(self.end * total))


SCENARIOS = {
    "none": Scenario("none", 1.0, description="no straggler"),
    "slow2x": Scenario("slow2x", 2.0, description="the last worker 2x slower throughout"),
    "slow3x": Scenario("slow3x", 3.0, description="the last worker 3x slower throughout"),
    "slow4x": Scenario("slow4x", 4.0, description="the last worker 4x slower throughout"),
    "phase": Scenario("phase", 3.0, 0.25, 0.6, description="the last worker 3x slower for rounds 25%..60%"),
}

#: Benchmark strategy name -> the job's strategy text (n: world size). ``dynamic`` starts as sync
#: and the daemon's policy switches it; ``gloo`` uses no aggd job.
STRATEGIES = {
    "sync": "sync",
    "quorum": "quorum:n-1",
    "ssp": "ssp:2",
    "async": "async",
    "wbsp": "wbsp",
    "dynamic": "sync",
    "gloo": None,
}


@dataclass(frozen=True)
class RunParams:
    workers: int = 4
    rounds: int = 300
    compute_ms: float = 20.0
    lr: float = 0.5
    lr_final: float = 0.1
    batch: int = 16
    hidden: int = 64
    eval_every: int = 5
    seed: int = 0
    target: float = 0.95
    timeout_s: float = 240.0
    step_only: bool = False             #: workers send their step alone (TrainConfig.step_only)


@dataclass
class RunResult:
    scenario: str
    strategy: str
    strategy_text: str | None
    target_accuracy: float
    time_to_target_s: float | None
    final_accuracy: float
    seconds: float
    rounds: int
    curve: list[tuple[float, float]]             #: rank 0's (seconds, test accuracy)
    rounds_curve: list[tuple[float, int]]        #: rank 0's (seconds, round)
    strategies_seen: list[tuple[float, str]]     #: rank 0's (seconds, strategy in force) changes
    decisions: list[dict] = field(default_factory=list)
    workers: list[dict] = field(default_factory=list)
    killed_at: float | None = None               #: rank 0's seconds when ``kill`` struck
    rounds_to_target: int | None = None          #: rank 0's first evaluated round at the target
    members: list[dict] = field(default_factory=list)   #: ``aggctl workers``' rows at the end

    def to_json(self) -> dict:
        return {"scenario": self.scenario, "strategy": self.strategy, "strategy_text": self.strategy_text,
                "target_accuracy": self.target_accuracy, "time_to_target_s": self.time_to_target_s,
                "final_accuracy": self.final_accuracy, "seconds": self.seconds, "rounds": self.rounds,
                "curve": self.curve, "rounds_curve": self.rounds_curve, "strategies_seen": self.strategies_seen, "decisions": self.decisions,
                "workers": self.workers, "rounds_to_target": self.rounds_to_target}


def lab_daemon(lab: Lab, *, policy: dict | None = None, slots: int = 64, log_level: str = "info",
               mode: str = "native") -> LabDaemon:
    """The lab's aggd for training runs, its XDP program in ``mode`` (native or generic): its policy
    manages the jobs named ``DYNAMIC_PREFIX*``. ``with lab_daemon(lab, policy={...}) as d: d.call("status")``."""
    return LabDaemon(lab, prefix="aggdtr-", call_timeout=10, jobs={"default_slots": slots},
                     log={"level": log_level}, dataplane={"mode": mode},
                     policy={"auto_switch": True, "jobs": f"{DYNAMIC_PREFIX}*", **(policy or {})})


def strategy_text(strategy: str, world: int) -> str | None:
    text = STRATEGIES[strategy]
    if text is None:
        return None
    from aggd.core.policy import fill
    return fill(text, world, 1)


def worker_argv(params: RunParams, rank: int, scenario: Scenario, straggler: int) -> list[str]:
    argv = [sys.executable, "-m", "aggd.training.worker", "--rank", str(rank),
            "--rounds", str(params.rounds), "--compute-ms", str(params.compute_ms), "--lr", str(params.lr),
            "--lr-final", str(params.lr_final), "--batch", str(params.batch), "--hidden", str(params.hidden),
            "--eval-every", str(params.eval_every), "--seed", str(params.seed)] + \
        (["--step-only"] if params.step_only else [])
    if rank == straggler and scenario.slow != 1.0:
        a, b = scenario.rounds(params.rounds)
        argv += ["--slow", str(scenario.slow), "--slow-rounds", f"{a}:{'' if b is None else b}"]
    return argv


def _job_state(daemon: LabDaemon | None, job: dict | None) -> str:
    """What the daemon says of a job whose workers failed: its strategies, each path's counters and
    drops, its members (for the failure's message; empty when it cannot be read)."""
    if daemon is None or job is None:
        return ""
    try:
        shown = daemon.call("jobs.show", job=job["name"])
        workers = daemon.call("workers", job=job["name"])
    except Exception as exc:   # the daemon is gone too: say so, the workers' errors stand
        return f"\n(the daemon could not be asked: {exc})"
    paths = {p: {"counters": {k: v for k, v in st.get("counters", {}).items() if v},
                 "drops": {k: v for k, v in st.get("drops", {}).items() if v}}
             for p, st in shown.get("paths", {}).items()}
    return (f"\njob {job['name']}: round {shown.get('round')}, strategies {shown.get('strategies')}\n"
            f"paths {paths}\nworkers {[(w['rank'], w.get('last_round'), w.get('gone')) for w in workers['workers']]}")


def run(lab: Lab, daemon: LabDaemon | None, strategy: str, scenario: Scenario | str, params: RunParams,
        *, on_record: Callable[[int, dict], None] | None = None, on_job: Callable[[dict], None] | None = None,
        tag: str = "", kill: tuple[int, int] | None = None, restart: bool = False,
        kernel_slots: int | None = None, precision: int | None = None, feedback: bool = True,
        error_reset: int | None = None, corrupt: tuple[int, int, float] | None = None,
        job_options: dict | None = None) -> RunResult:
    """One training run of ``params.workers`` workers; ``on_record(rank, record)`` sees every line,
    ``on_job(job)`` the daemon's answer to ``jobs.create`` (its name, token...) before they start.
    ``kill=(rank, round)``: SIGKILL that worker once rank 0 reports that round (a dead worker;
    the run goes on with the others); ``restart``: then start it again at once, as a supervisor
    would (it rejoins the job where the job is). ``kernel_slots``: the job's slots in the kernel
    (0: every chunk in the daemon's user-space path; None: the daemon's choice). ``precision``: the
    job's bits a contribution value (None: 32); a narrow job's workers use error feedback with error
    reset every ``error_reset`` rounds (None: the client's default) unless ``feedback`` is False.
    ``corrupt=(rank, round, scale)``: that worker sends its step times ``scale`` from that round on
    (a faulty member; it may then fail, refused by a quarantine); ``job_options``: more of the
    job's keys (``aggctl jobs create``'s: max_abs and quarantine_after, a per-member bound;
    combine and score_after, a robust job)."""
    if isinstance(scenario, str):
        scenario = SCENARIOS[scenario]
    world = params.workers
    straggler = world - 1
    text = strategy_text(strategy, world)
    job = None
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": lab.worker_ifname}
    summaries = {}

    killed: dict[int, float] = {}

    def on_line(rank: int, rec: dict) -> None:
        if rec.get("summary"):
            rec["_at"] = time.monotonic()
            summaries[rank] = rec
        if kill and rank == 0 and not killed and rec.get("round", -1) >= kill[1]:
            victim = workers.procs[kill[0]]
            victim.send_signal(signal.SIGKILL)
            killed[kill[0]] = rec["t"]
            if restart:
                victim.wait()
                workers.start(lab.worker_ns(kill[0]), worker_argv(params, kill[0], scenario, straggler) + extra(kill[0]))
        if on_record:
            on_record(rank, rec)

    def rank0_done() -> bool:
        """Rank 0 has reported its summary and the others have had 10 s to drain."""
        return 0 in summaries and time.monotonic() > summaries[0]["_at"] + 10

    def faulty(rank: int) -> list[str]:
        if corrupt is None or rank != corrupt[0]:
            return []
        return ["--corrupt-from", str(corrupt[1]), "--corrupt-scale", str(corrupt[2])]

    workers = LabProcesses(lab, "training workers", on_record=on_line, env=env, stderr_lines=400)
    try:
        if strategy == "gloo":
            init = f"tcp://{lab.worker_ip(0)}:{GLOO_PORT}"
            extra = lambda rank: ["--gloo", init, "--world", str(world)]  # noqa: E731
        else:
            if daemon is None:
                raise ValueError(f"strategy {strategy} needs a LabDaemon")
            name = f"{DYNAMIC_PREFIX if strategy == 'dynamic' else 'st'}-{scenario.name}-{strategy}" \
                   f"{tag}-{secrets.token_hex(2)}"
            job = daemon.call("jobs.create", name=name, world=world, strategy=text,
                              **({} if kernel_slots is None else {"kernel_slots": kernel_slots}),
                              **({} if precision is None else {"precision": precision}),
                              **(job_options or {}))
            if on_job:
                on_job(job)
            narrow = ["--feedback", "on" if feedback else "off"] + \
                ([] if error_reset is None else ["--error-reset", str(error_reset)])
            extra = lambda rank: ["--server", f"{lab.agg_ip}:{job['port']}",  # noqa: E731
                                  "--bind", f"{lab.worker_ip(rank)}:41000", "--job", job["name"],
                                  "--token", job["token"], *narrow, *faulty(rank)]
        for rank in range(world):
            workers.start(lab.worker_ns(rank), worker_argv(params, rank, scenario, straggler) + extra(rank))
        # every worker done, or rank 0 done and the others given their time
        runs = workers.wait(params.timeout_s, until=rank0_done)
        errors = {r.rank: r.stderr[-20000:] for r in runs}
        failed = [r for r in runs if r.returncode not in (0, None) and r.rank not in summaries
                  and r.rank not in killed and (corrupt is None or r.rank != corrupt[0])]
        if failed:
            raise RuntimeError("\n".join(f"worker {r.rank} failed ({r.returncode}):\n{errors[r.rank][-1500:]}"
                                         for r in failed) + _job_state(daemon, job))
        records = {r.rank: [x for x in r.records if not x.get("summary")] for r in runs}
        decisions, members = [], []
        if job is not None:
            view = daemon.call("workers", job=job["name"])
            decisions, members = (view.get("policy") or {}).get("decisions", []), view["workers"]
    finally:
        workers.kill()
        if job is not None:
            try:
                daemon.call("jobs.delete", job=job["name"])
            except ControlError:
                pass
    if 0 not in summaries:
        raise RuntimeError(f"{strategy}/{scenario.name}: rank 0 did not finish: {errors.get(0, '')[-3000:]}")
    evals = [r for r in records[0] if "accuracy" in r]
    curve = [(round(r["t"], 4), r["accuracy"]) for r in evals]
    rounds_curve = [(round(r["t"], 4), r["round"]) for r in evals]
    seen: list[tuple[float, str]] = []
    for r in evals:
        if not seen or seen[-1][1] != r["strategy"]:
            seen.append((round(r["t"], 4), r["strategy"]))
    ttt = next((r["t"] for r in evals if r["accuracy"] >= params.target), None)
    s0 = summaries[0]
    return RunResult(scenario.name, strategy, text, params.target, ttt, s0["final_accuracy"], s0["seconds"],
                     s0["rounds"], curve, rounds_curve, seen, decisions,
                     [{k: s.get(k) for k in ("rank", "seconds", "rounds", "steps", "results", "final_accuracy",
                                             "drained", "params_sha")} for _, s in sorted(summaries.items())],
                     next(iter(killed.values()), None),
                     next((r["round"] for r in evals if r["accuracy"] >= params.target), None), members)

