"""One client request, from admission to its last byte: pairs, retries and migration.

    open     choose a pair, drive its handshake; a leg that fails before the client has
             seen anything is retried on a new pair (`--max-attempts` pairs in all)
    relay    non-streaming: D's answer whole; streaming: event by event, into one
             client stream
    migrate  a stream whose decode fails after the client has seen events continues on
             a new pair from the token ids sent so far (`--max-migrations` times)

A request is a sequence of legs. Each leg ends in a `LegOutcome`, and a small loop
dispatches on it: DONE and GIVE_UP answer the client (`Proxy.response`), RETRY runs the
next leg on a new pair, MIGRATE continues the stream on a new pair.

A `Proxy` lives for one request and holds its own state (members tried, attempts and
migrations left); everything shared reaches it through `ProxyPorts` (router/ports.py).
"""

from __future__ import annotations

import enum
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Final

from router.choice import Affinity
from router.continuation import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    DONE_EVENT,
    Reshaper,
    TokenTap,
    continuation_of,
    streams_token_ids,
)
from router.errors import no_capacity, upstream_failed
from router.handshakes.catalog import handshake_for
from router.handshakes.exchange import Exchange, LegFailure, UpstreamRejected, leg_failure
from router.inflight import Hold
from router.ports import ProxyPorts
from router.relay import ClientStream, LegEnd, relay_leg
from router.table import Pair
from serving.http_messages import Request, Response, StreamResponse

__all__ = ["Call", "LegOutcome", "Proxy"]

logger = logging.getLogger(__name__)

Answer = Response | StreamResponse  # what a request ends with
COMPANION_WAIT_S: Final = 5.0  # after D is done, how long SGLang's P leg may still take
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')


class LegOutcome(enum.Enum):
    DONE = enum.auto()  # the client has its whole answer (`Proxy.response`)
    RETRY = enum.auto()  # nothing reached the client: run the request on a new pair
    MIGRATE = enum.auto()  # the stream is under way: continue it on a new pair
    GIVE_UP = enum.auto()  # the answer is final: an error, or the stream ended with one


@dataclass(slots=True)
class Call:
    """One client request as the router handles it."""

    path: str
    body: dict[str, Any]  # the client's, internal fields stripped
    model: str
    stream: bool
    affinity: Affinity  # the policy's input, computed at admission
    request_id: str
    started: float  # time.monotonic() at arrival
    wants_ids: bool  # the client asked for return_token_ids itself
    include_usage: bool
    migratable: str | None  # why its stream could not be continued; None if it can
    ticket: Any = None  # admission's (router/admission/tickets.py Ticket), when it is on

    @property
    def chat(self) -> bool:
        return self.path.endswith(CHAT_PATH)


class NoPair(Exception):
    """No pair could even be tried (none routable, or every one tried already)."""


@dataclass(slots=True)
class Opened:
    """A pair whose decode has answered: its exchange and the decode's in-flight slot."""

    pair: Pair
    exchange: Exchange
    decode_hold: Hold
    opened_at: float

    def close(self) -> None:
        self.exchange.close()
        self.decode_hold.release()


@dataclass(slots=True)
class Stream:
    """A streamed request's state across its legs."""

    client: ClientStream
    tap: TokenTap
    path: str
    body: dict[str, Any]
    ask_ids: bool  # ask engines for token ids: the stream may have to migrate
    migrations_left: int
    reshaper: Reshaper | None = None
    failure: LegFailure | None = None  # the failure a MIGRATE continues after
    next_body: dict[str, Any] | None = None  # and the body it continues with


