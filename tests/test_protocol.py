"""The wire contract: round trips, refusals, no pickle."""

from __future__ import annotations

import msgspec
import pytest

from registry import sessions
from wire.limits import NO_PROOF, PROOF_BYTES
from wire.protocol import (
    BannedBye,
    Bye,
    ByeReason,
    Endpoints,
    Heartbeat,
    LeaveReason,
    Load,
    LoadDigest,
    LoadEntry,
    MemberLeft,
    MemberRecord,
    MemberSpec,
    MemberState,
    MemberUpdated,
    Parallel,
    Register,
    Reply,
    ReplyStatus,
    Report,
    Role,
    Snapshot,
    Sync,
    control_decoder,
    event_decoder,
    make_encoder,
    parse_role,
    reply_decoder,
    topic_for,
)
from wire.validation import validate_spec

SPEC = MemberSpec(
    id="prefill-10.0.0.5-8100", incarnation=1_700_000_000_000_000_000, role=Role.PREFILL,
    model="llama-3-8b", protocol="vllm-nixl",
    endpoints=Endpoints(http="http://10.0.0.5:8100", kv_host="10.0.0.5", kv_port=5600),
    parallel=Parallel(tp_size=8), capacity=64, labels={"zone": "a", "rack": "r1"},
    started_at=1.5)
RECORD = MemberRecord(spec=SPEC, state=MemberState.READY, load=Load(1, 2, 0.5))

CONTROL = [
    Register(spec=SPEC, nonce=b"n" * 16, state=MemberState.READY, token="t"),
    Heartbeat("x", 1, 7, MemberState.DRAINING, Load(3, 4, 0.25, {"tok_s": 10.0})),
    Bye("x", 1, 8, ByeReason.CRASHED),
    BannedBye("x", 1, 9, ban_s=120.5),
    Sync(models=["a", "b"]),
    Report("router-1", 1, 9, "x", 1, "connect refused"),
]
REPLIES = [Reply(ReplyStatus.UNKNOWN, 5, 1.0, "register again", 7601, 7680),
           Reply(ReplyStatus.OK, 5, 1.0, session=b"s" * 32),
           Snapshot(5, 9, [RECORD], 1.0, 7601, 7680)]
EVENTS = [MemberUpdated(5, 10, RECORD), MemberLeft(5, 11, "x", 1, "m", LeaveReason.EXPIRED),
          LoadDigest(5, 11, "m", [LoadEntry("x", 1, Load(1, 0, 0.1), 0.3)], 1.0)]


@pytest.mark.parametrize("message", CONTROL, ids=lambda m: type(m).__name__)
def test_control_round_trip(message):
    assert control_decoder().decode(make_encoder().encode(message)) == message


@pytest.mark.parametrize("message", REPLIES, ids=lambda m: type(m).__name__)
def test_reply_round_trip(message):
    assert reply_decoder().decode(make_encoder().encode(message)) == message


@pytest.mark.parametrize("message", EVENTS, ids=lambda m: type(m).__name__)
def test_event_round_trip(message):
    assert event_decoder().decode(make_encoder().encode(message)) == message


def test_heartbeat_is_compact():
    beat = Heartbeat("decode-10.0.0.7-8200", 1_700_000_000_000_000_000, 123456,
                     MemberState.READY, Load(12, 3, 0.42))
    assert len(make_encoder().encode(beat)) < 64 + PROOF_BYTES + 2


def test_a_proof_is_the_last_bytes_of_its_message():
    """What `registry.sessions.seal` relies on: the proof's 16 bytes end the encoding."""
    for message in (Heartbeat("x", 1, 7, MemberState.READY, Load(1, 2, 0.5, {"a": 1.0})),
                    Bye("x", 1, 8), BannedBye("x", 1, 9, 60.0), Report("r", 1, 9, "x", 1)):
        payload = sessions.seal(b"k" * 32, make_encoder().encode(message))
        decoded = msgspec.msgpack.decode(payload, type=type(message))
        assert payload.endswith(decoded.proof) and decoded.proof != NO_PROOF
        assert sessions.verify(b"k" * 32, payload, decoded.proof)
        assert not sessions.verify(b"j" * 32, payload, decoded.proof)


