"""One DDP worker for test_torch_hook (started with torch.multiprocessing.spawn): trains the same
small network twice from the same start on the same shard, once with DDP's own gloo allreduce and
once with the aggd hook (through the test's user-space aggregator), and returns the parameters of
both plus what the bound needs (every bucket it contributed, per step)."""
from __future__ import annotations

import numpy as np

STEPS = 8
LR = 0.5
#: DDP buckets of unequal chunk counts (see train())
BUCKET_CAP_MB = 0.0005


def net(seed: int, dtype):
    import torch
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)).to(dtype)


def batches(rank: int, world: int, steps: int):
    from aggd.training.data import Batches, load_digits
    b = Batches(load_digits(), rank, world, 16, seed=3)
    return [b.next() for _ in range(steps)]


def train(ddp, data, opt):
    import torch
    for x, y in data:
        opt.zero_grad()
        out = ddp(torch.from_numpy(x).to(next(ddp.parameters()).dtype))
        torch.nn.functional.cross_entropy(out.float(), torch.from_numpy(y)).backward()
        opt.step()
    return torch.cat([p.detach().float().reshape(-1) for p in ddp.module.parameters()]).numpy().astype(np.float64)


def worker(rank: int, world: int, init: str, server, job: int, ports: list[int], dtype_name: str, out):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from aggd_client import AggClient
    from aggd_client.torch_hook import register

    dtype = getattr(torch, dtype_name)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    data = batches(rank, world, STEPS)
    try:
        # Buckets of unequal chunk counts (about 330 and 2080 values: 2 and 9 chunks of 256), as
        # real models have: chunks 2..8 sit out every other round. With ~1000-value buckets (4
        # chunks each) every chunk took part in every round and the unequal-size hang went unseen.
        ddp = DDP(net(0, dtype), bucket_cap_mb=BUCKET_CAP_MB)
        gloo = train(ddp, data, torch.optim.SGD(ddp.parameters(), lr=LR))

        ddp = DDP(net(0, dtype), bucket_cap_mb=BUCKET_CAP_MB)
        client = AggClient(tuple(server), job, rank, world, bind=("127.0.0.1", ports[rank]), give_up_after=20)
        state = register(ddp, client)
        sent = []
        orig = state._reduce

        def spy(index, tensor):  # what this rank contributed (as float64), for the bound
            sent.append((index, tensor.detach().float().numpy().astype(np.float64).copy()))
            return orig(index, tensor)

        state._reduce = spy
        aggd = train(ddp, data, torch.optim.SGD(ddp.parameters(), lr=LR))
        state.close()
        client.close()
        out.put((rank, gloo, aggd, sent, state.stats, ddp.module[0].weight.dtype == dtype))
    finally:
        dist.destroy_process_group()


def train_start(dtype_name: str) -> np.ndarray:
    import torch
    m = net(0, getattr(torch, dtype_name))
    return torch.cat([p.detach().float().reshape(-1) for p in m.parameters()]).numpy().astype(np.float64)
