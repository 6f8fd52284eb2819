"""`make test-cluster`: the rendered manifests run as processes, and the elastic loop closed.

1. render  every overlay with kubectl's kustomize (k8s/vllm, k8s/sglang, keda). The run
           takes the production overlay (deploy/keda) through an operator's overlay that
           sets its one network parameter, POD_CIDRS, to this run's pod network.
2. start   the pods the rendering asks for, from their own commands, args, env and
           ports (kubelet.py): the three etcd members (Debian's etcd), both registries
           on them (--store etcd://), both routers, Prometheus with the
           rendered scrape config, the planner, and one prefill and one decode pod, each
           the manifest's `pdreg agent` sidecar beside a sim engine in vLLM's place.
3. load    clients send completions through the routers; KEDA is played (keda.py): each
           poll runs the ScaledObjects' own queries in that Prometheus, and the kubelet
           starts or stops engine pods to the count. The desired counts go up and the
           fleet follows: pods started, members ready in both registries.
4. quiet   the load stops: after the planner's scale-down window the counts come down;
           the pods run their preStop hooks, drain and leave.
5. admin   an operator's `pdreg status` and `pdreg drain`, from the operators' namespace;
           a `pdreg cordon` (which only the store carries) held by both registries, and
           still after both are killed -9 and restarted; the replica set in etcd.
6. audit   every connection the run made, checked against the rendered NetworkPolicies
           (netaudit.py): router to engine, engine to registry, planner to router
           metrics, Prometheus to every target, KEDA to Prometheus, the CLI to a registry,
           registry to etcd, etcd to etcd.
7. sglang  the SGLang overlay as rendered (2P2D, no planner): a completion through each
           router, its connections audited the same way.

Only time is changed, and said at the start (TIME_SCALE). Prints progress; exit 0 = the
counts went up and back down with the fleet following, and no connection was refused.
usage: check_cluster.py [--keep WORKDIR]        (needs strace, prometheus, etcd, kubectl)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import yaml  # noqa: E402  (after the paths that find the helpers)
from deploy_support import DEPLOY, K8S, generate_secrets, render, tool  # noqa: E402
from fleet import Fleet, LoadDriver, log  # noqa: E402
from keda import ScaledObject  # noqa: E402
from kubelet import POD_NETWORK  # noqa: E402

# The one change to the manifests besides addresses: time, so that a scale-down is
# seen within minutes. (path in the rendering, the manifest's value, the run's value)
TIME_SCALE = {
    "planner --scale-down-window (s)": ("300", "15"),
    "Prometheus scrape and evaluation interval": ("5s", "1s"),
    "KEDA pollingInterval (s)": ("15", "2"),
}
LOAD_CLIENTS = 48
UP_TIMEOUT_S = 120.0
DOWN_TIMEOUT_S = 150.0
START_TIMEOUT_S = 90.0


def operator_overlay(work: Path, overlay: Path) -> Path:
    """An operator's kustomization over OVERLAY: the pod network set to this run's."""
    root = work / "overlay"
    root.mkdir(parents=True)
    (root / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(overlay, root)],
        "configMapGenerator": [{"name": "pdreg-network", "behavior": "merge",
                                "literals": [f"POD_CIDRS={POD_NETWORK}"]}]}))
    return root


def speed_up(docs: list[dict[str, Any]]) -> None:
    """TIME_SCALE applied to the rendered objects (and nothing else)."""
    for doc in docs:
        if doc["kind"] == "Deployment" and doc["metadata"]["name"] == "pdreg-planner":
            [container] = doc["spec"]["template"]["spec"]["containers"]
            args = container["args"]
            i = args.index("--scale-down-window")
            assert args[i + 1] == TIME_SCALE["planner --scale-down-window (s)"][0]
            args[i + 1] = TIME_SCALE["planner --scale-down-window (s)"][1]
        if doc["kind"] == "ScaledObject":
            assert str(doc["spec"]["pollingInterval"]) == TIME_SCALE[
                "KEDA pollingInterval (s)"][0]
            doc["spec"]["pollingInterval"] = int(TIME_SCALE["KEDA pollingInterval (s)"][1])


def check_renderings() -> None:
    for overlay in (K8S / "vllm", K8S / "sglang", DEPLOY / "keda"):
        docs = render(overlay)
        log(f"render {overlay.relative_to(DEPLOY.parent)}: {len(docs)} objects, "
            f"{sum(d['kind'] in ('Deployment', 'StatefulSet') for d in docs)} workloads")


class Autoscaler:
    """KEDA and the Deployment controller, played: every poll, each ScaledObject's own
    query in the fleet's Prometheus, and the pods started or ended to its count."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.scaled = [ScaledObject.from_manifest(o) for o in fleet.docs
                       if o["kind"] == "ScaledObject"]
        self.poll_s = float(self.scaled[0].polling_interval)
        self.desired: dict[str, list[int]] = {s.target: [] for s in self.scaled}
        self.started = time.monotonic()

    def poll(self, phase: str) -> dict[str, tuple[int, str]]:
        self.fleet.tick_for(self.poll_s)
        out = {}
        for obj in self.scaled:
            live = len(self.fleet.kubelet.live(obj.target))
            count, why = obj.poll(live, self.fleet.prometheus_query)
            self.fleet.scale(obj.target, count)
            self.desired[obj.target].append(count)
            out[obj.target] = (count, why)
            log(f"{time.monotonic() - self.started:5.0f}s {phase:6} {obj.target:13} "
                f"KEDA {why:>6} -> {count} | pods {len(self.fleet.kubelet.live(obj.target))}"
                f", members ready {self.fleet.ready_members(obj.target)}")
        return out

    def followed(self, counts: dict[str, tuple[int, str]]) -> bool:
        """Every Deployment has the pods asked for, each a ready member of both
        registries, and none still on its way out."""
        fleet = self.fleet
        return all(len(fleet.kubelet.live(t)) == n and fleet.ready_members(t) == n
                   and not fleet.terminating(t) for t, (n, _) in counts.items())


