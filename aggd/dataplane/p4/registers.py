"""Registers and counters: not reachable over BMv2's P4Runtime, so behind their own interface
(BMv2 Thrift in ``thrift.py``, BF Runtime in ``bfrt.py``, an in-memory file in the tests)."""
from __future__ import annotations

import abc


class RegisterAccess(abc.ABC):
    """Read and write the program's registers and (packet) counters by their P4 names."""

    @abc.abstractmethod
    def read(self, register: str, index: int) -> int:
        """One register cell, as an unsigned integer."""

    @abc.abstractmethod
    def write(self, register: str, index: int, value: int) -> None:
        """Set one register cell."""

    def write_range(self, register: str, start: int, end: int, value: int) -> None:
        """Set cells ``[start, end)``."""
        for i in range(start, end):
            self.write(register, i, value)

    @abc.abstractmethod
    def read_counter(self, counter: str, index: int) -> int:
        """Packets counted in one counter cell."""

    @abc.abstractmethod
    def write_counter(self, counter: str, index: int, packets: int) -> None:
        """Set one counter cell (0 to reset it)."""

    def close(self) -> None:
        pass
