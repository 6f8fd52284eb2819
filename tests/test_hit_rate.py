"""The engines' own prefix-cache hit rate where operators look: a load figure the reference
engine reports, a HIT% column in `pdreg status`, a value in the dashboard's load rows, and
a line per model nobody can match exactly."""

from __future__ import annotations

import json
from typing import Any

from pdreg.cmd_status import render, unmatched_models
from registry.change_log import Chunk
from registry.dashboard import render_ops
from registry.views import member_json
from wire.figures import PREFIX_CACHE_HIT_RATE
from wire.protocol import (
    Endpoints,
    KvEventsSpec,
    Load,
    LoadEntry,
    MemberRecord,
    MemberSpec,
    MemberState,
    Role,
)


def member(member_id: str, role: Role, load: Load, *, model: str = "tiny",
           publishes: bool = False) -> dict[str, Any]:
    kv = KvEventsSpec("tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558") if publishes else None
    spec = MemberSpec(id=member_id, incarnation=1, role=role, model=model,
                      protocol="vllm-nixl", endpoints=Endpoints(http="http://10.0.0.1:8000"),
                      kv_events=kv)
    return member_json(MemberRecord(spec=spec, state=MemberState.READY, load=load), 0.0)


def test_status_shows_the_engines_hit_rate_only_where_one_is_reported() -> None:
    members = [member("prefill-a", Role.PREFILL, Load(extra={PREFIX_CACHE_HIT_RATE: 0.734})),
               member("decode-a", Role.DECODE, Load())]
    header, prefill, decode, _ = render(members).splitlines()
    assert "HIT%" in header
    assert prefill.split()[-1] == "73" and decode.split()[-1] == "-"
    assert "HIT%" not in render([member("decode-a", Role.DECODE, Load())])


def test_the_dashboard_load_rows_carry_the_hit_rate_only_from_engines_with_one() -> None:
    entries = [LoadEntry("p", 1, Load(running=2, extra={PREFIX_CACHE_HIT_RATE: 0.5}), 0.25),
               LoadEntry("d", 1, Load(running=1), 0.25)]
    (op,) = json.loads("[" + render_ops(Chunk(0, "loads", entries, 0.0)) + "]")
    assert op["loads"] == [["p", 1, 2, 0, 0.0, 0.25, 0.5], ["d", 1, 1, 0, 0.0, 0.25]]


def test_status_names_models_no_prefill_publishes_for() -> None:
    members = [member("prefill-a", Role.PREFILL, Load(), model="a", publishes=True),
               member("prefill-b", Role.PREFILL, Load(), model="b"),
               member("mixed-c", Role.MIXED, Load(), model="c"),
               member("decode-a", Role.DECODE, Load(), model="a"),
               member("decode-d", Role.DECODE, Load(), model="d", publishes=True)]
    assert unmatched_models(members) == [
        f"kv pairing, model {m}: peak_ewma fallback (no_events: no prefill publishes KV "
        "events)" for m in ("b", "c")]
