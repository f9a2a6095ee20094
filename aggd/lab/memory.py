"""A process's resident memory from /proc/self/status, and resetting its peak (Linux >= 4.0:
writing 5 to /proc/self/clear_refs sets VmHWM back to the current RSS), so a benchmark can report
the peak of just the part it times. The kernel keeps no peak of anonymous memory alone; file pages
only grow while a process runs, so their growth taken off the peak gives it."""
from __future__ import annotations

from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(field: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{_STATUS} has no {field}")


def rss() -> int:
    """Resident set size now, bytes."""
    return _status_kib("VmRSS") * 1024


def peak_rss() -> int:
    """Largest resident set size since the process started or since ``reset_peak_rss``, bytes."""
    return _status_kib("VmHWM") * 1024


def mapped_file_rss() -> int:
    """Resident pages mapped from files (library code and data) and shared memory, bytes. They
    are shared with every process mapping the same files and, once touched, stay: a peak of
    anonymous memory is ``peak_rss() - baseline - (mapped_file_rss() - its baseline)``."""
    return (_status_kib("RssFile") + _status_kib("RssShmem")) * 1024


def reset_peak_rss() -> None:
    _CLEAR_REFS.write_text("5")
