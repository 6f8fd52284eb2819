"""`--watch` (pdreg status, pdreg plan): once, or redrawn in place until Ctrl-C."""

from __future__ import annotations

import io

import pytest

from pdreg.watch import show


def test_once_prints_the_full_shape() -> None:
    out = io.StringIO()
    show(lambda once: f"table once={once}", title="pdreg status", watch=False, out=out)
    assert out.getvalue() == "table once=True\n"


def test_watch_redraws_in_place_until_interrupted() -> None:
    out = io.StringIO()
    frames = iter(["first", "second"])

    def render(once: bool) -> str:
        assert not once
        frame = next(frames, None)
        if frame is None:
            raise KeyboardInterrupt
        return frame
    with pytest.raises(KeyboardInterrupt):
        show(render, title="pdreg plan", watch=True, period_s=0.0, out=out)
    screens = out.getvalue().split("\x1b[H\x1b[J")[1:]
    assert [s.split("\n", 1)[1] for s in screens] == ["first\n", "second\n"]
    assert all("pdreg plan" in s.split("\n", 1)[0] for s in screens)
