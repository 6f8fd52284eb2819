"""A small etcd v3 client over etcd's JSON gateway (`/v3/...`), on httpx.

Why the gateway and httpx rather than a gRPC client (`aetcd`): the registry needs six
calls (range, put, delete-if-unchanged, lease grant/keepalive/revoke) and one watch, all
from plain threads; the gateway serves every one of them in every etcd since 3.4, httpx
is already a dependency, and there is no asyncio loop, protobuf stack or code generation
to add to a process whose busy loop must stay lean. Keys and values travel base64,
64-bit integers as strings; a watch is one streamed response of JSON lines.

Every call has a deadline (REQUEST_TIMEOUT_S; CONNECT_TIMEOUT_S to connect). Several
endpoints: a call goes to the one that answered last, and on a transport error or an
"unavailable" answer tries the next. With a user, the client authenticates and retries
once when etcd says its token expired. Errors: `StoreUnavailable` (nobody answered, or
etcd refused: `EtcdRefused` carries the gRPC code), `Compacted` (a watch asked for a
revision etcd no longer has: reload everything).
"""

from __future__ import annotations

import base64
import json
import logging
import ssl
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Final

import httpx

from registry.store.base import Change, Item, StoreUnavailable
from registry.store.url import EtcdOptions

__all__ = ["Compacted", "EtcdClient", "EtcdOptions", "EtcdRefused"]

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT_S: Final = 2.0
CONNECT_TIMEOUT_S: Final = 1.0
# A watch with no news for this long is opened again from where it was (etcd 3.4 sends
# progress notifications only every 10 minutes): what bounds noticing a frozen etcd.
WATCH_IDLE_S: Final = 10.0
MAX_RESPONSE_BYTES: Final = 64 * 1024 * 1024
# gRPC codes etcd answers with (google.golang.org/grpc/codes).
CODE_NOT_FOUND: Final = 5
CODE_UNAVAILABLE: Final = 14
CODE_DEADLINE: Final = 4
CODE_UNAUTHENTICATED: Final = 16
_RETRY_ELSEWHERE = {CODE_UNAVAILABLE, CODE_DEADLINE}


