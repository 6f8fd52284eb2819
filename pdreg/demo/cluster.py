"""Start and stop the demo's processes on loopback: a registry, a router, engines.

Each child runs in its own session (so a terminal's Ctrl-C reaches only the demo, which
then stops children in order) and with a parent-death signal (so even a SIGKILLed demo
leaves no orphans). stdout is read by a thread that waits for the child's ready line;
stdout and stderr both go to a log file per process under one temporary directory.

Security is on as docs/security.md says to run a fleet (`DemoSecurity`): CURVE keys from
`pdreg keys generate` with an allow-list, a fleet token and an admin token. The registry
reads them from files (`--token-file`, `--curve-secret-key`), engines and the router
from the environment (`PDREG_TOKEN`, `PDREG_CURVE_KEY`, ...), as Kubernetes Secrets
would give them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from pdreg.args import ADMIN_TOKEN, CURVE_KEY_ENV, REGISTRY_PUBLIC_KEY_ENV, TOKEN
from pdreg.testing import die_with_parent, free_low_port
from registry.security import ClientCurve, generate_keys
from router.guard import LOOPBACK_ALLOW

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 120.0  # torch import on a loaded 2-core machine is slow
STOP_TIMEOUT_S = 30.0  # engines drain on SIGTERM before they exit
KILL_WAIT_S = 5.0

ReadyParser = Callable[[str], dict[str, Any] | None]


class PortAllocator:
    """Free loopback ports below 32768, never the same one twice in this process."""

    def __init__(self) -> None:
        self._given: set[int] = set()
        self._lock = threading.Lock()

    def take(self) -> int:
        with self._lock:
            port = free_low_port(avoid=self._given)
            self._given.add(port)
            return port




def json_ready_line(line: str) -> dict[str, Any] | None:
    """The `{"event": "ready", ...}` line engines and the router print once serving."""
    if not line.startswith("{"):
        return None
    try:
        message = json.loads(line)
    except ValueError:
        return None
    return message if isinstance(message, dict) and message.get("event") == "ready" else None


def registry_ready_line(line: str) -> dict[str, Any] | None:
    """`pdreg registry: control HOST:PORT ...` is printed once every socket is bound."""
    return {"line": line} if line.startswith("pdreg registry: control") else None


@dataclass
class ManagedProcess:
    """One child process: its ready message, its log, and how to stop it."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    ready_parser: ReadyParser
    ready: dict[str, Any] = field(default_factory=dict)
    started_at: float = field(default_factory=time.monotonic)
    _ready_event: threading.Event = field(default_factory=threading.Event)
    _reader: threading.Thread | None = None

    def start_reader(self, log: IO[bytes]) -> None:
        self._reader = threading.Thread(target=self._read_stdout, args=(log,),
                                        name=f"demo-stdout-{self.name}", daemon=True)
        self._reader.start()

    def _read_stdout(self, log: IO[bytes]) -> None:
        assert self.proc.stdout is not None
        with log:
            for raw in self.proc.stdout:
                log.write(raw)
                log.flush()
                if not self._ready_event.is_set():
                    message = self.ready_parser(raw.decode(errors="replace").strip())
                    if message is not None:
                        self.ready = message
                        self._ready_event.set()
        self._ready_event.set()  # exited: wake the waiter, who sees no ready message

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> dict[str, Any]:
        if not self._ready_event.wait(timeout_s):
            raise TimeoutError(f"{self.name} not ready within {timeout_s:.0f}s; "
                               f"log: {self.log_path}\n{self.log_tail()}")
        if not self.ready:
            raise RuntimeError(f"{self.name} exited with {self.proc.wait()} before it was "
                               f"ready; log: {self.log_path}\n{self.log_tail()}")
        return self.ready

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def terminate(self) -> None:
        """SIGTERM: engines drain, the router and registry close cleanly."""
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL to the whole process group: a crash, nothing said to anyone."""
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    def wait(self, timeout_s: float) -> int | None:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM, wait, SIGKILL if it overstays. Returns the exit code. Safe twice."""
        if self.alive:
            self.terminate()
            if self.wait(timeout_s) is None:
                logger.warning("[demo] %s did not exit within %.0fs of SIGTERM; killing",
                               self.name, timeout_s)
                self.kill()
        code = self.proc.wait(KILL_WAIT_S)
        if self._reader is not None:
            self._reader.join(KILL_WAIT_S)
        return code

    def _signal(self, signum: int) -> None:
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signum)


