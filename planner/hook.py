"""The `--exec CMD` hook: `CMD MODEL ROLE N` whenever a decision changes.

The hook is declarative: "model M's role R should have N replicas" (`kubectl scale`,
a cloud API, the demo's process supervisor). It runs without a shell (argv, never a
command string), in its own process group, one run at a time per (model, role), killed
after `timeout_s`. When it fails, it is tried again at the next tick with the decision
of that tick. The count it last applied starts as the count observed when the
(model, role) first appears, so a planner that starts does not ask for what exists.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["ExecHook", "HookStatus"]

logger = logging.getLogger(__name__)

OUTPUT_LOG_CHARS = 500


@dataclass(frozen=True, slots=True)
class HookStatus:
    applied: int  # the last N the hook accepted (or the count first observed)
    running: int | None  # N of the run in progress
    last_error: str


class ExecHook:
    """Owned by one event loop; every method runs on it."""

    def __init__(self, argv: Sequence[str], timeout_s: float,
                 on_result: Callable[[str], None] = lambda result: None) -> None:
        if not argv:
            raise ValueError("--exec needs a command")
        self.argv = tuple(argv)
        self.timeout_s = timeout_s
        self._on_result = on_result
        self._applied: dict[tuple[str, str], int] = {}
        self._running: dict[tuple[str, str], tuple[int, asyncio.Task[None]]] = {}
        self._errors: dict[tuple[str, str], str] = {}

    def status(self, model: str, role: str) -> HookStatus | None:
        key = (model, role)
        if key not in self._applied:
            return None
        running = self._running.get(key)
        return HookStatus(self._applied[key], running[0] if running else None,
                          self._errors.get(key, ""))

    def reconcile(self, model: str, role: str, desired: int, observed: int) -> None:
        """Start `CMD MODEL ROLE desired` unless it is applied or a run is in progress."""
        key = (model, role)
        applied = self._applied.setdefault(key, observed)
        if desired == applied or key in self._running:
            return
        task = asyncio.get_running_loop().create_task(self._run(key, desired))
        self._running[key] = (desired, task)

    def forget(self, model: str, role: str) -> None:
        self._applied.pop((model, role), None)
        self._errors.pop((model, role), None)

    async def close(self) -> None:
        """Cancel runs in progress (their processes are killed). Safe twice."""
        tasks = [task for _, task in self._running.values()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self, key: tuple[str, str], count: int) -> None:
        argv = (*self.argv, key[0], key[1], str(count))
        logger.info("[planner] exec %s", " ".join(argv))
        try:
            result, detail = await self._spawn(argv)
        finally:
            self._running.pop(key, None)
        self._on_result(result)
        if result == "ok":
            self._applied[key] = count
            self._errors.pop(key, None)
        else:
            self._errors[key] = detail
            logger.warning("[planner] exec %s: %s", " ".join(argv), detail)

    async def _spawn(self, argv: tuple[str, ...]) -> tuple[str, str]:
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT, start_new_session=True)
        except OSError as exc:
            return "failed", f"cannot start: {exc}"
        try:
            output, _ = await asyncio.wait_for(proc.communicate(), self.timeout_s)
        except TimeoutError:
            _kill_group(proc.pid)
            await proc.wait()
            return "timeout", f"killed after {self.timeout_s:g} s"
        except asyncio.CancelledError:
            _kill_group(proc.pid)
            await proc.wait()
            raise
        text = output.decode(errors="replace").strip()[-OUTPUT_LOG_CHARS:]
        if proc.returncode != 0:
            return "failed", f"exit code {proc.returncode}: {text}"
        if text:
            logger.info("[planner] exec output: %s", text)
        return "ok", ""


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
