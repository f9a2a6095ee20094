"""A worker process for the lab: allreduces deterministic random tensors and checks each result.

Every worker regenerates all members' tensors from the shared seed, so it can check its own result
against the exact float64 sum and the documented bound without any side channel. One JSON object
per allreduce goes to stdout. Used by the netns tests, ``aggctl bench allreduce`` and the demo.

``--gloo INIT_METHOD`` reduces with torch.distributed's gloo backend instead (the benchmark's
baseline; ``--world`` members). ``--reuse`` reduces the same tensor every round (a benchmark times
the allreduce, not the generation of tensors). Every record carries ``extra_rss_bytes``: this
process's peak resident memory since the first round of its size began, over what it held then
(the tensor, the client, the libraries), less the library pages first touched meanwhile (shared
code, not memory for the tensor). ``--prime`` runs one small allreduce before any of that. The
last record of a size carries ``host_cpu_seconds``: the whole host's CPU time by kind from the
start of the first timed round to the end of the last (``aggd.lab.hostcpu``).
"""
from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import sys
import time

import numpy as np

from aggd_client import AggClient, ShardedClient, ShardMap, join
from aggd_client.client import fast_for_run
from aggd_client.shards import rejoiner
from aggd_client.protocol import values_per_packet
from aggd_client.quant import chunk_exponents, error_bound, output_rounding, precision_of

from aggd.lab import hostcpu
from aggd.core.addresses import host_port
from aggd.core.robust import effective_trim, parse_combine
from aggd.lab.memory import mapped_file_rss, peak_rss, reset_peak_rss, rss


#: Tensors are generated, and results checked, in blocks of about this many values (a whole number
#: of packets, so a chunk's exponent is a block's business): a worker checking a 256 MiB result
#: against 8 members' tensors holds a few blocks, not 8 tensors and their float64 sum.
BLOCK_VALUES = 1 << 20


