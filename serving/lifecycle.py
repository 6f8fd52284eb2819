"""Lifecycles shared by every long-lived piece: the shutdown states, and an HTTP server
on a side thread.

`ShutdownState` is the one shutdown vocabulary (vLLM's `EngineShutdownState`): a signal
or `close()` only moves it to REQUESTED and wakes the loop, which ends the work and says
so with STOPPED.

`ServingThread(app, host, port)` serves an app on its own uvloop event loop in a daemon
thread, for the router, the planner and the registry's HTTP side alike: an `HttpApp`
(serving/http_server.py, the router's and the planner's), or an ASGI app through uvicorn
(the registry's FastAPI app), on a socket bound here (port 0 works). `start()` returns
once the socket accepts connections; `add_app()` serves another `HttpApp` on the same
loop, on a port of its own (the router's metrics); `close()` lets in-flight requests
finish (bounded), stops the loop and joins the thread, and is safe twice. Work of the
app's own (a planning loop, the router's upstream pool) starts and stops with it through
its `on_startup` / `on_cleanup` hooks.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import socket
import threading
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, Final, TypeVar

import uvloop

from serving.http_server import LISTEN_BACKLOG, HttpApp

__all__ = ["ServingThread", "ShutdownState"]

logger = logging.getLogger(__name__)

START_TIMEOUT_S: Final = 30.0
STOP_TIMEOUT_S: Final = 10.0
ASGI_GRACE_S: Final = 1.0  # uvicorn: how long open connections get once told to exit

T = TypeVar("T")


class ShutdownState(enum.Enum):
    RUNNING = "running"
    REQUESTED = "requested"  # close()/stop() was called; the loop ends its work and exits
    STOPPED = "stopped"


class ServingThread:
    def __init__(self, app: Any, host: str, port: int, *, name: str,
                 runner_options: Mapping[str, Any] | None = None,
                 stop_timeout_s: float = STOP_TIMEOUT_S) -> None:
        """`runner_options`: for an ASGI app, `uvicorn.Config` keywords (a protocol class,
        TLS files); an `HttpApp` carries its own limits. `stop_timeout_s`: how
        long close() waits for the server to stop, on top of that."""
        self.app = app
        self.host = host
        self.requested_port = port
        self.name = name
        self.port = 0
        self.state = ShutdownState.RUNNING
        self._runner_options = dict(runner_options or {})
        self._stop_timeout_s = stop_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: Callable[[], Coroutine[Any, Any, None]] | None = None
        self._also_stop: list[Callable[[], Coroutine[Any, Any, None]]] = []

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None, f"{self.name} is not running"
        return self._loop

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> ServingThread:
        """Bind and serve; returns once the socket accepts connections. On a started
        server it does nothing."""
        if self._thread is not None:
            return self
        loop = self._loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=loop.run_forever, name=self.name, daemon=True)
        self._thread.start()
        try:
            self.run(self._serve(), START_TIMEOUT_S)
        except BaseException:
            self.close()
            raise
        return self

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """Run `coro` on the server's loop from another thread; its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def call_soon(self, callback: Callable[..., object], *args: object) -> None:
        """Call `callback(*args)` on the server's loop, from any thread."""
        loop = self._loop
        if loop is not None:
            loop.call_soon_threadsafe(callback, *args)

    def add_app(self, app: HttpApp, port: int) -> int:
        """Serve another `HttpApp` on this loop and host, on `port` (0: the OS picks);
        its bound port. It stops with the thread."""
        return self.run(self._serve_also(app, port), START_TIMEOUT_S)

    async def _serve_also(self, app: HttpApp, port: int) -> int:
        server = await app.start_serving(self.host, port, backlog=LISTEN_BACKLOG)
        self._also_stop.append(server.close)
        return int(server.port)

    async def _serve(self) -> None:
        if isinstance(self.app, HttpApp):
            server = await self.app.start_serving(self.host, self.requested_port,
                                                  backlog=LISTEN_BACKLOG)
            self._stop = server.close
            self.port = server.port
            return
        await self._serve_asgi()

    async def _serve_asgi(self) -> None:
        import uvicorn

        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.requested_port))
        sock.listen(LISTEN_BACKLOG)
        self.port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(
            self.app, log_level="warning", access_log=False, lifespan="off",
            timeout_graceful_shutdown=ASGI_GRACE_S, **self._runner_options))
        task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
        while not server.started:
            if task.done():  # it failed to start: say why
                sock.close()
                task.result()
                raise RuntimeError(f"{self.name}: the HTTP server stopped at start-up")
            await asyncio.sleep(0.005)

        async def stop() -> None:
            server.should_exit = True
            try:
                await task
            finally:
                sock.close()
        self._stop = stop

    def close(self) -> None:
        """Stop serving (in-flight requests finish, bounded), stop the loop, join the
        thread. Safe twice, and from a failed start."""
        loop, self._loop = self._loop, None
        if loop is None:
            return
        self.state = ShutdownState.REQUESTED
        stops, self._also_stop = self._also_stop, []
        if self._stop is not None:
            stops.append(self._stop)
            self._stop = None
        in_flight_s = self.app.limits.drain_timeout_s if isinstance(self.app, HttpApp) \
            else ASGI_GRACE_S
        timeout_s = in_flight_s + self._stop_timeout_s
        for stop in stops:
            try:
                asyncio.run_coroutine_threadsafe(stop(), loop).result(timeout_s)
            except Exception:
                logger.exception("[%s] stopping the HTTP server failed", self.name)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(self._stop_timeout_s)
        if not loop.is_running():
            loop.close()
        self.state = ShutdownState.STOPPED

    def __enter__(self) -> ServingThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
