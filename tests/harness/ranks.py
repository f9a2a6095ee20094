"""Run one function per member in threads (members of a job in one process, against aggregators on
loopback): results by rank, the first member's exception raised."""
from __future__ import annotations

import threading


def run_ranks(clients, work, timeout: float = 120.0) -> list:
    """``work(rank, clients[rank])`` in a thread per rank; their results in rank order."""
    out, errs = [None] * len(clients), [None] * len(clients)

    def one(r):
        try:
            out[r] = work(r, clients[r])
        except BaseException as e:  # noqa: BLE001 (raised below)
            errs[r] = e

    threads = [threading.Thread(target=one, args=(r,)) for r in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    for e in errs:
        if e is not None:
            raise e
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"a member's work did not end within {timeout} s")
    return out