def _block(elements: int) -> int:
    return max(1, BLOCK_VALUES // elements) * elements


#: What ``--pattern`` may name (``_generate``).
PATTERNS = ("random", "near", "integers")


def _generate(rng: np.random.Generator, n: int, rank: int, dtype: str, pattern: str, elements: int,
              start: int) -> np.ndarray:
    if pattern == "integers":
        # Small integers with the same largest magnitude in every chunk of every worker: every
        # contribution of a chunk gets the same exponent and quantises exactly, so any data plane
        # and any arrival order give bit-identical sums (the exact ones).
        x = rng.integers(-1000, 1001, n).astype(np.float64)
        x[(-start) % elements::elements] = 1024.0
        return x.astype(dtype)
    x = rng.standard_normal(n, dtype=np.float32 if dtype != "float64" else np.float64)
    # some variety in scale between workers and chunks, as gradients have: "random" a wide one (a
    # chunk's own exponents mostly two or more steps apart), "near" within a factor of two (mostly a
    # step apart at most); data-parallel gradients lie between (docs/benchmarks.md)
    x *= x.dtype.type(1 + rank if pattern == "random" else 1 + (rank % 8) / 8)
    return x.astype(dtype, copy=False)


def tensor_block(seed: int, rank: int, size: int, dtype: str, round_: int, pattern: str, elements: int,
                 block: int) -> np.ndarray:
    """Values ``block * B .. (block + 1) * B - 1`` of ``tensor(...)`` (B = ``_block(elements)``),
    generated on their own: every block has its own random stream."""
    b = _block(elements)
    start = block * b
    n = min(b, size - start)
    return _generate(np.random.default_rng([seed, rank, size, round_, block]), n, rank, dtype, pattern,
                     elements, start)


def tensor(seed: int, rank: int, size: int, dtype: str, round_: int, pattern: str = "random",
           elements: int = 256) -> np.ndarray:
    out = np.empty(size, dtype)
    b = _block(elements)
    for k, start in enumerate(range(0, size, b)):
        out[start:start + b] = tensor_block(seed, rank, size, dtype, round_, pattern, elements, k)
    return out


def _chunk_max_abs(x: np.ndarray, elements: int) -> np.ndarray:
    """Largest |value| of each ``elements``-value chunk of ``x`` (the last chunk may be short)."""
    full = x.shape[0] // elements * elements
    a = np.abs(x)
    m = a[:full].reshape(-1, elements).max(axis=1) if full else np.zeros(0, a.dtype)
    if full < x.shape[0]:
        m = np.append(m, a[full:].max())
    return m.astype(np.float64)


def _expected_blocks(seed, world, size, dtype, round_, pattern, elements, float_sum=False, terms=None,
                     precision=32, combine="sum", outlier=None):
    """Per block: (start, exact float64 sum, per-element bound, each member's values [world, n] as
    float64). The bound is aggd's fixed-point
    quantisation's for contributions quantised for ``terms`` (None: ``world``) at ``precision`` (bits),
    or with ``float_sum`` that of a float sum of ``world`` terms in ``dtype`` (Gloo). A robust job's
    ``combine`` (median, trimmed:t) makes the "sum" its statistic times ``world`` (the statistic is
    within one term's error of the exact values', so the sum's bound holds); ``outlier`` (rank,
    scale): that member's tensor is scaled."""
    prec = precision_of(precision)
    b = _block(elements)
    for k, start in enumerate(range(0, size, b)):
        n = min(b, size - start)
        exact = np.zeros(n)
        mag = np.zeros(n) if float_sum else None
        exps = None
        rows = []
        for r in range(world):
            x = tensor_block(seed, r, size, dtype, round_, pattern, elements, k)
            if outlier is not None and r == outlier[0]:
                x = (x * outlier[1]).astype(x.dtype)
            rows.append(x.astype(np.float64))
            exact += x
            if float_sum:
                mag += np.abs(x)
            else:
                e = chunk_exponents(_chunk_max_abs(x, elements), world, terms, prec)
                exps = e if exps is None else np.minimum(exps, e)
        if combine != "sum":
            exact = world * robust_statistic(np.array(rows), combine)
        if float_sum:
            bound = world * float(np.finfo(dtype).eps) * mag
        else:
            bound = np.repeat(error_bound(world, exps, precision=prec), elements)[:n]
        yield start, exact, bound, np.array(rows)


def check_partial(out: np.ndarray, n_contrib: np.ndarray, seed, world, size, dtype, round_, elements,
                  pattern="random", *, terms: int | None = None, precision: int = 32) -> dict:
    """``out`` as an ``async`` job answers it: each chunk the sum of some ``n_contrib[chunk]`` of the
    members' tensors of this round (a running sum), within the bound. The record's fields as
    ``check``'s; ``within_bound`` when every chunk matches some such subset."""
    max_err = max_bound = max_val = 0.0
    within = True
    for start, _, bound, rows in _expected_blocks(seed, world, size, dtype, round_, pattern, elements,
                                                  terms=terms, precision=precision):
        n = rows.shape[1]
        got = out[start:start + n].astype(np.float64)
        bound = bound + output_rounding(out[start:start + n])
        max_bound = max(max_bound, float(bound.max()))
        for c0 in range(0, n, elements):
            c1 = min(n, c0 + elements)
            count = int(n_contrib[(start + c0) // elements])
            best, fits = np.inf, False
            for members in itertools.combinations(range(world), count) if 0 < count <= world else ():
                err = np.abs(got[c0:c1] - rows[list(members), c0:c1].sum(axis=0))
                best = min(best, float(err.max()))
                fits = fits or bool(np.all(err <= bound[c0:c1]))
            within = within and fits
            max_err = max(max_err, best)
        max_val = max(max_val, float(np.abs(got).max()))
    return {"max_abs_error": max_err, "error_bound": max_bound, "within_bound": within, "max_abs_value": max_val}


def robust_statistic(rows: np.ndarray, combine: str) -> np.ndarray:
    """The coordinate-wise median or trimmed mean (``trimmed:t``) of float ``rows`` [n, values]:
    what a robust job's result is, over ``n``, without rounding."""
    n = rows.shape[0]
    t = effective_trim(parse_combine(combine), n)
    return np.sort(rows, axis=0)[t:n - t].mean(axis=0)


def expected(seed, world, size, dtype, round_, elements, pattern="random", terms=None):
    """(exact float64 sum, per-element bound) for this round (whole arrays: for tests and small sizes;
    ``check`` does the same block by block)."""
    parts = list(_expected_blocks(seed, world, size, dtype, round_, pattern, elements, terms=terms))
    return np.concatenate([p[1] for p in parts]), np.concatenate([p[2] for p in parts])


def check(out: np.ndarray, seed, world, size, dtype, round_, elements, pattern="random", *,
          float_sum: bool = False, terms: int | None = None, precision: int = 32, combine: str = "sum",
          outlier: tuple[int, float] | None = None) -> dict:
    """``out`` against the exact sum of every member's tensor, block by block: the record's
    ``max_abs_error``, ``error_bound`` (largest per-element bound), ``within_bound`` and
    ``max_abs_value``. ``float_sum``: the bound of a float sum (Gloo), not aggd's quantisation."""
    max_err = max_bound = max_val = 0.0
    within = True
    for start, exact, bound, _ in _expected_blocks(seed, world, size, dtype, round_, pattern, elements, float_sum,
                                                terms, precision, combine, outlier):
        got = out[start:start + exact.shape[0]]
        bound = bound + output_rounding(got)
        err = np.abs(got.astype(np.float64) - exact)
        max_err, max_bound = max(max_err, float(err.max())), max(max_bound, float(bound.max()))
        max_val = max(max_val, float(np.abs(exact).max()))
        within = within and bool(np.all(err <= bound))
    return {"max_abs_error": max_err, "error_bound": max_bound, "within_bound": within, "max_abs_value": max_val}


def host_ports(text: str) -> list[tuple[str, int]]:
    return [host_port(t) for t in text.split(",")]


def weights(text: str) -> tuple[float, ...]:
    try:
        return ShardMap(tuple(float(t) for t in text.split(","))).weights
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--server", type=host_ports, required=True,
                    help="HOST:PORT; several, comma-separated, shard the job over those aggregators")
    ap.add_argument("--group", type=host_ports,
                    help="results' group, one an aggregator (not with --token: the join answer says)")
    ap.add_argument("--weights", type=weights, help="the shard map's weights, one an aggregator (default even)")
    ap.add_argument("--rebalance-every", type=int, help="move partitions between the aggregators every N calls")
    ap.add_argument("--failover-after", type=float,
                    help="drop an aggregator that answers nothing for this many seconds (needs --store)")
    ap.add_argument("--probe-every", type=float, default=None,
                    help="(rank 0) seconds between JOINs to a failed aggregator; once it answers, every "
                         "member joins it again at the next agreed call (default: never, as --revive does)")
    ap.add_argument("--revive", metavar="CALL:AGGREGATOR",
                    help="(rank 0, with --token) bring a failed aggregator back from about that call")
    ap.add_argument("--set-weights", metavar="CALL:W,W,..",
                    help="rank 0 asks for these weights at this call (a 0 drains that aggregator: scale in)")
    ap.add_argument("--add", metavar="CALL:HOST:PORT",
                    help="(rank 0, with --token) add that aggregator (the job registered there) from about that call")
    ap.add_argument("--store", type=host_port,
                    help="torch TCPStore the members agree through (rank 0 serves it) for --rebalance-every")
    ap.add_argument("--bind", type=host_port, required=True,
                    help="member address; with several aggregators the port of the first, then the next ports")
    ap.add_argument("--job", required=True, help="job id; or its name with --token")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--tensor-rank", type=int,
                    help="contribute worker N's tensors (default: --rank): a rack job's worker is one of "
                         "the tree's span, each with its own tensors, and checks the sum of them all")
    ap.add_argument("--world", type=int, help="members (not with --token: the join answer says)")
    ap.add_argument("--token", help="join the daemon's job with this token (aggd_client.join)")
    ap.add_argument("--sizes", default="256", help="comma-separated element counts")
    ap.add_argument("--dtypes", default="float32")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--interleave", action="store_true",
                    help="each round reduces every size in turn (DDP's buckets), not size by size")
    ap.add_argument("--warmup", type=int, default=0, help="untimed, unchecked rounds first")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--elements", type=int, default=256, help="the aggregator's packet size (not with --token)")
    ap.add_argument("--slots", type=int, default=1024)
    ap.add_argument("--precision", type=int, choices=(32, 16, 8), default=32,
                    help="bits a contribution value (not with --token: the join answer says)")
    ap.add_argument("--window", type=int, default=None)
    ap.add_argument("--no-gso", action="store_true")
    ap.add_argument("--transport", choices=("udp", "xsk"), default="udp",
                    help="xsk: packets through an AF_XDP socket on the lab interface (aggd.lab.xsk_client)")
    ap.add_argument("--room", action="store_true",
                    help="narrow contributions carry room for their result (not with --token: the join answer says)")
    ap.add_argument("--check", choices=["all", "last", "partial", "none"], default="all",
                    help="which timed rounds to check against the exact sum (partial: every round, each "
                         "chunk against the sum of as many members as its n_contrib says, as async answers)")
    ap.add_argument("--give-up-after", type=float, default=10.0)
    ap.add_argument("--slow", metavar="RANK:SECONDS", type=lambda t: (int(t.split(":")[0]), float(t.split(":")[1])),
                    help="that member waits this long before each call (a slow member's compute)")
    ap.add_argument("--compute", type=float, default=0.0, metavar="SECONDS",
                    help="every member waits this long before each call (a step's compute)")
    ap.add_argument("--step-calls", type=int, default=1, metavar="N",
                    help="a step makes N calls (DDP's buckets): --compute and --slow wait before the first only")
    ap.add_argument("--pattern", choices=list(PATTERNS), default="random",
                    help="random: normal values, worker r's times 1 + r; near: times 1 + (r mod 8) / 8 (within "
                         "a factor of two); integers: exactly representable sums, identical whatever path "
                         "serves them")
    ap.add_argument("--digest", action="store_true", help="report a sha256 of each result")
    ap.add_argument("--gloo", metavar="INIT_METHOD",
                    help="reduce with torch.distributed gloo (e.g. tcp://10.77.0.10:29500), not aggd")
    ap.add_argument("--prime", action="store_true",
                    help="one small allreduce first, outside every measurement (see _prime)")
    ap.add_argument("--reuse", action="store_true",
                    help="reduce the same tensor every round, into the same result buffer")
    ap.add_argument("--combine", default="sum",
                    help="how the job combines rounds: sum, median, trimmed:t (not with --token: the join "
                         "answer says); zeno is checked only for equal results on every member (--digest)")
    ap.add_argument("--outlier", metavar="RANK:SCALE", type=lambda t: (int(t.split(":")[0]), float(t.split(":")[1])),
                    help="that member sends its tensor times SCALE (a bad member; every check knows)")
    args = ap.parse_args(argv)
    combine = args.combine  # the joined job's, with --token
    terms = None    # what contributions are quantised for: the world (a sync job), or the joined job's headroom
    precision = args.precision  # ... and in how many bits (the joined job's)

    if args.gloo is not None:
        if args.world is None:
            ap.error("--gloo needs --world")
        client = _GlooClient(args.gloo, args.rank, args.world)
    else:
        k = len(args.server)
        if args.weights is not None and len(args.weights) != k:
            ap.error(f"--weights: {len(args.weights)} weights for {k} aggregators")
        binds = [(args.bind[0], args.bind[1] + i if args.bind[1] else 0) for i in range(k)]
        # a run that will pass the kernels' threshold loads them before the memory baseline
        fast = fast_for_run(sum(int(s) for s in args.sizes.split(",")) * (args.warmup + args.rounds)
                            * len(args.dtypes.split(",")))
        clients = []
        rejoin = None
        if args.token is not None:
            job = int(args.job) if args.job.isdigit() else args.job
            options = {"window": args.window, "gso": not args.no_gso, "give_up_after": args.give_up_after,
                       "fast": fast}
            for server, bind in zip(args.server, binds):
                clients.append(join(server, job, args.rank, args.token, bind=bind, timeout=args.give_up_after,
                                    **options))
            rejoin = rejoiner(args.server, job, args.rank, args.token, args.bind[0], args.give_up_after, options)
            info = clients[0].job_info
            # a rack job's sums hold every worker under its upper aggregator: the span's
            args.world, args.elements = info.span or info.world, info.elements
            terms = args.world * info.headroom
            precision = info.precision
            combine = info.combine
            print(f"rank {args.rank} joined: {[c.job_info for c in clients]}", file=sys.stderr, flush=True)
        else:
            if args.world is None:
                ap.error("--world is needed without --token")
            groups = args.group or [None] * k
            if len(groups) != k:
                ap.error(f"--group: {len(groups)} groups for {k} aggregators")
            # --elements is the aggregator's packet size; an 8-bit packet holds two values a lane
            args.elements = values_per_packet(args.elements, precision_of(args.precision))
            make, how = AggClient, {}
            if args.transport == "xsk":
                from aggd.lab.namespaces import WORKER_IFNAME
                from aggd.lab.xsk_client import XskClient
                make, how = XskClient, {"ifname": WORKER_IFNAME}
            for server, group, bind in zip(args.server, groups, binds):
                clients.append(make(server, int(args.job), args.rank, args.world, group=group, bind=bind, **how,
                                     elements=args.elements, slots=args.slots, window=args.window,
                                     gso=not args.no_gso, give_up_after=args.give_up_after,
                                     precision=args.precision, room=args.room, fast=fast))
        store = None
        if args.rebalance_every is not None or args.failover_after is not None:
            if args.store is None:
                ap.error("--rebalance-every and --failover-after need --store")
            import datetime

            from torch.distributed import TCPStore
            store = TCPStore(args.store[0], args.store[1], args.world, args.rank == 0,
                             timeout=datetime.timedelta(seconds=args.give_up_after * 4))
        client = clients[0] if k == 1 else ShardedClient(clients, ShardMap(args.weights or (1,) * k), store=store,
                                                         rebalance_every=args.rebalance_every,
                                                         failover_after=args.failover_after, rejoin=rejoin,
                                                         probe_every=args.probe_every)
    requests = _leader_requests(args, client)   # parsed on every rank, made by rank 0
    my_tensors = args.rank if args.tensor_rank is None else args.tensor_rank
    if combine == "zeno" and args.check != "none":
        ap.error("a zeno job's rows are chosen by the aggregator: its results cannot be checked here "
                 "(--check none; --digest compares the members')")
    status = 0
    with client:
        if args.prime:
            _prime(client, args.dtypes.split(",")[0], args.elements)
        for dtype, steps in _blocks(args):
            out = x = buf = host0 = None
            for n, (size, i) in enumerate(steps):
                out = None  # the previous result is not held through this round
                if x is None or not args.reuse or x.shape != (size,):
                    x = tensor(args.seed, my_tensors, size, dtype, 0 if args.reuse else i, args.pattern,
                               args.elements)
                    if args.outlier is not None and args.outlier[0] == my_tensors:
                        x = (x * args.outlier[1]).astype(x.dtype)
                if args.gloo is not None:
                    client.load(x)  # gloo reduces in place
                elif args.reuse and (buf is None or buf.shape != x.shape or buf.dtype != x.dtype):
                    # the caller's result buffer, made before the memory baseline as gloo's is
                    buf = np.ones_like(x)
                if n == 0:
                    reset_peak_rss()
                    held, held_files = rss(), mapped_file_rss()
                if i == args.warmup and host0 is None:
                    host0 = hostcpu.snapshot()
                for request in requests.get(i, ()) if args.rank == 0 else ():
                    request()
                compute = args.compute + (args.slow[1] if args.slow is not None and args.slow[0] == args.rank else 0.0)
                if compute and n % args.step_calls == 0:    # a step's compute, before its first call
                    time.sleep(compute)
                t0, c0 = time.perf_counter(), time.process_time()
                if args.reuse and args.gloo is None:
                    # one result buffer for every round, as gloo reduces into one buffer
                    out = client.allreduce(x, out=buf)
                elif args.check == "partial":
                    handle = client.allreduce_async(x)
                    out = handle.wait()
                    n_contrib = np.asarray(handle.n_contrib)
                else:
                    out = client.allreduce(x)
                seconds = time.perf_counter() - t0
                cpu = time.process_time() - c0
                # library code paged in on a path's first use is shared, not this tensor's
                files = mapped_file_rss() - held_files
                extra = peak_rss() - held - files
                if i < args.warmup:
                    continue
                last = n == len(steps) - 1
                host = hostcpu.between(host0, hostcpu.snapshot()) if last else None
                rec = {"rank": args.rank, "size": size, "dtype": dtype, "round": i,
                       "seconds": seconds, "cpu_seconds": cpu, "shape_ok": out.shape == x.shape and out.dtype == x.dtype,
                       "extra_rss_bytes": extra, "extra_file_rss_bytes": files, "tensor_bytes": x.nbytes}
                if isinstance(client, ShardedClient):  # the map that cut this call
                    rec.update(shard_version=client.shard_map.version, shard_weights=list(client.shard_map.weights))
                if isinstance(client, (AggClient, ShardedClient)):
                    first = client if isinstance(client, AggClient) else client.clients[0]
                    rec.update(retransmits=client.stats["retransmits"],
                               packets_sent=client.stats["packets_sent"], trains=client.stats["trains"],
                               retransmit_timeout=first.retransmit_timeout, window=first.window)
                if host is not None:
                    rec["host_cpu_seconds"] = host  # the whole host over the timed rounds
                if args.digest:
                    rec["sha256"] = hashlib.sha256(out.tobytes()).hexdigest()
                if args.check == "partial":
                    rec.update(check_partial(out, n_contrib, args.seed, args.world, size, dtype, i, args.elements,
                                             args.pattern, terms=terms, precision=precision))
                elif args.check == "all" or (args.check == "last" and last):
                    ref = 0 if args.reuse else i
                    rec.update(check(out, args.seed, args.world, size, dtype, ref, args.elements,
                                     args.pattern, float_sum=args.gloo is not None, terms=terms,
                                     precision=precision, combine=combine, outlier=args.outlier))
                if "within_bound" in rec and (not rec["within_bound"] or not rec["shape_ok"]):
                    status = 1
                print(json.dumps(rec), flush=True)
    return status


