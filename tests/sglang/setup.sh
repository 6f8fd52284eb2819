#!/usr/bin/env bash
# Build the real-SGLang virtualenv and the tiny offline model, once per machine.
#
# Follows docs/engines.md §4: sglang==0.5.23 with its pure-Python
# runtime dependencies (its own metadata minus the CUDA kernels), torch 2.14.1 from local
# disk, Mooncake's non-CUDA transfer engine, and three workarounds:
#   1. a placeholder `sgl_kernel` (the CPU build is not on PyPI; the CPU path without AMX
#      imports a few names and calls none of them);
#   2. one line in sglang/srt/disaggregation/mooncake/conn.py: the KV sender must not use
#      pinned host memory with CUDA events (prefill dies "Found no NVIDIA driver");
#   3. launch flags (--disable-overlap-schedule, and on decode
#      --disaggregation-decode-retraction-backup cpu_tensor): set by the check script.
# Each step leaves a stamp and is skipped when it is there; delete the venv or the model
# folder to rebuild. Setup then checks that the workarounds took, every time: an sglang
# that changed under it fails here with a clear message, not later as a hung engine.
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-python3.11}
SGLANG_VENV=${SGLANG_VENV:-.venv-sglang}
SGLANG_MODEL_DIR=${SGLANG_MODEL_DIR:-.cache/sglang-tiny-model}
SGLANG_VERSION=0.5.23
MOONCAKE_VERSION=0.3.13.post1
TORCH_VERSION=2.14.1
TORCHVISION_VERSION=0.29.1
VENV_STAMP="$SGLANG_VENV/.pdreg-sglang-$SGLANG_VERSION"
MODEL_STAMP="$SGLANG_MODEL_DIR/.pdreg-built"
HERE=tests/sglang

fail() { echo "[setup] FAILED: $*" >&2; exit 1; }
# pip warns about every configured index that lacks a package, and about the CUDA
# requirements left out on purpose: neither is news.
quiet_pip() {
  "$@" --no-warn-conflicts 2> >(grep -v -e 'is ignored: it is neither' >&2)
}
export PYTHONWARNINGS=ignore  # sglang warns at import about every GPU feature it lacks

# Mooncake's engine.so links libibverbs even for its TCP transport.
if ! ldconfig -p | grep -q 'libibverbs\.so\.1'; then
  echo "[setup] installing libibverbs1 (Mooncake's engine.so links it, even for TCP)"
  if [ "$(id -u)" != 0 ]; then fail "libibverbs1 is missing: apt-get install libibverbs1 (as root)"; fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libibverbs1 >/dev/null
fi

if [ -f "$VENV_STAMP" ]; then
  echo "[setup] $SGLANG_VENV already has sglang==$SGLANG_VERSION (stamp found)"
else
  echo "[setup] building $SGLANG_VENV with sglang==$SGLANG_VERSION (about 3 minutes, 7 GB)"
  rm -rf "$SGLANG_VENV"
  "$PYTHON" -m venv "$SGLANG_VENV"
  PY="$SGLANG_VENV/bin/python"
  quiet_pip "$PY" -m pip install -q --upgrade pip packaging
  quiet_pip "$PY" -m pip install -q --no-deps "sglang==$SGLANG_VERSION" \
    "mooncake-transfer-engine-non-cuda==$MOONCAKE_VERSION"
  # sglang's own runtime requirements, minus the CUDA kernels and GPU-only tooling.
  "$PY" "$HERE/sglang_requirements.py" > "$SGLANG_VENV/pdreg-requirements.txt"
  quiet_pip "$PY" -m pip install -q "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION" \
    msgpack -r "$SGLANG_VENV/pdreg-requirements.txt"
  # Workaround 1: the placeholder sgl_kernel.
  SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  mkdir -p "$SITE/sgl_kernel"
  cp "$HERE/sgl_kernel_placeholder.py" "$SITE/sgl_kernel/__init__.py"
  # Workaround 2: no pinned host tensors + CUDA events in Mooncake's KV sender.
  CONN="$SITE/sglang/srt/disaggregation/mooncake/conn.py"
  sed -i 's/^\(    supports_host_tensor_indices = \)True$/\1False/' "$CONN"
  touch "$VENV_STAMP"
fi

# Every run: the workarounds are in place and the pinned versions are the ones installed.
"$SGLANG_VENV/bin/python" "$HERE/verify_sglang_venv.py" "$SGLANG_VERSION" "$TORCH_VERSION" \
  || fail "$SGLANG_VENV does not hold the workarounds (see above); rm -rf $SGLANG_VENV and rerun"

if [ -f "$MODEL_STAMP" ]; then
  echo "[setup] tiny model already at $SGLANG_MODEL_DIR"
else
  echo "[setup] building the tiny model at $SGLANG_MODEL_DIR"
  rm -rf "$SGLANG_MODEL_DIR"
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    "$SGLANG_VENV/bin/python" tests/vllm/make_tiny_model.py "$SGLANG_MODEL_DIR"
  touch "$MODEL_STAMP"
fi
echo "[setup] done"
