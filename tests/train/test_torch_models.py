"""The PyTorch models of aggd.training.torch_models: sizes, determinism, and the DDP buckets they
give (a one-process gloo group: bucket assignment does not depend on the world size)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from aggd.training import torch_models
from aggd.training.data import Batches, load_digits


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "s"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def buckets(name: str, cap_mb: float | None, steps: int = 3) -> tuple[list[list[int]], str]:
    """(bucket sizes of every step, in values, as DDP hands them to a comm hook; DDP's own
    ``rebuilt_bucket_sizes``)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    model = DDP(torch_models.build(name), **({} if cap_mb is None else {"bucket_cap_mb": cap_mb}))
    seen: list[list[int]] = []

    def counting(state, bucket):
        seen[-1].append(bucket.buffer().numel())
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, counting)
    data = load_digits()
    b = Batches(data, 0, 1, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        seen.append([])
        x, y = b.next()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        opt.step()
    return seen, model._get_ddp_logging_data().get("rebuilt_bucket_sizes", "")


@pytest.mark.parametrize("name", torch_models.MODELS)
def test_models_are_a_few_hundred_thousand_parameters_and_deterministic(name):
    a, b = torch_models.build(name, 3), torch_models.build(name, 3)
    assert 300_000 <= torch_models.n_params(a) <= 1_000_000
    assert np.array_equal(torch_models.flat_params(a), torch_models.flat_params(b))
    assert not np.array_equal(torch_models.flat_params(a), torch_models.flat_params(torch_models.build(name, 4)))


@pytest.mark.parametrize("name", torch_models.MODELS)
def test_ddp_buckets_default_cap_two_unequal_small_cap_many(group, name):
    n = torch_models.n_params(torch_models.build(name))
    seen, rebuilt = buckets(name, None)
    # step 0: one bucket (torch 2.13 buckets nothing before it knows the gradients' order); then
    # a first bucket of at most 1 MiB (closed by the tensor that crosses it) and the rest
    assert seen[0] == [n]
    assert len(seen[1]) == 2 and seen[1] == seen[2] and sum(seen[1]) == n, seen
    assert seen[1][0] != seen[1][1]
    assert rebuilt.replace(" ", "") == ",".join(str(4 * s) for s in seen[1])
    small, _ = buckets(name, 0.02)                # a bucket holds whole tensors: the cnn has 14
    assert len(small[1]) >= (6 if name == "cnn" else 9) and len(set(small[1])) >= 3 and sum(small[1]) == n, small[1]
    big, _ = buckets(name, 100.0)                 # what quorum and async need from the hook
    assert big[1] == [n]
