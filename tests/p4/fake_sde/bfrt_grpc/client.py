"""The part of the SDE's ``bfrt_grpc.client`` that ``aggd.dataplane.p4.bfrt.BfrtRegisters`` uses,
over an in-memory register file in the process that imports it: registers and counters as BF
Runtime tables named "pipe.<P4 name>", keyed by ``$REGISTER_INDEX`` / ``$COUNTER_INDEX``, with one
register value per pipe ("<P4 name>.f1", four pipes) and ``$COUNTER_SPEC_PKTS``. It checks names
and keys as the SDE would refuse them; it is not the SDE."""
from __future__ import annotations

_CELLS: dict[tuple[str, int], int] = {}
PIPES = 4


class BfruntimeRpcException(Exception):
    pass


def KeyTuple(name, value):
    return (name, value)


def DataTuple(name, value):
    return (name, value)


def Target(device_id=0, pipe_id=0xFFFF):
    return ("target", device_id, pipe_id)


class _Data(dict):
    def to_dict(self):
        return dict(self)


class _Table:
    def __init__(self, name: str) -> None:
        if not name.startswith("pipe."):
            raise BfruntimeRpcException(f"no table {name}")
        self.name, self.p4name = name, name[len("pipe."):]
        self.key = "$COUNTER_INDEX" if self.p4name.endswith(("drops", "job_events")) else "$REGISTER_INDEX"

    def make_key(self, keys):
        (name, index), = keys
        if name != self.key:
            raise BfruntimeRpcException(f"{self.name}: no key field {name}")
        return index

    def make_data(self, data):
        return dict(data)

    def entry_get(self, target, keys, flags):
        value = _CELLS.get((self.name, keys[0]), 0)
        if self.key == "$COUNTER_INDEX":
            return iter([(_Data({"$COUNTER_SPEC_PKTS": value}), keys[0])])
        return iter([(_Data({f"{self.p4name}.f1": [value] + [0] * (PIPES - 1)}), keys[0])])

    def entry_mod(self, target, keys, data):
        field = "$COUNTER_SPEC_PKTS" if self.key == "$COUNTER_INDEX" else f"{self.p4name}.f1"
        if set(data[0]) != {field}:
            raise BfruntimeRpcException(f"{self.name}: no data field {set(data[0]) - {field}}")
        _CELLS[(self.name, keys[0])] = int(data[0][field])


class _Info:
    def table_get(self, name):
        return _Table(name)


class ClientInterface:
    def __init__(self, address, client_id=0, device_id=0):
        self.address = address

    def bind_pipeline_config(self, program):
        if program != "aggd":
            raise BfruntimeRpcException(f"no program {program}")

    def bfrt_info_get(self, program):
        return _Info()

    def tear_down_stream(self):
        pass
