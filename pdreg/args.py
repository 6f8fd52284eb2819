"""Command-line pieces shared by several subcommands."""

from __future__ import annotations

import argparse

from registry.client import REGISTRY_ENV


def add_registry_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--registry", default=None, metavar="HOST:PORT[,HOST:PORT...]",
                        help=f"registry control address(es) (default ${REGISTRY_ENV} "
                             f"or 127.0.0.1:7600)")


def add_label_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--label", dest="labels", action="append", type=_label, default=[],
                        metavar="KEY=VALUE",
                        help="member label, repeatable (e.g. zone=a, rack=r12)")


def labels_of(args: argparse.Namespace) -> dict[str, str]:
    return dict(args.labels)


def _label(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--label {text!r}: expected KEY=VALUE")
    return key, value
