"""The daemon's configuration: typed sections with defaults, loaded from TOML (``configs/aggd.toml``).

Every key has a type, a default and a check. Loading collects every problem at once and names the
key path and the reason (``dataplane.mode: must be "native" or "generic", not "fast"``); an unknown
key or section is an error too, so a typo never silently falls back to a default. ``aggd`` and
``aggctl config check`` both go through :func:`load` / :func:`parse`.

Which settings a SIGHUP applies live is decided here too (:data:`RELOADABLE`); the rest need a
restart, and the daemon says so when a reload changes them.
"""
from __future__ import annotations

import dataclasses
import grp
import ipaddress
import re
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from aggd.core.registry import slots_bytes
from aggd_client.protocol import (DEFAULT_ELEMENTS, DEFAULT_PORT, DEFAULT_RESULT_PORT, MAX_ELEMENTS, MAX_JOBS,
                                  MAX_MEMBERS, NATIVE_MAX_ELEMENTS, NATIVE_MAX_MTU)

DEFAULT_PATH = Path("/etc/aggd/aggd.toml")
IFNAMSIZ = 16
LOG_LEVELS = ("debug", "info", "warning", "error")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


class ConfigError(ValueError):
    """One or more bad settings; ``problems`` lists ``"key.path: reason"`` strings."""

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems = problems
        where = f"{source}: " if source else ""
        super().__init__(where + ("; ".join(problems) if len(problems) == 1 else
                                  f"{len(problems)} problems:\n  " + "\n  ".join(problems)))


def slot_bytes(elements: int) -> int:
    """The kernel memory one slot takes (``struct slot`` of xdp/aggd_maps.h: four banks of 64-bit
    sums and 2336 bytes of bookkeeping), for ``aggctl config check``. The daemon measures the size
    from the maps header before it sizes the kernel's slot array
    (``aggd.dataplane.xdp.ops.probe_value_sizes``); tests/bpf/test_pinned_maps.py holds the two equal."""
    return 2336 + 4 * 8 * elements


def parse_size(value: Any) -> int:
    """Bytes from an integer or a string like ``"64MiB"``, ``"64M"``, ``"1.5G"`` (binary units)."""
    if isinstance(value, bool):
        raise ValueError(f"must be a number of bytes, not {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"must not be negative, not {value}")
        return value
    if isinstance(value, str):
        m = _SIZE.match(value)
        if m:
            return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])
    raise ValueError(f'must be bytes as an integer or a size like "64MiB", not {value!r}')


# -- checks: each returns the (possibly converted) value or raises ValueError(reason) ----------------

def _one_of(*choices: str) -> Callable[[Any], str]:
    def check(v):
        if v not in choices:
            quoted = " or ".join(f'"{c}"' for c in choices) if len(choices) <= 2 else \
                ", ".join(f'"{c}"' for c in choices[:-1]) + f' or "{choices[-1]}"'
            raise ValueError(f"must be {quoted}, not {v!r}".replace("'", '"'))
        return v
    return check


def _int_range(lo: int, hi: int) -> Callable[[Any], int]:
    def check(v):
        if not lo <= v <= hi:
            raise ValueError(f"must be between {lo} and {hi}, not {v}")
        return v
    return check


def _port(v: int) -> int:
    return _int_range(1, 65535)(v)


def _abs_path(v: str) -> str:
    if not v.startswith("/"):
        raise ValueError(f"must be an absolute path, not {v!r}")
    return v


def _ifname(v: str) -> str:
    if not v or len(v) >= IFNAMSIZ or "/" in v or v.strip() != v:
        raise ValueError(f"must be an interface name of 1..{IFNAMSIZ - 1} characters, not {v!r}")
    return v


