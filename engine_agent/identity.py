"""Who a member is: its stable id and the incarnation of this process.

An id names a serving endpoint (several instances per host differ by port); an
incarnation is new on every process start, so a newer process gets a larger number.
"""

from __future__ import annotations

import time

from wire.protocol import Endpoints, MemberSpec, Role, role_name

__all__ = ["api_server_spec", "default_member_id", "new_incarnation"]


def default_member_id(role: Role, advertise_host: str, port: int) -> str:
    """The stable id of a serving endpoint: several instances per host differ by port."""
    return f"{role_name(role)}-{advertise_host}-{port}"


def new_incarnation() -> int:
    """A new incarnation per process start: a newer process gets a larger number."""
    return time.time_ns()


def api_server_spec(advertise_host: str, port: int, protocol: str) -> MemberSpec:
    """The member a router or planner registers as: an `api_server` serving HTTP on
    `advertise_host:port`, no model of its own, a fresh incarnation."""
    return MemberSpec(
        id=default_member_id(Role.API_SERVER, advertise_host, port),
        incarnation=new_incarnation(), role=Role.API_SERVER, model="", protocol=protocol,
        endpoints=Endpoints(http=f"http://{advertise_host}:{port}"), started_at=time.time())
