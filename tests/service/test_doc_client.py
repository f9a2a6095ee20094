"""A client written from docs/protocol.md alone (tests/harness/doc_client.py, by a session that read
only the user documents) against the real daemon and its XDP program in a lab: the document is
exact enough for others' clients, at every precision, with tensors that change size between calls
(DDP's buckets of 362 and 2048 values, and odd sizes), under loss.

And what such a client may get wrong without wedging the job: a contribution not padded to the
packet size, for a chunk of the kernel's slots, is dropped ``bad_count`` (passed up, the user-space
path served it beside the kernel's slot, and the kernel refused the chunk's next round for good).
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.root

ROOT = Path(__file__).resolve().parents[2]
DOC_CLIENT = ROOT / "tests" / "harness" / "doc_client.py"


def start_members(lab, job: dict, argv: list[str], world: int) -> list[subprocess.Popen]:
    return [lab.run(lab.worker_ns(w), [sys.executable, str(DOC_CLIENT), "--server", f"{lab.agg_ip}:47000",
                                       "--bind", f"{lab.worker_ip(w)}:40000", "--job", job["name"],
                                       "--token", job["token"], "--rank", str(w), *argv],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for w in range(world)]


def records(procs, timeout: float = 240) -> list[list[dict]]:
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        assert p.returncode == 0, stdout[-2000:] + stderr[-2000:]
        out.append([json.loads(line) for line in stdout.splitlines() if line.startswith("{")])
    return out


#: (precision, loss %, where the job's slots are): in the kernel; in user space behind the XDP
#: program; in user space on its own port, for a packet size the kernel does not take
CASES = [(32, 0.0, "kernel"), (32, 2.0, "kernel"), (16, 2.0, "kernel"), (8, 0.0, "kernel"), (8, 2.0, "kernel"),
         (32, 2.0, "userspace"), (8, 0.0, "userspace"), (32, 2.0, "userspace-port")]
PLACEMENT = {"kernel": {}, "userspace": {"kernel_slots": 0}, "userspace-port": {"elements": 300}}


@pytest.mark.parametrize("bits,loss,placement", CASES)
def test_a_client_written_from_the_protocol_document(make_lab, make_daemon, bits, loss, placement):
    world = 3
    lab = make_lab(world, loss_percent=loss)
    d = make_daemon(lab)
    job = d.call("jobs.create", name=f"doc{bits}", world=world, slots=8, precision=bits, **PLACEMENT[placement])
    sizes = "362,2048,362,2048,1,257,5000"      # DDP-like buckets; one value; more chunks than slots
    runs = records(start_members(lab, job, ["--sizes", sizes, "--iters", "21", "--seed", str(bits)], world))
    for rank, recs in enumerate(runs):
        assert len(recs) == 21 and all(r["ok"] for r in recs), (rank, [r for r in recs if not r["ok"]][:3])
        assert all(r["max_err_over_bound"] <= 1.0 for r in recs)
    paths = d.call("jobs.show", job=job["name"])["paths"]
    served = "kernel" if placement == "kernel" else "userspace"
    assert paths[served]["counters"]["released"] > 0, paths
    if loss:
        assert sum(r["retransmits"] for recs in runs for r in recs) > 0


#: One member: a call of two chunks, padded; then one whose chunk 1 goes out unpadded (``count``
#: values, not the packet's); then that round again padded, as the document asks, and more calls.
UNPADDED = textwrap.dedent("""
    import json, sys
    import numpy as np
    sys.path.insert(0, sys.argv[1])
    from tests.harness.doc_client import DocClient, ProtocolError
    server, bind, job, token, rank = sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], int(sys.argv[6])
    host, port = server.rsplit(":", 1)
    bhost, bport = bind.rsplit(":", 1)
    c = DocClient((host, int(port)), job, rank, token, bind=(bhost, int(bport)), give_up=3.0)

    def call(n):
        try:
            return float(c.allreduce(np.full(n, rank + 1.0, np.float32))[0][-1])
        except ProtocolError:
            return "no answer"
    out = {"padded": call(300)}
    padded = c.payload
    c.payload = lambda q: q.tobytes()          # unpadded: a short last chunk
    out["unpadded"] = call(300)
    c.payload = padded
    out["after"] = [call(n) for n in (300, 300, 2048, 300)]
    print(json.dumps(out), flush=True)
