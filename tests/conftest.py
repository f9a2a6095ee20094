"""Fixtures shared across test folders."""
from __future__ import annotations

import os
import secrets

import pytest
from hypothesis import settings

# The property tests draw new random cases on every run, which finds bugs but makes a run's verdict
# a draw: CI (.ci/run sets AGGD_HYPOTHESIS_PROFILE=ci) plays the same cases every time, a developer's
# `make test` new ones. Loaded here, before any test module builds its settings on the default.
settings.register_profile("ci", derandomize=True)
settings.register_profile("explore")
settings.load_profile(os.environ.get("AGGD_HYPOTHESIS_PROFILE", "explore"))


def unique_lab_name() -> str:
    """Short and unique, so parallel or crashed runs never collide (namespaces are global)."""
    return "t" + secrets.token_hex(4)


@pytest.fixture
def make_lab():
    """Factory ``make_lab(workers=2, **Lab kwargs)`` -> a running Lab, always torn down after the test."""
    from aggd.lab.namespaces import Lab

    labs = []

    def make(workers: int = 2, **kwargs) -> Lab:
        lab = Lab(unique_lab_name(), workers, **kwargs)
        labs.append(lab)  # before up(), so a half-built lab is removed too
        return lab.up()

    try:
        yield make
    finally:
        for lab in labs:
            lab.down()


@pytest.fixture
def lab_daemon(make_lab):
    """Factory ``lab_daemon(workers=4, loss=0.0, mode="native", **policy)`` -> (lab with ``loss`` percent
    of packets lost, a started labtrain.lab_daemon: an aggd with its XDP program in ``mode``
    for training runs); both torn down. Used by tests/train and tests/faults."""
    from aggd.training import labtrain

    daemons = []

    def make(workers: int = 4, loss: float = 0.0, mode: str = "native", **policy):
        lab = make_lab(workers, loss_percent=loss)
        d = labtrain.lab_daemon(lab, policy=policy, mode=mode)
        daemons.append(d)
        return lab, d.start()

    try:
        yield make
    finally:
        for d in daemons:
            d.close()
