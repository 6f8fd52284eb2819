"""Real-engine check: real SGLang P/D (two prefills on one host with their own bootstrap
ports, one decode, KV over Mooncake TCP), each under `pdreg agent --engine sglang`,
against a real registry, behind `pdreg router`. Run by `make test-sglang` after setup.sh.

    .venv/bin/python tests/sglang/check_sglang.py [--sglang-venv .venv-sglang]
        [--model-dir .cache/sglang-tiny-model]

Asserts, in order:
1. the sidecars register what they read from the real servers: model and bootstrap port
   from /server_info (no flag gives them);
2. completions and chat, streamed and not, through the router give exactly the token
   ids and text of one plain SGLang server; the router named each prefill in turn, and
   the prefill it named is the one that computed the prompt (its prompt-token counter
   grew by that prompt, the other's did not), whose KV the decode then took: a decode
   told another prefill's bootstrap port waits forever, so the answer proves the pull;
3. kill -9 of one prefill's SGLang processes while requests run and one of them waits
   there: every request still answers in full, identical to the plain server (the router
   retried on the other);
4. that prefill starts again on the same ports and rejoins; meanwhile the load the
   sidecars read from the `sglang:*` gauges moves in the registry and drops back to 0;
5. SIGTERM to the other prefill's sidecar while requests run and one waits there: it
   drains (DRAINING, no request retried or lost), leaves, and its SGLang processes exit;
Wherever a step needs a request caught inside a prefill, that prefill's scheduler is
held (SIGSTOP) until one arrives: a tiny model's prefill is over in milliseconds, so
catching one mid-flight by looking would be luck.
6. kill -9 of a sidecar: its SGLang server, scheduler and detokenizer exit with it.
The prefills publish KV events (--kv-events-config), and a second router, `--policy kv`,
checks KV-aware pairing after step 2 (kv_checks.py: the router's index holds the blocks
SGLang stored, a request sharing a long prefix goes to their holder, SGLang's own
cached-token counter shows the hit, output = plain server), and after step 4 that it
follows the restarted prefill.
Every process carries a marker and is killed at the end, pass or fail. On failure it
names the step, prints the tail of every log and keeps the logs.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import harness  # tests/sglang/, beside this script
import kv_checks
import sglang_cases as cases
from harness import Engine, Proc, Steps, say, wait_logged

from pdreg.testing import free_low_port, wait_until
from registry.server import RegistryConfig, RegistryServer
from wire.protocol import MemberRecord

STARTUP_TIMEOUT_S = 300.0  # four SGLang servers start at once on two cores: ~70 s
STEP_TIMEOUT_S = 60.0
LOAD_REQUESTS = 24
LOAD_THREADS = 4
HEARTBEAT_INTERVAL_S = 0.5
LEASE_S = 5.0
LOG_TAIL_LINES = 40
FAILURE_SUMMARY_CHARS = 600  # of the error, repeated on the last line


class Cluster:
    def __init__(self, workdir: Path, sglang_python: Path, model_dir: Path,
                 registry: RegistryServer) -> None:
        self.workdir, self.sglang_python, self.model_dir = workdir, sglang_python, model_dir
        self.registry = registry
        taken: set[int] = set()

        def port() -> int:  # distinct: none is bound until its server starts
            chosen = free_low_port(avoid=taken)
            taken.add(chosen)
            return chosen

        self.kv_ports = {name: (port(), port()) for name in ("prefill-1", "prefill-2")}
        self.p1 = Engine("prefill-1", workdir / "prefill-1.log", role="prefill",
                         port=port(), bootstrap_port=port(), omp_bind="0",
                         extra=kv_checks.kv_flags(*self.kv_ports["prefill-1"]))
        self.p2 = Engine("prefill-2", workdir / "prefill-2.log", role="prefill",
                         port=port(), bootstrap_port=port(), omp_bind="1",
                         extra=kv_checks.kv_flags(*self.kv_ports["prefill-2"]))
        self.decode = Engine("decode", workdir / "decode.log", role="decode",
                             port=port(), omp_bind="1")
        self.plain = Engine("plain", workdir / "plain.log", role="plain",
                            port=port(), omp_bind="0")
        self.router = Proc("router", workdir / "router.log")
        self.router_port = port()
        self.kv_router = Proc("kv-router", workdir / "kv-router.log")
        self.kv_router_port = port()

    @property
    def engines(self) -> tuple[Engine, ...]:
        return (self.p1, self.p2, self.decode)

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    @property
    def kv_router_url(self) -> str:
        return f"http://127.0.0.1:{self.kv_router_port}"

    def launch(self, engine: Engine) -> None:
        engine.launch(self.sglang_python, self.model_dir, self.registry.control_address)

    def member(self, engine: Engine) -> MemberRecord | None:
        return self.registry.members().get(engine.member_id)

    def state(self, engine: Engine) -> str:
        record = self.member(engine)
        return record.state.name.lower() if record else "absent"

    def ready(self, *engines: Engine) -> bool:
        for engine in engines:
            engine.assert_alive()
        return all(self.state(e) == "ready" for e in engines)

    def states(self) -> str:
        return ", ".join(f"{e.name}={self.state(e)}" for e in self.engines)

    def stop_all(self) -> None:
        self.router.stop(20)
        self.kv_router.stop(20)
        for proc in (self.plain, self.decode, self.p1, self.p2):
            proc.stop()


def check_registration(c: Cluster) -> None:
    for engine in c.engines:
        record = c.member(engine)
        assert record is not None, engine.name
        spec = record.spec
        say(f"{engine.name}: model={spec.model} protocol={spec.protocol} "
            f"http={spec.endpoints.http} bootstrap={spec.endpoints.kv_host}:"
            f"{spec.endpoints.bootstrap_port} tp={spec.parallel.tp_size} labels={spec.labels} "
            f"max_model_len={spec.max_model_len}")
        assert spec.role.name.lower() == engine.role, spec
        assert spec.model == harness.MODEL_NAME, f"model {spec.model!r} (served_model_name)"
        assert spec.protocol == "sglang", spec
        assert spec.endpoints.http == engine.url, spec
        assert spec.labels == {"test": "sglang"}, spec
        # Its context length, from /v1/models (the router refuses what surely exceeds it).
        assert spec.max_model_len > 0, f"{engine.name}: no max_model_len registered"
        if engine.role == "prefill":
            assert spec.endpoints.bootstrap_port == engine.bootstrap_port, (
                f"{engine.name} registered bootstrap port {spec.endpoints.bootstrap_port}, "
                f"its server runs it on {engine.bootstrap_port} (read from /server_info)")
            assert spec.endpoints.kv_host == "127.0.0.1", spec
            kv_checks.check_registration(engine, spec.kv_events, c.kv_ports[engine.name],
                                         c.model_dir)
        else:
            assert spec.endpoints.bootstrap_port == 0, spec
            assert spec.kv_events is None, spec


def check_load(c: Cluster, prefill: Engine, reference: dict[int, list[int]]) -> None:
    """Load in the registry moves with real requests, and all of it drops back to zero.

    A tiny-model prefill ends between two heartbeats, so `prefill`'s scheduler is held
    (SIGSTOP) while the requests arrive: they provably sit there when the sidecar reads
    its gauges (the open POSTs, live). Released, the decode runs them (running, KV in use)."""
    seen: dict[str, int] = {}

    def observe() -> dict[str, int]:
        for engine in c.engines:
            record = c.member(engine)
            if record is not None:
                load = record.load.running + record.load.waiting
                seen[engine.name] = max(seen.get(engine.name, 0), load)
                if engine is c.decode and record.load.kv_usage > 0:
                    seen["decode-kv"] = 1
        return seen

    with prefill.holding():
        run = cases.LoadRun(c.router_url, 8, 8, reference).start()
        wait_logged(f"{prefill.name} (scheduler held) reports the requests it holds",
                    lambda: observe().get(prefill.name, 0) > 0, STEP_TIMEOUT_S, lambda: str(seen))
    wait_logged("the decode reports load and KV usage > 0 (sglang:* gauges)",
                lambda: observe().get("decode", 0) > 0 and seen.get("decode-kv", 0) > 0,
                STEP_TIMEOUT_S, lambda: str(seen))
    run.join(STEP_TIMEOUT_S)
    assert not run.failures(), run.failures()
    wait_logged("every member's load back to 0", lambda: all(
        (r := c.member(e)) is None or r.load.running + r.load.waiting == 0
        for e in c.engines), STEP_TIMEOUT_S)


def named_prefill(c: Cluster, case: cases.Case, routed: cases.Output,
                  before: cases.RouterCounts, computed_before: dict[str, float]) -> Engine:
    """The prefill the router named for one request, checked to be the one that computed
    its prompt: its prompt-token counter grew by the prompt, the other's not at all."""
    after = cases.RouterCounts.read(c.router_url)
    assert (after.retries, after.migrations) == (before.retries, before.migrations), (
        f"{case.name} was retried or migrated")
    named = after.picked(before, "prefill")
    assert len(named) == 1, f"{case.name}: router picked prefills {named}"
    [named_id] = named
    prefill = next(p for p in (c.p1, c.p2) if p.member_id == named_id)
    other = c.p2 if prefill is c.p1 else c.p1
    grew: dict[str, float] = {}

    def counted() -> bool:
        grew.update({p.name: cases.prompt_tokens(p.url) - computed_before[p.name]
                     for p in (c.p1, c.p2)})
        return grew[prefill.name] >= routed.prompt_tokens

    wait_until(counted, 10.0, 0.2)
    assert grew == {prefill.name: routed.prompt_tokens, other.name: 0}, (
        f"{case.name}: the router named {prefill.name}; prompt tokens computed since: "
        f"{grew} (expected {routed.prompt_tokens} on {prefill.name} only)")
    return prefill


