"""Forged members (issue 16): a host on the segment that is not a member sends contributions with a
member's IP address and port, as fast as it can, for every round and chunk the job uses, while the
real members train. Without the member's tag (handed out in its JOIN_ACK, never on the wire to
anyone else) every forged packet is dropped and counted ``bad_tag``, on the kernel path and on the
user-space path; the members' results stay exact and every one of their contributions counts."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from aggd.lab.runner import LabJob, run_workers

pytestmark = pytest.mark.root

#: The forger: raw IPv4/UDP datagrams (scapy builds them) with a member's source address, claiming
#: rank 0 of the job, for rounds 0..11 and chunks 0..19, each with a guessed tag, over and over until
#: killed (before the member joins they are ``not_member``, after it ``bad_tag``).
FORGER = textwrap.dedent("""
    import socket, sys, time
    import numpy as np
    from scapy.all import IP, UDP, Raw
    from aggd_client.protocol import Header, MsgType
    agg, src_ip, src_port, job, elements, port = (sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]),
                                                  int(sys.argv[5]), int(sys.argv[6]))
    s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
    payload = np.full(elements, 1_000_000, "<i4").tobytes()
    rng = np.random.default_rng(7)
    forged = []
    for rnd in range(12):
        for chunk in range(20):
            tag = (0, 1, int(rng.integers(0, 2**63)))[len(forged) % 3]
            hdr = Header(type=MsgType.CONTRIB, job=job, rank=0, round=rnd, chunk=chunk, count=elements,
                         contributors=tag)
            forged.append(bytes(IP(src=src_ip, dst=agg) / UDP(sport=src_port, dport=port) / Raw(hdr.pack() + payload)))
    print("sending", flush=True)
    while True:
        for pkt in forged:
            s.sendto(pkt, (agg, 0))
        time.sleep(0.05)   # about 5000 packets a second: a flood is not what this test is about
""")


#: Where the job's slots are: in the kernel; in user space behind the XDP program (which checks the
#: tag before it passes a packet up); in user space on its own port (packets larger than the kernel
#: takes), where only the user-space path checks.
PLACEMENTS = {"kernel": ({}, "kernel"), "passed-up": ({"kernel_slots": 0}, "kernel"),
              "userspace-port": ({"elements": 320}, "userspace")}


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_forged_contributions_with_a_members_address_are_dropped_and_results_stay_exact(make_lab, make_daemon,
                                                                                       placement):
    options, checked_by = PLACEMENTS[placement]
    lab = make_lab(3)                 # workers 0 and 1 are the job's members; worker 2 forges
    d = make_daemon(lab)
    job = d.call("jobs.create", name=f"forged-{placement}", world=2, slots=16, **options)
    forger = lab.run(lab.worker_ns(2), [sys.executable, "-c", FORGER, lab.agg_ip, lab.worker_ip(0), "40000",
                                        str(job["id"]), str(job["elements"]), str(job["port"])],
                     stdout=subprocess.PIPE, text=True)
    try:
        # the forger is sending before the members join, and throughout
        assert forger.stdout.readline().strip() == "sending", forger.communicate()
        runs = run_workers(lab, LabJob(job=job["id"], workers=[0, 1], name=job["name"], token=job["token"]),
                           timeout=120, extra=["--sizes", f"{5 * job['elements']},{20 * job['elements']}",
                                               "--rounds", "20", "--pattern", "integers"])
    finally:
        forger.kill()
        forger.wait()
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
        assert len(r.records) == 40 and all(rec["max_abs_error"] == 0 for rec in r.records), r.records
    paths = d.call("jobs.show", job=job["name"])["paths"]
    assert paths[checked_by]["drops"]["bad_tag"] > 100, json.dumps(paths)
    # every member contribution counted once, none of the forger's (duplicates, if any, are the
    # members' own retransmissions)
    served = paths["userspace" if placement != "kernel" else "kernel"]
    assert served["counters"]["contributions"] == 2 * 20 * (5 + 20), paths
    # and operators see it
    assert f"{job['name']}: dropped ({checked_by}): bad_tag " in d.aggctl("status").output
