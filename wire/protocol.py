"""The pdreg wire contract: msgspec Structs, msgpack-encoded, shared by every part.

Control channel (engine agent / router  <->  registry ROUTER socket), after ZeroMQ's
identity envelope:

    agent -> registry   frame 0: a `ControlMessage`
                        (Register | Heartbeat | Bye | BannedBye | Sync | Report |
                         KvIndexReport)
    registry -> agent   frame 0: a `Reply` (for every message but Sync) or a `Snapshot`

Sessions: an accepted Register's Reply carries `session`, a secret of 256 random bits the
registry keeps per member. Heartbeat, Bye and Report end with `proof`: a MAC with that
secret over every byte of the encoded message before the proof itself
(`registry.sessions.seal`), so the proof travels in the one frame and binds every field.
Their `seq` must be above the last one accepted, so nobody else can speak for the member
and nothing can be replayed. A Register carries `nonce`, the registrant's own secret: a retried
Register (the first reply was lost) with the same nonce gets the same session back; one
without it cannot take over the (id, incarnation). With a fleet token, a Register proves
it (`Register.proof`) instead of carrying it, and the session comes back sealed with it
(`Reply.session_salt`): a replayed Register yields nothing its sender can use.

Event channel (registry PUB socket), two frames per message:

    frame 0: topic = model name + b"\\0" (see `topic_for`), so a router subscribes to
             exactly the models it serves; prefix matching cannot confuse "llama" with
             "llama-70b" because of the terminator.
    frame 1: an `Event` (MemberJoined | MemberUpdated | MemberLeft | LoadDigest)

Every membership change carries the registry's `epoch` (random per registry start), the
next `version` and its topic's previous one; load digests carry the current version (no
bump) and their topic's last, so subscribers of every model or of some see a gap even
when no change flows (registry/topic_versions.py; NOT_SAID: from an older registry).

No pickle anywhere: the encoder refuses unknown types instead of falling back.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Final

import msgspec

# A router's KV index reports (re-exported: part of the control channel's messages)
from wire.kv_index_report import (  # noqa: F401
    MAX_KV_BLOCKS,
    MAX_KV_ENTRIES,
    MAX_KV_LAG_MS,
    KvIndexEntry,
    KvIndexReport,
    KvIndexState,
)
from wire.limits import (
    MAX_EXTRA_LOAD_FIELDS,
    MAX_PROBLEM_CHARS,
    NO_PROOF,
    Adapters,
    Count,
    Fraction,
    Host,
    Incarnation,
    Interval,
    Labels,
    LoadFigure,
    MemberId,
    Name,
    Nonce,
    Port,
    Proof,
    Seconds,
    Seq,
    Session,
    Token,
    UnixTime,
    Url,
)

PROTOCOL_VERSION: Final = 2  # 2: member sessions (proof, seq, nonce)


TOPIC_TERMINATOR: Final = b"\0"
NOT_SAID: Final = -1  # a per-topic version from a registry before them (trailing fields)


class Role(enum.IntEnum):
    PREFILL = 1
    DECODE = 2
    MIXED = 3
    API_SERVER = 4


class MemberState(enum.IntEnum):
    """What a member says of itself. `suspect` is the registry's overlay, not a state."""

    JOINING = 1  # registered, not ready for traffic (engine warming up, health failing)
    READY = 2
    DRAINING = 3  # finishing in-flight work; takes no new requests


class ReplyStatus(enum.IntEnum):
    OK = 1
    UNKNOWN = 2  # "unknown member, register again" (e.g. the registry restarted)
    STALE = 3  # an older incarnation than the one the registry holds
    REJECTED = 4  # invalid, unauthorised or not allowed; `reason` says which


class ByeReason(enum.IntEnum):
    SHUTDOWN = 1  # clean exit, drained or not
    CRASHED = 2  # a sidecar saw its engine process exit


class LeaveReason(enum.IntEnum):
    BYE = 1
    CRASHED = 2
    EXPIRED = 3
    EVICTED = 4  # an operator removed it
    REPLACED = 5  # a newer incarnation of the same id registered


