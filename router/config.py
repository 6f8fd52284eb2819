"""A router's settings: one `RouterConfig`, in groups, handed whole to `Router` and
`RouterServer` (as `RegistryConfig` is to `RegistryServer`).

    clients   what one client connection may take: head and body deadlines and sizes,
              and how long requests in flight get at close (serving.http_server.Limits)
    upstream  what bounds each engine leg: connect, first byte, idle read
              (router.http.bounds.Timeouts)
    retries   pairs tried per request, migrations per stream (`Retries`)
    pairing   locality, when a load is stale, quarantine, latency memory (`PairingOptions`)
    kv        the `kv` policy's tokenizers and conditional disaggregation
              (router.kv.routing.KvOptions)
    admission overload admission: classes, budgets per member, the bounded queue
              (router.admission.options.AdmissionOptions)

Each default is defined once, beside the code that uses it; `pdreg router` builds the
config straight from its flags, and a flag's value keeps its name on the way
(`--drain-timeout` is `clients.drain_timeout_s`, which the HTTP server reads).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from router.admission.options import AdmissionOptions
from router.http.bounds import Timeouts
from router.kv.routing import KvOptions
from router.latency import DECAY_S
from router.policies import DEFAULT_POLICY, DEFAULT_STALE_LOAD_S
from router.quarantine import QUARANTINE_S
from router.warmup import WARM_CONNECTIONS
from serving.http_server import Limits

__all__ = [
    "DRAIN_DELAY_S",
    "MAX_ATTEMPTS",
    "MAX_MIGRATIONS",
    "AdmissionOptions",
    "KvOptions",
    "Limits",
    "PairingOptions",
    "Retries",
    "RouterConfig",
    "Timeouts",
]

MAX_ATTEMPTS: Final = 3  # pairs tried per request before giving up with 502
MAX_MIGRATIONS: Final = 3  # times one stream may continue on a new pair
DRAIN_DELAY_S: Final = 5.0  # after SIGTERM: serve on, unready, so balancers take us out


@dataclass(frozen=True, slots=True)
class Retries:
    max_attempts: int = MAX_ATTEMPTS  # at least 1
    max_migrations: int = MAX_MIGRATIONS  # 0: a stream whose decode fails ends in an error


@dataclass(frozen=True, slots=True)
class PairingOptions:
    locality_label: str = ""  # prefer P->D pairs with the same value of this member label
    stale_load_s: float = DEFAULT_STALE_LOAD_S  # an older load report counts as saturated
    quarantine_s: float = QUARANTINE_S  # a member that failed a request is skipped so long
    latency_decay_s: float = DECAY_S  # how fast a member's latency estimate forgets


@dataclass(frozen=True, slots=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0 = the OS picks
    # None: /metrics on the API port. A port (0 = the OS picks): /metrics there only.
    metrics_port: int | None = None
    policy: str = DEFAULT_POLICY
    api_key: str = ""  # clients must send Authorization: Bearer KEY when set
    allow_upstream: str = ""  # CIDRs; "" = public addresses only (guard.DEFAULT_DENY)
    warm_connections: int = WARM_CONNECTIONS  # opened to each member that becomes routable
    drain_delay_s: float = DRAIN_DELAY_S  # `pdreg router`, after SIGTERM
    clients: Limits = field(default_factory=Limits)
    upstream: Timeouts = field(default_factory=Timeouts)
    retries: Retries = field(default_factory=Retries)
    pairing: PairingOptions = field(default_factory=PairingOptions)
    kv: KvOptions = field(default_factory=KvOptions)
    admission: AdmissionOptions = field(default_factory=AdmissionOptions)
