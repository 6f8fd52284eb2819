"""`pdreg status`: the membership table (or JSON) from one or more registries."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import httpx

from pdreg.args import (
    TOKEN,
    add_client_curve_arguments,
    add_registry_http_arguments,
    add_secret_argument,
    client_curve_of,
    registry_http_of,
    secret_of,
)
from pdreg.targets import HTTP_TIMEOUT, Target, add_targets_argument, ask_all, parse_targets
from pdreg.watch import show
from registry.security import ClientCurve
from wire.figures import PREFIX_CACHE_HIT_RATE

COLUMNS = ("ID", "ROLE", "MODEL", "STATE", "ADDRESS", "RUN", "WAIT", "KV%", "HB AGE", "UPTIME")
ROLE_ORDER = {"prefill": 0, "decode": 1, "mixed": 2, "api_server": 3}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("status", help="show the live membership")
    add_targets_argument(p)
    add_client_curve_arguments(p)
    add_secret_argument(p, TOKEN, "the fleet token: a registry listening beyond loopback "
                                  "shows its members only to holders of it")
    add_registry_http_arguments(p)
    p.add_argument("--json", action="store_true", help="print a JSON list of members")
    p.add_argument("--watch", action="store_true", help="refresh the table in place")
    p.add_argument("--router", default="", metavar="URL",
                   help="show what this router's KV index holds per member (`--policy "
                        "kv`): index state, blocks indexed, event lag, and its admission: "
                        "queues per class, answers, budget per member (its API key from "
                        "PDREG_API_KEY); without it, the KV INDEX column is the registry's "
                        "summary of what every registered router reports")
    p.set_defaults(func=run)


def _router_get(router: str, path: str) -> httpx.Response:
    key = os.environ.get("PDREG_API_KEY", "")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(router.rstrip("/") + path, headers=headers, timeout=5.0)


def admission_lines(router: str) -> list[str]:
    """The router's admission (GET /v1/admission): one line for its classes and the
    routers sharing each budget, one per model (queue, answers), one per member budget."""
    response = _router_get(router, "/v1/admission")
    if response.status_code == 404:  # a router from before admission
        return []
    response.raise_for_status()
    body = response.json()
    if not body.get("enabled"):
        return ["admission: off (--no-admission)"]
    classes = ", ".join(f"{c['name']} (priority {c['priority']}, SLO {c['ttft_slo_ms']:.0f} ms"
                        + (", sheddable)" if c["sheddable"] else ")") for c in body["classes"])
    lines = [f"admission: {body['routers']} routers share each budget; classes: {classes}"]
    for model, entry in sorted(body["models"].items()):
        queued = ", ".join(f"{k} {n}" for k, n in sorted(entry["queued"].items())) or "0"
        answers = {}
        for outcomes in entry["outcomes"].values():
            for outcome, n in outcomes.items():
                answers[outcome] = answers.get(outcome, 0) + n
        told = ", ".join(f"{k} {n}" for k, n in sorted(answers.items())) or "none yet"
        lines.append(f"admission, model {model}: queued {queued} ({entry['bytes']} bytes); "
                     f"answers: {told}")
    for member in body["members"]:
        limit = member["limit"] or "no limit"
        lines.append(f"budget {member['id']} ({member['role']}): {member['used']}/{limit} "
                     f"tokens, {member['requests']} requests")
    return lines


def add_kv_index(members: list[dict[str, Any]], router: str) -> list[str]:
    """Merge a router's /v1/kv (per member: state, blocks, lag; per model: exact or the
    peak_ewma fallback, `kv_pairing`) into `members`; one line per model for the table."""
    response = _router_get(router, "/v1/kv")
    response.raise_for_status()
    body = response.json()
    indexed = {m["id"]: m for m in body["members"]}
    for member in members:
        entry = indexed.get(member["id"])
        if entry is not None and entry["incarnation"] == member["incarnation"]:
            member["kv_index"] = {k: entry.get(k) for k in (
                "state", "blocks", "lag_s", "gaps", "replays", "unknown", "distrusted_s")}
        elif member.get("kv_events"):
            member["kv_index"] = {"state": "not followed", "blocks": 0, "lag_s": None}
    models = body.get("models", {})
    for member in members:
        if member["model"] in models:
            member["kv_pairing"] = models[member["model"]]
    return [f"kv pairing, model {model}: "
            + (f"{p['pairing']} fallback ({p['why']})" if p["why"] else p["pairing"])
            + f", {p['publishers']} members publish KV events"
            for model, p in sorted(models.items())]


def unmatched_models(members: list[dict[str, Any]]) -> list[str]:
    """Without a router to ask: one line per model none of whose prefills publishes KV
    events, whose requests a `--policy kv` router (the default) cannot match exactly."""
    models: dict[str, bool] = {}
    for m in members:
        if m["role"] in ("prefill", "mixed"):
            models[m["model"]] = models.get(m["model"], False) or bool(m.get("kv_events"))
    return [f"kv pairing, model {model}: peak_ewma fallback (no_events: no prefill "
            "publishes KV events)" for model, publishes in sorted(models.items())
            if not publishes]


@dataclass(frozen=True, slots=True)
class Fleet:
    """What the registries asked said: members merged, the replica set, who did not
    answer (registry name -> why)."""

    members: list[dict[str, Any]]
    registries: list[dict[str, Any]] = field(default_factory=list)
    unreachable: dict[str, str] = field(default_factory=dict)


def fetch_fleet(registries: str | list[str] | None, *,
                curve: ClientCurve | None = None, token: str = "",
                scheme: str = "http", verify: str | bool = True) -> Fleet:
    """Ask every registry at once (each step bounded: `pdreg.targets`); per member id
    the newest incarnation wins. RuntimeError when none answered."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    targets = parse_targets(registries)

    def ask(target: Target) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        base = target.base(curve=curve, token=token, scheme=scheme)
        with httpx.Client(timeout=HTTP_TIMEOUT, headers=headers, verify=verify) as http:
            response = http.get(f"{base}/v1/members")
            response.raise_for_status()
            replicas = http.get(f"{base}/v1/registries")
            # A registry older than the replica set has no such endpoint: not an error.
            known = replicas.json() if replicas.status_code == 200 else []
        return response.json(), known

    merged: dict[str, dict[str, Any]] = {}
    replica_set: dict[str, dict[str, Any]] = {}
    unreachable: dict[str, str] = {}
    for target, answer in ask_all(targets, ask):
        if isinstance(answer, Exception):
            unreachable[target.name] = str(answer) or type(answer).__name__
            continue
        members, known = answer
        for member in members:
            held = merged.get(member["id"])
            if held is None or member["incarnation"] > held["incarnation"]:
                merged[member["id"]] = member
        for entry in known:
            replica_set.setdefault(entry["id"], {k: v for k, v in entry.items()
                                                 if k != "self"})
    if len(unreachable) == len(targets):
        raise RuntimeError("; ".join(f"{name}: {why}" for name, why in unreachable.items()))
    members = sorted(merged.values(), key=lambda m: (ROLE_ORDER.get(m["role"], 9),
                                                      m["model"], m["id"]))
    return Fleet(members, sorted(replica_set.values(), key=lambda r: r["id"]), unreachable)


