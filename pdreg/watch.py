"""`--watch` for the table commands (`pdreg status`, `pdreg plan`): print once, or redraw
in place every period until Ctrl-C."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Final, TextIO

__all__ = ["WATCH_PERIOD_S", "show"]

WATCH_PERIOD_S: Final = 1.0


def show(render: Callable[[bool], str], *, title: str, watch: bool,
         period_s: float = WATCH_PERIOD_S, out: TextIO | None = None) -> None:
    """Print `render(once)` once, or, with `watch`, home the cursor, clear below and
    redraw it under a time-stamped `title` every `period_s` (the table refreshes in
    place). `once` tells render which shape to produce (e.g. indented JSON once, one
    line per refresh). Ctrl-C ends the watch with KeyboardInterrupt, for the caller."""
    out = out or sys.stdout
    if not watch:
        print(render(True), file=out)
        return
    while True:
        text = render(False)
        out.write(f"\x1b[H\x1b[J{time.strftime('%H:%M:%S')}  {title}\n{text}\n")
        out.flush()
        time.sleep(period_s)
