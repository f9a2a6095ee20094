"""Lab programs for the strategy tests and ``aggctl bench swap``.

``worker``: a training-loop-shaped worker: every step it "computes" (sleeps ``delay`` times its
slowness, with jitter) an integer-valued gradient, hands it to ``allreduce_async`` and collects
finished handles, exactly as a real loop would, whatever the strategy in force. Integer values
keep quantisation exact, so sums can be compared exactly. One JSON line per finished handle, and
a final line with everything it sent.

``observer``: joins the job's group and records every result multicast to it (the releases; re-sends
and async running sums go by unicast and are not seen), one JSON line each, until told to stop.
"""
from __future__ import annotations

import argparse
import json
import random
import signal
import socket
import struct
import sys
import time
from collections import deque

import numpy as np

from aggd_client import AggClient
from aggd_client.client import fast_for_run
from aggd_client.protocol import HEADER_SIZE, Flag, Header, MsgType

from aggd.core.addresses import host_port

SIZE = 300  # two chunks of 256: exercises more than one slot


def gradient(rank: int, step: int, size: int = SIZE) -> np.ndarray:
    """Integer-valued, distinct per rank and step, |x| <= 1000."""
    base = np.arange(size, dtype=np.float64) % 17 - 8
    return (base * ((rank + 1) * 7 + step % 13) % 997).astype(np.float32)


def worker(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", type=host_port, required=True)
    ap.add_argument("--group", type=host_port, required=True)
    ap.add_argument("--bind", type=host_port, required=True)
    ap.add_argument("--job", type=int, required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--steps", type=int, default=20, help="rounds to reach (wbsp may add steps inside a round)")
    ap.add_argument("--delay", type=float, default=0.005, help="seconds of 'compute' a step")
    ap.add_argument("--slow", type=float, default=1.0, help="this worker's slowness factor")
    ap.add_argument("--jitter", type=float, default=0.0, help="random extra delay, fraction of delay")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slow-steps", default="", help="A:B: slow only for steps A..B-1 (a middle phase)")
    ap.add_argument("--give-up-after", type=float, default=20.0)
    ap.add_argument("--slots", type=int, required=True, help="the job's slot pool")
    ap.add_argument("--sizes", default=str(SIZE),
                    help="tensor sizes taken in turn, one a step (unequal buckets, as DDP's)")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed * 1000 + args.rank)
    sizes = [int(v) for v in args.sizes.split(",")]
    sent = 0.0
    pending: deque = deque()
    max_outstanding = 0

    def report(h, t_start):
        out = h.wait()
        s = h.strategy
        print(json.dumps({"rank": args.rank, "round": h.round, "step": h.step,
                          "kind": int(s.kind) if s else 0, "param": s.param if s else 0,
                          "version": s.version if s else 0, "n_contrib": [int(n) for n in h.n_contrib],
                          "sum": float(np.asarray(out, np.float64).sum()),
                          "seconds": time.monotonic() - t_start}), flush=True)

    fast = fast_for_run(sum(sizes[i % len(sizes)] for i in range(args.steps)))
    with AggClient(args.server, args.job, args.rank, args.world, group=args.group, bind=args.bind,
                   give_up_after=args.give_up_after, catch_up=len(sizes) == 1, slots=args.slots,
                   fast=fast) as client:
        step = 0
        # Loop until the job's round count is reached, not for a fixed number of calls: under wbsp
        # several calls share a round and under quorum a straggler skips rounds, so a fixed count
        # would leave some members waiting for others that have already stopped.
        while client.round < args.steps:
            slow = args.slow
            if args.slow_steps:
                a, b = (int(v) for v in args.slow_steps.split(":"))
                slow = args.slow if a <= step < b else 1.0
            time.sleep(args.delay * slow * (1 + args.jitter * rng.random()))
            g = gradient(args.rank, step, sizes[step % len(sizes)])
            t0 = time.monotonic()
            h = client.allreduce_async(g)
            sent += float(g.sum(dtype=np.float64))
            pending.append((h, t0))
            max_outstanding = max(max_outstanding, client.outstanding)
            while pending and pending[0][0].done():
                report(*pending.popleft())
            step += 1
        while pending:
            report(*pending.popleft())
        closing = time.monotonic()
    # close() retransmits what is still unanswered: late contributions only for a short linger
    print(json.dumps({"rank": args.rank, "final": True, "sent_sum": sent, "max_outstanding": max_outstanding,
                      "client": dict(client.stats), "close_seconds": time.monotonic() - closing}), flush=True)
    return 0


def observer(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--group", type=host_port, required=True)
    ap.add_argument("--iface-ip", required=True)
    ap.add_argument("--job", type=int, required=True)
    args = ap.parse_args(argv)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.setsockopt(socket.SOL_SOCKET, 33, 32 << 20)  # SO_RCVBUFFORCE: keep every release
    sock.bind(("0.0.0.0", args.group[1]))
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP,
                    socket.inet_aton(args.group[0]) + socket.inet_aton(args.iface_ip))
    sock.settimeout(0.2)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    print(json.dumps({"ready": True}), flush=True)
    while not stop:
        try:
            data = sock.recv(65536)
        except socket.timeout:
            continue
        if len(data) < HEADER_SIZE:
            continue
        h = Header.unpack(data)
        if h.type != MsgType.RESULT or h.job != args.job:
            continue
        whole = np.frombuffer(data, "<i4", offset=HEADER_SIZE).astype(np.float64)
        q = whole[:h.count]
        print(json.dumps({"t": time.monotonic(), "round": h.round, "chunk": h.chunk,
                          "version": h.strategy_version, "kind": h.strategy,
                          "param": h.param, "n_contrib": h.n_contrib, "contributors": h.contributors,
                          "flags": h.flags, "sum": float(np.ldexp(q, -h.exponent).sum()),
                          # beyond count too: a gradient carried from a round of a larger tensor
                          "sum_all": float(np.ldexp(whole, -h.exponent).sum())}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit({"worker": worker, "observer": observer}[sys.argv[1]](sys.argv[2:]))
