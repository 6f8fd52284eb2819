"""Peer routers for side-by-side benchmarks: install them, start them on loopback, stop them.

The peers live in their own virtualenv (`.venv-peers`) so the project's test venv stays
lean: sglang-router 0.3.2 (Rust, plus SGLang's Python mini_lb) and vllm-router 0.1.17
(Rust). Every listener they open (HTTP and Prometheus) is bound to 127.0.0.1; without the
host flags both bind 0.0.0.0.

    .venv/bin/python bench/peers.py        # install (once; a stamp file remembers)
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script: `bench` and pdreg's packages
    sys.path.insert(0, str(REPO))

from bench.procs import tree_cpu_s  # noqa: E402
from pdreg.testing import (  # noqa: E402
    die_with_parent,
    free_low_port,
    stop_process,
    wait_until,
)

logger = logging.getLogger(__name__)

PEERS_VENV = REPO / ".venv-peers"
PEER_PACKAGES = ("sglang-router==0.3.2", "vllm-router==0.1.17", "matplotlib")
STAMP = PEERS_VENV / ".peers-installed"
HOST = "127.0.0.1"
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0


def ensure_peers_venv() -> Path:
    """Create `.venv-peers` with the peer routers (and matplotlib for plots), once.

    The stamp file holds the package list, so changing PEER_PACKAGES reinstalls.
    """
    wanted = "\n".join(PEER_PACKAGES)
    if STAMP.exists() and STAMP.read_text() == wanted:
        return PEERS_VENV
    python = PEERS_VENV / "bin" / "python"
    if not python.exists():
        print(f"peers: creating {PEERS_VENV}", flush=True)
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([base, "-m", "venv", str(PEERS_VENV)], check=True)
    print(f"peers: pip install {' '.join(PEER_PACKAGES)} (about 30 s the first time)",
          flush=True)
    subprocess.run([str(python), "-m", "pip", "install", "--progress-bar", "off",
                    *PEER_PACKAGES], check=True)
    STAMP.write_text(wanted)
    print("peers: installed", flush=True)
    return PEERS_VENV


@dataclass
class PeerRouter:
    """A running peer router process; `url` is where clients send requests."""

    name: str
    proc: subprocess.Popen[bytes]
    url: str
    metrics_port: int
    log_path: str
    returncode: int | None = field(default=None)

    def log(self) -> str:
        path = Path(self.log_path)
        return path.read_text(errors="replace") if path.exists() else ""

    def cpu_s(self) -> float:
        return tree_cpu_s(self.proc.pid)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM, then SIGKILL if it overstays; removes the log. Safe twice."""
        if self.returncode is None:
            self.returncode = stop_process(self.proc, timeout_s)
            Path(self.log_path).unlink(missing_ok=True)
        return self.returncode

    def __enter__(self) -> PeerRouter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _start(name: str, argv: Sequence[str], port: int, metrics_port: int) -> PeerRouter:
    """Start a peer (from the main thread: die_with_parent) and wait until it listens."""
    log_fd, log_path = tempfile.mkstemp(prefix=f"pdreg-peer-{name}-", suffix=".log")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
    proc = subprocess.Popen(list(argv), cwd=REPO, stdout=log_fd, stderr=log_fd,
                            stdin=subprocess.DEVNULL, env=env, preexec_fn=die_with_parent)
    os.close(log_fd)
    router = PeerRouter(name=name, proc=proc, url=f"http://{HOST}:{port}",
                        metrics_port=metrics_port, log_path=log_path)

    def listening() -> bool:
        if proc.poll() is not None:
            return True  # reported below
        try:
            httpx.get(router.url + "/health", timeout=2.0)
            return True
        except httpx.HTTPError:
            return False

    if not wait_until(listening, READY_TIMEOUT_S, poll_s=0.1) or proc.poll() is not None:
        tail = router.log()[-3000:]
        router.stop()
        raise RuntimeError(f"{name} did not start listening on {router.url}:\n{tail}")
    return router


def _peer_bin(name: str) -> str:
    return str(ensure_peers_venv() / "bin" / name)


def _listen_args(port: int, metrics_port: int) -> list[str]:
    return ["--host", HOST, "--port", str(port), "--prometheus-host", HOST,
            "--prometheus-port", str(metrics_port)]


def _ports() -> tuple[int, int]:
    port = free_low_port()
    return port, free_low_port(avoid={port})


def start_sglang_router(prefills: Sequence[tuple[str, int]], decodes: Sequence[str],
                        policy: str = "round_robin", mini_lb: bool = False,
                        extra_args: Sequence[str] = ()) -> PeerRouter:
    """sglang-router in PD mode (SGLang bootstrap handshake); `mini_lb` = the Python LB.

    `prefills` are (http URL, bootstrap port) pairs. The workers must answer /health,
    /server_info and /model_info, and report an existing `model_path` (it loads a
    tokenizer from there).
    """
    port, metrics_port = _ports()
    argv = [str(ensure_peers_venv() / "bin" / "python"), "-m", "sglang_router.launch_router",
            "--pd-disaggregation", *_listen_args(port, metrics_port)]
    if mini_lb:
        argv.append("--mini-lb")
    else:
        argv += ["--policy", policy]
    for url, bootstrap_port in prefills:
        argv += ["--prefill", url, str(bootstrap_port)]
    for url in decodes:
        argv += ["--decode", url]
    argv += list(extra_args)
    return _start("mini_lb" if mini_lb else "sglang-router", argv, port, metrics_port)


def start_vllm_router(prefills: Sequence[str], decodes: Sequence[str],
                      policy: str = "round_robin", discovery_address: str = "",
                      extra_args: Sequence[str] = ()) -> PeerRouter:
    """vllm-router in vLLM PD mode (two-stage NIXL handshake).

    `policy` round_robin: its default cache_aware asks every worker to tokenize every
    request. With `discovery_address` (HOST:PORT) engines join by pinging its ZMQ socket.
    """
    port, metrics_port = _ports()
    argv = [_peer_bin("vllm-router"), "--vllm-pd-disaggregation",
            *_listen_args(port, metrics_port), "--policy", policy]
    for url in prefills:
        argv += ["--prefill", url]
    for url in decodes:
        argv += ["--decode", url]
    if discovery_address:
        argv += ["--vllm-discovery-address", discovery_address]
    argv += list(extra_args)
    return _start("vllm-router", argv, port, metrics_port)


def main() -> int:
    logging.basicConfig(level=logging.INFO)
    ensure_peers_venv()
    return 0


if __name__ == "__main__":
    sys.exit(main())
