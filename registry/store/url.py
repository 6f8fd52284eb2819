"""`--store URL`: which store a registry keeps its admin intents in. Pure.

    memory                                    in this process only (the default; today's
                                              behaviour: a restart forgets every intent)
    file:PATH                                 one registry that restarts and keeps them
    etcd://HOST:PORT[,HOST:PORT...][/PREFIX]  shared by every registry on that etcd

PREFIX (default `pdreg`) names the fleet's keys, so several fleets can share one etcd.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

__all__ = ["DEFAULT_PREFIX", "EtcdOptions", "StoreKind", "StoreUrl", "parse_store_url"]

DEFAULT_PREFIX = "pdreg"
MAX_ENDPOINTS = 16
_PREFIX_OK = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}(/[A-Za-z0-9][A-Za-z0-9._-]{0,63}){0,3}")
_HOST_OK = re.compile(r"[A-Za-z0-9.-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]")


class StoreKind(enum.StrEnum):
    MEMORY = "memory"
    FILE = "file"
    ETCD = "etcd"


@dataclass(frozen=True, slots=True)
class StoreUrl:
    kind: StoreKind
    path: str = ""  # file:
    endpoints: tuple[str, ...] = ()  # etcd: HOST:PORT each
    prefix: str = DEFAULT_PREFIX  # etcd: every key starts with "{prefix}/"

    @property
    def shared(self) -> bool:
        """Whether other registries see what is written here."""
        return self.kind is StoreKind.ETCD

    def __str__(self) -> str:
        if self.kind is StoreKind.FILE:
            return f"file:{self.path}"
        if self.kind is StoreKind.ETCD:
            return f"etcd://{','.join(self.endpoints)}/{self.prefix}"
        return "memory"


@dataclass(frozen=True, slots=True)
class EtcdOptions:
    """TLS and credentials. TLS is on with a CA or a client certificate."""

    ca_file: str = ""  # verify etcd's certificate against this CA (PEM)
    cert_file: str = ""  # client certificate (PEM), with key_file
    key_file: str = ""
    user: str = ""  # with password: etcd's own authentication
    password: str = ""

    @property
    def tls(self) -> bool:
        return bool(self.ca_file or self.cert_file)


def parse_store_url(text: str) -> StoreUrl:
    """The store `text` names; ValueError saying what is wrong and the forms accepted."""
    text = text.strip()
    if text in ("", "memory"):
        return StoreUrl(StoreKind.MEMORY)
    if text.startswith("file:"):
        path = text.removeprefix("file:").removeprefix("//")
        if not path or path.endswith("/"):
            raise ValueError(f"--store {text!r}: file: needs a file path (file:/var/lib/"
                             f"pdreg/intents.json)")
        return StoreUrl(StoreKind.FILE, path=path)
    if text.startswith("etcd://"):
        return _parse_etcd(text)
    raise ValueError(f"--store {text!r}: expected memory, file:PATH or "
                     f"etcd://HOST:PORT[,HOST:PORT...][/PREFIX]")


def _parse_etcd(text: str) -> StoreUrl:
    rest = text.removeprefix("etcd://")
    hosts, _, prefix = rest.partition("/")
    prefix = prefix.strip("/") or DEFAULT_PREFIX
    if not _PREFIX_OK.fullmatch(prefix):
        raise ValueError(f"--store {text!r}: prefix {prefix!r} must be up to 4 path parts of "
                         f"letters, digits and ._-")
    endpoints: list[str] = []
    for item in hosts.split(","):
        host, sep, port = item.strip().rpartition(":")
        if not sep or not _HOST_OK.fullmatch(host) or not port.isdigit() \
                or not 0 < int(port) < 65536:
            raise ValueError(f"--store {text!r}: endpoint {item!r} must be HOST:PORT")
        endpoint = f"{host}:{int(port)}"
        if endpoint not in endpoints:
            endpoints.append(endpoint)
    if len(endpoints) > MAX_ENDPOINTS:
        raise ValueError(f"--store {text!r}: at most {MAX_ENDPOINTS} endpoints")
    return StoreUrl(StoreKind.ETCD, endpoints=tuple(endpoints), prefix=prefix)
