"""Tofino registers and counters over BF Runtime (the SDE's ``bfrt_grpc`` client).

NOT TESTED ON A SWITCH: written without the Intel/Barefoot SDE, which is not installable here.
``tests/p4/test_p4_backend.py`` checks only the name mapping and value handling against a stand-in
of the ``bfrt_grpc.client`` module; docs/p4.md lists what must be checked on a Tofino.

Tables and multicast groups go over P4Runtime as for BMv2 (the SDE's P4Runtime server, or Stratum);
registers and counters are BF Runtime tables named after the P4 object with the pipeline's name
in front ("pipe.AggdIngress.aggd.bank_round"), keyed by ``$REGISTER_INDEX`` / ``$COUNTER_INDEX``,
with the value in the data field "<P4 name>.f1" (registers, one value per pipe) or
``$COUNTER_SPEC_PKTS`` (counters).
"""
from __future__ import annotations

from aggd.dataplane.p4 import P4Error
from aggd.dataplane.p4.registers import RegisterAccess


class BfrtRegisters(RegisterAccess):
    def __init__(self, address: str = "127.0.0.1:50052", *, program: str = "aggd", pipeline: str = "pipe",
                 device_id: int = 0, client_id: int = 0, client=None) -> None:
        if client is None:
            try:
                import bfrt_grpc.client as client  # from the SDE: $SDE_INSTALL/lib/python3*/site-packages/tofino
            except ImportError:
                raise P4Error("BF Runtime's client (bfrt_grpc, shipped with the Tofino SDE) is not importable: "
                              "add the SDE's Python path (docs/p4.md, 'Tofino')") from None
        self.gc = client
        self.pipeline = pipeline
        try:
            self.interface = client.ClientInterface(address, client_id=client_id, device_id=device_id)
            self.interface.bind_pipeline_config(program)
            self.info = self.interface.bfrt_info_get(program)
        except Exception as exc:  # the SDE raises its own (BfruntimeRpcException, grpc errors)
            raise P4Error(f"BF Runtime at {address} (program {program!r}): {exc}") from None
        self.target = client.Target(device_id=device_id, pipe_id=0xFFFF)
        self._tables: dict[str, object] = {}

    def _table(self, name: str):
        if name not in self._tables:
            try:
                self._tables[name] = self.info.table_get(f"{self.pipeline}.{name}")
            except Exception as exc:  # the SDE raises BfruntimeRpcException or KeyError
                raise P4Error(f"BF Runtime has no table {self.pipeline}.{name} ({exc})") from None
        return self._tables[name]

    def _get(self, name: str, key: str, index: int) -> dict:
        t = self._table(name)
        entries = t.entry_get(self.target, [t.make_key([self.gc.KeyTuple(key, index)])], {"from_hw": True})
        data, _ = next(iter(entries))
        return data.to_dict()

    def read(self, register: str, index: int) -> int:
        values = self._get(register, "$REGISTER_INDEX", index)[f"{register}.f1"]
        # one value per pipe: a slot lives in the pipe of its members' ports, the others hold 0
        return max(int(v) for v in values) if isinstance(values, list) else int(values)

    def write(self, register: str, index: int, value: int) -> None:
        t = self._table(register)
        t.entry_mod(self.target, [t.make_key([self.gc.KeyTuple("$REGISTER_INDEX", index)])],
                    [t.make_data([self.gc.DataTuple(f"{register}.f1", int(value))])])

    def read_counter(self, counter: str, index: int) -> int:
        return int(self._get(counter, "$COUNTER_INDEX", index)["$COUNTER_SPEC_PKTS"])

    def write_counter(self, counter: str, index: int, packets: int) -> None:
        t = self._table(counter)
        t.entry_mod(self.target, [t.make_key([self.gc.KeyTuple("$COUNTER_INDEX", index)])],
                    [t.make_data([self.gc.DataTuple("$COUNTER_SPEC_PKTS", int(packets))])])

    def close(self) -> None:
        tear = getattr(self.interface, "tear_down_stream", None)
        if tear is not None:
            tear()
