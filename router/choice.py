"""The values one pairing decision passes along, so nothing is left in shared state.

    Affinity  what a request brings to pairing, computed once at admission: the key
              `prefix` and `session` hash (0 for the other policies); the `kv` policy's
              subclass adds the prompt's token count and block keys
    Choice    what a prefill chooser answers: the member, and the prompt tokens it is
              predicted to hold already (`exact`: the prediction came from the KV index)

A `Pair` (router/table.py) carries its prefill choice's prediction on, to the metrics,
to conditional disaggregation and to whatever budgets the request against its members.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from router.table import Candidate

__all__ = ["NO_AFFINITY", "Affinity", "Choice"]


@dataclass(frozen=True, slots=True)
class Affinity:
    """What a request brings to pairing (`Pairer.affinity`, or the `kv` policy's
    `KvRouting.affinity`). `key` is what `prefix` and `session` hash, and where the `kv`
    policy places a prompt cached nowhere."""

    key: int = 0


NO_AFFINITY: Final = Affinity()


@dataclass(frozen=True, slots=True)
class Choice:
    """A prefill chooser's answer. `cached_tokens`: prompt tokens `candidate` is predicted
    to hold (0 when nothing is known); `exact`: the choice went by the KV index (the
    `kv` policy matched the prompt's blocks), not by load alone."""

    candidate: Candidate
    cached_tokens: int = 0
    exact: bool = False
