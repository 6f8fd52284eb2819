"""`pdreg drain ID`: ask the registry to stop routing new requests to a member."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import httpx

from pdreg.args import (
    ADMIN_TOKEN,
    add_client_curve_arguments,
    add_registry_argument,
    add_registry_http_arguments,
    add_secret_argument,
    client_curve_of,
    registry_http_of,
    secret_of,
)
from registry.client import http_base, parse_registries, request_snapshot


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("drain", help="mark a member draining (admin)")
    p.add_argument("id", help="member id, as `pdreg status` shows it")
    add_admin_arguments(p)
    p.set_defaults(func=run)


def add_admin_arguments(parser: argparse.ArgumentParser) -> None:
    add_registry_argument(parser)
    add_secret_argument(parser, ADMIN_TOKEN, "the registry's admin token (sent over the "
                                             "registry's HTTP side: over the network, use "
                                             "--https or --ca-file)")
    add_client_curve_arguments(parser)
    add_registry_http_arguments(parser)


def admin_request(args: argparse.Namespace, command: str, method: str, path: str,
                  done: str, params: dict[str, Any] | None = None) -> int:
    """Send one admin request to every registry; print each result; the exit code."""
    token = secret_of(args, ADMIN_TOKEN)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    curve = client_curve_of(args)
    scheme, verify = registry_http_of(args)
    failures = 0
    for address in parse_registries(args.registry):
        try:
            snapshot = request_snapshot(address, curve=curve, token=token)
            base = http_base(address, snapshot, scheme)
            response = httpx.request(method, f"{base}{path}", headers=headers, params=params,
                                     timeout=10.0, verify=verify)
        except (OSError, RuntimeError, httpx.HTTPError) as exc:
            print(f"pdreg {command}: {address}: {exc}", file=sys.stderr)
            failures += 1
            continue
        if response.is_success:
            print(f"{args.id}: {done} ({address})")
            continue
        try:
            detail = response.json().get("detail", response.text)
        except ValueError:
            detail = response.text
        print(f"pdreg {command}: {address}: HTTP {response.status_code}: {detail}",
              file=sys.stderr)
        failures += 1
    return 1 if failures else 0


def run(args: argparse.Namespace) -> int:
    return admin_request(args, "drain", "POST", f"/v1/members/{args.id}/drain", "draining")
