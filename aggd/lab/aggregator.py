"""The user-space aggregator (``aggd.dataplane.userspace.server``) as a process of its own in a lab's aggregator
namespace, driven by JSON lines on stdin; ``aggctl bench allreduce`` runs ``aggd-user`` through it.

Commands, one JSON object a line, each answered with one JSON line on stdout:
``{"cmd": "add_job", "job": .., "world": .., "slots": .., "max_chunks": .., "members":
{rank: [ip, port]}, "group": [ip, port], "elements": .., "precision": .., "combine": ..}``
(``precision``: the wire's Precision code, optional; ``combine``: "sum", "median", "trimmed:t" or
"zeno", optional), ``{"cmd": "remove_job", "job": ..}``,
``{"cmd": "stats", "job": ..}`` (the job's counters and this process's peak RSS) and
``{"cmd": "reset_peak"}``. End of input stops it. The first line out is ``{"ready": true, ...}``.
"""
from __future__ import annotations

import argparse
import json
import sys

from aggd_client.protocol.definition import Counter

from aggd.core.addresses import host_port
from aggd.lab.memory import peak_rss, reset_peak_rss, rss
from aggd.core.model import JobConfig
from aggd.core.robust import parse_combine
from aggd.dataplane.userspace.server import UserspaceAggregator


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--bind", type=host_port, required=True)
    ap.add_argument("--elements", type=int, required=True)
    args = ap.parse_args(argv)
    with UserspaceAggregator(bind=args.bind, elements=args.elements) as agg:
        print(json.dumps({"ready": True, "address": list(agg.address)}), flush=True)
        for line in sys.stdin:
            req = json.loads(line)
            cmd = req.pop("cmd")
            if cmd == "add_job":
                req["members"] = {int(r): tuple(a) for r, a in req["members"].items()}
                req["group"] = tuple(req["group"]) if req.get("group") else None
                req["combine"] = parse_combine(req.get("combine", "sum"))
                agg.add_job(JobConfig(**req))
                out = {"ok": True}
            elif cmd == "remove_job":
                agg.remove_job(int(req["job"]))
                out = {"ok": True}
            elif cmd == "stats":
                counters = agg.counters(int(req["job"]))
                out = {"counters": {c.name.lower(): int(counters[c]) for c in Counter},
                       "peak_rss_bytes": peak_rss(), "rss_bytes": rss(), "errors": agg.errors,
                       "send_errors": agg.send_errors}
            elif cmd == "reset_peak":
                reset_peak_rss()
                out = {"ok": True}
            else:
                out = {"error": f"unknown command {cmd!r}"}
            print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
