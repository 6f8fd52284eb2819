"""The router's (and planner's) HTTP server limits, and the request-head budget.

`HeadBudget` is pure: the server tells it what the parser handed over and what was read,
and it says when a head is over `max_head_bytes`, whether the head came in one read or
spans many, and without counting pipelined requests that came before it in a read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = ["BODY_TIMEOUT_S", "DRAIN_TIMEOUT_S", "HEADER_OVERHEAD", "HEADER_TIMEOUT_S",
           "LINGER_S", "MAX_BODY_BYTES", "MAX_HEAD_BYTES", "HeadBudget", "Limits"]

HEADER_TIMEOUT_S: Final = 10.0
BODY_TIMEOUT_S: Final = 30.0
MAX_BODY_BYTES: Final = 16 * 1024 * 1024
MAX_HEAD_BYTES: Final = 64 * 1024  # request line and headers together
DRAIN_TIMEOUT_S: Final = 30.0  # at close, requests in flight get this long to finish
LINGER_S: Final = 5.0  # after a 413, the rest of the body is read and dropped this long
HEADER_OVERHEAD: Final = 4  # ": " and CRLF around each header's name and value


@dataclass(frozen=True, slots=True)
class Limits:
    header_timeout_s: float = HEADER_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S
    max_body_bytes: int = MAX_BODY_BYTES
    max_head_bytes: int = MAX_HEAD_BYTES
    drain_timeout_s: float = DRAIN_TIMEOUT_S  # requests in flight, at close


class HeadBudget:
    """One connection's current request head against `limit` bytes, counted two ways:
    - `parsed`: the parts the parser handed over (URL, each header): catches a head
      that arrived whole in one read;
    - `unfinished`: the raw bytes read while a head is unfinished (the parser holds a
      part it has not handed over): catches one that trickles in over many reads. A read
      in which a request was completed may hold any number of whole pipelined requests
      before the unfinished head: that head is counted from the next read (and its parts
      as they are handed over); otherwise the read is all this head's.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._parsed = 0
        self._read = 0
        self._completed = False  # a request was completed during the current read

    def reading(self) -> None:
        """A read arrives (before the parser sees it)."""
        self._completed = False

    def begin(self) -> None:
        """A request's first byte."""
        self._parsed = 0

    def completed(self) -> None:
        """A whole request (head and body) was parsed."""
        self._completed = True

    def parsed(self, size: int) -> bool:
        """A part of the head handed over; whether the head is now over the limit."""
        self._parsed += size
        return self._parsed > self.limit

    def unfinished(self, size: int) -> bool:
        """The read of `size` bytes ended inside a head; whether it is over the limit."""
        self._read = 0 if self._completed else self._read + size
        return self._read > self.limit

    def refusal(self) -> tuple[int, str, str]:
        """The answer to a head over the limit: status, reason, message."""
        return 431, "head_too_large", f"request headers larger than {self.limit} bytes"

    def done(self) -> None:
        """The head is complete."""
        self._parsed = self._read = 0
