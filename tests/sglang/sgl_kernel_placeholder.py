"""A placeholder `sgl_kernel` for SGLang on a CPU without AMX (installed by setup.sh).

The CPU build of sgl-kernel is not on PyPI and PyPI's `sglang-kernel` is CUDA-only.
SGLang's CPU path imports a few of its names at start-up but, without AMX and with the
torch-native attention backend, calls none of them in plain or P/D serving
(docs/engines.md §4, workaround 1). Every name, and every `sgl_kernel.*` submodule,
resolves to a stand-in that raises NotImplementedError when called, so a code path that
does need a real kernel fails loudly instead of computing garbage.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

__version__ = "0.0.0+pdreg-placeholder"
PDREG_PLACEHOLDER = True


class _Missing:
    """A kernel that is not there: attribute access chains, calling raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Missing:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{self._name} is a kernel from sgl_kernel, which is only a placeholder here "
            "(pdreg tests/sglang/setup.sh): this SGLang code path needs the real CPU build")

    def __repr__(self) -> str:
        return f"<missing sgl_kernel kernel {self._name}>"


class _PlaceholderModule(types.ModuleType):
    def __getattr__(self, attr: str) -> _Missing:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self.__name__}.{attr}")


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`import sgl_kernel.anything` gives another placeholder module."""

    def find_spec(self, fullname: str, path: object, target: object = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(__name__ + "."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _PlaceholderModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def __getattr__(attr: str) -> _Missing:
    if attr.startswith("__"):
        raise AttributeError(attr)
    return _Missing(f"{__name__}.{attr}")


# Installed as sgl_kernel/__init__.py (a package), so submodule imports reach the finder.
sys.meta_path.append(_SubmoduleFinder())
