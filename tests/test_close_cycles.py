"""Two registries and two views in one process, started and closed 200 times in a row
with traffic between them: no abort, no leaked descriptor.

Embedding a registry or a view (tests, a control plane running two, a restart inside one
process) once risked a libzmq assertion at close ("Socket operation on non-socket"): a
ZeroMQ socket closed by one thread while another used it. Close paths now close a socket
only once its owner has stopped (registry/server.py, registry/client.py), and the wake
sockets other threads write are guarded by the same lock their closing takes. The cycles
run in a child process, so an abort fails this test instead of killing pytest.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from raw_member import RawMember

from pdreg.testing import wait_until

REPO = Path(__file__).resolve().parent.parent
CYCLES = 200


@pytest.mark.timeout(300)
def test_registries_and_views_close_cleanly_again_and_again() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(REPO / "tests"), str(REPO)))}
    done = subprocess.run([sys.executable, str(REPO / "tests" / "close_cycles.py"),
                           str(CYCLES)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=280)
    output = (done.stdout + done.stderr)[-4000:]
    assert done.returncode >= 0, f"killed by signal {-done.returncode}:\n{output}"
    assert done.returncode == 0, f"a leaked descriptor or a failed cycle:\n{output}"
    assert f"cycles={CYCLES}" in done.stdout, output


def test_a_view_closed_while_its_thread_is_busy_closes_its_sockets_later(monkeypatch) -> None:
    """close() waits so long for the view thread (a listener may block it); past that, the
    thread closes its own sockets when it leaves, never someone else under it."""
    import threading
    import time

    from registry import client
    from registry.client import MembershipView
    from registry.server import RegistryConfig, RegistryServer

    monkeypatch.setattr(client, "THREAD_STOP_TIMEOUT_S", 0.1)
    failures: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: failures.append(args.exc_value))
    registry = RegistryServer(RegistryConfig(port=0, events_port=0, http_port=-1)).start()
    member = RawMember(registry.control_address)
    try:
        member.register()  # so the first snapshot changes the view and calls listeners
        view = MembershipView(registry.control_address)
        release = threading.Event()
        busy = threading.Event()

        def slow_listener(members: object) -> None:
            busy.set()
            release.wait(5)
        view.add_listener(slow_listener)
        view.start()
        assert busy.wait(10)  # the first snapshot is being handed to listeners
        view.close()  # gives up waiting after 0.1 s
        assert view._thread is not None and view._thread.is_alive()
        assert not view._sockets.destroyed  # nobody destroyed it under the thread
        release.set()
        view._thread.join(10)
        deadline = time.monotonic() + 5
        while not view._sockets.destroyed and time.monotonic() < deadline:
            time.sleep(0.01)
        assert view._sockets.destroyed  # the thread closed them on its way out
        assert failures == []
    finally:
        member.close()
        registry.close()


def test_a_registry_closed_while_its_loop_is_busy_closes_its_sockets_later(monkeypatch):
    import threading

    from registry import server
    from registry.membership import Membership, Outcome
    from registry.server import RegistryConfig, RegistryServer
    from wire.protocol import ReplyStatus

    monkeypatch.setattr(server, "LOOP_STOP_TIMEOUT_S", 0.1)
    failures: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: failures.append(args.exc_value))
    registry = RegistryServer(RegistryConfig(port=0, events_port=0, http_port=-1)).start()
    started, release = threading.Event(), threading.Event()

    def slow(membership: Membership, now: float) -> Outcome:
        started.set()
        release.wait(5)  # an admin action holding the loop
        return Outcome(ReplyStatus.OK)
    done = registry.submit(slow)
    # Closed once the loop holds the action (closed before, the loop just stops).
    assert started.wait(10)
    registry.close()  # gives up waiting after 0.1 s
    assert registry._loop_thread is not None and registry._loop_thread.is_alive()
    assert not registry._ctx.closed
    release.set()
    assert done.result(10).status is ReplyStatus.OK
    registry._loop_thread.join(10)
    assert registry._ctx.closed and failures == []


def test_a_started_registry_and_view_used_as_context_managers_run_one_thread_each() -> None:
    """`with RegistryServer(...).start() as registry:` once started a second loop thread on
    the same sockets; closing then left the first polling a destroyed context, and libzmq
    aborted the test process. Starting again now does nothing."""
    import threading

    from registry.client import MembershipView
    from registry.server import RegistryConfig, RegistryServer

    def threads(name: str) -> int:
        return sum(thread.name == name for thread in threading.enumerate())

    before = threads("pdreg-registry"), threads("pdreg-view")
    with RegistryServer(RegistryConfig(port=0, events_port=0, http_port=0)).start() as registry:
        control = registry.control_address
        assert registry.start() is registry and registry.control_address == control
        with MembershipView(control).start() as view:
            assert view.start() is view
            assert (threads("pdreg-registry"), threads("pdreg-view")) == \
                (before[0] + 1, before[1] + 1)
            assert wait_until(lambda: view.synced, 10)
    assert (threads("pdreg-registry"), threads("pdreg-view")) == before
    assert registry._ctx.closed
