#!/usr/bin/env bash
# Build orch-test-busybox:latest from Debian's static busybox (no pulls, no network).
# Usage: sandboxes/build-test-image.sh [TAG]
set -euo pipefail
TAG=${1:-orch-test-busybox:latest}
HERE=$(cd "$(dirname "$0")" && pwd)
BB=${BUSYBOX:-/bin/busybox}

if ! [ -x "$BB" ] || ! file -L "$BB" 2>/dev/null | grep -q 'statically linked'; then
    # /bin/busybox may be the dynamic busybox package; the static one is what we need.
    if [ "$(id -u)" -eq 0 ] && ! dpkg -s busybox-static >/dev/null 2>&1; then
        echo "build-test-image: installing busybox-static" >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends busybox-static >/dev/null
    fi
fi
[ -x "$BB" ] || { echo "build-test-image: $BB not found (apt-get install busybox-static)" >&2; exit 1; }

ctx=$(mktemp -d)
trap 'rm -rf "$ctx"' EXIT
cp "$BB" "$ctx/busybox"
cp "$HERE/test/Dockerfile" "$ctx/Dockerfile"
# --network none: nothing in this build needs a network (never use the bridge).
if ! out=$(docker build --network none -q -t "$TAG" "$ctx" 2>&1); then
    echo "$out" >&2
    echo "build-test-image: docker build failed" >&2
    exit 1
fi
echo "build-test-image: built $TAG ($(docker image inspect -f '{{.Size}}' "$TAG") bytes) from $BB"
