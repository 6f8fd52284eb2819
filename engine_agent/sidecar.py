"""The sidecar: makes an unmodified vLLM / SGLang / generic server a member of the fleet.

    pdreg agent --engine vllm --engine-url http://127.0.0.1:8100 --role prefill \\
        -- vllm serve MODEL --port 8100 ...

With a COMMAND it launches the engine as its child (in its own process group, so a
terminal's Ctrl-C reaches only the sidecar, which then drains); without one it attaches
to an engine already running. Life cycle:

1. Learn what the spec needs from the engine when flags do not say it (vLLM /v1/models
   for the model; SGLang /server_info for model and bootstrap port), then register as
   JOINING.
2. Every tick: READY once /health answers 200; back to JOINING after
   HEALTH_FAILURES_TO_UNREADY failures in a row, or at once when the connection is
   refused. Load comes from /metrics at the heartbeat cadence.
3. The child exits -> bye CRASHED at once, end what is left of its process group (an
   engine's helper processes), exit with the child's code.
4. SIGTERM / SIGINT -> DRAINING, wait until the engine holds no request (or
   --drain-timeout), SIGTERM the child's process group (SIGKILL after --kill-grace),
   bye, exit 0.
5. The sidecar killed outright (kill -9, OOM) -> its lifeline process (lifeline.py) ends
   the engine's process group: no engine outlives its sidecar unregistered.
"""

from __future__ import annotations

import enum
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from engine_agent.agent import Agent, default_member_id, new_incarnation, wait_for_idle
from engine_agent.kv_config import kv_events_from_command
from engine_agent.lifeline import Lifeline, end_group
from engine_agent.probes import EngineKind, EngineMetadata, EngineProbe, Health
from registry.security import ClientCurve
from wire.protocol import (
    ByeReason,
    Endpoints,
    Handshake,
    Load,
    MemberSpec,
    MemberState,
    Parallel,
    Role,
)
from wire.validation import url_host

__all__ = ["Sidecar", "SidecarConfig", "default_protocol"]

logger = logging.getLogger(__name__)

ENGINE_DRAIN_QUIET_S = 1.0  # running+waiting must read 0 this long before the engine stops
HEALTH_FAILURES_TO_UNREADY = 3  # consecutive non-200 answers before READY -> JOINING
DEFAULT_HEALTH_INTERVAL_S = 1.0
DEFAULT_DRAIN_TIMEOUT_S = 30.0
DEFAULT_KILL_GRACE_S = 10.0  # SIGTERM -> SIGKILL for the child
VLLM_NIXL_SIDE_CHANNEL_PORT_DEFAULT = 5600  # vLLM's own default for the NIXL side channel
NIXL_HOST_ENV = "VLLM_NIXL_SIDE_CHANNEL_HOST"
NIXL_PORT_ENV = "VLLM_NIXL_SIDE_CHANNEL_PORT"
WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")

_DEFAULT_PROTOCOLS = {EngineKind.VLLM: Handshake.VLLM_NIXL, EngineKind.SGLANG: Handshake.SGLANG}


def default_protocol(engine: EngineKind) -> str:
    """vllm -> vllm-nixl, sglang -> sglang; generic engines must say theirs."""
    return _DEFAULT_PROTOCOLS.get(engine, "")


@dataclass(frozen=True)
class SidecarConfig:
    engine: EngineKind
    engine_url: str
    role: Role
    registries: str | Sequence[str] | None = None
    model: str = ""
    protocol: str = ""
    advertise_host: str = ""
    member_id: str = ""
    kv_host: str = ""
    kv_port: int = 0
    bootstrap_port: int = 0
    labels: dict[str, str] = field(default_factory=dict)
    capacity: int = 0
    token: str = ""
    curve: ClientCurve | None = None  # CURVE keys for the registry link
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    health_interval_s: float = DEFAULT_HEALTH_INTERVAL_S
    kill_grace_s: float = DEFAULT_KILL_GRACE_S
    command: tuple[str, ...] = ()

    def check(self) -> None:
        """Raise ValueError on flags that cannot work, before anything starts."""
        parts = urlsplit(self.engine_url)
        if parts.scheme not in ("http", "https") or not parts.hostname or not parts.port:
            raise ValueError(f"--engine-url {self.engine_url!r} must be http://HOST:PORT")
        if self.engine is EngineKind.GENERIC and not self.protocol:
            raise ValueError("--protocol is required with --engine generic")
        if self.engine is EngineKind.GENERIC and not self.model:
            raise ValueError("--model is required with --engine generic")
        if self.health_interval_s <= 0:
            raise ValueError("--health-interval must be positive")


