"""uvicorn in a thread of its own, on a socket we bind ourselves (so port 0 works)."""

from __future__ import annotations

import socket
import threading
import time

START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0


class HttpThread:
    def __init__(self, app: object, host: str, port: int, *, name: str,
                 tls: tuple[str, str] | None = None) -> None:
        """`tls`: (certificate file, key file) to serve HTTPS instead of HTTP."""
        import uvicorn

        from registry.http_guard import guarded_protocol

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(512)
        certfile, keyfile = tls or (None, None)
        # The guarded protocol: a request must arrive whole within a deadline (slowloris).
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=1, http=guarded_protocol(),
                                ssl_certfile=certfile, ssl_keyfile=keyfile)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run,
                                        kwargs={"sockets": [self._sock]}, name=name,
                                        daemon=True)

    def start(self) -> int:
        """Serve; returns the bound port once uvicorn is up."""
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started and self._thread.is_alive():
            if time.monotonic() > deadline:
                raise TimeoutError(f"HTTP server did not start within {START_TIMEOUT_S:.0f}s")
            time.sleep(0.01)
        return self._sock.getsockname()[1]

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=STOP_TIMEOUT_S)
        self._sock.close()
