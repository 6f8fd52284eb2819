"""A member as a process of its own: an `Agent` until SIGTERM (for SIGSTOP/kill tests).

    python tests/agent_process.py REGISTRY MEMBER_ID [PORT]

Prints "ready" once registered. Takes --token/--token-file/$PDREG_TOKEN and the CURVE key
flags and variables like the real commands do.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time

from engine_agent.agent import Agent, new_incarnation
from pdreg.args import (
    TOKEN,
    add_client_curve_arguments,
    add_secret_argument,
    client_curve_of,
    secret_of,
)
from pdreg.testing import wait_until
from wire.protocol import Endpoints, MemberSpec, MemberState, Role


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("registry")
    parser.add_argument("member_id")
    parser.add_argument("port", type=int, nargs="?", default=9000)
    add_secret_argument(parser, TOKEN)
    add_client_curve_arguments(parser)
    args = parser.parse_args()
    spec = MemberSpec(id=args.member_id, incarnation=new_incarnation(), role=Role.DECODE,
                      model="tiny", protocol="reference",
                      endpoints=Endpoints(http=f"http://127.0.0.1:{args.port}"),
                      started_at=time.time())
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    agent = Agent(spec, registries=args.registry, state=MemberState.READY,
                  token=secret_of(args, TOKEN), curve=client_curve_of(args)).start()
    try:
        if not wait_until(lambda: agent.registered, 30):
            print("not registered", flush=True)
            return 1
        print("ready", flush=True)
        stop.wait()
    finally:
        agent.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
