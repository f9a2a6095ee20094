"""What comes back: results and NACKs in a received batch, matched to the rounds in flight by
``(round, chunk)``, dequantised into their outputs, and what they say besides.

``ResultHandler`` is a mixin of ``AggClient``. For each batch the transport received into the
staging array (``_process``): classify by header words, scatter results into their rounds (the
numba kernel of ``_fast``, else numpy), acknowledge the sends whose packets the aggregator proves it
holds, learn the strategy in force from the newest result, let a quorum straggler catch up, and
turn NACKs into errors. Each chunk's newest round (``_chunk_last``: its own rounds, and a quorum's
seen on the group) gives the ``skip`` a new round's packets carry (``_skips_for``).
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np

from . import _fast, quant
from .errors import (AggregationOverflowError, NotMemberError, ProtocolError, UnknownJobError)
from .protocol import HEADER_DTYPE, HEADER_SIZE
from .protocol.definition import (LANES, MAGIC, SKIP_MAX, VERSION, Flag, MsgType, NackCode, Precision,
                                  StrategyKind)
from .strategy import StrategyInfo, _kind

if TYPE_CHECKING:
    from .rounds import _Round

log = logging.getLogger("aggd_client")  # one logger for the whole client, whatever the module

# plain ints: numpy compares against enum members far more slowly
_RESULT, _NACK = int(MsgType.RESULT), int(MsgType.NACK)
_OVERFLOW, _REREAD = int(Flag.OVERFLOW), int(Flag.REREAD)
_QUORUM = int(StrategyKind.QUORUM)


#: Chunk indices whose newest round a client tracks from results it did not ask for (8 MiB).
MAX_TRACKED_CHUNKS = 1 << 20

class ResultHandler:
    """Results and NACKs for ``AggClient`` (see the module's docstring)."""

    def _init_results(self) -> None:
        """Scratch for the numba kernel and the header words messages are classified by."""
        self._words = self._stage_u8.view(np.uint32)
        self._acks = np.zeros(len(self._stage), np.int64)
        self._meta = np.zeros(3, np.int64)
        # Messages are classified by the first 8 header bytes (magic, version, type; job) compared
        # as native uint32 words of the staging buffer, whatever the host's byte order.
        proto = np.zeros(1, HEADER_DTYPE)
        proto["magic"], proto["version"], proto["job"] = MAGIC, VERSION, self._job
        proto["type"] = _RESULT
        self._w_result = proto.view(np.uint32)[0]
        proto["type"] = _NACK
        self._w_nack = proto.view(np.uint32)[0]
        self._job_mask = np.frombuffer(b"\xff\xff\x00\x00", np.uint32)[0]  # job, not rank
        self._w_job = proto.view(np.uint32)[1] & self._job_mask

    def _process(self, m: int) -> None:
        """Hand ``m`` received messages to the rounds in flight. The numba kernel takes one round
        at a time; anything else in the batch (NACKs, malformed results, results of other rounds:
        stragglers' answers, re-sends of finished rounds) goes through the numpy path, which
        repeats harmlessly what the kernel did."""
        new = acked = 0
        handled = False
        # Under quorum and wbsp a release seen on the group need not hold our packet (released
        # without us, or a later wbsp step): those rounds take the numpy path, which checks.
        checked = self._strategy.kind in (StrategyKind.QUORUM, StrategyKind.WBSP)
        if self._fast and self._rounds and not checked and all(r.fast for r in self._rounds):
            handled, matched, jobs = True, 0, 0
            for rnd in list(self._rounds):
                status, nd, na, jobs = _fast.scatter(
                    self._stage_u8, self._stage_pay, self._sizes, m, self._job, rnd.r32,
                    rnd.n_chunks, self._elements, rnd.last_count, rnd.have, rnd.n_contrib, rnd.res_exp, rnd.out,
                    rnd.mean, self._acks, self._meta, int(self._precision), self._lanes.result_bytes)
                if status != _fast.OK:
                    handled = False
                    break
                matched += na
                if na:
                    acked += self._ack(rnd, self._acks[:na])
                if nd:
                    new += nd
                    rnd.n_have += nd
                    meta = self._meta
                    self._learn(rnd, rnd.number, int(meta[0]), int(meta[1]), int(meta[2]))
            handled = handled and matched == jobs
        if not handled:
            n2, a2 = self._process_numpy(m)
            new += n2
            acked += a2
        self.stats["results"] += new
        self.stats["ignored"] += m - new
        if new or acked:
            self._last_progress = time.monotonic()

    def _process_numpy(self, m: int) -> tuple[int, int]:
        w = self._words[:m]
        ours = (self._sizes[:m] >= HEADER_SIZE) & ((w[:, 1] & self._job_mask) == self._w_job)
        nack = ours & (w[:, 0] == self._w_nack)
        if nack.any():
            self._nacks(self._stage["hdr"][:m][nack])
        idx = np.flatnonzero(ours & (w[:, 0] == self._w_result))
        if idx.size == 0:
            return 0, 0
        h = self._stage["hdr"][idx]
        rounds = h["round"].astype(np.int64)
        chunks = h["chunk"].astype(np.int64)
        kind = h["strategy"]
        # Only a quorum round may answer an earlier round's chunk: it was released without some
        # members, who catch up. An async round is released only once every member has
        # contributed, so a member that skipped one would hold that round open for good.
        later_ok = kind == _QUORUM
        new = acked = 0
        # A later round answers one of our chunks only when it was sent to us alone (flag REREAD):
        # the aggregator's reply to our late contribution, which it has carried. A later round
        # merely seen on the group proves nothing about our packet, which may still be on its way.
        later_ok = later_ok & ((h["flags"] & _REREAD) != 0)
        for rnd in list(self._rounds):
            sel = (rounds == rnd.r32) | (later_ok & (rounds > rnd.r32))
            sel &= chunks < rnd.n_chunks
            if sel.any():
                n, a = self._apply(rnd, idx[sel], h[sel], rounds[sel], chunks[sel])
                new += n
                acked += a
        caught_up = kind == _QUORUM
        if caught_up.any():
            # A straggler catches up. A result sent to us (REREAD) may have answered a call of
            # ours: the next round follows it. One merely seen on the group makes us join that
            # round, not a round beyond it: a member ahead of the quorum would open a round in a
            # slot that still expects the quorum's chunks of the current round (keys grow per
            # slot) and stall them.
            self._note_rounds(rounds[caught_up], chunks[caught_up])
            to_us = caught_up & ((h["flags"] & _REREAD) != 0)
            seen = caught_up & ~to_us
            if not self._uniform:
                # Rounds are a sequence of tensors: one of the quorum's later rounds holds another
                # tensor than our next call. We keep our order; our late rounds are carried and
                # answered at once, so we catch up by running through them.
                to_us[:] = seen[:] = False
            if to_us.any():
                self._next_round = max(self._next_round, int(rounds[to_us].max()) + 1)
            if seen.any():
                self._catch_up(rounds[seen], chunks[seen])
        return new, acked

    def _skips_for(self, rnd: "_Round") -> np.ndarray | None:
        """The ``skip`` of each chunk of a new round (None: all 0), and the chunks' newest round."""
        n = rnd.n_chunks
        last = self._track_chunks(n)
        skips = np.minimum(rnd.number - last[:n] - 1, SKIP_MAX)
        last[:n] = rnd.number
        return skips.astype(np.uint16) if skips.any() else None

    def _note_rounds(self, rounds: np.ndarray, chunks: np.ndarray) -> None:
        """Results of rounds we did not send (a quorum's, seen by a straggler) move their chunks'
        newest round on, so our next round of each says the right ``skip``."""
        tracked = chunks < MAX_TRACKED_CHUNKS
        chunks, rounds = chunks[tracked], rounds[tracked]
        if chunks.size:  # chunks we have not sent yet too: their newest round is this one
            np.maximum.at(self._track_chunks(int(chunks.max()) + 1), chunks, rounds)

    def _track_chunks(self, n: int) -> np.ndarray:
        """``_chunk_last`` covering chunks ``0 .. n-1`` at least (``_chunk_floor``, -1 unless the
        client joined a running job: no round yet)."""
        last = self._chunk_last
        if n > last.size:
            last = self._chunk_last = np.concatenate([last, np.full(n - last.size, self._chunk_floor, np.int64)])
        return last

    def _catch_up(self, rounds: np.ndarray | None = None, chunks: np.ndarray | None = None) -> None:
        """Quorum results seen on the group (``rounds``, ``chunks``; none: re-evaluate): join the
        newest round seen, or the round after it once every chunk of it (as many as our newest
        round has) has been released."""
        if not self._uniform:
            return
        seen = self._seen_quorum
        if rounds is not None:
            for r, c in zip(rounds.tolist(), chunks.tolist()):
                if r >= self._next_round - 1:
                    seen.setdefault(r, set()).add(c)
        if not seen:
            return
        target = max(seen)
        whole = [r for r, cs in seen.items() if self._round_chunks and len(cs) >= self._round_chunks]
        if whole:
            target = max(target, max(whole) + 1)
        self._next_round = max(self._next_round, target)
        for r in [r for r in seen if r < self._next_round - 1]:
            del seen[r]

    def _apply(self, rnd: "_Round", idx, h, rounds, chunks) -> tuple[int, int]:
        """Results (staging positions ``idx``, headers ``h``) for chunks of ``rnd``: its own round's
        or a later round's. Returns (new results, sends' chunks answered)."""
        own = rounds == rnd.r32
        if self._chunks_sent > self._slots or rnd.ordered:
            # A later round's result sent to us is the chunk's newest, answering a late packet of
            # ours. Where slots serve several chunk indices, or our calls have had several sizes and
            # we said ORDERED (under quorum), the aggregator keeps our own round's result until we
            # hold it (rule 3's held), so our round waits for its own
            # (docs/protocol.md, "Tensors of different sizes"). A later round's whose count (its
            # round's) is not ours there is another tensor's and answers nothing. With tensors of
            # several sizes one with our count may be another tensor's too, answering a late copy
            # of an older round's packet (that round held its result, and we had moved on): it
            # only stops the retransmission of a chunk whose result we hold.
            if self._uniform:
                keep = own | (h["count"].astype(np.int64) == self._counts(rnd, chunks))
            else:
                keep = own | (rnd.have[chunks] != 0)
            if not keep.all():
                idx, h, rounds, chunks, own = idx[keep], h[keep], rounds[keep], chunks[keep], own[keep]
                if idx.size == 0:
                    return 0, 0
        code = h["code"]
        if (code != int(self._precision)).any():
            j = int(np.argmax(code != int(self._precision)))
            self._fail_round(rnd, ProtocolError(
                f"aggregator {self._server[0]}:{self._server[1]} sent a result of "
                f"{_precision_name(int(code[j]))} for job {self._job}, round {rounds[j]}, chunk "
                f"{chunks[j]}, whose precision is {_precision_name(int(self._precision))} (is the job "
                f"created with another --precision than this client's?)"))
            return 0, 0
        # What stops a packet's retransmission is proof that the aggregator holds it: an answer
        # sent to us alone (flag REREAD: a re-send, or the reply to a late contribution it
        # carried), or our own round's result listing our rank, which proves our first step
        # only (a later wbsp step may have arrived after the release; its re-send will say).
        to_us = (h["flags"] & _REREAD) != 0
        # (under sync and ssp a round is released only once every member is in it; an async
        # running sum answers whichever step of ours arrived, maybe a later one while step 0 was lost)
        partial_release = (h["strategy"] == _QUORUM) | (h["strategy"] == int(StrategyKind.WBSP)) | \
            (h["strategy"] == int(StrategyKind.ASYNC))
        lists_us = own & (~partial_release | ((h["contributors"] >> np.uint64(self._rank)) & np.uint64(1) != 0))
        acked = 0
        if to_us.any() or lists_us.any():
            acked = self._ack(rnd, chunks[to_us | lists_us], first_only=chunks[lists_us & ~to_us])
        new = rnd.have[chunks] == 0
        if not new.any():
            return 0, acked
        idx, h, rounds, chunks, own = idx[new], h[new], rounds[new], chunks[new], own[new]
        if idx.size > 1:  # one result per chunk: the round's own, else the newest; chunks sorted
            order = np.lexsort((-np.where(own, 1 << 40, rounds), chunks))
            chunks = chunks[order]
            first = np.empty(chunks.size, bool)
            first[0] = True
            np.not_equal(chunks[1:], chunks[:-1], out=first[1:])
            sel = order[first]
            idx, h, rounds, chunks = idx[sel], h[sel], rounds[sel], chunks[first]
        flags = h["flags"]
        if (flags & _OVERFLOW).any():
            j = int(np.argmax((flags & _OVERFLOW) != 0))
            terms = None if self._headroom is None else self._span * self._headroom
            self._fail_round(rnd, AggregationOverflowError(self._server, self._job,
                                                           int(rounds[j]), int(chunks[j]),
                                                           int(h["n_contrib"][j]), terms))
            return 0, acked
        cnt = h["count"].astype(np.int64)
        expect = self._counts(rnd, chunks)
        # Else a later round's result answers our late contribution in its stead (ours may be
        # gone), as a quorum answers its stragglers, whatever its count: the quorum's newest
        # result of that chunk, maybe another tensor's (docs/protocol.md)
        cnt = np.where(rounds == rnd.r32, cnt, expect)
        rb = self._lanes.result_bytes
        bad = (cnt != expect) | (self._sizes[idx] < HEADER_SIZE + rb * cnt)
        if bad.any():
            j = int(np.argmax(bad))
            if self._sizes[idx][j] >= HEADER_SIZE + rb * cnt[j]:  # a whole packet: the members differ
                why = ("the members reduced tensors of different sizes in that round (every member "
                       "must make the same sequence of calls; under quorum a straggler that caught "
                       "up to a later round reduces a different tensor than the quorum did there)")
            else:
                why = f"is the job's packet size {self._elements} elements?"
            self._fail_round(rnd, ProtocolError(
                f"aggregator {self._server[0]}:{self._server[1]} sent a result for job {self._job}, "
                f"round {rounds[j]}, chunk {chunks[j]} with count {cnt[j]} in {self._sizes[idx][j]} "
                f"bytes; expected {expect[j]} values ({why})"))
            return 0, acked
        ncon = h["n_contrib"]
        divisor = None
        if rnd.mean:
            if (ncon == 0).any():
                self._fail_round(rnd, ProtocolError(
                    f"aggregator {self._server[0]}:{self._server[1]} sent a result without "
                    f"contributions (n_contrib 0) for job {self._job}, round {rnd.number}"))
                return 0, acked
            divisor = ncon.astype(np.float64)
        vals = quant.dequantise(self._stage["payload"][idx], h["exponent"], divisor=divisor)
        E = self._elements
        with np.errstate(over="ignore", invalid="ignore"):  # float16 may overflow to inf
            if chunks[-1] < rnd.n_full:
                rnd.out_full[chunks] = vals
            else:
                rnd.out_full[chunks[:-1]] = vals[:-1]
                rnd.out[rnd.n_full * E:] = vals[-1, :rnd.last_count]
        rnd.have[chunks] = 1
        rnd.n_contrib[chunks] = ncon
        mine = rounds == rnd.r32  # our own round's results: our contributions are aligned in them
        rnd.res_exp[chunks[mine]] = h["exponent"][mine]
        rnd.n_have += int(chunks.size)
        j = int(np.argmax(rounds))
        self._learn(rnd, int(rounds[j]), int(h["strategy"][j]), int(h["param"][j]),
                    int(h["strategy_version"][j]))
        return int(chunks.size), acked

    def _note_short_sums(self, rnd: "_Round") -> None:
        """Log once when the rounds of a strategy that waits for every member (sync, ssp) start to
        hold fewer than the job's members (the daemon declared some gone: the rounds go on without
        them, and a mean divides by fewer), and once when they are whole again: a short sum raises
        nothing, so without this a user sees only its effect on training."""
        fewest = int(rnd.n_contrib.min()) if rnd.n_contrib.size else self._span
        waits = rnd.info is not None and rnd.info.kind in (StrategyKind.SYNC, StrategyKind.SSP)
        short = fewest if waits and fewest < self._span else None
        if short == self._short_sums:
            return
        if short is not None:
            log.warning("job %d, rank %d: round %d summed %d of %d members' contributions (the daemon "
                        "declared the others gone; `aggctl workers` says why)%s", self._job, self._rank,
                        rnd.number, short, self._span, "; the mean divides by that many" if rnd.mean else "")
        else:
            log.info("job %d, rank %d: round %d summed every member again", self._job, self._rank, rnd.number)
        self._short_sums = short

    def _counts(self, rnd: "_Round", chunks: np.ndarray) -> np.ndarray:
        """The count a result of ``rnd`` carries for each of ``chunks`` (the last one's is shorter)."""
        return np.where(chunks == rnd.n_chunks - 1, rnd.last_count, self._elements)

    def _ack(self, rnd: "_Round", chunks: np.ndarray, first_only: np.ndarray | None = None) -> int:
        """``chunks`` are answered for every send of the round; those also in ``first_only`` only
        for its first step."""
        now = time.monotonic()
        n = 0
        for s in rnd.sends:
            if first_only is not None and first_only.size and s.step > 0:
                n += s.ack(np.setdiff1d(chunks, first_only), now)
            else:
                n += s.ack(chunks, now)
        return n

    def _learn(self, rnd: "_Round", number: int, kind: int, param: int, version: int) -> None:
        """A result of round ``number`` (governed by kind/param/version) answered chunks of
        ``rnd``; the newest result seen sets the strategy in force."""
        info = StrategyInfo(_kind(kind), param, version)
        if rnd.info is None or number >= rnd.answered:
            rnd.answered = max(rnd.answered, number)
            rnd.info = info
        if number >= self._strategy_round:
            if info != self._strategy:
                log.debug("strategy in force: %s (table version %d, round %d)", info, version,
                          number)
            self._strategy, self._strategy_round = info, number
        if rnd.complete:
            if not rnd.realigned:          # once a round
                self._note_short_sums(rnd)
            rnd.realign_residuals()
            now = time.monotonic()
            for s in rnd.sends:  # their remaining answers are waited for give_up_after from now
                s.last_ack = now
                if s.step > 0:
                    # A later wbsp step is acknowledged only by an answer sent to us; ask at once,
                    # while the round's bank still exists (it re-sends, or carries a step that
                    # came too late), rather than after a timeout, when the bank may be reused
                    # and the retransmission can only be dropped as stale.
                    s.hurry()

    def _nacks(self, h: np.ndarray) -> None:
        for rec in h:
            code = int(rec["code"])
            if code == NackCode.UNKNOWN_JOB:
                raise UnknownJobError(self._server, self._job, self._rank, self._address)
            if code == NackCode.NOT_MEMBER:
                raise NotMemberError(self._server, self._job, self._rank, self._address)
            r32, chunk = int(rec["round"]), int(rec["chunk"])
            rnd = next((r for r in self._rounds if r.r32 == r32), None)
            where = f"job {self._job}, round {r32}, chunk {chunk}"
            srv = f"aggregator {self._server[0]}:{self._server[1]}"
            if code == NackCode.BAD_CHUNK:
                if rnd is not None:
                    self._fail_round(rnd, ProtocolError(
                        f"{srv} refused {where}: chunk beyond the job's max_chunks (this tensor "
                        f"has {rnd.n_chunks} chunks of {self._elements} values)"))
                continue
            if code == NackCode.STALE:
                lockstep = self._strategy.kind in (StrategyKind.SYNC, StrategyKind.SSP,
                                                   StrategyKind.WBSP)
                if rnd is not None and lockstep and chunk < rnd.n_chunks and not rnd.have[chunk]:
                    self._fail_round(rnd, ProtocolError(
                        f"{srv} refused {where} as stale: the job is past this round (do all "
                        f"members call allreduce in lockstep?)"))
                continue  # a late answer to an old retransmission, or a straggler's
            raise ProtocolError(f"{srv} refused {where} with unknown NACK code {code}")


def _precision_name(code: int) -> str:
    """``int8`` for a Precision's code; ``code N`` for a code that names none."""
    try:
        return f"int{LANES[Precision(code)].bits} (code {code})"
    except ValueError:
        return f"code {code} (no precision)"
