"""The routers bench_router.py compares and the engines behind them.

`pd_engines`: a registry and 2P+2D sim engines registered with it (optionally one slow
prefill or decode); `baseline_engines`: another pdreg source tree's registry and engines;
`pdreg_router` and `peer`: a router as a `Target`; `lineup`: every router that speaks a
handshake. Also what every router is measured with: the request (`BODY`), the
concurrency, and how long a router may take to serve its first request (`serving`).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for _path in (REPO, REPO / "tests"):  # `bench` and pdreg; the engine helpers
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from reference_helpers import EngineHandle, start_engines, stop_all  # noqa: E402

from bench import peers  # noqa: E402
from bench.load import Send, completion, serves  # noqa: E402
from bench.procs import LOCAL_ROUTER_FLAGS, router_process  # noqa: E402
from pdreg.testing import die_with_parent, free_low_port, stop_process, wait_until  # noqa: E402
from registry.server import RegistryConfig, RegistryServer  # noqa: E402

BODY = {"model": "tiny", "prompt": "benchmark prompt", "max_tokens": 4, "ignore_eos": True}
CONCURRENCY = 32
READY_TIMEOUT_S = 30.0
ROUTER_STOP_TIMEOUT_S = 20.0
# Slow-worker scenarios. Prefill per prompt token (a ~25-token prompt: fast ≈ 12 ms,
# slow ≈ 125 ms); decode per output token (8 tokens: fast ≈ 16 ms, slow ≈ 80 ms).
FAST_PREFILL_S_PER_TOKEN = 0.0005
SLOW_PREFILL_S_PER_TOKEN = 0.005
FAST_DECODE_S_PER_TOKEN = 0.002
SLOW_DECODE_S_PER_TOKEN = 0.010

ROUTER_ARGS: list[str] = []  # --router-args: extra `pdreg router` flags for every run
BASELINE_SRC: list[Path] = []  # --baseline-src: another pdreg source tree, run beside


@dataclass
class Target:
    name: str
    url: str
    cpu_s: Callable[[], float] | None = field(default=None)
    pid: int | None = None  # the router process (its tree's run time: the cold burst)


def serving(target: Target) -> Send:
    """BODY to `target`, once it has answered one within READY_TIMEOUT_S."""
    send = completion(target.url, BODY)
    if not wait_until(lambda: serves(send), READY_TIMEOUT_S, poll_s=0.2):
        raise RuntimeError(f"{target.name} does not serve requests at {target.url}")
    return send


@contextmanager
def pd_engines(handshake: str, slow: str = "", fast_only: bool = False
               ) -> Iterator[tuple[str, list[EngineHandle]]]:
    """A registry and 2P+2D sim engines registered with it as `handshake` members.

    `slow` "prefill": prefill 0 is 10x slower than prefill 1; "decode": decode 0 is 5x
    slower per token than decode 1 (both with timed prefill and decode); "": no delays.
    `fast_only`: the slow engine is left out (2 engines of the other role stay).
    Yields the registry's control address and the engines, prefills first.
    """
    def sim_args(role: str, slow_one: bool) -> list[str]:
        if not slow:
            return []
        prefill = SLOW_PREFILL_S_PER_TOKEN if slow_one and role == "prefill" else \
            FAST_PREFILL_S_PER_TOKEN
        decode = SLOW_DECODE_S_PER_TOKEN if slow_one and role == "decode" else \
            FAST_DECODE_S_PER_TOKEN
        return ["--sim-prefill-delay", str(prefill), "--sim-decode-delay", str(decode)]
    specs = []
    for role in ("prefill", "decode"):
        for index in range(2):
            slow_one = role == slow and index == 0
            if slow_one and fast_only:
                continue
            specs.append({"role": role, "extra_args": sim_args(role, slow_one)})
    registry = RegistryServer(RegistryConfig(port=0, events_port=0, http_port=0))
    registry.start()
    handles: list[EngineHandle] = []
    try:
        handles = start_engines([{**s, "backend": "sim", "protocol": handshake,
                                  "registry": registry.control_address} for s in specs])
        yield registry.control_address, handles
    finally:
        stop_all(handles)
        registry.close()


@contextmanager
def baseline_engines(src: Path, handshake: str) -> Iterator[str]:
    """Another pdreg version's registry and 2P+2D sim engines (their wire protocol may
    differ from this tree's); yields the registry's control address."""
    ports = [free_low_port()]
    ports += [free_low_port(avoid=set(ports)) for _ in range(2)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdreg", "--log-level", "WARNING", "registry", "--port",
         str(ports[0]), "--events-port", str(ports[1]), "--http-port", str(ports[2])],
        cwd=src, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
    handles: list[EngineHandle] = []
    try:
        assert proc.stdout is not None
        proc.stdout.readline()  # "pdreg registry: control ..." once its sockets are bound
        address = f"127.0.0.1:{ports[0]}"
        handles = start_engines([{"role": role, "backend": "sim", "protocol": handshake,
                                  "registry": address, "src": src}
                                 for role in ("prefill", "prefill", "decode", "decode")])
        yield address
    finally:
        stop_all(handles)
        stop_process(proc, ROUTER_STOP_TIMEOUT_S)


def _flags_known(src: Path) -> list[str]:
    """LOCAL_ROUTER_FLAGS that another version's `pdreg router` has (an older one may lack
    --allow-upstream, and then sends to loopback anyway)."""
    text = (src / "pdreg" / "cmd_router.py").read_text()
    pairs = zip(LOCAL_ROUTER_FLAGS[::2], LOCAL_ROUTER_FLAGS[1::2], strict=True)
    return [part for flag, value in pairs if f'"{flag}"' in text for part in (flag, value)]


@contextmanager
def pdreg_router(registry: str, policy: str, label: str = "", src: Path | None = None
                 ) -> Iterator[Target]:
    """`src`: run the router of another pdreg source tree (e.g. an export of main), with
    only the flags every version has."""
    flags = _flags_known(src) if src else [*LOCAL_ROUTER_FLAGS, *ROUTER_ARGS]
    with router_process(registry, policy, flags=flags, src=src or REPO) as router:
        try:
            yield Target(label or f"pdreg ({policy})", router.url, router.cpu_s,
                         router.proc.pid)
        finally:
            errors = router.error_lines()
            if errors:
                print(f"  (pdreg router logged {errors} ERROR lines)", flush=True)


@contextmanager
def peer(router: peers.PeerRouter) -> Iterator[Target]:
    try:
        yield Target(router.name, router.url, router.cpu_s, router.proc.pid)
    finally:
        router.stop()


def lineup(handshake: str, registry: str, policies: list[str], handles: list[EngineHandle],
           peers_too: bool = True, mini_lb: bool = True
           ) -> list[Callable[[], AbstractContextManager[Target]]]:
    """Context-manager factories for every router that speaks `handshake`, pdreg first."""
    prefills = [h for h in handles if h.id.startswith("prefill")]
    decodes = [h.url for h in handles if h.id.startswith("decode")]
    with_bootstrap = [(h.url, h.bootstrap_port) for h in prefills]
    factories: list[Callable[[], AbstractContextManager[Target]]] = [
        lambda policy=policy: pdreg_router(registry, policy) for policy in policies]
    if not peers_too:
        return factories
    if handshake == "vllm-nixl":
        factories.append(lambda: peer(peers.start_vllm_router(
            [h.url for h in prefills], decodes)))
    else:
        factories.append(lambda: peer(peers.start_sglang_router(with_bootstrap, decodes)))
        if mini_lb:
            factories.append(lambda: peer(peers.start_sglang_router(
                with_bootstrap, decodes, mini_lb=True)))
    return factories
