"""Fixtures shared across test folders."""
from __future__ import annotations

import secrets

import pytest


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
