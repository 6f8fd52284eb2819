"""Names of the engine figures in `Load.extra` that pdreg itself reads or shows.

`Load.extra` is free-form (an engine may report any figure); these are the ones with a
meaning every side agrees on.
"""

from __future__ import annotations

from typing import Final

__all__ = ["PREFIX_CACHE_HIT_RATE"]

# The share of prompt tokens an engine's prefix cache held, by the engine's own counters
# (prompt tokens found cached / prompt tokens prefilled since it started): the reference
# engine reports it; `pdreg status` (HIT%) and the dashboard show it.
PREFIX_CACHE_HIT_RATE: Final = "prefix_cache_hit_rate"
