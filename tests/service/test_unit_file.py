"""The systemd unit: `systemd-analyze verify` accepts it (rendered with this venv's aggd, since verify
checks that ExecStart exists), and it names what the daemon needs."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from .conftest import ROOT, UNIT, unit_capabilities


def test_systemd_analyze_verify(tmp_path):
    assert shutil.which("systemd-analyze"), "systemd-analyze is part of the test environment"
    aggd = Path(sys.executable).with_name("aggd")
    assert aggd.exists(), f"{aggd}: install the project (make setup)"
    text = UNIT.read_text()
    assert "ExecStart=/opt/aggd/venv/bin/aggd " in text
    unit = tmp_path / "aggd.service"
    unit.write_text(text.replace("/opt/aggd/venv/bin/aggd", str(aggd)))
    res = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True)
    # verify exits 0 on some bad values and only warns: any output is a finding
    assert res.returncode == 0 and not res.stdout.strip() and not res.stderr.strip(), res.stdout + res.stderr


def test_unit_contents():
    text = UNIT.read_text()
    for line in ("Type=notify", "ExecReload=/bin/kill -HUP $MAINPID", "Restart=on-failure",
                 "RestartPreventExitStatus=2",
                 "EnvironmentFile=-/etc/default/aggd", "ProtectSystem=strict", "PrivateTmp=yes",
                 "NoNewPrivileges=yes", "RestrictAddressFamilies=AF_UNIX AF_INET AF_NETLINK",
                 "ReadWritePaths=/sys/fs/bpf", "StateDirectory=aggd", "RuntimeDirectory=aggd"):
        assert line in text.splitlines(), line
    assert any(l.startswith("WatchdogSec=") for l in text.splitlines())
    assert unit_capabilities() == ["CAP_BPF", "CAP_NET_ADMIN", "CAP_PERFMON", "CAP_SYS_ADMIN"]
    assert (ROOT / "systemd" / "aggd.env").exists()
