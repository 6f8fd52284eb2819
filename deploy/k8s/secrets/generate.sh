#!/usr/bin/env bash
# Makes the credentials that kustomization.yaml turns into Secrets: three random tokens
# and the CURVE key pairs (`pdreg keys generate`), in DIR (default: files/ beside this
# script, where kustomization.yaml reads them). Existing files are kept, so running it
# again changes nothing; delete a file to rotate it.
#
# usage: generate.sh [DIR]      env PDREG: the pdreg command (default: pdreg)
set -euo pipefail
out="${1:-$(cd "$(dirname "$0")" && pwd)/files}"
pdreg="${PDREG:-pdreg}"
umask 077
mkdir -p "$out"
for name in token admin-token api-key; do
  if [ ! -s "$out/$name" ]; then
    # 256 random bits, hex: no newline, no character a shell or a header would mangle.
    python3 -c 'import secrets, sys; sys.stdout.write(secrets.token_hex(32))' > "$out/$name"
  fi
done
if [ ! -s "$out/curve/registry.key_secret" ] || [ ! -s "$out/curve/client.key_secret" ]; then
  $pdreg keys generate "$out/curve" --name registry --name client
fi
echo "credentials in $out; next: kubectl apply -k $(dirname "$0")"
