"""How far an aggd DDP run's final parameters may be from a gloo run's of the same script
(``aggd.training.torch_train``: same seed, same shards, plain SGD, ``sync``).

Per step ``t`` every rank records ``grad_max[t]``, the largest magnitude of its local gradient
before any reduction; ``M_t`` is the largest over the ranks. Every chunk's result exponent is at
least ``chunk_exponents(M_t, world, world * headroom)`` (a chunk's exponent comes from its largest contribution, which
is at most ``M_t``), so by docs/protocol.md each element of aggd's mean gradient is within
``error_bound(world, e_t) / world`` of the exact mean. Gloo's mean (DDP divides by the world, then
sums in float32) is within ``world`` ulps of ``M_t`` of it, and aggd's float32 output within half an
ulp; so the two mean gradients differ by at most
``eps_t = error_bound(world, e_t) / world + (world + 1) * ulp(M_t)``. Each SGD step moves the
parameters by ``lr`` times the gradient and rounds each parameter once in each run (an ulp of the
largest parameter ``P``). To first order (the two runs' gradients evaluated at the same parameters)
the final parameters differ by at most::

    first_order = sum_t (lr * eps_t + ulp(P))

The runs' parameters are not the same after the first step, so each step's gradients also differ
by ``H * delta_t`` (the Hessian times the difference so far): a step multiplies the difference so
far by up to ``||I - lr * H|| <= 1 + lr * ||H||``. We allow a factor ``GROWTH_PER_STEP = 2`` a step
(``lr * ||H|| <= 1``: SGD at a learning rate it is stable at, ``lr * lambda_max < 2``, and
curvature of either sign no larger than that), so ``bound = 2**steps * first_order``. Measured
(printed by the tests): the cnn's difference stays below the first-order bound (ratio ~0.05 after
8 steps: one float32 ulp), the transformer's grows to 20-24x it after 8 steps (LayerNorm and
attention at lr 0.1), inside ``2**8``.
"""
from __future__ import annotations

import numpy as np

from aggd_client import quant

#: how much the difference may grow a step through the propagation (see above)
GROWTH_PER_STEP = 2.0


def ulp32(x) -> np.ndarray:
    x = np.maximum(np.abs(np.asarray(x, np.float64)), 2.0 ** -126)
    return np.ldexp(1.0, np.floor(np.log2(x)).astype(int) - 23)


def first_order(records: list[dict]) -> float:
    """The first-order bound (above) from an aggd run's records (one per rank)."""
    world = len(records)
    steps = len(records[0]["grad_max"])
    lr = records[0]["lr"]
    m = np.max([r["grad_max"] for r in records], axis=0)
    assert len(m) == steps and np.all(m > 0)
    e = quant.chunk_exponents(m, world, world * quant.MAX_HEADROOM)   # the daemon job's headroom
    eps = quant.error_bound(world, e) / world + (world + 1) * ulp32(m)
    p = max(float(np.abs(np.load(r["params_path"])).max()) for r in records)
    return float(np.sum(lr * eps) + steps * ulp32(p))


def compare(gloo: list[dict], aggd: list[dict]) -> dict:
    """|aggd - gloo| of rank 0's final parameters, the bounds, and how far training moved them."""
    a, g = np.load(aggd[0]["params_path"]).astype(np.float64), np.load(gloo[0]["params_path"]).astype(np.float64)
    b1 = first_order(aggd)
    growth = GROWTH_PER_STEP ** len(aggd[0]["grad_max"])
    return {"diff": float(np.abs(a - g).max()), "first_order": b1, "bound": growth * b1}
