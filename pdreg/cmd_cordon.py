"""`pdreg cordon ID` / `pdreg uncordon ID`: keep an id out of routing, across restarts of
the member and (with a file or etcd store) of every registry, until uncordoned."""

from __future__ import annotations

import argparse

from pdreg.admin_cli import add_admin_arguments, admin_request


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "cordon", help="keep a member id out of routing until uncordoned (admin)",
        description="Keep an id out of routing: its members stay registered and are not "
                    "told to drain, but routers skip them (shown as draining, cordoned). "
                    "It holds across restarts of the member, and of every registry with a "
                    "file or etcd --store. An id may be cordoned before it joins.")
    p.add_argument("id", help="member id, as `pdreg status` shows it")
    add_admin_arguments(p)
    p.set_defaults(func=cordon)
    p = subparsers.add_parser("uncordon", help="let a cordoned member id be routed again "
                                               "(admin)")
    p.add_argument("id", help="member id, as `pdreg status` shows it")
    add_admin_arguments(p)
    p.set_defaults(func=uncordon)


def cordon(args: argparse.Namespace) -> int:
    return admin_request(args, "cordon", "POST", f"/v1/members/{args.id}/cordon", "cordoned")


def uncordon(args: argparse.Namespace) -> int:
    return admin_request(args, "uncordon", "DELETE", f"/v1/members/{args.id}/cordon",
                         "uncordoned")
