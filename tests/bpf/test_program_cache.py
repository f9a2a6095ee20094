"""The XDP program's instructions kept between loads (aggd/dataplane/xdp/program_cache.py): a second
load of the same build takes them instead of compiling, and the program it loads answers every
packet as the compiled one does; pinned maps are kept; an entry that is damaged or does not load is
compiled again; an empty ``AGGD_XDP_CACHE`` keeps nothing. The map value sizes the daemon probes
before loading are kept the same way."""
from __future__ import annotations

import base64
import json
import secrets

import numpy as np
import pytest

from aggd.dataplane.xdp import program_cache
from aggd.dataplane.xdp.bpf_syscall import prog_test_run
from aggd.dataplane.xdp.loader import XdpDataPlane, remove_pinned
from aggd.testing.frames import parse
from aggd_client.protocol import Flag

from .conftest import ELEMENTS, job_config
from tests.fixtures.packets import contrib

pytestmark = pytest.mark.root
SLOTS = 16


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "xdp-cache"
    monkeypatch.setenv("AGGD_XDP_CACHE", str(path))
    return path


def load(**kw) -> XdpDataPlane:
    dp = XdpDataPlane(None, elements=ELEMENTS, total_slots=SLOTS, **kw)
    dp.install_job(job_config(job=1, world=3, slots=4))
    return dp


def packets(seed: int = 3) -> list[bytes]:
    """Contributions of 3 members over 6 rounds and 4 chunks in a shuffled order, some repeated as
    retransmissions and some late: releases, duplicates, stale and busy drops."""
    rng = np.random.default_rng(seed)
    out = []
    for round_ in range(6):
        for chunk in range(4):
            for rank in rng.permutation(3):
                values = rng.integers(-2**20, 2**20, ELEMENTS, dtype=np.int32)
                out.append(contrib(int(rank), round_, chunk, values=values))
                if rng.random() < 0.2:
                    out.append(contrib(int(rank), round_, chunk, values=values, flags=Flag.RETRANSMIT))
    return out


def answers(dp: XdpDataPlane, pkts: list[bytes]) -> list[tuple[str, bytes]]:
    return [(r.verdict_name, r.packet if r.verdict_name == "tx" else b"")
            for r in (prog_test_run(dp.prog_fd, p) for p in pkts)]


def test_a_second_load_takes_the_program_compiled_before_and_answers_the_same(cache):
    compiled = load()
    try:
        assert compiled.compiled and len(list(cache.glob("*.json"))) == 1
        expected = answers(compiled, packets())
        expected_counters = compiled.job_stats(1).counters
    finally:
        compiled.close()
    cached = load()
    try:
        assert not cached.compiled
        got = answers(cached, packets())
        got_counters = cached.job_stats(1).counters
    finally:
        cached.close()
    assert sum(v == "tx" for v, _ in expected) >= 24   # every round of every chunk released, at least
    assert got == expected and got_counters == expected_counters


def test_another_build_is_not_taken_from_an_entry(cache):
    load().close()
    other = XdpDataPlane(None, elements=ELEMENTS, total_slots=SLOTS + 1)
    try:
        assert other.compiled
    finally:
        other.close()
    assert len(list(cache.glob("*.json"))) == 2


def test_pinned_maps_are_kept_by_a_load_from_the_cache(cache):
    pin_dir = f"/sys/fs/bpf/aggdtest-{secrets.token_hex(4)}"
    try:
        dp = load(pin_dir=pin_dir)
        assert dp.compiled
        first = [contrib(r) for r in range(3)]
        assert [prog_test_run(dp.prog_fd, p).verdict_name for p in first[:2]] == ["drop", "drop"]
        dp.close()   # the daemon goes away; the maps stay pinned
        dp = XdpDataPlane(None, elements=ELEMENTS, total_slots=SLOTS, pin_dir=pin_dir)
        try:
            assert not dp.compiled and dp.active_jobs() == [1]
            res = prog_test_run(dp.prog_fd, first[2])   # the third member completes the pinned round
            assert res.verdict_name == "tx"
            np.testing.assert_array_equal(parse(res.packet).payload, np.full(ELEMENTS, 6))
        finally:
            dp.close()
    finally:
        remove_pinned(pin_dir)


def _entry(cache):
    (path,) = cache.glob("*.json")
    return path, json.loads(path.read_text())


@pytest.mark.parametrize("damage", ["not json", "digest", "refused by the verifier"])
def test_an_entry_that_is_damaged_or_does_not_load_is_compiled_again(cache, damage, caplog):
    load().close()
    path, entry = _entry(cache)
    if damage == "not json":
        path.write_text("{")
    elif damage == "digest":
        entry["loads"] = entry["loads"][1:]
        path.write_text(json.dumps(entry))
    else:
        # a program of one instruction with no exit, entered with a right digest
        insns = bytes([0xb7, 0, 0, 0, 2, 0, 0, 0])
        entry.update(insns=base64.b64encode(insns).decode(), loads=[],
                     digest=program_cache._digest(insns, [], entry["license"].encode()))
        path.write_text(json.dumps(entry))
    dp = load()
    try:
        assert dp.compiled
        assert sum(v == "tx" for v, _ in answers(dp, packets())) >= 24
    finally:
        dp.close()
    assert "compiling" in caplog.text or "unreadable" in caplog.text
    # the entry was replaced by the compiled program's, which the next load takes
    again = load()
    try:
        assert not again.compiled
    finally:
        again.close()


def test_an_empty_cache_setting_keeps_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("AGGD_XDP_CACHE", "")
    assert program_cache.cache_dir() is None
    for _ in range(2):
        dp = load()
        try:
            assert dp.compiled
        finally:
            dp.close()


def test_the_cache_is_where_systemd_says(monkeypatch):
    monkeypatch.delenv("AGGD_XDP_CACHE", raising=False)
    monkeypatch.setenv("CACHE_DIRECTORY", "/var/cache/aggd")
    assert str(program_cache.cache_dir()) == "/var/cache/aggd/xdp"
    monkeypatch.delenv("CACHE_DIRECTORY")
    assert str(program_cache.cache_dir()) == "/var/cache/aggd/xdp"


def test_the_map_value_sizes_the_daemon_probes_are_kept_and_a_damaged_entry_probed_again(cache):
    from aggd.dataplane.xdp import ops
    probed = ops.probe_value_sizes(ELEMENTS)
    (path,) = cache.glob("*.json")
    assert ops.probe_value_sizes(ELEMENTS) == probed
    entry = json.loads(path.read_text())
    entry["value"]["slots"] += 8
    path.write_text(json.dumps(entry))
    assert ops.probe_value_sizes(ELEMENTS) == probed      # the digest caught it: probed again
    dp = load()
    try:
        assert ops.slot_size(dp) == probed["slots"]
    finally:
        dp.close()
