"""Fixtures for the training tests: a lab (tests/conftest.py's make_lab) with an aggd daemon."""
from __future__ import annotations

import pytest


@pytest.fixture
def lab_daemon(make_lab):
    """Factory ``lab_daemon(workers=4, **policy)`` -> (lab, a started labtrain.lab_daemon); both torn down."""
    from aggd.training import labtrain

    daemons = []

    def make(workers: int = 4, **policy):
        lab = make_lab(workers)
        d = labtrain.lab_daemon(lab, policy=policy)
        daemons.append(d)
        return lab, d.start()

    try:
        yield make
    finally:
        for d in daemons:
            d.close()