def check_routing(c: Cluster, reference: dict[str, cases.Output]) -> None:
    router_api = cases.client(c.router_url)
    chosen: dict[str, int] = {}
    for case in cases.CASES:
        before = cases.RouterCounts.read(c.router_url)
        computed_before = {p.name: cases.prompt_tokens(p.url) for p in (c.p1, c.p2)}
        routed = cases.run_case(router_api, harness.MODEL_NAME, case)
        expected = reference[case.name]
        assert routed.token_ids == expected.token_ids, (
            f"{case.name}: routed ids {routed.token_ids} != plain server's "
            f"{expected.token_ids}")
        assert routed.text == expected.text, (case.name, routed.text, expected.text)
        assert routed.prompt_tokens == expected.prompt_tokens, (case.name, routed, expected)
        prefill = named_prefill(c, case, routed, before, computed_before)
        chosen[prefill.name] = chosen.get(prefill.name, 0) + 1
        say(f"ok: {case.name} via {prefill.name} (bootstrap {prefill.bootstrap_port}) = "
            f"plain server: {routed.prompt_tokens} prompt tokens computed there, "
            f"ids {routed.token_ids[:6]}...")
    assert set(chosen) == {"prefill-1", "prefill-2"}, f"prefills chosen: {chosen}"
    say(f"ok: both prefills took traffic {chosen}; each decode pull came from the "
        "prefill the router named")


