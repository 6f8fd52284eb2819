"""A `MembershipView`'s ZeroMQ plumbing: one context, the poller its thread waits on, and
the wake pair by which another thread cuts that wait short (a close, a model asked for).

The view thread alone opens, polls and closes sockets here; `wake` and `shut` may come
from any thread (they share only the wake's PUSH socket, under a lock).
"""

from __future__ import annotations

import contextlib
import threading

import zmq

from registry.security import ClientCurve

__all__ = ["ViewSockets"]


class ViewSockets:
    def __init__(self, curve: ClientCurve | None) -> None:
        self.curve = curve
        self._ctx = zmq.Context()
        wake = f"inproc://pdreg-view-{id(self)}"
        self._wake_rx = self._ctx.socket(zmq.PULL)
        self._wake_rx.bind(wake)
        self._wake_tx = self._ctx.socket(zmq.PUSH)
        self._wake_tx.connect(wake)
        self._lock = threading.Lock()
        self._shut = False
        self._poller = zmq.Poller()
        self._poller.register(self._wake_rx, zmq.POLLIN)

    def socket(self, kind: int) -> zmq.Socket:
        """A socket that drops what it holds when closed, with CURVE if the view has it."""
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if self.curve is not None:
            self.curve.apply(sock)
        return sock

    def polled(self, sock: zmq.Socket) -> zmq.Socket:
        self._poller.register(sock, zmq.POLLIN)
        return sock

    def dealer(self, address: str) -> zmq.Socket:
        """A polled DEALER to a registry's control address."""
        sock = self.socket(zmq.DEALER)
        sock.connect(f"tcp://{address}")
        return self.polled(sock)

    def close(self, sock: zmq.Socket) -> None:
        self._poller.unregister(sock)
        sock.close(linger=0)

    def poll(self, timeout_ms: int) -> dict[zmq.Socket, int]:
        """The sockets ready within `timeout_ms` (a wake ends the wait and is consumed)."""
        ready = dict(self._poller.poll(timeout_ms))
        if self._wake_rx in ready:
            while True:
                try:
                    self._wake_rx.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
        return ready

    def wake(self) -> None:
        """End the view thread's wait (from any thread; nothing once shut)."""
        with self._lock:
            if not self._shut:
                with contextlib.suppress(zmq.ZMQError):
                    self._wake_tx.send(b"", zmq.NOBLOCK)

    def shut(self) -> bool:
        """Wake the thread a last time; whether this call did (only the first does)."""
        with self._lock:
            if self._shut:
                return False
            self._shut = True
            with contextlib.suppress(zmq.ZMQError):
                self._wake_tx.send(b"", zmq.NOBLOCK)
            return True

    @property
    def destroyed(self) -> bool:
        return bool(self._ctx.closed)

    def destroy(self) -> None:
        """Close every socket and the context (once the view thread is gone)."""
        self._ctx.destroy(linger=0)
