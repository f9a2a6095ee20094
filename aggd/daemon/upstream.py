"""Rack jobs' links to their upper aggregators (docs/hierarchy.md).

A rack job's daemon joins the upper job as one member, like a worker: a JOIN with the upper job's
token, sent from the address the rack's forwarded sums will leave from (the job's port), resent
until the upper daemon answers. Its JOIN_ACK says where contributions go, the rack's member tag
there and the group the upper results are multicast to; the data planes are then told where
complete rounds go (``DataPlane.set_upstream``) and the user-space path listens on that group.
Until then a complete round waits in its bank and the members' retransmissions send it once the
link is up, so nothing is lost by a late link.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from aggd_client.membership import JobInfo, decode_join_ack, encode_join
from aggd_client.protocol import HEADER_SIZE, Header, MsgType, NackCode
from aggd_client.errors import ProtocolError

from aggd.core.model import Upstream
from aggd.core.registry import Job, UpstreamSpec
from aggd.dataplane import DataPlaneError

log = logging.getLogger(__name__)

#: A JOIN is resent this often until answered (as workers do), and this often once refused (the
#: upper job may be created, or its token fixed, later).
RETRY = 0.25
RETRY_REFUSED = 5.0


@dataclass
class Link:
    job: int                  #: the rack job's id
    spec: UpstreamSpec
    port: int                 #: the rack job's port: its JOIN and its sums leave from there
    state: str = "joining"    #: joining, linked, refused
    reason: str = ""
    upstream: Upstream | None = None
    group: tuple[str, int] | None = None
    since: float = field(default_factory=time.time)
    next_join: float = 0.0

    def describe(self) -> dict:
        d = {"state": self.state, "since": self.since, **self.spec.describe()}
        if self.reason:
            d["reason"] = self.reason
        if self.upstream is not None:
            d.update(upper_job_id=self.upstream.job, sends_to=list(self.upstream.addr),
                     group=list(self.group) if self.group else None)
        return d


class UpstreamLinks:
    """The links of one daemon (``service``: aggd.daemon.service.Service) and the thread that joins."""

    def __init__(self, service) -> None:
        self.service = service
        self.links: dict[int, Link] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def want(self, job: Job) -> None:
        """``job`` (just installed in the data planes) has an upper aggregator: join it, or, if
        already linked with the same settings, tell the data planes again."""
        link = self.links.get(job.id)
        if link is None or link.spec != job.upstream or link.port != job.port:
            self.links[job.id] = Link(job.id, job.upstream, job.port)
        elif link.upstream is not None:
            self._install(link)

    def relink(self, job: int, why: str) -> None:
        """Join the upper job again while the data planes go on with the link they have: the upper
        daemon takes the rack as a restarted member (docs/protocol.md "Members declared gone"). A
        rack whose workers restart does, so the upper job waits for the other racks' workers as
        restarting too, however long since their last round, instead of declaring those racks
        gone and releasing rounds without them."""
        link = self.links.get(job)
        if link is not None and link.state == "linked":
            log.info("job %d: joining its upper job again: %s", job, why)
            link.state, link.reason, link.since, link.next_join = "joining", why, time.time(), 0.0

    def drop(self, job: int) -> None:
        self.links.pop(job, None)

    def describe(self, job: int) -> dict | None:
        link = self.links.get(job)
        return link.describe() if link is not None else None

    # -- the thread --------------------------------------------------------------------------------
    def start(self) -> "UpstreamLinks":
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="aggd-upstream", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(RETRY / 2):
            try:
                self.tick(time.monotonic())
            except Exception:  # one link's trouble must not stop the others
                log.exception("upstream links: a pass failed")

    def tick(self, now: float) -> None:
        """Send the JOIN of every link that is not up and is due."""
        svc = self.service
        with svc.lock:
            due = [link for link in self.links.values() if link.state != "linked" and now >= link.next_join]
            for link in due:
                spec = link.spec
                job = int(spec.job) if spec.job.isdigit() else spec.job
                try:
                    svc.us.send_from(link.port, encode_join(job, spec.rank, spec.token), spec.server)
                except Exception as exc:
                    link.reason = f"cannot send the JOIN: {exc}"
                link.next_join = now + (RETRY_REFUSED if link.state == "refused" else RETRY)

    # -- the answers (a user-space path handler: runs outside its batch lock) -------------------------
    def on_join_ack(self, data: memoryview, src: tuple[str, int]) -> None:
        """A JOIN_ACK from an upper aggregator: the link it answers goes up (or is refused)."""
        try:
            hdr, body = decode_join_ack(bytes(data))
        except (ProtocolError, ValueError) as exc:
            log.warning("a malformed JOIN_ACK from %s:%d: %s", src[0], src[1], exc)
            return None
        svc = self.service
        with svc.lock:
            link = next((lk for lk in self.links.values() if lk.state != "linked" and lk.spec.server == tuple(src)
                         and lk.spec.rank == hdr.rank and _names(lk.spec.job, hdr.job, body)), None)
            if link is None:
                return None
            if hdr.code != NackCode.NONE:
                reason = str(body.get("error", f"code {hdr.code}"))
                if (link.state, link.reason) != ("refused", reason):
                    log.error("job %d: the upper aggregator %s:%d refused its JOIN to job %s as rank %d: %s",
                              link.job, *link.spec.server, link.spec.job, link.spec.rank, reason)
                link.state, link.reason, link.since = "refused", reason, time.time()
                return None
            try:
                info = JobInfo.from_json(body)
            except ProtocolError as exc:
                link.state, link.reason = "refused", str(exc)
                return None
            job = svc.registry.jobs.get(link.job)
            if job is None:
                return None
            if info.elements != job.elements:
                link.state, link.since = "refused", time.time()
                link.reason = (f"the upper job has {info.elements} values a packet, this job {job.elements}: "
                               f"they must be equal (elements)")
                log.error("job %s: %s", job.name, link.reason)
                return None
            link.upstream = Upstream((link.spec.server[0], info.port), info.job, link.spec.rank, info.tag)
            link.group = info.group
            link.state, link.reason, link.since = "linked", "", time.time()
            self._install(link)
            if link.state == "linked":
                log.info("job %s: linked to job %s (%d) at %s:%d as rank %d", job.name, info.name, info.job,
                         link.spec.server[0], info.port, link.spec.rank)
        return None

    def on_nack(self, data: memoryview, src: tuple[str, int]) -> None:
        """A NACK from an upper aggregator (the XDP program passes up only those from a linked
        one): it refuses the rack's sums as from a stranger (unknown job, not a member) when its
        job was deleted and created again, or restarted without its state. The link still says
        linked; join again, as the link's JOIN would be answered now."""
        try:
            hdr = Header.unpack(bytes(data[:HEADER_SIZE]))
        except (ProtocolError, ValueError):
            return None
        if hdr.type != MsgType.NACK or hdr.code not in (NackCode.UNKNOWN_JOB, NackCode.NOT_MEMBER):
            return None
        svc = self.service
        with svc.lock:
            for link in self.links.values():
                if (link.state == "linked" and link.upstream is not None and link.upstream.addr[0] == src[0]
                        and link.upstream.job == hdr.job and link.spec.rank == hdr.rank):
                    self.relink(link.job, f"the upper aggregator refused its sums "
                                          f"({NackCode(hdr.code).name.lower()}: its job created again?)")
        return None

    def _install(self, link: Link) -> None:
        """Tell the data planes; a plane that cannot (the XDP program's interface does not reach
        the upper aggregator, or its next hop is not known yet) refuses the link, tried again later."""
        svc = self.service
        try:
            for plane in svc.planes:
                plane.set_upstream(link.job, link.upstream)
        except DataPlaneError as exc:
            log.error("job %d: cannot link to its upper aggregator: %s", link.job, exc)
            for plane in svc.planes:
                plane.set_upstream(link.job, Upstream(link.spec.server))   # complete rounds wait
            link.state, link.reason, link.upstream = "refused", str(exc), None
            return
        if link.group is not None:
            svc.listen_for(link.group)


def _names(wanted: str, job_field: int, body: dict) -> bool:
    """Does a JOIN_ACK (header ``job``, payload ``body``) answer a JOIN for job ``wanted``?"""
    if "name" in body or "job" in body:
        return wanted in (str(body.get("name")), str(body.get("job")))
    return wanted == str(job_field) or not wanted.isdigit()   # a refusal echoes the id, or 0xFFFF
