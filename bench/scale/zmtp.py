"""The load generator's connections to the registry: ZMTP 3.1 as libzmq's DEALER speaks it.

Through libzmq each heartbeat cost the generator two threads' work: the send checks
the socket's mailbox (getpid, poll) and wakes libzmq's I/O thread (an eventfd, a thread
switch), which then sends it; 32-45 us of CPU per heartbeat on the 2-core machine the
figures in bench/RESULTS.md come from, taken from the registry under test (~13 us now,
most of it the send() itself). So the generator speaks the wire protocol itself over
plain non-blocking TCP sockets: the bytes a libzmq DEALER sends (greeting, READY, one
frame per message), one send() per message, as each agent of a real fleet sends its
heartbeat in its own segment (TCP_NODELAY, as libzmq).
"""

from __future__ import annotations

import contextlib
import socket

# A libzmq 4.3 DEALER's greeting (ZMTP 3.1, NULL mechanism, as client) and READY command.
_GREETING = b"\xff" + bytes(7) + b"\x01\x7f\x03\x01NULL" + bytes(16) + b"\x00" + bytes(31)
_READY = (b"\x04\x29\x05READY\x0bSocket-Type\x00\x00\x00\x06DEALER"
          b"\x08Identity\x00\x00\x00\x00")
_SHORT = [bytes((0, n)) for n in range(256)]  # a last frame's flags and size, up to 255 B
_READ_BYTES = 1 << 16


def _frame(payload: bytes) -> bytes:
    n = len(payload)
    return _SHORT[n] + payload if n < 256 else b"\x02" + n.to_bytes(8, "big") + payload


class Wire:
    """One DEALER-speaking connection to the registry's ROUTER (NULL security, as the
    bench's registry runs): whole messages out, whole single-frame messages in."""

    def __init__(self, address: str, timeout_s: float = 30.0) -> None:
        host, _, port = address.rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.sendall(_GREETING + _READY)
        self._buf = bytearray()
        while len(self._buf) < 64:  # the registry's greeting, then its READY
            self._fill()
        del self._buf[:64]
        while not self._frames(handshake=True):
            self._fill()
        self.sock.setblocking(False)
        self.backlog = bytearray()  # what the kernel would not take yet (kept in order)

    def _fill(self) -> bool:
        """What has arrived, up to 64 KiB, into the buffer; whether there may be more."""
        try:
            chunk = self.sock.recv(_READ_BYTES)
        except BlockingIOError:
            return False
        if not chunk:
            raise ConnectionError("the registry closed a generator connection")
        self._buf += chunk
        return len(chunk) == _READ_BYTES

    def send(self, payload: bytes) -> None:
        frame = _frame(payload)
        if self.backlog:
            self.backlog += frame
            self.flush()
            return
        try:
            sent = self.sock.send(frame)
        except BlockingIOError:
            sent = 0
        if sent < len(frame):
            self.backlog += frame[sent:]

    def flush(self) -> None:
        if self.backlog:
            with contextlib.suppress(BlockingIOError):
                del self.backlog[:self.sock.send(self.backlog)]

    def read(self) -> list[bytes]:
        """Every whole message that has arrived, in order (the socket is readable)."""
        while self._fill():
            pass
        return self._frames()

    def _frames(self, handshake: bool = False) -> list[bytes]:
        """The buffer's whole frames: its messages; with `handshake`, up to the first
        command (the registry's READY), returned as the one item."""
        buf, pos, n, out = self._buf, 0, len(self._buf), []
        while n - pos >= 2:
            flags = buf[pos]
            if flags & 0x02:  # a long frame
                if n - pos < 9:
                    break
                size, head = int.from_bytes(buf[pos + 1:pos + 9], "big"), 9
            else:
                size, head = buf[pos + 1], 2
            if n - pos < head + size:
                break
            body = bytes(buf[pos + head:pos + head + size])
            pos += head + size
            if flags & 0x04:  # a command: the handshake's READY, or ERROR
                if body[1:1 + body[0]] == b"ERROR":
                    raise ConnectionError(f"the registry refused a connection: {body!r}")
                if handshake:
                    out = [body]
                    break
            elif flags & 0x01:
                raise ConnectionError("a multipart reply (the registry sends one frame)")
            elif not handshake:
                out.append(body)
        del buf[:pos]
        return out

    def close(self) -> None:
        self.sock.close()
