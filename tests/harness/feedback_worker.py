"""A lab worker of a narrow job with error feedback (aggd_client.feedback), where one member's
gradients are ``coarse`` times the others' and it calls last: ``calls`` calls of one key, a reset
every ``reset_every``. Every rank draws every rank's inputs from the same seeds, so each knows the
exact sums, and prints one JSON line: per reset period, how far what the calls delivered is from
the inputs, in steps of the last call's results (``mean``, ``max``)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    from aggd_client import join
    from aggd_client.feedback import ErrorFeedback
    server, bind, job, token, rank = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
    world, calls, H, size, coarse, shared = (int(sys.argv[6]), int(sys.argv[7]), int(sys.argv[8]),
                                             int(sys.argv[9]), float(sys.argv[10]), sys.argv[11] == "1")
    def grad(r, i):
        g = np.random.default_rng(1000 * r + i).standard_normal(size)
        return (g * (coarse if r == world - 1 else 1.0)).astype(np.float32)
    client = join((server, 47000), job, rank=rank, token=token, bind=(bind, 40000))
    ef = ErrorFeedback(client, reset_every=H, shared_scales=shared)
    exact, delivered, ends = np.zeros(size), np.zeros(size), []
    for i in range(calls):
        if rank == world - 1:
            time.sleep(0.003)   # after the others: the aggregator floors their partial sum
        delivered += ef.allreduce(grad(rank, i), key="g").astype(np.float64)
        exact += sum(grad(r, i).astype(np.float64) for r in range(world))
        if (i + 1) % H == 0:
            ends.append((delivered - exact).copy())
    scales = ef.last_handle.scales
    step = np.repeat(np.ldexp(1.0, -scales.shared.astype(np.int64)), scales.elements)[:size]
    drift = [np.abs(d) / step for d in ends]
    print(json.dumps({"mean": [float(d.mean()) for d in drift], "max": [float(d.max()) for d in drift],
                      "stats": ef.stats}), flush=True)
    client.close()
""")


def run(lab, job: dict, world: int, *, calls: int = 48, reset_every: int = 16, size: int = 3000,
        coarse: float = 8.0, shared: bool = True, timeout: float = 120.0) -> list[dict]:
    """Every rank of ``job`` (its ``name`` and ``token``) as worker ``rank`` of ``lab``; each rank's
    report."""
    procs = [lab.run(lab.worker_ns(w), [sys.executable, "-c", SCRIPT, lab.agg_ip_of(0), lab.worker_ip(w),
                                        job["name"], job["token"], str(w), str(world), str(calls),
                                        str(reset_every), str(size), str(coarse), "1" if shared else "0"],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for w in range(world)]
    out = []
    try:
        for w, p in enumerate(procs):
            stdout, stderr = p.communicate(timeout=timeout)
            assert p.returncode == 0, (w, stderr[-3000:])
            out.append(json.loads(stdout.splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return out
