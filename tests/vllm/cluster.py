"""The processes of `make test-vllm`: registry, vLLM engines under `pdreg agent`, router.

Each process is started from the command line a user would type, with its own log file,
and carries a marker in its environment, so that everything it spawned can be found and
killed at the end, pass or fail. vLLM's engine core and workers rename themselves
(setproctitle), which blanks /proc/PID/environ and hides the marker; they stay in the
process group of vLLM's API server (which `pdreg agent` starts in a session of its own),
so the groups of the marked processes are remembered and killed too. Missing them once
left orphaned engine cores (2.2 GB each) running after a kill -9 of their API server.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx

from pdreg.testing import CPU_ENGINE_TTFT_SLO_MS, die_with_parent, wait_until

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
CHAT_TEMPLATE = HERE / "chat_template.jinja"
# On the vLLM processes' PYTHONPATH only: NIXL's progress thread polls every 10 ms instead
# of spinning, and vLLM's NIXL worker keeps its model thread on the cores given by
# VLLM_CPU_OMP_THREADS_BIND (see nixl_cpu/sitecustomize.py).
NIXL_CPU_DIR = HERE / "nixl_cpu"
NIXL_CPU_MARKERS = ("[pdreg nixl-cpu] progress thread poll delay",
                    "[pdreg nixl-cpu] kept the worker thread's cores")
PDREG = (str(REPO / ".venv" / "bin" / "python"), "-m", "pdreg")
MARKER_ENV = "PDREG_VLLM_CHECK_MARKER"
MODEL_NAME = "tiny"
EXIT_TIMEOUT_S = 20.0
SIDECAR_EXIT_TIMEOUT_S = 90.0
FAILURE_SUMMARY_CHARS = 600  # of the error, repeated on the last line
LOG_TAIL_LINES = 60


def say(message: str) -> None:
    print(f"[test-vllm {time.strftime('%H:%M:%S')}] {message}", flush=True)


class Steps:
    """The step under way, so that a failure can say where it happened."""

    def __init__(self) -> None:
        self.current = "setup"

    def begin(self, name: str) -> None:
        self.current = name
        say(f"== {name}")


def wait_logged(what: str, predicate: Callable[[], object], timeout_s: float,
                progress: Callable[[], str] = lambda: "") -> None:
    """wait_until with a progress line every 10 s; raises AssertionError on timeout."""
    started = time.monotonic()
    deadline = started + timeout_s
    while time.monotonic() < deadline:
        if wait_until(predicate, min(10.0, deadline - time.monotonic())):
            say(f"ok: {what} ({time.monotonic() - started:.1f}s)")
            return
        say(f"waiting for {what} ({time.monotonic() - started:.0f}s) {progress()}")
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


@dataclass
class Proc:
    """One started command: its log, its process, and the marker its children inherit."""

    name: str
    log_path: Path
    marker: str
    process: subprocess.Popen[bytes] | None = None
    groups: set[int] = field(default_factory=set)

    def start(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        full_env = {**(env if env is not None else os.environ), MARKER_ENV: self.marker}
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(argv, env=full_env, stdout=log,
                                            stderr=subprocess.STDOUT, cwd=REPO,
                                            preexec_fn=die_with_parent)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def assert_alive(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            raise AssertionError(f"{self.name} exited with {self.process.returncode}; "
                                 f"see {self.log_path}")

    def stop(self, timeout_s: float = EXIT_TIMEOUT_S) -> int | None:
        """SIGTERM, wait, SIGKILL if it overstays; then kill anything it left behind."""
        self.remember_groups()
        code = None
        if self.process is not None:
            if self.process.poll() is None:
                self.process.send_signal(signal.SIGTERM)
            try:
                code = self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                say(f"{self.name} did not exit within {timeout_s:.0f}s of SIGTERM; killing")
        self.kill_all()
        if self.process is not None:
            code = self.process.wait()
        return code

    def remember_groups(self) -> None:
        """Note the process groups of everything this command runs (see the module doc)."""
        own = os.getpgrp()
        for pid in marked_pids(self.marker):
            with contextlib.suppress(ProcessLookupError):
                group = os.getpgid(pid)
                if group != own:
                    self.groups.add(group)

    def pids(self) -> list[int]:
        """Every live process this command started, renamed or not."""
        return sorted(set(marked_pids(self.marker)) | set(pids_in_groups(self.groups)))

    def kill_all(self) -> None:
        """SIGKILL everything this command started, at once (a lost machine)."""
        self.remember_groups()
        for group in self.groups:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
        for pid in marked_pids(self.marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def marked_pids(marker: str) -> list[int]:
    """Every live process whose environment carries `marker` (not renamed ones)."""
    pids = []
    needle = f"{MARKER_ENV}={marker}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except OSError:
            continue  # gone, or not ours to read
    return pids


def pids_in_groups(groups: set[int]) -> list[int]:
    """Live (not zombie) processes whose process group is one of `groups`."""
    if not groups:
        return []
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) in groups:  # state, pgrp
            pids.append(int(entry.name))
    return pids


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time consumed so far by these processes."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


@dataclass
class Registry:
    """`pdreg registry` on three chosen loopback ports."""

    port: int
    events_port: int
    http_port: int
    proc: Proc

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def start(self, heartbeat_interval_s: float, lease_s: float, extra: list[str]) -> None:
        self.proc.start([*PDREG, "registry", "--host", "127.0.0.1", "--port", str(self.port),
                         "--events-port", str(self.events_port), "--http-port",
                         str(self.http_port), "--heartbeat-interval", str(heartbeat_interval_s),
                         "--lease", str(lease_s), *extra])
        say(f"started registry: pid {self.proc.pid}, "
            f"control {self.address}, HTTP {self.http}, log {self.proc.log_path}")

    def members(self) -> dict[str, dict[str, Any]]:
        try:
            response = httpx.get(f"{self.http}/v1/members", timeout=5)
            response.raise_for_status()
        except httpx.HTTPError:
            return {}
        return {m["id"]: m for m in response.json()}

    def answers(self) -> bool:
        self.proc.assert_alive()
        try:
            return httpx.get(f"{self.http}/v1/members", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False


@dataclass
class Engine:
    """A `vllm serve` under `pdreg agent`, with NIXL (producer for prefill, consumer for
    decode) on its own side-channel port."""

    name: str
    role: str
    port: int
    side_channel_port: int
    omp_bind: str
    proc: Proc

    @property
    def member_id(self) -> str:
        return f"{self.role}-127.0.0.1-{self.port}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, registry: str, vllm_venv: Path, model_dir: Path,
              agent_extra: list[str], vllm_extra: tuple[str, ...] = ()) -> None:
        kv_role = "kv_producer" if self.role == "prefill" else "kv_consumer"
        kv_config = json.dumps({"kv_connector": "NixlConnector", "kv_role": kv_role,
                                "kv_buffer_device": "cpu"})
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
            "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_OMP_THREADS_BIND": self.omp_bind,
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.side_channel_port),
            "UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp,self",
        }
        argv = [
            *PDREG, "agent",
            "--engine", "vllm", "--engine-url", self.url, "--role", self.role,
            "--registry", registry, "--health-interval", "0.5", "--drain-timeout", "60",
            "--kill-grace", "20", "--label", "test=vllm", *agent_extra,
            "--",
            # The NIXL fixes go to vLLM only, not to the sidecar.
            "env", f"PYTHONPATH={NIXL_CPU_DIR}",
            str(vllm_venv / "bin" / "vllm"), "serve", str(model_dir),
            "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
            "--max-model-len", "512", "--served-model-name", MODEL_NAME, "--enforce-eager",
            "-O0", "--kv-transfer-config", kv_config, "--chat-template", str(CHAT_TEMPLATE),
            *vllm_extra,
        ]
        self.proc.start(argv, env)
        say(f"started {self.name}: sidecar pid {self.proc.pid}, vLLM on port {self.port}, "
            f"NIXL side channel {self.side_channel_port}, "
            f"cores {self.omp_bind}, log {self.proc.log_path}")

    @property
    def bound_cores(self) -> list[int]:
        """Where VLLM_CPU_OMP_THREADS_BIND puts the model thread ("nobind": anywhere)."""
        if self.omp_bind == "nobind":
            return sorted(os.sched_getaffinity(0))
        return sorted({int(core) for core in self.omp_bind.split(",")})

    def worker_cores(self) -> list[int]:
        """The cores vLLM's model thread (the worker's main thread) may run on."""
        for pid in self.engine_pids():
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"VLLM::Worker"):
                    return sorted(os.sched_getaffinity(pid))
        return []

    def engine_pids(self) -> list[int]:
        """vLLM's processes (API server, engine core, worker), not the sidecar."""
        self.proc.remember_groups()
        return [pid for pid in self.proc.pids() if pid != self.proc.pid]


