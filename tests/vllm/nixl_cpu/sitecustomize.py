"""Two fixes for several NIXL-enabled vLLM engines sharing a few CPU cores (test-vllm).

Put this folder on the PYTHONPATH of the vLLM processes only (cluster.py does so through
`env PYTHONPATH=... vllm serve`). Each fix is pinned to the code it changes: if that code
is not exactly what was measured, the import fails loudly (printed, since vLLM swallows
NIXL import errors, and the engine then refuses to start) instead of running unfixed.
Each fix prints one marker line per use, which the check looks for in the engine logs.

1. NIXL's progress thread busy-polls. vLLM 0.32.0's NixlConnector builds its agent with
   `nixl_agent(name, nixl_agent_config(...))`, and nixl-cu12 1.5.1's
   `nixl_agent.__init__` (nixl_cu12/_api.py) hard-codes `agent_config.pthrDelay = 0`
   with no way to pass another value: about one core per engine, even idle. The fix
   wraps the binding's `nixlAgent` constructor, as `_api` sees it, to set a 10 ms poll
   delay (`pthrDelay` is in microseconds). Measured: idle CPU per engine 73-89% -> 2%.
2. The NIXL worker re-pins its main thread to the last core. On CPU, vLLM 0.32.0's
   NIXL worker (`.../kv_connector/v1/nixl/base_worker.py`) calls
   `os.sched_setaffinity(0, rsv_cores_for_kv)` with the last core of each NUMA node,
   "to reserve different cores for start_load_kv() from model_forward()". But the
   calling thread is the worker's main thread, which is the one that runs the model: so
   every NIXL engine on a host computes on that one core, whatever
   `VLLM_CPU_OMP_THREADS_BIND` says. Three engines on two cores all ran on core 1 and
   stalled for minutes under load. The fix gives that module an `os` whose
   `sched_setaffinity` leaves the thread where vLLM's OpenMP setup put it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

MARKER = "[pdreg nixl-cpu]"
POLL_MARKER = f"{MARKER} progress thread poll delay"
AFFINITY_MARKER = f"{MARKER} kept the worker thread's cores"

NIXL_DIST, NIXL_VERSION = "nixl-cu12", "1.5.1"
NIXL_API = "nixl_cu12._api"
NIXL_HARD_CODED = "agent_config.pthrDelay = 0"
POLL_DELAY_US = 10_000

VLLM_DIST, VLLM_VERSION = "vllm-cpu", "0.32.0"
NIXL_WORKER = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"
NIXL_WORKER_REPIN = "os.sched_setaffinity(0, rsv_cores_for_kv)"


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _require(what: str, dist: str, version: str, source: str, line: str) -> None:
    found = importlib.metadata.version(dist)
    if found != version or line not in source:
        problem = (f"{MARKER} NOT APPLIED ({what}): expected {dist}=={version} with "
                   f"'{line}', found {found}{'' if line in source else ' without that line'}"
                   f"; update tests/vllm/nixl_cpu/sitecustomize.py for it")
        _say(problem)  # vLLM swallows NIXL's ImportError and its text
        raise ImportError(problem)


class _BindingsWithPollDelay:
    """`nixl_cu12._bindings` as `_api` sees it, but agents get POLL_DELAY_US."""

    def __init__(self, bindings: ModuleType) -> None:
        self._bindings = bindings

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bindings, name)

    def nixlAgent(self, name: str, config: Any) -> Any:  # the binding's own name
        config.pthrDelay = POLL_DELAY_US
        _say(f"{POLL_MARKER} {POLL_DELAY_US} us (agent {name})")
        return self._bindings.nixlAgent(name, config)


class _OsKeepingAffinity:
    """`os` as the NIXL worker module sees it, minus its re-pinning of the thread."""

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    @staticmethod
    def sched_setaffinity(pid: int, cores: Any) -> None:
        _say(f"{AFFINITY_MARKER} {sorted(os.sched_getaffinity(pid))} (NIXL asked for "
             f"{sorted(cores)})")


def _patch_nixl_api(module: ModuleType) -> None:
    _require("poll delay", NIXL_DIST, NIXL_VERSION,
             inspect.getsource(module.nixl_agent.__init__), NIXL_HARD_CODED)
    module.nixlBind = _BindingsWithPollDelay(module.nixlBind)


def _patch_nixl_worker(module: ModuleType) -> None:
    _require("thread affinity", VLLM_DIST, VLLM_VERSION, inspect.getsource(module),
             NIXL_WORKER_REPIN)
    module.os = _OsKeepingAffinity()


def check_pins() -> None:
    """Both pins, without starting vLLM (setup.sh runs this): raises ImportError."""
    import nixl_cu12._api  # noqa: F401  (patched on import: checks its pin)

    worker_file = importlib.metadata.distribution(VLLM_DIST).locate_file(
        NIXL_WORKER.replace(".", "/") + ".py")
    _require("thread affinity", VLLM_DIST, VLLM_VERSION,
             Path(str(worker_file)).read_text(), NIXL_WORKER_REPIN)


PATCHES: dict[str, Callable[[ModuleType], None]] = {
    NIXL_API: _patch_nixl_api,
    NIXL_WORKER: _patch_nixl_worker,
}


class _PatchAfterExec(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, patch: Callable[[ModuleType], None]):
        self._loader = loader
        self._patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        patch = PATCHES.get(name)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _PatchAfterExec(spec.loader, patch)
        return spec


sys.meta_path.insert(0, _Finder())
