"""The daemon's log lines: under systemd (JOURNAL_STREAM naming stderr) each line carries its
syslog priority, so that the journal files errors as errors; elsewhere plain lines."""
from __future__ import annotations

import logging
import os

from aggd.daemon import main


def _lines(tmp_path, monkeypatch, journal: bool) -> list[str]:
    path = tmp_path / "stderr"
    with open(path, "w") as stream:
        st = os.fstat(stream.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}" if journal else "1:2")
        root = logging.getLogger()
        before = list(root.handlers)
        try:
            main._setup_logging("debug", stream)
            log = logging.getLogger("aggd")
            log.error("the XDP program failed")
            log.warning("reloaded; these changes need a restart: dataplane.port")
            log.info("serving")
            try:
                raise ValueError("boom")
            except ValueError:
                log.exception("a request failed")
        finally:
            for h in root.handlers[len(before):]:
                root.removeHandler(h)
    return path.read_text().splitlines()


def test_lines_carry_their_priority_on_the_journal(tmp_path, monkeypatch):
    lines = _lines(tmp_path, monkeypatch, journal=True)
    assert lines[:3] == ["<3>ERROR aggd: the XDP program failed",
                         "<4>WARNING aggd: reloaded; these changes need a restart: dataplane.port",
                         "<6>INFO aggd: serving"]
    assert all(line.startswith("<3>") for line in lines[3:]) and any("ValueError: boom" in l for l in lines[3:])


def test_plain_lines_elsewhere(tmp_path, monkeypatch):
    lines = _lines(tmp_path, monkeypatch, journal=False)
    assert lines[0] == "ERROR aggd: the XDP program failed" and not any(l.startswith("<") for l in lines)
