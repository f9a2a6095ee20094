"""Errors the aggd client raises. All derive from ``AggdError``."""
from __future__ import annotations


def _addr(address) -> str:
    if address is None:
        return "?"
    host, port = address[0], address[1]
    return f"{host}:{port}"


class AggdError(Exception):
    """Base of every aggd client error."""


class ProtocolError(AggdError):
    """The aggregator answered with something this client cannot use (malformed, inconsistent
    with the request, or a refusal that is neither of the specific ones below)."""


class NoAnswerError(AggdError):
    """No progress at all for ``give_up_after`` seconds: the aggregator does not answer."""

    def __init__(self, server, job: int, waited: float, detail: str = ""):
        self.server = server
        self.job = job
        self.waited = waited
        msg = (f"no answer from aggregator {_addr(server)} for job {job} "
               f"in {waited:.2f} s")
        if detail:
            msg += f" ({detail})"
        super().__init__(msg)


class _Refused(AggdError):
    """A NACK from the aggregator."""

    code = 0

    def __init__(self, server, job: int, rank: int, member_address=None, detail: str = ""):
        self.server = server
        self.job = job
        self.rank = rank
        self.member_address = member_address
        super().__init__(self._message() + (f" ({detail})" if detail else ""))

    def _message(self) -> str:  # pragma: no cover - overridden
        raise NotImplementedError


class UnknownJobError(_Refused):
    """NACK code 1: the aggregator has no job with this id."""

    code = 1

    def _message(self) -> str:
        return f"aggregator {_addr(self.server)} does not know job {self.job} (NACK unknown job)"


class NotMemberError(_Refused):
    """NACK code 2: the rank is out of the job's range, or this worker's address is not the one
    registered for the rank (another worker joined as it, or the daemon quarantined it)."""

    code = 2

    def _message(self) -> str:
        return (f"aggregator {_addr(self.server)} refused rank {self.rank} of job {self.job} "
                f"from {_addr(self.member_address)}: not a member (is the rank below the job's "
                f"world size and this address the one registered for it? A member the daemon "
                f"quarantined is refused so too: `aggctl workers JOB` says why)")


class BadTokenError(_Refused):
    """NACK code 5 (an answer to a join): the token does not match the job's."""

    code = 5

    def _message(self) -> str:
        return (f"aggregator {_addr(self.server)} refused to let rank {self.rank} join job {self.job}: "
                f"the token was refused (check it with `aggctl jobs show {self.job}`)")


class AggregationOverflowError(AggdError):
    """A result was flagged OVERFLOW: the int32 sum overflowed and its values cannot be trusted
    (a sender quantised with the wrong world size, or a forged packet)."""

    def __init__(self, server, job: int, round_: int, chunk: int, n_contrib: int | None = None,
                 terms: int | None = None):
        self.server = server
        self.job = job
        self.round = round_
        self.chunk = chunk
        self.n_contrib = n_contrib   #: contributions the flagged sum holds (the result's n_contrib)
        self.terms = terms           #: contributions every round was quantised for (None: unknown)
        held = "" if n_contrib is None else f" (the sum holds {n_contrib} contributions" + (
            ")" if terms is None else f"; rounds are quantised for {terms})")
        super().__init__(f"aggregator {_addr(server)} flagged an int32 overflow in job {job}, "
                         f"round {round_}, chunk {chunk}{held}")
