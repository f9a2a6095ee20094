"""The generated C and P4 headers must match the wire definition exactly."""
import numpy as np

from aggd_client import protocol as proto
from aggd_client.protocol import codegen


def test_generated_headers_have_not_drifted():
    stale = codegen.drifted()
    assert not stale, f"regenerate with `make gen`: {[str(p) for p in stale]}"


def test_c_header_lists_every_field_in_wire_order():
    text = codegen.C_HEADER.read_text()
    body = text[text.index("struct aggd_hdr {"):]
    positions = [body.index(f" {f.name};") for f in proto.HEADER]
    assert positions == sorted(positions)
    assert f"#define AGGD_HDR_SIZE {proto.HEADER_SIZE}" in text


def test_p4_header_bit_widths_add_up():
    text = codegen.P4_HEADER.read_text()
    widths = [int(line.split("bit<")[1].split(">")[0]) for line in
              text[text.index("header aggd_h {"):].splitlines()[1:len(proto.HEADER) + 1]]
    assert sum(widths) == proto.HEADER_SIZE * 8


def test_codec_round_trip_and_dtype_agree():
    hdr = proto.Header(job=7, rank=3, round=0xDEADBEEF, chunk=9, count=5, exponent=-12, flags=3,
                       contributors=(1 << 63) | 5, n_contrib=64, step=2)
    payload = np.arange(5, dtype=np.int32) - 2
    data = proto.encode(hdr, payload)
    back, vals = proto.decode(data)
    assert back == hdr and list(vals) == list(payload)
    rec = np.frombuffer(data[:proto.HEADER_SIZE], dtype=proto.HEADER_DTYPE)[0]
    assert int(rec["round"]) == 0xDEADBEEF and int(rec["exponent"]) == -12
    assert data[:2] == b"\xa6\x6d"  # big-endian header
    assert data[proto.HEADER_SIZE:proto.HEADER_SIZE + 4] == (-2).to_bytes(4, "little", signed=True)


def test_drift_is_detected(tmp_path, monkeypatch):
    fake = tmp_path / "aggd_proto.h"
    fake.write_text(codegen.render_c().replace("AGGD_MAGIC 0xa66d", "AGGD_MAGIC 0xa66e"))
    monkeypatch.setattr(codegen, "GENERATED", {fake: codegen.render_c})
    assert codegen.drifted() == [fake]
