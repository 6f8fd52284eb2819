"""Who may have a long prompt tokenized now: a few at once, one per client address.

Tokenizing and keying a long prompt runs in a worker thread so the event loop goes on,
but whatever part of it holds the GIL (a chat template rendered by Jinja, the token
list built, the blocks keyed) makes the loop wait up to a switch interval (5 ms) each
time it wakes: a client sending 4 MB prompts as fast as it can slowed every other
client's requests 45-74x (docs/security.md). So long prompts get a few worker threads
of their own (MAX_IN_FLIGHT), and at most PER_CLIENT of them at a time per client
address. A long prompt that finds no room is not tokenized: it is paired as
`peak_ewma` pairs it (counted, `why="busy"`), which only costs it the cache hit.

Pure: `enter` and `leave` are called from the event loop alone, around the await.
"""

from __future__ import annotations

from typing import Final

__all__ = ["MAX_IN_FLIGHT", "PER_CLIENT", "LongPromptGate"]

MAX_IN_FLIGHT: Final = 2  # long prompts tokenizing at once (one core's worth, two cores)
PER_CLIENT: Final = 1  # of those, per client address


class LongPromptGate:
    def __init__(self, max_in_flight: int = MAX_IN_FLIGHT,
                 per_client: int = PER_CLIENT) -> None:
        self.max_in_flight = max_in_flight
        self.per_client = per_client
        self._by_client: dict[str, int] = {}
        self._in_flight = 0

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def enter(self, client: str) -> bool:
        """True: `client` may tokenize one long prompt now (then `leave` once done)."""
        if self._in_flight >= self.max_in_flight:
            return False  # every long-prompt thread is busy
        held = self._by_client.get(client, 0)
        if held >= self.per_client:
            return False  # this client's share is taken: its own prompts wait, not others'
        self._by_client[client] = held + 1
        self._in_flight += 1
        return True

    def leave(self, client: str) -> None:
        """One long prompt of `client`'s is done (after an `enter` that answered True)."""
        held = self._by_client.get(client, 0)
        if held <= 0:
            return  # not entered: a caller's bug must not let the counts go negative
        if held == 1:
            del self._by_client[client]
        else:
            self._by_client[client] = held - 1
        self._in_flight -= 1
