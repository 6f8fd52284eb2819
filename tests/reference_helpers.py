"""Start reference engines as real subprocesses, and drive the two P/D handshakes.

Reusable by any test (router, demo):

    with start_engine(role="prefill", backend="sim") as p, start_engine(role="decode") as d:
        out = vllm_pd(p.url, d.url, {"prompt": "hi", "max_tokens": 8})

`start_engine(registry=None)` runs with --no-register; pass a registry control address
to have the engine register itself. Each engine prints one JSON "ready" line on stdout;
the handle carries what it says (url, kv_port, bootstrap_port, member id).
"""

from __future__ import annotations

import json
import os
import random
import selectors
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pdreg.testing import stop_process

REPO_ROOT = Path(__file__).resolve().parent.parent
ENGINE_READY_TIMEOUT_S = 90.0  # torch import on a loaded 2-core machine can take a while
ENGINE_STOP_TIMEOUT_S = 30.0
HTTP_TIMEOUT_S = 60.0


@dataclass
class EngineHandle:
    proc: subprocess.Popen[bytes]
    url: str
    kv_port: int
    bootstrap_port: int
    id: str
    engine_id: str
    log_path: str
    returncode: int | None = field(default=None)
    kv_events: str = ""  # the KV events PUB endpoint (with --kv-events), else ""
    kv_events_replay: str = ""

    @property
    def host(self) -> str:
        return self.url.split("//", 1)[1].rsplit(":", 1)[0]

    def log(self) -> str:
        """The engine's stderr so far (deleted by stop())."""
        path = Path(self.log_path)
        return path.read_text(errors="replace") if path.exists() else ""


    def stop(self, timeout_s: float = ENGINE_STOP_TIMEOUT_S) -> int:
        """SIGTERM (drain), wait, SIGKILL if it overstays; returns the exit code. Safe twice."""
        if self.returncode is None:
            self.returncode = stop_process(self.proc, timeout_s)
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            Path(self.log_path).unlink(missing_ok=True)
        return self.returncode

    def __enter__(self) -> EngineHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_engine(role: str = "mixed", backend: str = "sim", protocol: str = "vllm-nixl",
                 model: str = "tiny", registry: str | None = None,
                 extra_args: Sequence[str] = (),
                 timeout_s: float = ENGINE_READY_TIMEOUT_S,
                 src: Path = REPO_ROOT) -> EngineHandle:
    """Start `pdreg engine` and wait for its ready line. The caller must stop() it.
    `src`: the pdreg source tree to run it from (benchmarks compare versions)."""
    log_fd, log_path = tempfile.mkstemp(prefix=f"pdreg-engine-{role}-", suffix=".log")
    cmd = [sys.executable, "-m", "pdreg", "engine", "--role", role, "--backend", backend,
           "--protocol", protocol, "--model", model, "--host", "127.0.0.1", "--port", "0"]
    cmd += ["--registry", registry] if registry else ["--no-register"]
    cmd += list(extra_args)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=src, stdout=subprocess.PIPE, stderr=log_fd,
                            stdin=subprocess.DEVNULL, env=env)
    os.close(log_fd)
    try:
        ready = _read_ready_line(proc, timeout_s)
    except BaseException as exc:
        proc.kill()
        proc.wait()
        tail = Path(log_path).read_text(errors="replace")[-2000:]
        Path(log_path).unlink(missing_ok=True)
        raise RuntimeError(f"engine {role}/{backend} failed to start: {exc}\n{tail}") from exc
    return EngineHandle(proc=proc, url=ready["url"], kv_port=ready["kv_port"],
                        bootstrap_port=ready["bootstrap_port"], id=ready["id"],
                        engine_id=ready["engine_id"], log_path=log_path,
                        kv_events=ready.get("kv_events", ""),
                        kv_events_replay=ready.get("kv_events_replay", ""))


