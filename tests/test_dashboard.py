"""The registry dashboard: the page, its SSE stream, and the page live in headless Chromium.

A real registry on loopback; members join and leave through real agents. The browser test
drives Chromium over the DevTools protocol and watches the page change without reloads.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import aiohttp
import httpx
import pytest

from engine_agent.agent import Agent, api_server_spec, new_incarnation
from pdreg.testing import die_with_parent, stop_process, wait_until
from registry.server import RegistryServer
from wire.protocol import (
    ROUTER_PROTOCOL,
    Endpoints,
    KvEventsSpec,
    KvIndexEntry,
    KvIndexState,
    Load,
    MemberSpec,
    MemberState,
    Role,
)

TIMEOUT_S = 20.0
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
NO_LOAD = Load()
SCREENSHOT_ENV = "PDREG_DASHBOARD_SCREENSHOT"  # set to a path to keep the screenshot


class Members:
    """Agents registering made-up engines; every one is stopped at the end."""

    def __init__(self, registry: RegistryServer) -> None:
        self.registry = registry
        self.agents: dict[str, Agent] = {}

    def join(self, member_id: str, role: Role, port: int, load: Load = NO_LOAD,
             load_of: Callable[[], Load] | None = None) -> Agent:
        spec = MemberSpec(id=member_id, incarnation=new_incarnation(), role=role,
                          model="tiny", protocol="vllm-nixl", capacity=8,
                          endpoints=Endpoints(http=f"http://127.0.0.1:{port}"))
        agent = Agent(spec, registries=self.registry.control_address,
                      load=load_of or (lambda: load),
                      state=MemberState.READY).start()
        self.agents[member_id] = agent
        return agent

    def leave(self, member_id: str) -> None:
        self.agents.pop(member_id).stop()

    def stop_all(self) -> None:
        for agent in self.agents.values():
            agent.stop()


@pytest.fixture
def members(registry: RegistryServer) -> Iterator[Members]:
    m = Members(registry)
    try:
        yield m
    finally:
        m.stop_all()



# --- HTTP: page, state, stream ----------------------------------------------------------

def test_page_is_self_contained(registry: RegistryServer) -> None:
    response = httpx.get(registry.http_url + "/")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    assert "EventSource" in response.text
    # Nothing may be fetched from elsewhere at run time.
    assert not re.search(r"(src|href)=\"(https?:)?//", response.text)


def test_state_lists_members_and_events(registry: RegistryServer, members: Members) -> None:
    members.join("prefill-a", Role.PREFILL, 21001, Load(running=3, waiting=1, kv_usage=0.25))
    assert wait_until(lambda: "prefill-a" in registry.members(), TIMEOUT_S)
    members.leave("prefill-a")
    assert wait_until(lambda: "prefill-a" not in registry.members(), TIMEOUT_S)
    members.join("decode-b", Role.DECODE, 21002)

    def state() -> dict[str, Any]:
        return httpx.get(registry.http_url + "/v1/dashboard").json()

    assert wait_until(lambda: [m["id"] for m in state()["members"]] == ["decode-b"], TIMEOUT_S)
    events = state()["events"]
    kinds = [(e["kind"], e["id"]) for e in events]
    assert ("joined", "prefill-a") in kinds and ("left", "prefill-a") in kinds
    assert kinds.index(("left", "prefill-a")) > kinds.index(("joined", "prefill-a"))
    assert [e["version"] for e in events] == sorted(e["version"] for e in events)


def _state_events(response: httpx.Response) -> Iterator[dict[str, Any]]:
    """What the page holds after each message: the whole state, then each `changes`
    applied to it (as the page's applyChanges does)."""
    event = ""
    members: dict[str, dict[str, Any]] = {}
    events: list[dict[str, Any]] = []
    for line in response.iter_lines():
        if line.startswith("event:"):
            event = line.split(":", 1)[1].strip()
        elif line.startswith("data:"):
            data = json.loads(line.split(":", 1)[1])
            if event == "state":
                members = {m["id"]: m for m in data["members"]}
                events = data["events"]
            elif event == "changes":
                apply_ops(members, events, data["ops"])
            yield {"members": list(members.values()), "events": list(events)}


def apply_ops(members: dict[str, dict[str, Any]], events: list[dict[str, Any]],
              ops: list[dict[str, Any]]) -> None:
    for op in ops:
        if "event" in op:
            events.append(op["event"])
            if "member" in op:
                members[op["member"]["id"]] = op["member"]
            else:
                members.pop(op["event"]["id"], None)
        elif "loads" in op:
            for member_id, incarnation, running, waiting, kv_usage, _ in op["loads"]:
                held = members.get(member_id)
                if held is not None and held["incarnation"] == incarnation:
                    held["load"] = {**held["load"], "running": running, "waiting": waiting,
                                    "kv_usage": kv_usage}


def test_stream_pushes_joins_leaves_and_load(registry: RegistryServer,
                                             members: Members) -> None:
    timeout = httpx.Timeout(TIMEOUT_S)
    with httpx.stream("GET", registry.http_url + "/v1/stream", timeout=timeout) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        states = _state_events(response)
        assert next(states)["members"] == []  # the current state comes at once
        load = [Load(running=2)]
        members.join("decode-x", Role.DECODE, 21003, load_of=lambda: load[0])
        state = next(s for s in states if s["members"])
        assert state["members"][0]["id"] == "decode-x"
        assert state["members"][0]["state"] == "ready"
        load[0] = Load(running=7, waiting=3, kv_usage=0.5)  # a load change alone is pushed
        state = next(s for s in states if s["members"][0]["load"]["running"] == 7)
        assert state["members"][0]["load"]["kv_usage"] == 0.5
        members.leave("decode-x")
        state = next(s for s in states if not s["members"])
        assert state["events"][-1]["kind"] == "left"


# --- the page in a real browser ---------------------------------------------------------

class Browser:
    """Headless Chromium with one page, driven over the DevTools protocol."""

    def __init__(self, url: str) -> None:
        assert CHROMIUM is not None
        self.profile = tempfile.mkdtemp(prefix="pdreg-chromium-")
        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
             "--disable-background-networking", "--disable-component-update",
             "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
             f"--user-data-dir={self.profile}", "--remote-debugging-address=127.0.0.1",
             "--remote-debugging-port=0", "--window-size=1280,860", url],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
            text=True, preexec_fn=die_with_parent)
        self.devtools = self._devtools_url()

    def _devtools_url(self) -> str:
        assert self.proc.stderr is not None
        deadline = time.monotonic() + TIMEOUT_S * 2
        for line in self.proc.stderr:
            match = re.search(r"DevTools listening on (ws://\S+)", line)
            if match:
                return match.group(1)
            if time.monotonic() > deadline:
                break
        raise RuntimeError("chromium did not start its DevTools endpoint")

    def page_ws(self) -> str:
        http = self.devtools.replace("ws://", "http://").split("/devtools/")[0]
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            pages = [t for t in httpx.get(f"{http}/json/list").json() if t["type"] == "page"]
            if pages:
                return pages[0]["webSocketDebuggerUrl"]
            time.sleep(0.1)
        raise RuntimeError("chromium opened no page")

    def close(self) -> None:
        stop_process(self.proc, 10)
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        shutil.rmtree(self.profile, ignore_errors=True)


