"""``aggctl bench xdp``: the production XDP program timed through BPF_PROG_TEST_RUN.

Every timed packet is a real contribution that gets added (64 members contribute to a round, one
of every 64 packets releases it), so the figure is the add path, not a duplicate drop. The kernel
measures each run; syscall overhead is excluded. numpy's int32 add over a large array on the same
machine, in the same run, is the memory-bound limit to compare with. ``harness_ns`` is the same
call timed with an XDP program that only returns XDP_DROP: the share of ``ns_per_packet`` that is
BPF_PROG_TEST_RUN's own (context set-up and the timer), not the aggregator's.
"""
from __future__ import annotations

import time
import types

import numpy as np

from aggd.core import strategy as strat
from aggd.dataplane.xdp.bpf_syscall import prog_test_run
from aggd.testing.frames import frame, raw_frame, worker_addr
from aggd_client.protocol import LANES, PRECISION_OF_BITS, Header, MsgType, values_per_packet

WORLD = 64


def _job(world: int, precision: int = 0):
    return types.SimpleNamespace(job=1, world=world, slots=1, max_chunks=1 << 20, precision=precision,
                                 group=("239.77.0.1", 47001), kernel_slots=None,
                                 members={r: worker_addr(r)[1:] for r in range(world)})


def bench_strategy(dp, text: str, elements: int, packets: int, bits: int = 32, exponents: int = 1) -> dict:
    """``bits`` 8 or 16: a narrow job's contributions, each with room for its result (what native
    XDP's workers send: docs/protocol.md, "Precision"), an 8-bit one of ``2 * elements`` values.
    ``exponents``: how many exponents the members' chunks take (member ``rank`` sends exponent
    ``rank % exponents``), as workers whose chunks' largest values differ do; above 1 the program
    aligns every contribution whose exponent is not its round's so far."""
    prec = PRECISION_OF_BITS[bits]
    lanes, values = LANES[prec], values_per_packet(elements, prec)
    dp.remove_job(1)
    dp.install_job(_job(WORLD, int(prec)))
    dp.set_strategy(1, [strat.to_entry(strat.parse(text).validate(WORLD), 0, 0)])
    rng = np.random.default_rng(0)
    top = min(1000, lanes.contrib_max)
    payloads = [rng.integers(-top, top, values).astype(lanes.contrib).tobytes()
                + bytes(values * (lanes.result_bytes - lanes.contrib_bytes)) for _ in range(8)]
    frames = []
    rounds = -(-packets // WORLD)
    for r in range(rounds):
        for rank in range(WORLD):
            # wbsp: only the last member's step counts to release; all others add as step 0
            hdr = Header(type=MsgType.CONTRIB, job=1, rank=rank, round=r, count=values, code=int(prec),
                         exponent=rank % exponents)
            frames.append(raw_frame(hdr.pack() + payloads[rank % 8], src=worker_addr(rank)))
    frames = frames[:packets]
    total_ns = 0
    verdicts: dict[str, int] = {}
    for f in frames:
        res = prog_test_run(dp.prog_fd, f)
        total_ns += res.duration_ns
        verdicts[res.verdict_name] = verdicts.get(res.verdict_name, 0) + 1
    ns = total_ns / len(frames)
    c = dp.job_stats(1).counters
    return {"system": "aggd-xdp", "strategy": text, "precision": bits, "elements_per_packet": elements,
            "values_per_packet": values, "exponents": exponents, "packets": len(frames),
            "ns_per_packet": ns, "elements_per_s_per_core": values / ns * 1e9,
            "added": int(c["contributions"]), "released": int(c["released"]), "verdicts": verdicts}


EMPTY_PROGRAM = b"int empty(struct xdp_md *ctx) { return XDP_DROP; }"


def harness_ns(elements: int, packets: int) -> float:
    """Mean ns BPF_PROG_TEST_RUN reports for an XDP program that does nothing, on a frame of
    ``elements`` int32 timed one run at a time as :func:`bench_strategy` does."""
    from bcc import BPF

    bpf = BPF(text=b"#include <uapi/linux/bpf.h>\n" + EMPTY_PROGRAM)
    try:
        fd = bpf.load_func(b"empty", BPF.XDP).fd
        hdr = Header(type=MsgType.CONTRIB, job=1, rank=0, round=0, count=elements)
        f = frame(hdr, np.zeros(elements, np.int32), elements=elements)
        return sum(prog_test_run(fd, f).duration_ns for _ in range(packets)) / packets
    finally:
        bpf.cleanup()


def numpy_add(elements: int = 1 << 24, repeat: int = 5) -> dict:
    a = np.ones(elements, np.int32)
    b = np.ones(elements, np.int32)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        np.add(a, b, out=a)
        best = min(best, time.perf_counter() - t0)
    return {"system": "numpy", "strategy": "numpy-add", "elements_per_packet": elements,
            "ns_per_packet": best * 1e9, "elements_per_s_per_core": elements / best}
