"""The job registry: pure logic (placement, tokens, joins, strategy versions, persistence)."""
from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aggd.core.registry import Limits, Registry, RegistryError, answer_join
from aggd_client.membership import JobInfo, decode_join_ack, encode_join
from aggd_client.errors import ProtocolError
from aggd_client.protocol import MAX_ELEMENTS, MsgType, NackCode

LIMITS = Limits(kernel_budget=16, elements=256, port=47000, userspace_port=47002, result_port=47001)


def registry(**changes) -> Registry:
    counter = itertools.count()
    limits = Limits(**{**LIMITS.__dict__, **changes})
    return Registry(limits, token_factory=lambda: f"token{next(counter)}")


def test_create_assigns_id_token_group_and_kernel_slots():
    r = registry()
    a = r.create("resnet", 4, slots=8, now=5.0)
    b = r.create("bert", 2, slots=4)
    assert (a.id, a.token, a.group, a.port) == (1, "token0", ("239.77.0.1", 47001), 47000)
    assert (b.id, b.group[0]) == (2, "239.77.0.2")
    assert (a.kernel_base, a.kernel_slots, b.kernel_base, b.kernel_slots) == (0, 8, 8, 4)
    assert r.kernel_used() == 12 and r.largest_free_run() == 4
    assert a.placement()["kernel"] == {"slots": [0, 8], "array": [0, 8]}
    assert a.placement()["userspace"] == {"slots": [8, 8]}
    assert r.get("resnet") is a and r.get(1) is a and r.get("1") is a


def test_a_budget_for_half_a_job_splits_its_slots():
    r = registry(kernel_budget=4)
    job = r.create("half", 2, slots=8)
    assert (job.kernel_slots, job.userspace_slots) == (4, 4)
    assert job.placement()["userspace"]["slots"] == [4, 8]
    assert r.create("rest", 2, slots=8).kernel_slots == 0  # nothing left: all in user space


def test_zero_budget_puts_everything_in_user_space():
    r = registry(kernel_budget=0)
    assert r.create("a", 2, slots=8).kernel_slots == 0
    assert r.largest_free_run() == 0


def test_kernel_slots_cap_and_other_packet_sizes():
    r = registry()
    assert r.create("capped", 2, slots=8, kernel_slots=3).kernel_slots == 3
    small = r.create("small", 2, slots=8, elements=128)
    large = r.create("large", 2, slots=8, elements=512)
    assert small.kernel_slots == large.kernel_slots == 0
    assert small.port == 47000 and large.port == 47002  # the kernel cannot take larger packets


def test_delete_frees_kernel_slots_and_first_fit_reuses_the_gap():
    r = registry()
    r.create("a", 2, slots=4)
    r.create("b", 2, slots=8)
    r.create("c", 2, slots=4)
    assert r.kernel_used() == 16 and r.largest_free_run() == 0
    freed = r.delete("b")
    assert freed.kernel_slots == 8 and r.kernel_used() == 8 and r.largest_free_run() == 8
    d = r.create("d", 2, slots=6)
    assert (d.kernel_base, d.kernel_slots, d.id) == (4, 6, 2)  # the lowest free id comes back too
    e = r.create("e", 2, slots=6)
    assert e.kernel_slots == 2 and e.kernel_base == 10  # the largest run left, first fit


