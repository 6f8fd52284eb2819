"""Transport security: ZeroMQ CURVE on the registry's sockets, with pyzmq's `zmq.auth`.

The ZeroMQ Guide's "Ironhouse": the registry has a key pair; every client has its own and
knows the registry's public key; a ZAP handler (`zmq.auth.thread.ThreadAuthenticator`)
lets in only the public keys found in `--allowed-clients DIR`, or any key when no
directory is given (then CURVE still encrypts and authenticates the registry). A client
without a key, or with a key not allowed, fails the handshake: it gets no answer and
changes nothing. Key files are the ones `zmq.auth.create_certificates` writes
(`pdreg keys generate`): `NAME.key` (public) and `NAME.key_secret` (the pair).

Nothing here is cryptography of our own: libzmq does CURVE, pyzmq the ZAP protocol.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

__all__ = ["ClientCurve", "ConnectionLimiter", "CurveServer", "ServerCurve", "generate_keys",
           "is_loopback", "load_public_keys"]

logger = logging.getLogger(__name__)

ZAP_DOMAIN: Final = "*"
SECRET_FILE_MODE: Final = 0o600


class KeyFileError(ValueError):
    """A key file that cannot be used; the message names the file and the fix."""


def _load(path: str | os.PathLike[str], what: str, *, need_secret: bool) -> tuple[bytes, bytes]:
    try:
        public, secret = zmq.auth.load_certificate(os.fspath(path))
    except (OSError, ValueError) as exc:
        raise KeyFileError(f"{what} {os.fspath(path)!r}: {exc}") from None
    if need_secret and not secret:
        raise KeyFileError(f"{what} {os.fspath(path)!r} holds no secret key; give the "
                           f"'.key_secret' file `pdreg keys generate` wrote")
    return public, secret or b""


def load_public_keys(directory: str | os.PathLike[str]) -> list[bytes]:
    """The public keys of every `*.key` file in `directory` (what the ZAP handler allows)."""
    path = Path(directory)
    if not path.is_dir():
        raise KeyFileError(f"allowed clients {os.fspath(path)!r} is not a directory")
    keys = [public for public, _ in zmq.auth.load_certificates(os.fspath(path)).items()]
    if not keys:
        raise KeyFileError(f"allowed clients {os.fspath(path)!r} holds no public key "
                           f"files (*.key)")
    return keys


@dataclass(frozen=True, slots=True)
class ClientCurve:
    """What a client needs to reach a CURVE registry: its public key and our own pair.

    Keys are Z85 text, as in the key files.
    """

    server_public: bytes
    public: bytes
    secret: bytes

    @classmethod
    def from_files(cls, registry_public_key: str | os.PathLike[str],
                   curve_key: str | os.PathLike[str]) -> ClientCurve:
        server_public, _ = _load(registry_public_key, "registry public key", need_secret=False)
        public, secret = _load(curve_key, "client key", need_secret=True)
        return cls(server_public, public, secret)

    def apply(self, sock: zmq.Socket) -> None:
        """Make `sock` a CURVE client of the registry; call before `connect`."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_serverkey = self.server_public


@dataclass(frozen=True, slots=True)
class ServerCurve:
    """The registry's key pair, and the public keys allowed to connect (None: any key)."""

    public: bytes
    secret: bytes
    allowed_clients: Path | None = None

    @classmethod
    def from_files(cls, secret_key: str | os.PathLike[str],
                   allowed_clients: str | os.PathLike[str] | None = None) -> ServerCurve:
        public, secret = _load(secret_key, "registry secret key", need_secret=True)
        allowed = Path(allowed_clients) if allowed_clients else None
        if allowed is not None:
            load_public_keys(allowed)  # fail at start, not at the first client
        return cls(public, secret, allowed)


# New connections per source address (ZAP, below). A ZeroMQ identity is one connection,
# so this is what keeps per-identity limits (syncs) from being dodged with fresh
# identities: one address gets a burst, then a few new connections a second. Loopback
# peers are not limited (this machine's own clients and benchmarks).
CONNECT_BURST: Final = 32
CONNECTS_PER_S: Final = 1.0
MAX_ADDRESSES_TRACKED: Final = 10_000
REFUSAL_LOG_EVERY_S: Final = 5.0


