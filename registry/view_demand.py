"""Loads on demand: what a router's `MembershipView` does to follow only the loads asked for.

A router of every model in front of 100k members heartbeating every 5 s takes ~20,000
load changes a second; applied, each cost its view ~3.3 µs, whichever model it served.
With loads on demand:

- a request asks for its model (`ask`); the models asked for within ASKED_KEEP_S, and the
  base models of the members serving an adapter asked for, are followed: their digests
  apply as they come;
- every other model's digests are read no further than their versions (`LoadDigestHead`,
  chosen by the frame's topic: a version gap is still seen) and passed over; the replica
  marks that model missed (registry/replica.py): its loads stay as old as they are and say
  so (`loads_confirmed_at` does not move);
- a missed model asked for again has its current loads fetched: a Sync for it alone, on
  a DEALER of its own per registry (answered in order; asked again after
  SYNC_TIMEOUT_S unanswered), the answer taken for loads only (`Replica.apply_loads`).

The view thread alone calls everything here but `ask`, which any thread may.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Final

import msgspec
import zmq

from registry import sessions
from registry.merge import Merge
from registry.view_links import SYNC_TIMEOUT_S, Link, LinkState
from wire.protocol import (
    Event,
    LoadDigest,
    MemberJoined,
    MemberLeft,
    MemberUpdated,
    Reply,
    Snapshot,
    Sync,
    make_encoder,
    topic_for,
)

__all__ = ["ASKED_KEEP_S", "ASKS_RECHECK_S", "LoadDigestHead", "LoadsOnDemand",
           "event_head_decoder"]

logger = logging.getLogger(__name__)

ASKED_KEEP_S: Final = 60.0  # a model not asked for this long is passed over again
ASKS_RECHECK_S: Final = 1.0  # the models asked for are looked at again this often


class LoadDigestHead(LoadDigest, tag="LoadDigest"):
    """A `LoadDigest` read no further than its versions: its loads stay undecoded bytes
    (five times cheaper to pass over than to decode)."""

    loads: msgspec.Raw  # type: ignore[assignment]


def event_head_decoder() -> msgspec.msgpack.Decoder[Event]:
    """Events as `wire.protocol.event_decoder` reads them, a digest as a `LoadDigestHead`."""
    return msgspec.msgpack.Decoder(MemberJoined | MemberUpdated | MemberLeft | LoadDigestHead)


class LoadsOnDemand:
    def __init__(self, merge: Merge, token: str) -> None:
        self._merge = merge
        self._token = token
        self._encode = make_encoder().encode
        # model name -> when a reader last asked for it (set by readers on any thread,
        # pruned by the view thread), and the names followed now (swapped whole)
        self._asked: dict[str, float] = {}
        self._following: frozenset[str] = frozenset()
        self._due = 0.0
        self.eager_topics: frozenset[bytes] = frozenset()  # topics of the models followed

    def ask(self, model: str) -> bool:
        """A reader is about to read `model`'s loads. Whether the view thread must look
        (a model it does not follow yet)."""
        self._asked[model] = time.monotonic()
        return model not in self._following

    def follow(self, now: float, links: list[Link]) -> None:
        """Follow the models asked for within ASKED_KEEP_S and their adapters' base
        models (the replicas name those to fetch); pass over every other model's.
        Looked at when a new name is asked for, and every ASKS_RECHECK_S (an adapter's
        base models change with membership)."""
        asked = self._asked
        if now < self._due and asked.keys() <= self._following:
            return
        self._due = now + ASKS_RECHECK_S
        names = set()
        for name, at in asked.copy().items():
            if now - at <= ASKED_KEEP_S:
                names.add(name)
            elif asked.get(name) == at:  # (asked again meanwhile: it stays)
                asked.pop(name, None)
        self._following = frozenset(names)
        bases = self._merge.bases_of(names)
        self.eager_topics = frozenset(map(topic_for, bases))
        for link in links:
            link.replica.want(bases)

    def fetch(self, link: Link, models: set[str], now: float,
              dealer: Callable[[str], zmq.Socket]) -> None:
        """Ask `link`'s registry for the current loads of `models` on the link's loads
        DEALER (`dealer(address)` opens one). Not while the link syncs: its snapshot
        has them."""
        if not models or link.state is not LinkState.LIVE:
            return
        if link.loads_dealer is None:
            link.loads_dealer = dealer(link.address)
        sync = sessions.prove_sync(Sync(models=sorted(models)), self._token, self._encode)
        link.loads_dealer.send(self._encode(sync), zmq.NOBLOCK)
        if not link.loads_asked:
            link.loads_asked_at = now
        link.loads_asked.append(frozenset(models))
        logger.debug("[view] %s: fetching the loads of %s", link.address, sorted(models))

    def read(self, link: Link, decode: msgspec.msgpack.Decoder[Reply | Snapshot],
             now: float) -> bool:
        """Take the answers waiting on `link`'s loads DEALER; whether a load changed."""
        changed = False
        while link.loads_dealer is not None:
            try:
                payload = link.loads_dealer.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            models = link.loads_asked.popleft() if link.loads_asked else frozenset()
            link.loads_asked_at = now
            try:
                message = decode.decode(payload)
            except msgspec.MsgspecError as exc:
                logger.warning("[view] %s: undecodable loads: %s", link.address, exc)
                continue
            if isinstance(message, Snapshot):
                changed |= link.replica.apply_loads(message, models, now, time.time())
            else:  # refused (rate limited): asked again after SYNC_TIMEOUT_S
                logger.warning("[view] %s refused the loads' sync: %s", link.address,
                               message.reason)
                link.loads_asked.appendleft(models)
                break
        return changed

    def retry(self, link: Link, now: float, dealer: Callable[[str], zmq.Socket],
              close: Callable[[zmq.Socket], None]) -> None:
        """Loads asked for and unanswered within SYNC_TIMEOUT_S: a new DEALER (one to a
        dead peer keeps its queue) asks again for all of them."""
        if not link.loads_asked or now - link.loads_asked_at < SYNC_TIMEOUT_S:
            return
        models = set().union(*link.loads_asked)
        link.loads_asked.clear()
        if link.loads_dealer is not None:
            close(link.loads_dealer)
            link.loads_dealer = None
        self.fetch(link, models, now, dealer)

    @staticmethod
    def next_retry_at(link: Link) -> float | None:
        return link.loads_asked_at + SYNC_TIMEOUT_S if link.loads_asked else None
