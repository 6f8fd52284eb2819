"""`pdreg drain ID`: ask the registry to stop routing new requests to a member."""

from __future__ import annotations

import argparse
import os
import sys

import httpx

from pdreg.args import add_registry_argument
from registry.client import http_base, parse_registries, request_snapshot
from registry.server import ADMIN_TOKEN_ENV


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("drain", help="mark a member draining (admin)")
    p.add_argument("id", help="member id, as `pdreg status` shows it")
    add_registry_argument(p)
    p.add_argument("--admin-token", default=None, help=f"bearer token (or ${ADMIN_TOKEN_ENV})")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    token = args.admin_token or os.environ.get(ADMIN_TOKEN_ENV, "")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    failures = 0
    for address in parse_registries(args.registry):
        try:
            base = http_base(address, request_snapshot(address))
            response = httpx.post(f"{base}/v1/members/{args.id}/drain", headers=headers,
                                  timeout=10.0)
        except (OSError, RuntimeError, httpx.HTTPError) as exc:
            print(f"pdreg drain: {address}: {exc}", file=sys.stderr)
            failures += 1
            continue
        if response.is_success:
            print(f"{args.id}: draining ({address})")
        else:
            print(f"pdreg drain: {address}: HTTP {response.status_code}: "
                  f"{response.json().get('detail', response.text)}", file=sys.stderr)
            failures += 1
    return 1 if failures else 0
