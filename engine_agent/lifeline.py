"""The engine's lifeline: its process group ends when the sidecar does, however it ends.

`pdreg agent -- CMD` starts the engine in a session of its own (so that a terminal's
Ctrl-C reaches only the sidecar, which drains first). The price: when the sidecar itself
is killed (kill -9, the OOM killer), nothing stops the engine, and an engine such as
SGLang leaves its scheduler processes behind even when its own main process dies. So the
sidecar starts one more, tiny process beside the engine:

    python -m engine_agent.lifeline --group PGID --grace S --fd N

It blocks reading the pipe on fd N, whose only writer is the sidecar. The sidecar writes
one byte when it has dealt with the engine itself (stopped it, or seen it exit); then the
lifeline just exits. End of file without that byte means the sidecar is gone without a
word: the lifeline sends SIGTERM to the engine's whole process group, SIGKILL after
`grace` seconds if anything is left, and exits. A pipe (not the parent-death signal)
because end of file cannot be missed: a sidecar that died before the lifeline started
reading still closes its end, and no thread in the sidecar has to outlive anything.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

__all__ = ["Lifeline", "end_group", "main"]

logger = logging.getLogger(__name__)

DONE = b"d"  # the sidecar has dealt with the engine: nothing to do
POLL_S = 0.1  # how often the lifeline looks whether the group is gone during the grace


@dataclass
class Lifeline:
    """The sidecar's end: start() beside the engine, release() once the engine is dealt
    with. If the sidecar dies first, its end of the pipe closes and the lifeline acts."""

    group: int
    grace_s: float
    process: subprocess.Popen[bytes] | None = None
    _write_fd: int = -1

    def start(self) -> Lifeline:
        read_fd, self._write_fd = os.pipe()  # neither end is inherited by the engine
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "engine_agent.lifeline", "--group", str(self.group),
                 "--grace", str(self.grace_s), "--fd", str(read_fd)],
                pass_fds=(read_fd,), stdin=subprocess.DEVNULL,
                start_new_session=True)  # a terminal's Ctrl-C must not reach it either
        finally:
            os.close(read_fd)
        return self

    def release(self) -> None:
        """The engine is stopped or gone: let the lifeline exit without acting. Safe twice."""
        if self._write_fd < 0:
            return
        with contextlib.suppress(OSError):  # the lifeline is gone already
            os.write(self._write_fd, DONE)
        os.close(self._write_fd)
        self._write_fd = -1
        if self.process is not None:
            try:
                self.process.wait(5.0)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _group_alive(group: int) -> bool:
    """Whether any process of the group still runs. Zombies do not count: an orphan's
    zombie may wait long for a reaper (the sidecar as a container's PID 1 never reaps
    it), and it holds nothing."""
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        entries = os.listdir("/proc")
    except OSError:
        return True  # no /proc: the group answered, count it alive
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        # After the command name: state, ppid, pgrp, ...
        if int(fields[2]) == group and fields[0] not in (b"Z", b"X"):
            return True
    return False


def end_group(group: int, grace_s: float) -> bool:
    """SIGTERM the process group, SIGKILL whatever is left after grace_s; whether SIGKILL
    was needed. A group that is gone already is fine (returns False)."""
    try:
        os.killpg(group, signal.SIGTERM)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False  # not ours (the id was reused by someone else's group)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not _group_alive(group):
            return False
        time.sleep(POLL_S)
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="end an engine's process group when its "
                                                 "sidecar dies (started by pdreg agent)")
    parser.add_argument("--group", type=int, required=True)
    parser.add_argument("--grace", type=float, required=True)
    parser.add_argument("--fd", type=int, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[lifeline %(asctime)s] %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    with os.fdopen(args.fd, "rb", buffering=0) as pipe:
        try:
            word = pipe.read(1)
        except OSError:
            word = b""
    if word == DONE:
        return 0
    logger.warning("pdreg agent is gone without stopping its engine: ending process "
                   "group %d (SIGTERM, SIGKILL after %.0fs)", args.group, args.grace)
    if end_group(args.group, args.grace):
        logger.warning("process group %d ignored SIGTERM; killed", args.group)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
