"""The README's numpy worker, with every client default, as a lab process: join, then allreduce
``rounds`` times, tensors of the given sizes in turn (two DDP-like buckets by default of one),
printing each round's first value. Each rank sends ``rank + 1 + offset`` everywhere, so a round
summed over every member of a world of ``n`` gives ``n (n + 1) / 2 + n offset`` in every element;
the worker fails (exit 3) on any other value."""
from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import sys, time
    import numpy as np
    from aggd_client import join
    server, bind, job, token, rank, rounds = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
    sizes, want, offset = [int(n) for n in sys.argv[7].split(",")], float(sys.argv[8]), float(sys.argv[9])
    client = join((server, 47000), job, rank=rank, token=token, bind=(bind, 40000))
    for r in range(rounds):
        out = client.allreduce(np.full(sizes[r % len(sizes)], rank + 1.0 + offset, np.float32))
        print(r, float(out[0]), flush=True)
        if want and not np.all(out == want):
            print("wrong sum in round", r, np.unique(out)[:5], file=sys.stderr, flush=True)
            sys.exit(3)
        time.sleep(0.01)
    client.close()
""")


def start(lab, w: int, job: str, token: str, rounds: int, sizes=(100_000,), check_world: int = 0, *,
          rank: int | None = None, aggregator: int = 0, offset: float = 0.0):
    """Worker ``w`` of ``lab`` as ``rank`` (``w`` by default) of ``job`` on aggregator
    ``aggregator``: a Popen with text pipes. ``check_world``: fail on a round that is not the sum
    over that many members (0: print only)."""
    rank = w if rank is None else rank
    want = check_world * (check_world + 1) / 2 + check_world * offset
    return lab.run(lab.worker_ns(w), [sys.executable, "-c", SCRIPT, lab.agg_ip_of(aggregator), lab.worker_ip(w),
                                      job, token, str(rank), str(rounds), ",".join(map(str, sizes)), str(want),
                                      str(offset)],
                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
