"""The model with numpy's arithmetic beside the model with the user-space path's numba kernels:
random traffic through both must give the same verdicts, bytes and counters."""
from __future__ import annotations

import dataclasses
import random

from aggd.core.model import NUMPY_ARITHMETIC, AggregatorModel
from aggd.core.strategy import parse, to_entry
from aggd.dataplane.userspace import kernels

from tests.fixtures.scenarios import JOB, job_config
from tests.fixtures.traffic import Traffic


def play_both(text: str, rng: random.Random, chunks, packets: int = 75, userspace: bool = False,
              **job) -> tuple[AggregatorModel, AggregatorModel]:
    """A fresh job (4 members, 2 slots; ``job``: more JobConfig fields) under strategy ``text`` in a
    numpy model and a numba one (``userspace``: the user-space path's model); ``packets`` of random
    traffic of ``chunks`` through both, every verdict compared. Returns (numpy model, numba model)."""
    models = []
    for arith in (NUMPY_ARITHMETIC, kernels.KERNEL_ARITHMETIC):
        m = AggregatorModel(32, userspace=userspace, arithmetic=arith)
        m.add_job(dataclasses.replace(job_config(4, 2, 8), **job))
        m.set_strategy(JOB, [to_entry(parse(text), 0, 0)])
        models.append(m)
    a, b = models
    traffic = Traffic(world=4, slots=2, chunks=chunks, max_chunks=8, window=3, elements=32)
    for _ in range(packets):
        sent = traffic.next(rng.getrandbits(32))
        va = a.process(sent.data, sent.src, sent.now_ns)
        assert va == b.process(sent.data, sent.src, sent.now_ns)
        traffic.observe(sent, va)
    assert a.stats() == b.stats()
    return a, b
