"""What a sharded job's members report of their shard map (docs/sharding.md, "Watching it").

A sharded job's map is agreed among its members (aggd_client.shards), not by any daemon; the
member that decides sends every aggregator host a SHARDS message at each agreed call: the map's
version and weights, which host the receiver is in it, each host's service rate as it measured it,
and the reason of the last change. The daemon keeps the newest report of each job and the last
changes, for ``aggctl jobs show``, ``aggctl shards`` and the metrics. A report is taken only from a
member's registered address with its tag, like a contribution; anything else is ignored.
"""
from __future__ import annotations

import json
import logging
import math
import time
from collections import deque

from aggd_client.protocol import HEADER_SIZE, Header, MAX_MEMBERS

log = logging.getLogger(__name__)

#: A report is small (a few weights and rates, a reason): anything longer is malformed.
MAX_REPORT = 4096
MAX_REASON = 256
#: Map changes kept per job (the newest last).
KEEP_CHANGES = 20


class ShardReports:
    def __init__(self) -> None:
        self.latest: dict[int, dict] = {}
        self.changes: dict[int, deque] = {}
        self.counts: dict[int, int] = {}    #: new map versions reported since start, a job
        self.ignored = 0     #: malformed or unauthenticated reports

    def forget(self, job: int) -> None:
        self.latest.pop(job, None)
        self.changes.pop(job, None)
        self.counts.pop(job, None)

    def take(self, data: bytes, src: tuple[str, int], registry, now: float | None = None) -> tuple | None:
        """A SHARDS message from ``src``, kept if it is a member's; (job, version, call, weights,
        reason) when it brings a new map version, else None."""
        try:
            report = self._check(data, src, registry)
        except ValueError as exc:
            self.ignored += 1
            log.debug("shard report from %s:%d ignored: %s", src[0], src[1], exc)
            return None
        report["at"] = time.time() if now is None else now
        job = report.pop("job_id")
        old = self.latest.get(job)
        self.latest[job] = report
        if old is not None and old["version"] == report["version"]:
            return None
        self.changes.setdefault(job, deque(maxlen=KEEP_CHANGES)).append(
            {k: report[k] for k in ("version", "call", "weights", "reason", "at")})
        self.counts[job] = self.counts.get(job, 0) + 1
        return job, report["version"], report["call"], report["weights"], report["reason"]

    @staticmethod
    def _check(data: bytes, src: tuple[str, int], registry) -> dict:
        if not HEADER_SIZE <= len(data) <= HEADER_SIZE + MAX_REPORT:
            raise ValueError(f"{len(data)} bytes")
        hdr = Header.unpack(data)
        job = registry.jobs.get(hdr.job)
        member = job.members.get(hdr.rank) if job is not None else None
        if member is None or tuple(member.address) != (src[0], src[1]) or member.tag != hdr.contributors:
            raise ValueError("not from a member of the job")
        try:
            body = json.loads(bytes(data[HEADER_SIZE:]).decode())
        except (UnicodeDecodeError, ValueError):
            raise ValueError("the payload is not a UTF-8 JSON object") from None
        if not isinstance(body, dict):
            raise ValueError("the payload is not a JSON object")
        weights, rates = body.get("weights"), body.get("rates")
        if not (isinstance(weights, list) and 1 <= len(weights) <= MAX_MEMBERS
                and all(_number(w) and w >= 0 for w in weights) and sum(weights) > 0):
            raise ValueError("weights: 1 to 64 numbers, 0 or more, not all 0")
        if not (isinstance(rates, list) and len(rates) == len(weights)
                and all(r is None or (_number(r) and r >= 0) for r in rates)):
            raise ValueError("rates: one number (or null) a weight")
        index, version, call = body.get("index"), body.get("version"), body.get("call")
        if not (_int(index) and 0 <= index < len(weights)) or not (_int(version) and version >= 0) \
                or not (_int(call) and call >= 0):
            raise ValueError("index, version and call: integers in range")
        reason = body.get("reason", "")
        if not isinstance(reason, str):
            raise ValueError("reason: a string")
        total = sum(weights)
        return {"job_id": job.id, "from_rank": hdr.rank, "version": version, "call": call, "index": index,
                "weights": weights, "shares": [w / total for w in weights], "rates": rates,
                "reason": reason[:MAX_REASON]}

    def describe(self, job: int) -> dict | None:
        latest = self.latest.get(job)
        if latest is None:
            return None
        return {**latest, "share": latest["shares"][latest["index"]], "changes": list(self.changes.get(job, ())),
                "changes_total": self.counts.get(job, 0)}


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)
