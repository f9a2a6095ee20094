"""Pinned maps keep jobs, slots and counters across a reload of the program (daemon restart)."""
import secrets

import numpy as np
import pytest

from aggd.dataplane.xdp.bpf_syscall import prog_test_run
from aggd.dataplane.xdp.loader import XdpDataPlane, XdpError, remove_pinned
from aggd.testing.frames import frame, parse
from aggd_client.protocol import Header, MsgType

from .conftest import ELEMENTS, job_config

pytestmark = pytest.mark.root


def contrib(rank, round_=0):
    return frame(Header(type=MsgType.CONTRIB, job=1, rank=rank, round=round_, count=ELEMENTS),
                 np.full(ELEMENTS, rank + 1, np.int32), elements=ELEMENTS)


@pytest.fixture
def pin_dir():
    path = f"/sys/fs/bpf/aggdtest-{secrets.token_hex(4)}"
    yield path
    remove_pinned(path)


def test_reload_keeps_jobs_half_summed_slots_and_counters(pin_dir):
    dp = XdpDataPlane(None, elements=ELEMENTS, total_slots=64, pin_dir=pin_dir)
    dp.install_job(job_config(job=1, world=3, slots=8))
    dp.install_job(job_config(job=2, world=2, slots=8, group=("239.77.0.2", 47001)))
    assert prog_test_run(dp.prog_fd, contrib(0)).verdict_name == "drop"
    assert prog_test_run(dp.prog_fd, contrib(1)).verdict_name == "drop"
    dp.close()  # the daemon goes away; the maps stay pinned

    dp = XdpDataPlane(None, elements=ELEMENTS, total_slots=64, pin_dir=pin_dir)
    try:
        assert sorted(dp.active_jobs()) == [1, 2]
        assert dp.allocator.free_slots() == 64 - 16  # allocations recovered, nothing double-booked
        res = prog_test_run(dp.prog_fd, contrib(2))  # the third member completes the old round
        assert res.verdict_name == "tx"
        np.testing.assert_array_equal(parse(res.packet).payload, np.full(ELEMENTS, 6))
        assert dp.job_stats(1).counters["contributions"] == 3
    finally:
        dp.close()


def test_other_layout_is_refused_with_the_difference(pin_dir):
    XdpDataPlane(None, elements=ELEMENTS, total_slots=64, pin_dir=pin_dir).close()
    with pytest.raises(XdpError, match="total_slots 64 pinned, 128 now") as info:
        XdpDataPlane(None, elements=ELEMENTS, total_slots=128, pin_dir=pin_dir)
    assert "dataplane.kernel_memory changed since" in str(info.value) and "{" not in str(info.value)


@pytest.mark.parametrize("elements", [1, 256, 832, 2233, 8192])
def test_config_checks_slot_size_is_the_kernels(elements):
    """`aggctl config check` counts slots with ``config.slot_bytes``: the size the daemon measures
    from the maps header (it said 7090 slots where the daemon made 6374)."""
    from aggd.daemon.config import slot_bytes
    from aggd.dataplane.xdp.ops import probe_value_sizes
    assert slot_bytes(elements) == probe_value_sizes(elements)["slots"]
