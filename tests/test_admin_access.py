"""Admin over the registry's HTTP side alone, bad input to the admin endpoints, and
several tokens accepted at once (rotation without downtime)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from raw_member import RawMember

from pdreg.targets import Target, parse_targets
from registry.server import RegistryConfig, RegistryServer
from wire.protocol import ReplyStatus

OLD, NEW = "fleet-token-old", "fleet-token-new"
ADMIN_OLD, ADMIN_NEW = "admin-token-old", "admin-token-new"


@pytest.mark.parametrize(("text", "expected"), [
    ("127.0.0.1:7600", [Target("127.0.0.1:7600", control="127.0.0.1:7600")]),
    ("https://reg.example:7680", [Target("https://reg.example:7680",
                                         url="https://reg.example:7680")]),
    ("http://10.0.0.1:7680/, a:1,a:1", [Target("http://10.0.0.1:7680", url="http://10.0.0.1:7680"),
                                        Target("a:1", control="a:1")]),
])
def test_registries_by_control_address_or_http_url(text: str, expected: list[Target]) -> None:
    assert parse_targets(text) == expected


@pytest.mark.parametrize("text", ["http://", "https://h:7680/v1/members", "http://h:x",
                                  "h", "h:0", ","])
def test_bad_registry_names_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_targets(text)


@pytest.fixture
def registry() -> Iterator[RegistryServer]:
    # Two tokens of each kind, as a token file holds them while they rotate.
    server = RegistryServer(RegistryConfig(port=0, events_port=0, http_port=0,
                                           token=f"{NEW}\n{OLD}\n",
                                           admin_token=f"{ADMIN_NEW}\n{ADMIN_OLD}")).start()
    try:
        yield server
    finally:
        server.close()


@pytest.mark.parametrize("token", [OLD, NEW])
def test_old_and_new_fleet_tokens_both_register(registry: RegistryServer, token: str) -> None:
    member = RawMember(registry.control_address, f"decode-{token}", token=token)
    try:
        reply = member.register()
        assert reply.status is ReplyStatus.OK
        assert member.heartbeat().status is ReplyStatus.OK  # the session opened: sealed
    finally:                                                # with the token it proved
        member.close()


def test_a_token_not_in_the_list_is_refused(registry: RegistryServer) -> None:
    member = RawMember(registry.control_address, "decode-x", token="fleet-token-guessed")
    try:
        assert member.register().status is ReplyStatus.REJECTED
    finally:
        member.close()


@pytest.mark.parametrize(("token", "status"), [(ADMIN_OLD, 200), (ADMIN_NEW, 200),
                                               (OLD, 401), ("", 401)])
def test_old_and_new_admin_tokens_both_act(registry: RegistryServer, token: str,
                                           status: int) -> None:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    response = httpx.post(f"{registry.http_url}/v1/members/decode-1/cordon", headers=headers)
    assert response.status_code == status


@pytest.mark.parametrize(("method", "path", "params", "reason"), [
    ("POST", "/v1/members/-bad/drain", None, "id"),
    ("POST", "/v1/members/a%20b/cordon", None, "id"),
    ("DELETE", "/v1/members/ok-1", {"ban": "nan"}, "ban"),
    ("DELETE", "/v1/members/ok-1", {"ban": "-5"}, "ban"),
    ("DELETE", "/v1/members/ok-1", {"ban": "1e30"}, "ban"),
    ("DELETE", "/v1/members/ok-1", {"ban": "soon"}, "ban"),
    ("POST", "/v1/members/ok-1/drain", None, "unknown"),
    ("DELETE", "/v1/members/ok-1", None, "unknown"),
    ("DELETE", "/v1/members/ok-1/cordon", None, "unknown"),
])
def test_bad_admin_requests_are_refused_counted_and_change_nothing(
        registry: RegistryServer, method: str, path: str, params: dict[str, str] | None,
        reason: str) -> None:
    url = registry.http_url
    headers = {"Authorization": f"Bearer {ADMIN_NEW}"}
    response = httpx.request(method, f"{url}{path}", params=params, headers=headers)
    assert response.status_code == (404 if reason == "unknown" else 400), response.text
    assert response.json()["detail"]
    assert registry.store_stats.admin_refused == {reason: 1}
    assert httpx.get(f"{url}/v1/intents", headers=headers).json() == []
    metrics = httpx.get(f"{url}/metrics").text
    assert f'pdreg_admin_requests_refused_total{{reason="{reason}"}} 1.0' in metrics


def test_the_cli_administers_through_the_http_side_alone(registry: RegistryServer,
                                                         tmp_path: Path) -> None:
    """`--registry http(s)://...`: no control port, as from inside a cluster or through
    one port-forward. The token file holds new then old: the CLI sends the first."""
    token_file = tmp_path / "admin-token"
    token_file.write_text(f"{ADMIN_NEW}\n{ADMIN_OLD}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDREG_")}
    result = subprocess.run(
        [sys.executable, "-m", "pdreg", "cordon", "decode-7", "--registry", registry.http_url,
         "--admin-token-file", str(token_file)],
        capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("decode-7: cordoned")
    intents = httpx.get(f"{registry.http_url}/v1/intents",
                        headers={"Authorization": f"Bearer {ADMIN_OLD}"}).json()
    assert [(i["kind"], i["id"]) for i in intents] == [("cordon", "decode-7")]
