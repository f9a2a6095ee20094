"""How much of the verifier's budget (a million instructions walked to accept a program) the
production XDP program takes at the packet sizes native XDP serves. The verifier walks every
iteration of every payload loop, once for each distinct state it reaches the loop with, so a change
that adds a loop or a way into one shows here, with its count, before the program stops loading at
some size. The jumbo build of generic mode (8192 values a packet, lab only) is held to the whole
budget, less a twentieth."""
from __future__ import annotations

import os

import pytest

from aggd_client import protocol as proto

#: the share of the budget a native build may take: room for the next change
BUDGET_SHARE = 0.8
#: ... and the jumbo build (its loops are 8192 iterations long)
JUMBO_SHARE = 0.95
VERIFIER_BUDGET = 1_000_000


def walked(**data_plane) -> int:
    """Instructions the verifier walks for the program ``XdpDataPlane(None, **data_plane)`` loads."""
    if os.geteuid() != 0:
        pytest.fail("tests/bpf need root (CI runs as root)")
    from aggd.dataplane.xdp.bpf_syscall import BPF_F_XDP_HAS_FRAGS, verified_insns
    from aggd.dataplane.xdp.loader import XdpDataPlane

    dp = XdpDataPlane(None, **data_plane)
    try:
        return verified_insns(dp.insns, flags=BPF_F_XDP_HAS_FRAGS if dp.frags else 0)
    finally:
        dp.close()


@pytest.mark.parametrize("elements", [proto.DEFAULT_ELEMENTS, (1500 - 28 - proto.HEADER_SIZE) // 4,
                                      proto.PAGE_MAX_ELEMENTS, proto.NATIVE_MAX_ELEMENTS],
                         ids=["default", "mtu1500", "one page", "mtu9000 multi-buffer"])
def test_native_builds_leave_room_in_the_verifier_budget(elements):
    n = walked(elements=elements, total_slots=64)
    print(f"{elements} values a packet: the verifier walks {n:,} instructions")
    assert 0 < n <= BUDGET_SHARE * VERIFIER_BUDGET, \
        f"{elements} values a packet: the verifier walks {n:,} of its {VERIFIER_BUDGET:,} instructions"


def test_the_jumbo_build_leaves_room_in_the_verifier_budget():
    n = walked(mode="generic", elements=proto.MAX_ELEMENTS, total_slots=4)
    print(f"{proto.MAX_ELEMENTS} values a packet (generic mode): the verifier walks {n:,} instructions")
    assert 0 < n <= JUMBO_SHARE * VERIFIER_BUDGET, \
        f"the jumbo build: the verifier walks {n:,} of its {VERIFIER_BUDGET:,} instructions"