def scale_up(auto: Autoscaler, driver: LoadDriver) -> dict[str, int]:
    """Load until every ScaledObject's count went up and the fleet followed."""
    driver.start(LOAD_CLIENTS)
    deadline = time.monotonic() + UP_TIMEOUT_S
    followed_polls = 0
    while True:
        counts = auto.poll("load")
        log(f"       clients: {driver.summary()}")
        followed_polls = followed_polls + 1 if auto.followed(counts) else 0
        if all(max(d) >= 2 for d in auto.desired.values()) and followed_polls >= 2:
            return {t: n for t, (n, _) in counts.items()}
        if time.monotonic() > deadline:
            raise SystemExit(f"test-cluster: no scale-up the fleet followed within "
                             f"{UP_TIMEOUT_S:.0f} s: {counts}")


def prometheus_outage(auto: Autoscaler) -> None:
    """Prometheus goes away under load: KEDA's queries fail, and past failureThreshold
    it keeps the replicas there are (fallback: currentReplicas), not a fixed count. Its
    replacement comes back with the history on its claim."""
    fleet = auto.fleet
    before = {t: len(fleet.kubelet.live(t)) for t in auto.desired}
    prometheus = fleet.prometheus_pod()
    assert prometheus is not None
    mark = time.time()
    log(f"outage: stopping {prometheus.name}; KEDA keeps {before}")
    fleet.kubelet.terminate(prometheus, time.monotonic())
    while True:
        counts = auto.poll("outage")
        held = {t: n for t, (n, _) in counts.items()}
        if held != before:
            raise SystemExit(f"test-cluster: Prometheus away, KEDA moved {before} to {held}")
        if all(why.startswith("fallback") for _, why in counts.values()):
            break
    fleet.tick_for(1.0)
    fleet.scale("pdreg-prometheus", 1)
    replacement = fleet.prometheus_pod()
    assert replacement is not None
    fleet.wait_ready([replacement], START_TIMEOUT_S)
    fleet.wait_targets_up(START_TIMEOUT_S)
    server = auto.scaled[0].server
    remembered = fleet.prometheus_query(server, "max(pdreg_planner_desired_replicas)", mark)
    if remembered is None:
        raise SystemExit("test-cluster: the new Prometheus holds nothing from before the "
                         "outage: its data is not on the claim")
    log(f"outage over: {replacement.name} serves the planner's gauge from before it "
        f"started ({remembered:g}): its TSDB is on the claim")


