"""PyTorch DDP training under torchrun in a lab: one ``torchrun --nnodes N --nproc-per-node 1``
agent per worker namespace, each running ``aggd.training.torch_train``; shared by the tests in
tests/train and ``aggctl bench train``.

The agents meet at a c10d rendezvous hosted by worker 0's agent (``--rdzv-endpoint`` on worker 0's
address, ``is_host`` said explicitly: every namespace shares the host name, so torch's guess from
it would be wrong) and each gives its namespace's address as ``--local-addr``; gloo binds the
namespace's interface (``GLOO_SOCKET_IFNAME``). For ``--comm aggd-hook`` (and ``aggd``) ``run``
creates the aggd job through the lab's daemon (``aggd.lab.daemon.LabDaemon``, XDP on the
aggregator's interface in native or generic mode: ``labtrain.lab_daemon(lab, mode=...)``), passes it in
``AGGD_SERVER``, ``AGGD_JOB``, ``AGGD_TOKEN`` and ``AGGD_BIND``, collects every rank's record and
deletes the job. ``kernel_slots=0`` puts every chunk of the job in the daemon's user-space path.
"""
from __future__ import annotations

import itertools
import json
import os
import secrets
import shutil
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np

from aggd.daemon.control import ControlError
from aggd.lab.daemon import LabDaemon
from aggd.lab.namespaces import Lab
from aggd.lab.processes import LabProcesses

RDZV_PORT = 29400
#: the port a worker's aggd client binds (the namespace's address)
CLIENT_PORT = 41000
_ports = itertools.count()


@dataclass(frozen=True)
class TorchRun:
    """One torchrun training run's settings (``torch_train``'s options)."""
    model: str = "cnn"
    steps: int = 30
    comm: str = "gloo"                      #: gloo, aggd-hook or aggd
    strategy: str = "sync"                  #: the aggd job's strategy (ignored for gloo)
    bucket_cap_mb: float | None = None
    batch: int = 32
    lr: float | None = None
    momentum: float = 0.0
    seed: int = 0
    eval_every: int = 10
    kernel_slots: int | None = None         #: the job's kernel slots (0: all in user space)
    slots: int | None = None                #: the job's slot pool (None: the daemon's default)
    precision: int | None = None            #: the job's bits a contribution value (None: 32)
    max_restarts: int = 0
    ckpt_every: int = 10
    die_at_step: int | None = None          #: that rank SIGKILLs itself there, first attempt only
    die_rank: int = 1
    slow_rank: int | None = None            #: that rank sleeps ``slow_s`` before every step
    slow_s: float = 0.0
    timeout_s: float = 240.0


@dataclass
class TorchResult:
    run: TorchRun
    records: list[dict]                     #: every rank's record, by rank
    job: dict | None = None                 #: the daemon's jobs.create answer
    job_after: dict | None = None           #: the job as ``workers`` showed it before deletion
    stdout: list[dict] = field(default_factory=list)

    def params(self, rank: int = 0) -> np.ndarray:
        return np.load(self.records[rank]["params_path"])


def torchrun_argv(lab: Lab, node: int, run: TorchRun, rdzv: tuple[str, int], rdzv_id: str, out: str,
                  ckpt_dir: str) -> list[str]:
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(lab.workers), "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{rdzv[0]}:{rdzv[1]}", "--rdzv-id", rdzv_id,
            "--rdzv-conf", f"is_host={'true' if node == 0 else 'false'}", "--local-addr", lab.worker_ip(node),
            "--max-restarts", str(run.max_restarts), "--monitor-interval", "0.5",
            "-m", "aggd.training.torch_train", "--model", run.model, "--steps", str(run.steps),
            "--comm", run.comm, "--strategy", run.strategy if run.comm != "gloo" else "",
            "--batch", str(run.batch), "--momentum", str(run.momentum), "--seed", str(run.seed),
            "--eval-every", str(run.eval_every), "--out", out, "--ckpt-dir", ckpt_dir,
            "--ckpt-every", str(run.ckpt_every)]
    if run.bucket_cap_mb is not None:
        argv += ["--bucket-cap-mb", str(run.bucket_cap_mb)]
    if run.lr is not None:
        argv += ["--lr", str(run.lr)]
    if run.die_at_step is not None:
        argv += ["--die-at-step", str(run.die_at_step), "--die-rank", str(run.die_rank)]
    if run.slow_rank is not None:
        argv += ["--slow-rank", str(run.slow_rank), "--slow-seconds", str(run.slow_s)]
    return argv


