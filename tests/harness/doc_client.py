"""A minimal aggd worker written from docs/protocol.md alone, as a conformance check.

Nothing here comes from aggd or aggd_client: the header layout, JOIN / JOIN_ACK, quantisation,
chunking, `count` / `skip`, rounds, multicast results and loss recovery follow the document (section
names are cited in comments).  If the document is exact, this client interoperates with a real aggd.

It is a worker of one job: it JOINs (retrying every 0.25 s), learns the job's packet size `V`,
precision, slots, group and member tag, then runs `allreduce` calls one round at a time (what a
`sync` job admits).  Precisions 32, 16 and 8 are supported (16/8 with stochastic rounding, and room
for the result when the JOIN_ACK says `room`); no error feedback, no strategies beyond reading the
result's strategy fields.  The protocol has no LEAVE message, so there is nothing to send at the end.

CLI (one process per rank): every process derives every member's tensor from --seed, so each can
check the aggregator's sum against the exact one within the documented bound (1.5 * n * u for int32,
2 * n * u for 8/16 bits, "Quantisation and the error bound"), printing one JSON line per call and
exiting 1 on a wrong result.

  python tests/harness/doc_client.py --server 10.77.0.1:47000 --job NAME --token T --rank 0 \
      --sizes 362,2048 --iters 20 --seed 1
"""
import argparse
import json
import math
import os
import select
import socket
import struct
import sys
import time

import numpy as np

MAGIC, VERSION = 0xA66D, 2
T_CONTRIB, T_RESULT, T_REREAD, T_NACK, T_JOIN, T_JOIN_ACK = 1, 2, 3, 4, 5, 6
F_RETRANSMIT, F_OVERFLOW, F_USERSPACE, F_CARRIED, F_RESENT, F_ORDERED = 1, 2, 4, 8, 16, 32
ZERO_EXPONENT = 0x3FFF            # "An all-zero chunk carries exponent 0x3FFF"
SKIP_CAP = 65535
# "Header (40 bytes, big-endian)": magic version type job rank round chunk count strategy_version
# exponent(signed) flags code contributors n_contrib step strategy param skip
HDR = struct.Struct(">HBBHHIIHHhBBQHHBBH")
assert HDR.size == 40
IP_MULTICAST_ALL = getattr(socket, "IP_MULTICAST_ALL", 49)   # Linux value


class ProtocolError(Exception):
    pass


def header(**f):
    v = dict(magic=MAGIC, version=VERSION, type=0, job=0, rank=0, round=0, chunk=0, count=0,
             strategy_version=0, exponent=0, flags=0, code=0, contributors=0, n_contrib=0, step=0,
             strategy=0, param=0, skip=0)
    v.update(f)
    return HDR.pack(*v.values())


FIELDS = ("magic version type job rank round chunk count strategy_version exponent flags code "
          "contributors n_contrib step strategy param skip").split()


def parse(pkt):
    if len(pkt) < HDR.size:
        return None
    h = dict(zip(FIELDS, HDR.unpack_from(pkt)))
    if h["magic"] != MAGIC or h["version"] != VERSION:
        return None
    return h


