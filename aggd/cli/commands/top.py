"""``aggctl top``: jobs and workers, live, from the daemon's Prometheus endpoint.

Two scrapes of ``/metrics`` an interval apart give the rates (rounds/s, elements/s, the kernel's
share); gauges (strategy, lag, rounds behind) come from the newer one. The endpoint is found like
the daemon finds it: ``[metrics] address`` of the daemon's config (``--config``, ``$AGGD_CONFIG``,
``/etc/aggd/aggd.toml``, else the file of the daemon the control socket reaches), inside
``[dataplane] netns`` when that is set; ``--url`` and ``--netns`` say otherwise.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
import urllib.error
import urllib.request
from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path

import click

from aggd.cli.commands._daemon import EXIT_UNREACHABLE, DaemonError, call

DEFAULT_URL = "http://127.0.0.1:9477/metrics"
DEFAULT_CONFIG = Path("/etc/aggd/aggd.toml")

Samples = dict[str, list[tuple[dict, float]]]


# -- reading --------------------------------------------------------------------------------------------

def endpoint(url: str | None, config: str | None, netns: str | None) -> tuple[str, str | None]:
    """(URL, namespace to reach it from) from the options and the daemon's config."""
    if url is not None:
        return url, netns
    path = config or os.environ.get("AGGD_CONFIG") or (str(DEFAULT_CONFIG) if DEFAULT_CONFIG.exists() else None)
    if path is None:
        path = _running_config()
    if path is None:
        return DEFAULT_URL, netns
    from aggd.daemon.config import ConfigError, load

    try:
        cfg = load(path)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from None
    host, _, port = cfg.metrics.address.rpartition(":")
    host = f"[{host.strip('[]')}]" if ":" in host.strip("[]") else host
    return f"http://{host}:{port}/metrics", netns if netns is not None else (cfg.dataplane.netns or None)


def _running_config() -> str | None:
    """The config file of the daemon the control socket reaches (``aggctl --socket``,
    ``$AGGD_SOCKET``): a daemon started by hand with its own file; None if none answers."""
    try:
        return call("status").get("config")
    except DaemonError:
        return None


def parse(text: str) -> Samples:
    """Prometheus text exposition -> {sample name: [(labels, value)]}."""
    from prometheus_client.parser import text_string_to_metric_families

    out: Samples = defaultdict(list)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name].append((dict(s.labels), float(s.value)))
    return dict(out)


def scrape(url: str, netns: str | None = None, timeout: float = 5.0) -> tuple[float, Samples]:
    """(monotonic time, samples) of one scrape; DaemonError (exit 3) if nobody answers."""
    where = nullcontext()
    if netns:
        from aggd.dataplane.netns import in_netns
        where = in_netns(netns)
    try:
        with where:  # the socket is made (and stays) in the namespace
            with urllib.request.urlopen(url, timeout=timeout) as resp:
                text = resp.read().decode()
    except FileNotFoundError:
        raise DaemonError(f"no network namespace {netns!r}", EXIT_UNREACHABLE) from None
    except PermissionError as exc:
        raise DaemonError(f"cannot enter network namespace {netns!r}: {exc.strerror} (needs root)",
                          EXIT_UNREACHABLE) from None
    except (urllib.error.URLError, OSError) as exc:
        where_ = f" in netns {netns}" if netns else ""
        raise DaemonError(f"cannot read metrics from {url}{where_}: {getattr(exc, 'reason', exc)} "
                          f"(is aggd running? [metrics] address, --url, --netns)", EXIT_UNREACHABLE) from None
    return time.monotonic(), parse(text)


# -- the view (pure) ------------------------------------------------------------------------------------

def _by(samples: Samples, name: str, *keys: str) -> dict[tuple, float]:
    """{(label values of keys): value summed over the other labels} of one sample name."""
    out: dict[tuple, float] = defaultdict(float)
    for labels, value in samples.get(name, ()):
        out[tuple(labels.get(k, "") for k in keys)] += value
    return out


def _rate(prev: Samples, cur: Samples, dt: float, name: str, *keys: str) -> dict[tuple, float | None]:
    a, b = _by(prev, name, *keys), _by(cur, name, *keys)
    return {k: (max(0.0, v - a[k]) / dt if k in a and dt > 0 else None) for k, v in b.items()}


def _strategy_text(kind: str, param: float | None, timeout_s: float | None) -> str:
    if kind == "quorum":
        return f"quorum:{int(param or 0)}:{round((timeout_s or 0) * 1000)}ms"
    if kind == "ssp":
        return f"ssp:{int(param or 0)}"
    return kind


