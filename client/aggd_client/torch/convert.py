"""Tensors to the arrays the client sends, and results back: shared by the process group and the
DDP comm hook (``aggd_client.torch_hook``).

Dtypes: float32, float16 and float64 go as they are (the client quantises each directly); bfloat16
has no numpy type, so it is sent as float32 and the result is rounded back to bfloat16.

Devices: a CPU tensor is read in place; any other tensor that ``Tensor.cpu()`` can copy (CUDA) is
*staged* through host memory: copied to the host before it is sent and the result copied back
into the tensor (``stage_in`` / ``stage_out``). The aggregator only ever sees host memory.
"""
from __future__ import annotations

import numpy as np

__all__ = ["FLOAT_DTYPES", "STAGED_DEVICES", "check_dtype", "check_tensor", "from_numpy", "stage_in", "stage_out",
           "to_numpy"]

#: torch dtype names aggd reduces.
FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")
#: device types whose tensors are copied through host memory (besides "cpu", read in place).
STAGED_DEVICES = ("cuda",)


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_dtype(t) -> None:
    """TypeError naming the dtype when aggd cannot reduce ``t``."""
    if _dtype_name(t.dtype) not in FLOAT_DTYPES:
        raise TypeError(f"aggd reduces float32, float16, bfloat16 and float64 tensors, not {t.dtype}")


def check_tensor(t) -> None:
    """TypeError naming the dtype, or ValueError naming the device, when the process group cannot
    reduce ``t``."""
    check_dtype(t)
    if t.device.type != "cpu" and t.device.type not in STAGED_DEVICES:
        raise ValueError(f"aggd reduces CPU tensors (and stages {', '.join(STAGED_DEVICES)} tensors through "
                         f"host memory), not tensors on {t.device}")


def check_tensors(tensors) -> None:
    """``check_tensor`` of each of one allreduce's ``tensors``, which must be some and share a dtype
    (TypeError otherwise)."""
    if not tensors:
        raise ValueError("aggd allreduce needs at least one tensor")
    for t in tensors:
        check_tensor(t)
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        raise TypeError(f"the tensors of one aggd allreduce must share a dtype, not {sorted(map(str, dtypes))}")


def to_numpy(t):
    """(numpy array to send, torch dtype to return) for a tensor; a tensor on another device than
    the CPU is copied to host memory first (``Tensor.cpu()``)."""
    import torch

    check_dtype(t)
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.to(torch.float32).cpu().numpy(), t.dtype
    return t.cpu().numpy(), t.dtype


def from_numpy(arr: np.ndarray, dtype, shape):
    """A CPU tensor of ``dtype`` and ``shape`` holding ``arr`` (a result)."""
    import torch

    return torch.from_numpy(np.asarray(arr)).to(dtype).reshape(shape)


def stage_in(tensors) -> tuple[np.ndarray, object]:
    """One flat host array holding every tensor of ``tensors`` (one dtype, the order given), and
    their torch dtype. A single CPU tensor's array may share its memory (it is only read)."""
    check_tensors(tensors)
    arrays = [to_numpy(t)[0].reshape(-1) for t in tensors]
    flat = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
    return np.ascontiguousarray(flat), tensors[0].dtype


def stage_out(tensors, result: np.ndarray, dtype) -> None:
    """Copy the flat ``result`` back into ``tensors`` (in place, on their own devices)."""
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(from_numpy(result[offset:offset + n], dtype, t.shape))
        offset += n
    if offset != result.size:
        raise ValueError(f"a result of {result.size} values for tensors of {offset}")