def _leader_requests(args, client) -> dict:
    """Rank 0's requests to its sharded client (--revive, --add, --set-weights), by the call before
    which each is made: {call: [functions]}."""
    requests: dict = {}
    if args.revive is not None:
        at, agg = (int(t) for t in args.revive.split(":"))
        requests.setdefault(at, []).append(lambda: agg in client.dead and client.revive(agg))
    if args.add is not None:
        at, host, port = args.add.split(":")
        requests.setdefault(int(at), []).append(lambda: client.add_aggregator((host, int(port))))
    if args.set_weights is not None:
        at, _, ws = args.set_weights.partition(":")
        asked = weights(ws)
        requests.setdefault(int(at), []).append(lambda: client.set_weights(asked))
    return requests


def _blocks(args):
    """The allreduces to run, as (dtype, [(size, round), ...]) blocks: one block per dtype and size,
    its rounds in turn; with ``--interleave`` one block per dtype in which every round reduces each
    size in turn, as DDP reduces its buckets each step (chunks of the larger tensors sit out the
    smaller ones' rounds). Memory is measured from a block's first allreduce, host CPU over its
    timed ones."""
    sizes = [int(s) for s in args.sizes.split(",")]
    rounds = range(args.warmup + args.rounds)
    for dtype in args.dtypes.split(","):
        if args.interleave:
            yield dtype, [(size, i) for i in rounds for size in sizes]
        else:
            for size in sizes:
                yield dtype, [(size, i) for i in rounds]


