"""A member that speaks the wire protocol by hand, to test the registry's side of it.

It holds what a real agent holds (its nonce, the session the registry gave it, its seq)
and signs what an agent signs, so tests can also send exactly what an attacker would:
the same messages without the secret, replays, other members' ids.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import msgspec
import zmq

from registry import sessions
from registry.security import ClientCurve
from wire.protocol import (
    Bye,
    ByeReason,
    Endpoints,
    Heartbeat,
    Load,
    MemberSpec,
    MemberState,
    Register,
    Reply,
    ReplyStatus,
    Report,
    Role,
    Snapshot,
    make_encoder,
    reply_decoder,
)

WAIT_S = 10.0  # generous: other test processes share two cores


def member_spec(member_id: str = "prefill-127.0.0.1-9001", incarnation: int = 1,
                role: Role = Role.PREFILL, model: str = "tiny",
                http: str = "http://127.0.0.1:9001") -> MemberSpec:
    return MemberSpec(id=member_id, incarnation=incarnation, role=role,
                      model=model if role is not Role.API_SERVER else "",
                      protocol="openai" if role is Role.API_SERVER else "reference",
                      endpoints=Endpoints(http=http))


class RawMember:
    def __init__(self, address: str, member_id: str = "prefill-127.0.0.1-9001",
                 incarnation: int = 1, role: Role = Role.PREFILL, token: str = "",
                 curve: ClientCurve | None = None, spec: MemberSpec | None = None) -> None:
        self.spec = spec or member_spec(member_id, incarnation, role)
        self.token = token
        self.address = address
        self.curve = curve
        self.nonce = sessions.new_nonce()
        self.session = b""
        self._seq = itertools.count(1)
        self.last_frames: list[bytes] = []  # what it sent last (for replay tests)
        self._ctx = zmq.Context()
        self.sock = self._ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            curve.apply(self.sock)
        self.sock.connect(f"tcp://{address}")
        self._encoder = make_encoder()
        self._decoder = reply_decoder()

    @property
    def id(self) -> str:
        return self.spec.id

    def next_seq(self) -> int:
        return next(self._seq)

    # --- raw -----------------------------------------------------------------------------

    def send_frames(self, frames: list[bytes]) -> Reply | Snapshot:
        self.last_frames = list(frames)
        self.sock.send_multipart(frames)
        return self.receive()

    def ask(self, message: object) -> Reply | Snapshot:
        return self.send_frames([self._encoder.encode(message)])

    def ask_signed(self, message: object) -> Reply | Snapshot:
        """Send `message` sealed with this member's session, as an agent does."""
        return self.send_frames([sessions.seal(self.session, self._encoder.encode(message))])

    def receive(self, timeout_s: float = WAIT_S) -> Reply | Snapshot:
        assert self.sock.poll(timeout_s * 1e3), "registry did not reply"
        return self._decoder.decode(self.sock.recv())

    def answers(self, timeout_s: float) -> bool:
        """Whether a reply arrives within `timeout_s` (for CURVE refusal tests)."""
        return bool(self.sock.poll(timeout_s * 1e3))

    # --- what an agent sends ----------------------------------------------------------

    def register_message(self, state: MemberState = MemberState.READY,
                         load: Load | None = None, spec: MemberSpec | None = None) -> Register:
        """The Register an agent sends: the token proved, never sent (registry.sessions)."""
        register = Register(spec=spec or self.spec, nonce=self.nonce, state=state,
                            load=load or Load())
        if not self.token:
            return register
        proof = sessions.register_proof(sessions.token_key(self.token),
                                        self._encoder.encode(register))
        return msgspec.structs.replace(register, proof=proof)

    def register(self, state: MemberState = MemberState.READY, load: Load | None = None,
                 spec: MemberSpec | None = None) -> Reply:
        reply = self.ask(self.register_message(state, load, spec))
        assert isinstance(reply, Reply)
        if reply.status is ReplyStatus.OK:
            self.session = self.open(reply)
        return reply

    def open(self, reply: Reply) -> bytes:
        """The session in `reply`, opened with this member's token and nonce if sealed."""
        if not reply.session_salt:
            return reply.session
        return sessions.open_session(sessions.token_key(self.token), self.nonce,
                                     reply.session_salt, reply.session)

    def heartbeat(self, load: Load | None = None,
                  state: MemberState = MemberState.READY) -> Reply:
        return self.ask_signed(Heartbeat(self.spec.id, self.spec.incarnation, self.next_seq(),
                                         state, load or Load()))

    def bye(self, reason: ByeReason = ByeReason.SHUTDOWN) -> Reply:
        return self.ask_signed(Bye(self.spec.id, self.spec.incarnation, self.next_seq(),
                                   reason))

    def report(self, member_id: str, incarnation: int, problem: str = "refused") -> Reply:
        return self.ask_signed(Report(self.spec.id, self.spec.incarnation, self.next_seq(),
                                      member_id, incarnation, problem))

    # --- helpers ------------------------------------------------------------------------

    def restart(self, incarnation: int) -> None:
        """Become the next process of this id: a newer incarnation, a new nonce."""
        self.spec = msgspec.structs.replace(self.spec, incarnation=incarnation)
        self.nonce = sessions.new_nonce()
        self.session = b""
        self._seq = itertools.count(1)

    def twin(self) -> RawMember:
        """The same member on a socket of its own (same session, shared seq counter)."""
        other = RawMember(self.address, token=self.token, curve=self.curve, spec=self.spec)
        other.nonce, other.session, other._seq = self.nonce, self.session, self._seq
        return other

    @contextmanager
    def kept_alive(self, interval_s: float) -> Iterator[None]:
        """Heartbeat from a thread of its own (own socket) while slow things run."""
        stop = threading.Event()

        def beat() -> None:
            twin = self.twin()
            try:
                while not stop.wait(interval_s / 2):
                    twin.heartbeat()
            finally:
                twin.close()

        thread = threading.Thread(target=beat, daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def close(self) -> None:
        self._ctx.destroy(linger=0)
