"""Who may use the registry's HTTP side: readers and operators (the README's threat model).

- admin actions (drain, evict, cordon): an admin token when any is set; without one, only
  clients on this machine (a loopback peer). Never a browser: a request carrying `Origin`
  or a cross-site `Sec-Fetch-Site` is refused, so no web page an operator visits can fire
  one (CSRF), not even through DNS rebinding.
- reads (members, bans, registries, dashboard): with `exposed` (bound beyond loopback),
  a fleet or admin token (when either is set), as `Authorization: Bearer T` or as the
  password of HTTP Basic (so a browser prompts for it once and the dashboard works).
  /healthz and /metrics stay open for probes and Prometheus.

Several tokens of each kind may be accepted at once (old and new, while they rotate);
every one is compared, in constant time, so which one matched is not timed either.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

from fastapi import HTTPException, Request

__all__ = ["Access"]


@dataclass(frozen=True, slots=True)
class Access:
    """The tokens the HTTP side accepts; `require_admin`/`require_reader` are FastAPI
    dependencies that raise 401/403 or return None."""

    admin_tokens: tuple[bytes, ...] = ()
    read_tokens: tuple[bytes, ...] = ()  # empty: reads are open

    @classmethod
    def of(cls, *, admin_tokens: Sequence[str], read_tokens: Sequence[str],
           exposed: bool) -> Access:
        admin = tuple(t.encode() for t in admin_tokens if t)
        fleet = tuple(t.encode() for t in read_tokens if t)
        # Reads need a token only when exposed; any fleet or admin token then reads.
        readers = (*fleet, *admin) if exposed else ()
        return cls(admin_tokens=admin, read_tokens=readers)

    def require_admin(self, request: Request) -> None:
        _refuse_browsers(request)
        if not self.admin_tokens:
            if not _from_loopback(request):
                raise HTTPException(403, "admin actions from another machine need the "
                                         "registry's --admin-token")
            return
        if not token_matches(request, self.admin_tokens):
            raise HTTPException(401, "admin token required: Authorization: Bearer <token>")

    def require_reader(self, request: Request) -> None:
        if self.read_tokens and not token_matches(request, self.read_tokens):
            raise HTTPException(401, "the fleet token is required: Authorization: Bearer "
                                     "<token>", headers={"WWW-Authenticate": 'Basic '
                                                         'realm="pdreg registry"'})


def _refuse_browsers(request: Request) -> None:
    """403 for what a web page can send: browsers set `Origin` on every POST and DELETE
    (and `Sec-Fetch-Site`); pdreg, curl and scripts set neither."""
    site = request.headers.get("sec-fetch-site", "none")
    if "origin" in request.headers or site != "none":
        raise HTTPException(403, "admin actions are not taken from web pages (a request "
                                 "with Origin or Sec-Fetch-Site); use pdreg drain/evict "
                                 "or curl")


def _from_loopback(request: Request) -> bool:
    host = request.client.host if request.client else ""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def token_matches(request: Request, tokens: Sequence[bytes]) -> bool:
    """Whether `Authorization` carries one of `tokens` (Bearer, or Basic's password)."""
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    given = value.strip().encode()
    if scheme.lower() == "basic":
        try:
            given = base64.b64decode(given, validate=True).partition(b":")[2]
        except (binascii.Error, ValueError):
            return False
    elif scheme.lower() != "bearer":
        return False
    # Every token compared, in constant time each: which one matched is not timed either.
    matched = False
    for token in tokens:
        matched |= hmac.compare_digest(given, token)
    return matched