def role_name(role: Role) -> str:
    return role.name.lower()


def parse_role(text: str) -> Role:
    try:
        return Role[text.strip().upper().replace("-", "_")]
    except KeyError:
        names = ", ".join(role_name(r) for r in Role)
        raise ValueError(f"unknown role {text!r}; expected one of: {names}") from None


# --- Member description (sent once, at registration) -----------------------------------
# Structs that hold only strings, numbers and flat dicts cannot form reference cycles, so
# they are `gc=False`: a 10,000-member snapshot then decodes without waking the collector.



class Endpoints(msgspec.Struct, frozen=True, omit_defaults=True, gc=False):
    """Where peers reach a member. Advertised addresses: behind NAT they differ from binds.

    `kv_host`/`kv_port` is the KV side of the P/D handshake: vLLM's NIXL side channel,
    the reference engine's KV server. `bootstrap_port` is SGLang's bootstrap server on
    `kv_host` (or on the HTTP host when `kv_host` is empty). Port 0 means "none".
    """

    http: Url
    kv_host: Host = ""
    kv_port: Port = 0
    bootstrap_port: Port = 0
    metrics: Url = ""  # its /metrics URL when not {http}/metrics (--metrics-port); "": there


class Parallel(msgspec.Struct, frozen=True, omit_defaults=True, gc=False):
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 1
    pp_size: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 1
    dp_size: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 1
    tp_rank: Annotated[int, msgspec.Meta(ge=0, lt=4096)] = 0
    pp_rank: Annotated[int, msgspec.Meta(ge=0, lt=4096)] = 0
    dp_rank: Annotated[int, msgspec.Meta(ge=0, lt=4096)] = 0


class KvEventsSpec(msgspec.Struct, frozen=True, omit_defaults=True, gc=False):
    """Where a member publishes its KV cache events (wire/kv_events.py): advertised
    `tcp://host:port` addresses, like `Endpoints`. Routers subscribe to ready members.

    `block_size`: tokens per cached block (0 = not known: the router cannot match exactly
    and falls back to approximate affinity). `hash_scheme`: what the engine hashes blocks
    with, as far as it says (`vllm:sha256`, `pdreg:content`...); informational, since
    routers key their index by token content (router/kv/keys.py). `tokenizer`: where the
    model's tokenizer is, as the engine was told (a local path or a hub name, for a
    router that has the same files), or `pdreg:bytes` for the reference engine's.
    """

    endpoint: Url
    replay_endpoint: Url = ""
    topic: Name = ""
    block_size: Annotated[int, msgspec.Meta(ge=0, le=65536)] = 0
    hash_scheme: Annotated[str, msgspec.Meta(max_length=64)] = ""
    tokenizer: Name = ""


class MemberSpec(msgspec.Struct, frozen=True, omit_defaults=True, gc=False):
    """Everything a member says about itself once, at registration."""

    id: MemberId
    incarnation: Incarnation  # new on every process start; newer replaces older
    role: Role
    model: Name
    protocol: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    endpoints: Endpoints
    parallel: Parallel = Parallel()
    capacity: Count = 0  # max concurrent requests it serves well; 0 = unknown
    labels: Labels = {}
    started_at: UnixTime = 0.0  # unix time the process started, for uptime
    kv_events: KvEventsSpec | None = None  # None: publishes no KV events (old members)
    adapters: Adapters = ()  # LoRA adapters served besides `model` (router/table.served)
    # Its context length in tokens (vLLM's max_model_len; 0: not said). A router refuses
    # a prompt sure to be longer than every member of the model takes (router/kv/limits.py).
    max_model_len: Count = 0


class Load(msgspec.Struct, frozen=True, array_like=True, gc=False, omit_defaults=True):
    running: Count = 0
    waiting: Count = 0
    kv_usage: Fraction = 0.0
    extra: Annotated[dict[Annotated[str, msgspec.Meta(max_length=64)], LoadFigure],
                     msgspec.Meta(max_length=MAX_EXTRA_LOAD_FIELDS)] = {}