class Page:
    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.next_id = 0

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        await self.ws.send_json({"id": self.next_id, "method": method, "params": params})
        while True:
            message = await self.ws.receive_json(timeout=TIMEOUT_S)
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise RuntimeError(message["error"])
                return message["result"]

    async def evaluate(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", expression=expression,
                                 returnByValue=True)
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout_s: float = TIMEOUT_S) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            value = await self.evaluate(expression)
            if value or time.monotonic() > deadline:
                return value
            await asyncio.sleep(0.1)


CARD_IDS = "[...document.querySelectorAll('.member')].map(c => c.dataset.id).join(',')"


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (apt-get install chromium)")
@pytest.mark.timeout(120)
def test_page_updates_live_in_chromium(registry: RegistryServer, members: Members) -> None:
    members.join("prefill-127.0.0.1-21011", Role.PREFILL, 21011,
                 Load(running=5, waiting=2, kv_usage=0.4))
    members.join("decode-127.0.0.1-21021", Role.DECODE, 21021, Load(running=3, kv_usage=0.7))
    assert wait_until(lambda: len(registry.members()) == 2, TIMEOUT_S)
    _in_chromium(registry, lambda page: _drive(page, members))


def _in_chromium(registry: RegistryServer, drive: Callable[[Page], Awaitable[None]]) -> None:
    """Open the dashboard in Chromium and run `drive` on its page."""
    browser = Browser(registry.http_url + "/")

    async def connected() -> None:
        async with aiohttp.ClientSession() as session, session.ws_connect(
                browser.page_ws(), max_msg_size=0) as ws:
            await drive(Page(ws))
    try:
        asyncio.run(connected())
    finally:
        browser.close()


