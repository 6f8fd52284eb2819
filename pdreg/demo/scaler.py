"""Holding a local cluster at a number of prefills and decodes, and what that costs.

`Scaler` is what a planner's `--exec` hook drives on one machine: `set(role, n)` starts
engines (not waiting: they register as joining, then ready) or stops the newest ones
(SIGTERM: they drain and say bye). A thread applies requests and notices engines that
became ready or exited. Engine-seconds are counted from each process's start to its
exit, the figure a GPU bill follows.

The planner reaches the scaler through a file: its hook appends `MODEL ROLE N` lines
(`hook_command` builds that hook, a plain `sh -c`), and the scaler's thread reads them.
"""

from __future__ import annotations

import dataclasses
import logging
import shlex
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pdreg.demo.cluster import Cluster, ClusterConfig, ManagedProcess, json_ready_line

__all__ = ["RoleArgsCluster", "ScaleEvent", "Scaler", "hook_command", "start_planner"]

logger = logging.getLogger(__name__)

POLL_S = 0.05
ROLES = ("prefill", "decode")


class RoleArgsCluster(Cluster):
    """A `Cluster` whose prefills and decodes get extra flags of their own (a prefill's
    --max-running differs from a decode's). Engines are spawned from one thread."""

    def __init__(self, config: ClusterConfig, role_args: dict[str, tuple[str, ...]],
                 log_dir: Path | None = None) -> None:
        super().__init__(config, log_dir)
        self.role_args = role_args

    def spawn_engine(self, role: str) -> ManagedProcess:
        base = self.config
        self.config = dataclasses.replace(
            base, engine_args=(*base.engine_args, *self.role_args.get(role, ())))
        try:
            return super().spawn_engine(role)
        finally:
            self.config = base


@dataclass(frozen=True, slots=True)
class ScaleEvent:
    at: float  # monotonic
    role: str
    what: str  # "asked", "ready", "stopping", "exited", "failed"
    detail: str
    serving: tuple[int, int]  # ready prefills, ready decodes after the event


def hook_command(requests_file: Path) -> str:
    """The --exec value that appends `MODEL ROLE N` to `requests_file` (atomic: one
    short write with O_APPEND)."""
    script = f'printf "%s %s %s\\n" "$1" "$2" "$3" >> {shlex.quote(str(requests_file))}'
    return f"sh -c {shlex.quote(script)} scale"


def start_planner(cluster: Cluster, planner_args: Sequence[str],
                  requests_file: Path) -> ManagedProcess:
    """`pdreg planner` on the cluster's registry, its hook appending to `requests_file`,
    with the cluster's client credentials; returns once it serves."""
    requests_file.touch()
    env = cluster.security.client_env() if cluster.security is not None else {}
    # Cluster starts engines, routers and registries; _spawn is how it starts any pdreg.
    planner = cluster._spawn("planner", [
        "planner", "--registry", cluster.registry_address, "--port",
        str(cluster.ports.take()), *planner_args, "--exec", hook_command(requests_file)],
        json_ready_line, env)
    planner.wait_ready()
    return planner


