"""Real ``torchrun`` launches of tests/train/torchrun_ddp.py for the "aggd" backend's tests: in a lab's
worker namespaces against the lab's aggd daemon (one torchrun per node, a c10d rendezvous on the
first worker's address), or in the root namespace with gloo (the reference). Plus what the
comparison needs: every rank's output and the bound on |aggd - gloo| for DDP's training."""
from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from aggd_client import quant

from tests.harness.allreduce_bound import ulp

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
SCRIPT = str(ROOT / "tests" / "train" / "torchrun_ddp.py")
RDZV_PORT = 29411


@dataclass
class Launch:
    returncodes: list[int]
    output: str           #: every torchrun's stdout and stderr, node by node
    ranks: list[dict]     #: rank -> its npz as a dict (empty when a rank wrote none)


def _env(extra: dict[str, str]) -> dict[str, str]:
    path = [str(ROOT), str(ROOT / "client"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p), "OMP_NUM_THREADS": "1",
            "PYTHONFAULTHANDLER": "1", **extra}


def load(out: Path, world: int) -> list[dict]:
    ranks = []
    for r in range(world):
        f = out / f"rank{r}.npz"
        ranks.append(dict(np.load(f, allow_pickle=True)) if f.exists() else {})
    return ranks


def _collect(procs: list[subprocess.Popen], timeout: float) -> tuple[list[int], str]:
    deadline = time.monotonic() + timeout
    outputs = []
    for i, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            for q in procs:
                if q.poll() is None:
                    q.kill()
            out, _ = p.communicate()
            out = (out or "") + f"\n[node {i}: killed after {timeout:.0f} s]"
        outputs.append(f"--- node {i} ---\n{out}")
    return [p.returncode for p in procs], "\n".join(outputs)


def gloo_reference(out: Path, world: int = 2, timeout: float = 180) -> Launch:
    """The same training with gloo: one torchrun --standalone in the root namespace."""
    out.mkdir(parents=True, exist_ok=True)
    argv = [TORCHRUN, "--standalone", "--nproc-per-node", str(world), SCRIPT, "--backend", "gloo",
            "--out", str(out)]
    p = subprocess.Popen(argv, env=_env({"GLOO_SOCKET_IFNAME": "lo"}), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    codes, text = _collect([p], timeout)
    return Launch(codes, text, load(out, world))


def lab_launch(lab, server: str | list[str], job: dict, out: Path, *, nodes: int, nproc_per_node: int,
               max_restarts: int = 0, crash: str | None = None, timeout: float = 300,
               settings: dict[str, str] | None = None) -> Launch:
    """torchrun on ``nodes`` worker namespaces of ``lab`` (``nproc_per_node`` workers each) training
    with ``init_process_group("aggd")`` in ``job`` (the daemon's ``jobs.create`` answer) at
    ``server`` (host:port; several, comma-separated: a sharded job; a list: each node's own, a rack
    job's aggregator); ``settings``: more AGGD_* variables."""
    out.mkdir(parents=True, exist_ok=True)
    world = nodes * nproc_per_node
    endpoint = f"{lab.worker_ip(0)}:{RDZV_PORT}"
    run_id = secrets.token_hex(4)
    procs = []
    for node in range(nodes):
        ip = lab.worker_ip(node)
        argv = [TORCHRUN, "--nnodes", str(nodes), "--nproc-per-node", str(nproc_per_node),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id,
                "--rdzv-conf", f"is_host={int(node == 0)},join_timeout=60",
                "--local-addr", ip, "--max-restarts", str(max_restarts), "--monitor-interval", "0.5",
                SCRIPT, "--backend", "aggd", "--out", str(out)]
        if crash:
            argv += ["--crash", crash]
        env = _env({"AGGD_SERVER": server if isinstance(server, str) else server[node], "AGGD_JOB": job["name"], "AGGD_TOKEN": job["token"],
                    "AGGD_BIND": ip, "AGGD_GIVE_UP_AFTER": "40", "GLOO_SOCKET_IFNAME": lab.worker_ifname,
                    "PG_TIMEOUT": "120", **(settings or {})})
        procs.append(lab.run(lab.worker_ns(node), argv, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, cwd=ROOT))
        if node == 0:
            time.sleep(1.0)  # the rendezvous host first
    codes, text = _collect(procs, timeout)
    return Launch(codes, text, load(out, world))


def ddp_bound(sent: list[list[np.ndarray]], elements: int, steps: int, lr: float, params: np.ndarray,
              dtype: str = "float32") -> float:
    """Bound on max |aggd - gloo| over the parameters after SGD on DDP's allreduces: for every
    allreduce (``sent[rank][i]``: what each rank contributed, DDP's gradient divided by the world),
    aggd's sum is within ``quant.error_bound`` of the exact sum plus the rounding of each side's
    sum to the dtype; the SGD step moves a parameter by ``lr`` times its bucket's error and rounds
    it once (an ulp). Summing every allreduce's worst error (not each step's) covers a parameter in
    any bucket of each step: looser than test_torch_hook's per-step bound by the buckets per step."""
    world = len(sent)
    total = 0.0
    for contribs in zip(*sent):
        size = contribs[0].size
        assert all(c.size == size for c in contribs)
        n = -(-size // elements)
        pads = np.zeros((world, n * elements))
        for i, c in enumerate(contribs):
            pads[i, :size] = np.abs(c)
        # a daemon job's members quantise for its headroom (docs/protocol.md, "Quantisation")
        exps = np.min([quant.chunk_exponents(p.reshape(n, elements).max(axis=1), world, world * quant.MAX_HEADROOM)
                       for p in pads], axis=0)
        q_err = np.repeat(quant.error_bound(world, exps), elements)[:size]
        rounding = 2 * ulp(np.sum(pads, axis=0)[:size], dtype)
        total += lr * float((q_err + rounding).max())
    return total + steps * 2 * float(ulp(np.abs(params).max(), dtype))
