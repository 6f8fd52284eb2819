"""The KV feed's socket plumbing: which of many ZeroMQ sockets to read now, at a cost in
what is ready rather than in what is followed, enough file descriptors for them, where
a member's advertised endpoint may lead, and one message off a socket."""

from __future__ import annotations

import ipaddress
import logging
import resource
import select
import socket
from collections.abc import Callable
from urllib.parse import urlsplit

import zmq

__all__ = ["Readiness", "needs_dns", "raise_fd_limit", "recv_frames", "resolve"]

logger = logging.getLogger(__name__)


class Readiness:
    """Which sockets may have something to read, at a cost in what is ready rather than
    in what is followed: epoll on each socket's ZMQ_FD, which fires when the socket's
    state changes (an edge), plus the sockets to look at again without waiting (not
    drained, just registered, or just written to: a send may consume the edge).
    zmq_poll() walks every socket on every call: ~1 ms at 2,000 sockets (1,000 members)
    on this project's machine, for a wake that usually brings one batch."""

    def __init__(self) -> None:
        # epoll itself, not `selectors`: a wake usually brings one batch, and the
        # selector's Python bookkeeping was a fifth of such a wake's own work.
        self._epoll = select.epoll()
        self._by_fd: dict[int, zmq.Socket] = {}
        self._again: set[zmq.Socket] = set()

    def register(self, sock: zmq.Socket) -> None:
        fd = sock.getsockopt(zmq.FD)
        self._epoll.register(fd, select.EPOLLIN)
        self._by_fd[fd] = sock
        self._again.add(sock)  # whatever arrived before it was registered

    def unregister(self, sock: zmq.Socket) -> None:
        """Before the socket closes (its FD goes with it)."""
        fd = sock.getsockopt(zmq.FD)
        self._epoll.unregister(fd)
        del self._by_fd[fd]
        self._again.discard(sock)

    def later(self, sock: zmq.Socket) -> None:
        self._again.add(sock)

    @property
    def pending(self) -> bool:
        """Sockets are marked to be looked at again without waiting."""
        return bool(self._again)

    def close(self) -> None:
        self._epoll.close()

    def wait(self, timeout_ms: int | None) -> set[zmq.Socket]:
        """The sockets to read now: those whose edge fired, and those marked `later`
        (then without waiting)."""
        again, self._again = self._again, set()
        timeout = 0.0 if again else -1.0 if timeout_ms is None else timeout_ms / 1000
        by_fd = self._by_fd
        for fd, _ in self._epoll.poll(timeout):
            sock = by_fd.get(fd)
            if sock is not None:
                again.add(sock)
        return again


def needs_dns(address: str) -> bool:
    """Whether resolving `address` (tcp://host:port) may ask a name server, so may block:
    a literal IP address does not."""
    try:
        ipaddress.ip_address(urlsplit(address).hostname or "")
    except ValueError:
        return True
    return False


def raise_fd_limit() -> None:
    """Soft open-files limit up to the hard one: a router following 1,000 members holds
    ~4,000 descriptors, and distributions' soft default is often 1,024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            logger.warning("[kv-feed] open-files limit stays %d (hard %d)", soft, hard)


def recv_frames(sock: zmq.Socket) -> list[bytes]:
    """One multipart message, without blocking (zmq.Again if none waits). Each frame
    says itself whether more follow: pyzmq's `recv_multipart` asks the socket instead
    (getsockopt RCVMORE, an enum lookup in Python per frame)."""
    frame = sock.recv(zmq.NOBLOCK, copy=False)
    frames = [frame.bytes]
    while frame.more:
        frame = sock.recv(zmq.NOBLOCK, copy=False)
        frames.append(frame.bytes)
    return frames


def resolve(address: str, allows: Callable[[str], bool]) -> str | None:
    """tcp://host:port -> tcp://ip:port for the first address the policy `allows`."""
    try:
        parts = urlsplit(address)
        host, port = parts.hostname, parts.port
        if parts.scheme != "tcp" or not host or not port:
            return None
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (ValueError, OSError):
        return None
    for info in infos:
        ip = str(info[4][0])
        if allows(ip):
            return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"
    return None
