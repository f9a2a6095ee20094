"""``aggctl bench kernels``: the client's numba kernels alone, on one core, in ns a value.

Each worker runs three of them a call (``aggd_client._fast``): the finiteness check of the tensor,
the fill (quantise a run of chunks into the packet ring; stochastic rounding at 8 and 16 bits) and
the scatter (dequantise a batch of received results into the output). They are called here as the
client calls them: a tensor of ``values`` random normal values, chunks of a packet's values at the
precision (``values_per_packet``), a ring of ``ring`` packets filled in runs that wrap, results read
in batches of ``batch`` (the staging array's records, as the client lays them out). The best of
``repeats`` runs is reported, so the figures are what the code costs, not what the host lent it.
"""
from __future__ import annotations

import math
import time

import numpy as np

from aggd_client import _fast, quant
from aggd_client.protocol import (HEADER_SIZE, LANES, MAGIC, PRECISION_OF_BITS, VERSION, ZERO_EXPONENT, MsgType,
                                  StrategyKind, packet_dtype, values_per_packet)
from aggd_client.transport import staging_dtype

KERNELS = ("all_finite", "fill", "scatter")


def _best(fn, repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _fill_run(x: np.ndarray, bits: int, world: int, elements: int, ring_rows: int):
    """A closure filling all of ``x`` into a ring of ``ring_rows`` packets, as a send does."""
    prec = PRECISION_OF_BITS[bits]
    V = values_per_packet(elements, prec)
    n = -(-x.size // V)
    R = min(ring_rows, n)
    ring = np.zeros(R, packet_dtype(V, prec, room=bits != 32))
    u8 = ring.view(np.uint8).reshape(R, -1)
    absmask, pick_b, pick_f = _fast.fill_args(x.dtype)
    xb = x.view(pick_b.dtype)
    fq, jq = quant._q_frexp(world, None, prec)
    qmax = quant.q_max(world, None, prec)
    state = np.array([0x9E3779B97F4A7C15], np.uint64)
    cap, own = np.full(n, ZERO_EXPONENT, np.int32), np.zeros(n, np.int32)  # own scales, as without feedback

    def run():
        c0 = 0
        while c0 < n:  # runs of at most the ring, split where it wraps
            r0 = c0 % R
            k = min(n - c0, R - r0)
            if bits == 32:
                _fast.fill(x, xb, absmask, pick_b, pick_f, c0, c0, k, V, fq, jq, u8, u8.view(np.int32), r0, 0, cap, own)
            else:
                _fast.fill_narrow(x, xb, absmask, pick_b, pick_f, c0, c0, k, V, fq, jq, u8,
                                  u8.view(LANES[prec].contrib), r0, 0, qmax, state, cap, own)
            c0 += k
    return run, V


def _scatter_run(x: np.ndarray, bits: int, world: int, elements: int, batch: int):
    """A closure reading every chunk's result of ``x``'s size into a float32 output, ``batch``
    results a call, from a staging array laid out as the client's."""
    prec = PRECISION_OF_BITS[bits]
    lanes = LANES[prec]
    V = values_per_packet(elements, prec)
    n = -(-x.size // V)
    stage = np.zeros(batch, staging_dtype(V, lanes))
    h = stage["hdr"]
    h["magic"], h["version"], h["type"], h["job"], h["round"] = MAGIC, VERSION, MsgType.RESULT, 1, 0
    h["count"], h["code"], h["n_contrib"], h["strategy"] = V, int(prec), world, StrategyKind.SYNC
    # a result of world contributions of a unit normal's chunk: its exponent and values' magnitude
    e = int(quant.chunk_exponents(np.array([4.5]), world, None, prec)[0])
    h["exponent"] = e
    rng = np.random.default_rng(0)
    stage["payload"] = rng.integers(-lanes.result_max // 2, lanes.result_max // 2, (batch, V)).astype(lanes.result)
    u8 = stage.view(np.uint8).reshape(batch, -1)
    pay = stage["payload"]
    out = np.empty(n * V, np.float32)
    sizes = np.full(batch, HEADER_SIZE + lanes.result_bytes * V, np.int64)
    acks, meta = np.zeros(batch, np.int64), np.zeros(3, np.int64)
    have, ncontrib, res_exp = np.zeros(n, np.uint8), np.zeros(n, np.uint16), np.zeros(n, np.int16)
    chunk_ids = np.arange(n, dtype=np.int64)

    def run():
        have[:] = 0
        for b in range(0, n, batch):
            m = min(batch, n - b)
            h["chunk"][:m] = chunk_ids[b:b + m]
            status, new, _, _ = _fast.scatter(u8, pay, sizes, m, 1, 0, n, V, V, have, ncontrib, res_exp, out,
                                              False, acks, meta, int(prec), lanes.result_bytes)
            if status != _fast.OK or new != m:
                raise RuntimeError(f"scatter refused a well-formed batch (status {status}, {new} of {m})")
    return run, V


def run(values: int = 16 << 20, precisions=(32, 16, 8), dtype: str = "float32", world: int = 4,
        elements: int = 2233, ring: int = 2048, batch: int = 64, repeats: int = 5) -> list[dict]:
    """One row per kernel and precision (the finiteness check once: it does not depend on it)."""
    if not _fast.warm_up():
        raise RuntimeError("the client's numba kernels are unavailable (numba missing, a big-endian host, "
                           "or AGGD_CLIENT_NUMBA=0)")
    x = np.random.default_rng(1).standard_normal(values).astype(dtype)
    common = {"bench": "kernels", "dtype": dtype, "values": values, "world": world, "elements_per_packet": elements,
              "repeats": repeats}

    def row(kernel, bits, seconds, per_packet, **extra):
        return common | {"kernel": kernel, "precision": bits, "values_per_packet": per_packet, "seconds": seconds,
                         "ns_per_value": seconds / values * 1e9} | extra

    rows = [row("all_finite", None, _best(lambda: _fast.all_finite(x), repeats), None)]
    for bits in precisions:
        fill, per_packet = _fill_run(x, bits, world, elements, ring)
        rows.append(row("fill", bits, _best(fill, repeats), per_packet, ring=ring))
        scatter, per_packet = _scatter_run(x, bits, world, elements, batch)
        rows.append(row("scatter", bits, _best(scatter, repeats), per_packet, batch=batch))
    return rows


def plot(rows: list[dict], path: str) -> None:
    """ns a value per kernel, a bar per precision."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["kernel"] + ("" if r["precision"] is None else f" {r['precision']}-bit") for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(labels, [r["ns_per_value"] for r in rows], color="#1f77b4")
    ax.set_ylabel("ns a value (best of runs, one core)")
    ax.set_title(f"aggd_client kernels, {rows[0]['values']:,} {rows[0]['dtype']} values")
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