# --- Control messages (client -> registry) -----------------------------------------------


class Register(msgspec.Struct, frozen=True, tag=True, array_like=True, omit_defaults=True):
    """Join (or re-join) the fleet. `nonce`: the registrant's random value, kept for the
    life of the process; a retry with the same (id, incarnation) must repeat it.

    The fleet token never travels: `proof` is a MAC with it over the message
    (`registry.sessions.register_proof`), and the Reply's session comes back sealed with
    it (`Reply.session_salt`), so a replayed Register returns nothing its sender can use.
    `token` is the old clear-text form, refused by a registry that has a token.
    """

    spec: MemberSpec
    nonce: Nonce
    state: MemberState = MemberState.JOINING
    load: Load = Load()
    token: Token = ""
    protocol_version: int = PROTOCOL_VERSION
    proof: Proof = NO_PROOF


class Heartbeat(msgspec.Struct, frozen=True, tag=True, array_like=True, gc=False):
    """`seq` strictly increases per member and registry; `proof` seals it (last field)."""

    id: MemberId
    incarnation: Incarnation
    seq: Seq
    state: MemberState
    load: Load
    proof: Proof = NO_PROOF


class Bye(msgspec.Struct, frozen=True, tag=True, array_like=True):
    id: MemberId
    incarnation: Incarnation
    seq: Seq
    reason: ByeReason = ByeReason.SHUTDOWN
    proof: Proof = NO_PROOF


