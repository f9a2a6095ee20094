"""The daemon's config: defaults, the shipped file, and errors that name the key and the reason."""
from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from aggd.daemon import config as c
from aggd.cli.main import main as aggctl

SHIPPED = Path(__file__).resolve().parents[2] / "configs" / "aggd.toml"


def problems(data: dict) -> list[str]:
    with pytest.raises(c.ConfigError) as info:
        c.parse(data)
    return info.value.problems


def test_shipped_file_is_the_defaults():
    assert c.load(SHIPPED) == c.Config()


def test_empty_file_gives_defaults(tmp_path):
    path = tmp_path / "a.toml"
    path.write_text("")
    cfg = c.load(path)
    assert cfg.dataplane.mode == "native" and cfg.dataplane.port == 47000
    assert cfg.dataplane.pin_dir == "/sys/fs/bpf/aggd" and cfg.metrics.address.startswith("127.0.0.1:")


def test_values_are_typed_and_sizes_parsed():
    cfg = c.parse({"dataplane": {"interface": "agg0", "netns": "lab-agg", "mode": "generic",
                                 "kernel_memory": "1MiB", "elements_per_packet": 128},
                   "jobs": {"default_slots": 64}, "log": {"level": "debug"}})
    assert cfg.dataplane.kernel_memory == 1 << 20 and cfg.dataplane.netns == "lab-agg"
    assert cfg.kernel_slots == (1 << 20) // c.slot_bytes(128)
    assert c.parse({"dataplane": {"kernel_memory": 0}}).kernel_slots == 0


def test_bad_mode_names_key_and_reason():
    assert problems({"dataplane": {"mode": "fast"}}) == ['dataplane.mode: must be "native" or "generic", not "fast"']


@pytest.mark.parametrize("data, expected", [
    ({"dataplane": {"bogus": 1}}, "dataplane.bogus: unknown key"),
    ({"nosuch": {}}, "nosuch: unknown section"),
    ({"dataplane": {"port": 70000}}, "dataplane.port: must be between 1 and 65535, not 70000"),
    ({"dataplane": {"port": "47000"}}, "dataplane.port: must be an integer, not '47000'"),
    ({"dataplane": {"unpin_on_stop": 1}}, "dataplane.unpin_on_stop: must be true or false"),
    ({"dataplane": {"narrow_room": "yes"}}, 'dataplane.narrow_room: must be "auto", "always" or "never", not "yes"'),
    ({"dataplane": {"elements_per_packet": 8193}}, "dataplane.elements_per_packet: must be between 1 and 8192"),
    ({"dataplane": {"elements_per_packet": 2234}},
     "dataplane.elements_per_packet: native XDP takes at most 2233 values a packet (an MTU of 9000), not 2234"),
    ({"dataplane": {"kernel_memory": "lots"}}, "dataplane.kernel_memory: must be bytes"),
    ({"dataplane": {"kernel_memory": -1}}, "dataplane.kernel_memory: must not be negative"),
    ({"dataplane": {"interface": "x" * 16}}, "dataplane.interface: must be an interface name"),
    ({"dataplane": {"address": "10.0.0"}}, "dataplane.address: must be an IPv4 address"),
    ({"dataplane": {"pin_dir": "bpf/aggd"}}, "dataplane.pin_dir: must be an absolute path"),
    ({"dataplane": {"userspace_port": 47000}}, "dataplane.userspace_port: must differ from dataplane.port"),
    ({"jobs": {"group_base": "10.0.0.0"}}, "jobs.group_base: must be an IPv4 multicast address"),
    ({"jobs": {"default_slots": 0}}, "jobs.default_slots: must be between 1"),
    ({"jobs": {"max_slots": 0}}, "jobs.max_slots: must be between 1"),
    ({"jobs": {"max_slots": True}}, "jobs.max_slots: must be an integer, not True"),
    ({"jobs": {"default_slots": 64, "max_slots": 32}}, "jobs.default_slots: must be at most jobs.max_slots (32)"),
    ({"jobs": {"max_job_memory": "1MiB"}}, "jobs.max_job_memory: a job of jobs.default_slots (1024) slots"),
    ({"control": {"group": "no-such-group-here"}}, "control.group: no such group 'no-such-group-here'"),
    ({"metrics": {"address": "9477"}}, 'metrics.address: must be "HOST:PORT"'),
    ({"log": {"level": "loud"}}, 'log.level: must be "debug", "info", "warning" or "error", not "loud"'),
    ({"policy": []}, "policy: must be a table"),
])
def test_each_bad_value_is_named(data, expected):
    found = problems(data)
    assert len(found) == 1 and found[0].startswith(expected), found


