"""A ``torch.distributed`` backend named "aggd": importing this package registers it.

    import torch.distributed as dist
    import aggd_client.torch                      # registers the backend
    dist.init_process_group("aggd")               # under torchrun; AGGD_SERVER, AGGD_JOB, AGGD_TOKEN set
    dist.all_reduce(t)                            # and DDP's gradient allreduce go through aggd
    aggd_client.torch.last_round_info()           # rounds asked/answered, strategy, n_contrib

``allreduce`` (SUM, AVG) of float32/float16/bfloat16/float64 tensors is one aggd round; the other
collectives go to an inner gloo group. docs/pytorch.md describes the settings, semantics, errors,
restarts and CUDA staging. Modules: ``process_group`` (the group), ``reducer`` (the thread that
owns the client), ``work`` (the Work it returns), ``settings``, ``convert`` (tensors <-> arrays,
shared with ``aggd_client.torch_hook``).
"""
from __future__ import annotations

import torch.distributed as dist

from .process_group import AggdProcessGroup, create
from .reducer import AggdBackendError, last_round_info
from .settings import Settings, SettingsError

__all__ = ["AggdBackendError", "AggdProcessGroup", "BACKEND", "Settings", "SettingsError", "last_round_info"]

BACKEND = "aggd"


def _register() -> None:
    if BACKEND.upper() in dist.Backend._plugins:
        return
    # devices as a list: a string would be split into letters
    dist.Backend.register_backend(BACKEND, create, extended_api=True, devices=["cpu", "cuda"])


_register()
