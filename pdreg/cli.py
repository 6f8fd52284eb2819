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
# Commands that another command's module adds.
ADDED_BY = {"uncordon": "cordon"}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole CLI, or with `only` the subcommands of that one module: each module
    imports its part of pdreg (the router, the registry, torch), so a process that runs
    one command pays for that one alone."""
    parser = argparse.ArgumentParser(
        prog="pdreg", description="Dynamic membership for prefill/decode disaggregated serving.")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    # Not "command": `pdreg agent -- COMMAND ...` uses that name for the engine's argv.
    subparsers = parser.add_subparsers(dest="subcommand", metavar="COMMAND", required=True)
    for name in SUBCOMMANDS if only is None else (only,):
        importlib.import_module(f"pdreg.cmd_{name}").add_parser(subparsers)
    return parser


def subcommand_of(argv: list[str]) -> str | None:
    """The subcommand module ARGV runs, if ARGV names a known command; None for anything
    else (`--help`, a typo), which the whole parser answers."""
    rest = iter(argv)
    for arg in rest:
        if arg == "--log-level":
            next(rest, None)
        elif not arg.startswith("--log-level="):
            return arg if arg in SUBCOMMANDS else ADDED_BY.get(arg)
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(subcommand_of(argv)).parse_args(argv)
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
