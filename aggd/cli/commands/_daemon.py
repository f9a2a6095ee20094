"""What the aggctl commands that talk to the daemon share: the call, errors, tables, times."""
from __future__ import annotations

import json
import time

import click

from aggd.core import strategy as strat
from aggd.daemon.control import ControlClient, ControlError, DaemonUnreachable

#: Exit status when no daemon answers (like `systemctl status` for an inactive unit); a refused
#: request exits 1, a usage error 2 (click's own).
EXIT_UNREACHABLE = 3


class DaemonError(click.ClickException):
    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


def call(cmd: str, **args):
    """Send one request to the daemon whose socket the global --socket option names."""
    ctx = click.get_current_context()
    path = (ctx.find_root().obj or {}).get("socket")
    try:
        return ControlClient(path).call(cmd, **args)
    except DaemonUnreachable as exc:
        raise DaemonError(exc.message, EXIT_UNREACHABLE) from None
    except ControlError as exc:
        raise DaemonError(f"aggd refused: {exc.message}") from None


json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")


def checked_strategy(text: str) -> str:
    """``text`` if it is a strategy; else a usage error (exit 2) saying what is wrong with it, without
    asking the daemon."""
    try:
        strat.parse(text)
    except strat.StrategyError as exc:
        raise DaemonError(f"bad strategy {text!r}: {exc}", 2) from None
    return text


def echo_json(obj) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=True))


def table(headers: tuple[str, ...], rows: list[tuple]) -> None:
    """Aligned columns; None shows as '-'."""
    cells = [tuple(headers)] + [tuple("-" if v is None else str(v) for v in row) for row in rows]
    widths = [max(len(r[c]) for r in cells) for c in range(len(headers))]
    for row in cells:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())


def job_columns(fast_path: str = "KERNEL") -> tuple[str, ...]:
    """The columns a job's one-line summary starts with (``aggctl jobs list``, ``aggctl status``);
    ``fast_path`` heads the count of slots outside user space (the kernel's or a switch's)."""
    return ("JOB", "ID", "WORLD", "JOINED", "STRATEGY", "SLOTS", fast_path, "USERSPACE")


def job_cells(j: dict) -> tuple:
    """A job's values under :func:`job_columns`, from its entry in ``jobs.list`` or ``status``."""
    gone = j.get("gone") or []
    joined = f"{j['joined']} ({len(gone)} gone)" if gone else j["joined"]
    return (j["name"], j["id"], j["world"], joined, j["strategy"], j["slots"], j["kernel_slots"],
            j["userspace_slots"])


def ago(ts: float | None) -> str | None:
    if ts is None:
        return None
    s = max(0, int(time.time() - ts))
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{s // n}{unit} ago"
    return f"{s}s ago"


def duration(seconds: float) -> str:
    s = int(seconds)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return (f"{d}d " if d else "") + f"{h:02d}:{m:02d}:{s:02d}"


def slot_range(r: list[int] | None) -> str:
    if not r or r[0] == r[1]:
        return "none"
    return f"{r[0]}..{r[1] - 1}"
