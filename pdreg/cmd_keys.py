"""`pdreg keys generate DIR`: CURVE key files for the registry and its clients."""

from __future__ import annotations

import argparse
import sys

from registry.security import generate_keys

DEFAULT_NAMES = ("registry", "client")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "keys", help="CURVE key files (ZeroMQ encryption and client allow-lists)",
        description="Write CURVE key pairs: NAME.key (public: give it to peers; put client "
                    "ones in the registry's --allowed-clients directory) and "
                    "NAME.key_secret (the pair, mode 0600: the registry's "
                    "--curve-secret-key, a client's --curve-key).")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    generate = actions.add_parser("generate", help="write new key pairs into DIR")
    generate.add_argument("dir", metavar="DIR")
    generate.add_argument("--name", dest="names", action="append", default=None,
                          metavar="NAME", help="one key pair per name, repeatable "
                                               f"(default: {', '.join(DEFAULT_NAMES)})")
    generate.add_argument("--force", action="store_true", help="replace existing key files")
    generate.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    for name in args.names or DEFAULT_NAMES:
        if not name or "/" in name or name.startswith("."):
            print(f"pdreg keys: bad key name {name!r}", file=sys.stderr)
            return 2
        try:
            public, secret = generate_keys(args.dir, name, overwrite=args.force)
        except (FileExistsError, OSError) as exc:
            print(f"pdreg keys: {exc}", file=sys.stderr)
            return 1
        print(f"{name}: {public} (public), {secret} (secret, mode 0600)")
    return 0
