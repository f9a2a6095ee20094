"""A worker process for the lab: allreduces deterministic random tensors and checks each result.

Every worker regenerates all members' tensors from the shared seed, so it can check its own result
against the exact float64 sum and the documented bound without any side channel. One JSON object
per allreduce goes to stdout. Used by the netns tests, ``aggctl bench allreduce`` and the demo.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from aggd_client import AggClient
from aggd_client.quant import chunk_exponents, error_bound, output_rounding


def tensor(seed: int, rank: int, size: int, dtype: str, round_: int) -> np.ndarray:
    rng = np.random.default_rng([seed, rank, size, round_])
    x = rng.standard_normal(size, dtype=np.float32 if dtype != "float64" else np.float64)
    # some variety in scale between workers and chunks, as gradients have
    x *= np.float32(1 + rank)
    return x.astype(dtype)


def expected(seed, world, size, dtype, round_, elements):
    """(exact float64 sum, per-element bound) for this round."""
    exact = np.zeros(size)
    n_chunks = -(-size // elements)
    exps = None
    for r in range(world):
        x = tensor(seed, r, size, dtype, round_)
        exact += x
        padded = np.zeros(n_chunks * elements)
        padded[:size] = np.abs(x)
        e = chunk_exponents(padded.reshape(n_chunks, elements).max(axis=1), world)
        exps = e if exps is None else np.minimum(exps, e)
    bound = np.repeat(error_bound(world, exps), elements)[:size]
    return exact, bound


def _addr(text: str) -> tuple[str, int]:
    host, port = text.rsplit(":", 1)
    return host, int(port)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--server", type=_addr, required=True)
    ap.add_argument("--group", type=_addr, required=True)
    ap.add_argument("--bind", type=_addr, required=True)
    ap.add_argument("--job", type=int, required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--sizes", default="256", help="comma-separated element counts")
    ap.add_argument("--dtypes", default="float32")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=0, help="untimed, unchecked rounds first")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--elements", type=int, default=256)
    ap.add_argument("--slots", type=int, default=1024)
    ap.add_argument("--window", type=int, default=None)
    ap.add_argument("--no-gso", action="store_true")
    ap.add_argument("--check", choices=["all", "last", "none"], default="all",
                    help="which timed rounds to check against the exact sum")
    ap.add_argument("--give-up-after", type=float, default=10.0)
    args = ap.parse_args(argv)

    client = AggClient(args.server, args.job, args.rank, args.world, group=args.group, bind=args.bind,
                       elements=args.elements, slots=args.slots, window=args.window,
                       gso=not args.no_gso, give_up_after=args.give_up_after)
    status = 0
    with client:
        for dtype in args.dtypes.split(","):
            for size in (int(s) for s in args.sizes.split(",")):
                for i in range(args.warmup + args.rounds):
                    x = tensor(args.seed, args.rank, size, dtype, i)
                    t0 = time.perf_counter()
                    out = client.allreduce(x)
                    seconds = time.perf_counter() - t0
                    if i < args.warmup:
                        continue
                    rec = {"rank": args.rank, "size": size, "dtype": dtype, "round": i,
                           "seconds": seconds, "shape_ok": out.shape == x.shape and out.dtype == x.dtype}
                    last = i == args.warmup + args.rounds - 1
                    if args.check == "all" or (args.check == "last" and last):
                        exact, bound = expected(args.seed, args.world, size, dtype, i, args.elements)
                        bound = bound + output_rounding(out)
                        err = np.abs(out.astype(np.float64) - exact)
                        rec.update(max_abs_error=float(err.max()), error_bound=float(bound.max()),
                                   within_bound=bool(np.all(err <= bound)),
                                   max_abs_value=float(np.abs(exact).max()))
                        if not rec["within_bound"] or not rec["shape_ok"]:
                            status = 1
                    print(json.dumps(rec), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
