"""Shared fixtures of the worker library's tests."""
from __future__ import annotations

import pytest


@pytest.fixture
def userspace_agg():
    """Factory ``userspace_agg(elements)`` -> a started user-space aggregator on 127.0.0.1 (the
    daemon's path, ``aggd.dataplane.userspace.server``), closed after the test."""
    made = []

    def make(elements: int):
        from aggd.dataplane.userspace.server import UserspaceAggregator
        agg = UserspaceAggregator(bind=("127.0.0.1", 0), elements=elements)
        made.append(agg)
        return agg.start()

    try:
        yield make
    finally:
        for agg in made:
            agg.close()


@pytest.fixture(params=["numba", "numpy"])
def path(request, monkeypatch):
    """Run a test with the numba kernels (when installed), loaded by every client at once, and
    with the numpy reference path."""
    from aggd_client import _fast, client
    if request.param == "numpy":
        monkeypatch.setattr(_fast, "AVAILABLE", False)
    elif not _fast.AVAILABLE:
        pytest.skip("numba not installed")
    else:
        monkeypatch.setattr(client, "FAST_AFTER_VALUES", 0)
    return request.param

