#!/usr/bin/env bash
# Writes the image's hashed lock files from PyPI (the Dockerfile installs them with
# `pip install --require-hashes`):
#   deploy/requirements.lock         pdreg's runtime dependencies (pyproject.toml), at the
#                                    versions the test suite runs with (.venv), each with
#                                    the sha256 of every file PyPI has for that version
#   deploy/requirements-build.lock   the build backend pyproject.toml names (setuptools)
#   deploy/requirements-engine.lock  the `engine` extra (torch, PyPI's build)
# Only PyPI: this machine's pip configuration (local indexes, find-links, constraints) is
# set aside, so the hashes are the ones any machine pulling from PyPI checks. pip-tools
# lives in .cache/lock-tools. Run after changing dependencies: make lock.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3.11}"
tools=.cache/lock-tools
export PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= PIP_CONSTRAINT= PIP_EXTRA_INDEX_URL=
pypi=(--index-url https://pypi.org/simple)
if [ ! -x "$tools/bin/pip-compile" ]; then
  "$python" -m venv "$tools"
  "$tools/bin/pip" install -q "${pypi[@]}" pip-tools==7.6.2
fi
# The versions the suite is tested with: the lock may not drift from them.
.venv/bin/pip freeze --exclude-editable | grep -v '^pdreg==' > "$tools/tested.txt"
compile=("$tools/bin/pip-compile" --quiet --generate-hashes --strip-extras --allow-unsafe
         --no-emit-index-url "${pypi[@]}")
"${compile[@]}" --constraint "$tools/tested.txt" --output-file deploy/requirements.lock \
  pyproject.toml
"$python" - > "$tools/build.in" <<'PY'
import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"]))
PY
"${compile[@]}" --constraint "$tools/tested.txt" --output-file deploy/requirements-build.lock \
  "$tools/build.in"
"${compile[@]}" --extra engine --constraint deploy/requirements.lock \
  --output-file deploy/requirements-engine.lock pyproject.toml
echo "lock: deploy/requirements*.lock written from PyPI"
