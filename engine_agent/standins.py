"""Stand-ins for vLLM and SGLang servers: only the HTTP surface a sidecar reads.

They follow the engines' contracts as measured on the real servers (docs/engines.md
§1, §3; vLLM 0.32, SGLang 0.5.23):
- vLLM: GET /health -> 200 with an empty body, 503 when the engine is dead;
  GET /v1/models -> {"object": "list", "data": [{"id", "object": "model", "max_model_len",
  ...}]}, then one card per LoRA adapter (`--lora-modules NAME=PATH`: "id" its name,
  "root" its path, "parent" the base model, no max_model_len); GET /metrics ->
  Prometheus text with gauges `vllm:num_requests_running`, `vllm:num_requests_waiting`,
  `vllm:kv_cache_usage_perc` labelled `engine`, `model_name`.
- SGLang: GET /ready -> 200, or 503 while warming up (and when unhealthy); GET /health
  likewise, but only after a one-second wait (the real one generates a token and sleeps
  a second before it looks); GET /server_info (and /get_server_info) -> server args incl.
  `model_path`, `served_model_name`, `disaggregation_mode`,
  `disaggregation_bootstrap_port`, `tp_size`, `dp_size`, `version`;
  GET /v1/models as vLLM's (the base card's "max_model_len" its context length, a card
  per LoRA adapter of --lora-paths with "parent"; no "permission");
  GET /v1/loads -> live counts per DP rank; GET /metrics -> 404 unless started with
  metrics (`--enable-metrics` on the real server), else gauges `sglang:num_running_reqs`,
  `sglang:num_queue_reqs`, `sglang:token_usage`, the P/D hand-off queues, labelled
  `model_name`, `engine_type`, `tp_rank`, `pp_rank`, `moe_ep_rank`, and
  `sglang:http_requests_active{endpoint, method}`.

Tests steer them through `POST /standin/state` (JSON: healthy, running, waiting, queued,
http_active, kv_usage) and `POST /standin/exit` (JSON: code) — paths no real engine serves.

    python -m engine_agent.standins --kind vllm --port 8100 --model tiny
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["StandinServer", "StandinState", "main"]

logger = logging.getLogger(__name__)

KINDS = ("vllm", "sglang")
SGLANG_VERSION = "0.5.23"  # the release whose surface the SGLang stand-in copies
SGLANG_HEALTH_WAIT_S = 1.0  # the real /health sleeps this long before it answers
DISAGGREGATION_ENGINE_TYPES = {"prefill": "prefill", "decode": "decode"}  # else "unified"


@dataclass
class StandinState:
    healthy: bool = True  # False: warming up (SGLang) or dead (vLLM) -> 503
    running: int = 0
    waiting: int = 0
    queued: int = 0  # SGLang P/D hand-off queues (bootstrap, KV in flight), summed
    http_active: int = 0  # SGLang: open generation POSTs besides those counted above
    kv_usage: float = 0.0


class StandinServer:
    """A vLLM- or SGLang-shaped HTTP server on a thread. `port=0` lets the OS pick."""

    def __init__(self, kind: str, *, host: str = "127.0.0.1", port: int = 0,
                 model: str = "tiny", bootstrap_port: int = 0,
                 disaggregation_mode: str = "null", metrics: bool = True) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
        self.kind = kind
        self.model = model
        self.bootstrap_port = bootstrap_port
        self.disaggregation_mode = disaggregation_mode
        self.metrics = metrics  # SGLang serves /metrics only with --enable-metrics
        self.lora_modules: dict[str, str] = {}  # vLLM's --lora-modules: name -> path
        self.kv_events: dict[str, Any] | None = None  # SGLang's, with --kv-events-config
        self.hits: Counter[str] = Counter()  # GET path -> requests served
        self.state = StandinState()
        self.exit_code: int | None = None  # set by POST /standin/exit
        self.exit_requested = threading.Event()
        self._httpd = ThreadingHTTPServer((host, port), _handler_for(self))
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{self._httpd.server_address[0]}:{self.port}"

    def start(self) -> StandinServer:
        self._thread = threading.Thread(target=self._httpd.serve_forever,
                                        name=f"standin-{self.kind}", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving and free the port; safe twice."""
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join()
            self._thread = None
        self._httpd.server_close()

    def __enter__(self) -> StandinServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- contract bodies --------------------------------------------------------------

    def metrics_text(self) -> str:
        s = self.state
        if self.kind == "vllm":
            labels = f'engine="0",model_name="{self.model}"'
            gauges = [
                ("vllm:num_requests_running",
                 "Number of requests in model execution batches.", s.running),
                ("vllm:num_requests_waiting",
                 "Number of requests waiting to be processed.", s.waiting),
                ("vllm:kv_cache_usage_perc",
                 "KV-cache usage. 1 means 100 percent usage.", s.kv_usage),
            ]
        else:
            engine_type = DISAGGREGATION_ENGINE_TYPES.get(self.disaggregation_mode, "unified")
            labels = (f'engine_type="{engine_type}",model_name="{self.model}",'
                      'moe_ep_rank="0",pp_rank="0",tp_rank="0"')
            bootstrap = s.queued if engine_type == "prefill" else 0
            prealloc = s.queued if engine_type == "decode" else 0
            gauges = [
                ("sglang:num_running_reqs", "The number of running requests.", s.running),
                ("sglang:num_queue_reqs", "The number of requests in the waiting queue.",
                 s.waiting),
                ("sglang:token_usage", "The token usage.", s.kv_usage),
                ("sglang:num_prefill_bootstrap_queue_reqs",
                 "The number of requests in the prefill bootstrap queue.", bootstrap),
                ("sglang:num_prefill_inflight_queue_reqs",
                 "The number of requests in the prefill inflight queue.", 0),
                ("sglang:num_decode_prealloc_queue_reqs",
                 "The number of requests in the decode prealloc queue.", prealloc),
                ("sglang:num_decode_transfer_queue_reqs",
                 "The number of requests in the decode transfer queue.", 0),
            ]
        lines = []
        for name, help_text, value in gauges:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge",
                      f"{name}{{{labels}}} {float(value)}"]
        if self.kind == "sglang":
            name = "sglang:http_requests_active"
            open_posts = s.running + s.waiting + s.queued + s.http_active
            lines += [f"# HELP {name} Number of currently active HTTP requests",
                      f"# TYPE {name} gauge",
                      f'{name}{{endpoint="/v1/completions",method="POST"}} {float(open_posts)}',
                      f'{name}{{endpoint="/metrics",method="GET"}} 1.0']
        return "\n".join(lines) + "\n"

    def loads_body(self) -> dict[str, Any]:
        """SGLang's GET /v1/loads: live counts, one entry per DP rank."""
        s = self.state
        mode = self.disaggregation_mode
        return {"version": SGLANG_VERSION, "loads": [{
            "dp_rank": 0, "num_running_reqs": s.running, "num_waiting_reqs": s.waiting,
            "token_usage": s.kv_usage, "max_total_num_tokens": 4096,
            "disaggregation": {
                "mode": mode,
                "prefill_bootstrap_queue_reqs": s.queued if mode == "prefill" else 0,
                "prefill_inflight_queue_reqs": 0,
                "decode_prealloc_queue_reqs": s.queued if mode == "decode" else 0,
                "decode_transfer_queue_reqs": 0, "decode_retracted_queue_reqs": 0}}]}

    def models_body(self) -> dict[str, Any]:
        model: dict[str, Any] = {
            "id": self.model, "object": "model", "created": int(time.time()),
            "owned_by": self.kind, "root": self.model, "parent": None, "max_model_len": 512}
        cards = [model]
        if self.kind == "vllm":
            model["permission"] = []
        # Both list a card per LoRA adapter, its "parent" the base model (SGLang's have
        # no "permission").
        cards += [{"id": name, "object": "model", "created": model["created"],
                   "owned_by": self.kind, "root": path, "parent": self.model,
                   "max_model_len": None, **({"permission": []} if self.kind == "vllm" else {})}
                  for name, path in self.lora_modules.items()]
        return {"object": "list", "data": cards}

    def server_info_body(self) -> dict[str, Any]:
        # A few of the real server's ~550 fields: those a sidecar or a router reads.
        return {
            "model_path": f"/models/{self.model}", "served_model_name": self.model,
            "tokenizer_path": f"/models/{self.model}", "host": self._httpd.server_address[0],
            "port": self.port, "tp_size": 1, "dp_size": 1, "pp_size": 1,
            "disaggregation_mode": self.disaggregation_mode,
            "disaggregation_bootstrap_port": self.bootstrap_port or 8998,
            "disaggregation_transfer_backend": "mooncake", "enable_metrics": self.metrics,
            "max_total_num_tokens": 4096, "version": SGLANG_VERSION,
            **({"kv_events": self.kv_events} if self.kv_events is not None else {}),
        }


