#!/usr/bin/env bash
# compose.cpu.yaml in real containers: installs what it needs (idempotent), then runs tests/containers
# (image build, stack start, traffic, scaling, a killed engine, a clean stop).
#
#   deploy/container_smoke.sh            # as root, on Debian/Ubuntu; CI runs it from .ci/run
#
# Installs podman (apt), podman-compose (pip) and a base image made with debootstrap from Debian's packages
# (deploy/base_image.sh), unless PDSERVE_BASE_IMAGE names one. Unless PDSERVE_TORCH_INDEX_URL names an index,
# a local CPU torch wheel (pip's find-links, /opt/wheels) goes into ./pip-local for the build. Exits 0 with a printed
# reason, running nothing, when this machine cannot run containers (no root, no apt, podman fails).
# Leaves the built images (pdserve:cpu and the base) for the next run's layer cache.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
skip() { echo "container smoke SKIPPED: $*"; exit 0; }

configure_podman() {
    # runc: crun refuses hosts with hybrid cgroups (v1 + a v2 mount). rlimits: podman's defaults exceed the
    # hard limits of a process without CAP_SYS_RESOURCE (a sandboxed root), which the runtime cannot raise.
    local conf=/etc/containers/containers.conf.d/90-pdserve-smoke.conf
    [ -f "$conf" ] && return
    mkdir -p "$(dirname "$conf")"
    {
        echo "# written by pdserve's deploy/container_smoke.sh"
        echo "[containers]"
        echo "default_ulimits = [\"nofile=$(ulimit -Hn):$(ulimit -Hn)\", \"nproc=32768:32768\"]"
        if command -v runc >/dev/null && [ -d /sys/fs/cgroup/unified ]; then
            echo "[engine]"
            echo 'runtime = "runc"'
        fi
    } > "$conf"
}

[ "$(id -u)" = 0 ] || skip "needs root to install and run podman"
# netavark (podman's network backend) sets up container networks with iptables: without it every `podman run`
# fails with "netavark: No such file or directory"
if ! command -v podman >/dev/null || ! command -v debootstrap >/dev/null || ! command -v iptables >/dev/null; then
    command -v apt-get >/dev/null || skip "no podman and no apt-get to install it"
    export DEBIAN_FRONTEND=noninteractive
    apt-get -o DPkg::Lock::Timeout=300 update -qq >/dev/null 2>&1 || true
    apt-get -o DPkg::Lock::Timeout=300 install -y -qq podman runc netavark aardvark-dns iptables debootstrap >/dev/null \
        || skip "apt-get could not install podman, iptables and debootstrap"
fi
configure_podman
podman info >/dev/null 2>&1 || skip "podman is installed but cannot run containers here: $(podman info 2>&1 | tail -n 1)"
"$python" -m pip install --quiet --disable-pip-version-check "podman-compose>=1.1" || skip "pip could not install podman-compose"
PATH="$("$python" -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH"
export PATH

# Nothing comes from a container registry or an index beyond the package registries unless asked: the base image is made
# from Debian's packages (PDSERVE_BASE_IMAGE=python:3.11-slim to use a registry's), and torch comes from a
# local CPU wheel (PDSERVE_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu to use PyTorch's index).
if [ -z "${PDSERVE_BASE_IMAGE:-}" ]; then
    podman image exists localhost/pdserve-base:bookworm || deploy/base_image.sh localhost/pdserve-base:bookworm
    export PDSERVE_BASE_IMAGE=localhost/pdserve-base:bookworm
fi
if [ -z "${PDSERVE_TORCH_INDEX_URL:-}" ]; then
    wheel=$(find $("$python" -m pip config get global.find-links 2>/dev/null || true) /opt/wheels \
            -maxdepth 1 -name 'torch-*+cpu-*.whl' 2>/dev/null | head -n 1 || true)
    [ -n "$wheel" ] || skip "no local CPU torch wheel: set PDSERVE_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu"
    ln -f "$wheel" pip-local/ 2>/dev/null || cp -f "$wheel" pip-local/
    export PDSERVE_TORCH_INDEX_URL=https://pypi.org/simple  # the +cpu wheel in ./pip-local wins over PyPI's
    echo "building with $(basename "$wheel") from ./pip-local"
fi
# the CA pip trusts here (a proxy's): PIP_CERT, pip's config, or the one requests/ssl are told to use
cert=${PIP_CERT:-$("$python" -m pip config get global.cert 2>/dev/null || true)}
[ -n "$cert" ] || cert=${REQUESTS_CA_BUNDLE:-${SSL_CERT_FILE:-}}
if [ -n "$cert" ] && [ -f "$cert" ]; then  # pip here trusts a proxy's CA: so does pip in the build
    cp -f "$cert" pip-local/ca.crt
    printf '[global]\ncert = /pip-local/ca.crt\n' > pip-local/pip.conf
fi
started=$(podman run --rm --pull never "$PDSERVE_BASE_IMAGE" true 2>&1) \
    || skip "podman cannot start a container here: $(echo "$started" | tail -n 1)"
echo "base image: $PDSERVE_BASE_IMAGE"
export PDSERVE_CONTAINER_REPORT=${PDSERVE_CONTAINER_REPORT:-$(mktemp /tmp/pdserve-containers.XXXXXX.json)}
"$python" -m pytest -q -p no:cacheprovider -m containers tests/containers "$@"
echo "measured: $(cat "$PDSERVE_CONTAINER_REPORT")"