def _optional(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``check`` for a non-empty value; "" keeps its documented meaning (a default chosen later)."""
    return lambda v: check(v) if v != "" else v


def _ipv4(v: str) -> str:
    try:
        ipaddress.IPv4Address(v)
    except ValueError:
        raise ValueError(f"must be an IPv4 address, not {v!r}") from None
    return v


def _multicast_base(v: str) -> str:
    try:
        ip = ipaddress.IPv4Address(v)
    except ValueError:
        raise ValueError(f"must be an IPv4 multicast address, not {v!r}") from None
    last = ip + (MAX_JOBS - 1)
    if not (ip.is_multicast and last.is_multicast):
        raise ValueError(f"must be an IPv4 multicast address with room for {MAX_JOBS} groups "
                         f"(224.0.0.0 .. 239.255.255.0), not {v!r}")
    return v


def _host_port(v: str) -> str:
    host, sep, port = v.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f'must be "HOST:PORT", e.g. "127.0.0.1:9477", not {v!r}')
    return v


def _group_name(v: str) -> str:
    try:
        grp.getgrnam(v)
    except KeyError:
        raise ValueError(f"no such group {v!r} on this host") from None
    return v


def _size(v: Any) -> int:
    return parse_size(v)


def _setting(default, check: Callable | None = None, doc: str = "", types: tuple = ()):
    meta = {"check": check, "doc": doc, "types": types or (type(default),)}
    if isinstance(default, dict):  # a mutable default: each config gets its own copy
        return field(default_factory=lambda: dict(default), metadata=meta)
    return field(default=default, metadata=meta)


# -- sections ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DataplaneConfig:
    kind: str = _setting("xdp", _one_of("xdp", "p4"), "which data plane aggregates: the XDP program on "
                         "this host, or the aggd P4 program on a switch ([p4])")
    interface: str = _setting("eth0", _ifname, "interface the XDP program attaches to")
    netns: str = _setting("", None, "named network namespace (/run/netns/NAME) of the interface; "
                                    "empty: the daemon's own")
    mode: str = _setting("native", _one_of("native", "generic"), "XDP attach mode")
    address: str = _setting("", _optional(_ipv4), "IPv4 address workers send to; empty: the "
                                                "interface's first address")
    port: int = _setting(DEFAULT_PORT, _port, "UDP port of the aggd protocol")
    userspace_port: int = _setting(DEFAULT_PORT + 2, _port,
                                   "UDP port for jobs whose packets the kernel program cannot take")
    elements_per_packet: int = _setting(DEFAULT_ELEMENTS, _int_range(1, MAX_ELEMENTS),
                                        "int32 values a packet holds (the kernel's packet size)")
    kernel_memory: int = _setting(64 << 20, _size, "bytes of kernel memory for slots", (int, str))
    pin_dir: str = _setting("/sys/fs/bpf/aggd", _abs_path, "where maps are pinned (bpffs)")
    unpin_on_stop: bool = _setting(False, None, "remove the pinned maps on a clean stop")
    narrow_room: str = _setting("auto", _one_of("auto", "always", "never"),
                                "whether workers of 8- and 16-bit jobs send contributions with room for "
                                "the wider result, so the XDP program answers them without growing the "
                                "frame: auto (in native mode where frames cannot grow: on a veth, and "
                                "above 832 values a packet, in multi-buffer frames), always, never")


#: Switch ports are bit<9> in v1model (aggd.dataplane.p4.layout.MAX_PORT); Tofino's are as wide.
MAX_SWITCH_PORT = (1 << 9) - 1
_MAC = re.compile(r"^[0-9a-f]{2}(:[0-9a-f]{2}){5}$", re.IGNORECASE)


def _grpc_target(v: str) -> str:
    if v.startswith("unix:"):
        if not v.removeprefix("unix:").removeprefix("//").startswith("/"):
            raise ValueError(f'must be "HOST:PORT" or "unix:/absolute/path", not {v!r}')
        return v
    try:
        return _host_port(v)
    except ValueError:
        raise ValueError(f'must be "HOST:PORT" or "unix:/absolute/path", not {v!r}') from None


def _switch_hosts(v: dict) -> dict:
    """``{ip: [mac, port]}`` -> ``{ip: (mac, port)}``: every problem of every host in one reason."""
    hosts, bad = {}, []
    for ip, entry in v.items():
        try:
            ipaddress.IPv4Address(ip)
        except ValueError:
            bad.append(f"{ip!r} is not an IPv4 address")
            continue
        if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[0], str)
                and isinstance(entry[1], int) and not isinstance(entry[1], bool)):
            bad.append(f'{ip}: must be ["MAC", PORT], not {entry!r}')
            continue
        mac, port = entry
        if not _MAC.match(mac):
            bad.append(f"{ip}: {mac!r} is not a MAC address (aa:bb:cc:dd:ee:ff)")
        elif not 0 <= port <= MAX_SWITCH_PORT:
            bad.append(f"{ip}: switch port must be between 0 and {MAX_SWITCH_PORT}, not {port}")
        else:
            hosts[ip] = (mac.lower(), port)
    if bad:
        raise ValueError("; ".join(bad))
    return hosts


@dataclass(frozen=True)
class P4Config:
    # The switch, when dataplane.kind = "p4" (docs/p4.md). Read only at start: changes need a restart.
    target: str = _setting("bmv2", _one_of("bmv2", "tofino"), "BMv2 simple_switch_grpc (every strategy) or "
                           "a Tofino (sync and quorum)")
    grpc: str = _setting("127.0.0.1:9559", _grpc_target, "the switch's P4Runtime server")
    device_id: int = _setting(0, _int_range(0, (1 << 63) - 1), "P4Runtime device id")
    election_id: int = _setting(1, _int_range(1, (1 << 63) - 1), "P4Runtime election id (the highest "
                                "connected controller is the primary)")
    registers: str = _setting("", _optional(_host_port), "registers and counters: BMv2's Thrift server "
                              "(bmv2; empty: 127.0.0.1:9090) or BF Runtime (tofino; empty: 127.0.0.1:50052)")
    registers_netns: str = _setting("", None, "named network namespace (/run/netns/NAME) the register "
                                    "server listens in (BMv2's Thrift has no Unix socket: a switch in a "
                                    "lab's namespace); empty: the daemon's own")
    program: str = _setting("aggd", None, "the program name BF Runtime binds (tofino)")
    p4info: str = _setting("", _optional(_abs_path), "the program's P4Info (text); empty: the one shipped "
                           "for the target")
    device_config: str = _setting("", _optional(_abs_path), "compiled program pushed at start (BMv2 JSON, "
                                  "Tofino binary); empty: keep the program the switch runs")
    slots: int = _setting(0, _int_range(0, 1 << 24), "switch slots aggd may use; 0: all of the program's")
    hosts: dict = _setting({}, _switch_hosts, 'hosts behind the switch: { "IP" = ["MAC", PORT] }, the '
                           "daemon host among them", (dict,))
    timeout: float = _setting(10.0, lambda v: _number_above(0.0)(v), "seconds to wait for the switch",
                              (int, float))


@dataclass(frozen=True)
class JobsConfig:
    default_slots: int = _setting(1024, _int_range(1, 1 << 20), "slots of a job created without --slots")
    max_slots: int = _setting(1 << 14, _int_range(1, 1 << 20), "most slots a job may ask for")
    max_job_memory: int = _setting(256 << 20, _size, "most bytes of sums a job's slots may take (slots x "
                                   "elements x 32)", (int, str))
    max_chunks: int = _setting(1 << 24, _int_range(1, (1 << 32) - 1), "largest chunk number + 1")
    group_base: str = _setting("239.77.0.0", _multicast_base, "job i's results go to this group + i")
    result_port: int = _setting(DEFAULT_RESULT_PORT, _port, "UDP port results are sent to")


@dataclass(frozen=True)
class ControlConfig:
    socket: str = _setting("/run/aggd/control.sock", _abs_path, "aggctl's Unix socket")
    group: str = _setting("", _optional(_group_name), "group allowed to use aggctl besides root; empty: root only")


@dataclass(frozen=True)
class StateConfig:
    dir: str = _setting("/var/lib/aggd", _abs_path, "where the job registry is kept (state.json)")


@dataclass(frozen=True)
class MetricsConfig:
    address: str = _setting("127.0.0.1:9477", _host_port, "Prometheus endpoint (in dataplane.netns if set)")
    max_jobs: int = _setting(64, _int_range(0, MAX_JOBS), "jobs exported (by id); the rest are counted in "
                             "aggd_metrics_truncated_total")
    max_ranks: int = _setting(64, _int_range(0, MAX_MEMBERS), "ranks of a job exported; the rest are counted")


@dataclass(frozen=True)
class LogConfig:
    level: str = _setting("info", _one_of(*LOG_LEVELS), "log level")


def _number_above(lo: float) -> Callable[[Any], float]:
    def check(v):
        if not v > lo:
            raise ValueError(f"must be above {lo:g}, not {v}")
        return float(v)
    return check


def _non_negative(v) -> float:
    if not v >= 0:
        raise ValueError(f"must be 0 or more, not {v}")
    return float(v)


def _fraction(v: float) -> float:
    if not 0 < v < 1:
        raise ValueError(f"must be a fraction between 0 and 1, not {v}")
    return float(v)


def _switch_template(v: str) -> str:
    from aggd.core.policy import PolicyError, PolicyRules
    try:
        PolicyRules(switch_to=v)
    except PolicyError as exc:
        raise ValueError(str(exc).removeprefix(f"switch_to {v!r}: ")) from None
    return v


_NUMBER = (int, float)


@dataclass(frozen=True)
class PolicyConfig:
    # The dynamic-hybrid policy (aggd/core/policy.py, docs/stragglers.md). Every key reloads on SIGHUP.
    auto_switch: bool = _setting(False, None, "let the daemon switch strategies by itself")
    interval_ms: int = _setting(200, _int_range(10, 60_000), "how often the per-member counters are read")
    slow_factor: float = _setting(1.5, _number_above(1.0), "a member is slow when its steps take this "
                                  "many times the median member's", _NUMBER)
    even_factor: float = _setting(1.35, _number_above(1.0), "a switched job's members are even again below "
                                  "this many times the median (at most slow_factor)", _NUMBER)
    slow_rounds: int = _setting(8, _int_range(0, 1 << 20), "rounds a member must stay slow before a switch")
    switch_to: str = _setting("quorum:n-s", _switch_template, "the strategy while members straggle "
                              "(n: world size, s: stragglers)")
    even_rounds: int = _setting(30, _int_range(0, 1 << 20), "rounds with every member even before "
                                "going back to the job's own strategy")
    max_stragglers: float = _setting(0.25, _fraction, "most members (fraction of the world, at least "
                                     "one) left behind; more slow ones is a slow job", _NUMBER)
    min_rounds_between: int = _setting(20, _int_range(0, 1 << 20), "fewest rounds between two switches")
    min_seconds_between: float = _setting(2.0, _non_negative, "fewest seconds between two switches",
                                          _NUMBER)
    settle_rounds: int = _setting(4, _int_range(0, 1 << 20), "rounds after a switch that are not judged")
    jobs: str = _setting("*", None, "glob of the job names the policy manages (their own strategy "
                         "must be sync)")
    # Members that go silent (aggd/core/departures.py), whatever auto_switch says.
    silent_after: float = _setting(5.0, _non_negative, "seconds a member may send nothing while "
                                   "another is at a newer round before it is declared gone and rounds "
                                   "stop waiting for it (0: never by itself)", _NUMBER)
    silent_steps: float = _setting(20.0, _non_negative, "... and at least this many of the job's "
                                   "usual steps", _NUMBER)
    readmit_rounds: int = _setting(2, _int_range(0, 1 << 20), "rounds every other member must be past the "
                                   "round a gone member left or rejoined at before rounds wait for it again")


@dataclass(frozen=True)
class Config:
    dataplane: DataplaneConfig = field(default_factory=DataplaneConfig)
    jobs: JobsConfig = field(default_factory=JobsConfig)
    control: ControlConfig = field(default_factory=ControlConfig)
    state: StateConfig = field(default_factory=StateConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    log: LogConfig = field(default_factory=LogConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    p4: P4Config = field(default_factory=P4Config)
    source: str | None = field(default=None, compare=False)

    @property
    def slot_bytes(self) -> int:
        return slot_bytes(self.dataplane.elements_per_packet)

    @property
    def kernel_slots(self) -> int:
        """Slots the kernel memory budget holds."""
        return self.dataplane.kernel_memory // self.slot_bytes

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("source")
        return d

    def with_changes(self, section: str, **changes) -> "Config":
        """A copy with some keys of one section changed, checked like a loaded file."""
        d = self.to_dict()
        d[section].update(changes)
        return parse(d, self.source)


SECTIONS = {f.name: f.default_factory for f in dataclasses.fields(Config) if f.name != "source"}

#: Settings a SIGHUP applies to the running daemon; any other change needs a restart.
RELOADABLE = {
    "log.level", "control.group", "jobs.default_slots", "jobs.max_slots", "jobs.max_job_memory", "jobs.max_chunks",
    *(f"policy.{f.name}" for f in dataclasses.fields(PolicyConfig)),
    "dataplane.kernel_memory",  # for jobs created afterwards, up to the size loaded at start
    "dataplane.narrow_room",    # for workers joining afterwards (the JOIN_ACK's room)
    "metrics.max_jobs", "metrics.max_ranks",  # read at every scrape
}


def parse(data: dict, source: str | None = None) -> Config:
    """A checked Config from a dict as tomllib returns it; ConfigError lists every problem."""
    problems: list[str] = []
    sections = {}
    for name in data:
        if name not in SECTIONS:
            problems.append(f"{name}: unknown section (known: {', '.join(SECTIONS)})")
    for name, factory in SECTIONS.items():
        raw = data.get(name, {})
        if not isinstance(raw, dict):
            problems.append(f"{name}: must be a table ([{name}]), not {type(raw).__name__}")
            raw = {}
        sections[name] = _parse_section(name, factory, raw, problems)
    if not problems:
        dp = sections["dataplane"]
        if dp.userspace_port == dp.port:
            problems.append(f"dataplane.userspace_port: must differ from dataplane.port ({dp.port})")
        if sections["jobs"].result_port == dp.port:
            problems.append(f"jobs.result_port: must differ from dataplane.port ({dp.port})")
        if dp.kind == "xdp" and dp.mode == "native" and dp.elements_per_packet > NATIVE_MAX_ELEMENTS:
            problems.append(f"dataplane.elements_per_packet: native XDP takes at most "
                            f"{NATIVE_MAX_ELEMENTS} values a packet (an MTU of {NATIVE_MAX_MTU}), not "
                            f'{dp.elements_per_packet} (larger packets need dataplane.mode "generic")')
        if dp.kind == "p4" and not sections["p4"].hosts:
            problems.append('p4.hosts: the switch needs its hosts ({ "IP" = ["MAC", PORT] }, the daemon host '
                            'among them) when dataplane.kind is "p4"')
        jobs = sections["jobs"]
        if jobs.default_slots > jobs.max_slots:
            problems.append(f"jobs.default_slots: must be at most jobs.max_slots ({jobs.max_slots})")
        elif slots_bytes(jobs.default_slots, dp.elements_per_packet) > jobs.max_job_memory:
            problems.append(f"jobs.max_job_memory: a job of jobs.default_slots ({jobs.default_slots}) slots of "
                            f"dataplane.elements_per_packet ({dp.elements_per_packet}) values takes "
                            f"{slots_bytes(jobs.default_slots, dp.elements_per_packet)} bytes, more than "
                            f"{jobs.max_job_memory}")
        pol = sections["policy"]
        if pol.even_factor > pol.slow_factor:
            problems.append(f"policy.even_factor: must be at most policy.slow_factor ({pol.slow_factor:g})")
    if problems:
        raise ConfigError(problems, source)
    return Config(**sections, source=source)


def _parse_section(name: str, factory, raw: dict, problems: list[str]):
    cls = factory().__class__
    known = {f.name: f for f in dataclasses.fields(cls)}
    values = {}
    for key, value in raw.items():
        path = f"{name}.{key}"
        f = known.get(key)
        if f is None:
            problems.append(f"{path}: unknown key (known: {', '.join(known)})")
            continue
        types = f.metadata["types"]
        # bool is an int in Python; a TOML `true` where a number belongs is still a mistake.
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            want = "a number" if float in types else \
                " or ".join({"str": "a string", "int": "an integer", "bool": "true or false",
                             "dict": "a table"}[t.__name__] for t in types)
            problems.append(f"{path}: must be {want}, not {value!r}")
            continue
        check = f.metadata["check"]
        try:
            values[key] = check(value) if check else value
        except ValueError as exc:
            problems.append(f"{path}: {exc}")
    return cls(**values)


def load(path: str | Path) -> Config:
    """Read and check a TOML config file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([f"cannot read: {exc.strerror or exc}"], str(path)) from None
    except UnicodeDecodeError as exc:
        raise ConfigError([f"not UTF-8 text (byte {exc.start}: {exc.object[exc.start:exc.start + 1]!r}); "
                           f"TOML files are UTF-8"], str(path)) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"not valid TOML: {exc}"], str(path)) from None
    return parse(data, str(path))


