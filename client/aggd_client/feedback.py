"""Error feedback with periodic error reset (CSER) over an aggd client.

Why. A narrow job (``precision=8`` or ``16``) rounds each gradient value to one of 255 (or 65,535)
steps of its chunk's scale: one step is about ``2 * max|x| / 127`` for int8. Stochastic rounding
keeps each rounding unbiased, but its variance stays in every step's gradient, and values far below
a chunk's largest round to 0 or to one step at random. Error feedback (EF-SGD: Seide et al. 2014,
"1-bit SGD"; Karimireddy et al. 2019, "Error Feedback Fixes SignSGD") keeps what a member's
rounding dropped, its *residual*, and adds it to what the member sends next: nothing is lost, it
is only delivered later, and SGD with error feedback converges as with exact gradients. The
residuals of different members differ, though, so the models' views of what was delivered drift
apart by the residuals; CSER (Xie et al. 2020, "CSER: Communication-efficient SGD with Error
Reset") bounds that by *resetting* the error every ``H`` steps: the residuals are themselves
allreduced and applied, after which every member has delivered every bit of its gradient mass and
all of them applied the same values.

The rule, per key (a tensor's identity: DDP's bucket index, the backend's tensor address):

* ``r`` starts at 0 (float64, the tensor's size);
* each call sends ``c = x + r`` through the client with ``residual=`` (``AggClient.allreduce``),
  which writes ``r' = c - (what the aggregator summed of c)``: the client's own rounding, corrected
  once the result comes for the aggregator's alignment of the contribution to the result's exponent
  (its floor, ``quant.align_and_sum``);
  the call returns the result of ``c`` and keeps ``r = r'``;
* every ``reset_every``-th call of the key (``H``; None or 0: never) then allreduces ``r`` through
  the same client with the same op, adds that result to what it returns, and sets ``r = 0``.
  The reset round's own rounding (about ``1/Q`` of the residuals) is dropped. With shared scales
  one more round follows it: the room flags, summed (``scales.room_flags``, ``scales.finer``).

So over calls 1..H of a key (residual 0 before call 1), the sum of what ``allreduce`` returned is
the sum (or mean) of the members' inputs within the reset round's quantisation error
(``quant.error_bound`` of its exponents), whatever the precision; without reset the residuals stay
bounded by about one quantisation step (plus what alignment drops) of the values sent.

Exactness needs every contribution floored on its own, or not at all. The aggregator
(``aggd.core.model``) keeps a running sum and, when a coarser contribution arrives after two or
more finer ones, floors their partial sum at once: that drops less than the members' own floors,
which no member can attribute to itself, and so the job would deliver a little more than its
gradients, by up to a step of the result a call per chunk. So the members share each chunk's
scale (``aggd_client.scales``, on by default: ``shared_scales``): every call after a key's first
sends each chunk at the exponent of that chunk's previous result (a step coarser where that moved)
unless a member's values outgrew it; and at each reset a round of flags (``ROOM_FLAGS`` per chunk)
lets the shared exponents grow finer again. Contributions of one exponent are added without a
shift: only a key's first call, and a call where some member's values outgrew the shared scale,
are aligned at all. (Under
``quorum``/``wbsp`` neither is the alignment of a contribution carried into a later round fed
back.)

Every member must make the same sequence of calls (the client's rule), and so the reset rounds
happen at the same call numbers of the same keys on every member: the calls of a key are counted
per key, and a key's counter is the same everywhere because every member calls with the same keys
in the same order. At most ``max_keys`` keys (256) are kept; using one more drops the least
recently used key's residual (its mass is lost, as without error feedback) and its counter: keep
keys stable (DDP's buckets are) and fewer than ``max_keys``.

``stats``: ``calls``, ``resets`` (reset rounds done), ``keys`` (kept now), ``evicted`` (keys dropped).
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from . import scales

__all__ = ["ErrorFeedback", "MAX_KEYS", "DEFAULT_RESET_EVERY"]

#: Keys (residual arrays) kept at most, least recently used dropped beyond.
MAX_KEYS = 256
#: ``H`` when the training integrations enable error feedback.
DEFAULT_RESET_EVERY = 16


class _Entry:
    __slots__ = ("residual", "calls", "scales")

    def __init__(self, size: int):
        self.residual = np.zeros(size, np.float64)
        self.calls = 0
        self.scales = None  # the chunks' shared exponents (aggd_client.scales), once a call left them


class ErrorFeedback:
    """Error feedback and error reset (see the module) over ``client`` (an ``AggClient`` or a
    ``ShardedClient``): ``allreduce(x, key=None, op="sum", out=None)``."""

    def __init__(self, client, reset_every: int | None = DEFAULT_RESET_EVERY, *, max_keys: int = MAX_KEYS,
                 shared_scales: bool = True):
        if reset_every is not None and int(reset_every) < 0:
            raise ValueError(f"reset_every must be a number of calls (0 or None: never), not {reset_every!r}")
        if int(max_keys) < 1:
            raise ValueError(f"max_keys must be at least 1, not {max_keys!r}")
        self.client = client
        self.reset_every = int(reset_every) if reset_every else None
        self.max_keys = int(max_keys)
        self.shared_scales = bool(shared_scales)
        self._entries: OrderedDict = OrderedDict()
        self.stats = {"calls": 0, "resets": 0, "keys": 0, "evicted": 0}
        #: The handles of the newest call: its round's, and its reset round's (None without).
        self.last_handle = None
        self.last_reset_handle = None

    def residual(self, key) -> np.ndarray | None:
        """The residual kept for ``key`` (float64, flat), or None."""
        e = self._entries.get(key)
        return None if e is None else e.residual

    def forget(self, key) -> None:
        """Drop ``key``'s residual and call count (its tensor is gone; the next use starts afresh)."""
        if self._entries.pop(key, None) is not None:
            self.stats["keys"] = len(self._entries)

    def calls(self, key) -> int:
        """Calls of ``key`` since its last reset (or since it was first used)."""
        e = self._entries.get(key)
        return 0 if e is None else e.calls

    def _entry(self, key, size: int) -> _Entry:
        e = self._entries.get(key)
        if e is not None and e.residual.size != size:
            raise ValueError(f"error feedback key {key!r} was used for {e.residual.size} values, now "
                             f"{size}: give tensors of different sizes different keys")
        if e is None:
            e = self._entries[key] = _Entry(size)
            while len(self._entries) > self.max_keys:
                self._entries.popitem(last=False)
                self.stats["evicted"] += 1
        self._entries.move_to_end(key)
        self.stats["keys"] = len(self._entries)
        return e

    def allreduce(self, x, key=None, op: str = "sum", *, out: np.ndarray | None = None,
                  timeout: float | None = None) -> np.ndarray:
        """The sum (or mean) of ``x`` over the members with error feedback: ``x`` plus this key's
        residual is reduced, the new residual kept; every ``reset_every``-th call of the key the
        residual is reduced too and added (see the module). ``key``: default ``(x.size,
        x.dtype.str)``. Returns an array of ``x``'s shape and dtype, or ``out`` filled. ``timeout``:
        for each round's ``wait``."""
        if op not in ("sum", "mean"):
            raise ValueError(f"op must be 'sum' or 'mean', got {op!r}")
        a = np.asarray(x)
        if key is None:
            key = (a.size, a.dtype.str)
        e = self._entry(key, a.size)
        corrected = a.reshape(-1).astype(np.float64) + e.residual
        new = np.empty(a.size, np.float64)
        self.last_reset_handle = None
        h = self.client.allreduce_async(corrected, op, residual=new, scales=e.scales)
        self.last_handle = h
        total = h.wait(timeout)
        # only once the round is through: a failed round leaves the residual as it was
        e.residual = new
        if self.shared_scales:
            e.scales = scales.after_call(e.scales, h.scales)
        e.calls += 1
        self.stats["calls"] += 1
        if self.reset_every and e.calls >= self.reset_every:
            hr = self.client.allreduce_async(e.residual, op)
            self.last_reset_handle = hr
            total = total + hr.wait(timeout)
            e.residual = np.zeros(a.size, np.float64)
            e.calls = 0
            self.stats["resets"] += 1
            if e.scales is not None:  # the shared exponents may grow finer now (aggd_client.scales)
                counts = self.client.allreduce_async(scales.room_flags(e.scales).reshape(-1), "sum").wait(timeout)
                e.scales = scales.finer(e.scales, counts)
        result = total.reshape(a.shape)
        if out is not None:
            with np.errstate(over="ignore"):
                out[...] = result
            return out
        with np.errstate(over="ignore"):
            return result.astype(a.dtype, copy=False)

    def reset(self) -> None:
        """Forget every residual and counter (every member must do so at the same call)."""
        self._entries.clear()
        self.stats["keys"] = 0

    def __repr__(self) -> str:
        return (f"<ErrorFeedback reset_every={self.reset_every} keys={len(self._entries)} "
                f"resets={self.stats['resets']}>")
