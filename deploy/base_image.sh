#!/usr/bin/env bash
# A Debian bookworm base image with python3 and its venv module, made without any container registry:
# debootstrap (minbase) from this machine's configured Debian mirror, then `import` into the engine.
#
#   deploy/base_image.sh [NAME]          # default localhost/pdserve-base:bookworm; podman, or CONTAINER_ENGINE=docker
#
# Kept when it exists already. Use it as the Dockerfile's BASE_IMAGE (PDSERVE_BASE_IMAGE for compose).
set -euo pipefail
name=${1:-localhost/pdserve-base:bookworm}
engine=${CONTAINER_ENGINE:-podman}
if "$engine" image inspect "$name" >/dev/null 2>&1; then
    echo "base image $name: already there"
    exit 0
fi
mirror=$(grep -rhoE '^(URIs:|deb) +https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null \
         | awk '{print $2}' | head -n 1 || true)
mirror=${mirror:-http://deb.debian.org/debian}
rootfs=$(mktemp -d /var/tmp/pdserve-rootfs.XXXXXX)
trap 'rm -rf "$rootfs"' EXIT
echo "debootstrap bookworm from $mirror into $rootfs"
debootstrap --variant=minbase --include=python3,python3-venv bookworm "$rootfs" "$mirror" >/dev/null
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/*
tar -C "$rootfs" -c . | "$engine" import --change 'CMD ["/bin/bash"]' - "$name" >/dev/null
echo "base image $name: made ($("$engine" image inspect --format '{{.Size}}' "$name") bytes)"