def toml_value(v) -> str:
    """A TOML value: strings, booleans, numbers, arrays and inline tables (``[p4] hosts``)."""
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(map(toml_value, v)) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{json.dumps(str(k))} = {toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"no TOML for {v!r}")


def to_toml(settings: dict[str, dict]) -> str:
    """A config file's text from ``{section: {key: value}}`` (what lab daemons and tests write)."""
    lines = []
    for section, values in settings.items():
        lines.append(f"[{section}]")
        lines.extend(f"{k} = {toml_value(v)}" for k, v in values.items())
    return "\n".join(lines) + "\n"


def applied(running: Config, new: Config) -> tuple[Config, list[str]]:
    """What a SIGHUP makes of ``new``: its reloadable keys, and the running value of every other
    key (those take effect at the next start; ``aggctl status`` shows what is in effect); and the
    changed keys that so wait for a restart."""
    d, keep = new.to_dict(), running.to_dict()
    waiting = sorted(changed_keys(running, new) - RELOADABLE)
    for path in waiting:
        section, key = path.split(".", 1)
        d[section][key] = keep[section][key]
    return parse(d, new.source), waiting


def changed_keys(old: Config, new: Config) -> set[str]:
    """Key paths whose values differ between two configs."""
    a, b = old.to_dict(), new.to_dict()
    return {f"{s}.{k}" for s in a for k in a[s] if a[s][k] != b[s][k]}