class ConnectionLimiter:
    """A token bucket of new connections per source address. Pure: the clock is passed."""

    def __init__(self, burst: float | None = None, per_s: float | None = None) -> None:
        self.burst = CONNECT_BURST if burst is None else burst
        self.per_s = CONNECTS_PER_S if per_s is None else per_s
        self.refused = 0
        self._buckets: dict[str, tuple[float, float]] = {}  # address -> (tokens, at)

    def allow(self, address: str, now: float) -> bool:
        try:
            if ipaddress.ip_address(address).is_loopback:
                return True
        except ValueError:
            pass  # not an IP (ipc://): limit it by name like any other
        tokens, at = self._buckets.get(address, (self.burst, now))
        tokens = min(self.burst, tokens + max(0.0, now - at) * self.per_s)
        if len(self._buckets) >= MAX_ADDRESSES_TRACKED and address not in self._buckets:
            # Forget the fullest buckets first: they are the ones that lose nothing.
            self._buckets = {a: b for a, b in self._buckets.items() if b[0] < self.burst - 1}
        if tokens < 1.0:
            self._buckets[address] = (tokens, now)
            self.refused += 1
            return False
        self._buckets[address] = (tokens - 1.0, now)
        return True


class _GuardedAuthenticator(ThreadAuthenticator):
    """pyzmq's authenticator, first asking the limiter (ZAP thread only)."""

    limiter: ConnectionLimiter
    _logged_at = 0.0

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        if len(msg) >= 6:
            address = msg[3].decode("utf-8", "replace")
            now = time.monotonic()
            if not self.limiter.allow(address, now):
                if now - self._logged_at > REFUSAL_LOG_EVERY_S:
                    self._logged_at = now
                    logger.warning("[registry] refusing new connections from %s: more than "
                                   "%d at once or %.0f/s (%d refused so far)", address,
                                   self.limiter.burst, self.limiter.per_s,
                                   self.limiter.refused)
                self._send_zap_reply(msg[1], b"400", b"too many connections")
                return
        await super().handle_zap_message(msg)


class CurveServer:
    """The ZAP handler for one context, and the CURVE settings for its server sockets.

    With `curve` None it only limits new connections per address (`ConnectionLimiter`),
    for sockets without CURVE.
    """

    def __init__(self, context: zmq.Context, curve: ServerCurve | None,
                 limiter: ConnectionLimiter | None = None) -> None:
        self.curve = curve
        self.limiter = limiter or ConnectionLimiter()
        self._auth = _GuardedAuthenticator(context, log=logger)
        self._auth.limiter = self.limiter
        self._auth.start()
        if curve is None:
            return
        if curve.allowed_clients is None:
            self._auth.configure_curve(domain=ZAP_DOMAIN, location=zmq.auth.CURVE_ALLOW_ANY)
            logger.info("[registry] CURVE on; any client key may connect (no --allowed-clients)")
        else:
            self._auth.configure_curve(domain=ZAP_DOMAIN,
                                       location=os.fspath(curve.allowed_clients))
            logger.info("[registry] CURVE on; clients allowed: %d keys in %s",
                        len(load_public_keys(curve.allowed_clients)), curve.allowed_clients)

    def secure(self, sock: zmq.Socket) -> None:
        """Make `sock` a CURVE server (with a curve) whose connections pass the ZAP
        handler; call before `bind`."""
        if self.curve is not None:
            sock.curve_secretkey = self.curve.secret
            sock.curve_publickey = self.curve.public
            sock.curve_server = True
        sock.zap_domain = ZAP_DOMAIN.encode()

    def stop(self) -> None:
        """Safe twice."""
        if self._auth.is_alive():
            self._auth.stop()


def generate_keys(directory: str | os.PathLike[str], name: str, *,
                  overwrite: bool = False) -> tuple[Path, Path]:
    """Write `NAME.key` (public) and `NAME.key_secret` (pair, mode 0600) into `directory`.

    The pair is written into a private (0700) scratch directory first and moved into
    place, so the secret is never readable by others, not even for a moment.
    """
    path = Path(directory)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    public_file, secret_file = path / f"{name}.key", path / f"{name}.key_secret"
    if not overwrite and (public_file.exists() or secret_file.exists()):
        raise FileExistsError(f"{public_file} or {secret_file} exists; pass --force to "
                              f"replace the key (clients holding the old one are locked out)")
    with tempfile.TemporaryDirectory(dir=path, prefix=".keys-") as scratch:
        public, secret = zmq.auth.create_certificates(scratch, name)
        os.chmod(secret, SECRET_FILE_MODE)
        os.replace(secret, secret_file)
        os.replace(public, public_file)
    return public_file, secret_file


def is_loopback(host: str) -> bool:
    """Whether binding `host` exposes nothing beyond this machine."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback
                                   for a in addresses)
