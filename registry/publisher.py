"""The registry loop's outputs: PUB events and load digests, and the published snapshot.

Loop thread only. Events go out one message each, with the model as topic; load digests
are coalesced per model and split at DIGEST_MAX_ENTRIES, so no PUB message is large and a
stalled subscriber's queue (EVENTS_HWM messages) stays bounded in bytes too. Frames are
sent with pyzmq's default copy: small ones are copied (cheaper than zero-copy's
bookkeeping), large ones go zero-copy above its COPY_THRESHOLD.
"""

from __future__ import annotations

from collections import deque
from typing import Final

import zmq

from registry.membership import Membership
from registry.metrics import LoopStats
from registry.published import Published
from wire.protocol import LoadDigest, MemberLeft, MembershipEvent, make_encoder, topic_for

DIGEST_MAX_ENTRIES: Final = 256  # per message (~12 KB)
RECENT_EVENTS: Final = 100  # membership events the HTTP side can show
# Per subscriber. A stalled one holds at most this many messages (events are < 1 KB,
# digests ~12 KB at most: ~60 MB in the worst case); beyond it, it misses messages, sees
# the version gap and resynchronises.
EVENTS_HWM: Final = 5_000


class Publisher:
    def __init__(self, sock: zmq.Socket, stats: LoopStats, epoch: int) -> None:
        self.sock = sock
        self.stats = stats
        self.epoch = epoch
        self._encoder = make_encoder()
        self._recent_events: deque[MembershipEvent] = deque(maxlen=RECENT_EVENTS)
        sock.setsockopt(zmq.SNDHWM, EVENTS_HWM)

    def events(self, events: list[MembershipEvent]) -> bool:
        """Publish membership events; whether there were any."""
        encode = self._encoder.encode
        for event in events:
            model = event.model if isinstance(event, MemberLeft) else event.member.spec.model
            self.sock.send_multipart((topic_for(model), encode(event)))
            self.stats.count_event(event)
            self._recent_events.append(event)
        return bool(events)

    def digests(self, membership: Membership, now: float, *, pulse: bool) -> None:
        digests = membership.take_load_digests(now)
        if pulse:
            # Every model's topic hears from us each interval, changes or not, and so does
            # the empty topic: subscribers use it to see the registry is alive and current.
            for model in membership.models() | {""}:
                digests.setdefault(model, [])
        interval = membership.timing.heartbeat_interval_s
        encode = self._encoder.encode
        sent = 0
        for model, loads in digests.items():
            topic = topic_for(model)
            for start in range(0, max(1, len(loads)), DIGEST_MAX_ENTRIES):
                digest = LoadDigest(self.epoch, membership.version, model,
                                    loads[start:start + DIGEST_MAX_ENTRIES], interval)
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
