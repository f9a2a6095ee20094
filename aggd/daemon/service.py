"""The daemon's core: the registry applied to the data planes, persisted, and served to aggctl.

``Service`` owns the job registry (``aggd.core.registry``), the fast data plane (``[dataplane] kind``:
the XDP program with its kernel slots and pinned maps, or the aggd P4 program on a switch, driven
over P4Runtime: ``aggd.dataplane``), the user-space path (``aggd.dataplane.userspace.server``: chunks and jobs the
kernel cannot hold, and JOINs), and the state file. Every change goes registry -> data planes -> state file, under one lock (JOINs
arrive on the user-space thread, aggctl requests on the main thread).

Restart. The XDP maps are pinned, so a restarted daemon finds jobs, members and half-summed slots
where the old one left them; state.json (rewritten atomically on every change) has what the maps
do not: names, tokens, strategies. A job whose kernel entry still matches the registry keeps its
slots; one that does not (maps removed, e.g. after a reboot) is installed afresh. User-space slots
live in memory-mapped files under ``[state] dir``/userspace (``aggd.dataplane.userspace.keep``), so
they come back too; those files are sparse and a slot takes memory only once packets reach it, so an
idle job costs the daemon next to nothing and creating one is quick. With a P4 switch every job is
installed afresh at start (its switch slots start empty).

"Kernel" in the registry and in aggctl's JSON means the fast data plane's slots: the switch's with
``kind = "p4"``.
"""
from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import shutil
import socket
import threading
import time
import types
from contextlib import nullcontext
from pathlib import Path

from aggd_client import protocol as proto
from aggd_client.protocol import Header

from aggd.core import hotswap
from aggd.core import strategy as strat
from aggd.core.departures import Restart, restart_of

from aggd.dataplane.xdp import loader as xdp_loader
from aggd.dataplane.xdp import ops as xdp_ops
from aggd.daemon.config import Config, applied
from aggd.daemon.control import ControlError, check_args
from aggd.dataplane import DataPlaneError, holding, max_round, member_rows
from aggd.core.model import Bound, Upstream
from aggd.core.registry import Job, Limits, Registry, RegistryError, answer_join
from aggd.daemon.shard_reports import ShardReports
from aggd.daemon.upstream import UpstreamLinks

log = logging.getLogger("aggd")

STATE_FILE = "state.json"
#: Under [state] dir: the user-space path's slots, kept across restarts (aggd.dataplane.userspace.keep).
USERSPACE_DIR = "userspace"
BPF_FS_MAGIC = 0xCAFE4A11


class ServiceError(RuntimeError):
    pass


def _write_atomically(path: Path, text: str) -> None:
    """Write ``text`` so that ``path`` holds the old or the new content, never a mix (SIGKILL-safe)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _bpffs_mounts() -> list[str]:
    with open("/proc/self/mounts") as f:
        return [line.split()[1] for line in f if line.split()[2] == "bpf"]


def ensure_bpffs(pin_dir: str) -> None:
    """Make sure ``pin_dir`` is on a bpffs; mount one on /sys/fs/bpf if that is where it belongs."""
    if any(pin_dir == m or pin_dir.startswith(m.rstrip("/") + "/") for m in _bpffs_mounts()):
        return
    if not pin_dir.startswith("/sys/fs/bpf/"):
        raise ServiceError(f"dataplane.pin_dir {pin_dir} is not on a bpf filesystem (mount one there)")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(b"bpf", b"/sys/fs/bpf", b"bpf", 0, None) != 0:
        err = ctypes.get_errno()
        raise ServiceError(f"cannot mount bpffs on /sys/fs/bpf: {os.strerror(err)} (needs CAP_SYS_ADMIN; "
                           f"or mount it before starting: mount -t bpf bpf /sys/fs/bpf)")
    log.info("mounted bpffs on /sys/fs/bpf")


def _warm_userspace_kernels() -> None:
    """Load the user-space path's numba kernels (a start's thread; a failure is left to the
    server's own warm-up, which raises it)."""
    try:
        from aggd.dataplane.userspace import fastpath, kernels
        kernels.warm_up()
        fastpath.warm_up()
    except Exception as exc:  # noqa: BLE001 - reported by the server's warm-up
        log.debug("early warm-up of the user-space kernels failed: %s", exc)


#: how an operator passes --reset-kernel-state, under the unit and by hand
RESET_HOW = "(under systemd: AGGD_OPTS=--reset-kernel-state in /etc/default/aggd, then remove it; by hand: " \
            "aggd --reset-kernel-state)"


def _where(netns: str | None) -> str:
    return f" in namespace {netns}" if netns else " on this host"


def interface_address(ifname: str, netns: str | None) -> str:
    """The first IPv4 address of ``ifname`` (in ``netns``)."""
    from pyroute2 import IPRoute

    # IPRoute(netns=...) would start a helper process; entering the namespace in this thread is enough
    with _netns(netns), IPRoute() as ipr:
        idx = ipr.link_lookup(ifname=ifname)
        if not idx:
            raise ServiceError(f"dataplane.interface: no interface {ifname}{_where(netns)}")
        addrs = [a.get_attr("IFA_ADDRESS") for a in ipr.get_addr(index=idx[0], family=socket.AF_INET)]
    if not addrs:
        raise ServiceError(f"dataplane.interface: {ifname}{_where(netns)} has no IPv4 address; set "
                           f"dataplane.address")
    return addrs[0]


