"""How far an aggd allreduce may be from the exact float64 one (docs/protocol.md, "Quantisation"):
``quant.error_bound`` per chunk from the members' contributions, divided by the contributions for a
mean, plus the rounding of the result to the tensor's dtype. Shared by the PyTorch backend's tests."""
from __future__ import annotations

import numpy as np

from aggd_client import quant

MANTISSA = {"float32": 23, "float16": 10, "bfloat16": 7, "float64": 52}


def ulp(x, dtype: str) -> np.ndarray:
    """Spacing of ``dtype`` at ``|x|`` (float16's subnormals included)."""
    tiny = {"float16": 2.0 ** -14, "float64": 2.0 ** -1022}.get(dtype, 2.0 ** -126)
    x = np.maximum(np.abs(np.asarray(x, np.float64)), tiny)
    return np.ldexp(1.0, np.floor(np.log2(x)).astype(int) - MANTISSA[dtype])


def allreduce_bound(contributions: list[np.ndarray], elements: int, dtype: str, *, mean: bool,
                    terms: int | None = None) -> np.ndarray:
    """Per-element bound on ``|aggd result - exact result|`` for the flat float64 ``contributions``
    (one per member, what each sent, in the tensor's dtype's values) under ``sync``."""
    world = len(contributions)
    size = contributions[0].size
    n = max(-(-size // elements), 1)
    pads = np.zeros((world, n * elements))
    for i, c in enumerate(contributions):
        pads[i, :size] = np.abs(c)
    exps = np.min([quant.chunk_exponents(p.reshape(n, elements).max(axis=1), world, terms) for p in pads], axis=0)
    q_err = np.repeat(quant.error_bound(world, exps), elements)[:size]
    exact = np.sum(contributions, axis=0)
    if mean:
        q_err, exact = q_err / world, exact / world
    # the float64 result rounded once to the dtype (bfloat16: through float32): one ulp covers both
    return q_err + ulp(np.abs(exact) + q_err, dtype)
