"""Naming a registry, and one-shot questions to it (for CLIs).

Every client names a registry by its control address `HOST:PORT` (several separated by
commas; default `$PDREG_REGISTRY`, else 127.0.0.1:7600). The registry announces its event
and HTTP ports itself, so that address is all anyone configures.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import zmq

from registry import sessions
from registry.security import ClientCurve
from wire.limits import MAX_NAME_CHARS
from wire.protocol import Snapshot, Sync, make_encoder, reply_decoder

__all__ = ["DEFAULT_REGISTRY", "REGISTRY_ENV", "http_base", "parse_models", "parse_registries",
           "request_snapshot"]

DEFAULT_REGISTRY = "127.0.0.1:7600"
REGISTRY_ENV = "PDREG_REGISTRY"


def parse_registries(text: str | Sequence[str] | None) -> list[str]:
    """`"h1:7600,h2:7600"` (or a list, or None -> $PDREG_REGISTRY or the default) -> list.

    Each address once, in the order given.
    """
    if text is None:
        text = os.environ.get(REGISTRY_ENV) or DEFAULT_REGISTRY
    items = text.split(",") if isinstance(text, str) else list(text)
    addresses = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        item = item.removeprefix("tcp://")
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"registry address {item!r} must be HOST:PORT")
        address = f"{host}:{int(port)}"
        if address not in addresses:
            addresses.append(address)
    if not addresses:
        raise ValueError("no registry address given")
    return addresses


def request_snapshot(address: str, *, timeout_s: float = 2.0, models: Sequence[str] = (),
                     curve: ClientCurve | None = None, token: str = "") -> Snapshot:
    """One Sync round trip (for CLIs): the snapshot, which also names the HTTP port.
    `token`: the fleet (or admin) token, which a registry beyond loopback asks for."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        curve.apply(sock)
    try:
        sock.connect(f"tcp://{address}")
        encode = make_encoder().encode
        sock.send(encode(sessions.prove_sync(Sync(models=list(models)), token, encode)))
        if not sock.poll(timeout_s * 1e3):
            hint = ("" if curve is not None else "; if it runs CURVE, give "
                    "--registry-public-key and --curve-key")
            raise TimeoutError(f"registry {address} did not answer within {timeout_s:.0f}s; "
                               f"is it running? (set --registry or ${REGISTRY_ENV}){hint}")
        reply = reply_decoder().decode(sock.recv())
    finally:
        sock.close(linger=0)
    if not isinstance(reply, Snapshot):
        raise RuntimeError(f"registry {address} refused the sync: {reply.reason}")
    return reply


def http_base(address: str, snapshot: Snapshot, scheme: str = "http") -> str:
    """The registry's HTTP base URL: its control host with the HTTP port it announced
    (`scheme` "https" where it serves --tls-cert)."""
    if not snapshot.http_port:
        raise RuntimeError(f"registry {address} runs without HTTP")
    return f"{scheme}://{address.rpartition(':')[0]}:{snapshot.http_port}"


def parse_models(text: str) -> tuple[str, ...]:
    """`A,B` -> ("A", "B"): the models a view subscribes to (empty: every model).

    Raises ValueError on a name no member could have (the registry refuses those)."""
    models = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    for model in models:
        if len(model) > MAX_NAME_CHARS or not model.isprintable():
            raise ValueError(f"model {model[:40]!r}: at most {MAX_NAME_CHARS} printable "
                             f"characters")
    return models
