"""The one launcher of the lab's child processes (test and benchmark workers, the strategy observer,
training workers): argvs started in lab namespaces, their pipes drained as lines come
(``childlines.PipeLines``), their JSON record lines parsed, waited for with a deadline, and killed
when left running.
"""
from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from aggd.lab.childlines import PipeLines, wait_all
from aggd.lab.namespaces import Lab


@dataclass
class WorkerRun:
    """What one process did: its return code (None: still running when ``wait`` returned), its JSON
    records and its stderr."""
    rank: int
    returncode: int | None
    records: list[dict] = field(default_factory=list)
    stderr: str = ""


class LabProcesses:
    """Processes in a lab, rank by rank in the order started::

        with LabProcesses(lab, "lab workers of job 1", on_record=show) as ps:
            for rank, w in enumerate(workers):
                ps.start(lab.worker_ns(w), argv(rank))
            runs = ps.wait(timeout=300)

    Every stdout line that starts with ``{`` is a JSON record, kept in its rank's ``records`` and
    handed to ``on_record(rank, record)`` as it comes (callbacks never run at once: they hold
    ``lock``). ``stderr_lines``: how many of the last stderr lines to keep (None: all). Leaving the
    ``with`` block kills what still runs."""

    def __init__(self, lab: Lab, what: str, *, on_record: Callable[[int, dict], None] | None = None,
                 env: dict[str, str] | None = None, stderr_lines: int | None = None) -> None:
        self.lab, self.what, self.env = lab, what, env
        self.on_record, self.stderr_lines = on_record, stderr_lines
        self.lock = threading.Lock()
        self.procs: list[subprocess.Popen] = []
        self.runs: list[WorkerRun] = []
        self._pipes: list[tuple[PipeLines, PipeLines]] = []

    def start(self, ns: str, argv: list[str]) -> subprocess.Popen:
        """Start ``argv`` in namespace ``ns`` as the next rank."""
        p = self.lab.run(ns, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=self.env)
        run = WorkerRun(len(self.runs), None)
        self.procs.append(p)
        self.runs.append(run)
        self._pipes.append((PipeLines(p.stdout, self._records_of(run), lock=self.lock, keep=0),
                            PipeLines(p.stderr, keep=self.stderr_lines)))
        return p

    def _records_of(self, run: WorkerRun) -> Callable[[str], None]:
        def on_line(line: str) -> None:
            if line.startswith("{"):
                rec = json.loads(line)
                run.records.append(rec)
                if self.on_record:
                    self.on_record(run.rank, rec)
        return on_line

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def first_record(self, rank: int, timeout: float = 120.0) -> dict:
        """The first record of ``rank`` (a child saying it is ready), waited for up to ``timeout`` s."""
        deadline = time.monotonic() + timeout
        out, err = self._pipes[rank]
        while not self.runs[rank].records:
            if self.procs[rank].poll() is not None:
                out.join(10)  # every line it wrote
                if self.runs[rank].records:
                    break
                raise RuntimeError(f"{self.what}: rank {rank} exited ({self.procs[rank].returncode}) "
                                   f"before reporting:\n{err.text(1)[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.what}: rank {rank} reported nothing within {timeout:.0f} s")
            time.sleep(0.02)
        return self.runs[rank].records[0]

    def wait(self, timeout: float, *, until: Callable[[], bool] | None = None,
             grace: float = 5.0) -> list[WorkerRun]:
        """Every rank's run once all have exited; TimeoutError naming ``what`` when one still runs
        after ``timeout`` s. With ``until``, asked (holding ``lock``) every 0.2 s, return as soon as
        it says so instead: those still running get ``grace`` s more each and are left running.
        The records and stderr are every line of a process that has exited (read for up to 10 s)
        and the lines so far of one still running."""
        what = f"{self.what} ({timeout:.0f} s)"
        deadline = time.monotonic() + timeout
        if until is None:
            wait_all(self.procs, deadline, what)
        else:
            while self.running():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{what} still running after the deadline")
                with self.lock:
                    if until():
                        break
                time.sleep(0.2)
            for p in self.procs:
                try:
                    p.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    pass
        for run, p, (out, err) in zip(self.runs, self.procs, self._pipes):
            drain = 10 if p.poll() is not None else 1
            out.join(drain)
            run.returncode, run.stderr = p.poll(), err.text(drain)
        return self.runs

    def kill(self, sig: int = signal.SIGKILL, timeout: float | None = None) -> None:
        """Send ``sig`` to every process still running and wait for it (up to ``timeout`` s)."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(sig)
                p.wait(timeout)

    def __enter__(self) -> "LabProcesses":
        return self

    def __exit__(self, *exc) -> None:
        self.kill()
