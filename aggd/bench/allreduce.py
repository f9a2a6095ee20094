"""``aggctl bench allreduce``: aggd's XDP path, aggd's user-space path and Gloo on one lab.

Every system reduces the same float32 tensors (``aggd.lab.worker --reuse``: one tensor a size,
reduced ``iters`` times after ``warmup`` rounds) with the same workers in the same namespaces:

* ``aggd-xdp``: the XDP program on the aggregator's interface (port 47000);
* ``aggd-user``: the user-space aggregator (``aggd.dataplane.userspace.server``, numba kernels) in a process of its
  own in the aggregator's namespace (``aggd.lab.aggregator``), on another port, so XDP passes its
  packets up the stack untouched;
* ``aggd-xsk``: ``aggd-xdp``'s job with the workers' packets through AF_XDP sockets (copy mode on the lab's
  veths), not UDP sockets (``aggd.lab.xsk_client``: issue 20's optional transport, measured in the lab only);
* ``gloo``: torch.distributed's allreduce (gloo backend, TCP through the same bridge).

aggd's systems run at every ``precisions`` (bits a contribution value: docs/precision.md); gloo
sends float32. For a narrow job the XDP path has a user-space aggregator beside it that hands the
frames the program could not grow back to it (``UserspaceAggregator.hand_back``), as the daemon does.

A row's ``seconds_per_allreduce`` is the median over rounds of the slowest worker's time;
``worker_extra_rss_bytes`` the largest worker's peak resident memory during its rounds over what it
held before them (its tensor, the client, the libraries, after one small allreduce: ``--prime``),
less library pages first touched meanwhile (``worker_extra_file_rss_bytes``: shared code, not
memory for the tensor); ``host_cpu_seconds_per_allreduce`` and ``host_cpu_split`` what the timed
rounds cost the whole host (``aggd.lab.hostcpu``: workers, aggregator and packet path share the cores);
``aggregator_memory_bytes`` the
aggregator's: the user-space process's peak RSS, or the XDP program's BPF maps (kernel memory; the
daemon's own RSS does not grow with traffic).
"""
from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass

from aggd_client import protocol as proto

from aggd.lab.namespaces import Lab
from aggd.lab.runner import LabJob, run_workers

SYSTEMS = ("aggd-xdp", "aggd-xsk", "aggd-user", "gloo")
#: BPF map memory the bench's default slot pool may take (aggd.daemon.config.slot_bytes a slot).
DEFAULT_SLOT_MEMORY = 128 << 20
USERSPACE_PORT = 47100
GLOO_PORT = 29600
JOB = 1


class BenchError(RuntimeError):
    pass


@dataclass
class Config:
    workers: int
    elements_total: int
    iters: int
    warmup: int
    elements: int  # values a packet
    slots: int
    mode: str = "native"
    precision: int = 32   # bits a contribution value (aggd's systems)
    combine: str = "sum"  # aggd-user's: a robust job's median or trimmed:t (docs/protocol.md, "Robust jobs")
    #: narrow jobs' workers send room for the result in native mode, as the daemon asks them to
    #: ([dataplane] narrow_room "auto"); False: their frames go through the program's re-run
    narrow_room: bool = True
    #: the workers' values (``aggd.lab.worker``'s ``--pattern``): "random" (worker r's scaled by
    #: 1 + r) or "near" (by 1 + (r mod 8) / 8, within a factor of two)
    pattern: str = "random"