def inspect_host(cfg: Config) -> tuple[str, str | None]:
    """The daemon's address (``dataplane.address``, or the interface's first IPv4 one) and, for the
    XDP data plane, the interface's kind (``link_kind``); ServiceError naming the key when this host
    lacks the network namespace, the interface in it, or its address."""
    dpc = cfg.dataplane
    netns = dpc.netns or None
    if netns and not Path("/run/netns", netns).exists():
        raise ServiceError(f"dataplane.netns: no network namespace {netns!r} (/run/netns/{netns} does not "
                           f"exist; `ip netns list` shows them)")
    kind = link_kind(dpc.interface, netns) if dpc.kind == "xdp" else None
    return dpc.address or interface_address(dpc.interface, netns), kind


def host_problems(cfg: Config) -> list[str]:
    """What of ``cfg`` this host lacks, by key (``aggctl config check``; a start asks ``inspect_host``)."""
    try:
        inspect_host(cfg)
    except ServiceError as exc:
        return [str(exc)]
    except PermissionError as exc:   # entering a namespace takes CAP_SYS_ADMIN: a start has it
        log.warning("dataplane.netns: not checked (%s): a start checks it", exc)
    return []


def asks_narrow_room(setting: str, kind: str, mode: str, elements: int, interface_kind: str | None) -> bool:
    """Whether narrow jobs' workers are asked for room for the result ([dataplane] narrow_room):
    "auto" asks where native XDP's frames cannot grow: in the multi-buffer build (packets above a
    page's), and on a veth (``interface_kind``, learnt by ``Service.start``). Generic mode's skbs
    and a NIC's page buffers grow."""
    if kind != "xdp" or setting == "never":
        return False
    if setting == "always":
        return True
    return mode == "native" and (elements > proto.PAGE_MAX_ELEMENTS or interface_kind == "veth")


def link_kind(ifname: str, netns: str | None) -> str | None:
    """The kind of link ``ifname`` is (in ``netns``): "veth", "bridge"..., None for a plain NIC."""
    from pyroute2 import IPRoute

    with _netns(netns), IPRoute() as ipr:
        links = ipr.get_links(ifname=ifname)
    if not links:
        raise ServiceError(f"dataplane.interface: no interface {ifname}{_where(netns)}")
    info = links[0].get_attr("IFLA_LINKINFO")
    return info.get_attr("IFLA_INFO_KIND") if info is not None else None


def _netns(name: str | None):
    if not name:
        return nullcontext()
    from aggd.dataplane.netns import in_netns
    return in_netns(name)


