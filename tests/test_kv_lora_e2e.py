"""LoRA adapters and cache salts over real processes: reference engines serving an adapter
(`--lora-modules`, registered in their spec) key its blocks apart, as vLLM does, and a
`kv` router routes a request naming the adapter to the members serving it, predicting
exactly the hits the engines' own counters show; a plain request, or one with another
`cache_salt`, is predicted to hit nothing of the adapter's blocks, and hits nothing."""

from __future__ import annotations

import httpx
from reference_helpers import EngineHandle, metrics, start_engine, start_engines
from test_kv_e2e import kv_members, router_metric

from pdreg.testing import wait_until
from registry.client import MembershipView
from registry.server import RegistryServer
from router.service import RouterServer
from wire.protocol import MemberState

WAIT_S = 30.0
ADAPTER = "sql-lora"
SYSTEM = "You translate questions into SQL for the orders database. " * 12  # ~45 blocks
HITS = "pdreg:engine_prefix_cache_hit_tokens_total"


def complete(http: httpx.Client, url: str, model: str, prompt: str, **extra: str) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "ignore_eos": True, **extra}
    r = http.post(url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text


def test_an_adapters_blocks_are_its_own_on_the_engine() -> None:
    engine = start_engine(role="mixed", extra_args=["--lora-modules", f"{ADAPTER}=/adapters/sql"])
    try:
        with httpx.Client(timeout=60) as http:
            models = http.get(engine.url + "/v1/models").json()["data"]
            assert {m["id"]: m.get("parent") for m in models} == {"tiny": None,
                                                                  ADAPTER: "tiny"}
            complete(http, engine.url, "tiny", SYSTEM)
            complete(http, engine.url, ADAPTER, SYSTEM)  # same tokens, another adapter
            assert metrics(engine.url)[HITS] == 0
            complete(http, engine.url, ADAPTER, SYSTEM)
            hit = metrics(engine.url)[HITS]
            assert hit >= 40 * 16
            complete(http, engine.url, ADAPTER, SYSTEM, cache_salt="tenant-a")
            assert metrics(engine.url)[HITS] == hit  # a salt isolates, too
            r = http.post(engine.url + "/v1/completions",
                          json={"model": "tiny", "prompt": "x", "cache_salt": ""})
            assert r.status_code == 400  # as vLLM refuses it
    finally:
        engine.stop(timeout_s=10)


def test_the_router_routes_an_adapter_exactly(
        registry: RegistryServer, view: MembershipView, kv_router: RouterServer,
        handles: list[EngineHandle]) -> None:
    control = registry.control_address
    flags = ["--kv-events", "--lora-modules", ADAPTER]
    handles += start_engines([
        {"role": "prefill", "registry": control, "extra_args": flags},
        {"role": "prefill", "registry": control, "extra_args": flags},
        {"role": "decode", "registry": control, "extra_args": ["--lora-modules", ADAPTER]}])
    prefills = handles[:2]
    assert view.wait_for(lambda m: len([x for x in m.values()
                                        if x.record.state is MemberState.READY]) == 3, WAIT_S)
    assert wait_until(lambda: [m["state"] for m in kv_members(kv_router).values()]
                      == ["live", "live"], WAIT_S)
    with httpx.Client(timeout=60) as http:
        assert ADAPTER in [m["id"] for m in http.get(kv_router.url + "/v1/models").json()["data"]]
        complete(http, kv_router.url, ADAPTER, SYSTEM + "Orders from May?")
        assert wait_until(lambda: max(m["blocks"] for m in kv_members(kv_router).values()) > 40,
                          WAIT_S)
        for question in ("Top customers?", "Orders per day?", "Late shipments?"):
            complete(http, kv_router.url, ADAPTER, SYSTEM + question)
        hits = sum(metrics(h.url)[HITS] for h in prefills)
        assert hits >= 3 * 40 * 16  # every repeat went where the adapter's blocks are
        predicted = router_metric(kv_router, "pdreg_router_prompt_tokens_cached_total")
        assert predicted == hits  # and the router predicted exactly that
        assert router_metric(kv_router, "pdreg_router_kv_exact") == 1

        # The same tokens without the adapter, or under a salt: other blocks everywhere.
        complete(http, kv_router.url, "tiny", SYSTEM + "Top customers?")
        complete(http, kv_router.url, ADAPTER, SYSTEM + "Top customers?", cache_salt="t-a")
        assert sum(metrics(h.url)[HITS] for h in prefills) == hits
        assert router_metric(kv_router, "pdreg_router_prompt_tokens_cached_total") == predicted