def test_every_problem_is_reported_at_once(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('[dataplane]\nmode = "fast"\ntypo = 1\n[log]\nlevel = "loud"\n')
    with pytest.raises(c.ConfigError) as info:
        c.load(path)
    assert len(info.value.problems) == 3
    assert str(path) in str(info.value)


def test_unreadable_and_invalid_toml(tmp_path):
    with pytest.raises(c.ConfigError, match="cannot read"):
        c.load(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[dataplane\n")
    with pytest.raises(c.ConfigError, match="not valid TOML"):
        c.load(bad)
    latin = tmp_path / "latin1.toml"
    latin.write_bytes('[log]\n# r\xe9glages\nlevel = "info"\n'.encode("latin-1"))
    with pytest.raises(c.ConfigError, match=r"not UTF-8 text \(byte 9: b'\\xe9'\)") as info:
        c.load(latin)
    assert str(latin) in str(info.value) and "Traceback" not in str(info.value)
    res = CliRunner().invoke(aggctl, ["config", "check", str(latin)])
    assert res.exit_code == 1 and "not UTF-8" in res.output and res.exception is None or \
        isinstance(res.exception, SystemExit), res.output


def test_reload_sees_which_keys_changed():
    old = c.Config()
    new = old.with_changes("log", level="debug").with_changes("dataplane", port=47010)
    assert c.changed_keys(old, new) == {"log.level", "dataplane.port"}
    assert c.changed_keys(old, new) - c.RELOADABLE == {"dataplane.port"}


def test_aggctl_config_check(tmp_path):
    runner = CliRunner()
    good = tmp_path / "good.toml"   # the shipped file on an interface every host has
    good.write_text(SHIPPED.read_text().replace('interface = "eth0"', 'interface = "lo"'))
    res = runner.invoke(aggctl, ["config", "check", str(good)])
    assert res.exit_code == 0 and "OK" in res.output, res.output
    bad = tmp_path / "bad.toml"
    bad.write_text('[dataplane]\nmode = "fast"\nwhatever = 2\n')
    res = runner.invoke(aggctl, ["config", "check", str(bad)])
    assert res.exit_code == 1
    assert 'dataplane.mode: must be "native" or "generic", not "fast"' in res.output
    assert "dataplane.whatever: unknown key" in res.output
    res = runner.invoke(aggctl, ["config", "check", "--json", str(bad)])
    assert res.exit_code == 1 and '"ok": false' in res.output


def test_aggctl_config_check_looks_for_the_interface_as_a_start_would(tmp_path):
    """A config whose interface or namespace this host lacks passes the file's checks but would not
    start: the check says so, naming the key."""
    runner = CliRunner()
    path = tmp_path / "aggd.toml"
    path.write_text('[dataplane]\ninterface = "nosuch9"\n')
    res = runner.invoke(aggctl, ["config", "check", str(path)])
    assert res.exit_code == 1 and "dataplane.interface: no interface nosuch9 on this host" in res.output, res.output
    path.write_text('[dataplane]\ninterface = "lo"\nnetns = "aggd-nosuch-ns"\n')
    res = runner.invoke(aggctl, ["config", "check", str(path)])
    assert res.exit_code == 1 and "dataplane.netns: no network namespace 'aggd-nosuch-ns'" in res.output, res.output
    path.write_text('[dataplane]\ninterface = "ifb0"\n')   # no IPv4 address: dataplane.address is needed
    if (Path("/sys/class/net") / "ifb0").exists():
        res = runner.invoke(aggctl, ["config", "check", str(path)])
        assert res.exit_code == 1 and "ifb0 on this host has no IPv4 address; set dataplane.address" in res.output


# -- [dataplane] kind and [p4] ---------------------------------------------------------------------

HOSTS = {"10.77.0.1": ["02:77:00:00:00:01", 100], "10.77.0.10": ["02:77:00:00:00:0A", 1]}


def test_p4_defaults_and_kind():
    cfg = c.Config()
    assert cfg.dataplane.kind == "xdp"
    assert (cfg.p4.target, cfg.p4.grpc, cfg.p4.device_id, cfg.p4.election_id) == ("bmv2", "127.0.0.1:9559", 0, 1)
    assert (cfg.p4.registers, cfg.p4.p4info, cfg.p4.device_config, cfg.p4.slots, cfg.p4.hosts) == ("", "", "", 0, {})
    # the XDP keys keep working next to kind
    old = c.parse({"dataplane": {"interface": "agg0", "mode": "generic", "kernel_memory": "1MiB"}})
    assert old.dataplane.kind == "xdp" and old.dataplane.mode == "generic"


def test_p4_section_is_typed():
    cfg = c.parse({"dataplane": {"kind": "p4", "elements_per_packet": 32},
                   "p4": {"target": "tofino", "grpc": "unix:/run/aggd/p4rt.sock", "device_id": 3, "election_id": 7,
                          "registers": "10.0.0.2:50052", "p4info": "/usr/lib/aggd/dataplane/p4/programs/tna/aggd.p4info.txtpb",
                          "device_config": "/usr/lib/aggd/dataplane/p4/programs/tna/build/tofino.bin", "slots": 512, "timeout": 2,
                          "hosts": HOSTS}})
    p4 = cfg.p4
    assert (p4.target, p4.grpc, p4.device_id, p4.election_id, p4.registers) == \
        ("tofino", "unix:/run/aggd/p4rt.sock", 3, 7, "10.0.0.2:50052")
    assert p4.slots == 512 and p4.timeout == 2.0
    assert p4.hosts == {"10.77.0.1": ("02:77:00:00:00:01", 100), "10.77.0.10": ("02:77:00:00:00:0a", 1)}
    # a copy with changes goes through the same checks (the hosts' tuples included)
    assert cfg.with_changes("log", level="debug").p4 == p4
    assert c.changed_keys(cfg, cfg.with_changes("p4", slots=64)) - c.RELOADABLE == {"p4.slots"}


def test_p4_table_form_of_hosts(tmp_path):
    path = tmp_path / "p4.toml"
    path.write_text('[dataplane]\nkind = "p4"\n[p4.hosts]\n"10.77.0.1" = ["02:77:00:00:00:01", 100]\n')
    assert c.load(path).p4.hosts == {"10.77.0.1": ("02:77:00:00:00:01", 100)}


@pytest.mark.parametrize("data, expected", [
    ({"dataplane": {"kind": "tofino"}}, 'dataplane.kind: must be "xdp" or "p4", not "tofino"'),
    ({"dataplane": {"kind": "p4"}}, "p4.hosts: the switch needs its hosts"),
    ({"p4": {"target": "tna"}}, 'p4.target: must be "bmv2" or "tofino", not "tna"'),
    ({"p4": {"grpc": "9559"}}, 'p4.grpc: must be "HOST:PORT" or "unix:/absolute/path"'),
    ({"p4": {"grpc": "unix:p4rt.sock"}}, 'p4.grpc: must be "HOST:PORT" or "unix:/absolute/path"'),
    ({"p4": {"registers": "thrift"}}, 'p4.registers: must be "HOST:PORT"'),
    ({"p4": {"device_id": -1}}, "p4.device_id: must be between 0 and"),
    ({"p4": {"election_id": 0}}, "p4.election_id: must be between 1 and"),
    ({"p4": {"p4info": "aggd.p4info.txtpb"}}, "p4.p4info: must be an absolute path"),
    ({"p4": {"device_config": "build/aggd.json"}}, "p4.device_config: must be an absolute path"),
    ({"p4": {"slots": -1}}, "p4.slots: must be between 0 and"),
    ({"p4": {"slots": "all"}}, "p4.slots: must be an integer"),
    ({"p4": {"timeout": 0}}, "p4.timeout: must be above 0"),
    ({"p4": {"hosts": ["10.0.0.1"]}}, "p4.hosts: must be a table"),
    ({"p4": {"hosts": {"10.0.0": ["02:00:00:00:00:01", 1]}}}, "p4.hosts: '10.0.0' is not an IPv4 address"),
    ({"p4": {"hosts": {"10.0.0.1": ["02:00:00:00:01", 1]}}}, "p4.hosts: 10.0.0.1: '02:00:00:00:01' is not a MAC"),
    ({"p4": {"hosts": {"10.0.0.1": ["02:00:00:00:00:01", 512]}}},
     "p4.hosts: 10.0.0.1: switch port must be between 0 and 511, not 512"),
    ({"p4": {"hosts": {"10.0.0.1": "02:00:00:00:00:01"}}}, 'p4.hosts: 10.0.0.1: must be ["MAC", PORT]'),
    ({"p4": {"thrift": "127.0.0.1:9090"}}, "p4.thrift: unknown key"),
])
def test_each_bad_p4_value_is_named(data, expected):
    found = problems(data)
    assert len(found) == 1 and found[0].startswith(expected), found


def test_p4_hosts_problems_all_named():
    (found,) = problems({"p4": {"hosts": {"x": ["02:00:00:00:00:01", 1], "10.0.0.2": ["02:00:00:00:00:02", 600]}}})
    assert "'x' is not an IPv4 address" in found and "10.0.0.2: switch port must be between 0 and 511" in found


def test_aggctl_config_check_p4(tmp_path):
    path = tmp_path / "p4.toml"
    path.write_text('[dataplane]\nkind = "p4"\ninterface = "lo"\n[p4]\ngrpc = "127.0.0.1"\n')
    res = CliRunner().invoke(aggctl, ["config", "check", str(path)])
    assert res.exit_code == 1
    assert 'p4.grpc: must be "HOST:PORT"' in res.output and "p4.hosts: the switch needs its hosts" not in res.output


def test_aggctl_config_check_p4_reads_the_p4info(tmp_path):
    hosts = 'hosts = { "10.77.0.1" = ["02:77:00:00:00:01", 100] }\n'
    good = tmp_path / "bmv2.toml"
    good.write_text('[dataplane]\nkind = "p4"\ninterface = "lo"\n[p4]\n' + hosts)
    res = CliRunner().invoke(aggctl, ["config", "check", str(good)])
    assert res.exit_code == 0 and "P4 bmv2 switch at 127.0.0.1:9559" in res.output, res.output
    # the Tofino program adds 32 values a packet, not the default 256; a device_config that is not there
    tofino = tmp_path / "tofino.toml"
    tofino.write_text('[dataplane]\nkind = "p4"\ninterface = "lo"\n[p4]\ntarget = "tofino"\ndevice_config = "/nonexistent/tofino.bin"\n'
                      + hosts)
    res = CliRunner().invoke(aggctl, ["config", "check", str(tofino)])
    assert res.exit_code == 1
    assert "dataplane.elements_per_packet: the P4 program adds 32 values a packet, not 256" in res.output
    assert "p4.device_config: no file /nonexistent/tofino.bin" in res.output
    bad = tmp_path / "bad.toml"
    (tmp_path / "x.txtpb").write_text("not a p4info")
    bad.write_text(f'[dataplane]\nkind = "p4"\n[p4]\np4info = "{tmp_path / "x.txtpb"}"\n' + hosts)
    res = CliRunner().invoke(aggctl, ["config", "check", str(bad)])
    assert res.exit_code == 1 and "p4.p4info: " in res.output


@pytest.mark.parametrize("setting,kind,mode,elements,link,asks", [
    ("auto", "xdp", "native", 256, "veth", True),       # a veth's short buffers
    ("auto", "xdp", "native", 256, None, False),        # a NIC's page buffers grow
    ("auto", "xdp", "native", 2233, None, True),        # multi-buffer frames never grow
    ("auto", "xdp", "generic", 256, "veth", False),     # skbs grow
    ("auto", "p4", "native", 256, "veth", False),       # the switch passes narrow packets up
    ("always", "xdp", "generic", 256, None, True),
    ("never", "xdp", "native", 2233, "veth", False),
])
def test_which_daemons_ask_narrow_jobs_for_room(setting, kind, mode, elements, link, asks):
    from aggd.daemon.service import asks_narrow_room
    assert asks_narrow_room(setting, kind, mode, elements, link) is asks
