"""`pdreg engine`: run the reference engine (OpenAI-compatible, both P/D handshakes)."""

from __future__ import annotations

import argparse

from pdreg.args import (
    TOKEN,
    add_client_curve_arguments,
    add_label_argument,
    add_registry_argument,
    add_secret_argument,
    client_curve_of,
    labels_of,
    secret_of,
)
from wire.protocol import Handshake, parse_role


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "engine", help="run the reference engine (registers itself)",
        description="The reference engine: a tiny CPU model (or a timed simulation) behind "
                    "an OpenAI-compatible server, speaking vLLM's and SGLang's P/D "
                    "handshakes. Prints one JSON 'ready' line on stdout once serving.")
    p.add_argument("--role", required=True, choices=("prefill", "decode", "mixed"))
    add_registry_argument(p)
    add_secret_argument(p, TOKEN, "the registry's fleet token")
    add_client_curve_arguments(p)
    p.add_argument("--no-register", action="store_true", help="run without a registry")
    p.add_argument("--host", default="127.0.0.1", help="bind address")
    p.add_argument("--port", type=int, default=0, help="HTTP port (0 = OS picks)")
    p.add_argument("--advertise-host", default="",
                   help="host peers use to reach this engine (default: --host)")
    p.add_argument("--kv-port", type=int, default=0,
                   help="prefill only: KV server port (0 = OS picks)")
    p.add_argument("--bootstrap-port", type=int, default=0,
                   help="prefill only: SGLang-style bootstrap port (0 = OS picks)")
    p.add_argument("--backend", choices=("torch", "sim"), default="torch")
    p.add_argument("--model", default="tiny",
                   help="served model name; torch weights are derived from it")
    p.add_argument("--protocol", choices=(Handshake.VLLM_NIXL, Handshake.SGLANG),
                   default=Handshake.VLLM_NIXL,
                   help="the P/D handshake it registers (it answers both)")
    p.add_argument("--max-running", type=int, default=8,
                   help="requests computed concurrently; more wait in a queue")
    p.add_argument("--kv-capacity-tokens", type=int, default=65536,
                   help="KV capacity in tokens (the denominator of kv_cache_usage_perc)")
    p.add_argument("--kv-lease", type=float, default=30.0, dest="kv_lease_s",
                   help="seconds a prefill keeps KV that no decode pulls")
    p.add_argument("--kv-fetch-timeout", type=float, default=10.0, dest="kv_fetch_timeout_s",
                   help="seconds a decode waits for a prefill's KV")
    p.add_argument("--drain-timeout", type=float, default=30.0, dest="drain_timeout_s",
                   help="seconds to wait for in-flight work on SIGTERM")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--sim-prefill-delay", type=float, default=0.0,
                   dest="sim_prefill_s_per_token", help="sim: seconds per prompt token")
    p.add_argument("--sim-decode-delay", type=float, default=0.0,
                   dest="sim_decode_s_per_token", help="sim: seconds per output token")
    p.add_argument("--sim-kv-bytes-per-token", type=int, default=128,
                   help="sim: KV payload bytes per prompt token")
    p.add_argument("--prefix-cache-blocks", type=int, default=None,
                   help="prefix cache size in blocks (default: the KV capacity; 0 = off)")
    p.add_argument("--block-size", type=int, default=16,
                   help="tokens per prefix-cache block")
    p.add_argument("--kv-events", action=argparse.BooleanOptionalAction, default=True,
                   help="publish KV cache events (vLLM's ZeroMQ format, with a replay "
                        "socket) for `pdreg router --policy kv`, on ports it picks and "
                        "registers, bound on --host (the default where it caches: prefill "
                        "and mixed); --no-kv-events: publish none")
    p.add_argument("--kv-events-port", type=int, default=0,
                   help="KV events PUB port (0 = any free one; the replay port is separate)")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME[=PATH]",
                   help="LoRA adapters served besides --model, as vLLM's flag names them: "
                        "a request whose model is NAME uses it (the reference model has "
                        "no adapter weights: only its prefix-cache blocks are the adapter's "
                        "own); registered, so routers send NAME's requests here")
    add_label_argument(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from engine_agent.reference.runner import EngineConfig, run

    config = EngineConfig(
        role=parse_role(args.role), model=args.model, host=args.host, port=args.port,
        advertise_host=args.advertise_host, kv_port=args.kv_port,
        bootstrap_port=args.bootstrap_port, backend=args.backend, protocol=args.protocol,
        max_running=args.max_running, kv_capacity_tokens=args.kv_capacity_tokens,
        kv_lease_s=args.kv_lease_s, kv_fetch_timeout_s=args.kv_fetch_timeout_s,
        drain_timeout_s=args.drain_timeout_s, register=not args.no_register,
        registries=args.registry, token=secret_of(args, TOKEN),
        curve=None if args.no_register else client_curve_of(args), threads=args.threads,
        sim_prefill_s_per_token=args.sim_prefill_s_per_token,
        sim_decode_s_per_token=args.sim_decode_s_per_token,
        sim_kv_bytes_per_token=args.sim_kv_bytes_per_token, labels=labels_of(args),
        prefix_cache_blocks=args.prefix_cache_blocks, block_size=args.block_size,
        kv_events=args.kv_events, kv_events_port=args.kv_events_port,
        adapters=tuple(dict.fromkeys(m.split("=", 1)[0] for m in args.lora_modules)))
    return run(config)
