"""`pdreg drain ID`: ask the registry to stop routing new requests to a member."""

from __future__ import annotations

import argparse

from pdreg.admin_cli import add_admin_arguments, admin_request


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("drain", help="mark a member draining (admin)")
    p.add_argument("id", help="member id, as `pdreg status` shows it")
    add_admin_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return admin_request(args, "drain", "POST", f"/v1/members/{args.id}/drain", "draining")