class Phase(enum.Enum):
    STARTING = "starting"  # engine metadata not known yet; not registered
    MEMBER = "member"  # registered; JOINING or READY follows /health
    DRAINING = "draining"
    DONE = "done"


class Sidecar:
    """Runs in the main thread (`run()` returns the exit code); signals only set flags."""

    def __init__(self, config: SidecarConfig) -> None:
        config.check()
        self.config = config
        self.phase = Phase.STARTING
        self._wake = threading.Event()
        self._shutdown_signal: int | None = None
        self._child: subprocess.Popen[bytes] | None = None
        self._lifeline: Lifeline | None = None
        self._agent: Agent | None = None
        self._probe = EngineProbe(config.engine, config.engine_url, model=config.model)
        self._load = Load()
        self._health_failures = 0
        self._incarnation = new_incarnation()
        self._started_at = time.time()

    # --- entry point -----------------------------------------------------------------

    def run(self) -> int:
        self._install_signal_handlers()
        try:
            if self.config.command:
                self._launch_child()
            return self._main_loop()
        finally:
            self._kill_child()
            if self._agent is not None:
                self._agent.stop()
            self._probe.close()
            self.phase = Phase.DONE

    def _main_loop(self) -> int:
        metadata: EngineMetadata | None = None
        while True:
            child_code = self._child.poll() if self._child is not None else None
            if child_code is not None:
                return self._on_child_exit(child_code)
            if self._shutdown_signal is not None:
                return self._drain_and_exit()
            if self._agent is None:
                metadata = metadata or self._engine_metadata()
                if metadata is not None:
                    self._join(metadata)
            if self._agent is not None:
                self._tick()
            self._wake.wait(self._tick_period_s())
            self._wake.clear()

    # --- steps -----------------------------------------------------------------------

    def _engine_metadata(self) -> EngineMetadata | None:
        """What the spec still needs from the engine; None while the engine cannot say."""
        cfg = self.config
        needs_model = not cfg.model
        needs_bootstrap = (cfg.engine is EngineKind.SGLANG and not cfg.bootstrap_port
                           and cfg.role in (Role.PREFILL, Role.MIXED))
        if not (needs_model or needs_bootstrap):
            return EngineMetadata(model=cfg.model)
        metadata = self._probe.metadata()
        if metadata is None or (needs_model and not metadata.model):
            logger.debug("[sidecar] waiting for %s to report its metadata", cfg.engine_url)
            return None
        return metadata

    def _join(self, metadata: EngineMetadata) -> None:
        spec = self._build_spec(metadata)
        self._probe.model = spec.model  # count only this model's requests in /metrics
        self._agent = Agent(spec, registries=self.config.registries, load=lambda: self._load,
                            token=self.config.token, state=MemberState.JOINING,
                            curve=self.config.curve).start()
        self.phase = Phase.MEMBER
        logger.info("[sidecar] member id=%s model=%s protocol=%s http=%s kv=%s:%d "
                    "bootstrap=%d", spec.id, spec.model, spec.protocol, spec.endpoints.http,
                    spec.endpoints.kv_host, spec.endpoints.kv_port,
                    spec.endpoints.bootstrap_port)

    def _tick(self) -> None:
        agent = self._agent
        assert agent is not None
        health = self._probe.health()
        if health is Health.OK:
            self._health_failures = 0
        elif health is Health.REFUSED:
            self._health_failures = HEALTH_FAILURES_TO_UNREADY  # nothing listens: down now
        else:
            self._health_failures += 1
        if health is Health.OK:
            load = self._probe.load()
            if load is not None:
                self._load = load
        if agent.state is MemberState.DRAINING:
            return
        if health is Health.OK and agent.state is not MemberState.READY:
            agent.set_state(MemberState.READY)
        elif (self._health_failures >= HEALTH_FAILURES_TO_UNREADY
              and agent.state is MemberState.READY):
            logger.warning("[sidecar] engine %s unhealthy (%s, %d in a row): not ready",
                           self.config.engine_url, health.value, self._health_failures)
            agent.set_state(MemberState.JOINING)

    def _on_child_exit(self, code: int) -> int:
        """The engine died under us: bye CRASHED at once, exit with its code."""
        exit_code = code if code >= 0 else 128 - code  # killed by signal N -> 128 + N
        logger.error("[sidecar] engine process exited with %s; leaving (crashed)",
                     code if code >= 0 else f"signal {-code}")
        if self._agent is not None:
            self._agent.stop(ByeReason.CRASHED)
        return exit_code

    def _drain_and_exit(self) -> int:
        signame = signal.Signals(self._shutdown_signal or signal.SIGTERM).name
        agent = self._agent
        if agent is None:
            logger.info("[sidecar] %s before the engine was up: stopping", signame)
            self._kill_child()
            return 0
        logger.info("[sidecar] %s: draining id=%s (timeout %.1fs)", signame, agent.spec.id,
                    self.config.drain_timeout_s)
        self.phase = Phase.DRAINING
        agent.set_state(MemberState.DRAINING)
        # vLLM counts a request only once its scheduler has it: a longer quiet period
        # covers those its HTTP server has accepted but not yet handed over.
        wait_for_idle(self._in_flight, self.config.drain_timeout_s, agent.spec.id,
                      quiet_s=ENGINE_DRAIN_QUIET_S)
        self._kill_child()
        agent.stop(ByeReason.SHUTDOWN)
        return 0

    def _in_flight(self) -> int:
        """Requests the engine still holds, from a fresh /metrics read (see
        probes.in_flight_from_metrics: SGLang's open POSTs count, its gauges lag)."""
        if self._child is not None and self._child.poll() is not None:
            return 0  # nothing left to wait for
        if self.config.engine is EngineKind.GENERIC:
            return 0  # no load signal: announcing DRAINING is all a generic engine gets
        in_flight = self._probe.in_flight()
        if in_flight is None:
            if self._probe.health() is Health.REFUSED:
                return 0
            return self._load.running + self._load.waiting  # metrics hiccup: last reading
        return in_flight

    # --- spec ------------------------------------------------------------------------

    def _build_spec(self, metadata: EngineMetadata) -> MemberSpec:
        cfg = self.config
        engine = urlsplit(cfg.engine_url)
        engine_port = engine.port or 0
        advertise_host = cfg.advertise_host or engine.hostname or ""
        if advertise_host in WILDCARD_HOSTS:
            advertise_host = socket.getfqdn()
        kv_host, kv_port = cfg.kv_host, cfg.kv_port
        protocol = cfg.protocol or default_protocol(cfg.engine)
        if cfg.engine is EngineKind.VLLM and protocol == Handshake.VLLM_NIXL:
            # The NIXL side channel: what the child's environment tells vLLM, else its default.
            env_host = os.environ.get(NIXL_HOST_ENV, "")
            kv_host = kv_host or ("" if env_host in WILDCARD_HOSTS else env_host)
            kv_port = kv_port or _int_env(NIXL_PORT_ENV, VLLM_NIXL_SIDE_CHANNEL_PORT_DEFAULT)
        bootstrap_port = cfg.bootstrap_port or (
            metadata.bootstrap_port if cfg.role in (Role.PREFILL, Role.MIXED) else 0)
        if (kv_port or bootstrap_port) and not kv_host:
            kv_host = advertise_host
        return MemberSpec(
            id=cfg.member_id or default_member_id(cfg.role, advertise_host, engine_port),
            incarnation=self._incarnation,
            role=cfg.role,
            model=cfg.model or metadata.model,
            protocol=protocol,
            endpoints=Endpoints(
                http=f"{engine.scheme}://{url_host(advertise_host)}:{engine_port}",
                kv_host=kv_host, kv_port=kv_port, bootstrap_port=bootstrap_port),
            parallel=Parallel(tp_size=metadata.tp_size, dp_size=metadata.dp_size),
            capacity=cfg.capacity,
            labels=dict(cfg.labels),
            started_at=self._started_at,
            # A decode's events too: conditional disaggregation follows what it holds.
            kv_events=kv_events_from_command(cfg.command, advertise_host, cfg.engine.value,
                                             metadata.kv_block_size),
            max_model_len=metadata.max_model_len,
            adapters=metadata.adapters,
        )

    # --- the child process -----------------------------------------------------------

    def _launch_child(self) -> None:
        logger.info("[sidecar] launching engine: %s", " ".join(self.config.command))
        # Own process group: signals to the sidecar do not reach the engine; the sidecar
        # decides when the engine stops (after draining). The lifeline stops the group if
        # the sidecar cannot.
        self._child = subprocess.Popen(list(self.config.command), start_new_session=True,
                                       env=child_environment(os.environ))
        self._lifeline = Lifeline(self._child.pid, self.config.kill_grace_s).start()
        threading.Thread(target=self._watch_child, name="sidecar-child-waiter",
                         daemon=True).start()

    def _watch_child(self) -> None:
        assert self._child is not None
        self._child.wait()
        self._wake.set()

    def _kill_child(self) -> None:
        """SIGTERM the child's process group (the engine and any helper processes it
        started, also after the engine itself exited), SIGKILL whatever is left after the
        grace period, then release the lifeline; safe twice."""
        child = self._child
        if child is None:
            return
        if child.poll() is None:
            logger.info("[sidecar] stopping engine pid=%d", child.pid)
        if end_group(child.pid, self.config.kill_grace_s):
            logger.warning("[sidecar] engine process group %d ignored SIGTERM for %.0fs; "
                           "SIGKILL", child.pid, self.config.kill_grace_s)
        child.wait()
        if self._lifeline is not None:
            self._lifeline.release()

    # --- signals & timing ------------------------------------------------------------

    def _install_signal_handlers(self) -> None:
        def request_shutdown(signum: int, _frame: object) -> None:
            self._shutdown_signal = signum  # only set state and wake the loop
            self._wake.set()

        signal.signal(signal.SIGTERM, request_shutdown)
        signal.signal(signal.SIGINT, request_shutdown)

    def _tick_period_s(self) -> float:
        period = self.config.health_interval_s
        if self._agent is not None:
            period = min(period, self._agent.heartbeat_interval_s)  # load at heartbeat cadence
        return period


# The engine sees none of pdreg's credentials. Model code runs inside the engine: with
# the fleet token it would be an insider (it could register members), with the admin
# token an operator, with a CURVE key file's path a trusted client. Every PDREG_*
# variable that names a token, a key or a secret is removed (PDREG_TOKEN,
# PDREG_ADMIN_TOKEN, PDREG_API_KEY, PDREG_CURVE_KEY, PDREG_CURVE_SECRET_KEY, ...).
_CREDENTIAL_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD")


def child_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` without pdreg's credentials (see _CREDENTIAL_WORDS)."""
    return {name: value for name, value in environ.items()
            if not (name.startswith("PDREG_")
                    and any(word in name for word in _CREDENTIAL_WORDS))}


def _int_env(name: str, default: int) -> int:
    text = os.environ.get(name, "")
    try:
        return int(text) if text else default
    except ValueError:
        logger.warning("[sidecar] ignoring %s=%r: not a port number", name, text)
        return default
