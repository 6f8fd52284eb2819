#!/usr/bin/env bash
# Makes the credentials that kustomization.yaml turns into Secrets, in DIR (default:
# files/ beside this script, where kustomization.yaml reads them):
#   token, admin-token, api-key      three random tokens
#   curve/                           CURVE key pairs (`pdreg keys generate`): the
#                                    registries' (registry.*) and the clients' (client.*)
#   allowed-clients/*.key            the client public keys the registries accept: several
#                                    at once, so a client key rotates without downtime
#                                    (rotate-client-key.sh)
#   allowed-clients.yaml             those keys as the Secret pdreg-allowed-clients, one
#                                    entry per file (written anew on every run)
# Existing files are kept, so running it again changes nothing; delete a token file to
# rotate it, then apply and restart every pdreg workload (see kustomization.yaml).
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
mkdir -p "$out/allowed-clients"
if ! compgen -G "$out/allowed-clients/*.key" >/dev/null; then
  cp "$out/curve/client.key" "$out/allowed-clients/client.key"
fi
# kustomize's secretGenerator names its files one by one; this Secret takes every key
# file of the directory, however many a rotation has there.
python3 - "$out" <<'PY'
import base64, pathlib, re, sys
out = pathlib.Path(sys.argv[1])
keys = sorted(out.glob("allowed-clients/*.key"))
bad = [k.name for k in keys if not re.fullmatch(r"[-._a-zA-Z0-9]+", k.name)]
if bad:
    sys.exit(f"generate.sh: key file names must be letters, digits and -._: {bad}")
lines = ["# Written by generate.sh from allowed-clients/: do not edit.",
         "apiVersion: v1", "kind: Secret",
         "metadata: {name: pdreg-allowed-clients, labels: {app.kubernetes.io/part-of: pdreg}}",
         "data:"]
lines += [f"  {k.name}: {base64.b64encode(k.read_bytes()).decode()}" for k in keys]
(out / "allowed-clients.yaml").write_text("\n".join(lines) + "\n")
print(f"allowed client keys: {', '.join(k.name for k in keys)}")
PY
echo "credentials in $out; next: kubectl apply -k $(dirname "$0")"