@dataclass
class Router:
    port: int
    proc: Proc
    api_key: str = ""
    extra: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def member_id(self) -> str:
        return f"api_server-127.0.0.1-{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def start(self, registry: str, max_attempts: int, extra: list[str],
              env: dict[str, str] | None = None) -> None:
        """`pdreg router`, registered as an api_server member (so the registry shows it).
        vLLM on two CPU cores takes seconds to a first token where a GPU takes
        milliseconds: admission's default 1 s TTFT SLO would refuse what merely queues,
        so the SLO is set for this machine, as an operator sets it for theirs."""
        self.proc.start([*PDREG, "router", "--registry", registry, "--host", "127.0.0.1",
                         "--port", str(self.port), "--max-attempts", str(max_attempts),
                         "--allow-upstream", "127.0.0.0/8,::1/128",
                         "--ttft-slo-ms", str(CPU_ENGINE_TTFT_SLO_MS), *extra], env)
        say(f"started router: pid {self.proc.pid}, "
            f"port {self.port}, log {self.proc.log_path}")

    def lists(self, model: str) -> bool:
        self.proc.assert_alive()
        try:
            response = httpx.get(f"{self.url}/v1/models", headers=self.headers, timeout=5)
        except httpx.HTTPError:
            return False
        return response.status_code == 200 and any(
            m.get("id") == model for m in response.json().get("data", []))

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=10).text


