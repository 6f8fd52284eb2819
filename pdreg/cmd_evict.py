"""`pdreg evict ID [--ban S]`: remove a member now; optionally keep its id out a while."""

from __future__ import annotations

import argparse

from pdreg.admin_cli import add_admin_arguments, admin_request


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "evict", help="remove a member at once (admin); --ban keeps its id out",
        description="Remove a member from the registry now. Its agent is told to register "
                    "again; with --ban S, registrations of that id are refused for S "
                    "seconds, so an impostor cannot come straight back.")
    p.add_argument("id", help="member id, as `pdreg status` shows it")
    p.add_argument("--ban", type=float, default=0.0, metavar="S",
                   help="refuse this id's registrations for S seconds (default: no ban)")
    add_admin_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    done = f"evicted, banned for {args.ban:g}s" if args.ban else "evicted"
    return admin_request(args, "evict", "DELETE", f"/v1/members/{args.id}", done,
                         params={"ban": args.ban} if args.ban else None)