def run(lab: Lab, daemon: LabDaemon | None, run: TorchRun, *, outdir: str | os.PathLike,
        on_record: Callable[[dict], None] | None = None, on_job: Callable[[dict], None] | None = None,
        tag: str = "") -> TorchResult:
    """Train ``run`` on every worker of ``lab``, its records and checkpoints in ``outdir`` (the
    caller's: ``TorchResult.params`` reads the records' files from it); ``on_record(line)`` sees every
    progress line (a dict with ``rank`` and ``step``, ``ready`` or ``done``), ``on_job(job)`` the
    daemon's ``jobs.create`` answer before the agents start. RuntimeError (with their stderr) when an
    agent fails or a rank writes no record."""
    world = lab.workers
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_dir = out / "ckpt"
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    ckpt_dir.mkdir()
    for old in out.glob("rank*.json"):
        old.unlink()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": lab.worker_ifname,
           "TORCH_CPP_LOG_LEVEL": "ERROR", "PYTHONUNBUFFERED": "1",
           # the workers' store: a new TCPStore on rank 0's --local-addr for every rendezvous round;
           # the agents' shared store keeps keys under attempt_{TORCHELASTIC_RESTART_COUNT}, which
           # differs between the failed node and the others after a restart, and their gloo mesh
           # then read stale addresses (connection refused)
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    job = job_after = None
    lines: list[dict] = []

    def on_line(_node: int, rec: dict) -> None:
        lines.append(rec)
        if on_record:
            on_record(rec)

    # the agents' temporary folders (torchrun makes a torchelastic_* one in TMPDIR and leaves it),
    # removed after the run; short, as a Unix socket's path in it must be
    scratch = tempfile.mkdtemp(prefix="aggd-torchrun-")
    env["TMPDIR"] = scratch
    procs = LabProcesses(lab, f"torchrun agents ({run.comm} {run.model})", on_record=on_line, env=env,
                         stderr_lines=None)
    try:
        aggd_vars: dict[str, str] = {}
        if run.comm != "gloo":
            if daemon is None:
                raise ValueError(f"--comm {run.comm} needs a LabDaemon")
            name = f"torch-{run.model}-{run.strategy.replace(':', '')}{tag}-{secrets.token_hex(2)}"
            job = daemon.call("jobs.create", name=name, world=world, strategy=run.strategy,
                              **({} if run.kernel_slots is None else {"kernel_slots": run.kernel_slots}),
                              **({} if run.slots is None else {"slots": run.slots}),
                              **({} if run.precision is None else {"precision": run.precision}))
            if on_job:
                on_job(job)
            # a JOIN waits for the daemon's user-space thread: on a loaded two-core lab host that took
            # over the backend's default 10 s once (a CI run)
            aggd_vars = {"AGGD_SERVER": f"{lab.agg_ip}:{job['port']}", "AGGD_JOB": job["name"],
                         "AGGD_TOKEN": job["token"], "AGGD_JOIN_TIMEOUT": "60"}
        rdzv = (lab.worker_ip(0), RDZV_PORT + next(_ports) % 500)
        rdzv_id = f"aggd-{secrets.token_hex(4)}"
        for node in range(world):
            node_env = {**aggd_vars, **({"AGGD_BIND": f"{lab.worker_ip(node)}:{CLIENT_PORT}"} if aggd_vars else {})}
            argv = ["env", *(f"{k}={v}" for k, v in node_env.items()),
                    *torchrun_argv(lab, node, run, rdzv, rdzv_id, str(out / "rank{rank}.json"), str(ckpt_dir))]
            procs.start(lab.worker_ns(node), argv)
        try:
            runs = procs.wait(run.timeout_s)
        except TimeoutError as exc:
            procs.kill()
            for r in procs.wait(10):
                (out / f"agent{r.rank}.stderr").write_text(r.stderr)
            (out / "lines.json").write_text(json.dumps(lines))
            raise TimeoutError(f"{exc}; agents' stderr and progress lines in {out}") from None
        for r in runs:  # every agent's stderr (with its worker's) beside the records
            (out / f"agent{r.rank}.stderr").write_text(r.stderr)
        failed = [r for r in runs if r.returncode != 0]
        if failed:
            raise RuntimeError("\n".join(f"torchrun agent in {lab.worker_ns(r.rank)} failed ({r.returncode}; "
                                         f"{out}/agent{r.rank}.stderr):\n{_worker_error(r.stderr)}" for r in failed))
        records = []
        for rank in range(world):
            path = out / f"rank{rank}.json"
            if not path.exists():
                raise RuntimeError(f"rank {rank} wrote no record; agents' stderr:\n"
                                   + "\n".join(r.stderr[-1500:] for r in runs))
            records.append(json.loads(path.read_text()))
        if job is not None:
            job_after = daemon.call("workers", job=job["name"])
    finally:
        procs.kill()
        shutil.rmtree(scratch, ignore_errors=True)
        if job is not None:
            try:
                daemon.call("jobs.delete", job=job["name"])
            except ControlError:
                pass
    return TorchResult(run, records, job, job_after, lines)


def _worker_error(stderr: str) -> str:
    """The worker's own traceback (torchrun's summary after it says little), or the tail."""
    at = stderr.find("Traceback (most recent call last)")
    return stderr[at:at + 3000] + "\n...\n" + stderr[-800:] if at >= 0 else stderr[-2500:]


def with_(run_: TorchRun, **changes) -> TorchRun:
    return replace(run_, **changes)
