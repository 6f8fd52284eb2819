"""Members the router sees but may never send to: an HTTP or KV address outside
--allow-upstream.

The upstream pool refuses such an address on every request (`forbidden`), so without
this the router would report ready while each request to those members failed with a
line in its log only. Checked as membership changes, never per request; the answer is a
readiness warning (router/readiness.py) and the `pdreg_router_unroutable_members`
gauge.

Only IP literals are judged here, the common case (members advertise their pod or host
address): a name may resolve to an allowed address, which the pool checks when it
connects. A KV host must also be canonical (router/guard.py `kv_address_problem`); a
member without one hands out its HTTP host, checked already.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Final
from urllib.parse import urlsplit

from registry.client import LiveMember
from router.guard import UpstreamPolicy, kv_address_problem
from router.http.kv_hosts import is_ip
from router.readiness import ReadyWarning
from wire.protocol import Role

__all__ = ["MAX_NAMED", "Unroutable"]

MAX_NAMED: Final = 5  # members a warning names; the rest are counted


class Unroutable:
    def __init__(self, policy: UpstreamPolicy, allow_upstream: str = "") -> None:
        """`allow_upstream`: the flag's text, as the warning quotes it."""
        self.policy = policy
        self._allowed = allow_upstream or "unset: public addresses only"
        self.members: dict[str, str] = {}  # member id -> the address refused ("http 10.0.0.5")
        # The warning, made again only when `members` changes: readiness asks every
        # second, and sorting 100k refused ids each time cost a router ~50 ms a second.
        self._warnings: list[ReadyWarning] | None = []

    def on_members(self, members: Mapping[str, LiveMember],
                   moved: Collection[str] | None = None) -> None:
        """Membership changed (not only loads): look again at the members in `moved`
        (the ids that joined, left or have a new record), or at all (None)."""
        found = self.members
        if moved is None:
            found.clear()
            self._warnings = None
            moved = members.keys()
        for member_id in moved:
            held = found.pop(member_id, "")
            member = members.get(member_id)
            problem = ""
            # (routers and API servers take no traffic from a router)
            if member is not None and member.record.spec.role is not Role.API_SERVER:
                endpoints = member.record.spec.endpoints
                problem = self._refused(endpoints.http, endpoints.kv_host)
            if problem:
                found[member_id] = problem
            if problem != held:
                self._warnings = None

    def _refused(self, http: str, kv_host: str) -> str:
        try:
            host = urlsplit(http).hostname or ""
        except ValueError:
            host = ""
        if is_ip(host) and not self.policy.allows(host):
            return f"http {host}"
        if kv_host and is_ip(kv_host.strip("[]")) and kv_address_problem(kv_host, self.policy):
            return f"kv {kv_host}"
        return ""

    def warnings(self) -> list[ReadyWarning]:
        """One warning, its detail naming the first MAX_NAMED such members (by id)."""
        if self._warnings is None:
            self._warnings = self._warning()
        return list(self._warnings)

    def _warning(self) -> list[ReadyWarning]:
        if not self.members:
            return []
        ids = sorted(self.members)
        named = ", ".join(f"{i} ({self.members[i]})" for i in ids[:MAX_NAMED])
        more = f" and {len(ids) - MAX_NAMED} more" if len(ids) > MAX_NAMED else ""
        return [ReadyWarning(f"{len(ids)} member(s) can never be routed to: an address "
                             "outside --allow-upstream",
                             f"--allow-upstream {self._allowed}; {named}{more}")]
