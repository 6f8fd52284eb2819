"""Where an external engine publishes KV events, read from its own command line.

vLLM and SGLang take the same flag: `--kv-events-config '{"enable_kv_cache_events": true,
"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558",
"topic": "..."}'` (vLLM's `KVEventsConfig`: publisher defaults to "zmq" when enabled,
endpoint to tcp://*:5557, no replay endpoint, topic ""; SGLang 0.5's has no enable flag,
publisher defaults to "null", and `bind` may say a concrete address binds). The sidecar
turns it into the member's `KvEventsSpec`: bind addresses become advertised ones (`*`,
0.0.0.0 and :: are replaced by the advertised host), plus the block size (SGLang's
/server_info `kv_events.block_size`, else `--block-size` / `--page-size`; 0 = learnt from
the events), hashing (`--prefix-caching-hash-algo`) and tokenizer (`--tokenizer`, else
the model path), so a router finds the same files.

Not supported (None, logged): a publisher that connects out (an endpoint without a
wildcard host: the subscriber would have to bind), ipc/inproc endpoints, and events
disabled. A data-parallel engine publishes rank k on port + k: the sidecar registers
rank 0's endpoints (one member per engine process).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Final
from urllib.parse import urlsplit

from wire.protocol import KvEventsSpec

__all__ = ["kv_events_from_command"]

logger = logging.getLogger(__name__)

FLAG: Final = "--kv-events-config"
WILDCARDS: Final = ("*", "0.0.0.0", "::", "[::]", "")


def _flag(command: Sequence[str], *names: str) -> str | None:
    """The value of the last of `names` in `command` (`--x v` or `--x=v`)."""
    found = None
    for i, arg in enumerate(command):
        for name in names:
            if arg == name and i + 1 < len(command):
                found = command[i + 1]
            elif arg.startswith(name + "="):
                found = arg[len(name) + 1:]
    return found


def _model(command: Sequence[str]) -> str:
    """vLLM: `vllm serve MODEL` or `--model`; SGLang: `--model-path`."""
    named = _flag(command, "--tokenizer", "--tokenizer-path")
    if named:
        return named
    named = _flag(command, "--model", "--model-path")
    if named:
        return named
    for i, arg in enumerate(command[:-1]):
        if arg == "serve" and not command[i + 1].startswith("-"):
            return command[i + 1]
    return ""


def _advertised(endpoint: str, host: str, bind: bool | None = None) -> str | None:
    """The address to subscribe to. `bind` (SGLang's option): None = vLLM's heuristic,
    a wildcard host binds and anything else connects out."""
    try:
        parts = urlsplit(endpoint)
        port = parts.port
    except ValueError:
        return None
    if parts.scheme != "tcp" or not port:
        return None
    bind_host = parts.netloc.rsplit(":", 1)[0]
    if bind_host in WILDCARDS:
        return f"tcp://{host}:{port}" if bind is not False else None
    if bind:  # a concrete address it binds: that is where to subscribe
        return f"tcp://{bind_host}:{port}"
    return None  # a connecting publisher: nothing here to subscribe to


def kv_events_from_command(command: Sequence[str], advertise_host: str,
                           engine: str, reported_block_size: int = 0) -> KvEventsSpec | None:
    """The `KvEventsSpec` an engine launched as `command` publishes, or None.
    `reported_block_size`: what the engine itself says its events carry (SGLang's
    /server_info); it wins over the command line, which may not say or be overridden."""
    raw = _flag(command, FLAG)
    if raw is None:
        return None
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as exc:
        logger.warning("[sidecar] %s is not JSON (%s): no KV events advertised", FLAG, exc)
        return None
    if not isinstance(config, dict):
        return None
    if engine == "sglang":  # SGLang has no enable flag: publisher "zmq" (default "null")
        if config.get("publisher") != "zmq":
            return None
    elif config.get("enable_kv_cache_events") is not True or \
            config.get("publisher", "zmq") != "zmq":
        return None  # vLLM: enabled, and then the publisher defaults to "zmq"
    bind = config.get("bind") if isinstance(config.get("bind"), bool) else None
    host = f"[{advertise_host}]" if ":" in advertise_host else advertise_host
    endpoint = _advertised(str(config.get("endpoint", "tcp://*:5557")), host, bind)
    if endpoint is None:
        logger.warning("[sidecar] KV events endpoint %r cannot be subscribed to (it must "
                       "bind tcp://*:PORT): not advertised", config.get("endpoint"))
        return None
    replay = config.get("replay_endpoint")
    replay_endpoint = _advertised(str(replay), host) if replay else None  # ROUTER: binds
    block = _flag(command, "--block-size", "--page-size")
    algo = _flag(command, "--prefix-caching-hash-algo") or "sha256"
    return KvEventsSpec(
        endpoint=endpoint, replay_endpoint=replay_endpoint or "",
        topic=str(config.get("topic", "")),
        block_size=reported_block_size or (int(block) if block and block.isdigit() else 0),
        hash_scheme=f"vllm:{algo}" if engine == "vllm" else engine,
        tokenizer=_model(command)[:256])
