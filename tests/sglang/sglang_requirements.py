"""Print sglang's runtime requirements minus the CUDA kernels, one per line, for pip.

Run with the SGLang virtualenv's python after `pip install --no-deps sglang==...`:
    .venv-sglang/bin/python tests/sglang/sglang_requirements.py > reqs.txt

Plain `pip install sglang` drags in flashinfer, cutlass, deep-gemm and friends (CUDA
kernels, several GB, useless without a GPU). What is left is pure Python or CPU wheels.
torch/torchvision are pinned by setup.sh itself; torchaudio/torchcodec are CUDA builds
on PyPI that break `import torchvision`-style imports, and SGLang's text path needs none.
"""

from __future__ import annotations

import importlib.metadata
import sys

from packaging.requirements import Requirement

CUDA_ONLY = {
    "apache-tvm-ffi", "cuda-python", "flash-attn-4", "flashinfer-python", "humming-kernels",
    "kernels", "nvidia-cutlass-dsl", "nvidia-mathdx", "nvshmem4py-cu13", "quack-kernels",
    "sgl-deep-ep", "sgl-deep-gemm", "sgl-flash-mla", "sglang-kernel", "tilelang",
    "torch-memory-saver", "deepseek-recipe", "tml-renderers",
}
PINNED_BY_SETUP = {"torch", "torchvision", "torchaudio", "torchcodec"}
TOOLING = {"py-spy", "ninja"}  # a profiler and a build tool: not needed to serve


def canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def main() -> int:
    skip = CUDA_ONLY | PINNED_BY_SETUP | TOOLING
    for line in importlib.metadata.requires("sglang") or []:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue  # an extra, or another platform
        if canonical(requirement.name) in skip:
            continue
        requirement.extras = set()  # flashinfer[cu13]-style extras pull CUDA
        requirement.marker = None
        print(requirement)
    return 0


if __name__ == "__main__":
    sys.exit(main())