class EtcdRefused(StoreUnavailable):
    """etcd answered with an error (permission denied, lease not found, ...)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"etcd refused: {message} (code {code})")
        self.code = code


class Compacted(Exception):
    def __init__(self, revision: int) -> None:
        super().__init__(f"watch revision compacted (etcd keeps from {revision})")
        self.revision = revision


class EtcdClient:
    """Thread-safe: the HTTP side writes while the store's thread watches."""

    def __init__(self, endpoints: Sequence[str], prefix: str,
                 options: EtcdOptions | None = None) -> None:
        self.options = options or EtcdOptions()
        scheme = "https" if self.options.tls else "http"
        self._bases = [f"{scheme}://{endpoint}" for endpoint in endpoints]
        self._current = 0  # the endpoint that answered last
        self._prefix = prefix.rstrip("/") + "/"
        tls = _tls_context(self.options)
        timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
        self._http = httpx.Client(verify=tls, timeout=timeout)
        # The watch's own connection: a long stream must not hold one writes wait for.
        self._watch_http = httpx.Client(verify=tls, timeout=httpx.Timeout(
            REQUEST_TIMEOUT_S, connect=CONNECT_TIMEOUT_S, read=WATCH_IDLE_S))
        self._token = ""
        self._token_lock = threading.Lock()

    def close(self) -> None:
        self._http.close()
        self._watch_http.close()

    @property
    def endpoint(self) -> str:
        return self._bases[self._current]

    # --- keys --------------------------------------------------------------------------

    def range_all(self) -> tuple[int, dict[str, Item]]:
        """(revision, every key under the prefix) in one consistent read."""
        body = self.call("/v3/kv/range", {"key": _b64(self._prefix),
                                          "range_end": _b64(_prefix_end(self._prefix))})
        items = {}
        try:
            for kv in body.get("kvs", []):
                key = _unb64(kv["key"]).decode(errors="replace").removeprefix(self._prefix)
                items[key] = Item(_unb64(kv.get("value", "")), int(kv.get("mod_revision", 0)))
        except (KeyError, ValueError, TypeError, AttributeError) as exc:
            raise StoreUnavailable(f"etcd answered a range of an unexpected shape: "
                                   f"{exc!r}") from None
        return _revision(body), items

    def put(self, key: str, value: bytes, lease: int = 0) -> int:
        body: dict[str, Any] = {"key": _b64(self._prefix + key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        return _revision(self.call("/v3/kv/put", body))

    def delete(self, key: str, *, mod_revision: int = 0) -> int:
        full = _b64(self._prefix + key)
        if not mod_revision:
            body = self.call("/v3/kv/deleterange", {"key": full})
            return _revision(body) if int(body.get("deleted", 0)) else 0
        body = self.call("/v3/kv/txn", {
            "compare": [{"key": full, "target": "MOD", "result": "EQUAL",
                         "mod_revision": str(mod_revision)}],
            "success": [{"request_delete_range": {"key": full}}]})
        return _revision(body) if body.get("succeeded") else 0

    # --- leases ------------------------------------------------------------------------

    def grant(self, ttl_s: int) -> int:
        return int(self.call("/v3/lease/grant", {"TTL": str(ttl_s), "ID": "0"})["ID"])

    def keepalive(self, lease: int) -> int:
        """The lease's TTL after renewing it; 0 if etcd no longer has it."""
        body = self.call("/v3/lease/keepalive", {"ID": str(lease)})
        return int(body.get("result", {}).get("TTL", 0))

    def revoke(self, lease: int) -> None:
        self.call("/v3/lease/revoke", {"ID": str(lease)})

    # --- watch -------------------------------------------------------------------------

    def watch(self, start_revision: int) -> Iterator[tuple[int, list[Change]]]:
        """(revision, changes) for every change under the prefix from `start_revision`,
        until the stream is idle for WATCH_IDLE_S (it returns; watch again from the next
        revision) or breaks (StoreUnavailable; Compacted)."""
        body = {"create_request": {"key": _b64(self._prefix),
                                   "range_end": _b64(_prefix_end(self._prefix)),
                                   "start_revision": str(start_revision)}}
        created = False
        try:
            with self._watch_http.stream("POST", self.endpoint + "/v3/watch", json=body,
                                         headers=self._headers()) as response:
                if response.status_code != 200:
                    response.read()
                    raise self._refusal(response)
                for line in response.iter_lines():
                    result = _watch_result(line)
                    if result is None:
                        continue
                    created = True
                    try:
                        batch = self._batch(result)
                    except (KeyError, ValueError, TypeError, AttributeError) as exc:
                        raise StoreUnavailable(f"etcd sent a watch event of an unexpected "
                                               f"shape: {exc!r}") from None
                    if batch is not None:
                        yield batch
        except httpx.ReadTimeout:
            if not created:
                raise StoreUnavailable(f"etcd at {self.endpoint} did not open a watch "
                                       f"within {WATCH_IDLE_S:.0f}s") from None
            return  # idle: the caller opens it again
        except httpx.HTTPError as exc:
            self._rotate()
            raise StoreUnavailable(f"etcd watch at {self.endpoint} broke: {exc}") from None
        raise StoreUnavailable(f"etcd at {self.endpoint} ended the watch")

    def _batch(self, result: dict[str, Any]) -> tuple[int, list[Change]] | None:
        if result.get("canceled"):
            compacted = int(result.get("compact_revision", 0))
            if compacted:
                raise Compacted(compacted)
            raise StoreUnavailable(f"etcd canceled the watch: "
                                   f"{result.get('cancel_reason', 'no reason given')}")
        changes: list[Change] = []
        revision = 0
        for event in result.get("events") or []:
            kv = event.get("kv", {})
            key = _unb64(kv["key"]).decode(errors="replace").removeprefix(self._prefix)
            revision = max(revision, int(kv.get("mod_revision", 0)))
            if event.get("type") == "DELETE":
                changes.append((key, None))
            else:
                changes.append((key, Item(_unb64(kv.get("value", "")), revision)))
        return (revision, changes) if changes else None

    # --- calls -------------------------------------------------------------------------

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST `body` to `path` at the endpoints in turn; the decoded answer."""
        errors = []
        for _ in range(len(self._bases)):
            base = self.endpoint
            try:
                response = self._post(base + path, body)
                if response.status_code != 200 and self._token_expired(response):
                    self._authenticate(force=True)
                    response = self._post(base + path, body)
            except httpx.HTTPError as exc:
                errors.append(f"{base}: {type(exc).__name__} {exc}".rstrip())
                self._rotate()
                continue
            if response.status_code == 200:
                return _json(response)
            refusal = self._refusal(response)
            if refusal.code not in _RETRY_ELSEWHERE:
                raise refusal
            errors.append(f"{base}: {refusal}")
            self._rotate()
        raise StoreUnavailable("etcd unreachable: " + "; ".join(errors))

    def _post(self, url: str, body: dict[str, Any]) -> httpx.Response:
        return self._http.post(url, json=body, headers=self._headers())

    def _headers(self) -> dict[str, str]:
        if not self.options.user:
            return {}
        return {"Authorization": self._authenticate()}

    def _authenticate(self, *, force: bool = False) -> str:
        with self._token_lock:
            if self._token and not force:
                return self._token
            response = self._http.post(self.endpoint + "/v3/auth/authenticate", json={
                "name": self.options.user, "password": self.options.password})
            if response.status_code != 200:
                raise self._refusal(response)
            self._token = str(_json(response).get("token", ""))
            return self._token

    def _token_expired(self, response: httpx.Response) -> bool:
        return bool(self.options.user) and _code(response) == CODE_UNAUTHENTICATED

    def _refusal(self, response: httpx.Response) -> EtcdRefused:
        try:
            data = _json(response)
            message = str(data.get("message") or data.get("error") or response.text)
        except (StoreUnavailable, ValueError):
            message = response.text[:200]
        return EtcdRefused(_code(response), f"HTTP {response.status_code}: {message[:300]}")

    def _rotate(self) -> None:
        self._current = (self._current + 1) % len(self._bases)


def _tls_context(options: EtcdOptions) -> ssl.SSLContext:
    """Server certificates checked against the CA given (else the system's); the client
    certificate presented when given. ValueError (the registry does not start) when a
    file cannot be read."""
    try:
        context = ssl.create_default_context(cafile=options.ca_file or None)
        if options.cert_file:
            context.load_cert_chain(options.cert_file, options.key_file or None)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"--store-ca/--store-cert/--store-key: {exc}") from None
    return context


def _watch_result(line: str) -> dict[str, Any] | None:
    """The `result` of one line of a watch stream (its creation notice included); None
    for a blank line."""
    if not line.strip():
        return None
    try:
        message = json.loads(line)
    except ValueError:
        raise StoreUnavailable(f"etcd sent a watch line that is not JSON: {line[:100]!r}") \
            from None
    if "error" in message:
        raise StoreUnavailable(f"etcd watch failed: {message['error']}")
    return message.get("result") or {}


def _code(response: httpx.Response) -> int:
    try:
        return int(json.loads(response.content).get("code", 0))
    except (ValueError, AttributeError, TypeError):
        return 0


def _json(response: httpx.Response) -> dict[str, Any]:
    if len(response.content) > MAX_RESPONSE_BYTES:
        raise StoreUnavailable(f"etcd answered {len(response.content)} bytes; limit "
                               f"{MAX_RESPONSE_BYTES}")
    try:
        data = json.loads(response.content)
    except ValueError:
        raise StoreUnavailable(f"etcd answered something that is not JSON: "
                               f"{response.text[:100]!r}") from None
    if not isinstance(data, dict):
        raise StoreUnavailable("etcd answered JSON that is not an object")
    return data


def _revision(body: dict[str, Any]) -> int:
    return int(body.get("header", {}).get("revision", 0))


def _b64(data: str | bytes) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode()


def _unb64(text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (ValueError, TypeError):
        raise StoreUnavailable("etcd answered a key or value that is not base64") from None


def _prefix_end(prefix: str) -> bytes:
    """The end of the range of keys that start with `prefix` (its last byte plus one)."""
    raw = prefix.encode()
    return raw[:-1] + bytes([raw[-1] + 1])
