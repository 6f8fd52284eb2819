"""What bounds an engine leg, and the error that says which bound it hit.

Timeouts (connect, first byte, idle read) and size caps, with the `UpstreamError` the
upstream client raises (a `ConnectionError`, so an `OSError`) and its `kind`: callers
tell a reset from an engine that went silent without parsing messages.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

__all__ = [
    "CONNECT_TIMEOUT_S",
    "FIRST_BYTE_TIMEOUT_S",
    "IDLE_READ_TIMEOUT_S",
    "MAX_BODY_BYTES",
    "FailureKind",
    "Timeouts",
    "UpstreamError",
]

CONNECT_TIMEOUT_S: Final = 3.0  # an engine that cannot accept in this long is treated as down
# From the request sent to the status line. A non-streaming answer arrives whole when the
# generation is done, so this bounds a whole non-streaming generation too.
FIRST_BYTE_TIMEOUT_S: Final = 300.0
# Between two reads of an answer's body: a stream with no token for this long is stalled.
IDLE_READ_TIMEOUT_S: Final = 15.0
# A buffered (non-streamed) answer larger than this is refused: no engine answer is.
MAX_BODY_BYTES: Final = 64 * 1024 * 1024


class FailureKind(enum.StrEnum):
    RESET = "reset"  # the connection broke (RST, error) before the answer was complete
    EOF = "eof"  # the engine closed the connection cleanly before the answer was complete
    FIRST_BYTE_TIMEOUT = "first_byte_timeout"
    IDLE_TIMEOUT = "idle_timeout"
    MALFORMED = "malformed"  # not HTTP/1.1
    TOO_LARGE = "too_large"
    FORBIDDEN = "forbidden"  # the address is outside --allow-upstream


class UpstreamError(ConnectionError):
    """The answer cannot be had: the connection dropped, the engine stopped answering,
    the answer is not HTTP or too large, or the address is not allowed."""

    def __init__(self, message: str, kind: FailureKind = FailureKind.RESET) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True, slots=True)
class Timeouts:
    connect_s: float = CONNECT_TIMEOUT_S
    first_byte_s: float = FIRST_BYTE_TIMEOUT_S
    idle_read_s: float = IDLE_READ_TIMEOUT_S
