"""How far apart data-parallel workers' own chunk exponents are, on real gradients.

The aggregator aligns a chunk's contributions whose own exponents differ (docs/benchmarks.md,
"Workers' exponents a step apart"). This measures how far apart they are: ``--workers`` data-
parallel replicas of a project model (aggd.training.torch_models) each take a mini-batch of their
own shard of the digits, the gradients are cut into chunks of ``--elements`` values, and each
chunk's own exponents (quantised for a daemon job's headroom, 4) are compared across the workers;
the replicas then step with the mean gradient, as DDP would. One JSON line per (model, workers).

    .venv/bin/python scripts/exponent_spread.py --models cnn,transformer --workers 4,8 --steps 60
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "client")]


def spreads(model_name: str, world: int, steps: int, elements: int, batch: int, lr: float) -> np.ndarray:
    """Per step and chunk: the largest less the smallest of the workers' own exponents."""
    import torch

    from aggd.training.data import Batches, load_digits
    from aggd.training.torch_models import build
    from aggd_client import quant

    data = load_digits()
    model = build(model_name, seed=0)
    shards = [Batches(data, r, world, batch) for r in range(world)]
    params = list(model.parameters())
    out = []
    for _ in range(steps):
        grads = []
        for r in range(world):
            x, y = shards[r].next()
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y)).backward()
            grads.append(np.concatenate([p.grad.detach().numpy().ravel() for p in params]))
        g = np.stack(grads)
        n = -(-g.shape[1] // elements)
        padded = np.zeros((world, n * elements), np.float32)
        padded[:, :g.shape[1]] = np.abs(g)
        own = np.stack([quant.chunk_exponents(padded[r].reshape(n, elements).max(axis=1), world,
                                              world * quant.MAX_HEADROOM) for r in range(world)])
        out.append(own.max(axis=0) - own.min(axis=0))
        mean = torch.from_numpy(g.mean(axis=0))
        with torch.no_grad():
            at = 0
            for p in params:
                p -= lr * mean[at:at + p.numel()].reshape(p.shape)
                at += p.numel()
    return np.concatenate(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="cnn,transformer")
    ap.add_argument("--workers", default="4,8")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--elements", type=int, default=2233, help="values a chunk (2233: a packet at MTU 9000)")
    ap.add_argument("--batch", type=int, default=32, help="examples a worker's mini-batch")
    ap.add_argument("--lr", type=float, default=0.05)
    a = ap.parse_args()
    for name in a.models.split(","):
        for world in map(int, a.workers.split(",")):
            s = spreads(name, world, a.steps, a.elements, a.batch, a.lr)
            print(json.dumps({"model": name, "workers": world, "chunks": int(s.size), "steps": a.steps,
                              "elements": a.elements, "batch": a.batch,
                              "share_same": float((s == 0).mean()), "share_within_one": float((s <= 1).mean()),
                              "share_two": float((s == 2).mean()), "share_more": float((s > 2).mean())}),
                  flush=True)


if __name__ == "__main__":
    main()
