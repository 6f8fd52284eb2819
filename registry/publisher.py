"""The registry loop's outputs: PUB events and load digests, and the published snapshot.

Loop thread only. Events go out one message each, with the model as topic; load digests
are coalesced per model and split at DIGEST_MAX_ENTRIES, so no PUB message is large and a
stalled subscriber's queue (EVENTS_HWM messages) stays bounded in bytes too. Frames are
sent with pyzmq's default copy: small ones are copied (cheaper than zero-copy's
bookkeeping), large ones go zero-copy above its COPY_THRESHOLD.

Each event says its topic's previous version and each digest its topic's last one
(registry/topic_versions.py): a view that follows some models checks its own topics.
While a dashboard stream is open, what goes out also goes to the change log
(registry/change_log.py): the same lists, by reference.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Final

import zmq

from registry.change_log import ChangeLog
from registry.kv_reports import KvSummary
from registry.membership import Membership
from registry.metrics import LoopStats
from registry.published import Published
from registry.topic_versions import TopicVersions, model_of
from wire.protocol import LoadDigest, MembershipEvent, make_encoder, topic_for

DIGEST_MAX_ENTRIES: Final = 256  # per message (~12 KB)
RECENT_EVENTS: Final = 100  # membership events the HTTP side can show
# Per subscriber. A stalled one holds at most this many messages (events are < 1 KB,
# digests ~12 KB at most: ~60 MB in the worst case); beyond it, it misses messages, sees
# the version gap and resynchronises.
EVENTS_HWM: Final = 5_000


class Publisher:
    def __init__(self, sock: zmq.Socket, stats: LoopStats, epoch: int,
                 changes: ChangeLog | None = None) -> None:
        self.sock = sock
        self.stats = stats
        self.epoch = epoch
        self.changes = changes or ChangeLog()
        self._encoder = make_encoder()
        self._recent_events: deque[MembershipEvent] = deque(maxlen=RECENT_EVENTS)
        self._topics = TopicVersions()
        sock.setsockopt(zmq.SNDHWM, EVENTS_HWM)

    def events(self, events: list[MembershipEvent]) -> bool:
        """Publish membership events; whether there were any."""
        encode = self._encoder.encode
        stamp = self._topics.stamp
        for event in events:
            event = stamp(event)
            self.sock.send_multipart((topic_for(model_of(event)), encode(event)))
            self.stats.count_event(event)
            self._recent_events.append(event)
        if self.changes.followers:
            self.changes.append("events", events, time.time())
        return bool(events)

    def kv_changed(self, changes: dict[str, KvSummary | None]) -> None:
        """The routers' KV summaries that changed (registry/kv_reports.py), for streams."""
        self.changes.append("kv", changes, time.time())

    def digests(self, membership: Membership, now: float, *, pulse: bool) -> None:
        digests = membership.take_load_digests(now)
        if pulse:
            # Every model's topic hears from us each interval, changes or not, and so does
            # the empty topic: subscribers use it to see the registry is alive and current.
            models = membership.models() | {""}
            for model in models:
                digests.setdefault(model, [])
            self._topics.keep(models)
        interval = membership.timing.heartbeat_interval_s
        encode = self._encoder.encode
        sent = 0
        changes = self.changes if self.changes.followers else None
        if changes is not None and pulse:
            changes.meta = {"epoch": self.epoch, "version": membership.version,
                            "heartbeat_interval_s": interval,
                            "lease_s": membership.timing.lease_s,
                            "self_preserving": membership.self_preserving}
        for model, loads in digests.items():
            if changes is not None:
                changes.append("loads", loads, time.time())
            topic = topic_for(model)
            for start in range(0, max(1, len(loads)), DIGEST_MAX_ENTRIES):
                digest = LoadDigest(self.epoch, membership.version, model,
                                    loads[start:start + DIGEST_MAX_ENTRIES], interval,
                                    self._topics.last(model))
                self.sock.send_multipart((topic, encode(digest)))
                sent += 1
            self.stats.digest_entries += len(loads)
        self.stats.digests += sent

    def snapshot(self, membership: Membership, now: float) -> Published:
        return Published(
            epoch=self.epoch,
            version=membership.version,
            members=tuple(membership.records()),
            heartbeat_interval_s=membership.timing.heartbeat_interval_s,
            lease_s=membership.timing.lease_s,
            self_preserving=membership.self_preserving,
            taken_at=now + membership.wall_offset,
            recent_events=tuple(self._recent_events),
            banned=tuple(sorted(membership.admission.banned(now).items())),
        )