@dataclass(slots=True)
class Proxy:
    call: Call
    ports: ProxyPorts
    tried: list[str] = field(default_factory=list)
    attempts_left: int = 0
    last_failure: LegFailure | None = None
    response: Answer | None = None  # the answer, once DONE or GIVE_UP

    def __post_init__(self) -> None:
        self.attempts_left = self.ports.max_attempts

    # --- opening a pair ---------------------------------------------------------------

    async def open(self, path: str, body: dict[str, Any], *, ask_ids: bool = False,
                   continuing: bool = False) -> Opened:
        """A pair whose decode answered (any status); retries failed legs on new pairs.
        `ask_ids`: ask for token ids (return_token_ids) where the pair's engines can.
        `continuing`: a stream under way, which may use quarantined members if no other.

        Raises NoPair when nothing (more) can be tried, UpstreamRejected on a prefill's
        4xx (the client's request is at fault)."""
        while self.attempts_left > 0:
            pair = self._choose(continuing)
            if pair is None:
                break
            self.attempts_left -= 1
            opened = await self._open_pair(pair, path, self._leg_body(pair, path, body,
                                                                      ask_ids))
            if opened is not None:
                return opened
        raise NoPair

    def _choose(self, continuing: bool) -> Pair | None:
        pairing, call = self.ports.pairing, self.call
        pair = pairing.choose(call.model, call.affinity, self.tried, ticket=call.ticket)
        if pair is None and continuing:
            pair = pairing.choose(call.model, call.affinity, self.tried,
                                  despite_quarantine=True, ticket=call.ticket)
        return pair

    @staticmethod
    def _leg_body(pair: Pair, path: str, body: dict[str, Any], ask_ids: bool
                  ) -> dict[str, Any]:
        if ask_ids and body.get("return_token_ids") is not True and streams_token_ids(
                pair.prefill.protocol, path):
            return {**body, "return_token_ids": True}
        return body

    async def _open_pair(self, pair: Pair, path: str, body: dict[str, Any]
                         ) -> Opened | None:
        """The pair's handshake; None if a leg failed (recorded, for a retry)."""
        ports = self.ports
        decode_hold, prefill_hold = ports.pairing.hold(pair, self.call.ticket)
        try:
            exchange = await handshake_for(ports.handshakes, pair).open(
                ports.pool, pair, path, body, self.call.request_id)
        except LegFailure as failure:
            decode_hold.release()
            self._failed(failure, pair.prefill.id, pair.decode.id)
            ports.record.retry(f"{failure.role}_failed")
            return None
        except BaseException:
            decode_hold.release()
            raise
        finally:
            if prefill_hold is not None:  # the prefill's part ends with the handshake
                prefill_hold.release()
        return Opened(pair, exchange, decode_hold, ports.clock())

    def _failed(self, failure: LegFailure, *member_ids: str) -> None:
        self.ports.outcomes.on_failure(failure)
        self.tried.extend(member_ids)
        self.last_failure = failure

    def _answer(self, response: Answer,
                outcome: LegOutcome = LegOutcome.DONE) -> LegOutcome:
        self.response = response
        return outcome

    def _no_pair(self) -> LegOutcome:
        """503 (or 404) when nothing could be tried, 502 when everything tried failed."""
        record, model = self.ports.record, self.call.model
        if self.last_failure is None:
            known = self.ports.pairing.knows(model)
            record.outcome(model, "no_capacity" if known else "model_not_found")
            return self._answer(no_capacity(model, known=known), LegOutcome.GIVE_UP)
        record.outcome(model, "upstream_error")
        return self._answer(upstream_failed(self.last_failure.public), LegOutcome.GIVE_UP)

    # --- non-streaming ----------------------------------------------------------------

    async def whole(self) -> Answer:
        """D's answer, read whole and relayed. A decode that dies before its answer is
        in is re-issued whole on a new pair."""
        while await self._whole_leg() is LegOutcome.RETRY:
            pass
        assert self.response is not None
        return self.response

    async def _whole_leg(self) -> LegOutcome:
        call, ports = self.call, self.ports
        try:
            opened = await self.open(call.path, call.body)
        except NoPair:
            return self._no_pair()
        try:
            response = opened.exchange.response
            try:
                data = await response.read()
            except OSError as exc:
                self._failed(leg_failure(opened.pair.decode, "decode", exc, "read"),
                             opened.pair.decode.id)
                ports.record.retry("decode_failed")
                return LegOutcome.RETRY
            await self._finish_companion(opened.exchange)
            ok = response.status < 400
            ports.record.outcome(call.model, "ok" if ok else "client_error")
            if ok:
                self._observe_whole(opened, data, ports.clock())
            return self._answer(Response(response.status, data,
                                         content_type=response.content_type))
        finally:
            self._observe_prefill(opened)
            opened.close()

    def _observe_whole(self, opened: Opened, data: bytes, now: float) -> None:
        record, call = self.ports.record, self.call
        exchange = opened.exchange
        prefill_s = exchange.prefill_s
        # TTFT without a stream: the first token exists when the prefill's part is done.
        # A mixed member's answer has no such moment: its whole answer it is.
        first_token_at = now if prefill_s is None else exchange.prefill_started + prefill_s
        record.ttft(call.model, first_token_at - call.started)
        record.e2e(call.model, now - call.started)
        # rfind, then the pattern at that place: a regex search from the answer's tail
        # cost more than the rest of this method.
        at = data.rfind(b'"completion_tokens"', max(0, len(data) - 512))
        tokens = _COMPLETION_TOKENS.match(data, at) if at >= 0 else None
        if tokens is not None and int(tokens.group(1)) > 0:
            decode_s = now - (exchange.decode_started or opened.opened_at)
            self.ports.outcomes.observe_decode(opened.pair.decode,
                                               decode_s / int(tokens.group(1)))

    # --- streaming --------------------------------------------------------------------

    async def stream(self, request: Request) -> Answer:
        call = self.call
        ask_ids = call.migratable is None and self.ports.max_migrations > 0
        s = Stream(client=ClientStream(request),
                   tap=TokenTap(strip=not call.wants_ids, chat=call.chat,
                                watch_usage=call.include_usage, hold_back=ask_ids),
                   path=call.path, body=call.body, ask_ids=ask_ids,
                   migrations_left=self.ports.max_migrations)
        try:
            while True:
                outcome = await self._stream_leg(s)
                if outcome is LegOutcome.MIGRATE:
                    self._migrate(s)
                elif outcome is not LegOutcome.RETRY:  # DONE or GIVE_UP: answered
                    assert self.response is not None
                    return self.response
        except ConnectionError:
            # A write to the client's closing socket: the client hung up (often right
            # after [DONE], before the stream's end). A cancel, not an upstream failure.
            logger.debug("[router] client left mid-response model=%s", call.model)
            self.ports.record.outcome(call.model, "cancelled")
            return s.client.response or Response(499)

    async def _stream_leg(self, s: Stream) -> LegOutcome:
        """One pair's leg of a stream: open it, relay its events, say how it ended."""
        try:
            opened = await self.open(s.path, s.body, ask_ids=s.ask_ids,
                                     continuing=s.client.started)
        except NoPair:
            if not s.client.started:
                return self._no_pair()
            return await self._give_up(s, "no pair is left to continue on", "no_pair")
        except UpstreamRejected as rejected:
            if not s.client.started:
                raise
            return await self._give_up(s, f"the continuation was refused (HTTP "
                                       f"{rejected.status})", "no_pair")
        try:
            response = opened.exchange.response
            if response.status != 200:  # a 4xx from the decode: the client's fault
                if not s.client.started:
                    return self._answer(await self._relay_refusal(opened))
                return await self._give_up(s, "the continuation was refused (HTTP "
                                           f"{response.status})", "no_pair")
            end = await relay_leg(
                opened.exchange, opened.pair.decode, s.client, s.tap, s.reshaper,
                self.ports.record.itl(self.call.model),
                lambda at, o=opened: self._first_read(o, at, s.client.started))
            if end.failure is None:
                await self._finish_companion(opened.exchange)
                self._observe_decode(opened, end)
        finally:
            self._observe_prefill(opened)
            opened.close()
        if end.failure is None:
            return await self._stream_done(s)
        return await self._after_failure(s, opened.pair, end.failure)

    async def _after_failure(self, s: Stream, pair: Pair, failure: LegFailure
                             ) -> LegOutcome:
        """A decode failed mid-answer: retry (nothing sent), complete (everything was),
        migrate (it can be continued) or give up."""
        s.tap.drop_held()
        self._failed(failure, pair.decode.id)
        if not s.client.started:  # nothing sent yet: an ordinary retry
            self.ports.record.retry("decode_failed")
            return LegOutcome.RETRY
        if s.tap.finished:  # only the end was lost: complete it here
            return await self._complete(s)
        why = "budget" if s.migrations_left <= 0 else self._why_not_continue(s.tap)
        if why:
            return await self._give_up(s, failure.public, why)
        next_body = continuation_of(self.call.path, self.call.body, s.tap.prompt_ids or [],
                                    s.tap.sent_ids())
        if next_body is None:  # every token the client asked for was sent
            return await self._complete(s)
        s.failure, s.next_body = failure, next_body
        return LegOutcome.MIGRATE

    def _migrate(self, s: Stream) -> None:
        """Count and log a migration; the next leg continues from the tokens sent."""
        assert s.failure is not None and s.next_body is not None
        call = self.call
        s.migrations_left -= 1
        self.ports.record.migration(s.failure.kind)
        logger.warning("[router] migrate request=%s after %s: %d tokens sent, %d "
                       "migrations left", call.request_id, s.failure.kind,
                       s.tap.sent_count(), s.migrations_left)
        self.attempts_left = self.ports.max_attempts  # a fresh start, on a new pair
        if s.reshaper is None:
            s.reshaper = Reshaper.for_stream(s.tap, chat=call.chat, keep_ids=call.wants_ids)
        else:
            s.reshaper.sent_before = s.tap.sent_count()
        s.path, s.body = COMPLETIONS_PATH, s.next_body

    def _why_not_continue(self, tap: TokenTap) -> str:
        if self.call.migratable is not None or tap.unmigratable:
            return "request_shape"
        if tap.prompt_ids is None:
            return "no_token_ids"
        return ""

    async def _stream_done(self, s: Stream) -> LegOutcome:
        await s.client.end()
        self._record_ok()
        return self._answer(s.client.response or Response(204))

    async def _give_up(self, s: Stream, message: str, why: str) -> LegOutcome:
        call, record = self.call, self.ports.record
        record.unmigratable(why)
        record.outcome(call.model, "failed_midstream")
        logger.warning("[router] stream failed request=%s: %s (not migrated: %s)",
                       call.request_id, message, why)
        await s.client.fail(message)
        return self._answer(s.client.response or Response(502),
                            LegOutcome.GIVE_UP)

    async def _complete(self, s: Stream) -> LegOutcome:
        """The generation had finished; the engine died before the stream's end."""
        call, tap = self.call, s.tap
        if call.include_usage and not tap.usage_sent and tap.prompt_ids is not None:
            shaper = s.reshaper or Reshaper.for_stream(tap, chat=call.chat, keep_ids=False)
            await s.client.write(shaper.usage_event(tap.sent_count()))
        await s.client.write(DONE_EVENT)
        return await self._stream_done(s)

    def _record_ok(self) -> None:
        call, record = self.call, self.ports.record
        record.outcome(call.model, "ok")
        record.e2e(call.model, self.ports.clock() - call.started)

    async def _relay_refusal(self, opened: Opened) -> Response:
        response = opened.exchange.response
        try:
            data = await response.read()
        except OSError:
            data = b""
        self.ports.record.outcome(self.call.model, "client_error")
        return Response(response.status, data, content_type=response.content_type)

    def _first_read(self, opened: Opened, at: float, continuing: bool) -> None:
        if not continuing:
            self.ports.record.ttft(self.call.model, at - self.call.started)
        if opened.pair.direct:  # a mixed member's "prefill": its time to first token
            self.ports.outcomes.observe_prefill(opened.pair.prefill, at - opened.opened_at)

    # --- bookkeeping --------------------------------------------------------------------

    async def _finish_companion(self, exchange: Exchange) -> None:
        if exchange.companion is not None:
            failure = await exchange.finish(COMPANION_WAIT_S)
            if failure is not None:  # D answered anyway; still keep that P out a while
                self.ports.outcomes.on_failure(failure)

    def _observe_prefill(self, opened: Opened) -> None:
        exchange = opened.exchange
        if exchange.prefill_s is not None:
            self.ports.outcomes.observe_prefill(opened.pair.prefill, exchange.prefill_s)
        if exchange.prefill_cached_tokens is not None:
            self.ports.outcomes.observe_cached(opened.pair, exchange.prefill_cached_tokens)

    def _observe_decode(self, opened: Opened, end: LegEnd) -> None:
        per_read = end.per_read_s()
        if per_read is not None:
            self.ports.outcomes.observe_decode(opened.pair.decode, per_read)
