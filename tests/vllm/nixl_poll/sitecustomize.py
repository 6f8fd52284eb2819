"""Give NIXL's progress thread a 10 ms poll timeout, in the vLLM processes of test-vllm.

Put this folder on PYTHONPATH of the vLLM processes only (check_vllm_sidecar.py does so
through `env PYTHONPATH=... vllm serve`). Why: vLLM 0.32.0's NixlConnector builds its
agent with `nixl_agent(name, nixl_agent_config(num_threads=..., capture_telemetry=True))`
(vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py), and nixl-cu12 1.5.1's
`nixl_agent.__init__` (nixl_cu12/_api.py) hard-codes `agent_config.pthrDelay = 0` with no
way to pass another value. The progress thread then busy-polls: about one full core per
NIXL-enabled vLLM even when idle. With three of them on two cores, KV pulls stall until
NIXL's lease runs out (see /work/shared/notes/engines-and-peers.md §8).

The fix wraps the binding's `nixlAgent` constructor as `_api` sees it, setting
`pthrDelay` (microseconds) before the agent and its thread are created. It is pinned:
another nixl-cu12 version, or an `_api.py` without that line, fails the import loudly
(printed, and vLLM then finds NIXL unavailable and the engine refuses to start) rather than
silently running without the fix. Each agent patched prints one line to stderr, which
the check looks for in the engine logs.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import inspect
import sys
from types import ModuleType
from typing import Any

PINNED_DIST = "nixl-cu12"
PINNED_VERSION = "1.5.1"
PATCHED_MODULE = "nixl_cu12._api"
HARD_CODED_LINE = "agent_config.pthrDelay = 0"
POLL_DELAY_US = 10_000
APPLIED_MARKER = "[pdreg nixl-poll] progress thread poll delay"


class _BindingsWithPollDelay:
    """`nixl_cu12._bindings` as `_api` sees it, but agents get POLL_DELAY_US."""

    def __init__(self, bindings: ModuleType) -> None:
        self._bindings = bindings

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bindings, name)

    def nixlAgent(self, name: str, config: Any) -> Any:  # the binding's name
        config.pthrDelay = POLL_DELAY_US
        print(f"{APPLIED_MARKER} {POLL_DELAY_US} us (agent {name})", file=sys.stderr,
              flush=True)
        return self._bindings.nixlAgent(name, config)


def _patch(module: ModuleType) -> None:
    version = importlib.metadata.version(PINNED_DIST)
    source = inspect.getsource(module.nixl_agent.__init__)
    if version != PINNED_VERSION or HARD_CODED_LINE not in source:
        problem = (f"{APPLIED_MARKER} NOT APPLIED: expected {PINNED_DIST}=={PINNED_VERSION} "
                   f"whose nixl_agent.__init__ has '{HARD_CODED_LINE}', found {version}"
                   f"{'' if HARD_CODED_LINE in source else ' without that line'}; "
                   f"update tests/vllm/nixl_poll/sitecustomize.py for it")
        print(problem, file=sys.stderr, flush=True)  # vLLM swallows the ImportError's text
        raise ImportError(problem)
    module.nixlBind = _BindingsWithPollDelay(module.nixlBind)


class _PatchAfterExec(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != PATCHED_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _PatchAfterExec(spec.loader)
        return spec


sys.meta_path.insert(0, _Finder())
