"""Who may choose a class or a tenant, over HTTP (a router on contract stand-ins).

With API keys in `--classes`: a request needs a key; a key names its tenant (a request's
`x-pdreg-tenant` is ignored, not refused), and `x-pdreg-priority` may name only the key's
classes (403), never an unknown one (400); `GET /v1/admission`, which names members,
needs a key too. Each refusal admits nothing and is counted."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from standins_fleet import Fleet, LoopThread

from router.config import AdmissionOptions
from router.guard import LOOPBACK_ALLOW
from router.service import RouterConfig, RouterServer
from wire.protocol import Handshake, Role

CLASSES = """default = "standard"
[classes.critical]
priority = 2
[classes.standard]
priority = 1
[keys.team-a]
key_env = "OVERLOAD_TEST_KEY_A"
classes = ["standard"]
"""
BODY = {"model": "m", "prompt": "hello", "max_tokens": 2}


@pytest.fixture
def router(loop_thread: LoopThread, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
           ) -> Iterator[RouterServer]:
    monkeypatch.setenv("OVERLOAD_TEST_KEY_A", "sk-team-a")
    classes = tmp_path / "classes.toml"
    classes.write_text(CLASSES)
    fleet = Fleet(loop_thread, Handshake.VLLM_NIXL)
    fleet.add("p1", Role.PREFILL)
    fleet.add("d1", Role.DECODE)
    server = RouterServer(RouterConfig(
        port=0, allow_upstream=LOOPBACK_ALLOW,
        admission=AdmissionOptions(classes_file=str(classes))), fleet.view).start()
    try:
        yield server
    finally:
        server.close()


def _post(server: RouterServer, key: str, **headers: str) -> httpx.Response:
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.post(server.url + "/v1/completions", json=BODY, headers=headers, timeout=30)


def _admission(server: RouterServer) -> dict:
    return httpx.get(server.url + "/v1/admission", timeout=10,
                     headers={"Authorization": "Bearer sk-team-a"}).json()


def test_keys_decide_the_class_and_tenant_a_stranger_changes_nothing(
        router: RouterServer) -> None:
    assert _post(router, "").status_code == 401  # keys configured: no key, no service
    assert _post(router, "sk-guess").status_code == 401
    forbidden = _post(router, "sk-team-a", **{"x-pdreg-priority": "critical"})
    assert forbidden.status_code == 403 and "class_not_allowed" in forbidden.text
    unknown = _post(router, "sk-team-a", **{"x-pdreg-priority": "gold"})
    assert unknown.status_code == 400 and "unknown_class" in unknown.text
    assert httpx.get(router.url + "/v1/admission", timeout=10).status_code == 401
    assert _admission(router)["models"] == {}  # the refusals admitted nothing
    ok = _post(router, "sk-team-a", **{"x-pdreg-tenant": "someone-else"})
    assert ok.status_code == 200, ok.text
    answered = _admission(router)["models"]["m"]["outcomes"]
    assert answered == {"standard": {"admitted": 1}}  # the key's class
    metrics = httpx.get(router.url + "/metrics", timeout=10,
                        headers={"Authorization": "Bearer sk-team-a"}).text
    assert 'pdreg_router_refused_total{reason="bad_class"} 2.0' in metrics
    assert 'pdreg_router_refused_total{reason="unauthorized"} 3.0' in metrics
