"""Chunk scales the members of a job share, for error feedback (``aggd_client.feedback``).

Why. The aggregator aligns a chunk's contributions to their smallest exponent with an arithmetic
right shift, a floor, and it keeps a running sum: a coarser contribution that arrives after two
finer ones floors their partial sum at once, which drops less than the two floors a member can see
(its own contribution's). A member's residual assumes its own contribution was floored alone, so
such a chunk delivers a little more than the members' gradients (up to a step of the result a
call), and no member's residual holds it, so no error reset takes it back. Contributions sent at
one exponent are added as they are: nothing is floored, and every residual is exact.

So with error feedback the members send each chunk at a scale they share (as IntSGD does, from
what they all saw of the previous call). For one key (one tensor of one layout):

* a key's first call sends each chunk at its own exponent (``quant.chunk_exponents``);
* each later call sends each chunk at ``min(own, shared)``: the shared exponent, unless this
  member's values outgrew it, then its own (coarser: the result's exponent follows it);
* after a call (``after_call``), a chunk's *shared* exponent is its result's (the smallest the
  members sent, to which every member's values fit) where that is the one they shared; where it
  is not (the key's first call, or a member's values outgrew the shared one) it is one step
  coarser than the result's: a bit of room, so that the values' next fluctuations fit too;
* so the shared exponent only grows coarser between error resets. At a reset the members also
  allreduce, per chunk, ``ROOM_FLAGS`` flags ``own - shared <= j`` (``j = 1 .. ROOM_FLAGS``,
  ``own`` from the key's newest call): the counts tell every member alike the smallest room any
  member had, and the shared exponent moves that many steps finer less one (``finer``), leaving
  the member with the least room one bit of it.

A bit of room costs a member with the largest values half its steps; error feedback delivers what
the coarser rounding drops a call later.

Members that saw different results (an ``async`` job's running sums) share less, and send at their
own exponents where they differ: the job is then as without this, never wrong.

``ChunkScales`` is what an ``AggClient`` call leaves (its handle's ``scales``) and takes
(``allreduce_async(scales=...)``): per chunk of that client's layout, the shared and own exponents.
A ``ShardedClient`` call leaves a ``PartScales``: one ``ChunkScales`` per aggregator's part.
"""
from __future__ import annotations

import numpy as np

from .protocol.definition import ZERO_EXPONENT

__all__ = ["ChunkScales", "PartScales", "ROOM_FLAGS", "after_call", "room_flags", "finer"]

#: How many steps finer one error reset may move a shared exponent (plus one kept as room).
ROOM_FLAGS = 8


class ChunkScales:
    """Per chunk of one client's layout (``elements`` values a chunk): the exponent the members
    share (``shared``, ZERO_EXPONENT where none) and this member's own exponents of the call that
    left it (``own``), both int32."""

    __slots__ = ("elements", "shared", "own")

    def __init__(self, elements: int, shared: np.ndarray, own: np.ndarray):
        self.elements = int(elements)
        self.shared = np.asarray(shared, np.int32)
        self.own = np.asarray(own, np.int32)

    def cap_for(self, elements: int, n_chunks: int) -> np.ndarray | None:
        """The exponents to send ``n_chunks`` chunks of ``elements`` values at most at, or None when
        this was left by another layout."""
        if elements != self.elements or n_chunks != self.shared.size:
            return None
        return self.shared

    def with_shared(self, shared: np.ndarray) -> "ChunkScales":
        return ChunkScales(self.elements, shared, self.own)


class PartScales:
    """A ``ShardedClient`` call's scales: ``parts`` maps each part's ``(lo, hi)`` value range to
    its ``ChunkScales``. ``shared`` and ``own`` run over the parts in order."""

    __slots__ = ("parts",)

    def __init__(self, parts: dict[tuple[int, int], ChunkScales]):
        self.parts = dict(sorted(parts.items()))

    def part(self, lo: int, hi: int) -> ChunkScales | None:
        return self.parts.get((lo, hi))

    @property
    def shared(self) -> np.ndarray:
        return _concat([p.shared for p in self.parts.values()])

    @property
    def own(self) -> np.ndarray:
        return _concat([p.own for p in self.parts.values()])

    def with_shared(self, shared: np.ndarray) -> "PartScales":
        out, at = {}, 0
        for key, p in self.parts.items():
            out[key] = p.with_shared(shared[at:at + p.shared.size])
            at += p.shared.size
        return PartScales(out)


def _concat(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(arrays) if arrays else np.zeros(0, np.int32)


def after_call(previous: "ChunkScales | PartScales | None", left: "ChunkScales | PartScales"):
    """The scales for a key's next call, from the ``scales`` its last call ``left`` (whose
    ``shared`` are that call's result exponents) and the ones that call was sent with
    (``previous``, None for a key's first call): see the module."""
    result = left.shared.astype(np.int64)
    if previous is None or previous.shared.size != result.size:
        kept = np.zeros(result.size, bool)
    else:
        kept = result == previous.shared
    shared = np.where((result == ZERO_EXPONENT) | kept, result, result - 1)
    return left.with_shared(shared.astype(np.int32))


def _room(scales: "ChunkScales | PartScales") -> np.ndarray:
    """Per chunk: how many steps finer than the shared exponent this member's own was; more than
    ``ROOM_FLAGS`` where that says nothing (no shared exponent, or the member's chunk was all zero)."""
    shared, own = scales.shared.astype(np.int64), scales.own.astype(np.int64)
    known = (shared != ZERO_EXPONENT) & (own != ZERO_EXPONENT)
    return np.where(known, own - shared, ROOM_FLAGS + 1)


def room_flags(scales: "ChunkScales | PartScales") -> np.ndarray:
    """This member's flags for an error reset: ``(ROOM_FLAGS, chunks)`` float32, row ``j - 1`` 1.0
    where its own exponent was at most ``j`` steps finer than the shared one (summed over the
    members, a row counts the members with that little room)."""
    room = _room(scales)
    j = np.arange(1, ROOM_FLAGS + 1)[:, None]
    return (room[None, :] <= j).astype(np.float32)


def finer(scales, counts: np.ndarray):
    """The scales after a reset whose flags summed to ``counts`` (``room_flags``' shape): each
    shared exponent moved finer by the least room of any member less one (none with a member of
    one step or less; ``ROOM_FLAGS - 1`` at most), the same on every member."""
    counts = np.asarray(counts).reshape(ROOM_FLAGS, -1)
    shared = scales.shared.astype(np.int64)
    some = counts > 0.5
    least = np.where(some.any(axis=0), np.argmax(some, axis=0) + 1, ROOM_FLAGS)  # least room, capped
    move = np.where(shared != ZERO_EXPONENT, np.maximum(least - 1, 0), 0)
    return scales.with_shared((shared + move).astype(np.int32))