def run_load_with(c: Cluster, reference: dict[int, list[int]], what: str,
                  action: Callable[[], None]) -> None:
    """LOAD_REQUESTS requests from LOAD_THREADS clients; `action()` once 4 have finished;
    every request must answer in full with the plain server's ids."""
    run = cases.LoadRun(c.router_url, LOAD_REQUESTS, LOAD_THREADS, reference).start()
    wait_logged("4 requests done", lambda: run.done() >= 4, STEP_TIMEOUT_S)
    action()
    wait_logged(f"all {LOAD_REQUESTS} requests answered", lambda: run.done() >= LOAD_REQUESTS,
                2 * STEP_TIMEOUT_S, lambda: f"{run.done()} done")
    run.join(STEP_TIMEOUT_S)
    assert not run.failures(), f"{what}: clients saw failures: {run.failures()}"
    say(f"ok: {what}: all {LOAD_REQUESTS} requests answered in full, = plain server")


def kill_prefill_under_load(c: Cluster,
                            reference: dict[int, list[int]]) -> tuple[Engine, Engine]:
    """kill -9 of the prefill holding a request; returns (victim, survivor).

    Both prefills' schedulers are held (SIGSTOP) until a request reaches one of them: that
    request is then provably in flight there, prompt not computed and KV not sent, when
    its process group is killed, so the router must retry it. (A tiny-model prefill ends
    within milliseconds: caught running, it has often handed its KV over already.) The
    survivor is let go; what it held goes on as usual."""
    prefills = (c.p1, c.p2)
    servers = {p.name: p.server_pid() for p in prefills}
    assert all(servers.values()), f"SGLang server processes: {servers}"
    names = {p.name: harness.process_names(p.tree()) for p in prefills}
    before = cases.RouterCounts.read(c.router_url)
    chosen: list[Engine] = []

    def kill() -> None:
        with c.p1.holding(), c.p2.holding():
            holders: list[Engine] = []

            def held() -> bool:
                holders[:] = [p for p in prefills if cases.open_posts(p.url) > 0]
                return bool(holders)

            wait_logged("a request waits at a prefill (schedulers held)", held, STEP_TIMEOUT_S)
            victim = holders[-1]
            server = servers[victim.name]
            assert server is not None
            os.killpg(server, signal.SIGKILL)
            chosen.append(victim)
        say(f"kill -9 of {victim.name}'s SGLang process group {server} {names[victim.name]} "
            "while a request waited at its held scheduler")

    run_load_with(c, reference, "kill -9 of the prefill holding a request", kill)
    [victim] = chosen
    survivor = c.p1 if victim is c.p2 else c.p2
    after = cases.RouterCounts.read(c.router_url)
    redone = after.retries + after.migrations - before.retries - before.migrations
    assert redone > 0, (
        "no request was retried or migrated: the kill hit nothing in flight, so it proved "
        "nothing")
    assert victim.process is not None
    code = victim.process.wait(STEP_TIMEOUT_S)
    assert code == 128 + signal.SIGKILL, f"{victim.name} sidecar exit code {code}"
    assert c.member(victim) is None, "the crashed prefill is still a member"
    wait_logged(f"{victim.name}'s processes gone", lambda: not victim.tree(), STEP_TIMEOUT_S)
    say(f"ok: {redone:.0f} request(s) retried or migrated to {survivor.name}; "
        f"{victim.name}'s sidecar said bye (crashed) and exited {code}")
    return victim, survivor


