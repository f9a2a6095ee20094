"""The daemon's life: READY/WATCHDOG/RELOADING/STOPPING on its NOTIFY_SOCKET, SIGHUP reload, SIGTERM
detaching XDP while the maps stay pinned, and a restart that finds the jobs again."""
from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from aggd.lab.namespaces import xdp_prog_id

pytestmark = pytest.mark.root


def test_notify_reload_and_clean_stop(make_lab, make_daemon):
    lab = make_lab(1)
    d = make_daemon(lab, start=False)
    d.start(env={"WATCHDOG_USEC": "1000000"})  # a ping every 0.5 s
    ready = d.notify.wait_for("READY=1", 5)
    assert any(m.startswith("STATUS=") for m in d.notify.messages[ready].split("\n")[1:])
    d.notify.wait_for("WATCHDOG=1", 5, after=ready)
    assert xdp_prog_id(lab.agg_ns, lab.agg_ifname) is not None

    created = d.call("jobs.create", name="before", world=1)
    assert created["slots"] == 16
    # SIGHUP: a reloadable key applies to jobs created afterwards; a bad file is refused whole
    d.configure(jobs={"default_slots": 32}, log={"level": "debug"})
    mark = len(d.notify.messages)
    d.send(signal.SIGHUP)
    d.notify.wait_for("RELOADING=1", 10, after=mark)
    d.notify.wait_for("READY=1", 10, after=mark)
    assert d.call("jobs.create", name="after", world=1)["slots"] == 32
    assert "applied: jobs.default_slots = 32, log.level = 'debug'" in d.log()   # what a reload did
    d.configure(dataplane={"mode": "fast"})
    mark = len(d.notify.messages)
    d.send(signal.SIGHUP)
    d.notify.wait_for("READY=1", 10, after=mark)
    assert 'dataplane.mode: must be "native" or "generic", not "fast"' in d.log()
    assert d.call("status")["dataplane"]["mode"] == "native"  # still running, old config
    # a key that needs a restart: logged, and status shows the value in effect until then
    d.configure(dataplane={"mode": "native", "port": 47100})
    mark = len(d.notify.messages)
    d.send(signal.SIGHUP)
    d.notify.wait_for("READY=1", 10, after=mark)
    assert "these changes need a restart: dataplane.port" in d.log()
    assert d.call("status")["dataplane"]["port"] == 47000
    d.configure(dataplane={"mode": "native", "port": 47000})

    # SIGTERM: STOPPING=1, XDP detached, maps and state kept
    mark = len(d.notify.messages)
    assert d.stop(signal.SIGTERM) == 0
    d.notify.wait_for("STOPPING=1", 1, after=mark)
    assert xdp_prog_id(lab.agg_ns, lab.agg_ifname) is None
    assert set(os.listdir(d.pin_dir)) >= {"jobs", "members", "slots", "stats"}
    saved = json.loads((d.state_dir / "state.json").read_text())
    assert [j["name"] for j in saved["jobs"]] == ["before", "after"]
    assert not Path(d.socket).exists()

    d.start()  # re-attaches to the pinned maps and restores both jobs
    assert [j["name"] for j in d.call("jobs.list")] == ["before", "after"]
    assert "kernel slots kept" in d.log()
    assert xdp_prog_id(lab.agg_ns, lab.agg_ifname) is not None


def refused_start(d, **dataplane) -> str:
    """Start ``d`` with these ``[dataplane]`` settings: it must exit 1 before READY; its log."""
    d.configure(dataplane=dataplane)
    d.start(wait=False)
    assert d.proc.wait(60) == 1
    return d.log()


def test_unpin_on_stop_and_refusing_to_start(make_lab, make_daemon):
    lab = make_lab(1)
    d = make_daemon(lab, dataplane={"unpin_on_stop": True})
    d.call("jobs.create", name="a", world=1)
    d.stop()
    assert not Path(d.pin_dir).exists()
    d.start()  # jobs come back from the state file, their kernel slots empty
    assert [j["name"] for j in d.call("jobs.list")] == ["a"]
    assert "kernel slots installed empty" in d.log()
    d.stop()
    # a smaller kernel_memory over the pinned maps: what changed, and how to start anyway
    d.configure(dataplane={"unpin_on_stop": False})
    d.start()
    d.stop()
    assert "dataplane.kernel_memory changed since: restore the old settings, or start once with " \
           "--reset-kernel-state (under systemd: AGGD_OPTS=--reset-kernel-state in /etc/default/aggd" in \
        refused_start(d, kernel_memory="4MiB")
    d.start("--reset-kernel-state")
    d.stop()
    d.configure(dataplane={"unpin_on_stop": True})
    d.start()
    d.stop()
    # a bad interface is a clear error and a non-zero exit before READY
    assert "no interface nosuch0" in refused_start(d, interface="nosuch0")
    # a namespace that does not exist: named by its key, no traceback
    log = refused_start(d, netns="nosuchns")
    assert "dataplane.netns: no network namespace 'nosuchns'" in log and "Traceback" not in log


