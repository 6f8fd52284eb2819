"""What `pdreg drain`, `evict`, `cordon` and `uncordon` share: one admin request, sent
to the registries given until it is done.

With a shared store (etcd), one registry taking the write is enough: it goes to the
store and every registry applies it, so the command stops at the first that says so
(`"shared": true`) and only names the ones it could not reach on the way. With `memory`
or `file:` stores each registry holds its own intents, so every one is asked, and any
failure makes the exit code non-zero. Every step is bounded (`pdreg.targets`).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import httpx

from pdreg.args import (
    ADMIN_TOKEN,
    add_client_curve_arguments,
    add_registry_http_arguments,
    add_secret_argument,
    client_curve_of,
    registry_http_of,
    secret_of,
)
from pdreg.targets import HTTP_TIMEOUT, Target, add_targets_argument, ask_all, parse_targets

__all__ = ["add_admin_arguments", "admin_request"]


def add_admin_arguments(parser: argparse.ArgumentParser) -> None:
    add_targets_argument(parser)
    add_secret_argument(parser, ADMIN_TOKEN, "the registry's admin token (sent over the "
                                             "registry's HTTP side: over the network, use "
                                             "--https or --ca-file)")
    add_client_curve_arguments(parser)
    add_registry_http_arguments(parser)


def admin_request(args: argparse.Namespace, command: str, method: str, path: str,
                  done: str, params: dict[str, Any] | None = None) -> int:
    """Send one admin request; print each registry's answer; the exit code."""
    token = secret_of(args, ADMIN_TOKEN)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    curve = client_curve_of(args)
    scheme, verify = registry_http_of(args)
    try:
        targets = parse_targets(args.registry)
    except ValueError as exc:
        print(f"pdreg {command}: {exc}", file=sys.stderr)
        return 2

    def ask(target: Target) -> httpx.Response:
        base = target.base(curve=curve, token=token, scheme=scheme)
        return httpx.request(method, f"{base}{path}", headers=headers, params=params,
                             timeout=HTTP_TIMEOUT, verify=verify)

    failures = 0
    for target in targets:
        [(_, answer)] = ask_all([target], ask)
        if isinstance(answer, Exception):
            print(f"pdreg {command}: registry {target.name} unreachable: "
                  f"{_describe(answer)}", file=sys.stderr)
            failures += 1
            continue
        body = _json(answer)
        if answer.is_success:
            shared = bool(body.get("shared"))
            where = f"{target.name}" + (f"; store {body['store']}, every registry applies it"
                                        if shared else "")
            late = "" if body.get("applied", True) else " (stored; not applied there yet)"
            print(f"{args.id}: {done}{late} ({where})")
            if shared:
                return 0
            continue
        print(f"pdreg {command}: registry {target.name}: HTTP {answer.status_code}: "
              f"{body.get('detail', answer.text)}", file=sys.stderr)
        failures += 1
    return 1 if failures else 0


def _json(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _describe(exc: Exception) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) < 300 else text[:300] + "..."
