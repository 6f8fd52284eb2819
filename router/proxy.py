"""One client request, from admission to its last byte: pairs, retries and migration.

    open     choose a pair, drive its handshake; a leg that fails before the client has
             seen anything is retried on a new pair (`--max-attempts` pairs in all)
    relay    non-streaming: D's answer whole; streaming: event by event, into one
             client stream
    migrate  a stream whose decode fails after the client has seen events continues on
             a new pair from the token ids sent so far (`--max-migrations` times)

The router (`router.app.Router`) owns the shared state (pairing, in-flight counts,
quarantine, latency, metrics); a `Proxy` lives for one request and holds its own:
which members it tried, how many attempts and migrations are left.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from aiohttp import web

from router.adapters import Exchange, LegFailure, UpstreamRejected, adapter_for, leg_failure
from router.continuation import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    Reshaper,
    TokenTap,
    continuation_of,
    streams_token_ids,
)
from router.inflight import Hold
from router.relay import ClientStream, LegEnd, relay_leg
from router.table import Pair

if TYPE_CHECKING:
    from router.app import Router

__all__ = ["Call", "Proxy"]

logger = logging.getLogger(__name__)

COMPANION_WAIT_S: Final = 5.0  # after D is done, how long SGLang's P leg may still take
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')


@dataclass(slots=True)
class Call:
    """One client request as the router handles it."""

    path: str
    body: dict[str, Any]  # the client's, internal fields stripped
    model: str
    stream: bool
    key: int  # the policy's affinity key
    request_id: str
    started: float  # time.monotonic() at arrival
    wants_ids: bool  # the client asked for return_token_ids itself
    include_usage: bool
    migratable: str | None  # why its stream could not be continued; None if it can

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
class Proxy:
    router: Router
    call: Call
    tried: list[str] = field(default_factory=list)
    attempts_left: int = 0
    last_failure: LegFailure | None = None

    def __post_init__(self) -> None:
        self.attempts_left = self.router.max_attempts

    # --- opening a pair ---------------------------------------------------------------

    async def open(self, path: str, body: dict[str, Any], *, ask_ids: bool = False
                   ) -> Opened:
        """A pair whose decode answered (any status); retries failed legs on new pairs.
        `ask_ids`: ask for token ids (return_token_ids) where the pair's engines can.

        Raises NoPair when nothing (more) can be tried, UpstreamRejected on a prefill's
        4xx (the client's request is at fault)."""
        router = self.router
        while self.attempts_left > 0:
            pair = router.choose(self.call.model, self.call.key, self.tried)
            if pair is None:
                break
            self.attempts_left -= 1
            leg_body = body
            if ask_ids and body.get("return_token_ids") is not True and streams_token_ids(
                    pair.prefill.protocol, path):
                leg_body = {**body, "return_token_ids": True}
            decode_hold, prefill_hold = router.hold(pair)
            try:
                exchange = await adapter_for(router.adapters, pair).open(
                    router.upstream(), pair, path, leg_body, self.call.request_id)
            except LegFailure as failure:
                decode_hold.release()
                router.on_failure(failure)
                router.metrics.retries.labels(f"{failure.role}_failed").inc()
                self.tried.extend((pair.prefill.id, pair.decode.id))
                self.last_failure = failure
                continue
            except BaseException:
                decode_hold.release()
                raise
            finally:
                if prefill_hold is not None:  # the prefill's part ends with the handshake
                    prefill_hold.release()
            return Opened(pair, exchange, decode_hold, time.monotonic())
        raise NoPair

    def no_pair_response(self) -> web.Response:
        """503 when nothing could be tried, 502 when everything tried failed."""
        router, model = self.router, self.call.model
        if self.last_failure is None:
            return router.no_capacity(model)
        router.count(model, "upstream_error")
        return router.error(502, f"no pair could serve the request; last: "
                            f"{self.last_failure.public}", "upstream_error",
                            "upstream_failed")

    # --- non-streaming ----------------------------------------------------------------

    async def whole(self) -> web.StreamResponse:
        """D's answer, read whole and relayed. A decode that dies before its answer is
        in is re-issued whole on a new pair."""
        router, call = self.router, self.call
        while True:
            try:
                opened = await self.open(call.path, call.body)
            except NoPair:
                return self.no_pair_response()
            try:
                response = opened.exchange.response
                try:
                    data = await response.read()
                except OSError as exc:
                    failure = leg_failure(opened.pair.decode, "decode", exc, "read")
                    router.on_failure(failure)
                    router.metrics.retries.labels("decode_failed").inc()
                    self.tried.append(opened.pair.decode.id)
                    self.last_failure = failure
                    continue
                await self._finish_companion(opened.exchange)
                now = time.monotonic()
                ok = response.status < 400
                router.count(call.model, "ok" if ok else "client_error")
                if ok:
                    self._observe_whole(opened, data, now)
                return web.Response(status=response.status, body=data,
                                    headers={"Content-Type": response.content_type})
            finally:
                self._observe_prefill(opened)
                opened.close()

    def _observe_whole(self, opened: Opened, data: bytes, now: float) -> None:
        router, model = self.router, self.call.model
        exchange = opened.exchange
        prefill_s = exchange.prefill_s
        # TTFT without a stream: the first token exists when the prefill's part is done.
        # A mixed member's answer has no such moment: its whole answer it is.
        first_token_at = now if prefill_s is None else exchange.prefill_started + prefill_s
        router.metrics.ttft_of(model).observe(first_token_at - self.call.started)
        router.metrics.e2e_of(model).observe(now - self.call.started)
        tokens = _COMPLETION_TOKENS.search(data, max(0, len(data) - 512))
        if tokens is not None and int(tokens.group(1)) > 0:
            decode_s = now - (exchange.decode_started or opened.opened_at)
            router.observe_decode(opened.pair.decode, decode_s / int(tokens.group(1)))

    # --- streaming --------------------------------------------------------------------

    async def stream(self, request: web.Request) -> web.StreamResponse:
        router, call = self.router, self.call
        client = ClientStream(request)
        ask_ids = call.migratable is None and router.max_migrations > 0
        tap = TokenTap(strip=not call.wants_ids, chat=call.chat,
                       watch_usage=call.include_usage, hold_back=ask_ids)
        path, body = call.path, call.body
        reshaper: Reshaper | None = None
        migrations_left = router.max_migrations
        try:
            while True:
                try:
                    opened = await self.open(path, body, ask_ids=ask_ids)
                except NoPair:
                    if not client.started:
                        return self.no_pair_response()
                    return await self._give_up(client, "no pair is left to continue on",
                                               "no_pair")
                except UpstreamRejected as rejected:
                    if not client.started:
                        raise
                    return await self._give_up(client, f"the continuation was refused "
                                               f"(HTTP {rejected.status})", "no_pair")
                try:
                    response = opened.exchange.response
                    if response.status != 200:  # a 4xx from the decode: the client's fault
                        if not client.started:
                            return await self._relay_refusal(opened)
                        return await self._give_up(client, "the continuation was refused "
                                                   f"(HTTP {response.status})", "no_pair")
                    end = await relay_leg(
                        opened.exchange, opened.pair.decode, client, tap, reshaper,
                        router.metrics.itl_of(call.model).observe,
                        lambda at, o=opened: self._first_read(o, at, client.started))
                    if end.failure is None:
                        await self._finish_companion(opened.exchange)
                        self._observe_decode(opened, end)
                finally:
                    self._observe_prefill(opened)
                    opened.close()
                if end.failure is None:
                    await client.end()
                    router.count(call.model, "ok")
                    router.metrics.e2e_of(call.model).observe(time.monotonic() - call.started)
                    return client.response or web.Response(status=204)
                failure = end.failure
                tap.drop_held()
                router.on_failure(failure)
                self.tried.append(opened.pair.decode.id)
                self.last_failure = failure
                if not client.started:  # nothing sent yet: an ordinary retry
                    router.metrics.retries.labels("decode_failed").inc()
                    continue
                if tap.finished:  # only the end was lost: complete it here
                    return await self._complete(client, tap, reshaper)
                why = self._why_not_continue(tap, migrations_left)
                if why:
                    return await self._give_up(client, failure.public, why)
                next_body = continuation_of(call.path, call.body, tap.prompt_ids or [],
                                            tap.sent_ids())
                if next_body is None:  # every token the client asked for was sent
                    return await self._complete(client, tap, reshaper)
                migrations_left -= 1
                router.metrics.migrations.labels(failure.kind).inc()
                logger.warning("[router] migrate request=%s after %s: %d tokens sent, "
                               "%d migrations left", call.request_id, failure.kind,
                               len(next_body["prompt"]) - len(tap.prompt_ids or []),
                               migrations_left)
                if reshaper is None:
                    reshaper = Reshaper.for_stream(tap, chat=call.chat,
                                                   keep_ids=call.wants_ids)
                else:
                    reshaper.sent_before = tap.sent_count()
                path, body = COMPLETIONS_PATH, next_body
                self.attempts_left = router.max_attempts  # a fresh start, on a new pair
        except ConnectionError:
            # A write to the client's closing socket: the client hung up (often right
            # after [DONE], before the stream's end). A cancel, not an upstream failure.
            logger.debug("[router] client left mid-response model=%s", call.model)
            router.count(call.model, "cancelled")
            return client.response or web.Response(status=499)

    def _why_not_continue(self, tap: TokenTap, migrations_left: int) -> str:
        if migrations_left <= 0:
            return "budget"
        if self.call.migratable is not None:
            return "request_shape"
        if tap.unmigratable:
            return "request_shape"
        if tap.prompt_ids is None:
            return "no_token_ids"
        return ""

    async def _give_up(self, client: ClientStream, message: str, why: str
                       ) -> web.StreamResponse:
        router, call = self.router, self.call
        router.metrics.unmigratable.labels(why).inc()
        router.count(call.model, "failed_midstream")
        logger.warning("[router] stream failed request=%s: %s (not migrated: %s)",
                       call.request_id, message, why)
        await client.fail(message)
        return client.response or web.Response(status=502)

    async def _complete(self, client: ClientStream, tap: TokenTap,
                        reshaper: Reshaper | None) -> web.StreamResponse:
        """The generation had finished; the engine died before the stream's end."""
        router, call = self.router, self.call
        if call.include_usage and not tap.usage_sent and tap.prompt_ids is not None:
            shaper = reshaper or Reshaper.for_stream(tap, chat=call.chat, keep_ids=False)
            await client.write(shaper.usage_event(tap.sent_count()))
        await client.write(b"data: [DONE]\n\n")
        await client.end()
        router.count(call.model, "ok")
        router.metrics.e2e_of(call.model).observe(time.monotonic() - call.started)
        return client.response or web.Response(status=204)

    async def _relay_refusal(self, opened: Opened) -> web.Response:
        response = opened.exchange.response
        try:
            data = await response.read()
        except OSError:
            data = b""
        self.router.count(self.call.model, "client_error")
        return web.Response(status=response.status, body=data,
                            headers={"Content-Type": response.content_type})

    def _first_read(self, opened: Opened, at: float, continuing: bool) -> None:
        if not continuing:
            self.router.metrics.ttft_of(self.call.model).observe(at - self.call.started)
        if opened.pair.direct:  # a mixed member's "prefill": its time to first token
            self.router.observe_prefill(opened.pair.prefill, at - opened.opened_at)

    # --- bookkeeping --------------------------------------------------------------------

    async def _finish_companion(self, exchange: Exchange) -> None:
        if exchange.companion is not None:
            failure = await exchange.finish(COMPANION_WAIT_S)
            if failure is not None:  # D answered anyway; still keep that P out a while
                self.router.on_failure(failure)

    def _observe_prefill(self, opened: Opened) -> None:
        if opened.exchange.prefill_s is not None:
            self.router.observe_prefill(opened.pair.prefill, opened.exchange.prefill_s)

    def _observe_decode(self, opened: Opened, end: LegEnd) -> None:
        per_read = end.per_read_s()
        if per_read is not None:
            self.router.observe_decode(opened.pair.decode, per_read)
