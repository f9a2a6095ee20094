"""Members of a job as threads of one process, against aggregators on loopback: ``run_ranks`` runs
one function per member (results by rank, the first member's exception raised), ``DictStore`` is
the store they share (torch.distributed's ``Store`` calls the sharded client uses)."""
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


class DictStore:
    """``set``, ``get`` (waits for the key), ``check`` (are all these keys there) in memory."""

    def __init__(self, timeout: float = 30.0):
        self.data: dict = {}
        self.cond = threading.Condition()
        self.timeout = timeout

    def set(self, key, value):
        with self.cond:
            self.data[key] = value.encode() if isinstance(value, str) else bytes(value)
            self.cond.notify_all()

    def get(self, key):
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.data, timeout=self.timeout):
                raise TimeoutError(f"no key {key} in the store within {self.timeout} s")
            return self.data[key]

    def check(self, keys):
        with self.cond:
            return all(k in self.data for k in keys)
