"""Helpers for whatever runs a cluster on loopback: tests, benchmarks and the demo."""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Container

# Linux hands out 32768-60999 to client sockets (and to port-0 binds), and load tests fill
# that range: a port a child process will bind later is chosen below it.
LOW_PORT_RANGE = (20000, 32768)
WAIT_POLL_S = 0.02
# Admission's TTFT SLO for routers in front of torch engines on CPU: those take seconds to
# a first token, and what would merely queue there must not be refused.
CPU_ENGINE_TTFT_SLO_MS = 120_000
_PR_SET_PDEATHSIG = 1


def free_low_port(avoid: Container[int] = frozenset()) -> int:
    """A port below 32768 that nothing on 127.0.0.1 listens on right now."""
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(*LOW_PORT_RANGE)
        if port in avoid:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {LOW_PORT_RANGE} after 1000 tries")


class LowPorts:
    """Ports below 32768, each free when picked and never one this object gave before:
    ports chosen before their processes bind them must not collide with each other."""

    def __init__(self) -> None:
        self.taken: set[int] = set()

    def __call__(self) -> int:
        port = free_low_port(avoid=self.taken)
        self.taken.add(port)
        return port


def wait_until(predicate: Callable[[], object], timeout_s: float,
               poll_s: float = WAIT_POLL_S) -> bool:
    """Poll `predicate` until it is truthy or `timeout_s` passes; whether it became so."""
    deadline = time.monotonic() + timeout_s
    pause = threading.Event()
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        pause.wait(poll_s)


def die_with_parent() -> None:
    """`preexec_fn` for child processes: SIGTERM when the parent dies, however it dies.

    A test killed by its timeout, or a demo killed with -9, leaves no engines behind.
    Linux ties this to the *thread* that started the child: use it only from threads
    that outlive their children (the main thread, a supervisor thread).
    """
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: normal exits and Ctrl-C still stop children


def stop_process(proc: subprocess.Popen, timeout_s: float) -> int:
    """SIGTERM (a pdreg process drains), wait, SIGKILL if it overstays; the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def marked_pids(env_name: str, marker: str) -> list[int]:
    """Every live process (zombies aside) whose environment has `env_name=marker`.

    Give a process tree a marker in its environment and this finds all of it, whatever
    sessions or parents its members moved to: an engine, its workers, a sidecar's helpers.
    """
    needle = f"{env_name}={marker}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                if stat.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X"):
                    continue
            with open(f"/proc/{entry}/environ", "rb") as environ:
                if needle in environ.read().split(b"\0"):
                    pids.append(int(entry))
        except (OSError, IndexError):
            continue  # gone, or not ours to read
    return pids


def kill_marked(env_name: str, marker: str) -> None:
    """SIGKILL every process marked_pids() finds: the last word of a test's cleanup."""
    for pid in marked_pids(env_name, marker):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