""")


@pytest.mark.parametrize("bits", [32, 8])
def test_an_unpadded_contribution_is_dropped_and_the_chunk_goes_on(make_lab, make_daemon, bits):
    lab = make_lab(2)
    d = make_daemon(lab)
    job = d.call("jobs.create", name="unpadded", world=2, slots=8, precision=bits)
    assert d.call("jobs.show", job="unpadded")["kernel_slots"] == 8
    procs = [lab.run(lab.worker_ns(w), [sys.executable, "-c", UNPADDED, str(ROOT), f"{lab.agg_ip}:47000",
                                        f"{lab.worker_ip(w)}:40000", job["name"], job["token"], str(w)],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for w in range(2)]
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr[-3000:]
        out = json.loads(stdout.splitlines()[-1])
        # the short chunk was dropped (no answer); padded, the same round and the next ones are right
        # (before, the user-space path answered it, and the kernel refused every later round of the chunk)
        assert out == {"padded": 3.0, "unpadded": "no answer", "after": [3.0, 3.0, 3.0, 3.0]}, out
    paths = d.call("jobs.show", job="unpadded")["paths"]
    assert paths["userspace"]["drops"]["bad_count"] >= 2, paths
    assert paths["userspace"]["counters"]["contributions"] == 0, paths     # nothing served beside the kernel


#: One member of a sync job: six calls, then a first copy of its round-0 contribution again (a packet
#: the network delayed, without the retransmit flag), then a call: its result is its own value.
DELAYED_COPY = textwrap.dedent("""
    import json, sys
    import numpy as np
    sys.path.insert(0, sys.argv[1])
    from tests.harness import doc_client as dc
    server, bind, job, token = sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
    host, port = server.rsplit(":", 1)
    bhost, bport = bind.rsplit(":", 1)
    c = dc.DocClient((host, int(port)), job, 0, token, bind=(bhost, int(bport)), give_up=10.0)
    for _ in range(6):
        c.allreduce(np.ones(100, np.float32))
    e, q = c.quantise(np.full(100, 100.0, np.float32))
    copy = dc.header(type=dc.T_CONTRIB, job=c.job_id, rank=0, round=0, chunk=0, count=100, exponent=e,
                     contributors=c.tag) + c.payload(q)
    c.sock.sendto(copy, c.dest)
    out, info = c.allreduce(np.ones(100, np.float32))
    print(json.dumps({"value": float(out[0]), "n_contrib": info["n_contrib"], "flags": info["flags"]}), flush=True)
""")


def test_a_delayed_first_copy_is_not_added_to_a_later_sync_round(make_lab, make_daemon):
    """Under sync every round releases with every member, so a contribution to a round the slot no
    longer holds is a copy of one counted, retransmitted or not: dropped ``stale``, never carried
    into a later round (it made that round's sum 101 with 2 contributions, flagged carried)."""
    lab = make_lab(1)
    d = make_daemon(lab)
    job = d.call("jobs.create", name="delayed", world=1, slots=4)
    proc = lab.run(lab.worker_ns(0), [sys.executable, "-c", DELAYED_COPY, str(ROOT), f"{lab.agg_ip}:47000",
                                      f"{lab.worker_ip(0)}:40000", job["name"], job["token"]],
                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr[-3000:]
    assert json.loads(stdout.splitlines()[-1]) == {"value": 1.0, "n_contrib": [1], "flags": 0}
    paths = d.call("jobs.show", job="delayed")["paths"]
    assert paths["kernel"]["drops"]["stale"] == 1 and paths["kernel"]["counters"]["carried"] == 0, paths
