"""Processes and waiting for `make test-sglang`: real SGLang servers, each under `pdreg
agent` or bare, and `pdreg router`, on loopback, with every process findable by a marker.

Each process tree gets its own marker in its environment (pdreg.testing.marked_pids).
SGLang's scheduler and detokenizer retitle themselves ("sglang::scheduler"), and
setproctitle writes the title over their environment, so the marker alone does not find
them: a tree is the marked processes plus every member of a session one of them leads (a
sidecar starts its engine in a session of its own; the plain server is started so too).
Logs go to one file per process in the work folder.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pdreg.testing import (
    CPU_ENGINE_TTFT_SLO_MS,
    die_with_parent,
    kill_marked,
    marked_pids,
    wait_until,
)

REPO = Path(__file__).resolve().parents[2]
PDREG = [str(REPO / ".venv" / "bin" / "python"), "-m", "pdreg"]
CHAT_TEMPLATE = Path(__file__).resolve().parent / "chat_template.jinja"
MARKER_ENV = "PDREG_SGLANG_CHECK_MARKER"
MODEL_NAME = "tiny"
EXIT_TIMEOUT_S = 60.0
PROGRESS_EVERY_S = 10.0


def say(message: str) -> None:
    print(f"[test-sglang {time.strftime('%H:%M:%S')}] {message}", flush=True)


class Steps:
    """The step under way, so that a failure can say where it happened."""

    def __init__(self) -> None:
        self.current = "setup"
        self.started = time.monotonic()

    def begin(self, name: str) -> None:
        self.current = name
        say(f"== {name} (t={time.monotonic() - self.started:.0f}s)")


def wait_logged(what: str, predicate: Callable[[], object], timeout_s: float,
                progress: Callable[[], str] = lambda: "") -> None:
    """wait_until with a progress line every 10 s; AssertionError on timeout."""
    started = time.monotonic()
    deadline = started + timeout_s
    while time.monotonic() < deadline:
        if wait_until(predicate, min(PROGRESS_EVERY_S, deadline - time.monotonic()), 0.1):
            say(f"ok: {what} ({time.monotonic() - started:.1f}s)")
            return
        say(f"waiting for {what} ({time.monotonic() - started:.0f}s) {progress()}")
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def sglang_env(omp_bind: str) -> dict[str, str]:
    """The environment of one SGLang server on CPU (docs/engines.md §4): CPU engine, loopback for
    its internal addresses, offline, one OpenMP thread pinned to core `omp_bind`."""
    return {"SGLANG_USE_CPU_ENGINE": "1", "SGLANG_HOST_IP": "127.0.0.1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "SGLANG_CPU_OMP_THREADS_BIND": omp_bind, "PYTHONWARNINGS": "ignore"}


def sglang_command(python: Path, model_dir: Path, port: int, role: str,
                   bootstrap_port: int = 0, extra: Sequence[str] = ()) -> list[str]:
    """`python -m sglang.launch_server` for `role` prefill | decode | plain, plus `extra`."""
    argv = [str(python), "-m", "sglang.launch_server", "--model-path", str(model_dir),
            "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
            "--enable-metrics",
            # CPU only (see tests/sglang/setup.sh): device, dtype, a KV pool size (the OMP
            # binding makes it mandatory), no overlap scheduler (it needs CUDA streams).
            "--device", "cpu", "--dtype", "float32", "--max-total-tokens", "4096",
            "--disable-overlap-schedule",
            # The tiny model's tokenizer has no chat template.
            "--chat-template", str(CHAT_TEMPLATE)]
    if role == "prefill":
        argv += ["--disaggregation-mode", "prefill",
                 "--disaggregation-transfer-backend", "mooncake_tcp",
                 "--disaggregation-bootstrap-port", str(bootstrap_port)]
    elif role == "decode":
        argv += ["--disaggregation-mode", "decode",
                 "--disaggregation-transfer-backend", "mooncake_tcp",
                 "--disaggregation-decode-retraction-backup", "cpu_tensor"]
    return [*argv, *extra]


@dataclass
class Proc:
    """One process tree we started: its marker, its log, its Popen."""

    name: str
    log_path: Path
    marker: str = field(default_factory=lambda: uuid.uuid4().hex)
    process: subprocess.Popen[bytes] | None = None
    sessions: set[int] = field(default_factory=set)  # sessions led by our processes

    def start(self, argv: list[str], env: dict[str, str] | None = None,
              new_session: bool = False) -> None:
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                argv, env={**os.environ, **(env or {}), MARKER_ENV: self.marker},
                stdout=log, stderr=subprocess.STDOUT, cwd=REPO, preexec_fn=die_with_parent,
                start_new_session=new_session)

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def tree(self) -> set[int]:
        """Live processes of this tree other than the one we started (see module doc).
        Sessions are remembered, so a session's members are found after its leader died."""
        marked = set(marked_pids(MARKER_ENV, self.marker))
        for pid in marked:
            stat = proc_stat(pid)
            if stat is not None and stat.session == pid:
                self.sessions.add(pid)
        return (marked | session_members(self.sessions)) - {self.pid}

    def assert_alive(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            raise AssertionError(f"{self.name} exited with {self.process.returncode}; "
                                 f"see {self.log_path}")

    def stop(self, timeout_s: float = EXIT_TIMEOUT_S) -> int | None:
        """SIGTERM, wait, then SIGKILL the whole tree; the exit code if it exited."""
        code = None
        if self.alive():
            assert self.process is not None
            self.process.send_signal(signal.SIGTERM)
            try:
                code = self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                say(f"{self.name} did not exit on SIGTERM within {timeout_s:.0f}s; killing")
        for pid in self.tree():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        kill_marked(MARKER_ENV, self.marker)
        return code


@dataclass
class Engine(Proc):
    """A real SGLang server, under `pdreg agent` (role prefill/decode) or bare (plain)."""

    role: str = "plain"
    port: int = 0
    bootstrap_port: int = 0
    omp_bind: str = "0"
    extra: tuple[str, ...] = ()  # more SGLang flags (--kv-events-config)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def member_id(self) -> str:
        return f"{self.role}-127.0.0.1-{self.port}"

    def launch(self, sglang_python: Path, model_dir: Path, registry: str) -> None:
        command = sglang_command(sglang_python, model_dir, self.port, self.role,
                                 self.bootstrap_port, self.extra)
        if self.role == "plain":
            self.start(command, sglang_env(self.omp_bind), new_session=True)
            say(f"started plain SGLang {self.name}: port {self.port}, log {self.log_path}")
            return
        # No --bootstrap-port and no --model: the sidecar reads both from /server_info.
        sidecar = [*PDREG, "agent", "--engine", "sglang", "--engine-url", self.url,
                   "--role", self.role, "--registry", registry, "--health-interval", "0.5",
                   "--drain-timeout", "60", "--kill-grace", "20", "--label", "test=sglang"]
        self.start([*sidecar, "--", *command], sglang_env(self.omp_bind))
        say(f"started {self.name}: sidecar pid {self.pid}, SGLang port {self.port}"
            + (f", bootstrap {self.bootstrap_port}" if self.bootstrap_port else "")
            + f", log {self.log_path}")

    def server_pid(self) -> int | None:
        """The SGLang server process the sidecar launched (its session's leader). By its
        command line too: the sidecar's lifeline is also a child leading a session, and
        killing it instead of the server would leave the engine serving."""
        for pid in self.tree():
            stat = proc_stat(pid)
            if stat is not None and stat.ppid == self.pid and stat.session == pid \
                    and process_names({pid}) == ["python -m sglang.launch_server"]:
                return pid
        return None

    def scheduler_pids(self) -> list[int]:
        """The scheduler processes of this engine (one per TP rank), by their title."""
        return [pid for pid in sorted(self.tree())
                if any(name.startswith("sglang::scheduler") for name in process_names({pid}))]

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Stop this engine's schedulers (SIGSTOP) for the block, then let them go on.

        A tiny model's prefill ends within milliseconds, between any two looks at it.
        With its scheduler stopped, a request that reaches the server provably stays
        there, prompt not computed and KV not sent: the HTTP server still takes requests,
        answers /ready and serves /metrics, whose open-POST gauge counts it live."""
        schedulers = self.scheduler_pids()
        assert schedulers, f"no sglang::scheduler process under {self.name}"
        for pid in schedulers:
            os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            for pid in schedulers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)

    def healthy(self) -> bool:
        self.assert_alive()
        try:
            return httpx.get(f"{self.url}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False


@dataclass(frozen=True)
class ProcStat:
    state: str
    ppid: int
    group: int
    session: int


def proc_stat(pid: int) -> ProcStat | None:
    """A process's state, parent, group and session from /proc; None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return ProcStat(fields[0].decode(), int(fields[1]), int(fields[2]), int(fields[3]))


def session_members(sessions: set[int]) -> set[int]:
    """Live (not zombie) processes in any of these sessions."""
    if not sessions:
        return set()
    members = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = proc_stat(int(entry))
            if stat is not None and stat.session in sessions and stat.state not in "ZX":
                members.add(int(entry))
    return members


def start_router(router: Proc, registry: str, port: int, policy: str = "round_robin",
                 register: bool = True) -> None:
    """`pdreg router`: by default round robin, so that both prefills take turns, and
    registered as an api_server member. SGLang on two CPU cores takes seconds to a first
    token where a GPU takes milliseconds: admission's default 1 s TTFT SLO would refuse
    what merely queues, so the SLO is set for this machine, as an operator sets it."""
    router.start([*PDREG, "router", "--registry", registry, "--host", "127.0.0.1",
                  "--port", str(port), "--policy", policy, "--max-attempts", "3",
                  "--allow-upstream", "127.0.0.0/8,::1/128",
                  "--ttft-slo-ms", str(CPU_ENGINE_TTFT_SLO_MS),
                  *([] if register else ["--no-register"])])
    say(f"started {router.name} ({policy}): pid {router.pid}, port {port}, "
        f"log {router.log_path}")


def process_names(pids: set[int]) -> list[str]:
    """What these processes call themselves (SGLang retitles its children
    "sglang::scheduler" and so on, in their command line)."""
    names = []
    for pid in sorted(pids):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        name = argv[0].decode(errors="replace")
        if len(argv) > 2 and argv[1] == b"-m":
            name += f" -m {argv[2].decode(errors='replace')}"
        names.append(name.rsplit("/", 1)[-1])
    return names
