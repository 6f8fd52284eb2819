"""The docs say what the code does.

- README.md stays short and opens with the two commands (`make demo`, `make test`),
  both real Makefile targets;
- every relative link in README.md, docs/, bench/README.md and deploy/README.md leads to
  a file (and an `#anchor` to a heading of it);
- every concrete `pdreg ...` command line in their code blocks is accepted by pdreg's
  own parser, and the synopsis of the stable commands (docs/operations.md) names only
  flags those commands have, for every command;
- every flag of every command is documented (README.md or docs/);
- the registry's and router's HTTP endpoints are the ones docs/operations.md lists;
- docs/metrics.md names every metric family a running registry, router, planner and
  reference engine expose, and no pdreg metric they do not.

The processes run from the command line, as documented: the stable interface itself.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from reference_helpers import start_engine

from pdreg.cli import build_parser
from pdreg.testing import die_with_parent, stop_process

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]  # where interfaces are documented
LINKED = [*PAGES, ROOT / "bench" / "README.md", ROOT / "deploy" / "README.md"]
README_MAX_LINES = 300
START_TIMEOUT_S = 30.0
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
ENDPOINT = re.compile(r"`(GET|POST|DELETE) (/[^`?\s]*)")
METRIC = re.compile(r"`((?:pdreg|vllm|sglang)[_:][a-z0-9_:]+)")


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _docs_text() -> str:
    return "\n".join(_text(p) for p in PAGES)


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


# --- the README -------------------------------------------------------------------------


def test_the_readme_is_short_and_opens_with_the_two_commands() -> None:
    text = _text(README)
    assert len(text.splitlines()) <= README_MAX_LINES
    first_block = FENCE.search(text)
    assert first_block is not None
    commands = [line.split("#")[0].strip() for line in first_block.group(1).splitlines()]
    assert commands == ["make demo", "make test"]
    targets = re.findall(r"^([a-z-]+):", _text(ROOT / "Makefile"), re.M)
    assert {"demo", "test"} <= set(targets)


# --- links ------------------------------------------------------------------------------


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation gone, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = FENCE.sub("", _text(path))
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


@pytest.mark.parametrize("page", LINKED, ids=_rel)
def test_every_link_leads_somewhere(page: Path) -> None:
    broken = []
    for target in LINK.findall(FENCE.sub("", _text(page))):
        if re.match(r"^[a-z]+:", target):
            continue  # a URL
        file_part, _, anchor = target.partition("#")
        path = (page.parent / file_part).resolve() if file_part else page
        anchored = not anchor or path.suffix != ".md" or anchor in _anchors(path)
        if not (path.exists() and anchored):
            broken.append(target)
    assert broken == []


# --- command lines and flags -------------------------------------------------------------


def _command_lines(text: str) -> Iterator[tuple[str, list[str]]]:
    """(line, argv after `pdreg`) for each shell line of a code block that runs pdreg
    with a subcommand: backslash continuations joined, comments, `&` and leading
    environment assignments (or a `$ ` prompt) removed."""
    for block in FENCE.findall(text):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            words = line.split(" #")[0].strip().removeprefix("$ ").rstrip("&").split()
            while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
                words.pop(0)
            if (len(words) > 1 and words[0] in ("pdreg", ".venv/bin/pdreg")
                    and words[1] in _subparsers()):
                yield line.strip(), shlex.split(" ".join(words[1:]))


def _is_template(argv: list[str]) -> bool:
    """A synopsis or an elided line: optional parts, alternatives, `...`."""
    return any(w.startswith("[") or "|" in w or "..." in w for w in argv)


def test_every_command_line_in_the_docs_is_accepted_by_pdreg() -> None:
    refused = []
    checked = 0
    for page in LINKED:
        for line, argv in _command_lines(_text(page)):
            if _is_template(argv):
                continue
            checked += 1
            try:
                build_parser().parse_args(argv)
            except SystemExit:
                refused.append(f"{_rel(page)}: {line}")
    assert refused == []
    assert checked >= 10  # the quick start, the sidecar, SGLang's lines, security, deploy


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in build_parser()._actions
                  if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    """A command's long options, its own subcommands' included (`keys generate`)."""
    flags = {option for action in parser._actions if action.help != argparse.SUPPRESS
             for option in action.option_strings if option.startswith("--")} - {"--help"}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                flags |= _flags(sub)
    return flags


def test_every_flag_of_every_command_is_documented() -> None:
    text = _docs_text()
    missing = {name: sorted(flag for flag in _flags(parser)
                            if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text))
               for name, parser in _subparsers().items()}
    assert {k: v for k, v in missing.items() if v} == {}
    assert "--log-level" in text  # the one flag before the command


def _synopsis() -> dict[str, set[str]]:
    """Per command, the flags the synopsis block of docs/operations.md names."""
    text = _text(ROOT / "docs" / "operations.md")
    block = next(b for b in FENCE.findall(text) if b.startswith("pdreg registry"))
    named: dict[str, set[str]] = {}
    command = ""
    for line in block.splitlines():
        if line.startswith("pdreg "):
            command = line.split()[1]
        named.setdefault(command, set()).update(re.findall(r"--[a-z][a-z0-9-]*", line))
    return named


def test_the_synopsis_covers_every_command_with_real_flags() -> None:
    synopsis, parsers = _synopsis(), _subparsers()
    assert set(synopsis) == set(parsers)
    unknown = {name: sorted(flags - _flags(parsers[name])) for name, flags in synopsis.items()}
    assert {k: v for k, v in unknown.items() if v} == {}


# --- running processes: endpoints and metrics --------------------------------------------


def _pdreg(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "pdreg", "--log-level", "WARNING", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            preexec_fn=die_with_parent)


def _ready_url(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    return json.loads(proc.stdout.readline())["url"]


@pytest.fixture(scope="module")
def fleet() -> Iterator[dict[str, str]]:
    """A registry, a router (kv), a planner and a sim reference engine, started as the
    docs say; their HTTP base URLs."""
    procs = []
    try:
        registry = _pdreg("registry", "--port", "0", "--events-port", "0", "--http-port", "0")
        procs.append(registry)
        assert registry.stdout is not None
        line = registry.stdout.readline()  # "pdreg registry: control ADDR ... http URL ..."
        address = line.split("control ")[1].split()[0]
        urls = {"registry": line.split(" http ")[1].split()[0]}
        for name in ("router", "planner"):
            procs.append(_pdreg(name, "--registry", address, "--port", "0", "--no-register"))
            urls[name] = _ready_url(procs[-1])
        engine = start_engine(role="prefill", backend="sim", registry=address)
        urls["engine"] = engine.url
        try:
            yield urls
        finally:
            engine.stop(timeout_s=10)
    finally:
        for proc in procs:
            stop_process(proc, 10)


def test_the_registry_serves_the_documented_endpoints(fleet: dict[str, str]) -> None:
    text = _text(ROOT / "docs" / "operations.md")
    documented = {(m, re.sub(r"\{[^}]*\}", "{}", p))
                  for m, p in ENDPOINT.findall(text.split("## Registry HTTP")[1]
                                               .split("\n## ")[0])}
    spec = httpx.get(fleet["registry"] + "/openapi.json", timeout=10).json()
    served = {(method.upper(), re.sub(r"\{[^}]*\}", "{}", path))
              for path, operations in spec["paths"].items() for method in operations}
    assert httpx.get(fleet["registry"] + "/", timeout=10).status_code == 200  # not in OpenAPI
    assert documented == served | {("GET", "/")}


ROUTER_ENDPOINTS = {"/v1/completions": "POST", "/v1/chat/completions": "POST",
                    "/v1/models": "GET", "/health": "GET", "/ready": "GET", "/metrics": "GET",
                    "/v1/kv": "GET", "/v1/admission": "GET"}


def test_the_router_serves_the_documented_endpoints(fleet: dict[str, str]) -> None:
    section = _text(ROOT / "docs" / "operations.md").split("## Router HTTP")[1].split("\n## ")[0]
    assert set(re.findall(r"`(/[a-z0-9/]+)`", section)) == set(ROUTER_ENDPOINTS)
    for path, method in ROUTER_ENDPOINTS.items():
        # A wrong method answers 405 and an unknown path 404: a route exists when neither.
        answer = httpx.request(method, fleet["router"] + path, timeout=10,
                               json={} if method == "POST" else None)
        assert answer.status_code not in (404, 405), path
    assert httpx.get(fleet["router"] + "/v2/nothing", timeout=10).status_code == 404


def _families(url: str) -> set[str]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return set(re.findall(r"^# TYPE (\S+)", text, re.M))


def test_every_metric_is_documented_and_every_documented_one_exists(
        fleet: dict[str, str]) -> None:
    exposed = set().union(*(_families(url) for url in fleet.values()))
    documented = set(METRIC.findall(_text(ROOT / "docs" / "metrics.md")))
    assert sorted(exposed - documented) == []
    ours = {name for name in documented if name.startswith("pdreg")}
    assert sorted(ours - exposed) == []
