"""A script for test_torch_exit: aggd's reduction thread (the DDP hook's, ``hook``, or the backend's,
``backend``) completes the process's last future and the main thread falls off the end of the script
at once, as a training script does after DDP's last backward. Before the threads were stopped at
exit (aggd_client.torch.shutdown) this aborted about 3 runs in 5 with "terminate called without an
active exception" after printing ``ok``.

    python tests/train/exit_race.py hook|backend
"""
from __future__ import annotations

import sys

import numpy as np
import torch


class Handle:
    def __init__(self, x):
        self.x, self.round, self.n_contrib, self.strategy = x, 0, np.ones(1), None

    def wait(self, timeout=None):
        return self.x


class DoublingClient:
    """What the hook and the reducer ask of an AggClient, answering at once (twice the input)."""
    round, strategy = 0, "sync"

    def allreduce_async(self, flat, op):
        return Handle(flat * 2)

    def close(self):
        pass


def main(mode: str) -> None:
    t = torch.ones(1000)
    if mode == "hook":
        from aggd_client.torch_hook import AggdHookState
        out = AggdHookState(DoublingClient()).submit(0, t).wait()
    else:
        from aggd_client.torch.reducer import Reducer
        from aggd_client.torch.work import AggdWork
        AggdWork(Reducer(DoublingClient(), 60).submit([t], "sum")).wait()
        out = t
    print("ok", float(out.sum()), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
