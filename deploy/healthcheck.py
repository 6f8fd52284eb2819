"""The pdreg image's HEALTHCHECK: ask the pdreg process in this container whether it is alive.

One image runs the registry, the router, the reference engine and the sidecar, each with
its own ports. So this finds the container's pdreg process, reads its command line with
pdreg's own parser, and asks the endpoint that process serves for liveness:

    registry  GET :HTTP_PORT/healthz   (503 once its loop has stalled)
    router    GET :PORT/health         (liveness; /ready is readiness and fails on drain)
    engine    GET :PORT/health
    agent     no HTTP: healthy while it runs (it exits when its engine dies)

usage: pdreg-healthcheck [PID]      (default: the one pdreg process in this container)
Exit status 0 = healthy, 1 = not (Docker's contract); the reason goes to stdout, which
`docker inspect` shows.
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

TIMEOUT_S = 3.0
ENTRYPOINT = "pdreg"

# Where each subcommand answers liveness: (path, the parsed flag that holds its port).
LIVENESS = {"registry": ("/healthz", "http_port"), "router": ("/health", "port"),
            "engine": ("/health", "port")}


def pdreg_argv(cmdline: list[str]) -> list[str] | None:
    """pdreg's own arguments from a process command line, or None if it is not pdreg.

    Matches `pdreg ARGS`, `python /usr/local/bin/pdreg ARGS` and `python -m pdreg ARGS`.
    """
    for i, arg in enumerate(cmdline):
        if Path(arg).name == ENTRYPOINT:
            return cmdline[i + 1:]
        if arg == "-m" and cmdline[i + 1:i + 2] == [ENTRYPOINT]:
            return cmdline[i + 2:]
    return None


def read_cmdline(pid: int) -> list[str]:
    raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def find_pdreg_process() -> tuple[int, list[str]]:
    """The container's pdreg process (the oldest, if a pdreg process started others)."""
    for entry in sorted(Path("/proc").iterdir(), key=lambda p: int(p.name)
                        if p.name.isdigit() else sys.maxsize):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = pdreg_argv(read_cmdline(int(entry.name)))
        except OSError:
            continue  # exited meanwhile, or not ours to read
        if argv:
            return int(entry.name), argv
    raise LookupError("no pdreg process in this container")


def liveness_url(argv: list[str]) -> str | None:
    """The URL that says whether the process with pdreg arguments ARGV is alive; None
    for a process without HTTP."""
    # the real parser: the flags mean what pdreg says
    from pdreg.cli import build_parser, subcommand_of

    args = build_parser(subcommand_of(argv)).parse_args(argv)
    if args.subcommand not in LIVENESS:
        return None
    path, port_flag = LIVENESS[args.subcommand]
    return f"http://127.0.0.1:{getattr(args, port_flag)}{path}"


def check(pid: int | None = None) -> tuple[bool, str]:
    """(healthy, why) for the pdreg process PID (default: the container's)."""
    try:
        if pid is None:
            pid, argv = find_pdreg_process()
        else:
            argv = pdreg_argv(read_cmdline(pid)) or []
    except (LookupError, OSError) as exc:
        return False, str(exc)
    try:
        url = liveness_url(argv)
    except SystemExit:
        return False, f"pid {pid}: cannot parse `pdreg {' '.join(argv)}`"
    if url is None:
        return True, f"pid {pid} ({argv[0] if argv else '?'}) runs and serves no HTTP"
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            return True, f"{url}: {response.status}"
    except urllib.error.HTTPError as exc:
        return False, f"{url}: {exc.code}"
    except OSError as exc:
        return False, f"{url}: {exc}"


def main() -> int:
    parser = argparse.ArgumentParser(prog="pdreg-healthcheck", description=__doc__.split("\n")[0])
    parser.add_argument("pid", nargs="?", type=int, default=None)
    healthy, why = check(parser.parse_args().pid)
    print(why)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
