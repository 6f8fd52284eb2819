"""bench_kv's view inside a router process: the CPU each of its threads spent over the
load (/proc, per thread), and with `--profile DIR` py-spy's stacks of every thread
(raw, `--threads`), bucketed into what the `kv` policy adds (tokenizing, keying, the
choice, the feed's decode and index) and what every policy pays (the proxy, the
HTTP server, the membership view).

    .venv/bin/python -m bench.kv_profile bench/out/kv-profile-kv.txt [...]  # a breakdown
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from bench.scale.profile import py_spy

# (bucket, what a frame of the stack contains), the first that any frame matches from the
# innermost out: a tokenizer called from the policy is "tokenize", not "policy".
BUCKETS: tuple[tuple[str, str], ...] = (
    ("kv: tokenize", "router/kv/tokenizer.py"),
    ("kv: block keys", "router/kv/key"),  # keys.py and key_cache.py
    ("kv: event decode", "decode_batch ("),
    ("kv: event apply", "router/kv/index.py"),
    ("kv: feed sockets", "router/kv/feed"),  # feed.py, feed_on_loop.py, feed_on_thread.py
    ("kv: feed sockets", "router/kv/follow.py"),
    ("kv: reporter", "router/kv/reporter.py"),
    ("kv: choice", "router/kv/policy.py"),
    ("kv: feed sockets", "router/kv/sockets.py"),
    ("kv: routing", "router/kv/"),
    ("choice (every policy)", "router/cho"),  # choice.py, choosers.py
    ("pairing (every policy)", "router/pairing.py"),
    ("proxy: upstream HTTP", "router/http/"),
    ("proxy: handshake", "router/handshakes/"),
    ("proxy", "router/proxy"),
    ("admission", "router/admission/"),
    ("HTTP server", "serving/"),
    ("membership view", "registry/"),
    ("metrics", "prometheus_client/"),
    ("event loop", "asyncio/"),
)
# Each stack under its thread; only the thread holding the GIL (what runs Python, and
# what the others wait for); never pausing the router (its CPU is what is measured).
SPY_FLAGS: tuple[str, ...] = ("--threads", "--gil", "--nonblocking")
SPY_RATE = 500
SPY_MAX_S = 3600  # stopped by close() long before
_DUMP_THREAD = re.compile(r'^Thread (?:0x)?([0-9A-Fa-f]+) \([^)]*\): "([^"]*)"', re.M)
_THREAD = re.compile(r"^thread \((?:0x)?([0-9A-Fa-f]+)\): ([^;]*);")


@dataclass
class Breakdown:
    """Samples per (thread name, bucket) of one raw py-spy file."""

    samples: Counter[tuple[str, str]] = field(default_factory=Counter)
    tids: dict[str, str] = field(default_factory=dict)  # tid -> thread name

    @property
    def total(self) -> int:
        return sum(self.samples.values())

    def by_bucket(self) -> Counter[str]:
        out: Counter[str] = Counter()
        for (_, bucket), n in self.samples.items():
            out[bucket] += n
        return out


def bucket(stack: str, thread: str = "") -> str:
    frames = stack.split(";")
    if frames[-1].startswith("Thread.run ("):  # no Python frame above the loop's C code
        return "event loop (uvloop's C: I/O)" if thread == "pdreg-router" else "other"
    for frame in reversed(frames):  # innermost first
        for name, needle in BUCKETS:
            if needle in frame:
                # The index read on the loop is a lookup; written by the feed, an apply.
                return "kv: index lookup" if name == "kv: event apply" \
                    and thread != "kv-feed" else name
    return "other"


def read_profile(path: Path) -> Breakdown:
    out = Breakdown()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        match = _THREAD.match(stack)
        thread = match.group(2) if match else "?"
        if match:
            out.tids[match.group(1)] = thread
        out.samples[(thread, bucket(stack, thread))] += int(count)
    return out


class RouterProbe:
    """Over the windows of a run (`window()`): each router process's CPU per thread
    (schedstat nanoseconds), and with `profile` py-spy's stacks from the first window to
    `close()` (PROFILE/kv-profile-LABEL-N.txt; with --gil, only the thread holding the
    GIL is sampled, so the other routers' windows between add nothing)."""

    def __init__(self, pids: Sequence[int], label: str, profile: Path | None) -> None:
        self.pids, self.label, self.profile = list(pids), label, profile
        self.paths: list[Path] = []
        self._spies: list[subprocess.Popen] = []
        self.cpu: Counter[tuple[int, str]] = Counter()  # (pid, tid) -> seconds
        self.slices: Counter[tuple[int, str]] = Counter()  # (pid, tid) -> times it ran
        self._names: dict[str, str] = {}  # tid -> thread name (a dump's, without py-spy's)

    @contextmanager
    def window(self) -> Iterator[None]:
        if self.profile is not None and not self._spies:
            self._start_spies(self.profile)
        before = [thread_run_s(pid) for pid in self.pids]
        yield
        for pid, b in zip(self.pids, before, strict=True):
            for tid, (seconds, slices) in thread_run_s(pid).items():
                was = b.get(tid, (0.0, 0))
                self.cpu[(pid, tid)] += seconds - was[0]
                self.slices[(pid, tid)] += slices - was[1]

    def _start_spies(self, profile: Path) -> None:
        profile.mkdir(parents=True, exist_ok=True)
        for i, pid in enumerate(self.pids):
            path = profile / f"kv-profile-{_safe(self.label)}-{i}.txt"
            spy = py_spy(pid, SPY_MAX_S, str(path), SPY_FLAGS, rate=SPY_RATE)
            if spy is not None:
                self._spies.append(spy)
                self.paths.append(path)

    def close(self) -> None:
        """Stop py-spy (it writes its stacks on SIGINT); without it, name the threads
        from one py-spy dump of each process (after the load: it pauses them)."""
        if not self._spies:
            for pid in self.pids:
                self._names.update(thread_names(pid))
        for spy in self._spies:
            spy.send_signal(signal.SIGINT)
        for spy in self._spies:
            try:
                spy.wait(timeout=30)
            except subprocess.TimeoutExpired:
                spy.kill()
                spy.wait()
        self._spies = []

    def threads(self) -> dict[str, float]:
        """CPU seconds per thread over the windows, summed over the processes, each named
        as py-spy saw it (else "tid N": ZeroMQ's I/O threads, which run no Python)."""
        return self._by_name(self.cpu)

    def wakes(self) -> dict[str, float]:
        """Times each thread was put on a CPU over the windows (schedstat's timeslices:
        its wakes, plus preemptions): a thread that wakes per KV batch shows it."""
        return self._by_name(self.slices)

    def _by_name(self, per_thread: Counter[tuple[int, str]]) -> dict[str, float]:
        names = dict(self._names)
        for path in self.paths:
            if path.exists():
                names.update(read_profile(path).tids)
        out: Counter[str] = Counter()
        for (_, tid), value in per_thread.items():
            out[names.get(tid, f"tid {tid}")] += value
        return dict(out)


def thread_names(pid: int) -> dict[str, str]:
    """tid -> Python thread name, from `py-spy dump` ({} without py-spy)."""
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    try:
        out = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True,
                             text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return {m.group(1): m.group(2) for m in _DUMP_THREAD.finditer(out)}


def thread_run_s(pid: int) -> dict[str, tuple[float, int]]:
    """Each live thread of `pid`: tid -> (run time in seconds, timeslices), from
    schedstat (nanoseconds; the times it was put on a CPU)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                run_ns, _, slices = f.read().split()[:3]
            out[tid] = (int(run_ns) / 1e9, int(slices))
        except (OSError, ValueError):
            continue  # exited meanwhile
    return out


def _safe(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=+-]", "_", label)


def print_breakdown(path: Path) -> None:
    b = read_profile(path)
    total = b.total or 1
    print(f"{path} ({b.total} samples)")
    threads: Counter[str] = Counter()
    for (thread, _), n in b.samples.items():
        threads[thread] += n
    for thread, n in threads.most_common():
        print(f"  {thread:<24} {n / total:6.1%}")
        for (t, name), m in sorted(b.samples.items(), key=lambda kv: -kv[1]):
            if t == thread and m / total >= 0.005:
                print(f"      {name:<28} {m / total:6.1%}")


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print_breakdown(Path(arg))
    sys.exit(0 if sys.argv[1:] and all(os.path.exists(a) for a in sys.argv[1:]) else 2)
