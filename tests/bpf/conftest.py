import os
import types

import pytest

from aggd_client import protocol as proto

ELEMENTS = 256


def job_config(job=1, world=3, slots=8, max_chunks=1 << 20, group=("239.77.0.1", proto.DEFAULT_RESULT_PORT),
               members=None, kernel_slots=None, tags=None, upstream=None, precision=0, bound=None, norm_bound=None):
    from aggd.testing.frames import worker_addr
    if members is None:
        members = {r: worker_addr(r)[1:] for r in range(world)}
    return types.SimpleNamespace(job=job, world=world, slots=slots, max_chunks=max_chunks, group=group,
                                 members=members, kernel_slots=kernel_slots, tags=tags or {}, upstream=upstream,
                                 precision=precision, bound=bound, norm_bound=norm_bound)


@pytest.fixture(scope="session")
def xdp_program():
    """The production XDP program, loaded once (not attached): run through BPF_PROG_TEST_RUN."""
    if os.geteuid() != 0:
        pytest.fail("tests/bpf need root (CI runs as root)")
    from aggd.dataplane.xdp.loader import XdpDataPlane
    dp = XdpDataPlane(None, elements=ELEMENTS, total_slots=256)
    yield dp
    dp.close()


@pytest.fixture
def dp(xdp_program):
    """The program with a clean job table: job 1 (3 members) installed."""
    for j in range(8):
        xdp_program.remove_job(j)
    xdp_program._reset_stats(proto.MAX_JOBS)
    xdp_program.install_job(job_config())
    return xdp_program


@pytest.fixture(scope="module")
def harness(xdp_program):
    """The reference model and the XDP program side by side (tests/harness/xdp_model.py)."""
    from tests.fixtures.scenarios import JOB
    from tests.harness.xdp_model import Harness
    h = Harness(xdp_program)
    yield h
    xdp_program.set_clock(0)      # real time again for whoever uses the program next
    xdp_program.remove_job(JOB)
