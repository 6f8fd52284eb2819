"""Processes a benchmark starts and measures.

Starting: `registry_process` (a `pdreg registry` child on OS-chosen ports) and
`router_process` (a `pdreg router` child), each from this tree or from another source
tree (`source_tree(commit)` extracts one), so two versions run side by side in one run.

Measuring, from /proc (Linux): CPU seconds of a process (`cpu_s`), of its whole tree
(`tree_cpu_s`, ticks; `tree_run_s`, nanoseconds, for short bursts), of each of its
threads (`thread_cpu_s`), the time its threads waited for a CPU (`runq_s`) and its
resident memory (`rss_bytes`). The machine is shared: `wait_for_quiet` waits, bounded,
for someone else's test run to end.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pdreg.testing import die_with_parent, free_low_port, stop_process

ROOT = Path(__file__).resolve().parent.parent  # the repository
CLK_TCK = os.sysconf("SC_CLK_TCK")
ROUTER_STOP_TIMEOUT_S = 20.0
REGISTRY_STOP_TIMEOUT_S = 10.0
# A router in front of engines on loopback, stopped without waiting for load balancers.
LOCAL_ROUTER_FLAGS: tuple[str, ...] = ("--drain-delay", "0",
                                       "--allow-upstream", "127.0.0.0/8,::1/128")


# --- starting processes -----------------------------------------------------------------


@contextmanager
def registry_process(interval_s: float = 1.0, lease_s: float = 30.0, *,
                     extra: Sequence[str] = (), src: str | Path = ROOT
                     ) -> Iterator[tuple[str, int]]:
    """A `pdreg registry` child (HTTP off unless `extra` says otherwise) from source
    tree `src`, on OS-chosen ports; yields (control address, pid)."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdreg", "--log-level", "WARNING", "registry", "--port", "0",
         "--events-port", "0", "--http-port", "-1", "--heartbeat-interval", str(interval_s),
         "--lease", str(lease_s), *extra],
        stdout=subprocess.PIPE, text=True, cwd=src, env=env, preexec_fn=die_with_parent)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "pdreg registry: control HOST:PORT ..." once bound
        yield line.split("control ")[1].split()[0], proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=REGISTRY_STOP_TIMEOUT_S)


@dataclass
class RouterProcess:
    """A running `pdreg router` child: where clients send requests, and its log."""

    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def cpu_s(self) -> float:
        return tree_cpu_s(self.proc.pid)

    def error_lines(self) -> int:
        return self.log_path.read_text(errors="replace").count(" ERROR ")


@contextmanager
def router_process(registry: str, policy: str, *, flags: Sequence[str] = LOCAL_ROUTER_FLAGS,
                   src: Path = ROOT, log_level: str = "WARNING",
                   log_path: Path | None = None, register: bool = False
                   ) -> Iterator[RouterProcess]:
    """`pdreg router --policy POLICY` from source tree `src`, following `registry`; not
    registered (no planner reads it) unless `register` (routers count each other so:
    admission splits each member's budget among them). Its log goes to `log_path`, else
    to a temporary file removed afterwards: a client that hangs up after [DONE] makes
    the HTTP client log a traceback per request, which would drown the benchmark's own
    output."""
    keep = log_path is not None
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix="pdreg-bench-router-", suffix=".log")
        os.close(fd)
        log_path = Path(name)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdreg", "--log-level", log_level, "router", "--registry",
             registry, "--port", str(free_low_port()), "--policy", policy,
             *([] if register else ["--no-register"]), *flags],
            cwd=src, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent)
    try:
        assert proc.stdout is not None
        url = json.loads(proc.stdout.readline())["url"]  # printed once it listens
        yield RouterProcess(proc, url, log_path)
    finally:
        stop_process(proc, ROUTER_STOP_TIMEOUT_S)
        if not keep:
            log_path.unlink(missing_ok=True)


def source_tree(commit: str) -> str:
    """This repository at `commit`, extracted into a temporary directory (the caller
    removes it: `shutil.rmtree`)."""
    target = tempfile.mkdtemp(prefix="pdreg-baseline-")
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", target], input=archive, check=True)
    return target


def remove_tree(path: str | None) -> None:
    if path:
        shutil.rmtree(path, ignore_errors=True)


# --- measuring processes ----------------------------------------------------------------


def _stat_fields(path: str) -> list[str]:
    """/proc/.../stat after the command name (which may hold spaces): field 3 onwards."""
    with open(path) as f:
        return f.read().rsplit(")", 1)[1].split()


def cpu_s(pid: int) -> float:
    """utime + stime of a process, all its threads, in seconds (10 ms ticks)."""
    fields = _stat_fields(f"/proc/{pid}/stat")
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def tree_cpu_s(pid: int) -> float:
    """utime + stime of a process and all its live descendants, plus what their reaped
    children used (cutime, cstime): routers that fork (mini_lb, uvicorn) are counted
    whole; the Rust routers are one process with many threads."""
    total = 0.0
    pending = [pid]
    while pending:
        current = pending.pop()
        try:
            fields = _stat_fields(f"/proc/{current}/stat")
        except OSError:
            continue  # exited meanwhile
        total += sum(int(fields[i]) for i in (11, 12, 13, 14)) / CLK_TCK
        for task in Path(f"/proc/{current}/task").glob("*/children"):
            try:
                pending += [int(child) for child in task.read_text().split()]
            except OSError:
                continue
    return total


def tree_run_s(pid: int) -> float:
    """Run time of every live thread of a process and its descendants, in seconds, from
    schedstat's nanoseconds: for bursts too short for 10 ms ticks to measure."""
    total_ns = 0
    pending = [pid]
    while pending:
        current = pending.pop()
        for task in Path(f"/proc/{current}/task").glob("*"):
            try:
                total_ns += int((task / "schedstat").read_text().split()[0])
                pending += [int(child) for child in (task / "children").read_text().split()]
            except (OSError, ValueError):
                continue  # exited meanwhile
    return total_ns / 1e9


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds per thread of `pid`, keyed "name/tid" (libzmq names its I/O threads
    ZMQbg/IO/N; Python's show the process name)."""
    out = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                text = f.read()
        except (FileNotFoundError, ProcessLookupError):
            continue
        name = text[text.index("(") + 1:text.rindex(")")]
        fields = text.rsplit(")", 1)[1].split()
        out[f"{name}/{task}"] = (int(fields[11]) + int(fields[12])) / CLK_TCK
    return out


def task_cpu_s(tid: int) -> float:
    """CPU seconds of one thread of this process (a thread's `native_id`)."""
    fields = _stat_fields(f"/proc/self/task/{tid}/stat")
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def runq_s(pid: int) -> float:
    """Seconds the threads of `pid` have waited on a run queue (runnable, no CPU)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[1])
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that ended
    return total / 1e9


def rss_bytes(pid: int | None = None) -> int:
    """Resident memory of `pid` (this process by default)."""
    with open(f"/proc/{pid or 'self'}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def wait_for_quiet(max_load: float, timeout_s: float) -> float:
    """The machine is shared: wait (bounded) until the 1-minute load average is below
    `max_load`, so a run is not measured against someone else's; the load average then."""
    deadline = time.monotonic() + timeout_s
    while os.getloadavg()[0] > max_load and time.monotonic() < deadline:
        time.sleep(5.0)
    return os.getloadavg()[0]
