"""End to end, over real processes: an insider whose KV events lie stops drawing a
prefix's requests once its own reports contradict them.

An honest prefill (a reference engine, prefix cache on) holds a shared prefix. An insider
registers a working prefill (a reference engine with its prefix cache off) whose spec
points at a KV event publisher that claims the same prefix, as someone holding the fleet
token could. The router (`--policy kv`) first splits the prefix's requests between the
two equal claims at random; the insider's engine reports 0 cached tokens each time, so
after a few it is distrusted and every further request for the prefix goes to the honest
prefill, which finds it cached. The router counts it, shows it in /v1/kv and /ready.
Both handshakes: vLLM's (the prefill's answer is read) and SGLang's (drained beside D).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from reference_helpers import EngineHandle, metrics, start_engine, start_engines

from engine_agent.agent import Agent, default_member_id, new_incarnation
from engine_agent.reference.kv_publisher import KvEventPublisher
from engine_agent.reference.prefix_cache import PrefixCache
from engine_agent.reference.tokens import BYTES_TOKENIZER, encode
from pdreg.testing import wait_until
from registry.client import MembershipView
from registry.server import RegistryServer
from router.kv.trust import STRIKES
from router.service import RouterServer
from wire.protocol import Endpoints, Handshake, KvEventsSpec, MemberSpec, MemberState, Role

WAIT_S = 60.0
BLOCK = 16
PREFIX = ("You are a careful assistant. Answer in one short sentence, cite nothing, and "
          "never apologise. ") * 8  # ~750 bytes: 46 full blocks
MAX_REQUESTS = 80  # until the insider strikes out (ties are at random: a few dozen)
AFTER = 15  # requests for the prefix once it is distrusted


@pytest.fixture
def lying_publisher() -> Iterator[KvEventPublisher]:
    publisher = KvEventPublisher("127.0.0.1")
    try:
        yield publisher
    finally:
        publisher.close()


def picks(router: RouterServer, member_id: str) -> float:
    text = httpx.get(router.url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pdreg_router_picks_total{")
               and f'member="{member_id}"' in line and 'role="prefill"' in line)


def kv_member(router: RouterServer, member_id: str) -> dict:
    members = httpx.get(router.url + "/v1/kv", timeout=10).json()["members"]
    return next((m for m in members if m["id"] == member_id), {})


def register_insider(registry: RegistryServer, engine: EngineHandle,
                     publisher: KvEventPublisher, protocol: str) -> tuple[Agent, str]:
    """The insider's engine, registered with a spec whose KV events are the liar's."""
    member_id = default_member_id(Role.PREFILL, "127.0.0.1", int(engine.url.rsplit(":", 1)[1]))
    spec = MemberSpec(
        id=member_id, incarnation=new_incarnation(), role=Role.PREFILL, model="tiny",
        protocol=protocol,
        endpoints=Endpoints(http=engine.url, kv_host="127.0.0.1", kv_port=engine.kv_port,
                            bootstrap_port=engine.bootstrap_port),
        kv_events=KvEventsSpec(endpoint=f"tcp://127.0.0.1:{publisher.port}",
                               replay_endpoint=f"tcp://127.0.0.1:{publisher.replay_port}",
                               block_size=BLOCK, hash_scheme="pdreg:content",
                               tokenizer=BYTES_TOKENIZER))
    agent = Agent(spec, registries=registry.control_address, state=MemberState.READY)
    return agent.start(), member_id


def ask(http: httpx.Client, router: RouterServer, prompt: str) -> None:
    r = http.post(router.url + "/v1/completions", json={
        "model": "tiny", "prompt": prompt, "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("protocol", [Handshake.VLLM_NIXL, Handshake.SGLANG])
def test_an_insider_whose_events_lie_stops_receiving_the_prefix(
        registry: RegistryServer, view: MembershipView, kv_router: RouterServer,
        handles: list[EngineHandle], lying_publisher: KvEventPublisher, protocol: str) -> None:
    control = registry.control_address
    honest, decode = start_engines([
        {"role": "prefill", "registry": control, "protocol": protocol},
        {"role": "decode", "registry": control, "protocol": protocol}])
    insider_engine = start_engine(role="prefill", protocol=protocol,
                                  extra_args=["--prefix-cache-blocks", "0"])
    handles += [honest, decode, insider_engine]
    with httpx.Client(timeout=60) as http:
        assert view.wait_for(lambda m: all(i in m and m[i].record.state is MemberState.READY
                                           for i in (honest.id, decode.id)), WAIT_S)
        assert wait_until(lambda: kv_member(kv_router, honest.id).get("state") == "live", WAIT_S)
        ask(http, kv_router, PREFIX + "Warm up.")  # the honest prefill now holds the prefix
        assert wait_until(lambda: kv_member(kv_router, honest.id)["blocks"] >= 40, WAIT_S)

        # The insider claims the same prefix: the blocks a real cache would store for it.
        claimed = PrefixCache(BLOCK, 1024)
        ids = encode(PREFIX + "Warm up.")
        lying_publisher.publish(claimed.store(ids, claimed.lookup(ids).keys, lambda i: None))
        agent, insider = register_insider(registry, insider_engine, lying_publisher,
                                          protocol)
        try:
            assert wait_until(lambda: kv_member(kv_router, insider).get("blocks", 0) >= 40,
                              WAIT_S)
            sent = 0
            while not kv_member(kv_router, insider)["distrusted_s"]:
                assert sent < MAX_REQUESTS, "the insider was never distrusted"
                ask(http, kv_router, PREFIX + f"Question {sent}?")
                sent += 1
            drawn = picks(kv_router, insider)
            assert drawn == STRIKES  # it won ties until its reports gave it away...
            for i in range(AFTER):
                ask(http, kv_router, PREFIX + f"Question {sent + i}?")
            assert picks(kv_router, insider) == drawn  # ...and none after that
            assert kv_member(kv_router, insider)["distrusted_s"] > 0
            assert kv_member(kv_router, honest.id)["distrusted_s"] is None
            text = httpx.get(kv_router.url + "/metrics", timeout=10).text
            assert f'pdreg_router_kv_distrusts_total{{member="{insider}"}} 1.0' in text
            warnings = httpx.get(kv_router.url + "/ready", timeout=10).json()["warnings"]
            assert any(insider in w for w in warnings)
            # The honest prefill found the prefix cached for every request it served.
            served = sent + AFTER + 1 - drawn
            hit = metrics(honest.url)["pdreg:engine_prefix_cache_hit_tokens_total"]
            assert hit >= (served - 1) * 40 * BLOCK
        finally:
            agent.stop()
