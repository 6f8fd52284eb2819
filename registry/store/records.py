"""What the store holds: keys and values, decoded and bounded. Pure.

Keys, relative to the store's prefix:

    intents/drain/{member id}    DrainIntent   drain the id's incarnations up to `incarnation`
    intents/evict/{member id}    EvictIntent   remove them (those registered before `at`);
                                               refuse the id until `ban_until`
    intents/cordon/{member id}   CordonIntent  keep the id out of routing, across restarts,
                                               until the key is deleted (uncordon)
    registries/{registry id}     RegistryEntry one per live registry, under its lease

Values are JSON, so `etcdctl get --prefix pdreg/` reads them. Whoever can write to the
store can drain, evict and cordon (it holds admin rights), but a value is still input: it
is decoded with a typed decoder, at most MAX_VALUE_BYTES, every field bounded, ids checked
like a registration's. A key or value that fails is refused with a reason (`BadRecord`),
counted, and changes nothing. Keys of kinds this version does not know are ignored.
"""

from __future__ import annotations

import enum
from typing import Annotated, Final, TypeVar

import msgspec

from wire.limits import MAX_ID_CHARS, Host, Incarnation, Name, Port, UnixTime, Url
from wire.validation import validate_member_id

__all__ = [
    "EVICT_HOLD_S", "INTENTS", "INTENT_MAX_AGE_S", "MAX_VALUE_BYTES", "REGISTRIES",
    "BadRecord", "CordonIntent", "DrainIntent", "EvictIntent", "Intent", "IntentKind",
    "RegistryEntry", "decode_intent", "decode_registry", "encode", "expires_at",
    "intent_key", "parse_key", "registry_key",
]

MAX_VALUE_BYTES: Final = 4096
INTENTS: Final = "intents/"
REGISTRIES: Final = "registries/"
# An eviction without a ban only has to reach every registry once (a watch does in about
# a second); kept this long so a registry that was away for a while hears it too.
EVICT_HOLD_S: Final = 600.0
# A drain or an eviction is swept from the store at the latest this long after it was
# made (a drained process that never came back); a cordon stays until uncordoned.
INTENT_MAX_AGE_S: Final = 30 * 24 * 3600.0
_T = TypeVar("_T")
Epoch = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]


class IntentKind(enum.StrEnum):
    DRAIN = "drain"
    EVICT = "evict"
    CORDON = "cordon"


class DrainIntent(msgspec.Struct, frozen=True, kw_only=True):
    incarnation: Incarnation  # this incarnation and any older one of the id is drained
    at: UnixTime  # when the operator asked
    by: Name = ""  # the registry that took the write


class EvictIntent(msgspec.Struct, frozen=True, kw_only=True):
    incarnation: Incarnation  # removed where held (0: nobody held it; a ban alone)
    at: UnixTime  # only incarnations registered before this are removed
    ban_until: UnixTime = 0.0  # registrations of the id are refused until then
    by: Name = ""


class CordonIntent(msgspec.Struct, frozen=True, kw_only=True):
    at: UnixTime
    by: Name = ""


Intent = DrainIntent | EvictIntent | CordonIntent
_INTENT_TYPES: dict[IntentKind, type[Intent]] = {
    IntentKind.DRAIN: DrainIntent, IntentKind.EVICT: EvictIntent,
    IntentKind.CORDON: CordonIntent,
}
_DECODERS = {kind: msgspec.json.Decoder(cls) for kind, cls in _INTENT_TYPES.items()}


class RegistryEntry(msgspec.Struct, frozen=True, kw_only=True):
    """A live registry, as clients and `pdreg status` learn the replica set."""

    id: Name
    control: Host  # HOST:PORT, the address clients configure
    events_port: Port
    http: Url = ""  # its HTTP base URL; "" without HTTP
    epoch: Epoch
    started_at: UnixTime


_REGISTRY_DECODER = msgspec.json.Decoder(RegistryEntry)
_ENCODER = msgspec.json.Encoder()


class BadRecord(Exception):
    """A key or value refused; `reason` is the metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason  # oversized | malformed | invalid | id | cap
        self.detail = detail


def intent_key(kind: IntentKind, member_id: str) -> str:
    return f"{INTENTS}{kind}/{member_id}"


def registry_key(registry_id: str) -> str:
    return f"{REGISTRIES}{registry_id}"


def parse_key(key: str) -> tuple[IntentKind, str] | str | None:
    """(kind, member id) for an intent key, the registry id for a replica-set key, None
    for a key this version does not know (ignored). BadRecord for a bad member id."""
    if key.startswith(REGISTRIES):
        name = key.removeprefix(REGISTRIES)
        return name if 0 < len(name) <= 256 else None
    if not key.startswith(INTENTS):
        return None
    kind_text, _, member_id = key.removeprefix(INTENTS).partition("/")
    try:
        kind = IntentKind(kind_text)
    except ValueError:
        return None
    problem = validate_member_id(member_id) if len(member_id) <= MAX_ID_CHARS else \
        f"id of {len(member_id)} characters; limit {MAX_ID_CHARS}"
    if problem:
        raise BadRecord("id", problem)
    return kind, member_id


def decode_intent(kind: IntentKind, value: bytes) -> Intent:
    return _decode(_DECODERS[kind], value)


def decode_registry(value: bytes) -> RegistryEntry:
    return _decode(_REGISTRY_DECODER, value)


def encode(value: Intent | RegistryEntry) -> bytes:
    return _ENCODER.encode(value)


def expires_at(intent: Intent) -> float | None:
    """Unix time after which `intent` is moot and may be swept from the store; None for
    one that stands until an operator removes it (a cordon)."""
    if isinstance(intent, CordonIntent):
        return None
    if isinstance(intent, EvictIntent):
        return min(intent.at + INTENT_MAX_AGE_S, max(intent.ban_until,
                                                     intent.at + EVICT_HOLD_S))
    return intent.at + INTENT_MAX_AGE_S


def _decode(decoder: msgspec.json.Decoder[_T], value: bytes) -> _T:
    if len(value) > MAX_VALUE_BYTES:
        raise BadRecord("oversized", f"{len(value)} bytes; limit {MAX_VALUE_BYTES}")
    try:
        return decoder.decode(value)
    except msgspec.ValidationError as exc:
        raise BadRecord("invalid", str(exc)) from None
    except msgspec.DecodeError as exc:
        raise BadRecord("malformed", str(exc)) from None
