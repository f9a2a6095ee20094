"""The daemon's config: defaults, the shipped file, and errors that name the key and the reason."""
from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from aggd import config as c
from aggd.cli import main as aggctl

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
    ({"dataplane": {"elements_per_packet": 513}}, "dataplane.elements_per_packet: must be between 1 and 512"),
    ({"dataplane": {"kernel_memory": "lots"}}, "dataplane.kernel_memory: must be bytes"),
    ({"dataplane": {"kernel_memory": -1}}, "dataplane.kernel_memory: must not be negative"),
    ({"dataplane": {"interface": "x" * 16}}, "dataplane.interface: must be an interface name"),
    ({"dataplane": {"address": "10.0.0"}}, "dataplane.address: must be an IPv4 address"),
    ({"dataplane": {"pin_dir": "bpf/aggd"}}, "dataplane.pin_dir: must be an absolute path"),
    ({"dataplane": {"userspace_port": 47000}}, "dataplane.userspace_port: must differ from dataplane.port"),
    ({"jobs": {"group_base": "10.0.0.0"}}, "jobs.group_base: must be an IPv4 multicast address"),
    ({"jobs": {"default_slots": 0}}, "jobs.default_slots: must be between 1"),
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


def test_reload_sees_which_keys_changed():
    old = c.Config()
    new = old.with_changes("log", level="debug").with_changes("dataplane", port=47010)
    assert c.changed_keys(old, new) == {"log.level", "dataplane.port"}
    assert c.changed_keys(old, new) - c.RELOADABLE == {"dataplane.port"}


def test_aggctl_config_check(tmp_path):
    runner = CliRunner()
    good = runner.invoke(aggctl, ["config", "check", str(SHIPPED)])
    assert good.exit_code == 0 and "OK" in good.output
    bad = tmp_path / "bad.toml"
    bad.write_text('[dataplane]\nmode = "fast"\nwhatever = 2\n')
    res = runner.invoke(aggctl, ["config", "check", str(bad)])
    assert res.exit_code == 1
    assert 'dataplane.mode: must be "native" or "generic", not "fast"' in res.output
    assert "dataplane.whatever: unknown key" in res.output
    res = runner.invoke(aggctl, ["config", "check", "--json", str(bad)])
    assert res.exit_code == 1 and '"ok": false' in res.output
