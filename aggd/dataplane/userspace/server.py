"""The aggregator in user space: the protocol over UDP sockets (the daemon's overflow path).

The decisions are ``aggd.core.model.AggregatorModel``'s (in ``userspace`` mode, so short payloads are
served rather than passed on and every message carries Flag.USERSPACE); the arithmetic is the numba
kernels'. This module only moves bytes: receive a batch (``recvmmsg``), decide it -- the common
case in the numba fast path (``aggd.dataplane.userspace.fastpath``, exactly the model's decisions), every other packet
by ``model.process`` -- and send the answers. The model's clock is CLOCK_MONOTONIC
(``time.monotonic_ns``, read once a batch), the kernel's ``bpf_ktime_get_ns``.

The daemon adds three things: more than one socket (the aggd port behind the XDP program, and a
port for jobs whose packets are larger than the kernel's), jobs with their own packet size (one
model per size; a packet goes to the model of its job), and handlers for message types the model
does not serve (JOIN), whose answer goes back to the sender.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import select
import socket
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np

from aggd_client.mrecv import MultiReceiver, sockaddr_addr
from aggd_client.protocol import HEADER_SIZE, MAX_ELEMENTS, Counter, DropReason, MsgType, Precision, StrategyKind
from aggd_client.protocol.definition import DEFAULT_ELEMENTS
from aggd_client.transport import grow_buffers

from aggd.dataplane.userspace import fastpath

from aggd.dataplane.userspace import kernels

from aggd.dataplane.userspace import msend
from aggd.dataplane.userspace.keep import SlotFiles
from aggd.dataplane import DataPlane, DataPlaneError, JobStats, rounds_by_member
from aggd.core.robust import SUM
from aggd.core.model import NO_JOB, Addr, AggregatorModel, BankState, JobConfig, Verdict, member_rows
from aggd.core.strategy import TableEntry

log = logging.getLogger(__name__)

#: Datagrams read (one recvmmsg) and decided per wake-up before the socket is polled again.
BATCH = 256
#: Room for a few thousand packets: the workers' first windows arrive in one burst, and a
#: batch's results leave in one (a result's buffer is held until the bridge has delivered it).
_BUFFERS = 32 << 20
_SO_NO_CHECK = getattr(socket, "SO_NO_CHECK", 11)


#: A handler for one message type: (message, sender) -> the answer to send back, or None.
Handler = Callable[[memoryview, Addr], "bytes | None"]


def _udp_socket(bind: Addr) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        grow_buffers(sock, _BUFFERS)
        try:
            # No UDP checksum on what we send, as the XDP program's results (optional for IPv4;
            # computing it is a pass over every payload).
            sock.setsockopt(socket.SOL_SOCKET, _SO_NO_CHECK, 1)
        except OSError:
            pass
        sock.bind(bind)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 1)
        if bind[0] not in ("", "0.0.0.0"):
            # Results leave by the interface the server is bound to (the routing table may have no
            # multicast route, e.g. on loopback).
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(bind[0]))
    except BaseException:
        sock.close()
        raise
    return sock


def _libc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):   # not glibc
        return None


_MALLOC_TRIM = _libc_trim()


def _trim_heap() -> None:
    """Give the heap's free memory back to the system (glibc's malloc_trim; a no-op elsewhere)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _own_config(cfg) -> JobConfig:
    """A JobConfig of its own (members and tags copied) from any job description with its fields."""
    return JobConfig(job=cfg.job, world=cfg.world, slots=cfg.slots, max_chunks=cfg.max_chunks,
                     members=dict(cfg.members), tags=dict(getattr(cfg, "tags", None) or {}), group=cfg.group,
                     elements=getattr(cfg, "elements", None), upstream=getattr(cfg, "upstream", None),
                     precision=getattr(cfg, "precision", Precision.INT32), bound=getattr(cfg, "bound", None),
                     norm_bound=getattr(cfg, "norm_bound", None), combine=getattr(cfg, "combine", SUM))


