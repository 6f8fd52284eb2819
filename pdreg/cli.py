"""The `pdreg` command: the composition root that wires registry, engine agent and router."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print("pdreg: subcommands land with the registry core", file=sys.stderr)
    return 2
