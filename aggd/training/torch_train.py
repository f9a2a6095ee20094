"""Train a PyTorch model with DDP under torchrun: ``python -m aggd.training.torch_train``.

    torchrun --nnodes 4 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        -m aggd.training.torch_train --model cnn --steps 100 --comm aggd-hook --out /tmp/run/{rank}.json

``--model``: ``cnn`` or ``transformer`` (``aggd.training.torch_models``), trained on the digits with
plain SGD (``--momentum`` 0 by default: the bound the tests derive is for plain SGD); every rank
takes ``--batch`` examples a step from its own shard (``aggd.training.data.Batches``).

``--comm`` is the one switch for how gradients are reduced:

* ``gloo``: DDP's own allreduce over a gloo process group (the baseline);
* ``aggd-hook``: a gloo process group (DDP still broadcasts the initial model and checks buckets
  with it) and ``aggd_client.torch_hook`` reducing every gradient bucket through aggd: the worker
  joins the job named by ``AGGD_JOB`` at ``AGGD_SERVER`` (host:port) with ``AGGD_TOKEN``, from
  ``AGGD_BIND`` (host:port, optional); then a gloo barrier, so every member has joined (and a
  restarted one learnt the job's round) before anybody sends;
* ``aggd``: ``import aggd_client.torch`` and ``init_process_group("aggd")`` (the same environment
  variables), DDP with no hook.

Deterministic: the seed fixes the initial model (``torch_models.build``) and every rank's shard and
batches, so a gloo run and an aggd run see the same data in the same order.

Restarts (torchrun ``--max-restarts``): rank 0 saves a checkpoint (model, optimiser, step) every
``--ckpt-every`` steps into ``--ckpt-dir`` (which must start empty); a worker that finds one resumes
from it (every worker restarted by torchrun: the failed node's, whose ``TORCHELASTIC_RESTART_COUNT``
went up, and the others', restarted for the membership change with theirs unchanged).
``--die-at-step S --die-rank R``: rank R SIGKILLs itself before step S, once per run (a marker file
in the checkpoint folder remembers it): a worker killed mid-training, for the fault tests.
``--slow-rank R --slow-seconds T``: rank R sleeps T seconds before every step (a straggler).

Output: one JSON record per rank written to ``--out`` (``{rank}`` in it is replaced, else
``.rankN.json`` is appended), with the final parameters in a ``.npy`` beside it; progress lines
(JSON, ``"step"``) on stdout at every evaluation.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

COMMS = ("gloo", "aggd-hook", "aggd")


def out_path(template: str, rank: int) -> Path:
    if "{rank}" in template:
        return Path(template.replace("{rank}", str(rank)))
    return Path(f"{template}.rank{rank}.json")


def aggd_env() -> tuple[tuple[str, int], str, str, tuple[str, int]]:
    """(server, job, token, bind) from AGGD_SERVER, AGGD_JOB, AGGD_TOKEN, AGGD_BIND."""
    from aggd.core.addresses import host_port

    missing = [k for k in ("AGGD_SERVER", "AGGD_JOB", "AGGD_TOKEN") if not os.environ.get(k)]
    if missing:
        raise RuntimeError(f"--comm aggd-hook needs {', '.join(missing)} in the environment")
    bind = host_port(os.environ["AGGD_BIND"]) if os.environ.get("AGGD_BIND") else ("0.0.0.0", 0)
    return host_port(os.environ["AGGD_SERVER"]), os.environ["AGGD_JOB"], os.environ["AGGD_TOKEN"], bind


def init_comm(comm: str, timeout_s: float):
    """Initialise the process group for ``comm``; returns the aggd client (aggd-hook) or None."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if comm == "aggd":
        try:
            import aggd_client.torch  # noqa: F401  (registers the "aggd" backend)
        except ImportError as exc:
            raise RuntimeError("--comm aggd needs the aggd torch.distributed backend (aggd_client.torch), "
                               f"which this aggd_client does not have ({exc}); use --comm aggd-hook") from exc
        dist.init_process_group("aggd", timeout=timeout)
        return None
    dist.init_process_group("gloo", timeout=timeout)
    if comm == "gloo":
        return None
    from aggd_client import join

    server, job, token, bind = aggd_env()
    client = join(server, int(job) if job.isdigit() else job, dist.get_rank(), token, bind=bind,
                  timeout=float(os.environ.get("AGGD_JOIN_TIMEOUT", "20")), give_up_after=60.0,
                  fast=True)  # training: the kernels' load at start, not in a timed step
    dist.barrier()  # every member has joined before anybody sends a round
    return client


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("cnn", "transformer"), default="cnn")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--comm", choices=COMMS, default="gloo")
    ap.add_argument("--bucket-cap-mb", type=float, default=None, help="DDP's bucket_cap_mb (default: DDP's)")
    ap.add_argument("--strategy", default="", help="the aggd job's strategy (recorded only)")
    ap.add_argument("--out", required=True, help="record path ({rank} replaced)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=None, help="default: 0.05 (cnn), 0.1 (transformer)")
    ap.add_argument("--momentum", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--ckpt-dir", default=None)
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--die-at-step", type=int, default=None)
    ap.add_argument("--die-rank", type=int, default=1)
    ap.add_argument("--slow-rank", type=int, default=None)
    ap.add_argument("--slow-seconds", type=float, default=0.0)
    ap.add_argument("--timeout", type=float, default=120.0, help="process group timeout (s)")
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from aggd.training import torch_models
    from aggd.training.data import Batches, load_digits

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    t_start = time.monotonic()
    client = init_comm(args.comm, args.timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    lr = args.lr if args.lr is not None else (0.05 if args.model == "cnn" else 0.1)

    data = load_digits(seed=args.seed)
    net = torch_models.build(args.model, args.seed, data.classes)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=args.momentum)
    batches = Batches(data, rank, world, args.batch, args.seed)
    start_step = 0
    dest_dir = out_path(args.out, rank).parent
    dest_dir.mkdir(parents=True, exist_ok=True)
    ckpt = Path(args.ckpt_dir) / "ckpt.pt" if args.ckpt_dir else None
    # resume whenever there is a checkpoint: torchrun restarts the workers of nodes that did not fail
    # with TORCHELASTIC_RESTART_COUNT unchanged (a membership change is not a failure)
    if ckpt is not None and ckpt.exists():
        saved = torch.load(ckpt, weights_only=False)
        net.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        start_step = saved["step"]
    for _ in range(start_step):  # the same batches a run without the restart would see from here
        batches.next()

    ddp_kwargs = {} if args.bucket_cap_mb is None else {"bucket_cap_mb": args.bucket_cap_mb}
    model = DDP(net, **ddp_kwargs)
    hook_state = None
    bucket_log: list[list[int]] = []   # per step: the buckets' sizes (values), in reduction order
    if client is not None:
        from aggd_client.torch_hook import register
        hook_state = register(model, client)
        orig = hook_state.submit

        def counted(index, tensor):
            bucket_log[-1].append(int(tensor.numel()))
            return orig(index, tensor)
        hook_state.submit = counted

    # max |local gradient| of every step (before any reduction): what the quantisation bound needs
    grad_max: list[float] = []
    for p in net.parameters():
        p.register_hook(lambda g: grad_max.__setitem__(-1, max(grad_max[-1], float(g.abs().max()))) or None)

    x_test, y_test = data.x_test, data.y_test
    step_times, curve = [], []
    t0 = time.monotonic()

    def evaluate(step: int) -> None:
        net.eval()
        acc = torch_models.accuracy(net, x_test, y_test)
        net.train()
        curve.append([step, round(time.monotonic() - t0, 4), acc])
        print(json.dumps({"rank": rank, "step": step, "t": curve[-1][1], "accuracy": acc, "loss": loss,
                          "restarts": restarts}), flush=True)

    loss = float("nan")
    print(json.dumps({"rank": rank, "ready": True, "start_step": start_step, "restarts": restarts,
                      "startup_s": round(time.monotonic() - t_start, 3)}), flush=True)
    for step in range(start_step, args.steps):
        if args.die_at_step is not None and step == args.die_at_step and rank == args.die_rank:
            marker = Path(args.ckpt_dir or dest_dir) / f"died-rank{rank}"
            if not marker.exists():          # once per run (the marker outlives the process)
                marker.touch()
                os.kill(os.getpid(), signal.SIGKILL)
        if rank == args.slow_rank:
            time.sleep(args.slow_seconds)
        x, y = batches.next()
        ts = time.monotonic()
        grad_max.append(0.0)
        bucket_log.append([])
        opt.zero_grad()
        out = model(torch.from_numpy(x))
        lossv = torch.nn.functional.cross_entropy(out, torch.from_numpy(y))
        lossv.backward()
        opt.step()
        step_times.append(time.monotonic() - ts)
        loss = float(lossv)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            evaluate(step + 1)
        if ckpt is not None and rank == 0 and (step + 1) % args.ckpt_every == 0:
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"step": step + 1, "model": net.state_dict(), "opt": opt.state_dict()}, tmp)
            tmp.replace(ckpt)
    seconds = time.monotonic() - t0
    if hook_state is not None:
        hook_state.close()
    dist.barrier()
    params = torch_models.flat_params(net)
    dest = out_path(args.out, rank)
    dest.parent.mkdir(parents=True, exist_ok=True)
    npy = dest.with_suffix(".npy")
    np.save(npy, params)
    logging_data = model._get_ddp_logging_data()
    steps_run = len(step_times)
    record = {
        "rank": rank, "world": world, "model": args.model, "comm": args.comm, "strategy": args.strategy,
        "n_params": int(params.size), "steps": args.steps, "start_step": start_step, "steps_run": steps_run,
        "restarts": restarts, "resumed": start_step > 0, "batch": args.batch, "lr": lr, "momentum": args.momentum, "seed": args.seed,
        "bucket_cap_mb": args.bucket_cap_mb,
        "ddp_buckets": {k: logging_data.get(k) for k in ("bucket_sizes", "num_buckets_reduced", "rebuilt_bucket_sizes")
                        if k in logging_data},
        "hook_buckets": bucket_log, "hook_stats": None if hook_state is None else hook_state.stats,
        "step_times": step_times, "seconds": seconds,
        "samples_per_s": args.batch * steps_run / seconds if seconds > 0 else None,
        "accuracy": curve, "final_accuracy": curve[-1][2] if curve else None, "grad_max": grad_max,
        "params_sha": hashlib.sha256(params.tobytes()).hexdigest()[:16], "params_path": str(npy),
        "aggd_round": None if client is None else client.round,
        "client_stats": None if client is None else dict(client.stats),
    }
    tmp = dest.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(dest)
    print(json.dumps({"rank": rank, "done": True, "seconds": seconds, "final_accuracy": record["final_accuracy"]}),
          flush=True)
    if client is not None:
        client.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # Leave without the interpreter's finalization (everything is written and destroyed): under
    # --comm gloo, gloo's worker thread may still be freeing DDP's last allreduce, which takes the
    # GIL, and during finalization that aborted the process ("terminate called without an active
    # exception", PyTorch's: docs/pytorch.md, "Exit")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
