"""Credentials as operators give them: flags, files and environment variables, for every
command; CURVE keys from `pdreg keys generate`; refusals to run exposed and open; the
registry's health when its loop is stuck.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from raw_member import RawMember
from reference_helpers import start_engine

from pdreg import cli
from pdreg.args import (
    TOKEN,
    add_client_curve_arguments,
    add_secret_argument,
    client_curve_of,
    insecure_refusal,
    is_loopback,
    secret_of,
)
from pdreg.testing import die_with_parent, free_low_port, stop_process, wait_until
from registry import server as server_module
from registry.security import ClientCurve, ServerCurve, generate_keys
from registry.server import RegistryConfig, RegistryServer
from router.guard import LOOPBACK_ALLOW
from wire.protocol import ReplyStatus, Role

WAIT_S = 30.0  # subprocesses start slowly on a busy two-core machine


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_secret_argument(parser, TOKEN)
    add_client_curve_arguments(parser)
    return parser.parse_args(argv)


# --- pdreg/args.py --------------------------------------------------------------------


def test_a_secret_comes_from_the_flag_then_the_file_then_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret_file = tmp_path / "token"
    secret_file.write_text("from-file\n")
    monkeypatch.setenv("PDREG_TOKEN", "from-env")
    assert secret_of(parse(["--token", "from-flag", "--token-file", str(secret_file)]),
                     TOKEN) == "from-flag"
    assert secret_of(parse(["--token-file", str(secret_file)]), TOKEN) == "from-file"
    assert secret_of(parse([]), TOKEN) == "from-env"
    monkeypatch.delenv("PDREG_TOKEN")
    assert secret_of(parse([]), TOKEN) == ""


@pytest.mark.parametrize(("content", "problem"), [(None, "No such file"), ("\n", "empty")])
def test_an_unusable_secret_file_is_an_error_naming_the_flag(tmp_path, content, problem):
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit, match=rf"--token-file .*{problem}"):
        secret_of(parse(["--token-file", str(path)]), TOKEN)


def test_curve_keys_come_in_pairs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    generate_keys(tmp_path, "registry")
    generate_keys(tmp_path, "client")
    with pytest.raises(SystemExit, match="--curve-key"):
        client_curve_of(parse(["--registry-public-key", str(tmp_path / "registry.key")]))
    with pytest.raises(SystemExit, match="no secret key"):
        client_curve_of(parse(["--registry-public-key", str(tmp_path / "registry.key"),
                               "--curve-key", str(tmp_path / "client.key")]))
    monkeypatch.setenv("PDREG_REGISTRY_PUBLIC_KEY", str(tmp_path / "registry.key"))
    monkeypatch.setenv("PDREG_CURVE_KEY", str(tmp_path / "client.key_secret"))
    curve = client_curve_of(parse([]))
    assert curve == ClientCurve.from_files(tmp_path / "registry.key",
                                           tmp_path / "client.key_secret")


def test_keys_generate_writes_private_pairs_and_never_overwrites(tmp_path: Path, capsys):
    keys = tmp_path / "keys"
    assert cli.main(["keys", "generate", str(keys)]) == 0
    for name in ("registry", "client"):
        assert stat.S_IMODE((keys / f"{name}.key_secret").stat().st_mode) == 0o600
        assert "secret-key" not in (keys / f"{name}.key").read_text()
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    ServerCurve.from_files(keys / "registry.key_secret", None)
    assert cli.main(["keys", "generate", str(keys), "--name", "client"]) == 1
    assert "--force" in capsys.readouterr().err
    before = (keys / "client.key").read_text()
    assert cli.main(["keys", "generate", str(keys), "--name", "client", "--force"]) == 0
    assert (keys / "client.key").read_text() != before


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("0.0.0.0", False), ("10.0.0.5", False), ("::", False),
])
def test_loopback_detection(host, loopback):
    assert is_loopback(host) is loopback


def test_exposed_and_open_is_refused_in_one_line():
    refusal = insecure_refusal("registry", "0.0.0.0", secured=False, insecure=False)
    assert refusal is not None and "\n" not in refusal and "--insecure" in refusal
    assert insecure_refusal("registry", "0.0.0.0", secured=True, insecure=False) is None
    assert insecure_refusal("registry", "0.0.0.0", secured=False, insecure=True) is None
    assert insecure_refusal("router", "127.0.0.1", secured=False, insecure=False) is None


@pytest.mark.parametrize("command", [
    ["registry", "--port", "0", "--events-port", "0", "--http-port", "-1"],
    ["router", "--port", "0", "--no-register", "--registry", "127.0.0.1:1"],
])
def test_commands_refuse_to_listen_exposed_without_credentials(command):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDREG_")}
    out = subprocess.run([sys.executable, "-m", "pdreg", *command, "--host", "0.0.0.0"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "refusing to listen on 0.0.0.0" in lines[0]
    assert "--insecure" in lines[0]


@pytest.mark.parametrize(("extra", "named"), [
    (["--token", "t"], "--admin-token"),  # HTTP open to the network without an admin token
    (["--curve-secret-key", "{keys}/registry.key_secret", "--admin-token", "a"],
     "--allowed-clients"),  # CURVE that lets in any key pair made up on the spot
], ids=["admin", "curve-any-key"])
def test_registry_refuses_half_secured_exposure(extra, named, keys: Path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDREG_")}
    argv = [a.format(keys=keys) for a in extra]
    base = [sys.executable, "-m", "pdreg", "registry", "--port", "0", "--events-port", "0",
            "--host", "0.0.0.0", *argv]
    out = subprocess.run(base, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[0] and "--insecure" in lines[0]


def test_help_says_tokens_on_the_command_line_show_in_ps():
    for command in ("registry", "router", "agent", "drain", "status"):
        text = " ".join(pdreg(command, "--help").stdout.split())
        assert "shows in `ps`" in text, command
        assert "-file" in text and "$PDREG_" in text, command


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")
def test_drain_and_status_over_https_with_a_ca_file(tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    server = RegistryServer(RegistryConfig(port=0, events_port=0, http_port=0,
                                           heartbeat_interval_s=60.0, lease_s=180.0,
                                           admin_token="adm", tls_cert=str(cert),
                                           tls_key=str(key))).start()
    member = RawMember(server.control_address, member_id="decode-127.0.0.1-9200",
                       role=Role.DECODE)
    try:
        assert server.http_url.startswith("https://")
        assert member.register().status is ReplyStatus.OK
        address = server.control_address
        plain = pdreg("drain", member.id, "--registry", address, "--admin-token", "adm")
        assert plain.returncode == 1  # plain HTTP to an HTTPS port: nothing sent in clear
        unverified = pdreg("drain", member.id, "--registry", address, "--https",
                           "--admin-token", "adm")
        assert unverified.returncode == 1 and "CERTIFICATE" in unverified.stderr.upper()
        drain = pdreg("drain", member.id, "--registry", address, "--ca-file", str(cert),
                      "--admin-token", "adm")
        assert drain.returncode == 0, drain.stderr
        status = pdreg("status", "--registry", address, "--ca-file", str(cert), "--json")
        assert status.returncode == 0, status.stderr
        assert [m["state"] for m in json.loads(status.stdout)] == ["draining"]
    finally:
        member.close()
        server.close()


# --- every command, credentials from files and the environment only ---------------------


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    for name in ("registry", "client"):
        generate_keys(tmp_path, name)
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "client.key").write_bytes((tmp_path / "client.key").read_bytes())
    (tmp_path / "token").write_text("fleet-token\n")
    (tmp_path / "admin").write_text("admin-token\n")
    return tmp_path


@pytest.fixture
def secure_registry(keys: Path) -> Iterator[tuple[str, str]]:
    """`pdreg registry` with CURVE, a fleet token and an admin token, all from files or
    the environment; yields (control address, http url)."""
    port = free_low_port()
    env = {**os.environ, "PDREG_CURVE_SECRET_KEY": str(keys / "registry.key_secret"),
           "PDREG_ALLOWED_CLIENTS": str(keys / "allowed")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdreg", "registry", "--port", str(port), "--events-port", "0",
         "--http-port", "0", "--heartbeat-interval", "0.3", "--lease", "1.5",
         "--token-file", str(keys / "token"), "--admin-token-file", str(keys / "admin")],
        stdout=subprocess.PIPE, text=True, env=env, preexec_fn=die_with_parent)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "security: CURVE, token, admin token" in line, line
        yield f"127.0.0.1:{port}", line.split("http ")[1].split()[0]
    finally:
        stop_process(proc, 10)


def client_env(keys: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """What a Kubernetes Secret would put in a client's environment."""
    values = {"PDREG_TOKEN": "fleet-token", "PDREG_ADMIN_TOKEN": "admin-token",
              "PDREG_API_KEY": "client-key",
              "PDREG_REGISTRY_PUBLIC_KEY": str(keys / "registry.key"),
              "PDREG_CURVE_KEY": str(keys / "client.key_secret")}
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    return {**os.environ}


