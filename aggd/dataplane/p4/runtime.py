"""P4Runtime over gRPC: the controller's session (:class:`P4RuntimeClient`) and the updates it writes.
The one I/O edge of the backend for tables and multicast groups."""
from __future__ import annotations

import logging
import queue
import threading
from typing import Iterable

from aggd.dataplane.p4 import P4Error

log = logging.getLogger(__name__)


def _status_details(exc) -> str:
    """The per-update errors a P4Runtime server puts in the gRPC status details, if any."""
    try:
        from google.rpc import status_pb2

        from aggd.dataplane.p4.proto import p4runtime_pb2
        for key, value in exc.trailing_metadata() or ():
            if key == "grpc-status-details-bin":
                status = status_pb2.Status.FromString(value)
                errs = []
                for d in status.details:
                    e = p4runtime_pb2.Error()
                    if d.Unpack(e) and e.canonical_code:
                        errs.append(e.message)
                return "; ".join(errs) or status.message
    except Exception:  # noqa: BLE001 -- best effort: the plain message follows anyway
        pass
    return ""


class P4RuntimeClient:
    """The controller side of a P4Runtime session: arbitration, pipeline, Write, Read."""

    def __init__(self, address: str, *, device_id: int = 0, election_id: int = 1, timeout: float = 10.0) -> None:
        import grpc

        from aggd.dataplane.p4.proto import SERVICE, p4runtime_pb2 as p
        self.address, self.device_id, self.timeout = address, device_id, timeout
        self.election_id = p.Uint128(high=election_id >> 64, low=election_id & ((1 << 64) - 1))
        self.channel = grpc.insecure_channel(address)
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            self.channel.close()
            raise P4Error(f"no P4Runtime server at {address} (is simple_switch_grpc running?)") from None
        m = f"/{SERVICE}/"
        self._write = self.channel.unary_unary(m + "Write", request_serializer=p.WriteRequest.SerializeToString,
                                               response_deserializer=p.WriteResponse.FromString)
        self._read = self.channel.unary_stream(m + "Read", request_serializer=p.ReadRequest.SerializeToString,
                                               response_deserializer=p.ReadResponse.FromString)
        self._set_pipeline = self.channel.unary_unary(
            m + "SetForwardingPipelineConfig",
            request_serializer=p.SetForwardingPipelineConfigRequest.SerializeToString,
            response_deserializer=p.SetForwardingPipelineConfigResponse.FromString)
        stream = self.channel.stream_stream(m + "StreamChannel",
                                            request_serializer=p.StreamMessageRequest.SerializeToString,
                                            response_deserializer=p.StreamMessageResponse.FromString)
        self._requests: queue.Queue = queue.Queue()
        self._arbitration: queue.Queue = queue.Queue()
        self._responses = stream(iter(self._requests.get, None))
        self._reader = threading.Thread(target=self._read_stream, name="p4runtime-stream", daemon=True)
        self._reader.start()
        self._requests.put(p.StreamMessageRequest(arbitration=p.MasterArbitrationUpdate(
            device_id=device_id, election_id=self.election_id)))
        try:
            answer = self._arbitration.get(timeout=timeout)
        except queue.Empty:
            self.close()
            raise P4Error(f"P4Runtime server at {address} did not answer the arbitration") from None
        if isinstance(answer, Exception):
            self.close()
            raise P4Error(f"P4Runtime arbitration with {address} failed: {answer}")
        if answer.status.code != 0:
            self.close()
            raise P4Error(f"another controller is primary on device {device_id} at {address} "
                          f"({answer.status.message or answer.status.code})")

    def _read_stream(self) -> None:
        try:
            for msg in self._responses:
                if msg.HasField("arbitration"):
                    self._arbitration.put(msg.arbitration)
                elif msg.HasField("error"):
                    log.warning("P4Runtime stream error: %s", msg.error.message)
        except Exception as exc:  # noqa: BLE001 -- the stream ends with an RpcError on close
            self._arbitration.put(exc)

    def _call(self, what: str, fn, request):
        import grpc
        try:
            return fn(request, timeout=self.timeout)
        except grpc.RpcError as exc:
            detail = _status_details(exc)
            raise P4Error(f"P4Runtime {what} failed: {exc.code().name} {exc.details()}"
                          + (f" ({detail})" if detail and detail != exc.details() else "")) from None

    def set_pipeline(self, p4info, device_config: bytes) -> None:
        from aggd.dataplane.p4.proto import p4runtime_pb2 as p
        req = p.SetForwardingPipelineConfigRequest(
            device_id=self.device_id, election_id=self.election_id,
            action=p.SetForwardingPipelineConfigRequest.VERIFY_AND_COMMIT,
            config=p.ForwardingPipelineConfig(p4info=p4info, p4_device_config=device_config))
        self._call("SetForwardingPipelineConfig", self._set_pipeline, req)

    def write(self, updates: Iterable) -> None:
        from aggd.dataplane.p4.proto import p4runtime_pb2 as p
        updates = list(updates)
        if not updates:
            return
        req = p.WriteRequest(device_id=self.device_id, election_id=self.election_id, updates=updates)
        self._call("Write", self._write, req)

    def read(self, entities: Iterable) -> list:
        from aggd.dataplane.p4.proto import p4runtime_pb2 as p
        req = p.ReadRequest(device_id=self.device_id, entities=list(entities))
        return [e for resp in self._call("Read", lambda r, timeout: list(self._read(r, timeout=timeout)), req)
                for e in resp.entities]

    def close(self) -> None:
        self._requests.put(None)
        self.channel.close()


def update(kind: str, **entity):
    """p4.v1.Update of ``kind`` ("INSERT", "MODIFY", "DELETE") for one entity field."""
    from aggd.dataplane.p4.proto import p4runtime_pb2 as p
    return p.Update(type=getattr(p.Update, kind), entity=p.Entity(**entity))


def multicast_group(group: int, ports: Iterable[int]):
    from aggd.dataplane.p4.proto import p4runtime_pb2 as p
    return p.PacketReplicationEngineEntry(multicast_group_entry=p.MulticastGroupEntry(
        multicast_group_id=group, replicas=[p.Replica(egress_port=port, instance=0) for port in sorted(set(ports))]))
