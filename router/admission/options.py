"""Admission's settings (`RouterConfig.admission`), one default each, beside their use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from router.admission.classes import DEFAULT_TTFT_SLO_MS

__all__ = [
    "BUDGET_SLO_SHARE",
    "DECODE_BUDGET_TOKENS",
    "KV_FULL",
    "MAX_QUEUE_BYTES",
    "MAX_QUEUE_REQUESTS",
    "PREFILL_BUDGET_TOKENS",
    "STARVATION_S",
    "AdmissionOptions",
]

# Uncached prompt tokens a prefill may have in flight from all routers together: a few
# scheduler steps' worth (vLLM batches up to 8192 tokens a step by default), so an engine
# always has its next batch at hand and never a queue that outlives the SLO.
PREFILL_BUDGET_TOKENS: Final = 16384
# KV tokens (prompt + answer) a decode may hold from all routers; 0: no limit of its own,
# the decode's reported KV use and capacity still bound it.
DECODE_BUDGET_TOKENS: Final = 0
# A decode reporting this KV use or more takes no new request while one of ours is there.
KV_FULL: Final = 0.95
MAX_QUEUE_REQUESTS: Final = 1024  # per model
MAX_QUEUE_BYTES: Final = 64 << 20  # per model: the queued request bodies
STARVATION_S: Final = 5.0  # a class waiting this long goes before higher priorities
# Once a prefill's speed is measured, its budget is the uncached tokens it gets through in
# this share of the most important class's TTFT SLO (capped by the flag): a request
# admitted to it then waits inside the engine at most that long.
BUDGET_SLO_SHARE: Final = 0.5


@dataclass(frozen=True, slots=True)
class AdmissionOptions:
    enabled: bool = True  # False: every request is forwarded at once (the old behaviour)
    classes_file: str = ""  # --classes FILE (TOML); "" = one class
    ttft_slo_ms: float = DEFAULT_TTFT_SLO_MS  # the one class's SLO, without a file
    prefill_budget_tokens: int = PREFILL_BUDGET_TOKENS  # per prefill, split among routers
    budget_slo_share: float = BUDGET_SLO_SHARE  # 0: the flag's budget alone, never measured
    decode_budget_tokens: int = DECODE_BUDGET_TOKENS  # per decode, split among routers
    max_queue_requests: int = MAX_QUEUE_REQUESTS
    max_queue_bytes: int = MAX_QUEUE_BYTES
    starvation_s: float = STARVATION_S