@dataclass(frozen=True, slots=True)
class RegistryPorts:
    control: int
    events: int
    http: int


class DemoSecurity:
    """Keys and tokens for one demo cluster, in a private directory under its logs."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        keys = directory / "keys"
        generate_keys(keys, "registry")
        generate_keys(keys, "client")
        self.allowed = keys / "allowed"
        self.allowed.mkdir(mode=0o700)
        shutil.copy(keys / "client.key", self.allowed / "client.key")
        self.registry_secret_key = keys / "registry.key_secret"
        self.registry_public_key = keys / "registry.key"
        self.client_key = keys / "client.key_secret"
        self.token_file = self._secret_file("fleet-token")
        self.admin_token_file = self._secret_file("admin-token")
        self.curve = ClientCurve.from_files(self.registry_public_key, self.client_key)

    def _secret_file(self, name: str) -> Path:
        path = self.directory / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(24) + "\n")
        return path

    def registry_args(self) -> list[str]:
        return ["--curve-secret-key", str(self.registry_secret_key),
                "--allowed-clients", str(self.allowed),
                f"--{TOKEN.flag}-file", str(self.token_file),
                f"--{ADMIN_TOKEN.flag}-file", str(self.admin_token_file)]

    def client_env(self) -> dict[str, str]:
        """What an engine or a router gets: the fleet token and CURVE keys, no admin."""
        return {TOKEN.env: self.token_file.read_text().strip(),
                REGISTRY_PUBLIC_KEY_ENV: str(self.registry_public_key),
                CURVE_KEY_ENV: str(self.client_key)}

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token_file.read_text().strip()}"}

    def summary(self) -> str:
        return (f"CURVE on (1 allowed client key), fleet token, admin token "
                f"(keys and tokens in {self.directory})")


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    backend: str = "torch"  # reference engine backend: torch | sim
    model: str = "tiny"
    heartbeat_interval_s: float = 0.5
    lease_s: float = 2.0
    engine_args: tuple[str, ...] = ()  # extra `pdreg engine` flags (e.g. sim delays)
    drain_timeout_s: float = 20.0
    # A prefill holds KV until a decode pulls it; KV meant for a killed decode is never
    # pulled, and a draining prefill waits for it. Short here: demo requests take ms.
    kv_lease_s: float = 5.0
    # The router's TTFT SLO: a request that would wait past it gets a 503. The reference
    # engine computes on a CPU, seconds a prompt on a busy laptop; the demo shows members
    # coming and going without a failed request, not overload shedding (1 s by default).
    ttft_slo_ms: float = 30_000.0
    log_level: str = "INFO"
    secure: bool = True  # CURVE, a fleet token and an admin token (DemoSecurity)


class Cluster:
    """Every process the demo starts, and the one place that stops them all."""

    def __init__(self, config: ClusterConfig, log_dir: Path | None = None,
                 ports: PortAllocator | None = None) -> None:
        self.config = config
        self._own_log_dir = log_dir is None
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix="pdreg-demo-"))
        self.ports = ports or PortAllocator()
        self.registry_ports = RegistryPorts(self.ports.take(), self.ports.take(),
                                            self.ports.take())
        self.registry: ManagedProcess | None = None
        self.router: ManagedProcess | None = None
        self.engines: dict[str, ManagedProcess] = {}  # member id -> process
        self._retired: list[ManagedProcess] = []
        self._counter = 0
        self.security = DemoSecurity(self.log_dir / "secrets") if config.secure else None

    # --- addresses ---------------------------------------------------------------------

    @property
    def registry_address(self) -> str:
        return f"127.0.0.1:{self.registry_ports.control}"

    @property
    def registry_url(self) -> str:
        return f"http://127.0.0.1:{self.registry_ports.http}"

    @property
    def router_url(self) -> str:
        return self.router.ready["url"] if self.router is not None else ""

    @property
    def client_curve(self) -> ClientCurve | None:
        """For in-process clients of the registry (status tables)."""
        return self.security.curve if self.security is not None else None

    @property
    def admin_headers(self) -> dict[str, str]:
        return self.security.admin_headers if self.security is not None else {}

    def security_summary(self) -> str:
        return self.security.summary() if self.security is not None else "off"

    # --- starting ----------------------------------------------------------------------

    def _spawn(self, name: str, args: Sequence[str], ready_parser: ReadyParser,
               env_extra: dict[str, str] | None = None) -> ManagedProcess:
        self._counter += 1
        log_path = self.log_dir / f"{self._counter:02d}-{name}.log"
        log = open(log_path, "ab")  # noqa: SIM115 (the reader thread closes it)
        cmd = [sys.executable, "-m", "pdreg", "--log-level", self.config.log_level, *args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log,
                                stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                                preexec_fn=die_with_parent)
        managed = ManagedProcess(name=name, proc=proc, log_path=log_path,
                                 ready_parser=ready_parser)
        managed.start_reader(log)
        logger.info("[demo] started %s pid=%d log=%s", name, proc.pid, log_path)
        return managed

    def start_registry(self) -> ManagedProcess:
        """The registry on fixed ports, so a restarted one is found at the same address."""
        ports = self.registry_ports
        self.registry = self._spawn("registry", [
            "registry", "--host", "127.0.0.1", "--port", str(ports.control),
            "--events-port", str(ports.events), "--http-port", str(ports.http),
            "--heartbeat-interval", str(self.config.heartbeat_interval_s),
            "--lease", str(self.config.lease_s),
            *(self.security.registry_args() if self.security else [])], registry_ready_line)
        self.registry.wait_ready()
        return self.registry

    def restart_registry(self) -> ManagedProcess:
        if self.registry is not None:
            self.registry.stop()
            self._retired.append(self.registry)
        return self.start_registry()

    def start_router(self) -> ManagedProcess:
        self.router = self._spawn("router", [
            "router", "--registry", self.registry_address, "--host", "127.0.0.1",
            "--port", str(self.ports.take()), "--allow-upstream", LOOPBACK_ALLOW,
            "--ttft-slo-ms", str(self.config.ttft_slo_ms)],
            json_ready_line, self._client_env())
        self.router.wait_ready()
        return self.router

    def spawn_engine(self, role: str) -> ManagedProcess:
        """Start one engine (not waiting); `wait_engine` registers it by member id."""
        port = self.ports.take()
        args = ["engine", "--role", role, "--registry", self.registry_address,
                "--host", "127.0.0.1", "--port", str(port), "--backend", self.config.backend,
                "--model", self.config.model,
                "--drain-timeout", str(self.config.drain_timeout_s),
                "--kv-lease", str(self.config.kv_lease_s)]
        if role == "prefill":
            args += ["--kv-port", str(self.ports.take()),
                     "--bootstrap-port", str(self.ports.take())]
        args += list(self.config.engine_args)
        return self._spawn(f"{role}-{port}", args, json_ready_line, self._client_env())

    def _client_env(self) -> dict[str, str]:
        return self.security.client_env() if self.security is not None else {}

    def wait_engine(self, managed: ManagedProcess) -> str:
        member_id = str(managed.wait_ready()["id"])
        self.engines[member_id] = managed
        return member_id

    def start_engines(self, roles: Sequence[str]) -> list[str]:
        """Start several engines at once (their slow start-ups overlap); their member ids."""
        spawned = [self.spawn_engine(role) for role in roles]
        try:
            return [self.wait_engine(m) for m in spawned]
        except BaseException:
            for managed in spawned:
                if managed not in self.engines.values():
                    managed.stop(KILL_WAIT_S)
            raise

    def engine_ids(self, role: str) -> list[str]:
        """Live engines of a role, oldest first."""
        return [member_id for member_id, m in self.engines.items()
                if m.alive and member_id.startswith(f"{role}-")]

    def retire(self, member_id: str) -> ManagedProcess:
        managed = self.engines.pop(member_id)
        self._retired.append(managed)
        return managed

    # --- stopping ----------------------------------------------------------------------

    def stop_all(self) -> None:
        """Engines first (they drain and say bye), then the router, then the registry."""
        engines = list(self.engines.values()) + [m for m in self._retired if m.alive]
        for managed in engines:
            managed.terminate()
        for managed in engines:
            managed.stop()
        for managed in (self.router, self.registry):
            if managed is not None:
                managed.stop()
        self.engines.clear()

    def remove_logs(self) -> None:
        if self._own_log_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def processes(self) -> list[ManagedProcess]:
        every = [*self.engines.values(), *self._retired, self.router, self.registry]
        return [m for m in every if m is not None]
