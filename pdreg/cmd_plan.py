"""`pdreg plan`: what the planner decided, per model and role, and why."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import httpx

from pdreg.args import (
    TOKEN,
    add_client_curve_arguments,
    add_registry_argument,
    add_secret_argument,
    client_curve_of,
    secret_of,
)
from pdreg.cmd_status import fetch_members
from pdreg.watch import show
from planner.inputs import PLANNER_PROTOCOL
from registry.security import ClientCurve

HTTP_TIMEOUT_S = 5.0
COLUMNS = ("MODEL", "ROLE", "NOW", "DESIRED", "WHY")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("plan", help="show the planner's decisions")
    add_registry_argument(p)
    add_client_curve_arguments(p)
    add_secret_argument(p, TOKEN, "the fleet token, to find the planner through a registry "
                                  "listening beyond loopback")
    p.add_argument("--planner", default="", metavar="URL",
                   help="the planner's HTTP address (default: found through the registry)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--watch", action="store_true", help="refresh the table in place")
    p.set_defaults(func=run)


def find_planner(registries: str | None, curve: ClientCurve | None = None,
                 token: str = "") -> str:
    """The HTTP address of a ready planner registered with the registry."""
    planners = [m for m in fetch_members(registries, curve=curve, token=token)
                if m["role"] == "api_server" and m["protocol"] == PLANNER_PROTOCOL
                and m["routable"]]
    if not planners:
        raise RuntimeError("no planner is registered (start `pdreg planner`, or pass "
                           "--planner URL)")
    return planners[0]["endpoints"]["http"]


def fetch_plan(url: str) -> dict[str, Any]:
    try:
        response = httpx.get(f"{url.rstrip('/')}/v1/plan", timeout=HTTP_TIMEOUT_S)
        response.raise_for_status()
        return response.json()
    except (httpx.HTTPError, ValueError) as exc:
        raise RuntimeError(f"planner {url}: {exc}") from None


def render(plan: dict[str, Any]) -> str:
    rows = [COLUMNS]
    for d in plan["decisions"]:
        desired = str(d["desired"]) + (" (held)" if d["holding"] else "")
        rows.append((d["model"], d["role"], str(d["now"]), desired, d["why"]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS) - 1)]
    lines = ["  ".join([*(cell.ljust(w) for cell, w in zip(row[:-1], widths, strict=True)),
                        row[-1]]) for row in rows]
    if not plan["decisions"]:
        lines.append("(no model to plan: no prefill or decode is registered)")
    lines.extend(f"! {problem}" for problem in plan["problems"])
    lines.append(f"TTFT SLO {plan['ttft_slo_s'] * 1e3:.0f} ms, ITL SLO "
                 f"{plan['itl_slo_s'] * 1e3:.0f} ms (p{plan['latency_quantile'] * 100:g}); "
                 f"every {plan['interval_s']:g} s")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        url = args.planner or find_planner(args.registry, client_curve_of(args),
                                           secret_of(args, TOKEN))

        def table(once: bool) -> str:
            plan = fetch_plan(url)
            if args.json:
                return json.dumps(plan, indent=2 if once else None)
            return render(plan)
        show(table, title=f"pdreg plan  ({url})", watch=args.watch)
        return 0
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, TimeoutError, ValueError) as exc:
        print(f"pdreg plan: {exc}", file=sys.stderr)
        return 1
