"""What one `/metrics` scrape of the registry costs as the fleet grows.

    .venv/bin/python bench/bench_metrics_scrape.py [--members 10000,100000] [--baseline REV]

Renders the registry's collector (`registry.metrics`) over a published snapshot of N
members, as the HTTP thread does for a scrape, while a second thread stands in for the
registry loop: it wakes every 0.1 ms (releasing the GIL, as the loop does in every
libzmq call) and records how late each wake is. Reported per N: scrape bytes and series,
render time, and the loop thread's longest and p99 wait while the scrape ran. With
--baseline, the same for `registry/metrics.py` of that commit, side by side.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from types import ModuleType

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_scale import member_spec  # noqa: E402
from prometheus_client import generate_latest  # noqa: E402

from registry.metrics import LoopStats  # noqa: E402
from registry.protocol import Load, MemberRecord, MemberState  # noqa: E402
from registry.published import Published  # noqa: E402

MODELS = 8


def published(members: int, now: float) -> Published:
    records = tuple(
        MemberRecord(spec=member_spec(f"decode-{i}", f"m{i % MODELS}", i),
                     state=MemberState.READY, load=Load(running=i % 7),
                     registered_at=now - 60, heartbeat_at=now - (i % 50) / 10)
        for i in range(members))
    return Published(epoch=1, version=members, members=records, heartbeat_interval_s=5.0,
                     lease_s=15.0, self_preserving=False, taken_at=now)


def load_metrics(rev: str) -> ModuleType:
    if not rev:
        import registry.metrics as module
        return module
    source = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:registry/metrics.py"],
                            check=True, capture_output=True, text=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "metrics_rev.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location("metrics_rev", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["metrics_rev"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def scrape(module: ModuleType, snapshot: Published) -> dict[str, float]:
    registry = module.make_metrics_registry(LoopStats(), lambda: snapshot)
    waits: list[float] = []
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            time.sleep(0.0001)
            waits.append(time.perf_counter() - t)

    thread = threading.Thread(target=loop)
    thread.start()
    time.sleep(0.05)
    waits.clear()
    t0 = time.perf_counter()
    text = generate_latest(registry)
    took = time.perf_counter() - t0
    stop.set()
    thread.join()
    waits.sort()
    series = sum(1 for line in text.splitlines() if line and not line.startswith(b"#"))
    return {"members": len(snapshot.members), "bytes": len(text), "series": series,
            "render_ms": round(1e3 * took, 1),
            "loop_wait_max_ms": round(1e3 * waits[-1], 1) if waits else 0.0,
            "loop_wait_p99_ms": round(1e3 * waits[int(0.99 * (len(waits) - 1))], 2)
            if waits else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", default="10000,100000")
    parser.add_argument("--baseline", default="", help="a commit to run beside this tree")
    args = parser.parse_args()
    trees = [("this", load_metrics(""))]
    if args.baseline:
        trees.insert(0, (args.baseline, load_metrics(args.baseline)))
    for members in [int(n) for n in args.members.split(",")]:
        snapshot = published(members, time.time())
        for name, module in trees:
            print(json.dumps({"tree": name, **scrape(module, snapshot)}), flush=True)


if __name__ == "__main__":
    main()
