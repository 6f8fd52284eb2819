"""The JSON shape of a member, shared by `GET /v1/members` and `pdreg status --json`."""

from __future__ import annotations

from typing import Any

import msgspec

from wire.protocol import Load, MemberRecord, Role, role_name


def member_json(record: MemberRecord, now_wall: float) -> dict[str, Any]:
    """A member as operators and scripts see it. Ages are from the registry's clock."""
    spec = record.spec
    endpoints = spec.endpoints
    parallel = spec.parallel
    started = spec.started_at or record.registered_at
    load = record.load
    return {
        "id": spec.id,
        "role": role_name(spec.role),
        "model": spec.model,
        "state": record.state.name.lower(),
        "suspect": record.suspect,
        "cordoned": record.cordoned,
        "routable": record.routable,
        "incarnation": spec.incarnation,
        "protocol": spec.protocol,
        "endpoints": {
            "http": endpoints.http,
            "kv_host": endpoints.kv_host,
            "kv_port": endpoints.kv_port,
            "bootstrap_port": endpoints.bootstrap_port,
        },
        "parallel": {
            "tp_size": parallel.tp_size, "pp_size": parallel.pp_size,
            "dp_size": parallel.dp_size, "tp_rank": parallel.tp_rank,
            "pp_rank": parallel.pp_rank, "dp_rank": parallel.dp_rank,
        },
        "capacity": spec.capacity,
        "labels": dict(spec.labels),
        "load": load_json(load),
        "heartbeat_age_s": round(max(0.0, now_wall - record.heartbeat_at), 3),
        "registered_at": record.registered_at,
        "uptime_s": round(max(0.0, now_wall - started), 1),
        # Where it publishes KV cache events (None: it does not); routers subscribe.
        "kv_events": msgspec.structs.asdict(spec.kv_events) if spec.kv_events else None,
        # The LoRA adapters a request may name besides `model`, and the context length in
        # tokens (0: not said): what a router serves and refuses by.
        "adapters": list(spec.adapters),
        "max_model_len": spec.max_model_len,
    }


def load_json(load: Load) -> dict[str, Any]:
    return {
        "running": load.running,
        "waiting": load.waiting,
        "kv_usage": load.kv_usage,
        # Engine-specific figures stay apart: merged in, an `extra` named "running"
        # would overwrite the real count in /v1/members, the dashboard and status.
        "extra": dict(load.extra),
    }


def matches(record: MemberRecord, *, role: Role | None, model: str | None,
            state: str | None) -> bool:
    """The filters of `GET /v1/members` (state may be "suspect" or "routable" too)."""
    if role is not None and record.spec.role is not role:
        return False
    if model is not None and record.spec.model != model:
        return False
    if state is None:
        return True
    if state == "suspect":
        return record.suspect
    if state == "routable":
        return record.routable
    return record.state.name.lower() == state