_TEXT = "text/plain"
_JSON = "application/json"


def _get_reply(server: StandinServer, path: str) -> tuple[int, bytes, str]:
    """What the engine being stood in for answers a GET on `path`: (status, body, type)."""
    server.hits[path] += 1
    sglang = server.kind == "sglang"
    status = 200 if server.state.healthy else 503
    if path == "/health":
        if sglang:
            time.sleep(SGLANG_HEALTH_WAIT_S)
        return status, b"", _TEXT
    if path == "/ready" and sglang:
        return status, b"", _TEXT
    if path == "/metrics" and (server.metrics or not sglang):
        return 200, server.metrics_text().encode(), "text/plain; version=0.0.4; charset=utf-8"
    if path == "/v1/models":
        body: Any = server.models_body()
    elif path in ("/server_info", "/get_server_info") and sglang:
        body = server.server_info_body()
    elif path == "/v1/loads" and sglang:
        body = server.loads_body()
    else:
        return 404, json.dumps({"detail": "Not Found"}).encode(), _JSON
    return 200, json.dumps(body).encode(), _JSON


def _handler_for(server: StandinServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug("[standin] " + format, *args)

        def do_GET(self) -> None:
            self._send(*_get_reply(server, self.path.split("?", 1)[0]))

        def do_POST(self) -> None:
            path = self.path.split("?", 1)[0]
            try:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
            except (ValueError, json.JSONDecodeError) as exc:
                self._json(400, {"detail": f"bad JSON: {exc}"})
                return
            if path == "/standin/state":
                for key, value in body.items():
                    if hasattr(server.state, key):
                        setattr(server.state, key, type(getattr(server.state, key))(value))
                self._json(200, asdict(server.state))
            elif path == "/standin/exit":
                server.exit_code = int(body.get("code", 0))
                self._json(200, {"exiting": server.exit_code})
                server.exit_requested.set()
            else:
                self._json(404, {"detail": "Not Found"})

        def _json(self, status: int, body: Any) -> None:
            self._send(status, json.dumps(body).encode(), _JSON)

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Handler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="vLLM/SGLang stand-in HTTP server")
    parser.add_argument("--kind", choices=KINDS, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--bootstrap-port", type=int, default=0)
    parser.add_argument("--unhealthy", action="store_true",
                        help="start with /health 503 (warming up)")
    parser.add_argument("--disaggregation-mode", default="null",
                        choices=("null", "prefill", "decode"))
    parser.add_argument("--no-metrics", action="store_true",
                        help="SGLang: no /metrics (as without --enable-metrics)")
    parser.add_argument("--lora-modules", nargs="*", default=[], metavar="NAME=PATH",
                        help="LoRA adapters it lists in /v1/models (vLLM's --lora-modules, "
                        "SGLang's --lora-paths)")
    parser.add_argument("--startup-delay", type=float, default=0.0,
                        help="seconds before binding, like an engine loading weights")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s standin: %(message)s")
    stop = threading.Event()
    # SIGTERM is how the sidecar stops its child: exit 0 like a clean engine shutdown.
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    if stop.wait(args.startup_delay):
        return 0
    server = StandinServer(args.kind, host=args.host, port=args.port, model=args.model,
                           bootstrap_port=args.bootstrap_port,
                           disaggregation_mode=args.disaggregation_mode,
                           metrics=not args.no_metrics)
    server.state.healthy = not args.unhealthy
    server.lora_modules = dict(module.split("=", 1) for module in args.lora_modules)
    server.start()
    logger.info("%s stand-in on %s (pid %d)", args.kind, server.url, os.getpid())
    while not stop.wait(0.05):
        if server.exit_requested.is_set():
            break
    server.close()
    return server.exit_code or 0


if __name__ == "__main__":
    raise SystemExit(main())
