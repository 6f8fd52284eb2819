"""Retry pacing for an agent whose registry does not answer."""

from __future__ import annotations

import random
from typing import Final

BACKOFF_BASE_S: Final = 0.1  # first retry after an unanswered request
BACKOFF_MAX_S: Final = 3.0  # exponential backoff is capped here (jitter keeps half to all of it)


def backoff_delay_s(failures: int, rng: random.Random) -> float:
    """Exponential backoff with 'equal jitter': half the step fixed, half random."""
    step = min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** max(0, failures - 1))
    return step / 2 + rng.uniform(0, step / 2)
