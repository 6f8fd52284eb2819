"""What a person sees while the demo runs: step headers, checks, figures, tables, a live line."""

from __future__ import annotations

import sys
import threading
from typing import TextIO

from pdreg.demo.stage import StepResult

_GREEN = "\x1b[32m"
_RED = "\x1b[31m"
_BOLD = "\x1b[1m"
_RESET = "\x1b[0m"


def requests_table(measures: dict[str, float]) -> list[str]:
    """What happened to the requests a kill -9 hit: a two-row table."""
    head = ("in flight at the kill", "migrated to another decode", "failed")
    values = tuple(str(int(measures.get(f"{name}_count", 0)))
                   for name in ("in_flight_at_kill", "migrated", "failed"))
    widths = [max(len(h), len(v)) for h, v in zip(head, values, strict=True)]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
            for row in (head, values)]


class TerminalDisplay:
    """Plain lines for logs and pipes; colour and a refreshing status line on a terminal."""

    def __init__(self, out: TextIO | None = None) -> None:
        self.out = out or sys.stdout
        self.tty = self.out.isatty()
        self._lock = threading.Lock()  # the status ticker writes from its own thread
        self._status_shown = False

    def _paint(self, text: str, code: str) -> str:
        return f"{code}{text}{_RESET}" if self.tty else text

    def _write(self, text: str) -> None:
        with self._lock:
            if self._status_shown:
                self.out.write("\r\x1b[K")
                self._status_shown = False
            self.out.write(text + "\n")
            self.out.flush()

    def status(self, text: str) -> None:
        if not self.tty:
            return
        with self._lock:
            self.out.write("\r\x1b[K" + text[:160])
            self.out.flush()
            self._status_shown = True

    def endpoints(self, where: dict[str, str]) -> None:
        width = max(len(name) for name in where)
        lines = [f"  {name.ljust(width)}  {value}" for name, value in where.items()]
        self._write(self._paint("The cluster is up:", _BOLD) + "\n" + "\n".join(lines))

    def step_started(self, index: int, total: int, step: StepResult) -> None:
        self._write("\n" + self._paint(f"==> [{index}/{total}] {step.title}", _BOLD))

    def step_finished(self, step: StepResult) -> None:
        lines = []
        if step.name == "summary":
            lines.append("\n" + self._paint("==> Summary", _BOLD))
        for check in step.checks:
            mark = self._paint("ok  ", _GREEN) if check.ok else self._paint("FAIL", _RED)
            detail = f"  ({check.detail})" if check.detail else ""
            lines.append(f"  {mark} {check.name}{detail}")
        for name, value in step.measures.items():
            shown = f"{value:.0f}" if name.endswith("_count") else f"{value:.2f} s"
            lines.append(f"  {name.removesuffix('_s').removesuffix('_count')}: {shown}")
        if step.traffic is not None:
            lines.append(f"  traffic: {step.traffic.line()}")
        if "migrated_count" in step.measures:
            lines.append("  requests:")
            lines += ["    " + row for row in requests_table(step.measures)]
            lines.append("  members:")
        if step.table:
            lines.append("\n".join("    " + row for row in step.table.splitlines()))
        if step.name != "summary":
            lines.append(f"  ({step.finished - step.started:.1f} s)")
        self._write("\n".join(lines))

    def message(self, text: str) -> None:
        self._write(text)