def view(prev: Samples, cur: Samples, dt: float, job: str | None = None) -> dict:
    """Jobs and workers from two scrapes ``dt`` seconds apart (rates over that interval)."""
    g = lambda name, *keys: _by(cur, name, *keys)  # noqa: E731
    r = lambda name, *keys: _rate(prev, cur, dt, name, *keys)  # noqa: E731
    strategy = {k[0]: k[1] for k in g("aggd_job_strategy_info", "aggd_job", "strategy")}
    version, param = g("aggd_job_strategy_version", "aggd_job"), g("aggd_job_strategy_param", "aggd_job")
    timeout = g("aggd_job_strategy_timeout_seconds", "aggd_job")
    world, joined = g("aggd_job_members", "aggd_job"), g("aggd_job_members_joined", "aggd_job")
    stragglers, switched = g("aggd_job_stragglers", "aggd_job"), g("aggd_job_policy_switched", "aggd_job")
    rounds = r("aggd_job_rounds_total", "aggd_job")
    elements = r("aggd_elements_total", "aggd_job", "path")
    drops = r("aggd_drops_total", "aggd_job")
    jobs = []
    for name in sorted(strategy):
        if job is not None and name != job:
            continue
        k = (name,)
        ek, eu = elements.get((name, "kernel")), elements.get((name, "user"))
        total = None if ek is None or eu is None else ek + eu
        jobs.append({
            "job": name, "strategy": _strategy_text(strategy[name], param.get(k), timeout.get(k)),
            "strategy_version": int(version.get(k, 0)), "policy_switched": bool(switched.get(k, 0)),
            "world": int(world.get(k, 0)), "joined": int(joined.get(k, 0)),
            "rounds_per_second": rounds.get(k), "elements_per_second": total,
            "bytes_per_second": None if total is None else 4 * total,
            "kernel_share": None if not total else ek / total,
            "drops_per_second": drops.get(k), "stragglers": int(stragglers.get(k, 0)),
        })
    names = {j["job"] for j in jobs}
    contrib = r("aggd_worker_contributions_total", "aggd_job", "rank")
    lag_sum = r("aggd_worker_arrival_lag_seconds_total", "aggd_job", "rank")
    gauges = {f: g(m, "aggd_job", "rank") for f, m in (
        ("lag_seconds", "aggd_worker_lag_seconds"), ("slowdown", "aggd_worker_slowdown_ratio"),
        ("straggler", "aggd_worker_straggler"), ("rounds_behind", "aggd_worker_rounds_behind"),
        ("blocking_seconds", "aggd_worker_blocking_seconds"), ("wait_seconds", "aggd_worker_wait_seconds_total"))}
    workers = []
    for key in sorted(g("aggd_worker_contributions_total", "aggd_job", "rank"),
                      key=lambda k: (k[0], int(k[1]) if k[1].isdigit() else 0)):
        if key[0] not in names:
            continue
        c, s = contrib.get(key), lag_sum.get(key)
        per_round = rounds.get((key[0],))     # the lag is summed once a round: each call's start
        w = {"job": key[0], "rank": int(key[1]), "contributions_per_second": c,
             "mean_arrival_lag_seconds": s / per_round if per_round and s is not None else None}
        for f, values in gauges.items():
            v = values.get(key)
            w[f] = None if v is None else (bool(v) if f == "straggler" else int(v) if f == "rounds_behind" else v)
        workers.append(w)
    one = lambda name: next(iter(g(name).values()), None)  # noqa: E731
    daemon = {"xdp_attached": one("aggd_xdp_attached"), "p4_connected": one("aggd_p4_connected"),
              "userspace_path_up": one("aggd_userspace_path_up"),
              "jobs": one("aggd_jobs"), "kernel_slots_allocated": one("aggd_kernel_slots_allocated"),
              "kernel_slots_capacity": one("aggd_kernel_slots_capacity"),
              "kernel_memory_bytes": one("aggd_kernel_memory_bytes")}
    daemon = {k: (None if v is None else bool(v) if k in ("xdp_attached", "p4_connected", "userspace_path_up") else int(v))
              for k, v in daemon.items()}
    return {"interval": dt, "daemon": daemon, "jobs": jobs, "workers": workers}


# -- rendering -------------------------------------------------------------------------------------------

def _num(x: float | None, unit: str = "") -> str:
    if x is None:
        return "-"
    for suffix, n in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= n:
            return f"{x / n:.1f}{suffix}{unit}"
    return f"{x:.1f}{unit}" if x % 1 else f"{int(x)}{unit}"


def _secs(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1e3:.1f}ms" if x < 1 else f"{x:.2f}s"


