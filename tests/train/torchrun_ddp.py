"""A torchrun training script for the "aggd" backend's launch tests (test_torchrun): DDP on
ddp_run's small network, no comm hook, ``init_process_group(BACKEND)`` (aggd or gloo, the
reference). Every rank writes ``OUT/rank{R}.npz``: the final parameters, what it contributed to
each allreduce (for the bound) and, under aggd, the group's first round and last_round_info.

    torchrun --nproc-per-node 2 tests/train/torchrun_ddp.py --backend aggd --out DIR [--crash RANK:STEP]

``--crash RANK:STEP``: rank RANK exits with status 3 before step STEP on the first attempt
(``TORCHELASTIC_RESTART_COUNT`` 0), so torchrun restarts every worker (``--max-restarts``); the
restarted workers train from the start again, in the same aggd job.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for tests.train.ddp_run

from tests.train import ddp_run  # noqa: E402

STEPS = ddp_run.STEPS


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", required=True, choices=["aggd", "gloo"])
    p.add_argument("--out", required=True)
    p.add_argument("--crash", default=None)
    p.add_argument("--dtype", default="float32")
    a = p.parse_args()

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.set_num_threads(1)
    sent: list[np.ndarray] = []
    if a.backend == "aggd":
        import aggd_client.torch as at
        from aggd_client.torch.process_group import AggdProcessGroup

        orig = AggdProcessGroup.allreduce

        def spy(self, tensors, opts=None):  # what this rank contributes, for the bound
            ts = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
            sent.append(np.concatenate([t.detach().to(torch.float64).reshape(-1).numpy().copy() for t in ts]))
            return orig(self, tensors, opts)

        AggdProcessGroup.allreduce = spy
    dist.init_process_group(a.backend, timeout=datetime.timedelta(seconds=float(os.environ.get("PG_TIMEOUT", "60"))))
    dtype = getattr(torch, a.dtype)
    data = ddp_run.batches(rank, world, STEPS)
    ddp = DDP(ddp_run.net(0, dtype), bucket_cap_mb=ddp_run.BUCKET_CAP_MB)
    opt = torch.optim.SGD(ddp.parameters(), lr=ddp_run.LR)
    crash = tuple(int(v) for v in a.crash.split(":")) if a.crash else None
    step_seconds = []     # how long each step took (a stall shows)
    compute = float(os.environ.get("STEP_DELAY", "0"))   # seconds of "compute" a step: faults land mid-run
    for step, (x, y) in enumerate(data):
        t0 = time.perf_counter()
        time.sleep(compute)
        if crash and attempt == 0 and rank == crash[0] and step == crash[1]:
            print(f"rank {rank}: crashing before step {step} (attempt {attempt})", flush=True)
            os._exit(3)
        opt.zero_grad()
        out = ddp(torch.from_numpy(x).to(dtype))
        torch.nn.functional.cross_entropy(out.float(), torch.from_numpy(y)).backward()
        opt.step()
        step_seconds.append(time.perf_counter() - t0)
    params = torch.cat([p.detach().to(torch.float64).reshape(-1) for p in ddp.module.parameters()]).numpy()
    extra = {}
    if a.backend == "aggd":
        pg = dist.distributed_c10d._get_default_group()
        extra = {"first_round": pg.first_round, "info": json.dumps(at.last_round_info()),
                 "job": pg.job_info.name}
    np.savez(Path(a.out) / f"rank{rank}.npz", params=params, attempt=attempt, world=world,
             sent=np.array(sent, dtype=object), step_seconds=np.array(step_seconds), **extra)
    dist.destroy_process_group()
    print(json.dumps({"rank": rank, "attempt": attempt, "done": True}), flush=True)
    # (gloo's threads once aborted the interpreter's teardown, "terminate called without an active
    # exception", after a finished run: leave without it, everything is written and destroyed)
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