def drain_prefill_under_load(c: Cluster, victim: Engine, other: Engine,
                             reference: dict[int, list[int]]) -> None:
    before = cases.RouterCounts.read(c.router_url)

    def sigterm() -> None:
        # Held, as in the kill: the request is provably still there when the drain starts.
        with victim.holding():
            wait_logged(f"{victim.name} holds a request (scheduler held)",
                        lambda: cases.open_posts(victim.url) > 0, STEP_TIMEOUT_S)
            assert victim.process is not None
            victim.process.send_signal(signal.SIGTERM)
            say(f"SIGTERM to {victim.name}'s sidecar")
            wait_logged(f"{victim.name} DRAINING", lambda: c.state(victim) in ("draining",
                                                                               "absent"),
                        STEP_TIMEOUT_S)

    run_load_with(c, reference, f"SIGTERM drain of {victim.name}", sigterm)
    after = cases.RouterCounts.read(c.router_url)
    assert (after.retries, after.migrations) == (before.retries, before.migrations), (
        "a request was retried or migrated during the drain")
    wait_logged(f"{victim.name} gone from the registry", lambda: c.member(victim) is None,
                STEP_TIMEOUT_S)
    assert victim.process is not None
    code = victim.process.wait(STEP_TIMEOUT_S)
    assert code == 0, f"{victim.name} sidecar exit code {code}"
    wait_logged(f"{victim.name}'s SGLang processes exited", lambda: not victim.tree(),
                STEP_TIMEOUT_S)
    assert c.ready(other, c.decode), c.states()


def kill_sidecar(c: Cluster, engine: Engine) -> None:
    tree = engine.tree()
    names = harness.process_names(tree)
    assert any(name.startswith("sglang::") for name in names), names  # scheduler etc.
    assert engine.process is not None
    engine.process.kill()
    engine.process.wait()
    say(f"kill -9 of {engine.name}'s sidecar; its processes were {names}")
    wait_logged(f"{engine.name}'s SGLang server, scheduler and detokenizer exited",
                lambda: not engine.tree(), STEP_TIMEOUT_S,
                lambda: str(harness.process_names(engine.tree())))
    wait_logged(f"{engine.name} expired from the registry", lambda: c.member(engine) is None,
                STEP_TIMEOUT_S)


