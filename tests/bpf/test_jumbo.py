"""The XDP program at the largest packet size (``protocol.MAX_ELEMENTS``: 32 KiB jumbo packets,
served in generic mode; tests/netns/test_allreduce.py sums them through a lab). BPF_PROG_TEST_RUN
hands a program without fragment support only the first page of a larger frame, as native XDP
would: such a frame must be refused and counted, never summed in part."""
from __future__ import annotations

import numpy as np
import pytest

from aggd.dataplane.xdp.bpf_syscall import prog_test_run
from aggd.dataplane.xdp.loader import XdpDataPlane, XdpError
from aggd.testing.frames import frame
from aggd_client.protocol import MAX_ELEMENTS, Header, MsgType

from .conftest import job_config

pytestmark = pytest.mark.root


def test_program_at_max_elements_loads_and_refuses_a_frame_cut_to_one_page():
    dp = XdpDataPlane(None, mode="generic", elements=MAX_ELEMENTS, total_slots=4)  # the verifier takes it
    try:
        dp.install_job(job_config(world=2, slots=4))
        pkt = frame(Header(type=MsgType.CONTRIB, job=1, rank=0, count=MAX_ELEMENTS),
                    np.ones(MAX_ELEMENTS, np.int32), elements=MAX_ELEMENTS)
        assert len(pkt) > 32 * 1024
        before = dp.job_stats(None).drops
        assert prog_test_run(dp.prog_fd, pkt).verdict_name == "drop"
        after = dp.job_stats(None).drops
        assert {k: after[k] - before[k] for k in after if after[k] != before[k]} == {"too_short": 1}
        assert dp.job_stats(1).counters["contributions"] == 0
    finally:
        dp.close()


def test_packet_sizes_beyond_the_largest_are_refused():
    with pytest.raises(XdpError, match=f"1..{MAX_ELEMENTS}"):
        XdpDataPlane(None, elements=MAX_ELEMENTS + 1)