@pytest.mark.parametrize("kwargs, kind, text", [
    (dict(name="9lives", world=2), "bad_request", "start with a letter"),
    (dict(name="a", world=0), "bad_request", "world must be 1..64"),
    (dict(name="a", world=65), "bad_request", "world must be 1..64"),
    (dict(name="a", world=2, slots=0), "bad_request", "slots"),
    (dict(name="a", world=2, elements=MAX_ELEMENTS + 1), "bad_request", "elements"),
    (dict(name="a", world=2, strategy="fastest"), "bad_strategy", "unknown strategy"),
    (dict(name="a", world=2, strategy="quorum:3"), "bad_strategy", "quorum k=3"),
    # what a client can send that is not what it looks like
    (dict(name="a\n", world=2), "bad_request", "start with a letter"),
    (dict(name="a", world=True), "bad_request", "world must be 1..64, not True"),
    (dict(name="a", world=2, slots=True), "bad_request", "slots must be a positive integer"),
    (dict(name="a", world=2, elements=False), "bad_request", "elements"),
    (dict(name="a", world=2, kernel_slots=True), "bad_request", "kernel_slots"),
    (dict(name="a", world=2, strategy=3), "bad_strategy", "strategy must be text"),
    (dict(name="a", world=2, strategy=["sync"]), "bad_strategy", "strategy must be text"),
    (dict(name="a", world=2, token="short"), "bad_request", "token must be 32 to 128"),
    (dict(name="a", world=2, token="x" * 31 + "!"), "bad_request", "token must be 32 to 128"),
    (dict(name="a", world=2, token=12345), "bad_request", "token must be 32 to 128"),
    # sizes: bounded, and the message names the config key
    (dict(name="a", world=2, slots=10 ** 12), "too_large", r"the 16384 a job may have \(\[jobs\] max_slots\)"),
    (dict(name="a", world=2, slots=16384, elements=MAX_ELEMENTS), "too_large", r"\[jobs\] max_job_memory"),
])
def test_create_refusals(kwargs, kind, text):
    r = registry()
    with pytest.raises(RegistryError, match=text) as info:
        r.create(**kwargs)
    assert info.value.kind == kind and not r.jobs


def test_a_job_on_several_aggregators_takes_the_token_given():
    """A sharded job is created on each aggregator host with one token: members join every host
    with it."""
    import secrets
    token = secrets.token_hex(16)   # what a daemon makes
    first, second = registry(), registry()
    assert first.create("big", 2, token=token).token == token
    job = second.create("big", 2, token=token)
    assert job.token == token
    assert second.join("big", 1, token, ("10.0.0.9", 4000)).code == 0


def test_size_limits_come_from_the_limits():
    r = registry(max_slots=8, max_job_memory=8 * 32 * 256)
    assert r.create("a", 2, slots=8).slots == 8
    with pytest.raises(RegistryError, match="more than the 8 a job may have") as info:
        r.create("b", 2, slots=9)
    assert info.value.kind == "too_large"
    with pytest.raises(RegistryError, match="65792 bytes, more than the 65536") as info:
        r.create("b", 2, slots=8, elements=257)
    assert info.value.kind == "too_large" and len(r.jobs) == 1


def test_sum_bytes_is_the_models():
    from aggd.core.model import BANKS
    from aggd.core.registry import SUM_BYTES
    assert SUM_BYTES == BANKS * 8


def test_odd_job_references_are_unknown_jobs():
    r = registry()
    r.create("a", 2)
    for ref in ("a\n", "\u00b2", "9" * 5000, True, "0" * 30):
        with pytest.raises(RegistryError) as info:
            r.get(ref)
        assert info.value.kind == "unknown_job", ref
    with pytest.raises(RegistryError) as info:
        r.depart("a", True, "why")
    assert info.value.kind == "bad_rank"
    with pytest.raises(RegistryError) as info:
        r.set_strategy("a", "sync", True)
    assert info.value.kind == "bad_request"


def test_duplicate_name_and_unknown_job():
    r = registry()
    r.create("a", 2)
    with pytest.raises(RegistryError) as info:
        r.create("a", 2)
    assert info.value.kind == "exists"
    with pytest.raises(RegistryError) as info:
        r.get("nope")
    assert info.value.kind == "unknown_job"
    with pytest.raises(RegistryError):
        r.delete(9)


def test_join_checks_job_token_rank_in_that_order():
    r = registry()
    r.create("a", 2)
    assert r.join("nope", 0, "token0", ("10.0.0.1", 1)).code == NackCode.UNKNOWN_JOB
    bad = r.join("a", 0, "wrong", ("10.0.0.1", 1))
    assert bad.code == NackCode.BAD_TOKEN and "token" in bad.message and "refused" in bad.message
    assert r.join("a", 5, "wrong", ("10.0.0.1", 1)).code == NackCode.BAD_TOKEN  # token before rank
    assert r.join("a", 2, "token0", ("10.0.0.1", 1)).code == NackCode.NOT_MEMBER
    assert not r.get("a").members


