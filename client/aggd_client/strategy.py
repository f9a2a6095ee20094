"""The strategies a job may run under, as results name them, and how many rounds each admits.

Kept apart from the client because both the public API (admission, ``AllreduceHandle.strategy``)
and the result handling (which learns the strategy in force from each result) need them.
"""
from __future__ import annotations

from typing import NamedTuple

from . import quant
from .protocol.definition import RESULT_WINDOW, StrategyKind

#: Rounds a worker may have outstanding under ``async``: the aggregator's window.
ASYNC_OUTSTANDING = RESULT_WINDOW
#: Terms of one worker a ``wbsp`` round may hold (the quantisation headroom, ``quant.HEADROOM``): its
#: own steps and its late steps of the previous round carried in (``_Round.carried_in``) together.
WBSP_MAX_STEPS = quant.HEADROOM[StrategyKind.WBSP]


def _kind(value: int) -> StrategyKind:
    try:
        return StrategyKind(int(value))
    except ValueError:  # a kind this client does not know: assume the strictest
        return StrategyKind.SYNC


class StrategyInfo(NamedTuple):
    """A strategy as results carry it: ``kind``, ``param`` (quorum ``k``, ssp staleness ``s``) and
    the ``version`` of the job's strategy table that governed the round."""
    kind: StrategyKind = StrategyKind.SYNC
    param: int = 0
    version: int = 0

    @property
    def max_outstanding(self) -> int:
        """Rounds a worker may have outstanding (sent, result not complete) under this strategy."""
        if self.kind == StrategyKind.SSP:
            return self.param + 1
        if self.kind == StrategyKind.ASYNC:
            return ASYNC_OUTSTANDING
        return 1

    @classmethod
    def parse(cls, text: str) -> "StrategyInfo":
        """``sync``, ``quorum:K`` (``quorum:K:TIMEOUT`` too: the timeout is the data plane's),
        ``ssp:S``, ``async`` or ``wbsp`` -- the text form ``aggctl`` and ``JobInfo.strategy`` use."""
        parts = str(text).strip().lower().split(":")
        try:
            kind = StrategyKind[parts[0].upper()]
        except KeyError:
            names = ", ".join(k.name.lower() for k in StrategyKind)
            raise ValueError(f"unknown strategy {text!r}: use one of {names}") from None
        if kind not in (StrategyKind.QUORUM, StrategyKind.SSP):
            return cls(kind)
        if len(parts) < 2 or not parts[1].isdigit():
            raise ValueError(f"strategy {text!r}: {parts[0]} needs an integer parameter")
        return cls(kind, int(parts[1]))

    def __str__(self) -> str:
        name = self.kind.name.lower()
        return f"{name}:{self.param}" if self.kind in (StrategyKind.QUORUM, StrategyKind.SSP) else name