def test_an_old_agents_bye_and_reply_still_decode():
    """The ban travels in a message of its own, so an old agent's Bye (five fields, the
    proof last) decodes as before, and an old agent reads a Reply that carries banned_s."""
    old_bye = msgspec.msgpack.encode(["Bye", "x", 1, 8, 1, NO_PROOF])
    assert control_decoder().decode(old_bye) == Bye("x", 1, 8, ByeReason.SHUTDOWN)
    assert make_encoder().encode(Bye("x", 1, 8)) == old_bye


@pytest.mark.parametrize("payload", [
    b"",
    b"\xc1",                                      # never-used msgpack byte
    msgspec.msgpack.encode({"type": "Heartbeat"}),
    msgspec.msgpack.encode(["Nope", 1]),
    msgspec.msgpack.encode(["Heartbeat", "x", -1, 0, 2, [0, 0, 0.0]]),   # negative incarnation
    msgspec.msgpack.encode(["Heartbeat", "x", 1, 0, 9, [0, 0, 0.0]]),    # bad state
    msgspec.msgpack.encode(["Heartbeat", "x", 1, 0, 2, [0, 0, 1.5]]),    # kv_usage > 1
    msgspec.msgpack.encode(["Heartbeat", "x" * 500, 1, 0, 2, [0, 0, 0]]),  # id too long
    msgspec.msgpack.encode(["Heartbeat", "x", 1, 2**63, 2, [0, 0, 0.0]]),  # seq too big
    msgspec.msgpack.encode(["Bye", "x", 1]),                              # no seq
    msgspec.msgpack.encode(["Bye", "x", 1, 1, 1, b"short"]),              # proof length
    msgspec.msgpack.encode(["BannedBye", "x", 1, 1, -5.0, NO_PROOF]),      # negative ban
    msgspec.msgpack.encode(["BannedBye", "x", 1, 1, float("inf"), NO_PROOF]),  # endless ban
    msgspec.msgpack.encode(["BannedBye", "x", 1, 1, NO_PROOF]),            # no ban_s
    msgspec.msgpack.encode(["Register", msgspec.to_builtins(SPEC), b"short"]),  # nonce
])
def test_malformed_control_messages_are_refused(payload):
    with pytest.raises(msgspec.MsgspecError):
        control_decoder().decode(payload)


def test_too_many_labels_are_refused():
    raw = msgspec.to_builtins(Register(spec=SPEC, nonce=b"n" * 16))
    raw[1]["labels"] = {f"k{i}": "v" for i in range(100)}
    with pytest.raises(msgspec.ValidationError, match="labels"):
        control_decoder().decode(msgspec.msgpack.encode(raw))


NON_FINITE = [float("nan"), float("inf"), float("-inf")]