def test_join_registers_and_rejoin_moves_the_address():
    r = registry()
    r.create("a", 2)
    first = r.join("a", 0, "token0", ("10.0.0.1", 4000), now=1.0)
    assert first.code == NackCode.NONE and first.changed
    again = r.join(1, 0, "token0", ("10.0.0.1", 4000), now=2.0)
    assert again.code == NackCode.NONE and not again.changed      # a retried JOIN changes nothing
    assert r.get("a").members[0].joined_at == 1.0
    tag = r.get("a").members[0].tag
    moved = r.join("a", 0, "token0", ("10.0.0.1", 4001), now=3.0)  # restarted worker, new port
    assert moved.changed and r.get("a").members[0].address == ("10.0.0.1", 4001)
    assert 0 < tag != r.get("a").members[0].tag != 0                # and a new tag
    clash = r.join("a", 1, "token0", ("10.0.0.1", 4001))           # one address, two ranks
    assert clash.code == NackCode.NOT_MEMBER and "rank 0" in clash.message


def test_answer_join_round_trip():
    r = registry(gso=False)
    job = r.create("a", 2, slots=8)
    answer, outcome = answer_join(r, encode_join("a", 1, job.token), ("10.0.0.2", 5000))
    hdr, body = decode_join_ack(answer)
    assert (hdr.type, hdr.code, hdr.job, hdr.rank) == (MsgType.JOIN_ACK, 0, job.id, 1)
    assert body["world"] == 2 and body["slots"] == 8 and body["gso"] is False and body["port"] == 47000
    assert outcome.changed
    # the member's tag, as 16 hex digits; kept in the saved state, never shown to operators
    assert JobInfo.from_json(body).tag == job.members[1].tag == int(body["tag"], 16) != 0
    saved = r.to_json()["jobs"][0]["members"][0]
    assert saved["tag"] == job.members[1].tag and "tag" not in str(job.describe()["members"])
    answer, _ = answer_join(r, encode_join(job.id, 0, "bad"), ("10.0.0.3", 5000))
    hdr, body = decode_join_ack(answer)
    assert hdr.code == NackCode.BAD_TOKEN and "refused" in body["error"]
    assert answer_join(r, b"\xa6\x6d\x01\x05" + bytes(10), ("10.0.0.3", 1)) == (None, None)   # no header


@pytest.mark.parametrize("narrow_room", [False, True])
def test_join_ack_asks_narrow_jobs_in_the_kernel_for_room(narrow_room):
    """``room`` (docs/protocol.md, "Precision"): only where the data plane cannot grow a frame, and
    only for a narrow job with kernel slots (an int32 result is no wider; user space reads any size)."""
    r = registry(narrow_room=narrow_room)
    jobs = [r.create("n8", 2, slots=4, precision=8), r.create("n16", 2, slots=4, precision=16),
            r.create("n32", 2, slots=4), r.create("u8", 2, slots=4, precision=8, kernel_slots=0)]
    room = {}
    for job in jobs:
        _, body = decode_join_ack(answer_join(r, encode_join(job.name, 0, job.token), ("10.0.0.2", 5000))[0])
        room[job.name] = JobInfo.from_json(body).room
        assert body.get("room", False) is room[job.name]
    assert room == {"n8": narrow_room, "n16": narrow_room, "n32": False, "u8": False}
    with pytest.raises(ProtocolError, match="room must be true or false"):
        JobInfo.from_json({**body, "room": "yes"})


JOIN_HEADER = encode_join("a", 1, "t")[:40]


@pytest.mark.parametrize("payload, reason", [
    (b"not json", "a UTF-8 JSON object"),
    (b"[" * 5000 + b"]" * 5000, "at most 512 bytes"),                  # RecursionError before
    (b"[" * 250 + b"]" * 250, "a JSON object"),
    (b'{"token": "\\ud800", "job": "a"}', "not valid Unicode"),        # UnicodeEncodeError before
    (b'{"token": "t", "job": "' + b"x" * 400 + b'"}', "1..64 characters"),
    (b'{"token": 7, "job": "a"}', "the token must be a string"),
    (b"\xff\xfe", "UTF-8"),
])
def test_malformed_joins_are_refused_in_one_line(payload, reason):
    r = registry()
    r.create("a", 2)
    answer, outcome = answer_join(r, JOIN_HEADER + payload, ("10.0.0.3", 1))
    hdr, body = decode_join_ack(answer)
    assert hdr.code == NackCode.BAD_REQUEST == outcome.code and reason in body["error"], body
    assert "\n" not in body["error"] and len(body["error"]) < 120 and not r.get("a").members


