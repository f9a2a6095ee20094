"""One training worker: ``python -m aggd.training.worker`` (the lab runs one per worker namespace).

Joins an aggd job with its token (``--token``) or a gloo group (``--gloo tcp://HOST:PORT``), trains
the digits MLP on its shard (``aggd.training.loop.train``) and prints one JSON line per evaluation,
then one summary line (``"summary": true``). Exit status 0 when training ran to the end.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from aggd.core.addresses import host_port


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, help="members (gloo; aggd's join answer says)")
    ap.add_argument("--server", type=host_port, help="aggd's address HOST:PORT")
    ap.add_argument("--bind", type=host_port, default=("0.0.0.0", 0))
    ap.add_argument("--job", help="the aggd job's name or id")
    ap.add_argument("--token")
    ap.add_argument("--gloo", metavar="INIT_METHOD", help="use torch.distributed gloo instead of aggd")
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--lr-final", type=float, default=0.1)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--compute-ms", type=float, default=20.0, help="simulated compute a step")
    ap.add_argument("--slow", type=float, default=1.0, help="this worker's slowdown factor")
    ap.add_argument("--slow-rounds", default="", help="A:B: slow only for rounds A..B-1")
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--give-up-after", type=float, default=20.0)
    ap.add_argument("--step-only", action="store_true", help="send the step alone, not the model with it")
    ap.add_argument("--corrupt-from", type=int, default=None, metavar="ROUND",
                    help="from this round on send the step times --corrupt-scale (a faulty member)")
    ap.add_argument("--corrupt-scale", type=float, default=-10.0)
    ap.add_argument("--feedback", choices=("on", "off"), default="on",
                    help="a narrow job's (8 or 16 bits) error feedback and error reset")
    ap.add_argument("--error-reset", type=int, default=None, metavar="H",
                    help="error reset every H rounds (default aggd_client.feedback's; 0: never)")
    args = ap.parse_args(argv)

    from aggd.training.data import load_digits
    from aggd.training.loop import GlooExchange, TrainConfig, train

    slow_from, slow_until = 0, None
    if args.slow_rounds:
        a, b = args.slow_rounds.split(":")
        slow_from, slow_until = int(a or 0), (int(b) if b else None)
    cfg = TrainConfig(rounds=args.rounds, lr=args.lr, lr_final=args.lr_final, batch=args.batch,
                      hidden=args.hidden, compute_s=args.compute_ms / 1000, slow=args.slow,
                      slow_from=slow_from, slow_until=slow_until, eval_every=args.eval_every, seed=args.seed,
                      step_only=args.step_only, corrupt_from=args.corrupt_from, corrupt_scale=args.corrupt_scale)
    data = load_digits(seed=args.seed)

    def report(rec: dict) -> None:
        print(json.dumps(rec), flush=True)

    t_start = time.monotonic()
    if args.gloo:
        if args.world is None:
            ap.error("--gloo needs --world")
        ex = GlooExchange(args.rank, args.world, args.gloo)
        world = args.world
    else:
        from aggd_client import join
        if args.server is None or args.job is None or args.token is None:
            ap.error("aggd needs --server, --job and --token")
        job = int(args.job) if args.job.isdigit() else args.job
        ex = join(args.server, job, args.rank, args.token, bind=args.bind, timeout=args.give_up_after,
                  give_up_after=args.give_up_after, fast=True)  # the kernels' load at start, not mid-training
        world = ex.job_info.world
        if ex.job_info.precision != 32:
            from aggd.training.loop import FeedbackExchange
            ex = FeedbackExchange(ex, args.feedback == "on", args.error_reset)
    print(json.dumps({"rank": args.rank, "ready": True, "startup_s": time.monotonic() - t_start}), flush=True)
    try:
        summary = train(ex, data, args.rank, world, cfg, report)
    finally:
        ex.close()
    summary.pop("evals")
    stats = getattr(ex, "stats", None)   # the client's counters: where a run's time went (retransmits...)
    print(json.dumps({**summary, **({"client": dict(stats)} if stats is not None else {}),
                      "summary": True}, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
