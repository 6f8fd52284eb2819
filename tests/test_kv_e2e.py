"""End to end with `--policy kv`: a real registry, reference engines publishing KV events
(processes), the router's feed and index. A long shared prefix goes to the prefill that
holds it; a restarted prefill's old blocks are never counted; the answer is unchanged."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
from typing import Any

import httpx
import pytest
from reference_helpers import EngineHandle, collect, metrics, start_engine, start_engines

from pdreg.testing import free_low_port, wait_until
from registry.client import MembershipView
from registry.server import RegistryServer
from router.service import RouterServer
from wire.figures import PREFIX_CACHE_HIT_RATE
from wire.protocol import MemberState

WAIT_S = 30.0
SYSTEM = ("You are a careful assistant. Answer in one short sentence, cite nothing, and "
          "never apologise. ") * 8  # ~750 bytes: ~47 blocks of 16 tokens


def kv_members(router: RouterServer) -> dict[str, dict[str, Any]]:
    body = httpx.get(router.url + "/v1/kv", timeout=10).json()
    return {m["id"]: m for m in body["members"]}


def ready(view: MembershipView, *ids: str) -> bool:
    members = view.members()
    return all(i in members and members[i].record.state is MemberState.READY for i in ids)


def ready_pair(registry: RegistryServer, view: MembershipView,
               handles: list[EngineHandle], prefill_flags: list[str]
               ) -> tuple[EngineHandle, EngineHandle]:
    """A prefill (started with `prefill_flags`) and a decode on `registry`, both READY in
    `view`; each stopped at the test's end."""
    control = registry.control_address
    p, d = start_engines([{"role": "prefill", "registry": control,
                           "extra_args": prefill_flags},
                          {"role": "decode", "registry": control}])
    handles += [p, d]
    assert view.wait_for(lambda m: ready(view, p.id, d.id), WAIT_S)
    return p, d