def fetch_members(registries: str | list[str] | None, *,
                  curve: ClientCurve | None = None, token: str = "",
                  scheme: str = "http", verify: str | bool = True) -> list[dict[str, Any]]:
    """Members from every registry; per id the newest incarnation wins."""
    return fetch_fleet(registries, curve=curve, token=token, scheme=scheme,
                       verify=verify).members


def render_registries(fleet: Fleet) -> list[str]:
    """The replica set, and every registry asked that did not answer."""
    lines = []
    for entry in fleet.registries:
        lines.append(f"registry {entry['id']}: live ({entry.get('http') or 'no HTTP'}, "
                     f"store {entry.get('store', '?')})")
    for name, why in fleet.unreachable.items():
        lines.append(f"registry {name}: UNREACHABLE ({why[:200]})")
    return lines


def render(members: list[dict[str, Any]]) -> str:
    """A table people read at a glance; a HIT% column when any engine reports its prefix
    cache's hit rate (`Load.extra`), and a KV INDEX column when any member has one (the
    registry's summary of what routers report, or `--router`'s own index)."""
    with_kv = any("kv_index" in m for m in members)
    with_hits = any(PREFIX_CACHE_HIT_RATE in m["load"].get("extra", {}) for m in members)
    rows = [(*COLUMNS, *(("HIT%",) if with_hits else ()), *(("KV INDEX",) if with_kv else ()))]
    for m in members:
        state = ("cordoned" if m.get("cordoned") else m["state"]) + (
            " (suspect)" if m["suspect"] else "")
        load = m["load"]
        address = m["endpoints"]["http"].removeprefix("http://").removeprefix("https://")
        rows.append((m["id"], m["role"], m["model"] or "-", state, address,
                     str(load["running"]), str(load["waiting"]),
                     f"{100 * load['kv_usage']:.0f}", f"{m['heartbeat_age_s']:.1f}s",
                     _duration(m["uptime_s"])))
        if with_hits:  # the engine's own prefix-cache counters, not the router's guess
            rate = m["load"].get("extra", {}).get(PREFIX_CACHE_HIT_RATE)
            rows[-1] = (*rows[-1], "-" if rate is None else f"{100 * rate:.0f}")
        if with_kv:
            rows[-1] = (*rows[-1], _kv_cell(m.get("kv_index")))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
             for row in rows]
    by_role: dict[str, int] = {}
    for m in members:
        if m["routable"]:
            by_role[m["role"]] = by_role.get(m["role"], 0) + 1
    summary = ", ".join(f"{n} {role}" for role, n in sorted(by_role.items())) or "none"
    lines.append(f"{len(members)} members; routable: {summary}")
    return "\n".join(lines)


