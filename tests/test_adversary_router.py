"""The router against its own host and against other models' churn, over real sockets and
processes: a member cannot point it at a service bound on the host's own (non-loopback)
addresses, and a router serving some models is not made to resync by the others."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import msgspec
import pytest
from raw_member import RawMember, member_spec

from pdreg.testing import die_with_parent, stop_process, wait_until
from registry.server import RegistryServer
from router.guard import LOOPBACK_ALLOW, UpstreamPolicy
from router.host_addresses import own_addresses
from router.http.bounds import FailureKind, UpstreamError
from router.http.upstream import UpstreamPool
from wire.protocol import Load, MemberSpec, Role

WAIT_S = 20.0
HEARTBEAT_S = 0.2  # registry_factory's interval


def _outside_address() -> str | None:
    """One of this host's own addresses beyond loopback that a server can bind, if any."""
    for address in own_addresses():
        ip = ipaddress.ip_address(address)
        if not ip.is_loopback and not ip.is_link_local:
            return address
    return None


def test_the_hosts_own_addresses_are_denied_by_default() -> None:
    """A service on the host's own interface address (here one the kernel lists, which
    the default policy would otherwise count as public) is refused like loopback; naming
    the address itself allows it."""
    address = _outside_address()
    if address is None:
        pytest.skip("this host has no address beyond loopback")

    async def run() -> None:
        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
            await writer.drain()
            writer.close()
        server = await asyncio.start_server(answer, address, 0)
        port = server.sockets[0].getsockname()[1]
        host = f"[{address}]" if ":" in address else address
        url = f"http://{host}:{port}"
        refusing = UpstreamPool(policy=UpstreamPolicy.build())
        allowing = UpstreamPool(policy=UpstreamPolicy.build(
            f"{address}/{32 if '.' in address else 128}"))
        try:
            with pytest.raises(UpstreamError) as caught:
                await refusing.post(url, "/v1/completions", b"{}", "r1")
            assert caught.value.kind is FailureKind.FORBIDDEN
            answered = await allowing.post(url, "/v1/completions", b"{}", "r2")
            assert answered.status == 200
        finally:
            await refusing.close()
            await allowing.close()
            server.close()
            await server.wait_closed()

    asyncio.run(run())
    policy = UpstreamPolicy.build()
    assert not policy.allows(address) and policy.allows("8.8.8.8")
    assert UpstreamPolicy.build(LOOPBACK_ALLOW).allows("127.0.0.1")


@pytest.fixture
def router_of_m(registry_factory) -> Iterator[tuple[RegistryServer, str]]:
    """A registry, and a `pdreg router --models m` process following it."""
    registry = registry_factory()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdreg", "router", "--registry", registry.control_address,
         "--port", "0", "--models", "m", "--no-register", "--policy", "least_loaded",
         "--allow-upstream", LOOPBACK_ALLOW],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
        preexec_fn=die_with_parent)
    try:
        assert proc.stdout is not None
        ready = proc.stdout.readline().decode()
        assert '"ready"' in ready, ready
        yield registry, json.loads(ready)["url"]
    finally:
        assert stop_process(proc, 20) == 0


def _routable(spec: MemberSpec) -> MemberSpec:
    """A spec the router pairs (a handshake it speaks)."""
    return msgspec.structs.replace(spec, protocol="vllm-nixl")


def _serves(url: str, model: str) -> bool:
    data = httpx.get(f"{url}/v1/models", timeout=5).json()["data"]
    return model in {m["id"] for m in data}


def test_a_router_of_one_model_does_not_resync_on_the_others(router_of_m) -> None:
    """Another model's members join, change load, leave and expire while ours
    heartbeats: the router takes no snapshot beyond its first, and still sees ours."""
    registry, url = router_of_m
    address = registry.control_address
    ours = RawMember(address, spec=_routable(member_spec("decode-m", role=Role.DECODE,
                                                         model="m")))
    later = RawMember(address, spec=_routable(member_spec("prefill-m", model="m")))
    theirs = [RawMember(address, spec=member_spec(f"prefill-n{i}", model="n"))
              for i in range(10)]
    try:
        ours.register()
        # The router's view: the empty topic's snapshot (for the event port), then its own.
        assert wait_until(lambda: registry.stats.syncs >= 2, WAIT_S)
        synced = registry.stats.syncs
        for member in theirs:
            member.register()
        for step in range(15):  # 3 s of load changes, at the heartbeat interval
            ours.heartbeat(Load(running=step % 3))
            for i, member in enumerate(theirs):
                member.heartbeat(Load(running=(step + i) % 5, kv_usage=step / 20))
            time.sleep(HEARTBEAT_S)  # pacing heartbeats, not waiting on a condition
        silent = theirs[8:]  # fall silent and expire (few: no self-preservation)
        gone = lambda: not any(m.spec.id in registry.members() for m in silent)  # noqa: E731

        def beat() -> bool:
            for member in (ours, *theirs[:8]):
                member.heartbeat(Load())
            return gone()
        assert wait_until(beat, WAIT_S, poll_s=HEARTBEAT_S)
        for member in theirs[:8]:
            member.bye()
        later.register()

        def served() -> bool:
            ours.heartbeat(Load())
            later.heartbeat(Load())
            return _serves(url, "m")
        assert wait_until(served, WAIT_S, poll_s=0.2)
        assert registry.stats.syncs == synced
    finally:
        for member in (ours, later, *theirs):
            member.close()