def pdreg(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdreg", *argv], capture_output=True,
                          text=True, timeout=60)


def members(http: str) -> dict[str, dict]:
    return {m["id"]: m for m in httpx.get(f"{http}/v1/members").json()}


def test_engine_router_and_clis_take_every_credential_from_the_environment(
        secure_registry: tuple[str, str], keys: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    address, http = secure_registry
    env = client_env(keys, monkeypatch)
    engine = start_engine(role="mixed", backend="sim", registry=address)
    router = subprocess.Popen(
        [sys.executable, "-m", "pdreg", "router", "--registry", address, "--port", "0",
         "--quarantine", "30", "--allow-upstream", LOOPBACK_ALLOW], stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True, env=env, preexec_fn=die_with_parent)
    try:
        assert router.stdout is not None
        info = json.loads(router.stdout.readline())
        assert wait_until(lambda: {engine.id, info["id"]} <= set(members(http)), WAIT_S)
        assert members(http)[info["id"]]["role"] == "api_server"
        body = {"model": "tiny", "prompt": "secure", "max_tokens": 2}
        auth = {"Authorization": "Bearer client-key"}
        assert httpx.post(f"{info['url']}/v1/completions", json=body).status_code == 401
        assert wait_until(lambda: httpx.post(f"{info['url']}/v1/completions", json=body,
                                             headers=auth).status_code == 200, WAIT_S)

        status = pdreg("status", "--registry", address, "--json")
        assert status.returncode == 0, status.stderr
        assert {m["id"] for m in json.loads(status.stdout)} >= {engine.id, info["id"]}
        drain = pdreg("drain", engine.id, "--registry", address)
        assert drain.returncode == 0, drain.stderr
        assert wait_until(lambda: members(http)[engine.id]["state"] == "draining", WAIT_S)

        monkeypatch.delenv("PDREG_ADMIN_TOKEN")
        evict = pdreg("evict", engine.id, "--ban", "600", "--registry", address,
                      "--admin-token-file", str(keys / "admin"))
        assert evict.returncode == 0, evict.stderr
        assert "banned for 600s" in evict.stdout
        assert [b["id"] for b in httpx.get(f"{http}/v1/bans").json()] == [engine.id]
    finally:
        stop_process(router, 20)
        engine.stop(10)


def test_the_router_reports_failures_through_its_own_session(
        secure_registry: tuple[str, str], keys: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    address, http = secure_registry
    env = client_env(keys, monkeypatch)
    engine = start_engine(role="mixed", backend="sim", registry=address)
    router = subprocess.Popen(
        [sys.executable, "-m", "pdreg", "router", "--registry", address, "--port", "0",
         "--allow-upstream", LOOPBACK_ALLOW],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
        preexec_fn=die_with_parent)
    try:
        assert router.stdout is not None
        info = json.loads(router.stdout.readline())
        auth = {"Authorization": "Bearer client-key"}
        body = {"model": "tiny", "prompt": "x", "max_tokens": 1}
        assert wait_until(lambda: httpx.post(f"{info['url']}/v1/completions", json=body,
                                             headers=auth).status_code == 200, WAIT_S)
        engine.proc.kill()
        engine.proc.wait()
        httpx.post(f"{info['url']}/v1/completions", json=body, headers=auth)

        def reported() -> bool:
            text = httpx.get(f"{http}/metrics").text
            # Accepted, or outweighed when it came while the engine's last heartbeat was
            # still fresh (one router alone cannot suspect a member that heartbeats):
            # either way proved with the router's own session.
            return any(f'pdreg_failure_reports_total{{result="{result}"}} 1.0' in text
                       for result in ("accepted", "outweighed"))
        assert wait_until(reported, WAIT_S)
    finally:
        stop_process(router, 20)
        engine.stop(10)


def test_the_sidecar_takes_its_credentials_from_the_environment(
        secure_registry: tuple[str, str], keys: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent given only PDREG_TOKEN (and its keys' paths) in its environment registers,
    over CURVE: every credential is read from a flag, a file or the environment."""
    address, http = secure_registry
    env = client_env(keys, monkeypatch)
    port = free_low_port()
    sidecar = subprocess.Popen(
        [sys.executable, "-m", "pdreg", "agent", "--engine", "vllm", "--engine-url",
         f"http://127.0.0.1:{port}", "--role", "decode", "--registry", address,
         "--health-interval", "0.1", "--", sys.executable, "-m", "engine_agent.standins",
         "--kind", "vllm", "--port", str(port), "--model", "tiny"],
        env=env, preexec_fn=die_with_parent)
    try:
        assert wait_until(lambda: any(m["role"] == "decode" and m["state"] == "ready"
                                      for m in members(http).values()), WAIT_S)
    finally:
        assert stop_process(sidecar, 30) == 0
    assert wait_until(lambda: members(http) == {}, WAIT_S)


def test_status_without_the_keys_says_how_to_reach_a_curve_registry(
        secure_registry: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    address, _ = secure_registry
    for name in ("PDREG_REGISTRY_PUBLIC_KEY", "PDREG_CURVE_KEY"):
        monkeypatch.delenv(name, raising=False)
    out = pdreg("status", "--registry", address)
    assert out.returncode == 1 and "--registry-public-key" in out.stderr


# --- /healthz ---------------------------------------------------------------------------


def test_healthz_fails_while_the_loop_is_stuck(monkeypatch: pytest.MonkeyPatch) -> None:
    """/healthz answers 503 while the registry's loop is held, and 200 again once it
    turns. The loop is held by an action that waits for the test's word, not for a
    time: a busy machine can delay each step, never make the loop look turned or stuck
    at the wrong moment."""
    monkeypatch.setattr(server_module, "HEALTHZ_MIN_STALL_S", 0.3)
    server = RegistryServer(RegistryConfig(port=0, events_port=0, http_port=0,
                                           heartbeat_interval_s=0.05, lease_s=1.0)).start()
    release = threading.Event()
    try:
        url = f"{server.http_url}/healthz"
        assert wait_until(lambda: httpx.get(url).status_code == 200, WAIT_S)
        held = server.submit(lambda m, now: release.wait(2 * WAIT_S))  # type: ignore[arg-type]
        assert wait_until(lambda: httpx.get(url).status_code == 503, WAIT_S)
        answer = httpx.get(url)  # the loop is still held: still 503
        assert answer.status_code == 503
        body = answer.json()
        assert body["status"] == "stalled" and "has not turned" in body["detail"]
        release.set()
        held.result(WAIT_S)
        assert wait_until(lambda: httpx.get(url).status_code == 200, WAIT_S)
    finally:
        release.set()
        server.close()
