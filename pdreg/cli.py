"""The `pdreg` command: the composition root that wires registry, engine agent and router.

Each subcommand lives in its own module `pdreg/cmd_<name>.py` exposing
`add_parser(subparsers) -> None`; the parser it adds sets `func(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# Order is the order `pdreg --help` lists them.
SUBCOMMANDS = ("registry", "status", "drain", "evict", "cordon", "engine", "agent", "router",
               "demo", "keys", "planner", "plan")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdreg", description="Dynamic membership for prefill/decode disaggregated serving.")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    # Not "command": `pdreg agent -- COMMAND ...` uses that name for the engine's argv.
    subparsers = parser.add_subparsers(dest="subcommand", metavar="COMMAND", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(f"pdreg.cmd_{name}").add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # One line per HTTP request is noise in a CLI; their warnings still show.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.root.level))
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