class Service:
    def __init__(self, config: Config, *, reset_kernel_state: bool = False):
        self.config = config
        self.reset_kernel_state = reset_kernel_state
        self._interface_kind: str | None = None   # "veth"...: the XDP interface's, once started
        self.lock = threading.RLock()
        #: job id -> its members' latest restart (``aggd.core.departures.Restart``): the round a
        #: rejoining member starts at; when every member has rejoined and no round came in between,
        #: the whole group restarted
        self._restarts: dict[int, Restart] = {}
        #: (job id, rank) -> (the round its last JOIN was answered with, the member's newest round
        #: then): a JOIN from the same address before the member sent anything newer repeats one
        #: whose answer was lost, and gets the same answer (it is no restart)
        self._answered_joins: dict[tuple[int, int], tuple[int, int | None]] = {}
        self._join_repeated = False   # the JOIN being answered is such a repeat (set by _join_round)
        self.started_at = time.time()
        self.dp = None          # aggd.dataplane.DataPlane: XdpDataPlane or P4DataPlane
        self.us = None          # UserspaceAggregator
        self.policy = None      # aggd.daemon.policy_runner.PolicyRunner: straggler detector and policy, a thread
        self.address: str | None = None
        self._locks: list[int] = []   # this daemon's interface and pinned maps (_claim)
        # The kernel's slot array is sized once, at load, from the budget and the slot size of the
        # program being loaded; a reload may lower the budget for new jobs but not grow the array.
        self.slot_bytes = config.slot_bytes  # estimate until start() measures it
        # (a switch's slots are known once its P4Info is read, at start)
        self.kernel_capacity = config.p4.slots if config.dataplane.kind == "p4" else config.kernel_slots
        self.registry = Registry(self._limits(config))
        self.departures: dict[int, int] = {}   # job id -> members declared gone since start
        self.upstream = UpstreamLinks(self)    # rack jobs' links to their upper aggregators
        self.shard_reports = ShardReports()    # sharded jobs' maps, as their members report them
        self.state_path = Path(config.state.dir) / STATE_FILE

    def _limits(self, cfg: Config) -> Limits:
        dp, jobs = cfg.dataplane, cfg.jobs
        budget = self.kernel_capacity if dp.kind == "p4" else \
            min(cfg.dataplane.kernel_memory // self.slot_bytes, self.kernel_capacity)
        # the P4 programs forward, add narrow lanes and check bounds nowhere: such jobs go to user space
        serves = xdp_loader.Serves(False, False, False) if dp.kind == "p4" else \
            xdp_loader.Serves.of(dp.elements_per_packet)
        return Limits(kernel_budget=budget,
                      elements=dp.elements_per_packet,
                      port=dp.port, userspace_port=dp.userspace_port, result_port=jobs.result_port,
                      group_base=jobs.group_base, default_slots=jobs.default_slots, max_slots=jobs.max_slots,
                      max_job_memory=jobs.max_job_memory, max_chunks=jobs.max_chunks,
                      gso=dp.mode == "native",
                      forwards_in_kernel=serves.relays, narrow_in_kernel=serves.narrow,
                      bounds_in_kernel=serves.bounds, narrow_room=self._narrow_room(cfg))

    def _narrow_room(self, cfg: Config) -> bool:
        dp = cfg.dataplane
        return asks_narrow_room(dp.narrow_room, dp.kind, dp.mode, dp.elements_per_packet, self._interface_kind)

    # -- life cycle ------------------------------------------------------------------------------
    def start(self) -> None:
        # The user-space path's numba kernels load (about 0.5 s) while the XDP program's
        # maps are built: bcc's compile runs in C without the GIL, so on two cores a start takes
        # the longer of the two, not their sum. The server's own warm-up below then finds them.
        warming = threading.Thread(target=_warm_userspace_kernels, name="aggd-warm-up", daemon=True)
        warming.start()
        from aggd.dataplane.userspace.server import UserspaceAggregator

        cfg, dpc = self.config, self.config.dataplane
        netns = dpc.netns or None
        self.address, self._interface_kind = inspect_host(cfg)
        self._claim(cfg)
        Path(cfg.state.dir).mkdir(parents=True, exist_ok=True, mode=0o700)
        if dpc.kind == "xdp":
            self.registry.with_limits(self._limits(cfg))     # ([dataplane] narrow_room "auto")
        if dpc.kind == "p4":
            self._start_p4()
        else:
            self._start_xdp()
        warming.join()
        try:
            with _netns(netns):  # sockets stay in the namespace they were made in
                self.us = UserspaceAggregator((self.address, dpc.port), dpc.elements_per_packet,
                                              extra_binds=((self.address, dpc.userspace_port),),
                                              handlers={int(proto.MsgType.JOIN): self._on_join,
                                                        int(proto.MsgType.JOIN_ACK): self.upstream.on_join_ack,
                                                        int(proto.MsgType.NACK): self.upstream.on_nack,
                                                        int(proto.MsgType.SHARDS): self._on_shards},
                                              keep_dir=Path(cfg.state.dir) / USERSPACE_DIR)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            raise ServiceError(f"dataplane.port / dataplane.userspace_port: UDP {self.address}:{dpc.port} or "
                               f":{dpc.userspace_port}{_where(netns)} is in use by another program "
                               f"(`ss -ulpn` shows which)") from None
        self._restore()
        self.us.start()
        self.upstream.start()
        from aggd.daemon.policy_runner import PolicyRunner
        self.policy = PolicyRunner(self).start()
        if dpc.kind == "p4":
            p4 = cfg.p4
            log.info("serving on %s:%d (P4 %s switch at %s), user-space port %d, %d switch slots",
                     self.address, dpc.port, p4.target, p4.grpc, dpc.userspace_port,
                     self.registry.limits.kernel_budget)
        else:
            log.info("serving on %s:%d (%s XDP on %s%s), user-space port %d, kernel budget %d slots",
                     self.address, dpc.port, dpc.mode, dpc.interface, f" in {netns}" if netns else "",
                     dpc.userspace_port, self.registry.limits.kernel_budget)

    def _claim(self, cfg: Config) -> None:
        """This daemon's locks on its interface and pinned maps (aggd.daemon.instance_lock), before
        anything touches them."""
        from aggd.daemon.instance_lock import InstanceLocked, claim
        dpc = cfg.dataplane
        if dpc.kind != "xdp":
            return
        where = f"{dpc.interface}{_where(dpc.netns or None)}"
        try:
            self._locks = [claim(f"if.{dpc.netns or '-'}.{dpc.interface}", f"dataplane.interface {where}"),
                           claim(f"pins.{dpc.pin_dir}", f"dataplane.pin_dir {dpc.pin_dir}")]
        except InstanceLocked as exc:
            raise ServiceError(str(exc)) from None

    def _start_p4(self) -> None:
        """Connect to the switch (P4Runtime, and its registers), push the program if configured,
        write the switch-wide entries. Any failure is a ServiceError naming the address."""
        from aggd.dataplane.p4.backend import P4DataPlane
        from aggd.dataplane.p4.p4info import P4INFO, TNA_P4INFO
        cfg, p4 = self.config, self.config.p4
        tofino = p4.target == "tofino"
        reg_address = p4.registers or ("127.0.0.1:50052" if tofino else "127.0.0.1:9090")
        where = f"the P4 switch at {p4.grpc} (registers at {reg_address}" + \
            (f" in netns {p4.registers_netns})" if p4.registers_netns else ")")
        if self.address not in p4.hosts:
            raise ServiceError(f"p4.hosts has no entry for this host, {self.address} (the daemon's address): "
                               f"the switch could not pass it what it does not aggregate, nor JOINs")
        if p4.registers_netns and not Path("/run/netns", p4.registers_netns).exists():
            raise ServiceError(f"p4.registers_netns: no network namespace {p4.registers_netns} (/run/netns)")
        registers = None
        try:
            with _netns(p4.registers_netns or None):  # the connection stays in the namespace it was made in
                if tofino:
                    from aggd.dataplane.p4.bfrt import BfrtRegisters
                    registers = BfrtRegisters(reg_address, program=p4.program, device_id=p4.device_id)
                else:
                    from aggd.dataplane.p4.thrift import Bmv2Registers
                    registers = Bmv2Registers(reg_address)
            self.dp = P4DataPlane(
                p4.grpc, address=self.address, port=cfg.dataplane.port, hosts=p4.hosts,
                elements=cfg.dataplane.elements_per_packet, total_slots=p4.slots or None,
                registers=registers, own_registers=True,
                p4info=p4.p4info or (TNA_P4INFO if tofino else P4INFO), device_config=p4.device_config or None,
                device_id=p4.device_id, election_id=p4.election_id, target=p4.target, timeout=p4.timeout)
        except DataPlaneError as exc:  # P4Error: gRPC, Thrift / BF Runtime, P4Info, the program's sizes
            if registers is not None and self.dp is None:
                registers.close()
            raise ServiceError(f"{where}: {exc}") from None
        self.kernel_capacity = self.dp.total_slots
        self.registry.with_limits(self._limits(cfg))

    def _start_xdp(self) -> None:
        from aggd.dataplane.xdp.loader import PinnedLayoutError, XdpDataPlane, XdpError, remove_pinned

        cfg, dpc = self.config, self.config.dataplane
        netns = dpc.netns or None
        ensure_bpffs(dpc.pin_dir)
        sizes = xdp_ops.probe_value_sizes(dpc.elements_per_packet)
        self.slot_bytes = sizes["slots"]
        self.kernel_capacity = dpc.kernel_memory // self.slot_bytes
        self.registry.with_limits(self._limits(cfg))
        if self.reset_kernel_state:
            log.warning("removing pinned maps in %s (--reset-kernel-state)", dpc.pin_dir)
            remove_pinned(dpc.pin_dir)
        problems = xdp_ops.pinned_layout_problems(dpc.pin_dir, sizes)
        if problems:
            raise ServiceError(f"the maps pinned in {dpc.pin_dir} were made by another XDP program "
                               f"({'; '.join(problems)}): start once with --reset-kernel-state {RESET_HOW} "
                               f"(jobs are kept, their kernel slots start empty)")
        try:
            # The array holds at least one slot (a map cannot be empty); the registry never hands
            # out more than the budget, so with a budget of 0 that slot stays unused.
            self.dp = XdpDataPlane(dpc.interface, mode=dpc.mode, port=dpc.port,
                                   elements=dpc.elements_per_packet, total_slots=max(1, self.kernel_capacity),
                                   netns=netns, pin_dir=dpc.pin_dir)
        except PinnedLayoutError as exc:
            raise ServiceError(f"{exc}: restore the old settings, or start once with --reset-kernel-state "
                               f"{RESET_HOW} (jobs are kept, their kernel slots start empty)") from None
        except XdpError as exc:
            raise ServiceError(str(exc)) from None
        if xdp_ops.slot_size(self.dp) != self.slot_bytes:
            raise ServiceError(f"a kernel slot takes {xdp_ops.slot_size(self.dp)} bytes, the probe said "
                               f"{self.slot_bytes}: the budget would be wrong")

    def stop(self, failed_start: bool = False) -> None:
        """Detach XDP (or leave the switch) and stop serving; the pinned maps stay unless configured
        otherwise, or unless this start pinned them and failed (``failed_start``: they hold nothing a
        later start needs, and the kernel memory they take is the user's)."""
        if self.policy is not None:
            self.policy.stop()
            self.policy = None
        self.upstream.stop()
        self._keep_rounds()
        for fd in self._locks:   # a later start in this process takes them again
            os.close(fd)
        self._locks = []
        planes, self.dp, self.us = self.planes[::-1], None, None
        failed = None
        for plane in planes:  # the user-space path first: it answers what XDP passes on
            made_here = failed_start and getattr(plane, "pins_made", False)
            try:
                plane.stop(unpin=self.config.dataplane.unpin_on_stop or made_here)
            except Exception as exc:  # noqa: BLE001 - stop the others, then say it
                failed = failed or exc
        if failed is not None:
            raise failed

    def _keep_rounds(self) -> None:
        """Record in the state file, per job, the round after the newest any member sent
        (``Job.resume_round``): the next start may find the data planes' rounds gone."""
        if self.us is None:
            return
        with self.lock:
            changed = False
            for job in self.registry.jobs.values():
                try:
                    top = max_round(self._holding(job), job)
                except Exception as exc:  # noqa: BLE001 - a stop goes on; the floor is only lower
                    log.warning("job %s: its newest round could not be read at stop: %s", job.name, exc)
                    continue
                if top is not None and top + 1 > job.resume_round:
                    job.resume_round, changed = top + 1, True
            if changed:
                self._save()

    def healthy(self) -> bool:
        return self.us is not None and self.us.attached and self.dp is not None

    # -- persistence -----------------------------------------------------------------------------
    def _save(self) -> None:
        _write_atomically(self.state_path, json.dumps(self.registry.to_json(), indent=1) + "\n")

    def _restore(self) -> None:
        if self.state_path.exists():
            try:
                self.registry.load_json(json.loads(self.state_path.read_text()))
            except (ValueError, KeyError, TypeError, RegistryError) as exc:
                raise ServiceError(f"cannot read {self.state_path}: {exc}") from None
        kernel_jobs = set(self.dp.active_jobs())
        for job in self.registry.list():
            kept = job.id in kernel_jobs and self._kernel_matches(job)
            self._apply(job, keep_kernel=kept)
            log.info("job %s (%d): restored, %s", job.name, job.id,
                     "kernel slots kept" if kept else "kernel slots installed empty")
        for orphan in kernel_jobs - set(self.registry.jobs):
            log.warning("job id %d is in the pinned maps but not in %s: removed", orphan, self.state_path)
            self.dp.remove_job(orphan)
        kept = Path(self.config.state.dir) / USERSPACE_DIR
        for folder in kept.glob("job-*") if kept.is_dir() else ():
            if folder.name.removeprefix("job-") not in {str(j) for j in self.registry.jobs}:
                shutil.rmtree(folder, ignore_errors=True)   # a job deleted while no daemon ran
        self._save()

    def _kernel_matches(self, job: Job) -> bool:
        return self.dp.installed(job.id) == (job.world, job.slots, job.kernel_base, job.kernel_slots)

    # -- applying the registry to the data planes --------------------------------------------------
    @property
    def planes(self) -> tuple:
        """The data planes, fast one first: the XDP program (or the switch), then the user-space
        path, which serves every chunk the fast one passes on."""
        return tuple(p for p in (self.dp, self.us) if p is not None)

    def _apply(self, job: Job, keep_kernel: bool = False) -> None:
        """Install ``job`` in every data plane (the kernel's slots kept if ``keep_kernel``); a
        quarantined member's address is not (its packets are refused as not a member's)."""
        members = {r: m.address for r, m in job.members.items() if not job.quarantined(r)}
        tags = {r: m.tag for r, m in job.members.items()}
        cfg = types.SimpleNamespace(job=job.id, world=job.world, slots=job.slots, max_chunks=job.max_chunks,
                                    members=members, tags=tags, group=job.group, kernel_slots=job.kernel_slots,
                                    elements=job.elements, precision=job.precision,
                                    bound=None if job.max_abs is None else Bound.of(job.max_abs),
                                    norm_bound=None if job.max_norm is None else Bound.of(job.max_norm),
                                    combine=job.combine_rule,
                                    upstream=Upstream(job.upstream.server) if job.upstream is not None else None,
                                    # the user-space path keeps this job's slots across restarts
                                    identity=f"{job.name}@{job.created_at!r}")
        for plane in self.planes:
            if plane is self.dp and keep_kernel:
                for rank in range(proto.MAX_MEMBERS):
                    plane.set_member(job.id, rank, members.get(rank), tags.get(rank, 0))
                continue
            plane.install_job(cfg)
        base, count = self.dp.allocation(job.id)
        if (base, count) != (job.kernel_base, job.kernel_slots):
            log.warning("job %s: the kernel placed its slots at %d+%d, the registry planned %d+%d",
                        job.name, base, count, job.kernel_base, job.kernel_slots)
            job.kernel_base, job.kernel_slots = base, count
        if self.us is not None:
            # the kernel's slots are never served here too: a narrow job's packet the kernel could
            # not grow the frame of goes back to it, any other job's of another size is dropped
            rerun = getattr(self.dp, "rerun", None) if job.precision != proto.Precision.INT32 else None
            self.us.hand_back(job.id, job.slots, job.kernel_slots, rerun)
        table = job.strategy_table()
        if len(table.entries) > 1 or job.strategy.kind != proto.StrategyKind.SYNC:
            self._install_strategies(job, table)
        if job.gone:
            self._set_awaited(job)
        if job.upstream is not None:
            self.upstream.want(job)

    def _on_shards(self, data: memoryview, src: tuple[str, int]) -> None:
        """A sharded job's member reports its map (runs on the user-space thread; never answered)."""
        with self.lock:
            changed = self.shard_reports.take(bytes(data), src, self.registry)
        if changed is not None:
            log.info("job %d: shard map version %d from call %d, weights %s: %s", *changed)
        return None

    def listen_for(self, group: tuple[str, int]) -> None:
        """The user-space path also serves what arrives for ``group`` (a rack job's upper results)."""
        with _netns(self.config.dataplane.netns or None):   # its socket lives where the others do
            self.us.listen(group, self.address)

    def _set_awaited(self, job: Job) -> None:
        """Tell every data plane which members the job's rounds wait for (DataPlaneError: one
        cannot; the caller undoes)."""
        for plane in self.planes:
            plane.set_awaited(job.id, job.awaited)

    def _install_strategies(self, job: Job, table) -> None:
        """Give every data plane the job's strategy table; ControlError (and nothing changed) if
        one cannot run it."""
        entries = table.table_entries()
        try:
            for plane in self.planes:
                plane.check_strategies(entries)  # refused before anything changed anywhere
            for plane in self.planes:
                plane.set_strategy(job.id, entries)
        except DataPlaneError as exc:
            raise ControlError("unsupported", f"job {job.name}: {exc}") from None

    # -- JOIN (runs on the user-space thread) ---------------------------------------------------------
    def _join_round(self, outcome, rank: int) -> int:
        """The round an accepted member starts at: 0 for a member joining for the first time (the
        others wait for it in round 0); for one declared gone, or restarted (it had joined before),
        its restart's round (``aggd.core.departures.restart_of``): the round after the newest any
        member sent when the first of the members restarting together rejoined. It has nothing for
        the rounds in progress, which stop waiting for it once it is declared gone."""
        job = outcome.job
        rounds = self._rounds(job)[1]
        newest = rounds.get(rank)
        before = self._answered_joins.get((job.id, rank))
        self._join_repeated = before is not None and not outcome.changed and before[1] == newest
        if self._join_repeated:
            return before[0]
        if rank not in job.gone and not outcome.rejoined:
            first = 0
        else:
            top, floor = max_round(self._holding(job), job), job.round_floor()
            if floor and (top is None or top < floor - 1):
                top = floor - 1   # the data plane lost its rounds (a reboot, a reset)
            restart = self._restarts[job.id] = restart_of(self._restarts.get(job.id), rank, rounds, top)
            first = restart.round
            if job.upstream is not None and restart.ranks == {rank}:
                self.upstream.relink(job.id, f"its workers restart (rank {rank} rejoined)")
        self._answered_joins[(job.id, rank)] = (first, newest)
        return first

    def restart_waits_for(self, job: Job) -> int:
        """The members a restart under way waits for, as a bitmap (0: none): they have not rejoined
        yet, and are starting, as at the job's start, not silent (``silent_members``)."""
        restart = self._restarts.get(job.id)
        if restart is None or not restart.under_way(self._rounds(job)[1]):
            return 0
        return restart.waiting_for(job.world)

    def _on_join(self, data: memoryview, src: tuple[str, int]) -> bytes | None:
        with self.lock:
            answer, outcome = answer_join(self.registry, data, src, time.time(), round_of=self._join_round)
            if outcome is None:
                log.info("a JOIN too short for its header from %s:%d ignored", src[0], src[1])
            elif outcome.code != proto.NackCode.NONE:
                log.warning("join refused (%s) from %s:%d: %.200s", outcome.code.name, src[0], src[1],
                            outcome.message)
            elif outcome.changed:
                job, rank = outcome.job, Header.unpack(data).rank
                for plane in self.planes:
                    plane.set_member(job.id, rank, src, job.members[rank].tag)
                log.info("job %s: rank %d joined from %s:%d", job.name, rank, src[0], src[1])
                if rank in job.gone:       # back: awaited once it keeps pace (the policy runner)
                    job.gone[rank]["round"] = self._answered_joins[(job.id, rank)][0]
                self._save()
            if outcome is not None and outcome.code == proto.NackCode.NONE and outcome.rejoined \
                    and not self._join_repeated:
                # a restarted member, from a new port or (a fixed one) the same address
                self._count_rejoin(outcome.job, Header.unpack(data).rank)
            return answer

    def _count_rejoin(self, job: Job, rank: int) -> None:
        """A restarted member rejoined. Once every member has (torchrun restarts the whole group
        after a failure; a script is run again), the rounds their old selves left open can never
        complete: the job's rounds are dropped from every data plane, and members declared gone
        meanwhile are awaited again, so the group starts afresh at its restart's round
        (docs/protocol.md, "Members declared gone")."""
        restart = self._restarts.get(job.id)
        if restart is None or len(restart.ranks) < job.world:
            return
        # every member restarted: the slots hold only the old workers' rounds, and rounds the
        # first of the new ones opened meanwhile, which their retransmissions open again. Left,
        # an old round blocks a chunk the new run sends first with more chunks than the old run's
        # last tensor (its predecessor, by the new members' skip 0, never opened: busy for good).
        del self._restarts[job.id]
        for plane in self.planes:
            plane.clear_rounds(job.id)
        back = sorted(job.gone)
        for r in back:
            self.registry.readmit(job.id, r)
        if back:
            self._set_awaited(job)
        log.info("job %s: every member restarted; the rounds left open are dropped and the job goes on from "
                 "round %d%s", job.name, restart.round, f" (ranks {back} awaited again)" if back else "")

    # -- reload --------------------------------------------------------------------------------------
    def reload(self, new: Config) -> list[str]:
        """Apply what a SIGHUP can change; return the changed keys that need a restart (their
        running values stay until then)."""
        with self.lock:
            new, waiting = applied(self.config, new)
            self.config = new
            self.registry.with_limits(self._limits(new))
            wanted = new.dataplane.kernel_memory // self.slot_bytes
            if new.dataplane.kind == "xdp" and wanted > self.kernel_capacity:
                log.warning("dataplane.kernel_memory grew to %d slots; the kernel array holds %d until a "
                            "restart with --reset-kernel-state", wanted, self.kernel_capacity)
            return waiting

    # -- aggctl requests ---------------------------------------------------------------------------------
    #: Each aggctl command's arguments and their kinds (aggd.daemon.control.check_args): a request
    #: is checked against them before its handler runs.
    COMMANDS = {
        "status": {},
        "jobs.list": {},
        "jobs.create": {"name": "text", "world": "int", "strategy": "text?", "slots": "int?",
                        "elements": "int?", "kernel_slots": "int?", "headroom": "int?", "token": "text?",
                        "upstream": "object?", "precision": "int?", "max_abs": "number?", "max_norm": "number?",
                        "quarantine_after": "int?", "combine": "text?", "score_rho": "number?",
                        "score_after": "int?"},
        "jobs.delete": {"job": "job"},
        "jobs.show": {"job": "job"},
        "workers": {"job": "job"},
        "workers.remove": {"job": "job", "rank": "int", "reason": "text?"},
        "workers.readmit": {"job": "job", "rank": "int"},
        "strategy.show": {"job": "job"},
        "strategy.set": {"job": "job", "strategy": "text", "from_round": "int?"},
    }

    def dispatch(self, cmd: str, args: dict):
        spec = self.COMMANDS.get(cmd)
        if spec is None:
            shown = cmd if len(cmd) <= 40 else cmd[:37] + "..."
            raise ControlError("bad_request", f"unknown command {shown!r} (known: {', '.join(self.COMMANDS)})")
        handler = getattr(self, "cmd_" + cmd.replace(".", "_"))
        args = check_args(cmd, args, spec)
        with self.lock:
            try:
                return handler(**args)
            except RegistryError as exc:
                raise ControlError(exc.kind, str(exc)) from None
            except DataPlaneError as exc:  # refused by the XDP program or the switch
                raise ControlError("dataplane", str(exc)) from None
            except TypeError as exc:
                raise ControlError("bad_request", f"{cmd}: {exc}") from None

    def _job(self, job) -> Job:
        return self.registry.get(job)

    def _rounds(self, job: Job) -> tuple[int | None, dict[int, int]]:
        """(highest round, {rank: its highest round}) over the planes that hold the job's slots."""
        tops, per = [], {}
        for plane in self._holding(job):
            top, ranks = plane.job_rounds(job.id)
            if top is not None:
                tops.append(top)
            for r, v in ranks.items():
                per[r] = max(per.get(r, v), v)
        return (max(tops) if tops else None), per

    def _holding(self, job: Job) -> tuple:
        return holding(self.planes, job)

    def open_rounds(self, job: Job) -> list[tuple[int, int, int]] | None:
        """(round, bitmap, t_first ns) of the job's open rounds on every plane holding its slots;
        None when a plane cannot tell."""
        out = []
        for plane in self._holding(job):
            mine = plane.open_rounds(job.id)
            if mine is None:
                return None
            out += mine
        return out

    def member_stats(self, job: Job) -> list[dict] | None:
        """Per rank, the member counters of the planes holding the job's slots, summed."""
        return member_rows(self._holding(job), job)

    def _paths(self, job: Job) -> dict:
        """Counters of each path: what the kernel served, what it passed up, what user space served."""
        return {name: {"counters": s.counters, "drops": s.drops}
                for name, s in (("kernel", self.dp.job_stats(job.id)), ("userspace", self.us.job_stats(job.id)))}

    def cmd_status(self):
        cfg, dpc = self.config, self.config.dataplane
        lim = self.registry.limits
        used = self.registry.kernel_used()
        p4 = dpc.kind == "p4"
        dataplane = {"kind": dpc.kind, "interface": dpc.interface, "netns": dpc.netns or None, "mode": dpc.mode,
                     "address": self.address, "port": dpc.port, "userspace_port": dpc.userspace_port,
                     "elements": dpc.elements_per_packet, "pin_dir": dpc.pin_dir,
                     "attached": bool(self.dp and self.dp.attached)}
        if p4:  # no XDP on this host: the switch, where it is and what it holds
            dataplane.update(mode=None, pin_dir=None, p4={
                "target": cfg.p4.target, "grpc": cfg.p4.grpc, "registers": cfg.p4.registers or None,
                "device_id": cfg.p4.device_id, **(self.dp.describe() if self.dp else {})})
        return {
            "pid": os.getpid(), "started_at": self.started_at, "uptime": time.time() - self.started_at,
            "config": cfg.source,
            "dataplane": dataplane,
            # "kernel": the fast data plane's slots (the switch's with kind = "p4": no kernel memory)
            "kernel": {"budget_bytes": None if p4 else dpc.kernel_memory, "slot_bytes": None if p4 else self.slot_bytes,
                       "budget_slots": lim.kernel_budget,
                       "array_slots": self.kernel_capacity if p4 else max(1, self.kernel_capacity),
                       "used_slots": used, "free_slots": max(0, lim.kernel_budget - used),
                       "largest_free_run": self.registry.largest_free_run()},
            "userspace": self.us.describe() if self.us else {"alive": False},
            # packets refused before their job was known (malformed, foreign, unknown job), by path
            "no_job_drops": {name: plane.job_stats(None).drops
                             for name, plane in (("kernel", self.dp), ("userspace", self.us)) if plane is not None},
            # each job's drops by path and reason (those that happened): every counter the metrics have
            "jobs": [{**self._summary(j), **self._policy_view(j),
                      "drops": {path: {r: n for r, n in s["drops"].items() if n}
                                for path, s in self._paths(j).items()}}
                     for j in self.registry.list()],
        }

    def _policy_view(self, job: Job, rank: int | None = None) -> dict:
        """The straggler detector's and the policy's view of a job (or of one of its ranks)."""
        return self.policy.view(job, rank) if self.policy is not None else {}

    @staticmethod
    def _in_force(job: Job, top: int | None) -> dict:
        """The strategy governing the job's newest round ``top`` (None: none yet): ``strategy``,
        ``strategy_version``; and the newer versions waiting for their first rounds (``pending``:
        strategy, version, from_round each, oldest first): the table's newest entry is not in force
        until then."""
        version, in_force = job.strategy_table().governing(0 if top is None else top)
        pending = [{"strategy": t, "version": v, "from_round": r} for v, r, t in job.strategies if v > version]
        return {"strategy": str(in_force), "strategy_version": version, "pending": pending}

    def _summary(self, job: Job) -> dict:
        return {"name": job.name, "id": job.id, "world": job.world, "joined": len(job.members),
                **self._in_force(job, self._rounds(job)[0]), "slots": job.slots, "kernel_slots": job.kernel_slots,
                "userspace_slots": job.userspace_slots, "elements": job.elements,
                "precision": job.precision_bits, "gone": sorted(job.gone)}

    def cmd_jobs_list(self):
        return [self._summary(j) for j in self.registry.list()]

    def cmd_jobs_create(self, name, world, strategy="sync", slots=None, elements=None, kernel_slots=None,
                        headroom=None, token=None, upstream=None, precision=None, max_abs=None,
                        max_norm=None, quarantine_after=None, combine=None, score_rho=None, score_after=None):
        job = self.registry.create(name, world, strategy=strategy, slots=slots, elements=elements,
                                   kernel_slots=kernel_slots, headroom=headroom, token=token, upstream=upstream,
                                   precision=precision, max_abs=max_abs, max_norm=max_norm,
                                   quarantine_after=quarantine_after,
                                   combine=combine, score_rho=score_rho, score_after=score_after,
                                   now=time.time())
        try:
            self._apply(job)
        except BaseException:
            self.registry.delete(job.id)
            for plane in self.planes:
                plane.remove_job(job.id)
            raise
        self._save()
        log.info("job %s (%d) created: world %d, %s, %d-bit contributions, %d slots (%d in the kernel)",
                 job.name, job.id, job.world, job.strategy, job.precision_bits, job.slots, job.kernel_slots)
        return job.describe()

    def cmd_jobs_delete(self, job):
        j = self.registry.delete(job)
        self.departures.pop(j.id, None)
        self.upstream.drop(j.id)
        self.shard_reports.forget(j.id)
        # its members' JOIN history: a job created later may get the same id
        self._restarts.pop(j.id, None)
        for key in [k for k in self._answered_joins if k[0] == j.id]:
            del self._answered_joins[key]
        for plane in self.planes:
            plane.remove_job(j.id)
        self._save()
        log.info("job %s (%d) deleted; %d kernel slots freed", j.name, j.id, j.kernel_slots)
        return {"name": j.name, "id": j.id, "freed_kernel_slots": j.kernel_slots}

    def cmd_jobs_show(self, job):
        j = self._job(job)
        top, _ = self._rounds(j)
        d = {**j.describe(), **self._in_force(j, top)}
        d["paths"] = self._paths(j)
        if j.upstream is not None:
            d["upstream"]["link"] = self.upstream.describe(j.id)
        d["shards"] = self.shard_reports.describe(j.id)
        d["dataplane"] = self.config.dataplane.kind    # the "kernel" path is the switch's with "p4"
        d["round"] = top
        return d

    # -- members declared gone ---------------------------------------------------------------------
    def depart(self, job: Job, rank: int, reason: str, at_round: int | None = None,
               quarantine: bool = False) -> Job:
        """Declare ``rank`` gone: rounds stop waiting for it (``aggd.core.departures``); with
        ``quarantine`` its address leaves the data planes too (its contributions count no more, its
        JOINs are refused) until it is readmitted by hand. RegistryError or ControlError, and
        nothing changed, when refused."""
        if at_round is None:
            at_round = (max_round(self._holding(job), job) or 0) + 1
        self.registry.depart(job.id, rank, reason, time.time(), at_round, quarantined=quarantine)
        if quarantine:
            for plane in self.planes:
                plane.set_member(job.id, rank, None)
        try:
            self._set_awaited(job)
        except DataPlaneError as exc:
            self.registry.readmit(job.id, rank)
            self._set_awaited(job)
            raise ControlError("unsupported", f"job {job.name}: rank {rank} cannot be declared gone: {exc}") from None
        self.departures[job.id] = self.departures.get(job.id, 0) + 1
        self._save()
        log.warning("job %s: rank %d declared gone from round %d: %s; rounds wait for ranks %s", job.name, rank,
                    at_round, reason, [r for r in range(job.world) if job.awaited >> r & 1])
        return job

    def readmit(self, job: Job, rank: int, reason: str) -> Job:
        """Rounds wait for ``rank`` again (a quarantined one is a member again: its address back)."""
        quarantined = job.quarantined(rank)
        self.registry.readmit(job.id, rank)
        m = job.members.get(rank)
        if quarantined and m is not None:
            for plane in self.planes:
                plane.set_member(job.id, rank, m.address, m.tag)
        self._set_awaited(job)
        self._save()
        log.warning("job %s: rank %d is awaited again: %s", job.name, rank, reason)
        return job

    def cmd_workers_remove(self, job, rank, reason=None):
        j = self._job(job)
        self.depart(j, int(rank), reason or "removed by hand (aggctl workers remove)")
        return {"job": j.name, "id": j.id, "rank": int(rank), **j.gone[int(rank)]}

    def cmd_workers_readmit(self, job, rank):
        j = self._job(job)
        self.readmit(j, int(rank), "readmitted by hand (aggctl workers readmit)")
        return {"job": j.name, "id": j.id, "rank": int(rank)}

    def cmd_workers(self, job):
        j = self._job(job)
        top, per_rank = self._rounds(j)
        stats = {int(r["rank"]): r for r in (self.member_stats(j) or [])}
        rows = []
        for rank in range(j.world):
            m = j.members.get(rank)
            # the slots' banks show recent rounds only; the member's counters keep its newest
            # (a dead member's rounds leave the banks as the others go on)
            seen = [x for x in (per_rank.get(rank), stats.get(rank, {}).get("last_round")) if x is not None]
            rows.append({"rank": rank, "address": list(m.address) if m else None,
                         "joined_at": m.joined_at if m else None, "last_round": max(seen) if seen else None,
                         "lag": None, "gone": j.gone.get(rank), "offences": int(stats.get(rank, {}).get("offences", 0)),
                         **self._policy_view(j, rank)})
        return {"job": j.name, "id": j.id, "round": top, "workers": rows, **self._policy_view(j)}

    def cmd_strategy_show(self, job):
        j = self._job(job)
        top, _ = self._rounds(j)
        # the newest version may govern only from a later round: say which one governs now
        now = self._in_force(j, top)
        return {"job": j.name, "id": j.id, "current": str(j.strategy), "version": j.strategy_version,
                "round": top, "in_force": {"strategy": now["strategy"], "version": now["strategy_version"]},
                "versions": [{"version": v, "from_round": r, "strategy": t} for v, r, t in j.strategies]}

    def cmd_strategy_set(self, job, strategy, from_round=None):
        j = self._job(job)
        if not isinstance(strategy, str):
            raise ControlError("bad_strategy", f"strategy must be text such as 'quorum:3', not {strategy!r}")
        try:
            parsed = strat.parse(strategy)
        except strat.StrategyError as exc:
            raise ControlError("bad_strategy", f"job {j.name}: bad strategy {strategy!r}: {exc}") from None
        if j.upstream is not None and parsed.kind != strat.StrategyKind.SYNC:
            raise ControlError("bad_strategy", f"job {j.name} forwards its sums to an upper aggregator (a rack "
                                               f"job): sync only, not {strategy!r}")

        def install(version: int, first: int) -> None:
            saved = list(j.strategies)
            _, table = self.registry.set_strategy(j.id, parsed, first)
            try:
                self._install_strategies(j, table)
            except BaseException:
                j.strategies = saved  # nothing changed anywhere: the registry follows the data planes
                raise
            self._save()

        try:
            _, from_round = hotswap.swap(j.strategy_table(), parsed, j.world,
                                         seen=lambda: self._rounds(j)[0], install=install,
                                         from_round=from_round)
        except hotswap.RoundPast as exc:
            raise ControlError("bad_round", f"job {j.name}: {exc}; a new strategy must start at a "
                                            f"later round") from None
        except hotswap.TableFull as exc:
            raise ControlError("table_full", f"job {j.name}: {exc}") from None
        except hotswap.SwapRaced as exc:  # installed; the operator should know the margin was short
            log.warning("job %s: %s", j.name, exc)
            raise ControlError("swap_raced", f"job {j.name}: {exc}") from None
        except strat.StrategyError as exc:
            raise ControlError("bad_strategy", f"job {j.name}: bad strategy {strategy!r}: {exc}") from None
        log.info("job %s: strategy %s from round %d (version %d)", j.name, j.strategy, from_round,
                 j.strategy_version)
        return self.cmd_strategy_show(j.id)
