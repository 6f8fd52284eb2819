"""Which registries a CLI command talks to, and asking all of them at once, bounded.

`--registry` names each registry by its control address `HOST:PORT` (the registry then
announces its HTTP port in a Sync reply), or by its HTTP(S) URL, `https://host:7680`:
the CLI then needs no control port at all, so `pdreg drain` works from inside a
cluster or through one port-forward. Mixed lists are fine.

Every registry is asked in parallel and every step is bounded (SYNC_TIMEOUT_S for the
Sync round trip, HTTP_TIMEOUT for the request), so one frozen or unreachable registry
costs a command at most COMMAND_DEADLINE_S, and is named in what the command prints.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, TypeVar
from urllib.parse import urlsplit

import httpx

from registry.addresses import (
    DEFAULT_REGISTRY,
    REGISTRY_ENV,
    http_base,
    parse_registries,
    request_snapshot,
)
from registry.security import ClientCurve

__all__ = ["COMMAND_DEADLINE_S", "HTTP_TIMEOUT", "Target", "add_targets_argument", "ask_all",
           "parse_targets"]

SYNC_TIMEOUT_S: Final = 1.5
HTTP_TIMEOUT: Final = httpx.Timeout(2.0, connect=1.0)
# Sync, then the HTTP request: what one registry may cost a command, whatever it does.
COMMAND_DEADLINE_S: Final = 5.0

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class Target:
    """One registry as given: a control address, or an HTTP(S) base URL."""

    name: str
    control: str = ""  # HOST:PORT
    url: str = ""  # scheme://host:port

    def base(self, *, curve: ClientCurve | None, token: str, scheme: str) -> str:
        """The registry's HTTP base URL (a Sync round trip for a control address)."""
        if self.url:
            return self.url
        snapshot = request_snapshot(self.control, timeout_s=SYNC_TIMEOUT_S, curve=curve,
                                    token=token)
        return http_base(self.control, snapshot, scheme)


def add_targets_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--registry", default=None,
                        metavar="HOST:PORT|http(s)://HOST:PORT[,...]",
                        help=f"registries, by control address or by HTTP(S) URL (then no "
                             f"control port is needed), comma-separated (default "
                             f"${REGISTRY_ENV} or {DEFAULT_REGISTRY})")


def parse_targets(text: str | Sequence[str] | None) -> list[Target]:
    """`--registry` (or $PDREG_REGISTRY, or the default) as targets, each once."""
    if text is None:
        text = os.environ.get(REGISTRY_ENV) or DEFAULT_REGISTRY
    items = text.split(",") if isinstance(text, str) else list(text)
    targets: list[Target] = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        if item.startswith(("http://", "https://")):
            target = _url_target(item)
        else:
            address = parse_registries([item])[0]
            target = Target(address, control=address)
        if target not in targets:
            targets.append(target)
    if not targets:
        raise ValueError("no registry given")
    return targets


def _url_target(text: str) -> Target:
    parts = urlsplit(text)
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"registry URL {text!r} must be http(s)://HOST[:PORT]")
    if port is None and ":" in parts.netloc.rpartition("@")[2].rpartition("]")[2]:
        raise ValueError(f"registry URL {text!r} has an invalid port")
    base = f"{parts.scheme}://{parts.netloc}"
    return Target(base, url=base)


def ask_all(targets: Sequence[Target], ask: Callable[[Target], _T], *,
            deadline_s: float = COMMAND_DEADLINE_S) -> list[tuple[Target, _T | Exception]]:
    """`ask(target)` for every target at once, in daemon threads; each one's answer or
    exception, in the targets' order. One that has not answered by `deadline_s` gets a
    TimeoutError (its thread is left to finish on its own bounded steps)."""
    results: dict[int, _T | Exception] = {}
    done = threading.Condition()

    def run(index: int, target: Target) -> None:
        try:
            result: _T | Exception = ask(target)
        except Exception as exc:  # reported per registry, never raised past here
            result = exc
        with done:
            results[index] = result
            done.notify_all()

    for index, target in enumerate(targets):
        threading.Thread(target=run, args=(index, target), daemon=True,
                         name=f"pdreg-ask-{target.name}").start()
    end = time.monotonic() + deadline_s
    with done:
        done.wait_for(lambda: len(results) == len(targets), max(0.0, end - time.monotonic()))
        answered = dict(results)
    return [(target, answered.get(index, TimeoutError(
                f"no answer within {deadline_s:.0f}s")))
            for index, target in enumerate(targets)]