def scale_down(auto: Autoscaler, driver: LoadDriver) -> None:
    """No load: every count back to its minimum, the pods drained and gone."""
    driver.stop()
    log(f"load stopped: {driver.summary()}")
    deadline = time.monotonic() + DOWN_TIMEOUT_S
    while True:
        counts = auto.poll("quiet")
        if all(counts[o.target][0] == o.min_replicas for o in auto.scaled) \
                and auto.followed(counts):
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"test-cluster: the counts did not come back down within "
                             f"{DOWN_TIMEOUT_S:.0f} s: {counts}")


def production(work: Path, credentials: Path, secrets: dict[str, dict[str, bytes]]) -> Fleet:
    docs = render(operator_overlay(work / "keda-overlay", DEPLOY / "keda"))
    speed_up(docs)
    return Fleet(docs, work / "keda", credentials, secrets,
                 scrape_interval_s=float(TIME_SCALE[
                     "Prometheus scrape and evaluation interval"][1].rstrip("s")))


def run_production(fleet: Fleet) -> None:
    times: dict[str, float] = {}
    with timed("start", times):
        fleet.start_all(START_TIMEOUT_S)
        log(f"Prometheus scrapes {fleet.wait_targets_up(START_TIMEOUT_S)} pods, all up")
    driver = LoadDriver(fleet)
    auto = Autoscaler(fleet)
    with timed("scale up under load", times):
        peak = scale_up(auto, driver)
    with timed("Prometheus outage", times):
        prometheus_outage(auto)
    with timed("scale down", times):
        scale_down(auto, driver)
    if driver.failed:
        raise SystemExit(f"test-cluster: {driver.failed} requests failed: {driver.errors[:5]}")
    log(f"desired counts went up to {peak} under load and back to the minimum after; "
        f"{driver.summary()}")
    with timed("admin", times):
        fleet.admin_status_and_drain()
        fleet.cordon_survives_the_registries(START_TIMEOUT_S)


@contextlib.contextmanager
def timed(part: str, times: dict[str, float]) -> Iterator[None]:
    begin = time.monotonic()
    log(f"{part} ...")
    yield
    times[part] = time.monotonic() - begin
    log(f"{part}: {times[part]:.0f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keep", default=None, help="keep logs and traces in this directory")
    args = parser.parse_args()
    for needed, package in (("strace", "strace"), ("prometheus", "prometheus"),
                            ("etcd", "etcd-server")):
        if shutil.which(needed) is None:
            raise SystemExit(f"test-cluster: {needed} is not installed (apt-get install "
                             f"{package})")
    tool("kubectl")
    began = time.monotonic()
    log("time scaled (manifest -> run): " + "; ".join(
        f"{k} {a} -> {b}" for k, (a, b) in TIME_SCALE.items()))
    work = Path(args.keep or tempfile.mkdtemp(prefix="pdreg-cluster-"))
    work.mkdir(parents=True, exist_ok=True)
    fleets: list[Fleet] = []
    try:
        check_renderings()
        credentials, secrets = generate_secrets(work / "credentials")
        fleets.append(production(work, credentials, secrets))
        run_production(fleets[-1])
        fleets[-1].audit_or_fail("keda (vLLM)")
        fleets[-1].stop_all()
        fleets.append(sglang(work, credentials, secrets))
        run_sglang(fleets[-1])
        fleets[-1].audit_or_fail("k8s/sglang")
    finally:
        for fleet in fleets:
            fleet.stop_all()
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    log(f"passed in {time.monotonic() - began:.0f} s")
    return 0


def sglang(work: Path, credentials: Path, secrets: dict[str, dict[str, bytes]]) -> Fleet:
    docs = render(operator_overlay(work / "sglang-overlay", K8S / "sglang"))
    return Fleet(docs, work / "sglang", credentials, secrets, scrape_interval_s=1.0)


def run_sglang(fleet: Fleet) -> None:
    fleet.start_all(START_TIMEOUT_S)
    for router in fleet.kubelet.live("pdreg-router"):
        text = fleet.complete(router)
        log(f"sglang: completion through {router.name}: {text!r}")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    sys.exit(130)