def router_metric(router: RouterServer, name: str) -> float:
    text = httpx.get(router.url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def ask(http: httpx.Client, router: RouterServer, prompt: str) -> list[int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "ignore_eos": True,
            "return_token_ids": True}
    r = http.post(router.url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return collect(r, False)[0]


def test_shared_prefix_goes_to_its_prefill_and_a_restart_forgets_it(
        registry: RegistryServer, view: MembershipView, kv_router: RouterServer,
        handles: list[EngineHandle]) -> None:
    control = registry.control_address
    port = free_low_port()
    kv: list[str] = []  # KV events are on by default: no flag
    p1, p2, d = start_engines([
        {"role": "prefill", "registry": control, "extra_args": [*kv, "--port", str(port)]},
        {"role": "prefill", "registry": control, "extra_args": ["--kv-events"]},  # accepted
        {"role": "decode", "registry": control}])
    handles += [p1, p2, d]
    assert view.wait_for(lambda m: ready(view, p1.id, p2.id, d.id), WAIT_S)
    assert wait_until(lambda: [m["state"] for m in kv_members(kv_router).values()]
                      == ["live", "live"], WAIT_S)
    mixed = start_engine(role="mixed")  # not registered: the single-instance reference
    handles.append(mixed)
    with httpx.Client(timeout=60) as http:
        first = ask(http, kv_router, SYSTEM + "What is 2+2?")
        # The first prefill now holds the prefix: wait until the router's index has it.
        assert wait_until(lambda: max(m["blocks"] for m in kv_members(kv_router).values()) > 40,
                          WAIT_S)
        holder = max(kv_members(kv_router).values(), key=lambda m: m["blocks"])["id"]
        for question in ("Name a colour.", "Why is the sky blue?", "Count to three."):
            prompt = SYSTEM + question
            got = ask(http, kv_router, prompt)
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "ignore_eos": True,
                    "return_token_ids": True}
            assert got == collect(http.post(mixed.url + "/v1/completions", json=body),
                                  False)[0]  # the answer is unchanged
        assert first
        by_id = {p1.id: p1, p2.id: p2}
        hits = {i: metrics(h.url)["pdreg:engine_prefix_cache_hit_tokens_total"]
                for i, h in by_id.items()}
        other = next(i for i in by_id if i != holder)
        assert hits[holder] >= 3 * 40 * 16 and hits[other] == 0  # every repeat hit, there
        assert router_metric(kv_router, "pdreg_router_prompt_tokens_cached_total") == hits[holder]
        # Every prediction held against the engine's own report: nobody is distrusted.
        checked = router_metric(kv_router, "pdreg_router_kv_cache_reports_total")
        assert checked == 3 and router_metric(kv_router, "pdreg_router_kv_distrusts_total") == 0
        assert httpx.get(kv_router.url + "/ready", timeout=10).json()["warnings"] == []

        # Operators see it: `pdreg status --router` shows the index per member, and the
        # engines' own hit rate (a load figure, with the next heartbeat).
        assert view.wait_for(lambda m: PREFIX_CACHE_HIT_RATE in m[holder].load.extra, WAIT_S)
        status = [sys.executable, "-m", "pdreg", "status", "--registry", control,
                  "--router", kv_router.url]
        listed = subprocess.run([*status, "--json"], capture_output=True, text=True,
                                timeout=60, check=True)
        members = {m["id"]: m for m in json.loads(listed.stdout)}
        assert members[holder]["kv_index"]["state"] == "live"
        assert members[holder]["kv_index"]["blocks"] == kv_members(kv_router)[holder]["blocks"]
        # The decode publishes too (by default), but a router that never skips the
        # prefill leg has no use for its cache, so it follows none of it.
        assert members[d.id]["kv_events"] is not None
        assert members[d.id]["kv_index"]["state"] == "not followed"
        table = subprocess.run(status, capture_output=True, text=True, timeout=60, check=True)
        assert "KV INDEX" in table.stdout and "live" in table.stdout
        assert "HIT%" in table.stdout  # the engines' own hit rate, from their heartbeats
        assert "kv pairing, model tiny: exact, 2 members publish KV events" in table.stdout
        assert members[d.id]["kv_pairing"]["pairing"] == "exact"

        # The holder restarts (same id, new incarnation, empty cache): its old blocks must
        # not be counted, whatever the timing of the feed.
        holder_handle = by_id[holder]
        old = kv_members(kv_router)[holder]["incarnation"]
        holder_handle.stop(timeout_s=10)
        extra = [*kv, "--port", holder_handle.url.rsplit(":", 1)[1]]
        restarted = start_engine(role="prefill", registry=control, extra_args=extra)
        handles.append(restarted)
        assert restarted.id == holder
        assert view.wait_for(lambda m: ready(view, holder) and
                             m[holder].record.spec.incarnation != old, WAIT_S)
        cached_before = router_metric(kv_router, "pdreg_router_prompt_tokens_cached_total")
        ask(http, kv_router, SYSTEM + "A question after the restart?")
        assert router_metric(kv_router, "pdreg_router_prompt_tokens_cached_total") == cached_before
        assert wait_until(lambda: kv_members(kv_router).get(holder, {}).get("incarnation")
                          not in (None, old), WAIT_S)
        assert wait_until(lambda: kv_members(kv_router)[holder]["state"] == "live", WAIT_S)


def test_a_fleet_that_publishes_nothing_is_paired_as_peak_ewma(
        registry: RegistryServer, view: MembershipView, kv_router: RouterServer,
        handles: list[EngineHandle], caplog: pytest.LogCaptureFixture) -> None:
    """Engines told not to publish KV events. Requests are served; before any request the
    router says per model that it pairs as peak_ewma and why, in /ready (and so in its
    log) and plain `pdreg status` says it too; then in /v1/kv and its metrics, logged
    once; it follows nobody (no KV feed started)."""
    control = registry.control_address
    ready_pair(registry, view, handles, ["--no-kv-events"])
    caplog.set_level(logging.INFO, logger="router")
    with httpx.Client(timeout=60) as http:
        assert wait_until(lambda: http.get(kv_router.url + "/v1/models").json()["data"], WAIT_S)
        warned = [w for w in http.get(kv_router.url + "/ready").json()["warnings"]
                  if "peak_ewma" in w]
        assert warned == ["requests for a model cannot be matched to the engines' KV caches "
                          "exactly; its prefills are chosen as peak_ewma: model tiny: "
                          "no_events; its engines publish no KV events (vLLM/SGLang "
                          "--kv-events-config, the reference engine by default unless "
                          "--no-kv-events)"]
        status = subprocess.run([sys.executable, "-m", "pdreg", "status", "--registry",
                                 control], capture_output=True, text=True, timeout=60,
                                check=True)
        assert "kv pairing, model tiny: peak_ewma fallback (no_events" in status.stdout
        for question in ("Name a colour.", "Why is the sky blue?", "Count to three."):
            assert ask(http, kv_router, SYSTEM + question)
        body = http.get(kv_router.url + "/v1/kv").json()
    assert body["members"] == []
    assert body["models"] == {"tiny": {"pairing": "peak_ewma", "why": "no_events",
                                       "publishers": 0}}
    assert router_metric(kv_router, "pdreg_router_kv_inexact_requests_total") == 3
    assert router_metric(kv_router, "pdreg_router_kv_exact") == 0
    said = [r for r in caplog.records if "paired as peak_ewma" in r.getMessage()]
    assert len(said) == 1 and "no_events" in said[0].getMessage()
    assert any("chosen as peak_ewma: model tiny" in r.getMessage() for r in caplog.records
               if r.name == "router.readiness")  # said once it held, before any request
    assert not any(t.name == "kv-feed" for t in threading.enumerate())
