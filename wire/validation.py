"""Semantic validation of what a member says about itself, beyond what the types enforce.

Character patterns cost a regex per field, so they are checked once, at registration,
not on every heartbeat and snapshot.
"""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

from wire.protocol import MemberSpec, Role

__all__ = ["url_host", "validate_member_id", "validate_spec"]

# The whole text must match (`\Z`; `$` would let a trailing newline through). Ids: no `/`
# (they are URL path segments in the HTTP API), nothing a terminal or log would misread.
_ID_OK = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]*\Z")
_HOST_OK = re.compile(r"[A-Za-z0-9._:\[\]-]+\Z")
_PROTOCOL_OK = re.compile(r"[a-z0-9][a-z0-9._-]*\Z")
# Link-local addresses include every cloud's instance metadata service (169.254.169.254):
# no engine lives there, and a router must never be pointed at it.
_LINK_LOCAL = (ipaddress.ip_network("169.254.0.0/16"), ipaddress.ip_network("fe80::/10"))


def validate_member_id(member_id: str) -> str | None:
    """Why `member_id` is not a valid id, or None."""
    if not _ID_OK.fullmatch(member_id):
        return f"id {member_id!r} must be letters, digits and ._:@- (starting alphanumeric)"
    return None


def _is_link_local(host: str) -> bool:
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False  # a name: only the router's --allow-upstream can judge where it points
    return any(address.version == net.version and address in net for net in _LINK_LOCAL)


def _problem_with_text(spec: MemberSpec) -> str | None:
    if not spec.model.isprintable():
        return f"model {spec.model!r} must be printable text"
    for adapter in spec.adapters:
        if not adapter or not adapter.isprintable() or adapter == spec.model:
            return f"adapter {adapter!r} must be printable text, not the base model's name"
    for key, value in spec.labels.items():
        if not key or not key.isprintable() or not value.isprintable():
            return f"label {key!r}={value!r} must be printable text with a non-empty key"
    return None


def validate_spec(spec: MemberSpec) -> str | None:
    """Return why `spec` is unacceptable, or None. Types were already checked on decode."""
    problem = validate_member_id(spec.id) or _problem_with_text(spec)
    if problem:
        return problem
    if not _PROTOCOL_OK.fullmatch(spec.protocol):
        return f"protocol {spec.protocol!r} must be lower-case letters, digits and ._-"
    problem = _problem_with_http_url("endpoints.http", spec.endpoints.http)
    if spec.endpoints.metrics:
        # Scraped by the planner (and named to Prometheus): the same rules as `http`.
        problem = problem or _problem_with_http_url("endpoints.metrics",
                                                    spec.endpoints.metrics)
    if problem:
        return problem
    if _is_link_local(spec.endpoints.kv_host):
        return (f"address {spec.endpoints.kv_host!r} is link-local (instance metadata "
                "lives there)")
    if spec.role is not Role.API_SERVER and not spec.model:
        return "model must be set for engine roles"
    p = spec.parallel
    if p.tp_rank >= p.tp_size or p.pp_rank >= p.pp_size or p.dp_rank >= p.dp_size:
        return "parallel: every rank must be below its size"
    if spec.endpoints.kv_host and not _HOST_OK.match(spec.endpoints.kv_host):
        return f"endpoints.kv_host {spec.endpoints.kv_host!r} is not a host name"
    if spec.kv_events is not None:
        for name in ("endpoint", "replay_endpoint"):
            problem = _problem_with_zmq_endpoint(name, getattr(spec.kv_events, name))
            if problem:
                return problem
        if not spec.kv_events.topic.isprintable():
            return "kv_events.topic must be printable text"
    return None


def _problem_with_http_url(name: str, url: str) -> str | None:
    """An advertised HTTP address: http(s)://host[:port][/path], no credentials, query
    or fragment, never link-local."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        return f"{name} {url!r} is not a URL: {exc}"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"{name} {url!r} must be http(s)://host[:port]"
    if not _HOST_OK.fullmatch(parts.hostname) or not url.isprintable():
        return f"{name} {url!r} has an invalid host"
    if port == 0:
        return f"{name} {url!r} has port 0"
    if parts.query or parts.fragment or parts.username or parts.password:
        return f"{name} {url!r} must not carry a query or fragment or credentials"
    if _is_link_local(parts.hostname):
        return f"address {parts.hostname!r} is link-local (instance metadata lives there)"
    return None


def url_host(host: str) -> str:
    """HOST as it goes into a URL: an IPv6 literal in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _problem_with_zmq_endpoint(name: str, address: str) -> str | None:
    """An advertised ZeroMQ address must be tcp://host:port: routers connect to it."""
    if not address:
        return "kv_events.endpoint is required" if name == "endpoint" else None
    try:
        parts = urlsplit(address)
        port = parts.port
    except ValueError as exc:
        return f"kv_events.{name} {address!r} is not an address: {exc}"
    if parts.scheme != "tcp" or not parts.hostname or not port:
        return f"kv_events.{name} {address!r} must be tcp://host:port (advertised, not *)"
    if not _HOST_OK.fullmatch(parts.hostname) or _is_link_local(parts.hostname):
        return f"kv_events.{name} {address!r} has an invalid or link-local host"
    if parts.path or parts.query or parts.fragment or parts.username:
        return f"kv_events.{name} {address!r} must be only tcp://host:port"
    return None
