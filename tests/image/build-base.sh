#!/usr/bin/env bash
# Builds the Dockerfile's base image (python:3.11-slim) locally, for machines that reach
# no container registry: a Debian bookworm rootfs from the system package mirror
# (debootstrap), with Python 3.11 laid out like the official python:3.11-slim (python,
# python3, pip on /usr/local/bin, pip installs into /usr/local, LANG=C.UTF-8, useradd)
# and this machine's local CAs,
# committed to buildah's store as docker.io/library/python:3.11-slim, which is what the
# Dockerfile's `FROM python:3.11-slim` resolves to. deploy/Dockerfile is unchanged: a user
# with Docker Hub gets the official image instead.
#
# Behind a stamp: skipped while the image is in the store and this script is unchanged.
# About 2-4 minutes the first time (debootstrap), 0 s after.
#
# usage: build-base.sh        env MIRROR (default: this machine's apt mirror), STAMP_DIR
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
IMAGE=docker.io/library/python:3.11-slim
stamp_dir="${STAMP_DIR:-$repo/.cache/image}"
stamp="$stamp_dir/base.stamp"
# The CAs this machine adds to Debian's (a TLS-intercepting proxy's, an organisation's):
# the base trusts them too, so that pip in the build reaches the index pip reaches here.
local_cas=(/usr/local/share/ca-certificates/*.crt)
[ -e "${local_cas[0]}" ] || local_cas=()
want="$(cat "$0" ${local_cas[@]+"${local_cas[@]}"} | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && buildah inspect --type image "$IMAGE" >/dev/null 2>&1; then
  echo "base: $IMAGE is built (stamp $stamp)"
  exit 0
fi

# The mirror apt uses here (deb822 or one-line sources), else Debian's own.
if [ -z "${MIRROR:-}" ]; then
  MIRROR="$(sed -n 's/^URIs: *\([^ ]*debian\)$/\1/p; s/^deb \(\[[^]]*\] \)\?\([^ ]*debian\) bookworm .*/\2/p' \
      /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null | head -n1 || true)"
  MIRROR="${MIRROR:-http://deb.debian.org/debian}"
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
rootfs="$work/rootfs"
start=$SECONDS
echo "base: debootstrap bookworm from $MIRROR"
# minbase + what python:3.11-slim ships: Python 3.11 with pip and setuptools, CA
# certificates, netbase (/etc/services, /etc/protocols). passwd (useradd) is in minbase.
debootstrap --variant=minbase \
  --include=python3.11,python3-pip,python3-setuptools,python3-wheel,ca-certificates,netbase \
  bookworm "$rootfs" "$MIRROR" > "$work/debootstrap.log" 2>&1 \
  || { tail -n 30 "$work/debootstrap.log"; exit 1; }
# The official image's layout: the interpreter and pip on /usr/local/bin, and pip free to
# install as root (Debian marks its Python externally managed; the official image is not).
rm -f "$rootfs/usr/lib/python3.11/EXTERNALLY-MANAGED"
for name in python python3 python3.11; do ln -sf /usr/bin/python3.11 "$rootfs/usr/local/bin/$name"; done
for name in pip pip3 pip3.11; do ln -sf /usr/bin/pip3 "$rootfs/usr/local/bin/$name"; done
if [ ${#local_cas[@]} -gt 0 ]; then
  cp "${local_cas[@]}" "$rootfs/usr/local/share/ca-certificates/"
  chroot "$rootfs" update-ca-certificates >/dev/null
fi
# As small as the real one: no apt lists, caches or docs.
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb \
  "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/*
tar -C "$rootfs" -cf "$work/rootfs.tar" .
echo "base: rootfs $(du -sh "$rootfs" | cut -f1), debootstrap $((SECONDS - start)) s"
cat > "$work/Containerfile" <<'CONTAINERFILE'
FROM scratch
ADD rootfs.tar /
ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8 \
    PYTHON_VERSION=3.11
CMD ["python3"]
CONTAINERFILE
buildah bud --isolation chroot --format docker -t "$IMAGE" -f "$work/Containerfile" "$work" >/dev/null 2>&1
mkdir -p "$stamp_dir"
echo "$want" > "$stamp"
echo "base: $IMAGE built in $((SECONDS - start)) s"