async def _drive(page: Page, members: Members) -> None:
    ids = await page.wait_for(f"document.querySelectorAll('.member').length == 2 && "
                              f"{CARD_IDS}")
    assert ids == "prefill-127.0.0.1-21011,decode-127.0.0.1-21021"
    assert await page.evaluate("document.getElementById('conn').textContent") == "live"
    version = int(await page.evaluate("document.body.dataset.version"))

    # A member joins: the page shows it without a reload.
    await asyncio.to_thread(members.join, "decode-127.0.0.1-21022", Role.DECODE, 21022,
                            Load(running=1, kv_usage=0.1))
    assert await page.wait_for(f"({CARD_IDS}).includes('decode-127.0.0.1-21022')")
    assert await page.wait_for(
        "document.querySelector('[data-role=decode] h2').textContent"
        ".includes('2 routable / 2')")
    assert int(await page.evaluate("document.body.dataset.version")) > version
    assert await page.evaluate("performance.getEntriesByType('navigation').length") == 1

    # The load bars reflect what the members report.
    width = await page.evaluate(
        "document.querySelector('[data-id=\"prefill-127.0.0.1-21011\"] .bar.kv .fill')"
        ".style.width")
    assert width == "40%"
    await _screenshot(page)

    # A member leaves: its card goes, and the event list says so.
    await asyncio.to_thread(members.leave, "prefill-127.0.0.1-21011")
    assert await page.wait_for(f"!({CARD_IDS}).includes('prefill-127.0.0.1-21011')")
    events = await page.evaluate("document.getElementById('events').innerText")
    assert "left" in events and "prefill-127.0.0.1-21011" in events


async def _screenshot(page: Page) -> None:
    shot = await page.call("Page.captureScreenshot", format="png")
    png = base64.b64decode(shot["data"])
    assert png.startswith(b"\x89PNG")
    target = os.environ.get(SCREENSHOT_ENV)
    if target:
        with open(target, "wb") as out:
            out.write(png)


def test_state_is_computed_once_per_snapshot_for_every_viewer() -> None:
    """Viewers cannot make the registry redo work per viewer: one JSON per snapshot."""
    from registry.dashboard import SharedState
    from registry.published import Published

    snapshot = Published(epoch=1, version=1, members=(), heartbeat_interval_s=1.0,
                         lease_s=3.0, self_preserving=False, taken_at=time.time())
    current = {"published": snapshot}

    shared = SharedState(lambda: current["published"])
    first = shared.current()
    assert all(shared.current() is first for _ in range(100))  # the same object
    current["published"] = Published(epoch=1, version=2, members=(), heartbeat_interval_s=1.0,
                                     lease_s=3.0, self_preserving=False, taken_at=time.time())
    second = shared.current()
    assert second is not first and json.loads(second)["version"] == 2


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (apt-get install chromium)")
@pytest.mark.timeout(120)
def test_page_shows_the_kv_index_routers_report(registry: RegistryServer,
                                                members: Members) -> None:
    """A member that publishes KV events gets a KV index line: what a registered router
    reports of it (`Agent.report_kv`, as router/kv/reporter.py sends), updated live."""
    kv = KvEventsSpec(endpoint="tcp://127.0.0.1:21557", block_size=16)
    spec = MemberSpec(id="prefill-127.0.0.1-21031", incarnation=new_incarnation(),
                      role=Role.PREFILL, model="tiny", protocol="vllm-nixl", kv_events=kv,
                      endpoints=Endpoints(http="http://127.0.0.1:21031"))
    prefill = Agent(spec, registries=registry.control_address, state=MemberState.READY)
    router = Agent(api_server_spec("127.0.0.1", 21041, ROUTER_PROTOCOL),
                   registries=registry.control_address, state=MemberState.READY)
    members.agents.update({spec.id: prefill.start(), router.spec.id: router.start()})
    assert wait_until(lambda: len(registry.members()) == 2 and router.registered, TIMEOUT_S)
    _in_chromium(registry, lambda page: _drive_kv(page, spec, router))


async def _drive_kv(page: Page, spec: MemberSpec, router: Agent) -> None:
    line = f"document.querySelector('[data-id=\"{spec.id}\"] .kvindex')"
    assert await page.wait_for(f"{line} && {line}.innerText.includes('not reported')")
    router.report_kv([KvIndexEntry(spec.id, spec.incarnation, KvIndexState.LIVE, 120, 40)])
    assert await page.wait_for(f"{line}.innerText.includes('120 blocks')")
    assert await page.evaluate(f"{line}.className") == "kvindex live"
    router.report_kv([KvIndexEntry(spec.id, spec.incarnation, KvIndexState.UNKNOWN, 3,
                                   2500)])
    assert await page.wait_for(f"{line}.className == 'kvindex unknown'")
    text = await page.evaluate(f"{line}.innerText")
    assert "3 blocks" in text and "lag 2.5s" in text and "1 unknown" in text