def test_a_jumbo_link_names_the_settings_native_xdp_needs(make_lab, make_daemon):
    """The default packet (256 values, a one-page program) on a link of MTU 9000, as `aggctl lab up`
    makes by default: native attach fails (the kernel says only ERANGE), and the daemon says why
    and which settings fix it; with larger packets (the multi-buffer program) it starts."""
    lab = make_lab(1, mtu=9000)
    d = make_daemon(lab, start=False)
    d.start(wait=False)
    assert d.proc.wait(60) == 1
    assert "MTU 9000" in d.log() and "dataplane.elements_per_packet above 832" in d.log(), d.log()[-2000:]
    assert 'dataplane.mode = "generic"' in d.log() and "Traceback" not in d.log()
    # the failed start pinned maps afresh and removed them: the next start needs no reset
    assert not Path(d.pin_dir).exists() or not any(Path(d.pin_dir).iterdir())
    d.configure(dataplane={"elements_per_packet": 2233})
    d.start()
    status = d.call("status")["dataplane"]
    assert status["attached"] and status["elements"] == 2233


def test_a_stop_after_the_namespace_went_away_is_clean(make_lab, make_daemon):
    """The data plane's namespace deleted under a running daemon (a lab taken down first): its
    interfaces and their program went with it, and SIGTERM stops the daemon cleanly, saying so."""
    lab = make_lab(1)
    d = make_daemon(lab)
    subprocess.run(["ip", "netns", "del", lab.agg_ns], check=True)
    assert d.stop(signal.SIGTERM) == 0
    assert "is gone: nothing to detach" in d.log() and "Traceback" not in d.log(), d.log()[-3000:]


def test_a_second_daemon_on_the_interface_leaves_the_first_alone(make_lab, make_daemon):
    """An operator starts aggd by hand with the service's config while the service runs: it refuses
    before it touches the interface, naming the running one, and the first keeps its program. The
    status and the health gauge read the link: a program detached behind the daemon's back shows."""
    from aggd.lab.namespaces import in_netns
    from tests.harness.prometheus import free_port

    lab = make_lab(1)
    port = free_port(lab.agg_ns)
    d = make_daemon(lab, metrics={"address": f"127.0.0.1:{port}"})
    prog = xdp_prog_id(lab.agg_ns, lab.agg_ifname)
    second = subprocess.run(d.command(), capture_output=True, text=True, timeout=120)
    assert second.returncode == 1
    assert f"another aggd (pid {d.proc.pid}) serves dataplane.interface {lab.agg_ifname} in namespace " \
           f"{lab.agg_ns}" in second.stderr, second.stderr[-2000:]
    assert "attached" not in second.stderr and "Traceback" not in second.stderr
    assert xdp_prog_id(lab.agg_ns, lab.agg_ifname) == prog
    assert d.call("status")["dataplane"]["attached"] is True
    subprocess.run(["ip", "netns", "exec", lab.agg_ns, "ip", "link", "set", "dev", lab.agg_ifname, "xdp", "off"],
                   check=True)
    assert d.call("status")["dataplane"]["attached"] is False
    with in_netns(lab.agg_ns):
        import urllib.request
        page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert "aggd_xdp_attached 0.0" in page


def test_a_control_group_the_daemon_is_not_in_names_the_fix(make_lab, make_daemon):
    """Under the unit's capabilities (no CAP_CHOWN) the daemon can give its socket only to a group
    it is in: the start, and a reload, say which key and how to fix it, and a reload keeps the
    group it had (not reported applied)."""
    import grp
    group = next(g.gr_name for g in grp.getgrall() if g.gr_gid not in os.getgroups() and g.gr_gid != 0)
    lab = make_lab(1)
    d = make_daemon(lab)
    d.configure(control={"group": group})
    mark = len(d.notify.messages)
    d.send(signal.SIGHUP)
    d.notify.wait_for("READY=1", 10, after=mark)
    assert f"reload: control.group '{group}': the daemon is not in that group" in d.log()
    assert f"SupplementaryGroups={group}" in d.log() and "control.group stays ''" in d.log()
    assert "control.group =" not in d.log()
    d.stop()
    d.start(wait=False)
    assert d.proc.wait(60) == 1
    assert f"cannot start: control.group '{group}': the daemon is not in that group" in d.log(), d.log()[-2000:]