# "Precision": code -> (contribution dtype, result dtype, Q for T terms)
PRECISION = {
    32: (0, "<i4", "<i4", lambda t: (2**31 - 1) // t),
    16: (1, "<i2", "<i4", lambda t: min(32767, (2**31 - 1) // t)),
    8: (2, "<i1", "<i2", lambda t: min(127, 32767 // t)),
}


def exponent_for(m, q_max):
    """The largest integer e with m * 2**e <= Q ("Quantisation and the error bound")."""
    e = math.floor(math.log2(q_max / m))
    while math.ldexp(m, e) > q_max:
        e -= 1
    while math.ldexp(m, e + 1) <= q_max:
        e += 1
    return e


class DocClient:
    def __init__(self, server, job, rank, token, bind=("0.0.0.0", 0), join_timeout=10.0,
                 give_up=20.0, min_rto=0.05, max_rto=1.0, seed=None):
        self.server, self.rank, self.give_up = server, rank, give_up
        self.min_rto, self.max_rto = min_rto, max_rto
        self.rng = np.random.default_rng(seed)        # stochastic rounding of narrow jobs
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self.sock.bind(bind)
        self._join(job, token, join_timeout)
        self.last_sent = {}        # chunk index -> newest round it was sent in ("skip")
        self.ordered = False       # flag 0x20 once a round had more chunks than slots
        self.srtt = self.rttvar = None
        self.stats = {"retransmits": 0}

    # -- "Joining" ------------------------------------------------------------------------
    def _join(self, job, token, timeout):
        body = {"token": token}
        if isinstance(job, int):
            job_field = job
        else:
            job_field, body["job"] = 0xFFFF, job
        pkt = header(type=T_JOIN, job=job_field, rank=self.rank) + json.dumps(body).encode()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.sock.sendto(pkt, self.server)
            t_next = time.monotonic() + 0.25
            while (left := t_next - time.monotonic()) > 0:
                if not select.select([self.sock], [], [], left)[0]:
                    break
                data, _ = self.sock.recvfrom(65535)
                h = parse(data)
                if not h or h["type"] != T_JOIN_ACK or h["rank"] != self.rank:
                    continue
                ack = json.loads(data[HDR.size:].decode() or "{}")
                if h["code"] != 0:
                    raise ProtocolError(f"JOIN refused, code {h['code']}: {ack.get('error')}")
                return self._setup(ack)
        raise ProtocolError(f"no JOIN_ACK from {self.server} in {timeout} s")

    def _setup(self, ack):
        self.ack = ack
        self.job_id, self.world = ack["job"], ack["world"]
        self.V, self.slots = ack["elements"], ack["slots"]
        self.max_chunks = ack.get("max_chunks", 1 << 32)
        self.bits = ack.get("precision", 32)
        self.code, self.cdt, self.rdt, qfun = PRECISION[self.bits]
        self.room = bool(ack.get("room", False))
        self.span = ack.get("span", self.world)
        headroom = ack.get("headroom") or 4
        self.Q = qfun(self.span * headroom)     # T = span * headroom terms
        self.tag = int(ack.get("tag", "0"), 16)
        self.round = self.first_round = ack.get("round", 0)
        self.dest = (self.server[0], ack.get("port", self.server[1]))
        self.socks = [self.sock]
        group = ack.get("group")
        if group:                               # "Transport": a socket bound to group:port
            probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            probe.connect(self.dest)
            local_ip = probe.getsockname()[0]
            probe.close()
            m = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            m.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            m.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            m.setsockopt(socket.IPPROTO_IP, IP_MULTICAST_ALL, 0)
            m.bind((group[0], group[1]))
            mreq = socket.inet_aton(group[0]) + socket.inet_aton(local_ip)
            m.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, mreq)
            self.socks.append(m)

    # -- quantisation ("Quantisation and the error bound", "Precision") --------------------
    def quantise(self, x):
        m = float(np.max(np.abs(x))) if x.size else 0.0
        if m == 0.0:
            return ZERO_EXPONENT, np.zeros(x.size, self.cdt)
        e = exponent_for(m, self.Q)
        y = np.ldexp(x.astype(np.float64), e)
        if self.bits == 32:
            q = np.rint(y)
        else:                                   # stochastic: floor(x * 2**e + U)
            q = np.floor(y + self.rng.random(x.size))
        return e, q.astype(self.cdt)

    def payload(self, q):
        vals = np.zeros(self.V, self.cdt)
        vals[:q.size] = q
        raw = vals.tobytes()
        if self.room and self.bits != 32:       # room: V values of the result's width (4E bytes)
            raw += bytes(self.V * np.dtype(self.rdt).itemsize - len(raw))
        return raw

    # -- one allreduce: a round ------------------------------------------------------------
    def allreduce(self, x):
        x = np.ascontiguousarray(x, dtype=np.float32).ravel()
        n, V, r = x.size, self.V, self.round
        C = max(1, math.ceil(n / V))
        if C > self.max_chunks:
            raise ProtocolError(f"{C} chunks > max_chunks {self.max_chunks}")
        if C > self.slots:
            self.ordered = True                 # "What clients do": flag 0x20 from then on
        flags0 = F_ORDERED if self.ordered else 0
        pkts, counts = [], []
        for c in range(C):
            seg = x[c * V:(c + 1) * V]
            e, q = self.quantise(seg)
            # "Tensors of different sizes": skip = round - P - 1, P = -1 for a chunk's first round;
            # a (re)joined member starts at the JOIN_ACK's round with skip 0 ("Members declared gone")
            skip = min(SKIP_CAP, r - self.last_sent.get(c, self.first_round - 1) - 1)
            h = dict(type=T_CONTRIB, job=self.job_id, rank=self.rank, round=r, chunk=c,
                     count=seg.size, exponent=e, code=self.code,
                     contributors=self.tag, skip=skip)
            pkts.append((h, self.payload(q)))
            counts.append(seg.size)
        out = np.empty(n, np.float32)
        info = {"exp": [None] * C, "n_contrib": [0] * C, "flags": 0, "strategy": None}
        done = [False] * C
        sent_at, tries, rto = [None] * C, [0] * C, [0.0] * C
        window = min(64, self.slots)            # "Loss recovery": slow start from 64, <= slots
        nxt, inflight, remaining = 0, 0, C
        last_progress = time.monotonic()
        rtx = 0

        def send(c, retransmit):
            h, body = pkts[c]
            fl = flags0 | (F_RETRANSMIT if retransmit else 0)
            self.sock.sendto(header(**dict(h, flags=fl)) + body, self.dest)
            now = time.monotonic()
            sent_at[c] = now
            tries[c] += 1
            base = self.min_rto if self.srtt is None else self.srtt + 4 * self.rttvar
            rto[c] = now + min(self.max_rto, max(self.min_rto, base) * 2 ** (tries[c] - 1))

        while remaining:
            # chunk c + slots only once chunk c's result is in ("Aggregation semantics")
            while nxt < C and inflight < window and (nxt < self.slots or done[nxt - self.slots]):
                send(nxt, False)
                nxt += 1
                inflight += 1
            now = time.monotonic()
            waiting = [c for c in range(nxt) if not done[c]]
            t_wake = min([rto[c] for c in waiting], default=now + 0.05)
            ready = select.select(self.socks, [], [], max(0.0, t_wake - now))[0]
            for s in ready:
                while True:
                    try:
                        data = s.recv(65535, socket.MSG_DONTWAIT)
                    except BlockingIOError:
                        break
                    h = parse(data)
                    if not h or h["job"] != self.job_id:
                        continue
                    if h["type"] == T_NACK and h["rank"] == self.rank:
                        raise ProtocolError(f"NACK code {h['code']} for round {h['round']} chunk {h['chunk']}")
                    if h["type"] != T_RESULT or h["round"] != r or h["chunk"] >= C:
                        continue                # an older round's late copy, or another tensor
                    c = h["chunk"]
                    if done[c]:
                        continue
                    mine = (h["contributors"] >> self.rank) & 1 or h["flags"] & F_RESENT
                    if not mine:
                        continue                # not proof that the aggregator holds ours
                    if h["count"] != counts[c]:
                        raise ProtocolError(f"result count {h['count']} != {counts[c]} (chunk {c})")
                    if h["flags"] & F_OVERFLOW:
                        raise ProtocolError(f"overflow flag on round {r} chunk {c}")
                    vals = np.frombuffer(data, self.rdt, counts[c], HDR.size).astype(np.float64)
                    e = h["exponent"]
                    out[c * V:c * V + counts[c]] = np.ldexp(vals, -e) if e != ZERO_EXPONENT else 0.0
                    info["exp"][c], info["n_contrib"][c] = e, h["n_contrib"]
                    info["flags"] |= h["flags"]
                    info["strategy"] = (h["strategy"], h["param"], h["strategy_version"])
                    if tries[c] == 1:           # RFC 6298, samples from chunks sent once
                        sample = time.monotonic() - sent_at[c]
                        if self.srtt is None:
                            self.srtt, self.rttvar = sample, sample / 2
                        else:
                            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - sample)
                            self.srtt = 0.875 * self.srtt + 0.125 * sample
                    done[c] = True
                    inflight -= 1
                    remaining -= 1
                    last_progress = time.monotonic()
            now = time.monotonic()
            for c in range(nxt):
                if not done[c] and now >= rto[c]:
                    send(c, True)
                    rtx += 1
            if now - last_progress > self.give_up:
                raise ProtocolError(f"no answer from {self.dest} for job {self.job_id} round {r}")
        self.round += 1
        for c in range(C):
            self.last_sent[c] = r
        self.stats["retransmits"] += rtx
        info["retransmits"] = rtx
        return out, info

    def close(self):
        for s in self.socks:
            s.close()


# -- the CLI: every member's tensors from the seed, checked against the exact sum -------------
def member_tensor(seed, call, rank, size):
    rng = np.random.default_rng([seed, call, rank])
    scale = 10.0 ** rng.uniform(-4, 3)          # chunks of every member at its own scale
    return (rng.standard_normal(size) * scale).astype(np.float32)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", required=True, help="aggregator IP:PORT (the aggd port, 47000)")
    p.add_argument("--job", required=True, help="job name (or id, if numeric)")
    p.add_argument("--token", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--bind", default="0.0.0.0:0", help="local IP:PORT the member sends from")
    p.add_argument("--sizes", default="362,2048", help="tensor lengths, used in turn")
    p.add_argument("--iters", type=int, default=10, help="allreduce calls")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--zero-ranks", default="", help="ranks whose tensor is all zero on even calls")
    p.add_argument("--give-up", type=float, default=20.0)
    p.add_argument("--start-after", type=float, default=0.0,
                   help="seconds to wait after joining (a restarted group sends nothing before all have joined)")
    a = p.parse_args(argv)
    host, port = a.server.rsplit(":", 1)
    bhost, bport = a.bind.rsplit(":", 1)
    job = int(a.job) if a.job.isdigit() else a.job
    sizes = [int(s) for s in a.sizes.split(",")]
    zero_ranks = {int(z) for z in a.zero_ranks.split(",") if z}
    cl = DocClient((host, int(port)), job, a.rank, a.token, bind=(bhost, int(bport)),
                   give_up=a.give_up, seed=[a.seed, a.rank, os.getpid()])
    print(json.dumps({"joined": {k: cl.ack.get(k) for k in
                      ("job", "world", "group", "port", "elements", "slots", "precision", "room",
                       "headroom", "span", "round", "strategy", "gso", "combine")}}), file=sys.stderr)
    time.sleep(a.start_after)
    failed = False
    for i in range(a.iters):
        size = sizes[i % len(sizes)]

        def tensor(rk):
            if rk in zero_ranks and i % 2 == 0:
                return np.zeros(size, np.float32)
            return member_tensor(a.seed, i, rk, size)
        xs = [tensor(rk) for rk in range(cl.world)]
        exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
        t0 = time.monotonic()
        try:
            got, info = cl.allreduce(xs[a.rank])
        except ProtocolError as err:
            print(json.dumps({"call": i, "size": size, "ok": False, "error": str(err)}), flush=True)
            failed = True
            break
        # bound per chunk: n * 1.5 * u (int32) or 2 * n * u (narrow), u = 2**-e, plus float32 output
        k = 1.5 if cl.bits == 32 else 2.0
        bound = np.empty(size)
        for c, e in enumerate(info["exp"]):
            u = 0.0 if e == ZERO_EXPONENT else math.ldexp(1.0, -e)
            bound[c * cl.V:(c + 1) * cl.V] = k * info["n_contrib"][c] * u
        bound += np.abs(exact) * 2.0 ** -23 + 1e-45
        err = np.abs(got.astype(np.float64) - exact)
        ok = bool(np.all(err <= bound)) and all(n == cl.world for n in info["n_contrib"])
        failed |= not ok
        print(json.dumps({"call": i, "round": cl.round - 1, "size": size, "ok": ok,
                          "max_err": float(err.max()), "max_err_over_bound": float((err / bound).max()),
                          "retransmits": info["retransmits"], "flags": info["flags"],
                          "n_contrib": sorted(set(info["n_contrib"])), "strategy": info["strategy"],
                          "ms": round(1000 * (time.monotonic() - t0), 2)}), flush=True)
    print(json.dumps({"rank": a.rank, "retransmits": cl.stats["retransmits"], "failed": failed}),
          file=sys.stderr)
    cl.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
