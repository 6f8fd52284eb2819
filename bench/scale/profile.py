"""--profile for `bench_scale.py`: the registry under test sampled by py-spy over the
window (raw stacks), and its garbage collections over 1 ms logged by a sitecustomize
shim on its path. Bench-only: nothing here runs in a deployed registry."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence

# Bench-only: the registry under --profile imports this first (a sitecustomize on its
# path) and logs every garbage collection that pauses it over 1 ms.
_GC_LOG_SHIM = """
import gc, os, time
_log = open(os.environ["PDREG_BENCH_GC_LOG"], "a", buffering=1)
_start = [0.0]
def _timed(phase, info):
    if phase == "start":
        _start[0] = time.perf_counter()
    else:
        took = time.perf_counter() - _start[0]
        if took > 0.001:
            _log.write(f"{time.time():.3f} gen{info['generation']} {1e3 * took:.1f}ms "
                       f"collected={info['collected']}\\n")
        if info["generation"] == 2:  # what a full collection walks (bench only)
            from collections import Counter
            kinds = Counter(type(o).__name__ for o in gc.get_objects())
            _log.write(f"  tracked={sum(kinds.values())} {kinds.most_common(6)}\\n")
gc.callbacks.append(_timed)
"""


@contextlib.contextmanager
def profiled(src: str, profile: str, label: str) -> Iterator[str]:
    """`src`, or with `profile` a directory whose sitecustomize logs GC pauses into
    PROFILE/LABEL-gc.log before importing `src`'s packages (by symlink)."""
    if not profile:
        yield src
        return
    os.makedirs(profile, exist_ok=True)
    shim = tempfile.mkdtemp(prefix="pdreg-profiled-")
    for name in os.listdir(src):
        os.symlink(os.path.join(src, name), os.path.join(shim, name))
    with open(os.path.join(shim, "sitecustomize.py"), "w") as f:
        f.write(_GC_LOG_SHIM)
    before = os.environ.get("PDREG_BENCH_GC_LOG")
    os.environ["PDREG_BENCH_GC_LOG"] = os.path.abspath(os.path.join(profile, f"{label}-gc.log"))
    try:
        yield shim
    finally:
        if before is None:
            os.environ.pop("PDREG_BENCH_GC_LOG", None)
        shutil.rmtree(shim, ignore_errors=True)


def py_spy(pid: int, seconds: float, out: str, extra: Sequence[str] = (), rate: int = 200
           ) -> subprocess.Popen | None:
    """`extra`: more py-spy flags (`--threads`: each stack under its thread's id and
    name; `--nonblocking`: never pause the process sampled)."""
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(spy):
        print("py-spy not found (pip install py-spy): no profile", file=sys.stderr)
        return None
    return subprocess.Popen([spy, "record", "--pid", str(pid), "--duration",
                             str(max(1, int(seconds))), "--rate", str(rate), "--format", "raw",
                             *extra, "--output", out], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
