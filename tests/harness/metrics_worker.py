"""The lab's worker of tests/service/test_prometheus.py, run as a script in a worker's namespace:
join the job, then allreduce ``--rounds`` times, sleeping ``--delay`` seconds before each; rank 0
then sends a shard report so the dashboard's shard panels have data. Prints one JSON line."""
from __future__ import annotations

import json
import sys
import time


def main(argv=None) -> int:
    import argparse

    import numpy as np

    from aggd_client import join
    from aggd_client.shards import send_report

    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--bind", required=True)
    ap.add_argument("--job", required=True)
    ap.add_argument("--token", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--rounds", type=int, required=True)
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--size", type=int, required=True)
    a = ap.parse_args(argv)
    host, port = a.server.rsplit(":", 1)
    bhost, bport = a.bind.rsplit(":", 1)
    x = np.full(a.size, float(a.rank + 1), np.float32)
    with join((host, int(port)), a.job, a.rank, a.token, bind=(bhost, int(bport)), timeout=20,
              give_up_after=30) as client:
        world = client.job_info.world
        t0 = time.monotonic()
        for _ in range(a.rounds):
            time.sleep(a.delay)
            out = client.allreduce(x)
            assert np.allclose(out, world * (world + 1) / 2), out[:4]
        if a.rank == 0:   # the map of a job on one aggregator, so the dashboard's shard panels have data
            send_report(client, version=0, call=a.rounds, weights=[1], index=0,
                        rates=[a.size * a.rounds / (time.monotonic() - t0)], reason="the map given")
    print(json.dumps({"rank": a.rank, "rounds": a.rounds}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