class BannedBye(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """A Bye from a member an operator banned (at some registry, for `ban_s` more
    seconds): the registry removes it and refuses its id for that long too. The member
    carries a ban to every registry, and a restarted one (`Reply.banned_s`), sealed with
    its own session: it can ban only its own id. Not a field of `Bye`: a proved message
    ends with its proof, so old agents' Byes would break; an old registry refuses it.
    """

    id: MemberId
    incarnation: Incarnation
    seq: Seq
    ban_s: Seconds
    proof: Proof = NO_PROOF


class Sync(msgspec.Struct, frozen=True, tag=True, array_like=True, omit_defaults=True):
    """Ask for a snapshot. `models` empty = all models. `proof`: a MAC with the fleet (or
    admin) token over the message (`registry.sessions.sync_proof`), which a registry
    listening beyond loopback with a token requires."""

    models: Annotated[list[Name], msgspec.Meta(max_length=1024)] = []
    protocol_version: int = PROTOCOL_VERSION
    proof: Proof = NO_PROOF


class Report(msgspec.Struct, frozen=True, tag=True, array_like=True, omit_defaults=True):
    """A router saw `member` fail (connection error, 5xx) and quarantined it locally.

    Sent by the reporter about another member: `id`, `incarnation` and `seq` are the
    reporter's own, and `proof` is made with the reporter's session. Only `api_server`
    members (routers) may report.
    """

    id: MemberId
    incarnation: Incarnation
    seq: Seq
    member: MemberId
    member_incarnation: Incarnation
    problem: Annotated[str, msgspec.Meta(max_length=MAX_PROBLEM_CHARS)] = ""
    proof: Proof = NO_PROOF


ControlMessage = Register | Heartbeat | Bye | BannedBye | Sync | Report | KvIndexReport


# --- Registry -> client ------------------------------------------------------------------


class Reply(msgspec.Struct, frozen=True, tag=True, array_like=True, omit_defaults=True):
    status: ReplyStatus
    epoch: int
    heartbeat_interval_s: Interval
    reason: str = ""
    events_port: int = 0
    http_port: int = 0
    session: Session = b""  # set only on an accepted Register: the member's session secret
    # What an operator told this registry, carried by the member to every registry (the
    # only way without a shared store): `drain`: it announces DRAINING everywhere.
    drain: bool = False
    # `banned_s`: a Register refused because an operator banned this id here, for this
    # long; the member says a `BannedBye` to every registry and stops registering.
    banned_s: Seconds = 0.0
    # Set when `session` is sealed with the fleet token (`registry.sessions.open_session`).
    session_salt: Annotated[bytes, msgspec.Meta(max_length=32)] = b""


class MemberRecord(msgspec.Struct, frozen=True, omit_defaults=True, gc=False):
    """A member as the registry holds it: spec, state, suspicion and last load."""

    spec: MemberSpec
    state: MemberState
    suspect: bool = False
    load: Load = Load()
    registered_at: UnixTime = 0.0  # unix time the registry accepted this incarnation
    heartbeat_at: UnixTime = 0.0  # unix time of the last heartbeat (registry clock)
    cordoned: bool = False  # an operator's cordon: out of routing, shown as DRAINING

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def routable(self) -> bool:
        return self.state is MemberState.READY and not self.suspect


class Snapshot(msgspec.Struct, frozen=True, tag=True, array_like=True, omit_defaults=True,
               gc=False):
    epoch: int
    version: int
    members: list[MemberRecord]
    heartbeat_interval_s: Interval
    events_port: int = 0
    http_port: int = 0


# --- Events (registry PUB) ---------------------------------------------------------------


class MemberJoined(msgspec.Struct, frozen=True, tag=True, array_like=True, gc=False):
    epoch: int
    version: int
    member: MemberRecord
    previous_on_topic: int = NOT_SAID


class MemberUpdated(msgspec.Struct, frozen=True, tag=True, array_like=True, gc=False):
    """State or suspicion changed (not load: that travels in digests)."""

    epoch: int
    version: int
    member: MemberRecord
    previous_on_topic: int = NOT_SAID


class MemberLeft(msgspec.Struct, frozen=True, tag=True, array_like=True, gc=False):
    epoch: int
    version: int
    id: str
    incarnation: int
    model: str
    reason: LeaveReason
    previous_on_topic: int = NOT_SAID


class LoadEntry(msgspec.Struct, frozen=True, array_like=True, gc=False):
    id: str
    incarnation: int
    load: Load
    heartbeat_age_s: Seconds


class LoadDigest(msgspec.Struct, frozen=True, tag=True, array_like=True, gc=False):
    """Coalesced load for one model; sent even when empty, as the registry's pulse.

    `version` is the current membership version (not bumped): a subscriber that holds an
    older one has missed a change and resynchronises.
    """

    epoch: int
    version: int
    model: str
    loads: list[LoadEntry]
    heartbeat_interval_s: Interval
    last_on_topic: int = NOT_SAID


MembershipEvent = MemberJoined | MemberUpdated | MemberLeft
Event = MemberJoined | MemberUpdated | MemberLeft | LoadDigest


def topic_for(model: str) -> bytes:
    return model.encode() + TOPIC_TERMINATOR


# --- Encoding ----------------------------------------------------------------------------


def _refuse(obj: Any) -> Any:
    raise TypeError(f"pdreg protocol cannot encode {type(obj).__name__}; no pickle fallback")


def make_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder(enc_hook=_refuse)


def control_decoder() -> msgspec.msgpack.Decoder[ControlMessage]:
    return msgspec.msgpack.Decoder(ControlMessage)


def reply_decoder() -> msgspec.msgpack.Decoder[Reply | Snapshot]:
    return msgspec.msgpack.Decoder(Reply | Snapshot)


def event_decoder() -> msgspec.msgpack.Decoder[Event]:
    return msgspec.msgpack.Decoder(Event)


# --- P/D handshakes (appended by the router's owner; one definition for every part) ------

# A router's api_server `protocol` (what it speaks to clients): the planner finds routers by it.
ROUTER_PROTOCOL: Final = "openai"


class Handshake(enum.StrEnum):
    """The P/D handshake a member speaks: the value of `MemberSpec.protocol` for engines.

    Routers drive a (prefill, decode) pair only when both speak the same one; see
    router/handshakes/ for what each means on the wire.
    """

    VLLM_NIXL = "vllm-nixl"  # P: max_tokens=1 + kv_transfer_params; D: P's params verbatim
    SGLANG = "sglang"  # the same body to P and D at once, plus bootstrap_host/port/room
    VLLM_P2P = "vllm-p2p"  # the pair encoded in X-Request-Id; P first, then D