class Scaler:
    def __init__(self, cluster: Cluster, requests_file: Path | None = None,
                 on_event: Callable[[ScaleEvent], None] = lambda e: None) -> None:
        self.cluster = cluster
        self.requests_file = requests_file
        self.on_event = on_event
        self.events: list[ScaleEvent] = []
        self._targets: dict[str, int] = {}
        self._starting: dict[str, list[ManagedProcess]] = {r: [] for r in ROLES}
        self._stopping: list[tuple[str, ManagedProcess]] = []
        self._lives: list[tuple[float, float | None]] = []  # per engine: start, exit
        self._lives_of: dict[int, int] = {}  # pid -> index in _lives
        self._lock = threading.Lock()
        self._offset = 0
        self._serving = (0, 0)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- control (any thread) -----------------------------------------------------------

    def start(self) -> Scaler:
        self._thread = threading.Thread(target=self._run, name="demo-scaler", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the thread (engines stay: the cluster stops them). Safe twice."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self._account_exits(time.monotonic())

    def set(self, role: str, count: int) -> None:
        if role not in ROLES or count < 0:
            raise ValueError(f"cannot scale {role!r} to {count}")
        with self._lock:
            self._targets[role] = count

    def serving(self) -> tuple[int, int]:
        """Ready prefills and decodes, as of the scaler's last step."""
        return self._serving

    def engine_seconds(self, since: float = 0.0, until: float | None = None) -> float:
        """Seconds engines were alive within [since, until] (default: until now)."""
        end = time.monotonic() if until is None else until
        with self._lock:
            lives = list(self._lives)
        return sum(max(0.0, min(end, stop if stop is not None else end) - max(since, start))
                   for start, stop in lives)

    # --- the scaler's thread ------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self._read_requests()
                self._step()
                self._serving = self._count_ready()
            except Exception:  # the demo must go on; the log says what broke
                logger.exception("[scaler] step failed")

    def _read_requests(self) -> None:
        if self.requests_file is None or not self.requests_file.exists():
            return
        with self.requests_file.open("rb") as f:
            f.seek(self._offset)
            data = f.read()
        complete = data[:data.rfind(b"\n") + 1]
        self._offset += len(complete)
        for line in complete.decode(errors="replace").splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[1] in ROLES and parts[2].isdigit():
                self.set(parts[1], int(parts[2]))
                self._event(parts[1], "asked", f"planner asked for {parts[2]}")
            else:
                logger.warning("[scaler] ignored request %r", line)

    def _step(self) -> None:
        now = time.monotonic()
        for role in ROLES:
            for managed in list(self._starting[role]):
                if managed.ready:
                    self._starting[role].remove(managed)
                    member_id = self.cluster.wait_engine(managed)
                    self._event(role, "ready", member_id)
                elif not managed.alive:
                    self._starting[role].remove(managed)
                    self._event(role, "failed", f"exited before ready; log {managed.log_path}")
        self._account_exits(now)
        with self._lock:
            targets = dict(self._targets)
        for role, target in targets.items():
            ready, starting = len(self.cluster.engine_ids(role)), len(self._starting[role])
            for _ in range(target - ready - starting):
                managed = self.cluster.spawn_engine(role)
                self._starting[role].append(managed)
                self.track(managed)
            surplus = ready + starting - target
            while surplus > 0 and self._starting[role]:
                managed = self._starting[role].pop()  # not serving yet: cheapest to drop
                managed.terminate()
                self._stopping.append((role, managed))
                self._event(role, "stopping", f"{managed.name} (still starting)")
                surplus -= 1
            for member_id in self.cluster.engine_ids(role)[::-1][:max(0, surplus)]:
                managed = self.cluster.retire(member_id)
                managed.terminate()  # drains: in-flight requests finish
                self._stopping.append((role, managed))
                self._event(role, "stopping", member_id)

    def _account_exits(self, now: float) -> None:
        for role, managed in list(self._stopping):
            if not managed.alive:
                self._stopping.remove((role, managed))
                self._ended(managed, now)
                self._event(role, "exited", managed.name)
        for managed in self.cluster.processes():
            if not managed.alive:
                self._ended(managed, now)

    def _count_ready(self) -> tuple[int, int]:
        prefill, decode = self.cluster.engine_ids("prefill"), self.cluster.engine_ids("decode")
        return len(prefill), len(decode)

    def _ended(self, managed: ManagedProcess, now: float) -> None:
        with self._lock:
            index = self._lives_of.get(managed.pid)
            if index is not None and self._lives[index][1] is None:
                self._lives[index] = (self._lives[index][0], now)

    def track(self, managed: ManagedProcess) -> None:
        """Count the engine-seconds of an engine started outside the scaler (before
        `start`)."""
        with self._lock:
            self._lives_of[managed.pid] = len(self._lives)
            self._lives.append((managed.started_at, None))
        self._serving = self._count_ready()

    def _event(self, role: str, what: str, detail: str) -> None:
        self._serving = self._count_ready()
        event = ScaleEvent(time.monotonic(), role, what, detail, self._serving)
        self.events.append(event)
        self.on_event(event)