class UserspaceAggregator(DataPlane):
    """``bind``: the main address (``address``); ``extra_binds``: more addresses served alike.
    ``handlers``: message type -> Handler, for types the model does not serve.

    As a :class:`DataPlane` it holds all of a job's slots: it serves whatever reaches it, the
    chunks beyond the kernel's (or the switch's) slots and the packets of another size."""

    def __init__(self, bind: Addr = ("127.0.0.1", 0), elements: int = DEFAULT_ELEMENTS, *,
                 extra_binds: tuple[Addr, ...] = (), handlers: dict[int, Handler] | None = None,
                 keep_dir: str | Path | None = None) -> None:
        kernels.warm_up()
        self.elements = elements
        self.model = self._new_model(elements)     # the aggregator's packet size, and unknown jobs
        self._models: dict[int, AggregatorModel] = {elements: self.model}
        self._route: dict[int, AggregatorModel] = {}  # job -> the model of its packet size
        #: job -> (slots, kernel slots, rerun): packets for the job's kernel slots that reach this
        #: path are never served by its own slots (``hand_back``)
        self._kernel_held: dict[int, tuple[int, int, Callable[[bytes, Addr], Verdict] | None]] = {}
        self.handlers: dict[int, Handler] = dict(handlers or {})
        #: where jobs installed with an ``identity`` keep their slots across restarts (``keep``)
        self.keep_dir = Path(keep_dir) if keep_dir is not None else None
        self._files: dict[int, SlotFiles] = {}
        # Held while a batch is decided. Handlers (JOIN) run after it is released: they take the
        # daemon's lock, which the daemon holds while it calls in here (one lock order, no deadlock).
        self._lock = threading.RLock()
        self._deferred: list[tuple[Handler, bytes, Addr]] = []
        self._socks: list[socket.socket] = []
        self._groups: dict[socket.socket, Addr] = {}   # listening sockets: an upper aggregator's results
        try:
            for addr in (bind, *extra_binds):
                self._socks.append(_udp_socket(addr))
        except BaseException:
            for s in self._socks:
                s.close()
            raise
        self._sock = self._socks[0]
        # Anything longer than the largest valid message is malformed anyway; one spare element
        # lets the model see it as such instead of the kernel truncating it silently.
        rec = HEADER_SIZE + 4 * (max(elements, MAX_ELEMENTS) + 1)
        self._batch = fastpath.Batch(BATCH, (rec + 7) // 8 * 8)   # (the kernel reads int32 lanes)
        self._stage = memoryview(self._batch.stage).cast("B")
        self._receivers = {s: MultiReceiver(self._batch.stage, self._batch.rec, self._batch.sizes,
                                            names=self._batch.names) for s in self._socks}
        self._fast = fastpath.FastPath()
        self._sender = msend.MultiSender(self._batch.out, self._batch.rec, BATCH) if msend.AVAILABLE else None
        fastpath.warm_up()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.send_errors = 0
        self.errors = 0  # packets whose handling raised (logged; serving goes on)

    @staticmethod
    def _new_model(elements: int) -> AggregatorModel:
        return AggregatorModel(elements, userspace=True, arithmetic=kernels.KERNEL_ARITHMETIC)

    @property
    def address(self) -> Addr:
        return self._sock.getsockname()

    @property
    def addresses(self) -> list[Addr]:
        return [s.getsockname() for s in self._socks]

    # -- registry (thread-safe) ------------------------------------------------------------------
    def add_job(self, cfg: JobConfig, identity: str | None = None) -> bool:
        """Add a job; with ``identity`` (and a ``keep_dir``) its slots live in files there and a
        job of the same identity and shapes a previous server kept is taken up where it was.
        Returns whether it was."""
        elements = cfg.elements or self.elements
        with self._lock:
            model = self._models.get(elements)
            if model is None:
                model = self._models[elements] = self._new_model(elements)
            model.add_job(cfg)
            self._route[cfg.job] = model
            if fastpath.HEADER_SIZE + 4 * elements > self._batch.rec:  # its results do not fit a record
                return False
            files = None
            if identity is not None and self.keep_dir is not None:
                layout = fastpath.FastJob.layout(cfg.slots, elements, fastpath.FastJob.rows_of(cfg))
                files = self._files[cfg.job] = SlotFiles(self.keep_dir / f"job-{cfg.job}", identity,
                                                         {k: shape for k, (_, shape) in layout.items()})
            self._fast.add_job(model, cfg.job, files)
            return files is not None and files.restored

    def install_job(self, cfg) -> None:
        """The DataPlane form of ``add_job``: replaces the job if it is there (``kernel_slots`` is
        the kernel's business: this path holds every slot of the job). ``cfg.identity``, if set,
        keeps the job's slots across restarts (``add_job``)."""
        with self._lock:
            self._drop(cfg.job)
            restored = self.add_job(_own_config(cfg), getattr(cfg, "identity", None))
            if restored:
                log.info("job %d: user-space slots taken up where the previous daemon left them", cfg.job)

    def hand_back(self, job: int, slots: int, kernel_slots: int,
                  rerun: Callable[[bytes, Addr], Verdict] | None = None) -> None:
        """Contributions and re-reads of ``job`` for its first ``kernel_slots`` slots (of ``slots``)
        belong to the kernel's (or the switch's) slots, never to this path's own: served here
        beside the kernel's slot, a chunk's rounds would go two ways, and the kernel's slot then
        refused the chunk's next round for good. When one reaches this path it is decided by
        ``rerun`` (the program itself, on a buffer with room: ``XdpDataPlane.rerun``; a narrow job's
        frame the XDP program could not grow); one that is not the job's packet size (the data
        plane takes no other there) is dropped ``bad_count``. ``kernel_slots`` 0: no longer."""
        with self._lock:
            if not kernel_slots:
                self._kernel_held.pop(job, None)
            else:
                self._kernel_held[job] = (int(slots), int(kernel_slots), rerun)
            fj = self._fast.jobs.get(job)
            if fj is not None:
                fj.slow_only = self._kernel_held.get(job, (0, 0, None))[2] is not None

    def _drop(self, job: int) -> None:
        self._kernel_held.pop(job, None)
        model = self._route.pop(job, None)
        if model is not None:
            model.remove_job(job)
            self._fast.remove_job(job)
        self._files.pop(job, None)

    def remove_job(self, job: int) -> None:
        """Remove a job and its kept slots; nothing happens for one that is not here. Its memory
        goes back to the system: the slot files' maps with the last reference to them, the heap
        its slot objects took by ``malloc_trim`` (glibc keeps freed heap otherwise)."""
        with self._lock:
            files = self._files.get(job)
            self._drop(job)
            if files is not None:
                files.remove()
        _trim_heap()

    def clear_rounds(self, job: int) -> None:
        """The job again with empty slots (and its kept files anew); members, tags, strategy table
        and awaited members as they were. Its user-space counters start again from zero."""
        with self._lock:
            model = self._route[job]
            state = model.jobs[job]
            cfg, table, awaited = state.cfg, model.strategy_table(job), state.awaited
            files = self._files.get(job)
            identity = files.identity if files is not None else None
            self._drop(job)
            if files is not None:
                files.remove()
            self.add_job(_own_config(cfg), identity)
            self._route[job].set_strategy(job, table)
            if awaited != (1 << cfg.world) - 1:
                self._route[job].set_awaited(job, awaited)
            self._fast.refresh(job)

    def has_job(self, job: int) -> bool:
        with self._lock:
            return job in self._route

    def active_jobs(self) -> list[int]:
        with self._lock:
            return sorted(self._route)

    def allocation(self, job: int) -> tuple[int, int]:
        """(0, slots): each job has its own slot array here."""
        with self._lock:
            model = self._route.get(job)
            return (0, model.jobs[job].cfg.slots) if model is not None else (0, 0)

    def set_member(self, job: int, rank: int, addr: Addr | None, tag: int = 0) -> None:
        with self._lock:
            self._route[job].set_member(job, rank, addr, tag)
            self._fast.refresh(job)

    def set_strategy(self, job: int, entries: list[TableEntry]) -> None:
        """Install a job's strategy table: exactly these rows (``StrategyTable.table_entries()``), as
        the kernel stores them. DataPlaneError, and the job left as it was, for rows no data plane
        holds."""
        with self._lock:
            try:
                self._route[job].set_strategy(job, entries)
            except (ValueError, NotImplementedError) as exc:
                raise DataPlaneError(str(exc)) from None
            self._fast.refresh(job)

    def set_upstream(self, job: int, upstream) -> None:
        with self._lock:
            self._route[job].set_upstream(job, upstream)

    def listen(self, group: Addr, interface: str) -> None:
        """Also serve what arrives for the multicast ``group`` (ip, port) on the interface whose
        address is ``interface``: an upper aggregator's results to its racks. Idempotent."""
        with self._lock:
            if group in self._groups.values():
                return
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                grow_buffers(sock, _BUFFERS)
                sock.bind((group[0], group[1]))       # only that group's datagrams
                sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP,
                                socket.inet_aton(group[0]) + socket.inet_aton(interface))
                sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(interface))
                sock.setblocking(False)
            except BaseException:
                sock.close()
                raise
            self._groups[sock] = group
            self._receivers[sock] = MultiReceiver(self._batch.stage, self._batch.rec, self._batch.sizes,
                                                  names=self._batch.names)
            self._socks = [*self._socks, sock]   # a new list: the serving thread iterates the old one

    def send_from(self, port: int, data: bytes, addr: Addr) -> None:
        """Send ``data`` to ``addr`` from the socket bound to ``port`` (a rack's JOIN to its upper
        aggregator leaves from the address its forwarded sums will come from)."""
        sock = next((s for s in self._socks if s.getsockname()[1] == port and s not in self._groups), None)
        if sock is None:
            raise DataPlaneError(f"the user-space path has no socket on port {port}")
        self._sendto(sock, data, addr)

    def set_awaited(self, job: int, awaited: int) -> None:
        with self._lock:
            try:
                self._route[job].set_awaited(job, awaited)
            except ValueError as exc:
                raise DataPlaneError(f"job {job}: {exc}") from None

    def job_rounds(self, job: int) -> tuple[int | None, dict[int, int]]:
        """(highest round any slot of ``job`` has seen, {rank: highest round it contributed to})."""
        with self._lock:
            if job not in self._route:
                return None, {}
            self._fast.sync(job)
            state = self._route[job].jobs[job]
            return rounds_by_member((bank.key[0], bank.bitmap) for slot in state.slots for bank in slot.banks
                                    if bank.state != BankState.EMPTY)

    def job_stats(self, job: int | None) -> JobStats:
        if job is None:
            return JobStats({}, {d.name.lower(): int(v) for d, v in zip(DropReason, self.drops(NO_JOB))})
        with self._lock:
            if job not in self._route:
                return JobStats({}, {})
            return JobStats({c.name.lower(): int(v) for c, v in zip(Counter, self.counters(job))},
                            {d.name.lower(): int(v) for d, v in zip(DropReason, self.drops(job))})

    def open_rounds(self, job: int) -> list[tuple[int, int, int]] | None:
        with self._lock:
            if job not in self._route:
                return []
            self._fast.sync(job)
            return [(b.key[0], b.bitmap, b.t_first) for s in self._route[job].jobs[job].slots for b in s.banks
                    if b.state == BankState.OPEN and not b.holding and b.kind != StrategyKind.QUORUM]

    def open_slots(self, job: int) -> int | None:
        with self._lock:
            if job not in self._route:
                return None
            self._fast.sync(job)
            state = self._route[job].jobs[job]
            return sum(any(b.state == BankState.OPEN for b in s.banks) for s in state.slots)

    @property
    def attached(self) -> bool:
        """Whether the serving thread runs."""
        return self.is_alive()

    def describe(self) -> dict:
        return {"alive": self.is_alive(), "errors": self.errors, "send_errors": self.send_errors}

    def member_stats(self, job: int, world: int) -> list[dict] | None:
        with self._lock:
            if job not in self._route:
                return None
            state = self._route[job].jobs[job]
            return member_rows(state.members, world, state.scores if state.cfg.combine.robust else None)

    def max_round(self, job: int) -> int | None:
        return self.job_rounds(job)[0] if self.has_job(job) else None

    def counters(self, job: int) -> np.ndarray:
        """uint64[len(Counter)] of ``job``."""
        with self._lock:
            return self._route.get(job, self.model).counters(job)

    def drops(self, job: int = NO_JOB) -> np.ndarray:
        """uint64[len(DropReason)] of ``job`` or of the NO_JOB bucket (summed over packet sizes)."""
        with self._lock:
            if job == NO_JOB:
                return sum((m.drops(NO_JOB) for m in self._models.values()), np.zeros(len(DropReason), np.uint64))
            return self._route.get(job, self.model).drops(job)

    def stats(self) -> dict:
        with self._lock:
            out = self.model.stats()
            for model in self._models.values():
                if model is self.model:
                    continue
                other = model.stats()
                out["jobs"].update(other["jobs"])
                for k, v in other["no_job"].items():
                    out["no_job"][k] += v
            return out

    # -- serving ---------------------------------------------------------------------------------
    def serve_once(self, timeout: float | None = 0.0) -> int:
        """Wait up to ``timeout`` s for packets, then handle up to BATCH of them; return how many."""
        ready, _, _ = select.select(self._socks, [], [], timeout)
        handled = 0
        for sock in ready:
            handled += self._serve_socket(sock)
        return handled

    def _serve_socket(self, sock: socket.socket) -> int:
        try:
            n = self._receivers[sock].drain(sock, 0)
        except OSError as e:  # e.g. ICMP errors reported on the socket; keep serving
            log.debug("recv: %s", e)
            return 0
        if n == 0:
            return 0
        batch = self._batch
        batch.nows[:n] = time.monotonic_ns()
        with self._lock:
            verdicts = self._fast.process(batch, n, self._slow)
            self._answer(sock, n, verdicts)
        self._run_handlers(sock)
        return n

    def _run_handlers(self, sock: socket.socket) -> None:
        """The batch's handled messages (JOINs), outside the batch lock, each answered to its sender."""
        deferred, self._deferred = self._deferred, []
        for handler, data, src in deferred:
            try:
                answer = handler(memoryview(data), src)
            except Exception:  # one bad packet (or a bug it triggers) must not stop the path
                self.errors += 1
                log.exception("user-space path: handling a %d-byte message from %s failed", len(data), src)
                continue
            if answer is not None:
                self._sendto(sock, answer, src)

    def _answer(self, sock: socket.socket, n: int, verdicts: dict[int, Verdict | None]) -> None:
        """Send the batch's answers in packet order: the kernel's by sendmmsg, the model's by sendto."""
        built = np.flatnonzero(self._batch.out_kind[:n] >= fastpath.TO_GROUP)
        done = 0
        for i in sorted(verdicts):
            verdict = verdicts[i]
            if verdict is None or verdict.action != "tx":
                continue
            upto = int(np.searchsorted(built, i))
            self._send_built(sock, built[done:upto])
            done = upto
            for addr in verdict.addrs:
                self._sendto(sock, verdict.out, addr)
        self._send_built(sock, built[done:])

    def _send_built(self, sock: socket.socket, idx: np.ndarray) -> None:
        """The kernel's answers to packets ``idx`` (in order): results to their job's group, running
        sums to their sender."""
        if not len(idx):
            return
        batch = self._batch
        if self._sender is not None:
            stage = batch.stage
            jobs = stage[idx, 4].astype(np.int64) << 8 | stage[idx, 5]
            fj = self._fast.jobs.get(int(jobs[0]))
            if fj is not None and fj.group_names is not None and len(fj.group_names) == 1 and (jobs == jobs[0]).all() \
                    and (batch.out_kind[idx] == fastpath.TO_GROUP).all():   # the common case: one multicast group
                self.send_errors += self._sender.send(sock, idx, batch.out_len[idx], fj.group_names)
                return
        for i in idx.tolist():
            if batch.out_kind[i] == fastpath.TO_GROUP:
                fj = self._fast.jobs.get(self._job_of(i))
                for addr in fj.group if fj is not None else ():   # (a handler may have removed it)
                    self._sendto(sock, batch.answer(i), addr)
            else:
                self._sendto(sock, batch.answer(i), sockaddr_addr(batch.names[i]))

    def _job_of(self, i: int) -> int:
        return int.from_bytes(self._stage[i * self._batch.rec + 4:i * self._batch.rec + 6], "big")

    def _slow(self, i: int) -> Verdict | None:
        """Packet ``i`` of the batch by its handler or its job's model; None: nothing to send."""
        batch = self._batch
        size = int(batch.sizes[i])
        data = self._stage[i * batch.rec:i * batch.rec + size]
        src = sockaddr_addr(batch.names[i])
        try:
            handler = self.handlers.get(data[3]) if size >= HEADER_SIZE else None
            if handler is not None:   # run once the batch is done (_run_handlers)
                self._deferred.append((handler, bytes(data), src))
                return None
            job = self._job_of(i) if size >= 6 else NO_JOB
            held = self._kernel_held.get(job)
            if held is not None and size >= HEADER_SIZE and data[3] in (MsgType.CONTRIB, MsgType.REREAD) \
                    and int.from_bytes(data[12:16], "big") % held[0] < held[1]:
                model = self._route.get(job)
                if model is not None and size - HEADER_SIZE not in model.packet_sizes(job):
                    return model.refuse(job, DropReason.BAD_COUNT)   # not the kernel slot's size
                if held[2] is not None:
                    return held[2](bytes(data), src)      # the kernel's slot: its program decides
            if size >= HEADER_SIZE and data[3] == MsgType.RESULT:   # from a rack job's upper aggregator?
                model = next((m for m in self._models.values() if m.relays(job, src)), self.model)
                return model.process(data, src, int(batch.nows[i]))
            return self._route.get(job, self.model).process(data, src, int(batch.nows[i]))
        except Exception:  # one bad packet (or a bug it triggers) must not stop the path
            self.errors += 1
            log.exception("user-space path: handling a %d-byte packet from %s failed", size, src)
            return None

    def _sendto(self, sock: socket.socket, data: bytes, addr: Addr) -> None:
        try:
            sock.sendto(data, addr)
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.ENOBUFS, errno.EPERM, errno.ECONNREFUSED):
                raise
            self.send_errors += 1

    def start(self) -> "UserspaceAggregator":
        if self._thread is None:
            self._stopping.clear()
            self._thread = threading.Thread(target=self._run, name="aggd-userspace", daemon=True)
            self._thread.start()
        return self

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        while not self._stopping.is_set():
            self.serve_once(0.05)

    def _stop_serving(self) -> None:
        if self._thread is not None:
            self._stopping.set()
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        self._stop_serving()
        for s in self._socks:
            s.close()

    def __enter__(self) -> "UserspaceAggregator":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