def _prime(client, dtype: str, elements: int) -> None:
    """One small allreduce before any measured one, so that what every allreduce of any size
    needs once (library code paged in, the allocator's first growth) is not counted against the
    first size measured. A training job has done this long before its steady state; gloo's
    workers get the same."""
    x = np.ones(2 * elements, dtype)
    if isinstance(client, _GlooClient):
        client.load(x)
    client.allreduce(x)


class _GlooClient:
    """torch.distributed's allreduce (gloo backend, TCP) with AggClient's ``allreduce``. The result
    is reduced in place in a buffer of the client's (the input is copied in first, untimed)."""

    def __init__(self, init_method: str, rank: int, world: int):
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        self._torch, self._dist = torch, dist
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=600))
        self._buf = None

    def allreduce(self, x: np.ndarray) -> np.ndarray:
        """The sum of what ``load`` put in (``x`` is that input)."""
        self._dist.all_reduce(self._buf)
        return self._buf.numpy()

    def load(self, x: np.ndarray) -> None:
        """Copy the next input into the buffer (outside the timed call)."""
        if self._buf is None or self._buf.shape != x.shape or self._buf.dtype != x.dtype:
            self._buf = self._torch.from_numpy(np.empty_like(x))
        self._buf.numpy()[...] = x

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