def check(steps: Steps, c: Cluster) -> None:
    steps.begin("start a plain SGLang, two prefills and a decode (under pdreg agent), "
                "and pdreg router")
    for engine in (c.plain, c.p1, c.p2, c.decode):
        c.launch(engine)
    harness.start_router(c.router, c.registry.control_address, c.router_port)
    harness.start_router(c.kv_router, c.registry.control_address, c.kv_router_port,
                         policy="kv", register=False)
    wait_logged("plain server healthy and P1, P2, D READY", lambda: c.plain.healthy()
                and c.ready(*c.engines), STARTUP_TIMEOUT_S, c.states)

    steps.begin("registration: model, bootstrap ports and KV block size read from "
                "/server_info, KV events endpoints from --kv-events-config")
    check_registration(c)

    steps.begin("reference outputs from the plain server")
    plain_api = cases.client(c.plain.url)
    reference = {case.name: cases.run_case(plain_api, harness.MODEL_NAME, case)
                 for case in cases.CASES}
    for name, out in reference.items():
        assert len(out.token_ids) == cases.MAX_TOKENS, (name, out)
    load_reference = cases.load_references(c.plain.url)
    kv_reference = kv_checks.references(c.plain.url)
    c.plain.stop()
    say("ok: references taken; plain server stopped")

    steps.begin("router serves the model")
    wait_logged("router lists the model", lambda: harness.MODEL_NAME in [
        m.id for m in cases.client(c.router_url).models.list().data], STEP_TIMEOUT_S)

    steps.begin("routed completions and chat = plain server; each prefill named in turn")
    check_routing(c, reference)

    steps.begin("KV-aware pairing (pdreg router --policy kv): the index holds what SGLang "
                "stored, a shared long prefix goes to its holder, SGLang counts the hit")
    kv_checks.check_kv((c.p1, c.p2), c.kv_router, c.kv_router_url, c.kv_ports, c.model_dir,
                       kv_reference, STEP_TIMEOUT_S)
    incarnations = {p.name: kv_checks.kv_status(c.kv_router_url)[p.member_id]["incarnation"]
                    for p in (c.p1, c.p2)}

    steps.begin("kill -9 of a prefill under load: retried on the other, no client failure")
    victim, survivor = kill_prefill_under_load(c, load_reference)

    steps.begin("the killed prefill starts again on the same ports; meanwhile: load from "
                "the sglang:* gauges reaches the registry")
    c.launch(victim)
    check_load(c, survivor, load_reference)
    wait_logged(f"{victim.name} READY again", lambda: c.ready(victim), STARTUP_TIMEOUT_S,
                c.states)
    kv_checks.relearned(c.kv_router_url, victim, incarnations[victim.name], STEP_TIMEOUT_S)

    steps.begin("SIGTERM drain of a prefill under load: no request lost")
    drain_prefill_under_load(c, survivor, victim, load_reference)

    steps.begin("kill -9 of a sidecar: its SGLang processes do not outlive it")
    kill_sidecar(c, victim)


class DropLoopLag(logging.Filter):
    """The in-process registry shares two cores with four SGLang servers: its loop runs
    late all the time and warns on every tick. Expected here; it drowns the progress."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("[registry] loop lag")


def print_log_tails(workdir: Path) -> None:
    for log in sorted(workdir.glob("*.log")):
        print(f"----- last {LOG_TAIL_LINES} lines of {log} -----", flush=True)
        lines = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        print("\n".join(lines), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sglang-venv", type=Path, default=harness.REPO / ".venv-sglang")
    parser.add_argument("--model-dir", type=Path,
                        default=harness.REPO / ".cache" / "sglang-tiny-model")
    args = parser.parse_args()
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(DropLoopLag())
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    sglang_python = args.sglang_venv.resolve() / "bin" / "python"
    if not sglang_python.exists():
        say(f"no SGLang at {args.sglang_venv}; run tests/sglang/setup.sh first")
        return 2
    registry = RegistryServer(RegistryConfig(
        host="127.0.0.1", port=0, events_port=0, http_port=-1,
        heartbeat_interval_s=HEARTBEAT_INTERVAL_S, lease_s=LEASE_S)).start()
    workdir = Path(tempfile.mkdtemp(prefix="pdreg-sglang-"))  # kept: the first thing asked
    steps = Steps()
    cluster = Cluster(workdir, sglang_python, args.model_dir.resolve(), registry)
    say(f"registry at {registry.control_address}; logs in {workdir}")
    try:
        check(steps, cluster)
    except Exception as exc:  # any failure: name the step, show the logs, keep them
        say(f"FAILED at step '{steps.current}': {type(exc).__name__}: {exc}")
        cluster.stop_all()
        print_log_tails(workdir)
        # Again after the logs' tails: a reader of only the last lines sees why.
        say(f"FAILED at step '{steps.current}' after {time.monotonic() - steps.started:.0f}s"
            f" ({type(exc).__name__}: {str(exc)[:FAILURE_SUMMARY_CHARS]}); full logs kept in"
            f" {workdir}")
        return 1
    finally:
        cluster.stop_all()
        registry.close()
    say(f"PASSED in {time.monotonic() - steps.started:.0f}s; logs in {workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
