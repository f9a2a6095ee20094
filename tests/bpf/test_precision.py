"""The XDP program's narrow lanes outside the equivalence sequences (those are in
test_model_equivalence.py): a round re-run through ``XdpDataPlane.rerun`` (the daemon's way for a
frame the attached program could not grow) is decided as the model decides it, the result's frame is
the result's size, and a contribution with room for its result is answered in its own frame (the
multi-buffer build's narrow packets: test_model_equivalence.py)."""
from __future__ import annotations

import numpy as np
import pytest

from aggd.core.model import AggregatorModel, JobConfig
from aggd_client.protocol import LANES, Header, MsgType, Precision, decode, payload_dtype

from tests.bpf.conftest import ELEMENTS, job_config
from tests.harness.equivalence import member

pytestmark = pytest.mark.root
GROUP = ("239.77.0.9", 47001)


def narrow_job(xdp_program, job: int, world: int, precision: Precision):
    """A job of ``precision`` on the program and on the model: (members, model)."""
    members = {r: member(r) for r in range(world)}
    model = AggregatorModel(ELEMENTS)
    model.add_job(JobConfig(job=job, world=world, slots=4, max_chunks=64, members=members, group=GROUP,
                            precision=precision))
    xdp_program.install_job(job_config(job=job, world=world, slots=4, max_chunks=64, group=GROUP,
                                       members=members, precision=int(precision)))
    return members, model


@pytest.mark.parametrize("precision", (Precision.INT8, Precision.INT16))
def test_a_round_rerun_through_the_program_equals_the_model(xdp_program, precision):
    world, job = 3, 5
    members, model = narrow_job(xdp_program, job, world, precision)
    try:
        lanes = LANES[precision]
        rng = np.random.default_rng(int(precision))
        for round_ in range(3):
            for r in range(world):
                q = rng.integers(-lanes.contrib_max, lanes.contrib_max + 1, ELEMENTS)
                q[:2] = (lanes.contrib_max, -lanes.contrib_max)
                data = Header(type=MsgType.CONTRIB, job=job, rank=r, round=round_, count=ELEMENTS,
                              exponent=r - round_, code=int(precision)).pack() + q.astype(payload_dtype(precision)).tobytes()
                want = model.process(data, members[r], 0)
                got = xdp_program.rerun(data, members[r])
                assert (got.action, got.out, got.dest) == (want.action, want.out, want.dest)
            assert got.addrs == (GROUP,)
            hdr, payload = decode(got.out)
            assert hdr.code == precision and payload.dtype == np.dtype(lanes.result) and len(payload) == ELEMENTS
        stats = xdp_program.job_stats(job)
        assert stats.counters["released"] == 3 and stats.counters["contributions"] == 3 * world
    finally:
        xdp_program.remove_job(job)



@pytest.mark.parametrize("precision", (Precision.INT8, Precision.INT16))
def test_contributions_with_room_are_answered_in_their_own_frame(xdp_program, precision):
    """A narrow contribution that carries room for its result (the JOIN_ACK's ``room``: native XDP on
    veth cannot grow a frame) is answered in the kernel in the frame it came in, the room's junk
    never read: the same result as the model's and as that of the contributions without room, with
    IP and UDP lengths of the result."""
    from aggd.dataplane.xdp.bpf_syscall import XDP_TX, prog_test_run
    from tests.harness.equivalence import frame

    world, job = 2, 6
    members, model = narrow_job(xdp_program, job, world, precision)
    lanes = LANES[precision]
    room = b"\xa5" * (ELEMENTS * (lanes.result_bytes - lanes.contrib_bytes))
    try:
        rng = np.random.default_rng(7)
        for round_ in range(4):
            with_room = round_ % 2 == 0
            for r in range(world):
                q = rng.integers(-lanes.contrib_max, lanes.contrib_max + 1, ELEMENTS).astype(lanes.contrib)
                data = Header(type=MsgType.CONTRIB, job=job, rank=r, round=round_, count=ELEMENTS,
                              code=int(precision)).pack() + q.tobytes() + (room if with_room else b"")
                want = model.process(data, members[r], 0)
                sent = frame(data, members[r])
                got = prog_test_run(xdp_program.prog_fd, sent)
            assert want.action == "tx" and got.verdict == XDP_TX
            out = got.packet
            if with_room:
                assert len(out) == len(sent)      # answered in place: the frame did not grow
            assert int.from_bytes(out[16:18], "big") == len(out) - 14          # IP total length
            assert int.from_bytes(out[38:40], "big") == len(out) - 34          # UDP length
            hdr, payload = decode(out[42:])
            assert hdr.type == MsgType.RESULT and len(payload) == ELEMENTS
            assert out[42:] == want.out
        assert xdp_program.job_stats(job).counters["to_userspace"] == 0
    finally:
        xdp_program.remove_job(job)
