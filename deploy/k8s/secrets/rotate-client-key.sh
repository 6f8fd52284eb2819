#!/usr/bin/env bash
# Replaces the clients' CURVE key pair (routers, sidecars, the planner) with no moment
# when a client's key is refused. The registries read their allowlist once, at start, so
# each step ends by restarting them (a StatefulSet: `rollout restart deploy` alone leaves
# them on the old list). DIR as generate.sh's (default: files/ beside this script).
#
#   rotate-client-key.sh begin [DIR]    a new pair in DIR/curve-next/; its public key joins
#                                       the allowlist (both keys accepted), then:
#       kubectl apply -k deploy/k8s/secrets
#       kubectl -n pdreg rollout restart statefulset/pdreg-registry
#       kubectl -n pdreg rollout status statefulset/pdreg-registry
#
#   rotate-client-key.sh finish [DIR]   the new pair becomes the clients' (DIR/curve/client.*)
#                                       and the old public key leaves the allowlist, then:
#       kubectl apply -k deploy/k8s/secrets
#       kubectl -n pdreg rollout restart deploy      # clients take the new pair; the
#       kubectl -n pdreg rollout status deploy/...   # running registries accept both
#       kubectl -n pdreg rollout restart statefulset/pdreg-registry   # the old key is out
#
# usage: rotate-client-key.sh begin|finish [DIR]      env PDREG: the pdreg command
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
step="${1:?usage: rotate-client-key.sh begin|finish [DIR]}"
out="${2:-$here/files}"
pdreg="${PDREG:-pdreg}"
umask 077
[ -s "$out/curve/client.key_secret" ] || { echo "rotate: no client key in $out (run generate.sh)" >&2; exit 1; }
case "$step" in
  begin)
    [ ! -e "$out/curve-next" ] || { echo "rotate: $out/curve-next exists: a rotation is under way (finish it)" >&2; exit 1; }
    $pdreg keys generate "$out/curve-next" --name client
    cp "$out/curve-next/client.key" "$out/allowed-clients/client-next.key"
    ;;
  finish)
    [ -s "$out/curve-next/client.key_secret" ] || { echo "rotate: no rotation under way (begin first)" >&2; exit 1; }
    mv "$out/curve-next/client.key" "$out/curve/client.key"
    mv "$out/curve-next/client.key_secret" "$out/curve/client.key_secret"
    rmdir "$out/curve-next"
    mv "$out/allowed-clients/client-next.key" "$out/allowed-clients/client.key"
    ;;
  *) echo "usage: rotate-client-key.sh begin|finish [DIR]" >&2; exit 2 ;;
esac
PDREG="$pdreg" "$here/generate.sh" "$out"
