#!/usr/bin/env bash
# Full build of orch-sandbox:latest (and orch-test-busybox:latest).
#
# Usage: sandboxes/build.sh [--rebuild-base] [--no-test-image]
#
# 1. Base image: use $BASE (debian:bookworm-slim) if present or pullable;
#    otherwise debootstrap a local orch-base:bookworm (sandboxes/build-base.sh)
#    and build with --build-arg BASE=orch-base:bookworm.
# 2. docker build --network host (apt needs the mirror; the bridge network is
#    forbidden here). If apt fails inside the build, fall back to a debootstrap
#    base that already contains the packages (build-base.sh --full) + SKIP_APT=1.
# Env: BASE, TAG (orch-sandbox:latest).
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
BASE=${BASE:-debian:bookworm-slim}
TAG=${TAG:-orch-sandbox:latest}
LOCAL_BASE=orch-base:bookworm
REBUILD_BASE=0
TEST_IMAGE=1
for a in "$@"; do
    case $a in
        --rebuild-base) REBUILD_BASE=1 ;;
        --no-test-image) TEST_IMAGE=0 ;;
        -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
        *) echo "build.sh: unknown argument $a" >&2; exit 2 ;;
    esac
done

say() { echo "build.sh: $*"; }
die() { echo "build.sh: ERROR: $*" >&2; exit 1; }

docker info >/dev/null 2>&1 || die "docker engine not reachable (run .ci/docker-up)"
start=$(date +%s)

have_image() { docker image inspect "$1" >/dev/null 2>&1; }

if [ "$REBUILD_BASE" = 1 ]; then
    BASE=$LOCAL_BASE
    say "--rebuild-base: building $LOCAL_BASE with debootstrap"
    "$HERE/build-base.sh" "$LOCAL_BASE"
elif have_image "$BASE"; then
    say "using base $BASE (present locally)"
elif timeout 60 docker pull -q "$BASE" >/dev/null 2>&1; then
    say "using base $BASE (pulled)"
elif have_image "$LOCAL_BASE"; then
    say "cannot pull $BASE; using existing local $LOCAL_BASE (--rebuild-base to refresh)"
    BASE=$LOCAL_BASE
else
    say "cannot pull $BASE; building local $LOCAL_BASE with debootstrap instead"
    "$HERE/build-base.sh" "$LOCAL_BASE"
    BASE=$LOCAL_BASE
fi

log=$(mktemp /tmp/orch-sandbox-build.XXXXXX.log)
say "docker build --network host --build-arg BASE=$BASE -t $TAG $HERE (log: $log)"
if docker build --network host --build-arg BASE="$BASE" -t "$TAG" "$HERE" >"$log" 2>&1; then
    :
else
    tail -n 15 "$log" >&2
    say "build with apt inside failed; falling back to a debootstrap base with the packages preinstalled"
    "$HERE/build-base.sh" --full "${LOCAL_BASE}-full"
    docker build --network host --build-arg BASE="${LOCAL_BASE}-full" --build-arg SKIP_APT=1 \
        -t "$TAG" "$HERE" >"$log" 2>&1 || { tail -n 30 "$log" >&2; die "docker build failed (log: $log)"; }
fi
rm -f "$log"

# Smoke test: no network, unprivileged, tools present.
docker run --rm --network none "$TAG" bash -c \
    'test "$(id -u)" = 10001 && git --version >/dev/null && python3 -c "print()" >/dev/null' \
    || die "smoke test of $TAG failed"

if [ "$TEST_IMAGE" = 1 ]; then
    "$HERE/build-test-image.sh"
fi
say "built $TAG from $BASE in $(( $(date +%s) - start ))s ($(docker image inspect -f '{{.Size}}' "$TAG" | awk '{printf "%d MB", $1/1e6}'))"
