import pytest

from aggd.testing.frames import AGG_IP, AGG_MAC, worker_addr
from aggd_client import protocol as proto

#: The switch's hosts: every fixture worker on port rank + 1, the daemon host (the aggregator's
#: address: what the switch cannot hold goes there) on port 100.
AGG_PORT_NO = 100
HOSTS = {worker_addr(r)[1]: (worker_addr(r)[0], r + 1) for r in range(proto.MAX_MEMBERS)}
HOSTS[AGG_IP] = (AGG_MAC, AGG_PORT_NO)


def port_of(ip: str) -> int:
    """The switch port a frame from ``ip`` comes in on (strangers: port 200)."""
    return HOSTS.get(ip, (None, 200))[1]


@pytest.fixture(scope="session")
def info():
    from aggd.dataplane.p4.p4info import P4Info
    return P4Info()


@pytest.fixture
def sim(info):
    from tests.harness.p4_switch import SimSwitch
    s = SimSwitch(info, HOSTS)
    yield s
    s.close()


@pytest.fixture
def p4dp(sim):
    from aggd.dataplane.p4.backend import P4DataPlane
    dp = P4DataPlane(sim.address, address=AGG_IP, hosts=HOSTS, registers=sim.registers, elements=256)
    yield dp
    dp.close()


def _xdp_program():
    from ..bpf.conftest import xdp_program
    return xdp_program


xdp_program = _xdp_program()   # the production XDP program, loaded once per session (root)