@contextlib.contextmanager
def userspace_aggregator(lab: Lab, elements: int, port: int = USERSPACE_PORT):
    """``aggd.lab.aggregator`` in the lab's aggregator namespace; yields a function sending it one
    command (a dict) and returning its answer."""
    proc = lab.run(lab.agg_ns, [sys.executable, "-m", "aggd.lab.aggregator", "--bind",
                                f"{lab.agg_ip}:{port}", "--elements", str(elements)],
                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def call(**req) -> dict:
        proc.stdin.write(json.dumps(req) + "\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        if not line:
            raise BenchError(f"the user-space aggregator exited: {proc.stderr.read()[-2000:]}")
        out = json.loads(line)
        if "error" in out:
            raise BenchError(out["error"])
        return out

    try:
        ready = proc.stdout.readline()
        if not ready:
            raise BenchError(f"the user-space aggregator did not start: {proc.stderr.read()[-2000:]}")
        yield call
    finally:
        if proc.poll() is None:
            proc.stdin.close()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def default_slots(elements: int) -> int:
    """The job's slot pool when the caller does not say: 4096, or what ``DEFAULT_SLOT_MEMORY``
    holds of slots of ``elements`` values (510 of 8,192: a jumbo slot's banks take 256 KiB)."""
    from aggd.daemon.config import slot_bytes
    return max(64, min(4096, DEFAULT_SLOT_MEMORY // slot_bytes(elements)))


def bpf_map_bytes(dp) -> int:
    """Kernel memory the XDP data plane's maps hold (entries × (key + value); per CPU where so)."""
    total = 0
    for name in ("jobs", "members", "slots", "stats", "clock", "member_stats"):
        t = dp.bpf[name.encode()]
        per = ctypes.sizeof(t.Key) + ctypes.sizeof(t.Leaf)
        cpus = os.cpu_count() if "PerCpu" in type(t).__name__ else 1
        total += t.max_entries * per * cpus
    return total


def _row(system: str, cfg: Config, runs, extra: dict) -> dict:
    failed = [r for r in runs if r.returncode != 0 or len(r.records) != cfg.iters]
    if failed:
        f = failed[0]
        raise BenchError(f"{system}: worker rank {f.rank} failed ({f.returncode}): {f.stderr.strip()[-2000:]}")
    per_round = [max(r.records[i]["seconds"] for r in runs) for i in range(cfg.iters)]
    sec = statistics.median(per_round)
    checked = [rec for r in runs for rec in r.records if "max_abs_error" in rec]
    n = cfg.elements_total
    nbytes = n * 4
    extra_rss = max(rec["extra_rss_bytes"] for r in runs for rec in r.records)
    extra_files = max(rec.get("extra_file_rss_bytes", 0) for r in runs for rec in r.records)
    row = {
        "system": system, "precision": 32 if system == "gloo" else cfg.precision, "workers": cfg.workers,
        "combine": cfg.combine if system == "aggd-user" else "sum",
        "bytes": nbytes, "elements": n, "iters": cfg.iters, "pattern": cfg.pattern,
        "seconds_per_allreduce": sec, "seconds_min": min(per_round), "seconds_max": max(per_round),
        "algbw_gbps": nbytes * 8 / sec / 1e9, "elements_per_s": n / sec,
        "max_abs_error": max(r["max_abs_error"] for r in checked),
        "error_bound": max(r["error_bound"] for r in checked),
        "within_bound": all(r["within_bound"] for r in checked),
        "errors": sum(0 if r["within_bound"] and r["shape_ok"] else 1 for r in checked),
        "worker_extra_rss_bytes": extra_rss, "worker_extra_rss_ratio": extra_rss / nbytes,
        "worker_extra_file_rss_bytes": extra_files,
        **_host_cpu(runs[0].records[-1].get("host_cpu_seconds"), cfg.iters),
    }
    trains = [r.records[-1].get("trains") for r in runs]
    if None not in trains:  # aggd's: reads that took a train of results (UDP GRO), warm-up included
        row["result_trains"] = sum(trains)
    row.update(extra)
    return row


@contextlib.contextmanager
def _handing_back(lab: Lab, dp, job: LabJob):
    """For a narrow job: the user-space aggregator on the aggd port of the lab's aggregator, which
    runs the frames the XDP program passed up for want of room through the program again."""
    if job.precision == 32:
        yield None
        return
    from aggd.dataplane.netns import in_netns
    from aggd.dataplane.userspace.server import UserspaceAggregator
    with in_netns(lab.agg_ns):
        agg = UserspaceAggregator((lab.agg_ip, proto.DEFAULT_PORT), elements=dp.elements)
    try:
        c = job.config(lab)
        agg.install_job(c)
        agg.hand_back(c.job, c.slots, c.slots, dp.rerun)
        yield agg.start()
    finally:
        agg.close()


def _values(cfg: Config) -> int:
    """Values a packet: the aggregator's lanes (``elements``), two a lane at 8 bits."""
    return proto.values_per_packet(cfg.elements, proto.PRECISION_OF_BITS[cfg.precision])


def run_aggd_xdp(lab: Lab, dp, cfg: Config, transport: str = "udp") -> dict:
    """The XDP path's row; with ``transport="xsk"`` the workers send and receive through AF_XDP
    sockets (system ``aggd-xsk``)."""
    job = LabJob(job=JOB, workers=list(range(cfg.workers)), slots=cfg.slots, precision=cfg.precision)
    if cfg.precision != 32 and not dp.narrow:
        raise BenchError(f"the XDP program holds {cfg.precision}-bit contributions in packets of at most "
                         f"{proto.NATIVE_MAX_ELEMENTS} values (--elements {proto.NATIVE_MAX_ELEMENTS} or fewer), "
                         f"not {cfg.elements}")
    room = cfg.narrow_room and cfg.precision != 32 and cfg.mode == "native"
    dp.install_job(job.config(lab))
    try:
        with _handing_back(lab, dp, job):
            runs = run_workers(lab, job, elements=cfg.elements, gso=(cfg.mode == "native"),
                               timeout=_timeout(cfg), extra=_worker_args(cfg) + (["--room"] if room else []) +
                               ["--transport", transport])
        counters = dp.job_stats(JOB).counters
    finally:
        dp.remove_job(JOB)
    return _row("aggd-xdp" if transport == "udp" else "aggd-xsk", cfg, runs, {
        "mode": cfg.mode, "elements_per_packet": cfg.elements, "values_per_packet": _values(cfg),
        "retransmits": counters["retransmits"],
        "handed_back": counters["to_userspace"], "room": room,
        "aggregator_memory_bytes": bpf_map_bytes(dp), "aggregator_memory": "bpf_maps"})


def run_aggd_user(lab: Lab, agg, cfg: Config) -> dict:
    job = LabJob(job=JOB, workers=list(range(cfg.workers)), slots=cfg.slots, precision=cfg.precision,
                 combine=cfg.combine)
    c = job.config(lab)
    agg(cmd="add_job", job=JOB, world=c.world, slots=c.slots, max_chunks=c.max_chunks,
        members={r: list(a) for r, a in c.members.items()}, group=list(c.group), elements=cfg.elements,
        precision=c.precision, combine=cfg.combine)
    agg(cmd="reset_peak")
    try:
        runs = run_workers(lab, job, elements=cfg.elements, gso=True, server_port=USERSPACE_PORT,
                           timeout=_timeout(cfg, slow=True), extra=_worker_args(cfg))
        stats = agg(cmd="stats", job=JOB)
    finally:
        agg(cmd="remove_job", job=JOB)
    return _row("aggd-user", cfg, runs, {
        "elements_per_packet": cfg.elements, "values_per_packet": _values(cfg),
        "retransmits": stats["counters"]["retransmits"],
        "aggregator_send_errors": stats["send_errors"],
        "aggregator_memory_bytes": stats["peak_rss_bytes"], "aggregator_memory": "peak_rss"})


def run_gloo(lab: Lab, cfg: Config, port: int) -> dict:
    job = LabJob(job=JOB, workers=list(range(cfg.workers)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": lab.worker_ifname}
    init = f"tcp://{lab.worker_ip(0)}:{port}"
    runs = run_workers(lab, job, timeout=_timeout(cfg), env=env,
                       extra=[*_worker_args(cfg), "--gloo", init])
    return _row("gloo", cfg, runs, {})


def _host_cpu(host: dict | None, iters: int) -> dict:
    """Rank 0's view of the whole host over the timed rounds: busy CPU seconds an allreduce, and
    the share of each kind (user, system, softirq, other, idle) of all CPU time."""
    if not host:
        return {}
    total = host["busy"] + host["idle"]
    return {"host_cpu_seconds_per_allreduce": host["busy"] / iters,
            # /proc/stat counts in ticks (10 ms): a window under a second is a coarse figure
            "host_cpu_window_seconds": total / (os.cpu_count() or 1),
            "host_cpu_split": {k: host[k] / total if total else 0.0
                               for k in ("user", "system", "softirq", "other", "idle")}}


def _worker_args(cfg: Config) -> list[str]:
    return ["--sizes", str(cfg.elements_total), "--rounds", str(cfg.iters), "--warmup", str(cfg.warmup),
            "--check", "last", "--reuse", "--prime", "--give-up-after", "30", "--pattern", cfg.pattern]


def _timeout(cfg: Config, slow: bool = False) -> float:
    per_round = cfg.elements_total / 1e6 * cfg.workers * (2.0 if slow else 0.3)
    return 120 + (cfg.iters + cfg.warmup) * per_round + 2 * cfg.elements_total / 1e6 * cfg.workers


@contextlib.contextmanager
def cpu_hogs(count: int):
    """``count`` processes that spin on a core each (the host's other work), stopped on exit."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def run(systems: list[str], worker_counts: list[int], sizes: list[int], *, iters: int, warmup: int,
        mode: str, elements: int, slots: int, mtu: int | None, lab_name: str, on_row=None,
        losses: tuple[float, ...] = (0.0,), hogs: tuple[int, ...] = (0,), gros: tuple[bool, ...] = (False,),
        precisions: tuple[int, ...] = (32,), combines: tuple[str, ...] = ("sum",),
        narrow_room: bool = True, pattern: str = "random") -> list[dict]:
    """Every (workers, size, loss, hogs) with every system (aggd's at every precision; aggd-user's
    with every ``combines``: "sum" and robust jobs' "median", "trimmed:t"), in that order; returns
    the rows.
    ``losses``: percentages of packets the lab's links drop (each way); ``hogs``: processes spinning
    on the host's cores meanwhile (``cpu_hogs``); ``gros``: the workers' receive path (False: the host's
    backlog, True: GRO, as a NIC: ``Lab.set_gro``); each set in turn, lowest first. A row says its
    ``slowdown_over_lossless`` (its time over the same system's, shape's and hogs' at 0% loss) and
    ``slowdown_over_quiet`` (over the same at 0 hogs) where the run had that row. ``narrow_room``,
    ``pattern``: see ``Config``."""
    from aggd.lab.runner import xdp_aggregator

    losses, hogs = tuple(sorted(set(losses))), tuple(sorted(set(hogs)))
    seconds: dict[tuple, float] = {}     # (system, precision, combine, gro, workers, bytes, loss, hogs) -> s / allreduce
    mtu = mtu or max(1500, proto.HEADER_SIZE + 4 * elements + 28)
    rows = []
    with contextlib.ExitStack() as stack:
        lab = stack.enter_context(Lab(lab_name, max(worker_counts), mtu=mtu))
        dp = stack.enter_context(xdp_aggregator(lab, elements=elements, mode=mode,
                                                total_slots=max(slots, 64))) \
            if {"aggd-xdp", "aggd-xsk"} & set(systems) else None
        agg = stack.enter_context(userspace_aggregator(lab, elements)) if "aggd-user" in systems else None
        port = GLOO_PORT
        for n in worker_counts:
            for gro, nbytes, loss, hog in itertools.product(sorted(set(gros)), sizes, losses, hogs):
                if gro != lab.gro:
                    lab.set_gro(gro)
                lab.set_loss(loss)
                for system, bits, how in [(s, b, c) for s in systems for b in (precisions if s != "gloo" else (32,))
                                          for c in (combines if s == "aggd-user" else ("sum",))]:
                    cfg = Config(n, max(1, nbytes // 4), iters, warmup, elements, slots, mode, bits, how,
                                 narrow_room, pattern)
                    with cpu_hogs(hog):
                        if system in ("aggd-xdp", "aggd-xsk"):
                            row = run_aggd_xdp(lab, dp, cfg, "udp" if system == "aggd-xdp" else "xsk")
                        elif system == "aggd-user":
                            row = run_aggd_user(lab, agg, cfg)
                        else:
                            port += 1  # a fresh rendezvous port: the last one may be in TIME_WAIT
                            row = run_gloo(lab, cfg, port)
                    row["loss_percent"], row["cpu_hogs"], row["mtu"], row["gro"] = loss, hog, mtu, gro
                    here = seconds[(system, bits, how, gro, n, nbytes, loss, hog)] = row["seconds_per_allreduce"]
                    for field, base in (("slowdown_over_lossless", (0.0, hog)), ("slowdown_over_quiet", (loss, 0))):
                        if base != (loss, hog) and (system, bits, how, gro, n, nbytes, *base) in seconds:
                            row[field] = here / seconds[(system, bits, how, gro, n, nbytes, *base)]
                    if how != "sum" and (system, bits, "sum", gro, n, nbytes, loss, hog) in seconds:
                        row["slowdown_over_sum"] = here / seconds[(system, bits, "sum", gro, n, nbytes, loss, hog)]
                    rows.append(row)
                    if on_row:
                        on_row(row)
    return rows


def ratios(rows: list[dict]) -> list[dict]:
    """Per (workers, bytes, loss, hogs) and aggd precision: algbw of aggd-xdp over gloo's, of
    aggd-user and aggd-xsk over aggd-xdp's, and ``slowdown``: (system, "lossless" or "quiet", its
    ``slowdown_over_...``) where the run had that baseline (``run``)."""
    def cond(r):
        return r["workers"], r["bytes"], r.get("loss_percent", 0.0), r.get("cpu_hogs", 0), r.get("gro", False)

    by = {(*cond(r), r["system"], r.get("precision", 32)): r for r in rows if r.get("combine", "sum") == "sum"}
    bits_seen = sorted({r.get("precision", 32) for r in rows if r["system"] != "gloo"} or {32}, reverse=True)
    out = []
    for c in sorted({cond(r) for r in rows}):
        g = by.get((*c, "gloo", 32), {}).get("algbw_gbps")
        for bits in bits_seen:
            x, k, u = (by.get((*c, s, bits), {}).get("algbw_gbps") for s in ("aggd-xdp", "aggd-xsk", "aggd-user"))
            if x is None and k is None and u is None and bits != bits_seen[0]:
                continue
            slowdown = [(s, base, r[f"slowdown_over_{base}"]) for s in SYSTEMS for base in ("lossless", "quiet")
                        if f"slowdown_over_{base}" in (r := by.get((*c, s, 32 if s == "gloo" else bits), {}))]
            out.append({"workers": c[0], "bytes": c[1], "loss_percent": c[2], "cpu_hogs": c[3], "gro": c[4],
                        "precision": bits,
                        "xdp_over_gloo": x / g if x and g else None,
                        "user_over_xdp": u / x if u and x else None,
                        "xsk_over_xdp": k / x if k and x else None,
                        "slowdown": slowdown})
    return out


def plot(rows: list[dict], path: str) -> None:
    """algbw against tensor size, a colour per system, a line style and marker per worker count."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # one curve per system and worker count: the runs with the least loss and fewest hogs
    lowest = min((r.get("loss_percent", 0.0), r.get("cpu_hogs", 0), r.get("gro", False)) for r in rows)
    rows = [r for r in rows if (r.get("loss_percent", 0.0), r.get("cpu_hogs", 0), r.get("gro", False)) == lowest]
    colours = {"aggd-xdp": "#1f77b4", "aggd-xsk": "#9467bd", "aggd-user": "#2ca02c", "gloo": "#8c564b"}
    styles = ["-", "--", ":", "-."]
    markers = ["s", "o", "^", "D"]
    workers = sorted({r["workers"] for r in rows})
    fig, ax = plt.subplots(figsize=(8, 5))
    shades = {32: 1.0, 16: 0.7, 8: 0.45}      # aggd's narrower precisions lighter
    for system in SYSTEMS:
        variants = sorted({(r.get("precision", 32), r.get("combine", "sum")) for r in rows if r["system"] == system},
                          key=lambda v: (-v[0], v[1] != "sum", v[1]))
        for bits, how in variants:
            for i, w in enumerate(workers):
                pts = sorted((r["bytes"], r["algbw_gbps"]) for r in rows
                             if r["system"] == system and r["workers"] == w and r.get("precision", 32) == bits
                             and r.get("combine", "sum") == how)
                if pts:
                    label = f"{system}{'' if bits == 32 else f' {bits}-bit'}{'' if how == 'sum' else f' {how}'}, " \
                            f"{w} workers"
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], styles[i % len(styles)],
                            marker=markers[i % len(markers)], color=colours[system], alpha=shades.get(bits, 1.0),
                            label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tensor bytes (float32)")
    ax.set_ylabel("algorithm bandwidth, Gbit/s")
    ax.set_title("allreduce in one lab (2 shared cores)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
