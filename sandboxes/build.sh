#!/usr/bin/env bash
# Full build of orch-sandbox:latest (and orch-test-busybox:latest).
#
# Usage: build.sh [--rebuild-base] [--no-test-image] [--dry-run]
#
# 1. Base image: use $BASE (debian:bookworm-slim) if present or pullable;
#    otherwise debootstrap a local orch-base:bookworm (build-base.sh) and build
#    with --build-arg BASE=orch-base:bookworm. "Pullable" is decided fast: a
#    registry that has not started answering the pull within $REGISTRY_TIMEOUT
#    seconds (default 4) counts as unreachable, as offline.
# 2. docker build --network host (apt needs the mirror; the bridge network is
#    forbidden here). If apt fails inside the build, fall back to a debootstrap
#    base that already contains the packages (build-base.sh --full) + SKIP_APT=1.
# --dry-run: decide the base (the pull included), then print the builds it
#    would run instead of running them.
# Env: BASE, TAG (orch-sandbox:latest), REGISTRY_TIMEOUT (4).
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
BASE=${BASE:-debian:bookworm-slim}
TAG=${TAG:-orch-sandbox:latest}
LOCAL_BASE=orch-base:bookworm
REGISTRY_TIMEOUT=${REGISTRY_TIMEOUT:-4}
REBUILD_BASE=0
TEST_IMAGE=1
DRY_RUN=0
for a in "$@"; do
    case $a in
        --rebuild-base) REBUILD_BASE=1 ;;
        --no-test-image) TEST_IMAGE=0 ;;
        --dry-run) DRY_RUN=1 ;;
        -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
        *) echo "build.sh: unknown argument $a" >&2; exit 2 ;;
    esac
done

say() { echo "build.sh: $*"; }
die() { echo "build.sh: ERROR: $*" >&2; exit 1; }

docker info >/dev/null 2>&1 || die "docker engine not reachable (run .ci/docker-up)"
start=$(date +%s)

have_image() { docker image inspect "$1" >/dev/null 2>&1; }

# Run (or, with --dry-run, only print) one step of the build.
step() {
    if [ "$DRY_RUN" = 1 ]; then say "dry run: would run: $*"; else "$@"; fi
}

# Pull $1, giving the registry $REGISTRY_TIMEOUT seconds to start answering ("Pulling
# from", or the digest of an image that is up to date); once it answers, the download
# may take up to 10 minutes. Offline, a pull waits about 60 s before it gives up: this
# gives up after a few. Sets PULL_WHY to the reason when it fails.
PULL_WHY=""
pull_quick() {
    local out rc=0 pid ticks=0 limit
    out=$(mktemp /tmp/orch-pull.XXXXXX)
    docker pull "$1" >"$out" 2>&1 &
    pid=$!
    limit=$(( REGISTRY_TIMEOUT * 10 ))
    while kill -0 "$pid" 2>/dev/null; do
        if [ "$ticks" -ge "$limit" ]; then
            kill "$pid" 2>/dev/null || true
            wait "$pid" 2>/dev/null || true
            if [ "$limit" = 6000 ]; then PULL_WHY="the pull took over 10 minutes"
            else PULL_WHY="the registry did not answer within ${REGISTRY_TIMEOUT}s"; fi
            rm -f "$out"
            return 1
        fi
        # it answers: the download may take up to 10 minutes
        grep -qE 'Pulling from|Digest:' "$out" && limit=6000
        sleep 0.1
        ticks=$(( ticks + 1 ))
    done
    wait "$pid" || rc=$?
    [ "$rc" = 0 ] || PULL_WHY=$(grep -v '^$' "$out" | tail -n 1)
    rm -f "$out"
    return "$rc"
}

if [ "$REBUILD_BASE" = 1 ]; then
    BASE=$LOCAL_BASE
    say "--rebuild-base: building $LOCAL_BASE with debootstrap"
    step bash "$HERE/build-base.sh" "$LOCAL_BASE"
elif have_image "$BASE"; then
    say "using base $BASE (present locally)"
elif pull_quick "$BASE"; then
    say "using base $BASE (pulled)"
elif have_image "$LOCAL_BASE"; then
    say "cannot pull $BASE ($PULL_WHY); using existing local $LOCAL_BASE (--rebuild-base to refresh)"
    BASE=$LOCAL_BASE
else
    say "cannot pull $BASE ($PULL_WHY); building local $LOCAL_BASE with debootstrap instead"
    step bash "$HERE/build-base.sh" "$LOCAL_BASE"
    BASE=$LOCAL_BASE
fi

if [ "$DRY_RUN" = 1 ]; then
    say "dry run: would run: docker build --network host --build-arg BASE=$BASE -t $TAG $HERE"
    [ "$TEST_IMAGE" = 1 ] && say "dry run: would run: bash $HERE/build-test-image.sh"
    say "dry run: built nothing ($(( $(date +%s) - start ))s)"
    exit 0
fi

log=$(mktemp /tmp/orch-sandbox-build.XXXXXX.log)
say "docker build --network host --build-arg BASE=$BASE -t $TAG $HERE (log: $log)"
if docker build --network host --build-arg BASE="$BASE" -t "$TAG" "$HERE" >"$log" 2>&1; then
    :
else
    tail -n 15 "$log" >&2
    say "build with apt inside failed; falling back to a debootstrap base with the packages preinstalled"
    bash "$HERE/build-base.sh" --full "${LOCAL_BASE}-full"
    docker build --network host --build-arg BASE="${LOCAL_BASE}-full" --build-arg SKIP_APT=1 \
        -t "$TAG" "$HERE" >"$log" 2>&1 || { tail -n 30 "$log" >&2; die "docker build failed (log: $log)"; }
fi
rm -f "$log"

# Smoke test: no network, unprivileged, tools present.
docker run --rm --network none "$TAG" bash -c \
    'test "$(id -u)" = 10001 && git --version >/dev/null && python3 -c "print()" >/dev/null' \
    || die "smoke test of $TAG failed"

if [ "$TEST_IMAGE" = 1 ]; then
    bash "$HERE/build-test-image.sh"
fi
say "built $TAG from $BASE in $(( $(date +%s) - start ))s ($(docker image inspect -f '{{.Size}}' "$TAG" | awk '{printf "%d MB", $1/1e6}'))"