@pytest.mark.parametrize("bad", NON_FINITE, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("where", ["kv_usage", "extra", "started_at"])
def test_every_float_is_finite(bad, where):
    """NaN or infinity anywhere a member can put a float is refused on decode: it would
    break the dashboard's JSON and `pdreg status`."""
    if where == "started_at":
        raw = msgspec.to_builtins(Register(spec=SPEC, nonce=b"n" * 16))
        raw[1]["started_at"] = bad
    else:
        load = [1, 2, bad, {}] if where == "kv_usage" else [1, 2, 0.5, {"tok_s": bad}]
        raw = ["Heartbeat", "x", 1, 1, 2, load]
    with pytest.raises(msgspec.ValidationError):
        control_decoder().decode(msgspec.msgpack.encode(raw))


@pytest.mark.parametrize("member_id", ["a/b", "a\n", "a\nb", " a", "-a", "a b", "a\x00", "é"])
def test_ids_are_strict(member_id):
    bad = msgspec.structs.replace(SPEC, id=member_id)
    assert "id" in (validate_spec(bad) or "")


@pytest.mark.parametrize(("change", "problem"), [
    ({"endpoints": Endpoints(http="ftp://x:1")}, "http"),
    ({"endpoints": Endpoints(http="http://:80")}, "http"),
    ({"endpoints": Endpoints(http="http://h:99999")}, "not a URL"),
    ({"endpoints": Endpoints(http="http://h:80/?q=1")}, "query"),
    ({"model": ""}, "model"),
    ({"parallel": Parallel(tp_size=2, tp_rank=2)}, "rank"),
    ({"id": "bad id!"}, "id"),
    ({"protocol": "Bad Proto"}, "protocol"),
    ({"endpoints": Endpoints(http="http://h:1", kv_host="h;rm -rf")}, "kv_host"),
    ({"endpoints": Endpoints(http="http://h:1", kv_host="h\n")}, "kv_host"),
    ({"endpoints": Endpoints(http="http://169.254.169.254:80")}, "link-local"),
    ({"endpoints": Endpoints(http="http://[fe80::1]:80")}, "link-local"),
    ({"endpoints": Endpoints(http="http://h:1", kv_host="169.254.1.1")}, "link-local"),
    ({"endpoints": Endpoints(http="http://user:pw@h:1")}, "credentials"),
    # The advertised /metrics URL (a router's --metrics-port) is held to the same rules.
    ({"endpoints": Endpoints(http="http://h:1", metrics="ftp://h:2/metrics")},
     "endpoints.metrics"),
    ({"endpoints": Endpoints(http="http://h:1", metrics="http://169.254.169.254/m")},
     "link-local"),
    ({"endpoints": Endpoints(http="http://h:1", metrics="http://u:p@h:2/metrics")},
     "credentials"),
    ({"endpoints": Endpoints(http="http://h:1", metrics="http://h:2/metrics?x=1")}, "query"),
    ({"model": "a\x00b"}, "printable"),
    ({"model": "line\nbreak"}, "printable"),
    ({"labels": {"zone": "a\x1b[31m"}}, "printable"),
    ({"labels": {"": "x"}}, "label"),
    ({"protocol": "vllm\n"}, "protocol"),
])
def test_semantic_validation(change, problem):
    bad = msgspec.structs.replace(SPEC, **change)
    assert problem in (validate_spec(bad) or "")
    assert validate_spec(SPEC) is None


def test_a_spec_without_a_metrics_url_is_what_old_members_send():
    """`metrics` is optional and omitted when empty: an old member's spec decodes as
    before, and a new one's decodes where the field is unknown (a map, not an array)."""
    assert "metrics" not in msgspec.to_builtins(SPEC.endpoints)
    advertised = msgspec.structs.replace(
        SPEC, endpoints=Endpoints(http="http://10.0.0.5:8100",
                                  metrics="http://10.0.0.5:9100/metrics"))
    assert validate_spec(advertised) is None

    class OldEndpoints(msgspec.Struct, frozen=True, omit_defaults=True):
        http: str
        kv_host: str = ""
        kv_port: int = 0
        bootstrap_port: int = 0

    old = msgspec.msgpack.decode(msgspec.msgpack.encode(advertised.endpoints),
                                 type=OldEndpoints)
    assert old.http == "http://10.0.0.5:8100"


def test_encoder_never_pickles():
    with pytest.raises(TypeError, match="no pickle"):
        make_encoder().encode(Heartbeat("x", 1, 1, MemberState.READY, Load(extra={"a": object()})))


def test_topics_do_not_prefix_match():
    assert not topic_for("llama-70b").startswith(topic_for("llama"))


@pytest.mark.parametrize(("text", "role"), [("prefill", Role.PREFILL), ("API-SERVER",
                                                                         Role.API_SERVER)])
def test_parse_role(text, role):
    assert parse_role(text) is role


def test_parse_role_names_the_choices():
    with pytest.raises(ValueError, match="prefill, decode, mixed, api_server"):
        parse_role("encoder")
