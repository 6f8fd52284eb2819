"""What the planner plans from: membership per (model, role), and the routers to scrape.

Pure functions of a membership mapping (`registry.client.MembershipView.members()`).

- Counted: prefill and decode members that are joining or ready. Joining ones count
  (with their capacity and no load, as HPA counts unready pods at 0% for scale-up): an
  engine the planner asked for is on its way, and must not be asked for twice. Draining
  members are leaving and do not count. Mixed members are not planned.
- Capacity: each member's declared `capacity`; one that declares none gets
  `default_capacity`, else the mean of its role's declared ones; 0 when nobody declares.
- Unsure: a suspect member's heartbeats are late, so its load is not known. Its role's
  decision is held until it is back or gone.
- Routers: `api_server` members speaking `openai` (CONTRACT.md), not draining.
- Model names reach `--exec` as an argument: only names matching MODEL_NAME are planned.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from registry.client import LiveMember
from wire.protocol import ROUTER_PROTOCOL, MemberState, Role

__all__ = ["MAX_MODELS", "MODEL_NAME", "PLANNED_ROLES", "PLANNER_PROTOCOL", "ROUTER_PROTOCOL",
           "Fleet", "RoleFleet", "fleet_of", "routers_of"]

PLANNER_PROTOCOL = "pdreg-planner"  # the planner's own api_server registration
PLANNED_ROLES = (Role.PREFILL, Role.DECODE)
# Letters first: a name like "--force" must never reach a hook's argv as an option.
MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,255}$")
MAX_MODELS = 256  # bounds the metrics' label sets and the work per tick


@dataclass(frozen=True, slots=True)
class RoleFleet:
    replicas: int = 0  # joining + ready
    ready: int = 0
    running: int = 0
    waiting: int = 0
    capacity: int = 0  # 0 = unknown
    kv_usage: float = 0.0  # mean over the counted members
    unsure: tuple[str, ...] = ()  # suspect members: their load is not known


@dataclass(frozen=True, slots=True)
class Fleet:
    """Every planned model's roles, and the models left out (with why)."""

    models: dict[str, dict[Role, RoleFleet]]
    refused: dict[str, str]  # model -> why it is not planned


def fleet_of(members: Mapping[str, LiveMember], *, default_capacity: int = 0,
             models: frozenset[str] = frozenset()) -> Fleet:
    """Per model (all, or only `models`), both planned roles, even one with no member."""
    grouped: dict[str, dict[Role, list[LiveMember]]] = {}
    refused: dict[str, str] = {}
    for member in members.values():
        spec = member.record.spec
        if spec.role not in PLANNED_ROLES or (models and spec.model not in models):
            continue
        if not MODEL_NAME.match(spec.model):
            refused[spec.model] = "model name is not letters, digits and ._:/@+- " \
                                  "(it would reach --exec as an argument)"
            continue
        if spec.model not in grouped and len(grouped) >= MAX_MODELS:
            refused[spec.model] = f"more than {MAX_MODELS} models"
            continue
        roles = grouped.setdefault(spec.model, {role: [] for role in PLANNED_ROLES})
        if member.record.state is not MemberState.DRAINING:
            roles[spec.role].append(member)
    return Fleet({model: {role: _role_fleet(found, default_capacity)
                          for role, found in roles.items()}
                  for model, roles in grouped.items()}, refused)


def _role_fleet(members: list[LiveMember], default_capacity: int) -> RoleFleet:
    if not members:
        return RoleFleet()
    declared = [m.record.spec.capacity for m in members if m.record.spec.capacity > 0]
    fill = default_capacity or (round(sum(declared) / len(declared)) if declared else 0)
    capacity = sum(declared) + fill * (len(members) - len(declared))
    return RoleFleet(
        replicas=len(members),
        ready=sum(m.record.state is MemberState.READY for m in members),
        running=sum(m.load.running for m in members),
        waiting=sum(m.load.waiting for m in members),
        capacity=capacity if capacity > 0 else 0,
        kv_usage=sum(m.load.kv_usage for m in members) / len(members),
        unsure=tuple(sorted(m.id for m in members if m.record.suspect)))


def routers_of(members: Mapping[str, LiveMember]) -> list[LiveMember]:
    """The routers to scrape, in id order."""
    return sorted((m for m in members.values()
                   if m.record.spec.role is Role.API_SERVER
                   and m.record.spec.protocol == ROUTER_PROTOCOL
                   and m.record.state is not MemberState.DRAINING),
                  key=lambda m: m.id)
