"""Worker programs for the "aggd" process group's tests (test_torch_backend), started with
torch.multiprocessing.spawn: each sets its AGGD_* environment, calls
``init_process_group("aggd")`` and reports what it saw on a queue as plain data."""
from __future__ import annotations

import os
import time
import traceback

import numpy as np

SIZES = (1, 362, 2048, 362, 5000)
DTYPES = ("float32", "float16", "bfloat16", "float64")


def contribution(rank: int, size: int, dtype: str, call: int):
    """What ``rank`` contributes to call ``call`` (a tensor of ``dtype``)."""
    import torch
    rng = np.random.default_rng(1000 * call + rank)
    x = rng.standard_normal(size) * (rank + 1) * (1 + call % 3)
    return torch.tensor(x, dtype=torch.float32).to(getattr(torch, dtype))


def _as64(t) -> np.ndarray:
    import torch
    return t.detach().to(torch.float64).numpy().reshape(-1).copy()  # (float64: no view of t)


def _init(rank: int, world: int, init: str, env: dict, timeout_s: float = 60.0):
    import datetime

    import torch
    import torch.distributed as dist

    import aggd_client.torch  # noqa: F401 - registers "aggd"

    os.environ.update(env)
    torch.set_num_threads(1)
    dist.init_process_group("aggd", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def collectives(rank: int, world: int, init: str, env: dict, out) -> None:
    """Every dtype, SUM and AVG, unequal sizes; several tensors in one call; async overlap;
    refusals; the collectives delegated to gloo; last_round_info."""
    try:
        import torch
        import torch.distributed as dist

        import aggd_client.torch as at

        _init(rank, world, init, env)
        report: dict = {"rank": rank, "calls": [], "refusals": {}}
        call = 0
        for dtype in DTYPES:
            for size in SIZES:
                for op in ("SUM", "AVG"):
                    t = contribution(rank, size, dtype, call)
                    sent = _as64(t)
                    dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
                    assert t.dtype == getattr(torch, dtype) and t.shape == (size,)
                    report["calls"].append({"call": call, "dtype": dtype, "size": size, "op": op, "sent": sent,
                                            "got": _as64(t), "info": at.last_round_info()})
                    call += 1
        # two tensors (of two shapes) in one call: one round
        pg = dist.distributed_c10d._get_default_group()
        a, b = contribution(rank, 300, "float32", 900), contribution(rank, 70, "float32", 901).reshape(7, 10)
        report["pair_sent"] = (_as64(a), _as64(b))
        pg.allreduce([a, b]).wait()
        report["pair_got"] = (_as64(a), _as64(b))
        report["pair_info"] = at.last_round_info()

        # async: rank 1 joins the round a second late; rank 0's call returns at once
        x = torch.full((4000,), float(rank + 1))
        if rank == 1:
            time.sleep(1.0)
        t0 = time.monotonic()
        work = dist.all_reduce(x, async_op=True)
        report["async_returned_after"] = time.monotonic() - t0
        report["async_completed_at_return"] = work.is_completed()
        y = torch.full((10,), float(rank + 1))
        work2 = dist.all_reduce(y, op=dist.ReduceOp.AVG, async_op=True)  # queued behind the first
        work.wait()
        work2.wait()
        report["async_waited"] = time.monotonic() - t0
        report["async_x"] = _as64(x)[:3]
        report["async_y"] = _as64(y)[:3]
        report["async_future"] = _as64(work.get_future().wait()[0])[:3]

        # refused, with a message naming what
        for name, fn in (("max", lambda: dist.all_reduce(torch.ones(4), op=dist.ReduceOp.MAX)),
                         ("int", lambda: dist.all_reduce(torch.ones(4, dtype=torch.int64))),
                         ("meta", lambda: dist.all_reduce(torch.ones(4, device="meta"))),
                         ("mixed", lambda: dist.distributed_c10d._get_default_group().allreduce(
                             [torch.ones(3), torch.ones(3, dtype=torch.float64)]).wait())):
            try:
                fn()
                report["refusals"][name] = None
            except Exception as exc:  # noqa: BLE001
                report["refusals"][name] = f"{type(exc).__name__}: {exc}"

        # delegated to gloo
        z = torch.full((5,), float(rank))
        dist.broadcast(z, src=1)
        report["broadcast"] = _as64(z)
        dist.barrier()
        parts = [torch.zeros(3) for _ in range(world)]
        dist.all_gather(parts, torch.full((3,), float(rank)))
        report["all_gather"] = [_as64(p) for p in parts]
        flat = torch.zeros(3 * world)
        dist.all_gather_into_tensor(flat, torch.full((3,), float(rank + 10)))
        report["all_gather_into_tensor"] = _as64(flat)
        objs = [None] * world
        dist.all_gather_object(objs, {"rank": rank})
        report["all_gather_object"] = objs
        report["backend"] = dist.get_backend()
        # still in step after all that
        w = torch.full((600,), 1.5)
        dist.all_reduce(w)
        report["after"] = _as64(w)[:2]
        dist.destroy_process_group()
        out.put(("ok", rank, report))
    except BaseException:  # noqa: BLE001
        out.put(("error", rank, traceback.format_exc()))


def failing(rank: int, world: int, init: str, env: dict, out) -> None:
    """Rank 1 never reduces: rank 0's allreduce must fail with the group's timeout (2 s), from
    wait() and from dist.all_reduce, and later allreduces fail at once."""
    try:
        import torch
        import torch.distributed as dist

        _init(rank, world, init, env, timeout_s=3.0)
        report: dict = {"rank": rank}
        if rank == 0:
            t0 = time.monotonic()
            work = dist.all_reduce(torch.ones(1000), async_op=True)
            try:
                work.wait()
                report["wait"] = None
            except Exception as exc:  # noqa: BLE001
                report["wait"] = f"{type(exc).__name__}: {exc}"
            report["waited"] = time.monotonic() - t0
            t0 = time.monotonic()
            try:
                dist.all_reduce(torch.ones(10))
                report["next"] = None
            except Exception as exc:  # noqa: BLE001
                report["next"] = f"{type(exc).__name__}: {exc}"
            report["next_took"] = time.monotonic() - t0
        out.put(("ok", rank, report))
        os._exit(0)  # rank 1 never reduced: no orderly shutdown
    except BaseException:  # noqa: BLE001
        out.put(("error", rank, traceback.format_exc()))
        os._exit(1)


def ddp_timeout(rank: int, world: int, init: str, env: dict, out) -> None:
    """DDP over "aggd"; after two steps rank 1 stops (never reduces again): rank 0's backward must
    raise the group's timeout as a RuntimeError (no crash, no hang), and so must the next one."""
    try:
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP

        _init(rank, world, init, env, timeout_s=3.0)
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.ReLU(), torch.nn.Linear(30, 4)),
                    bucket_cap_mb=0.001)
        report: dict = {"rank": rank, "steps": []}
        for step in range(4):
            if rank == 1 and step == 2:
                break
            t0 = time.monotonic()
            try:
                model(torch.randn(8, 20)).sum().backward()
                report["steps"].append((step, None, time.monotonic() - t0))
            except Exception as exc:  # noqa: BLE001
                report["steps"].append((step, f"{type(exc).__name__}: {exc}", time.monotonic() - t0))
        out.put(("ok", rank, report))
        os._exit(0)
    except BaseException:  # noqa: BLE001
        out.put(("error", rank, traceback.format_exc()))
        os._exit(1)
