"""The P4 data plane (docs/p4.md): the backend (``backend.py``) and the pieces it is built from."""
from __future__ import annotations

from aggd.dataplane import DataPlaneError


class P4Error(DataPlaneError):
    """What the P4 data plane refuses or cannot do (bad values, a program that lacks an object, a
    switch that does not answer); every module of ``aggd.dataplane.p4`` raises it."""
