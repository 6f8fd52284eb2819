"""Real-engine check: two `vllm serve` (prefill + decode, NixlConnector on CPU), each
under `pdreg agent`, against a real registry, behind `pdreg router`. Run by
`make test-vllm` after setup.sh.

    .venv/bin/python tests/vllm/check_vllm_sidecar.py [--vllm-venv .venv-vllm]
        [--model-dir .cache/vllm-tiny-model]

Asserts, in this order: both members READY with the right role, model, protocol and NIXL
side channel; load figures that move while completions run; a `pdreg router` (registered
as an api_server member) serves the model with output token-identical to a single vLLM
instance while the KV travels from P to D (routing_checks.py); SIGTERM on the decode's
sidecar drains it (DRAINING while requests run), it leaves /v1/members and its vLLM
processes exit. Every process it starts carries a marker in its environment, and all of
them are killed at the end, pass or fail. On failure it names the step that failed,
prints the tail of every log and keeps the logs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import routing_checks  # tests/vllm/, beside this script

from pdreg.testing import die_with_parent, free_low_port, wait_until
from registry.server import RegistryConfig, RegistryServer

REPO = Path(__file__).resolve().parents[2]
CHAT_TEMPLATE = Path(__file__).resolve().parent / "chat_template.jinja"

STARTUP_TIMEOUT_S = 300.0  # vLLM takes ~50-85 s to become healthy here; two at once
STEP_TIMEOUT_S = 60.0
SIDECAR_EXIT_TIMEOUT_S = 90.0
ROUTER_STARTUP_TIMEOUT_S = 60.0
ROUTER_EXIT_TIMEOUT_S = 20.0
LOG_TAIL_LINES = 60
DRAIN_REQUESTS = 6
ROUTER_MAX_ATTEMPTS = 3  # pairs the router tries per request (its --max-attempts)
HEARTBEAT_INTERVAL_S = 0.5
MARKER_ENV = "PDREG_VLLM_CHECK_MARKER"
MODEL_NAME = "tiny"
LONG_COMPLETION = {"model": MODEL_NAME, "prompt": "The registry keeps", "max_tokens": 400,
                   "ignore_eos": True, "temperature": 0.0}


def say(message: str) -> None:
    print(f"[test-vllm {time.strftime('%H:%M:%S')}] {message}", flush=True)


class Steps:
    """The step under way, so that a failure can say where it happened."""

    def __init__(self) -> None:
        self.current = "setup"

    def begin(self, name: str) -> None:
        self.current = name
        say(f"== {name}")


@dataclass
class Engine:
    role: str
    port: int
    side_channel_port: int
    marker: str
    log_path: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def member_id(self) -> str:
        return f"{self.role}-127.0.0.1-{self.port}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def start_engine(engine: Engine, registry: str, vllm_venv: Path, model_dir: Path,
                 omp_bind: str) -> None:
    kv_role = "kv_producer" if engine.role == "prefill" else "kv_consumer"
    kv_config = json.dumps({"kv_connector": "NixlConnector", "kv_role": kv_role,
                            "kv_buffer_device": "cpu"})
    env = {
        **os.environ,
        MARKER_ENV: engine.marker,
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
        "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_OMP_THREADS_BIND": omp_bind,
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(engine.side_channel_port),
        "UCX_NET_DEVICES": "lo", "UCX_TLS": "tcp,self",
    }
    argv = [
        str(REPO / ".venv" / "bin" / "python"), "-m", "pdreg", "agent",
        "--engine", "vllm", "--engine-url", engine.url, "--role", engine.role,
        "--registry", registry, "--health-interval", "0.5", "--drain-timeout", "60",
        "--kill-grace", "20", "--label", "test=vllm",
        "--",
        str(vllm_venv / "bin" / "vllm"), "serve", str(model_dir),
        "--host", "127.0.0.1", "--port", str(engine.port), "--dtype", "float32",
        "--max-model-len", "512", "--served-model-name", MODEL_NAME, "--enforce-eager",
        "-O0", "--kv-transfer-config", kv_config, "--chat-template", str(CHAT_TEMPLATE),
    ]
    with engine.log_path.open("wb") as log:
        engine.process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          cwd=REPO, preexec_fn=die_with_parent)
    say(f"started {engine.role}: sidecar pid {engine.process.pid}, vLLM on port "
        f"{engine.port}, NIXL side channel {engine.side_channel_port}, log {engine.log_path}")


def marked_pids(marker: str) -> list[int]:
    """Every live process whose environment carries `marker` (sidecar, vLLM, workers)."""
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


def kill_marked(marker: str) -> None:
    for pid in marked_pids(marker):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def members(registry_http: str) -> dict[str, dict[str, Any]]:
    try:
        response = httpx.get(f"{registry_http}/v1/members", timeout=5)
        response.raise_for_status()
    except httpx.HTTPError:
        return {}
    return {m["id"]: m for m in response.json()}


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


def fire_completions(url: str, count: int,
                     outcomes: list[str] | None = None) -> list[threading.Thread]:
    """`count` long completions at once, each in a thread; each appends "ok", its HTTP
    status or its error to `outcomes`."""
    def one() -> None:
        try:
            response = httpx.post(f"{url}/v1/completions", json=LONG_COMPLETION, timeout=120)
            outcome = "ok" if response.status_code == 200 else f"HTTP {response.status_code}"
        except httpx.HTTPError as exc:
            outcome = repr(exc)
            say(f"completion to {url} ended: {outcome}")
        if outcomes is not None:
            outcomes.append(outcome)

    threads = [threading.Thread(target=one, daemon=True) for _ in range(count)]
    for thread in threads:
        thread.start()
    return threads


@dataclass
class Router:
    port: int
    log_path: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def member_id(self) -> str:
        return f"api_server-127.0.0.1-{self.port}"


def start_router(router: Router, registry: str) -> None:
    """`pdreg router`, registered as an api_server member (so the registry shows it too)."""
    argv = [str(REPO / ".venv" / "bin" / "python"), "-m", "pdreg", "router",
            "--registry", registry, "--host", "127.0.0.1", "--port", str(router.port),
            "--max-attempts", str(ROUTER_MAX_ATTEMPTS)]
    with router.log_path.open("wb") as log:
        router.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                          preexec_fn=die_with_parent)
    say(f"started router: pid {router.process.pid}, port {router.port}, log {router.log_path}")


def stop_router(router: Router) -> None:
    process = router.process
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(ROUTER_EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        say("router did not exit on SIGTERM; killing")
        process.kill()
        process.wait()


def router_lists(router: Router, model: str) -> bool:
    if router.process is not None and router.process.poll() is not None:
        raise AssertionError(f"router exited with {router.process.returncode}; "
                             f"see {router.log_path}")
    try:
        response = httpx.get(f"{router.url}/v1/models", timeout=5)
    except httpx.HTTPError:
        return False
    return response.status_code == 200 and any(
        m.get("id") == model for m in response.json().get("data", []))


def check_routing(steps: Steps, registry_http: str, registry_address: str, prefill: Engine,
                  decode: Engine, router: Router) -> None:
    """Requests through `pdreg router` against the same requests served by one instance."""
    steps.begin("registry shows prefill and decode routable")
    routable = members(registry_http)
    for engine in (prefill, decode):
        assert routable.get(engine.member_id, {}).get("routable") is True, (
            f"{engine.role} not routable in the registry: {routable.get(engine.member_id)}")
    say("ok: both routable")

    steps.begin("start pdreg router")
    start_router(router, registry_address)
    wait_logged("router lists the model in /v1/models", lambda: router_lists(router, MODEL_NAME),
                ROUTER_STARTUP_TIMEOUT_S)
    wait_logged("router registered as a READY api_server member", lambda: members(
        registry_http).get(router.member_id, {}).get("state") == "ready", STEP_TIMEOUT_S)

    steps.begin("router /v1/models through the openai client")
    routing_checks.check_models(router.url, MODEL_NAME)
    say("ok: /v1/models lists the model")

    steps.begin("routed completions and chat = single instance; KV pulled by the decode")
    transit = routing_checks.check_routed_outputs(router.url, prefill.url, decode.url,
                                                  MODEL_NAME, say)

    steps.begin("router metrics: both members picked, no retries")
    routing_checks.check_router_picks(router.url, prefill.member_id, decode.member_id,
                                      transit, ROUTER_MAX_ATTEMPTS)
    say("ok: router picked both, retried nothing")


def check(steps: Steps, registry_http: str, registry_address: str, vllm_venv: Path,
          model_dir: Path, workdir: Path) -> None:
    prefill = Engine("prefill", free_low_port(), free_low_port(), uuid.uuid4().hex,
                     workdir / "prefill.log")
    decode = Engine("decode", free_low_port(), free_low_port(), uuid.uuid4().hex,
                    workdir / "decode.log")
    router = Router(free_low_port(), workdir / "router.log")
    try:
        steps.begin("start prefill and decode vLLM under pdreg agent, wait for READY")
        start_engine(prefill, registry_address, vllm_venv, model_dir, omp_bind="0")
        start_engine(decode, registry_address, vllm_venv, model_dir, omp_bind="1")

        def both_ready() -> bool:
            view = members(registry_http)
            return all(view.get(e.member_id, {}).get("state") == "ready"
                       for e in (prefill, decode))

        def states() -> str:
            view = members(registry_http)
            return ", ".join(f"{e.role}={view.get(e.member_id, {}).get('state', 'absent')}"
                             for e in (prefill, decode))

        def sidecars_alive() -> None:
            for e in (prefill, decode):
                assert e.process is not None
                if e.process.poll() is not None:
                    raise AssertionError(f"{e.role} sidecar exited with "
                                         f"{e.process.returncode}; see {e.log_path}")

        def ready_or_dead() -> bool:
            sidecars_alive()
            return both_ready()

        wait_logged("both members READY", ready_or_dead, STARTUP_TIMEOUT_S, states)
        steps.begin("registration: role, model, protocol, endpoints, labels")
        view = members(registry_http)
        for engine in (prefill, decode):
            m = view[engine.member_id]
            say(f"{engine.role}: " + json.dumps({k: m[k] for k in (
                "role", "model", "state", "protocol", "endpoints", "load")}))
            assert m["role"] == engine.role, m
            assert m["model"] == MODEL_NAME, m
            assert m["protocol"] == "vllm-nixl", m
            assert m["endpoints"]["http"] == engine.url, m
            assert m["endpoints"]["kv_host"] == "127.0.0.1", m
            assert m["endpoints"]["kv_port"] == engine.side_channel_port, m
            assert m["labels"] == {"test": "vllm"}, m

        steps.begin("load figures move while completions run")
        threads = fire_completions(prefill.url, 6) + fire_completions(decode.url, 6)

        def load_of(engine: Engine) -> dict[str, Any]:
            return members(registry_http).get(engine.member_id, {}).get(
                "load", {"running": 0, "waiting": 0})

        def busy(engine: Engine) -> Callable[[], bool]:
            return lambda: load_of(engine)["running"] > 0

        wait_logged("prefill reports running > 0", busy(prefill), STEP_TIMEOUT_S)
        wait_logged("decode reports running > 0", busy(decode), STEP_TIMEOUT_S)
        for thread in threads:
            thread.join(STEP_TIMEOUT_S)
        wait_logged("load back to 0", lambda: all(
            members(registry_http)[e.member_id]["load"]["running"] == 0
            for e in (prefill, decode)), STEP_TIMEOUT_S)

        check_routing(steps, registry_http, registry_address, prefill, decode, router)

        # SIGTERM the decode's sidecar while it serves: DRAINING, then gone, and every
        # request it held at SIGTERM answered in full.
        steps.begin("drain the decode with SIGTERM while it serves")
        # Idle first, so that "busy" below is these requests and not a stale report of the
        # routed ones; and all of them in the engine (running or waiting) before SIGTERM,
        # because the sidecar can only wait for requests vLLM's scheduler counts.
        wait_logged("decode reports idle", lambda: load_of(decode)["running"] == 0,
                    STEP_TIMEOUT_S)
        drain_outcomes: list[str] = []
        threads = fire_completions(decode.url, DRAIN_REQUESTS, drain_outcomes)
        wait_logged(f"decode holds all {DRAIN_REQUESTS} requests", lambda: load_of(
            decode)["running"] + load_of(decode)["waiting"] >= DRAIN_REQUESTS, STEP_TIMEOUT_S)
        assert decode.process is not None
        decode.process.send_signal(signal.SIGTERM)
        say("sent SIGTERM to the decode's sidecar")
        wait_logged("decode DRAINING", lambda: members(registry_http).get(
            decode.member_id, {}).get("state") == "draining", STEP_TIMEOUT_S)
        wait_logged("decode gone from /v1/members",
                    lambda: decode.member_id not in members(registry_http),
                    SIDECAR_EXIT_TIMEOUT_S)
        code = decode.process.wait(SIDECAR_EXIT_TIMEOUT_S)
        assert code == 0, f"decode sidecar exit code {code}"
        wait_logged("decode's vLLM processes exited",
                    lambda: not marked_pids(decode.marker), STEP_TIMEOUT_S)
        for thread in threads:
            thread.join(STEP_TIMEOUT_S)
        assert drain_outcomes == ["ok"] * DRAIN_REQUESTS, (
            f"requests held by the decode at SIGTERM ended {drain_outcomes}; drain should "
            f"have let all {DRAIN_REQUESTS} finish")
        say(f"ok: all {DRAIN_REQUESTS} requests held at SIGTERM finished")
        assert members(registry_http)[prefill.member_id]["state"] == "ready"
        say("prefill still READY")
    finally:
        say("stopping router, decode, prefill")
        stop_router(router)
        for engine in (decode, prefill):
            if engine.process is not None and engine.process.poll() is None:
                engine.process.send_signal(signal.SIGTERM)
        for engine in (decode, prefill):
            if engine.process is not None:
                try:
                    engine.process.wait(SIDECAR_EXIT_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    say(f"{engine.role} sidecar did not exit; killing")
            kill_marked(engine.marker)


class DropLoopLag(logging.Filter):
    """The in-process registry shares two cores with two vLLMs: its loop runs late all the
    time and warns on every tick. That is expected here and drowns the progress lines."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("[registry] loop lag")


