"""Start and close two registries and two views in one process, again and again, with
traffic between them; exit 0 if every cycle closed cleanly and no descriptor leaked.

Run as a child process by tests/test_close_cycles.py: a libzmq assertion aborts the whole
process ("Socket operation on non-socket" was seen), which a test in pytest's own
process could not report. Prints one line: cycles, descriptors before and after, time.

    python tests/close_cycles.py [CYCLES]
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time

import zmq
from raw_member import member_spec

from registry import sessions
from registry.client import MembershipView
from registry.membership import Membership, Outcome
from registry.server import RegistryConfig, RegistryServer
from wire.protocol import MemberState, Register, ReplyStatus, make_encoder

WARM_UP = 5  # cycles before descriptors are counted (imports, lazily made pools)
WAIT_S = 5.0
ADMIN_EVERY_S = 0.002


def descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def register(ctx: zmq.Context, address: str, member_id: str) -> None:
    """A member registering at `address` (one round trip), from a socket of its own."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{address}")
        sock.send(make_encoder().encode(Register(spec=member_spec(member_id, model="m"),
                                                 nonce=sessions.new_nonce(),
                                                 state=MemberState.READY)))
        if not sock.poll(WAIT_S * 1e3):
            raise RuntimeError(f"{address} did not answer a Register")
        sock.recv()
    finally:
        sock.close(linger=0)


def nothing(membership: Membership, now: float) -> Outcome:
    return Outcome(ReplyStatus.OK)


def admin(registry: RegistryServer, stop: threading.Event) -> None:
    """What an HTTP thread does meanwhile: admin actions and snapshot reads, each of which
    wakes the loop through its wake socket, up to and during close."""
    while not stop.wait(ADMIN_EVERY_S):
        registry.submit(nothing)
        registry.published  # noqa: B018 - a read that may wake the loop


def cycle(ctx: zmq.Context, i: int) -> None:
    registries = [RegistryServer(RegistryConfig(port=0, events_port=0, http_port=-1,
                                                heartbeat_interval_s=0.05, lease_s=0.5))
                  .start() for _ in range(2)]
    addresses = [r.control_address for r in registries]
    views = [MembershipView(addresses).start() for _ in range(2)]
    member_id = f"decode-{i % 7}"
    stop = threading.Event()
    admins = [threading.Thread(target=admin, args=(r, stop)) for r in registries]
    for thread in admins:
        thread.start()
    try:
        for address in addresses:
            register(ctx, address, member_id)
        if i % 2:  # half the cycles close with the traffic seen, half while it is in flight
            for view in views:
                if not view.wait_for(lambda seen: member_id in seen, WAIT_S):
                    raise RuntimeError(f"cycle {i}: a view never saw the member")
    finally:
        # Alternate who goes first: views under live registries, registries under views.
        for closable in ([*views, *registries] if i % 3 else [*registries, *views]):
            closable.close()
        stop.set()
        for thread in admins:
            thread.join()


def main() -> int:
    faulthandler.enable()  # an abort prints every thread's stack
    cycles = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    started = time.monotonic()
    before = 0
    ctx = zmq.Context()
    for i in range(cycles):
        if i == WARM_UP:
            before = descriptors()
        cycle(ctx, i)
    after = descriptors()
    ctx.destroy(linger=0)
    print(f"cycles={cycles} fds_before={before} fds_after={after} "
          f"seconds={time.monotonic() - started:.1f}", flush=True)
    return 0 if after <= before else 1


if __name__ == "__main__":
    sys.exit(main())
