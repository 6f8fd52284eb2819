"""What a registry is told at start (`pdreg registry`'s flags, as one frozen value)."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

from registry.admission import MAX_MEMBERS, Limits
from registry.coalesce import PAUSE_S as COALESCE_PAUSE_S
from registry.deadband import MAX_AGE_INTERVALS as LOAD_MAX_AGE_INTERVALS
from registry.deadband import MAX_AGE_S as LOAD_MAX_AGE_S
from registry.deadband import Deadband
from registry.detector import HEARTBEAT_INTERVAL_S, DetectorConfig
from registry.security import ServerCurve
from registry.store.url import EtcdOptions

__all__ = ["DEFAULT_MAX_MEMBERS", "RegistryConfig"]

DEFAULT_MAX_MEMBERS = MAX_MEMBERS  # --max-members (registry.admission says why)


@dataclass(frozen=True, slots=True)
class RegistryConfig:
    host: str = "127.0.0.1"
    port: int = 7600
    events_port: int = 7601
    http_port: int = 7680  # -1 disables HTTP
    heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S
    lease_s: float = 3.0
    token: str = ""  # registrations must carry it when set
    admin_token: str = ""  # drain/evict must carry it when set
    max_members: int = DEFAULT_MAX_MEMBERS
    max_members_per_model: int = 0  # 0: only the total cap
    curve: ServerCurve | None = None  # CURVE on both ZeroMQ sockets when set
    tls_cert: str = ""  # with tls_key: HTTPS on the HTTP side (uvicorn's certificate/key)
    tls_key: str = ""
    # A load change inside its deadband goes out at most this late (0: every change at
    # once); see registry.deadband.
    load_max_age_s: float = LOAD_MAX_AGE_S
    load_max_age_intervals: float = LOAD_MAX_AGE_INTERVALS  # or this many intervals, if longer
    io_threads: int = 1  # libzmq I/O threads: the PUB fan-out to many routers uses them
    # Under a high message rate the loop pauses this long between turns (registry.coalesce;
    # 0: never).
    coalesce_s: float = COALESCE_PAUSE_S
    # Where admin intents live (registry.store): memory, file:PATH, etcd://HOST:PORT[,...].
    store: str = "memory"
    store_options: EtcdOptions = field(default_factory=EtcdOptions)
    # In the replica set: this registry's id (default: its advertised control address)
    # and the host clients reach it by (default: --host, or the host name for 0.0.0.0).
    registry_id: str = ""
    advertise_host: str = ""

    def deadband(self) -> Deadband:
        return Deadband(max_age_s=self.load_max_age_s,
                        max_age_intervals=self.load_max_age_intervals)

    def detector(self) -> DetectorConfig:
        return DetectorConfig(heartbeat_interval_s=self.heartbeat_interval_s,
                              lease_s=self.lease_s,
                              tick_period_s=min(0.1, self.heartbeat_interval_s / 4))

    def advertised_host(self) -> str:
        if self.advertise_host:
            return self.advertise_host
        return socket.gethostname() if self.host in ("0.0.0.0", "::", "") else self.host

    def limits(self) -> Limits:
        return Limits(max_members=self.max_members,
                      max_members_per_model=self.max_members_per_model)