def _kv_cell(kv: dict[str, Any] | None) -> str:
    """A member's KV index: one router's (`--router`), or the registry's summary across
    the routers that report it (the worst state, with routers per state when several)."""
    if kv is None:
        return "-"
    lag = f" lag {kv['lag_s']:.1f}s" if kv.get("lag_s") is not None else ""
    routers: dict[str, int] = kv.get("routers") or {}
    across = ""
    if len(routers) > 1:
        across = " (" + ", ".join(f"{n} {state}" for state, n in routers.items()) + ")"
    elif sum(routers.values()) > 1:
        across = f" ({sum(routers.values())} routers)"
    # This router scores it as holding nothing: its engine's reports contradict its events.
    distrust = f" DISTRUSTED {kv['distrusted_s']:.0f}s" if kv.get("distrusted_s") else ""
    return f"{kv['state']} {kv['blocks']} blocks{lag}{across}{distrust}"


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h{(seconds % 3600) // 60:02d}m"


def run(args: argparse.Namespace) -> int:
    curve = client_curve_of(args)
    scheme, verify = registry_http_of(args)
    token = secret_of(args, TOKEN)

    def fetch() -> Fleet:
        fleet = fetch_fleet(args.registry, curve=curve, token=token, scheme=scheme,
                            verify=verify)
        for name, why in fleet.unreachable.items():
            print(f"pdreg status: registry {name} unreachable: {why[:300]}", file=sys.stderr)
        return fleet

    try:
        def table(once: bool) -> str:
            fleet = fetch()
            members = fleet.members
            kv_lines = [*add_kv_index(members, args.router), *admission_lines(args.router)] \
                if args.router else unmatched_models(members)
            if args.json:
                return json.dumps(members, indent=2 if once else None)
            return "\n".join([render(members), *kv_lines, *render_registries(fleet)])
        show(table, title="pdreg status", watch=args.watch)
        return 0
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, TimeoutError, ValueError, httpx.HTTPError) as exc:
        print(f"pdreg status: {exc}", file=sys.stderr)
        return 1