def start_engines(specs: Sequence[dict[str, Any]]) -> list[EngineHandle]:
    """Start several engines at once (torch import overlaps); all or none."""
    with ThreadPoolExecutor(len(specs)) as pool:
        futures = [pool.submit(start_engine, **spec) for spec in specs]
        handles, errors = [], []
        for future in futures:
            try:
                handles.append(future.result())
            except Exception as exc:
                errors.append(exc)
    if errors:
        stop_all(handles)
        raise errors[0]
    return handles


def stop_all(handles: Sequence[EngineHandle]) -> list[int]:
    """Stop several engines at once (each drains in parallel); their exit codes."""
    if not handles:
        return []
    with ThreadPoolExecutor(len(handles)) as pool:
        return list(pool.map(lambda handle: handle.stop(), handles))


def _read_ready_line(proc: subprocess.Popen[bytes], timeout_s: float) -> dict[str, Any]:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    buffer = b""
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"engine not ready within {timeout_s:.0f}s")
            if not selector.select(remaining):
                continue
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError(f"engine exited with {proc.wait()} before it was ready")
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                try:
                    message = json.loads(line)
                except ValueError:
                    continue
                if isinstance(message, dict) and message.get("event") == "ready":
                    return message


# --- Driving the handshakes exactly as a router would ------------------------------------


def _post(client: httpx.Client, url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return client.post(url + path, json=body, timeout=HTTP_TIMEOUT_S)


def read_sse(response: httpx.Response) -> list[dict[str, Any]]:
    """The JSON chunks of an SSE body; asserts it ends with `data: [DONE]`."""
    events = [line[len("data: "):] for line in response.text.splitlines()
              if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", f"stream did not end with [DONE]: {events[-3:]}"
    return [json.loads(e) for e in events[:-1]]


def collect(response: httpx.Response, stream: bool) -> tuple[list[int], str]:
    """(token ids, text) of a completion or chat response, streamed or not."""
    if response.status_code != 200:
        raise AssertionError(f"HTTP {response.status_code}: {response.text}")
    if not stream:
        choice = response.json()["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        return choice["token_ids"], text
    ids: list[int] = []
    text = ""
    for chunk in read_sse(response):
        for choice in chunk["choices"]:
            ids += choice.get("token_ids") or []
            text += choice["delta"].get("content", "") if "delta" in choice else choice["text"]
    return ids, text


def vllm_pd(client: httpx.Client, prefill_url: str, decode_url: str, body: dict[str, Any],
            path: str = "/v1/completions") -> httpx.Response:
    """vLLM's two-stage NIXL handshake: P with max_tokens=1, then D with P's params."""
    prefill_body = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None}}
    prefill = _post(client, prefill_url, path, prefill_body)
    assert prefill.status_code == 200, prefill.text
    params = prefill.json()["kv_transfer_params"]
    return _post(client, decode_url, path, {**body, "kv_transfer_params": params})


def sglang_pd(client: httpx.Client, prefill: EngineHandle, decode_url: str,
              body: dict[str, Any], path: str = "/v1/completions",
              room: int | None = None) -> httpx.Response:
    """SGLang's handshake: the same body to P and D at once, plus bootstrap fields."""
    room = random.getrandbits(63) if room is None else room
    full = {**body, "bootstrap_host": prefill.host, "bootstrap_port": prefill.bootstrap_port,
            "bootstrap_room": room}
    with ThreadPoolExecutor(2) as pool:
        p_future = pool.submit(_post, client, prefill.url, path, full)
        d_future = pool.submit(_post, client, decode_url, path, full)
        decode = d_future.result()
        p_future.result()  # drained, as a router does
    return decode


class BodyFor:
    """Request bodies tests keep needing."""

    @staticmethod
    def slow(max_tokens: int, prompt: str = "keep me busy") -> dict[str, Any]:
        """A completion of exactly `max_tokens` tokens (with --sim-decode-delay: slow)."""
        return {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                "return_token_ids": True}


def metrics(url: str) -> dict[str, float]:
    """Prometheus text from /metrics as {name: value} (labels dropped; one series each)."""
    text = httpx.get(url + "/metrics", timeout=HTTP_TIMEOUT_S).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            values[series.split("{", 1)[0]] = float(value)
    return values

