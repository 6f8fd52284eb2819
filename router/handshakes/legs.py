"""The steps handshakes share: post a leg, read or drain its answer, refuse a 4xx, and
the KV address a member registered, checked against --allow-upstream.

Every KV address handed to an engine is checked by the pool (`kv_host_problem`): the
same --allow-upstream policy as HTTP traffic, canonical forms only.
"""

from __future__ import annotations

from typing import Any, Final
from urllib.parse import urlsplit

import msgspec

from router.handshakes.exchange import LegFailure, UpstreamRejected, leg_failure
from router.http.response import UpstreamResponse
from router.http.upstream import UpstreamPool
from router.table import Candidate

__all__ = [
    "kv_address",
    "kv_endpoint",
    "post_leg",
    "prefill_json",
    "read_all",
    "reject_4xx",
    "reported_cached_tokens",
    "reported_cached_tokens_in",
]

ERROR_BODY_CHARS: Final = 300  # how much of an upstream error body a log line keeps
ERROR_BODY_BYTES: Final = 64 * 1024  # how much of an upstream error body is read at all
REJECTION_BODY_BYTES: Final = 1024 * 1024  # a prefill's 4xx answer, relayed to the client

_decode = msgspec.json.decode


async def post_leg(pool: UpstreamPool, member: Candidate, role: str, path: str,
                   payload: bytes, request_id: str, *,
                   quarantine_on_5xx: bool = True) -> UpstreamResponse:
    """POST and wait for the status line. Connection errors and 5xx become LegFailure."""
    try:  # OSError covers refused, dropped (UpstreamError) and connect timeouts
        response = await pool.post(member.http, path, payload, request_id)
    except OSError as exc:
        raise leg_failure(member, role, exc, "post") from None
    if response.status >= 500:
        text = await read_quietly(response)
        raise LegFailure(member, role, f"HTTP {response.status}: {text[:ERROR_BODY_CHARS]}",
                         kind="status", status=response.status, quarantine=quarantine_on_5xx)
    return response


async def read_quietly(response: UpstreamResponse) -> str:
    try:
        return (await response.read(ERROR_BODY_BYTES)).decode(errors="replace")
    except OSError:
        return ""
    finally:
        response.release()


async def read_all(response: UpstreamResponse, member: Candidate, role: str,
                   max_bytes: int | None = None) -> bytes:
    try:
        return await response.read(max_bytes)
    except OSError as exc:
        raise leg_failure(member, role, exc, "read") from None
    finally:
        response.release()


def reported_cached_tokens(reply: Any) -> int | None:
    """The prompt tokens the engine found cached, in an OpenAI answer's usage
    `prompt_tokens_details.cached_tokens` (vLLM with --enable-prompt-tokens-details,
    SGLang with --enable-cache-report, the reference engine always): None when absent
    or not a count."""
    usage = reply.get("usage") if isinstance(reply, dict) else None
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if isinstance(cached, int) and not isinstance(cached, bool) and cached >= 0:
        return cached
    return None


def reported_cached_tokens_in(body: bytes) -> int | None:
    """`reported_cached_tokens` of a whole JSON answer; None for anything else (a
    stream, an answer that is not JSON)."""
    if not body.startswith(b"{"):
        return None
    try:
        return reported_cached_tokens(_decode(body))
    except msgspec.DecodeError:
        return None


async def reject_4xx(response: UpstreamResponse, member: Candidate, role: str) -> None:
    if response.status >= 400:
        body = await read_all(response, member, role, REJECTION_BODY_BYTES)
        raise UpstreamRejected(response.status, body, response.content_type)


async def prefill_json(pool: UpstreamPool, member: Candidate, path: str,
                       payload: bytes, request_id: str) -> Any:
    response = await post_leg(pool, member, "prefill", path, payload, request_id)
    await reject_4xx(response, member, "prefill")
    raw = await read_all(response, member, "prefill")
    try:
        return _decode(raw)
    except msgspec.DecodeError:
        raise LegFailure(member, "prefill", "response is not JSON", kind="reply") from None


async def kv_endpoint(pool: UpstreamPool, member: Candidate, role: str = "prefill"
                      ) -> tuple[str, int, int]:
    """(host, kv_port, bootstrap_port) the member registered for its KV side, the host
    checked by the pool's policy. LegFailure (forbidden) if it may not be used."""
    endpoints = member.member.record.spec.endpoints if member.member else None
    host = (endpoints.kv_host if endpoints else "") or _http_host(member.http)
    problem = await pool.kv_host_problem(host)
    if problem is not None:
        raise LegFailure(member, role, problem, kind="forbidden")
    if endpoints is None:
        return host, 0, 0
    return host, endpoints.kv_port, endpoints.bootstrap_port


async def kv_address(pool: UpstreamPool, member: Candidate, role: str) -> str:
    host, port, _ = await kv_endpoint(pool, member, role)
    return f"{host}:{port}"


def _http_host(url: str) -> str:
    return urlsplit(url).hostname or ""