def print_log_tails(workdir: Path) -> None:
    for log in sorted(workdir.glob("*.log")):
        print(f"----- last {LOG_TAIL_LINES} lines of {log} -----", flush=True)
        lines = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        print("\n".join(lines), flush=True)


class StoppableCluster(Protocol):
    def stop(self) -> None: ...


def run_check(description: str, workdir_prefix: str,
              make_cluster: Callable[[Path], StoppableCluster],
              check: Callable[[Steps, Any, Path, Path], None]) -> int:
    """The `main()` of a real-vLLM check script: parse --vllm-venv and --model-dir, run
    `check` on a fresh cluster, and on any failure name the step, show the logs' tails
    and keep the logs (a few hundred kB, and the first thing anyone asks for)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--vllm-venv", type=Path, default=REPO / ".venv-vllm")
    parser.add_argument("--model-dir", type=Path, default=REPO / ".cache" / "vllm-tiny-model")
    args = parser.parse_args()
    if not (args.vllm_venv / "bin" / "vllm").exists():
        say(f"no vLLM at {args.vllm_venv}; run tests/vllm/setup.sh first")
        return 2
    started = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix=workdir_prefix))
    steps = Steps()
    cluster = make_cluster(workdir)
    try:
        check(steps, cluster, args.vllm_venv.resolve(), args.model_dir.resolve())
    except Exception as exc:  # any failure: name the step, show the logs, keep them
        say(f"FAILED at step '{steps.current}': {type(exc).__name__}: {exc}")
        cluster.stop()
        print_log_tails(workdir)
        # Again after the logs' tails: a reader of only the last lines sees why.
        say(f"FAILED at step '{steps.current}' after {time.monotonic() - started:.0f}s "
            f"({type(exc).__name__}: {str(exc)[:FAILURE_SUMMARY_CHARS]}); full logs kept "
            f"in {workdir}")
        return 1
    finally:
        cluster.stop()  # safe twice
    say(f"PASSED in {time.monotonic() - started:.0f}s; logs in {workdir}")
    return 0