def setup_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[%(name)s %(asctime)s] %(levelname)s %(message)s",
                                           "%H:%M:%S"))
    handler.addFilter(DropLoopLag())
    logging.basicConfig(level=logging.WARNING, handlers=[handler])


def print_log_tails(workdir: Path) -> None:
    for log in sorted(workdir.glob("*.log")):
        print(f"----- last {LOG_TAIL_LINES} lines of {log} -----", flush=True)
        lines = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        print("\n".join(lines), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-venv", type=Path, default=REPO / ".venv-vllm")
    parser.add_argument("--model-dir", type=Path, default=REPO / ".cache" / "vllm-tiny-model")
    args = parser.parse_args()
    setup_logging()
    if not (args.vllm_venv / "bin" / "vllm").exists():
        say(f"no vLLM at {args.vllm_venv}; run tests/vllm/setup.sh first")
        return 2
    started = time.monotonic()
    server = RegistryServer(RegistryConfig(
        host="127.0.0.1", port=0, events_port=0, http_port=0,
        heartbeat_interval_s=HEARTBEAT_INTERVAL_S, lease_s=5.0)).start()
    say(f"registry at {server.control_address}, HTTP {server.http_url}")
    # Kept, pass or fail: a few hundred kB, and the first thing anyone asks for.
    workdir = Path(tempfile.mkdtemp(prefix="pdreg-vllm-"))
    steps = Steps()
    try:
        check(steps, server.http_url, server.control_address, args.vllm_venv.resolve(),
              args.model_dir.resolve(), workdir)
    except Exception as exc:  # any failure: name the step, show the logs, keep them
        say(f"FAILED at step '{steps.current}': {type(exc).__name__}: {exc}")
        print_log_tails(workdir)
        say(f"FAILED at step '{steps.current}' after {time.monotonic() - started:.0f}s; "
            f"full logs kept in {workdir}")
        return 1
    finally:
        server.close()
    say(f"PASSED in {time.monotonic() - started:.0f}s; logs in {workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
