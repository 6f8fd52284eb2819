"""The `pdreg` command line: each command builds only its own module's parser, and that
parser is the whole CLI's for it."""

from __future__ import annotations

import argparse

import pytest

from pdreg.cli import build_parser, subcommand_of


def commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_command_parses_alone_as_in_the_whole_cli() -> None:
    whole = commands(build_parser())
    assert {"registry", "status", "router", "engine", "uncordon"} <= set(whole)
    for name, parser in whole.items():
        module = subcommand_of([name])
        assert module is not None, name
        alone = commands(build_parser(module))
        assert name in alone, (name, module)
        flags = sorted(s for a in parser._actions for s in a.option_strings)
        assert sorted(s for a in alone[name]._actions for s in a.option_strings) == flags


@pytest.mark.parametrize(("argv", "module"), [
    (["status", "--json"], "status"),
    (["--log-level", "DEBUG", "drain", "x"], "drain"),
    (["--log-level=DEBUG", "uncordon", "x"], "cordon"),
    (["--help"], None),
    (["statsu"], None),
    ([], None),
])
def test_the_command_is_found_before_its_flags(argv: list[str], module: str | None) -> None:
    assert subcommand_of(argv) == module


def test_a_typo_is_answered_by_the_whole_cli(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser(subcommand_of(["statsu"])).parse_args(["statsu"])
    assert exited.value.code == 2
    assert "choose from" in capsys.readouterr().err
