"""Every aggctl command against a running daemon, and its error paths: daemon not running, refused
request, unknown job, bad strategy, bad config."""
from __future__ import annotations

import json

import pytest


pytestmark = pytest.mark.root


def ok(result):
    assert result.exit_code == 0, result.output
    return result.output


def test_every_command(make_lab, make_daemon, slot_bytes, tmp_path):
    lab = make_lab(1)
    d = make_daemon(lab, dataplane={"kernel_memory": 24 * slot_bytes})

    out = ok(d.aggctl("status"))
    assert "XDP native on agg0" in out and "24 slots" in out and "no jobs" in out
    status = json.loads(ok(d.aggctl("status", "--json")))
    assert status["kernel"]["budget_slots"] == 24 and status["kernel"]["slot_bytes"] == slot_bytes
    assert status["userspace"]["alive"] and status["dataplane"]["attached"]

    out = ok(d.aggctl("jobs", "create", "resnet", "--world", "2", "--slots", "16"))
    assert "token: " in out and "kernel 0..15" in out
    made = json.loads(ok(d.aggctl("jobs", "create", "bert", "--world", "3", "--slots", "16", "--json")))
    assert (made["kernel_slots"], made["userspace_slots"]) == (8, 8)  # what was left of the budget
    assert made["placement"]["userspace"]["slots"] == [8, 16] and len(made["token"]) == 32
    assert json.loads(ok(d.aggctl("jobs", "create", "tiny", "--world", "1", "--kernel-slots", "0",
                                  "--json")))["kernel_slots"] == 0

    out = ok(d.aggctl("jobs", "list"))
    assert out.splitlines()[0].split() == ["JOB", "ID", "WORLD", "JOINED", "STRATEGY", "SLOTS", "KERNEL",
                                           "USERSPACE", "VALUES/PACKET"]
    assert [r["name"] for r in json.loads(ok(d.aggctl("jobs", "list", "--json")))] == ["resnet", "bert", "tiny"]

    out = ok(d.aggctl("jobs", "show", "bert"))
    assert "kernel:     slots 0..7" in out and "user space: slots 8..15" in out and made["token"] in out
    shown = json.loads(ok(d.aggctl("jobs", "show", str(made["id"]), "--json")))
    assert shown["paths"]["kernel"]["counters"]["released"] == 0 and shown["round"] is None

    out = ok(d.aggctl("workers", "bert"))
    assert out.count("not joined") == 3
    workers = json.loads(ok(d.aggctl("workers", "bert", "--json")))
    assert [w["rank"] for w in workers["workers"]] == [0, 1, 2]

    out = ok(d.aggctl("strategy", "show", "resnet"))
    assert "sync (version 0)" in out
    assert json.loads(ok(d.aggctl("strategy", "show", "resnet", "--json")))["versions"] == \
        [{"version": 0, "from_round": 0, "strategy": "sync"}]
    # a valid hot swap: applied where the kernel can take it, refused (and nothing recorded) where not
    res = d.aggctl("strategy", "set", "resnet", "quorum:2:20ms", "--from-round", "5")
    assert res.exit_code == 0 and "version 1" in res.output, res.output
    # before round 5 sync still governs: show says which is in force and which comes
    out = ok(d.aggctl("strategy", "show", "resnet"))
    assert "sync (version 0) in force, round -; quorum:2:20ms (version 1) from round 5" in out, out
    # a job served wholly in user space takes a swap too
    out = ok(d.aggctl("strategy", "set", "tiny", "sync", "--from-round", "3"))
    assert "sync from round 3 (version 1)" in out
    # before the job's first round a new version replaces the whole table (no row has governed a
    # round): setting strategies again and again never fills it
    for version, text in enumerate(("sync", "async", "sync", "sync", "ssp:1", "wbsp"), start=2):
        assert json.loads(ok(d.aggctl("strategy", "set", "tiny", text, "--json")))["version"] == version
    assert json.loads(ok(d.aggctl("strategy", "show", "tiny", "--json")))["versions"] == \
        [{"version": 7, "from_round": 0, "strategy": "wbsp"}]

    # error paths: bad strategy text (caught before the daemon), invalid for the job, unknown job
    for argv in (("strategy", "set", "resnet", "fastest"), ("jobs", "create", "y", "--world", "2", "--strategy", "fastest")):
        res = d.aggctl(*argv)
        assert res.exit_code == 2 and "unknown strategy 'fastest'" in res.output, (argv, res.output)
    res = d.aggctl("strategy", "set", "resnet", "quorum:7")
    assert res.exit_code == 1 and "aggd refused" in res.output and "quorum k=7" in res.output
    for argv in (("jobs", "show", "nope"), ("workers", "nope"), ("strategy", "show", "nope"),
                 ("jobs", "delete", "nope"), ("strategy", "set", "nope", "sync")):
        res = d.aggctl(*argv)
        assert res.exit_code == 1 and "no job 'nope'" in res.output, (argv, res.output)
    res = d.aggctl("jobs", "create", "resnet", "--world", "2")  # refused: the name is taken
    assert res.exit_code == 1 and "exists already" in res.output
    res = d.aggctl("jobs", "create", "x", "--world", "2", "--strategy", "ssp:9")
    assert res.exit_code == 1 and "staleness" in res.output

    out = ok(d.aggctl("jobs", "delete", "bert"))
    assert "8 kernel slots freed" in out
    assert json.loads(ok(d.aggctl("status", "--json")))["kernel"]["free_slots"] == 8
    assert json.loads(ok(d.aggctl("jobs", "delete", "tiny", "--json")))["freed_kernel_slots"] == 0

    bad = tmp_path / "bad.toml"
    bad.write_text('[dataplane]\nmode = "fast"\n')
    res = d.aggctl("config", "check", str(bad))
    assert res.exit_code == 1 and 'dataplane.mode: must be "native" or "generic", not "fast"' in res.output
    assert ok(d.aggctl("config", "check", str(d.config_path))).endswith("shows the exact number)\n")

    d.stop()
    for argv in (("status",), ("jobs", "list"), ("jobs", "show", "resnet"), ("workers", "resnet"),
                 ("strategy", "show", "resnet"), ("jobs", "create", "y", "--world", "1"),
                 ("jobs", "delete", "resnet"), ("strategy", "set", "resnet", "sync")):
        res = d.aggctl(*argv)
        assert res.exit_code == 3 and "aggd is not running" in res.output, (argv, res.output)