@settings(max_examples=300, deadline=None)
@given(payload=st.one_of(st.binary(max_size=600),
                         st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=80),
                                      lambda inner: st.lists(inner, max_size=4) |
                                      st.dictionaries(st.sampled_from(["token", "job", "x"]), inner, max_size=3),
                                      max_leaves=20).map(lambda v: json.dumps(v).encode())),
       job_by_name=st.booleans())
def test_random_join_payloads_never_raise(payload, job_by_name):
    """Any payload after a JOIN header: answered (accepted only with the job's token) or refused
    with a code; nothing raises."""
    r = registry()
    job = r.create("a", 2)
    head = encode_join("a" if job_by_name else job.id, 1, "t")[:40]
    answer, outcome = answer_join(r, head + payload, ("10.0.0.3", 1))
    hdr, body = decode_join_ack(answer)
    assert (hdr.code == NackCode.NONE) == (outcome.code == NackCode.NONE)
    assert hdr.code != NackCode.NONE or job.token.encode() in payload


def test_strategy_versions():
    r = registry()
    r.create("a", 4)
    job, table = r.set_strategy("a", "quorum:3:20ms", 10)
    assert job.strategy_version == 1 and str(job.strategy) == "quorum:3:20ms"
    assert [(e.version, e.from_round) for e in table.table_entries()] == [(0, 0), (1, 10)]
    with pytest.raises(RegistryError) as info:
        r.set_strategy("a", "sync", 10)  # must start after the last version's first round
    assert info.value.kind == "bad_round"
    with pytest.raises(RegistryError) as info:
        r.set_strategy("a", "quorum:5", 20)  # k beyond world
    assert info.value.kind == "bad_strategy"
    with pytest.raises(RegistryError) as info:
        r.set_strategy("a", "nonsense", 20)
    assert info.value.kind == "bad_strategy"
    assert job.strategy_version == 1  # refusals changed nothing
    for i, rnd in enumerate((20, 30, 40, 50)):
        r.set_strategy("a", "sync" if i % 2 else "ssp:1", rnd)
    assert [v for v, _, _ in job.strategies] == [2, 3, 4, 5]  # the ring keeps the last 4


def test_set_strategy_takes_a_parsed_strategy():
    """The daemon parses the operator's text once and hands the Strategy on; a refused one is
    named by its text form."""
    from aggd.core.strategy import parse

    r = registry()
    r.create("a", 4)
    job, _ = r.set_strategy("a", parse("quorum:3:20ms"), 10)
    assert job.strategy_version == 1 and str(job.strategy) == "quorum:3:20ms"
    with pytest.raises(RegistryError) as info:
        r.set_strategy("a", parse("quorum:5"), 20)  # k beyond world
    assert info.value.kind == "bad_strategy" and "bad strategy 'quorum:5:50ms': quorum k=5" in str(info.value)
    assert job.strategy_version == 1


def test_state_round_trip():
    r = registry()
    r.create("a", 2, slots=8, strategy="ssp:1")
    r.create("b", 3, slots=8, elements=512)
    r.join("a", 1, "token0", ("10.0.0.1", 4000), now=7.0)
    r.set_strategy("a", "sync", 12)
    saved = json.loads(json.dumps(r.to_json()))
    back = registry()
    back.load_json(saved)
    assert back.to_json() == r.to_json()
    assert back.get("a").members[1].address == ("10.0.0.1", 4000)
    assert back.get("b").kernel_base == 8 or back.get("b").kernel_slots == 0
    with pytest.raises(RegistryError):
        back.load_json({"version": 99, "jobs": []})


@pytest.mark.parametrize("text", ["sync", "async", "wbsp", "ssp:2", "quorum:3:20ms", "quorum:3:500us",
                                  "quorum:2:1500us", "quorum:1:2s"])
def test_strategy_text_round_trips_exactly(text):
    """The registry saves strategies as text: what it reads back is the same strategy."""
    from aggd.core.strategy import parse

    assert parse(str(parse(text))) == parse(text)