def _table(headers: tuple, rows: list[tuple]) -> list[str]:
    cells = [headers] + [tuple(str(c) for c in row) for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]


def render(v: dict, source: str) -> list[str]:
    d = v["daemon"]
    slots = "-" if d["kernel_slots_capacity"] is None else f"{d['kernel_slots_allocated']}/{d['kernel_slots_capacity']}"
    fast = (f"P4 switch {'connected' if d['p4_connected'] else 'DISCONNECTED'}" if d.get("p4_connected") is not None
            else f"XDP {'attached' if d['xdp_attached'] else 'DETACHED'}")
    lines = [f"aggd top - {source} - every {v['interval']:.1f}s - {fast}, "
             f"user-space path {'up' if d['userspace_path_up'] else 'DOWN'}, "
             f"{'switch' if d.get('p4_connected') is not None else 'kernel'} slots {slots}", ""]
    if not v["jobs"]:
        return lines + ["no jobs"]
    lines += _table(("JOB", "STRATEGY", "VER", "MEMBERS", "ROUNDS/S", "ELEMENTS/S", "BYTES/S", "KERNEL",
                     "DROPS/S", "STRAGGLERS"),
                    [(j["job"], j["strategy"] + (" (policy)" if j["policy_switched"] else ""), j["strategy_version"],
                      f"{j['joined']}/{j['world']}", _num(j["rounds_per_second"]), _num(j["elements_per_second"]),
                      _num(j["bytes_per_second"], "B"),
                      "-" if j["kernel_share"] is None else f"{100 * j['kernel_share']:.0f}%",
                      _num(j["drops_per_second"]), j["stragglers"]) for j in v["jobs"]])
    if v["workers"]:
        lines += [""] + _table(
            ("JOB", "RANK", "LAG", "MEAN LAG", "SLOWDOWN", "BEHIND", "BLOCKING", "WAITED", "CONTRIB/S", ""),
            [(w["job"], w["rank"], _secs(w["lag_seconds"]), _secs(w["mean_arrival_lag_seconds"]),
              "-" if w["slowdown"] is None else f"{w['slowdown']:.2f}x", _num(w["rounds_behind"]),
              _secs(w["blocking_seconds"] or None), _secs(w["wait_seconds"]), _num(w["contributions_per_second"]),
              "STRAGGLER" if w["straggler"] else "") for w in v["workers"]])
    return lines


@click.command()
@click.option("--url", help=f"The metrics endpoint (default: from the daemon's config, else {DEFAULT_URL}).")
@click.option("--config", "config", type=click.Path(dir_okay=False),
              help="The daemon's config, for [metrics] address and [dataplane] netns "
                   "(default $AGGD_CONFIG, else /etc/aggd/aggd.toml if it exists, else the file of the "
                   "daemon the control socket reaches).")
@click.option("--netns", help="Network namespace to reach the endpoint from (default: [dataplane] netns).")
@click.option("--interval", "-n", type=click.FloatRange(min=0.1), default=2.0, show_default=True,
              help="Seconds between refreshes (and between the two scrapes of --once).")
@click.option("--job", help="Only this job.")
@click.option("--once", is_flag=True, help="One view, then exit (two scrapes --interval apart).")
@click.option("--json", "as_json", is_flag=True, help="With --once: the view as JSON.")
def top(url, config, netns, interval, job, once, as_json):
    """Jobs (strategy, rounds/s, throughput, kernel share) and workers (lag), refreshed in place."""
    if as_json and not once:
        raise click.UsageError("--json needs --once")
    url, netns = endpoint(url, config, netns)
    source = url + (f" (netns {netns})" if netns else "")
    t0, prev = scrape(url, netns)
    if once:
        time.sleep(interval)
        t1, cur = scrape(url, netns)
        v = view(prev, cur, t1 - t0, job)
        if as_json:
            click.echo(json.dumps(v, indent=2, sort_keys=True))
        else:
            click.echo("\n".join(render(v, source)))
        return
    tty = sys.stdout.isatty()
    try:
        while True:
            time.sleep(interval)
            t1, cur = scrape(url, netns)
            lines = render(view(prev, cur, t1 - t0, job), source)
            t0, prev = t1, cur
            if tty:
                cols, rows = shutil.get_terminal_size()
                # home, then each line cleared to its end, then the rest of the screen cleared
                out = "\x1b[H" + "".join(line[:cols] + "\x1b[K\n" for line in lines[:rows - 1]) + "\x1b[J"
                click.echo(out, nl=False)
            else:
                click.echo("\n".join(lines) + "\n")
    except KeyboardInterrupt:
        pass
