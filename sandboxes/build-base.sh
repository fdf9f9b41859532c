#!/usr/bin/env bash
# Build a local Debian base image with debootstrap, for hosts that cannot pull
# from a container registry.
#
# Usage: sandboxes/build-base.sh [--full] [TAG]
#   default TAG orch-base:bookworm: minbase + ca-certificates (the stand-in for
#       debian:bookworm-slim; sandboxes/Dockerfile installs the rest with apt).
#   --full (default TAG orch-base:bookworm-full): also includes the sandbox
#       packages, for when apt cannot reach the mirror from inside a build;
#       build then with --build-arg SKIP_APT=1.
# Env: SUITE (bookworm), MIRROR (auto: the host's apt mirror), DEBOOTSTRAP_CACHE
#      (/var/cache/orch-debootstrap; .debs are kept there to speed up reruns).
set -euo pipefail

FULL=0
if [ "${1:-}" = "--full" ]; then FULL=1; shift; fi
SUITE=${SUITE:-bookworm}
if [ "$FULL" = 1 ]; then TAG=${1:-orch-base:${SUITE}-full}; else TAG=${1:-orch-base:${SUITE}}; fi
CACHE=${DEBOOTSTRAP_CACHE:-/var/cache/orch-debootstrap}
PKGS=ca-certificates
[ "$FULL" = 1 ] && PKGS=ca-certificates,bash,coreutils,git,python3,procps

say() { echo "build-base: $*"; }
die() { echo "build-base: ERROR: $*" >&2; exit 1; }

[ "$(id -u)" -eq 0 ] || die "must run as root (debootstrap)"
command -v debootstrap >/dev/null 2>&1 || {
    say "installing debootstrap"
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends debootstrap >/dev/null \
        || die "cannot install debootstrap"
}

# URIs the host's apt uses for a given suite (deb822 .sources and one-line .list).
host_uri_for_suite() {
    local want=$1 f
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -f "$f" ] || continue
        # deb822: blank-line separated stanzas with URIs:/Suites: fields.
        awk -v want="$want" '
            function flush() { if (uris != "" && (" " suites " ") ~ (" " want " ") && types ~ /(^| )deb( |$)/) { split(uris, u, " "); print u[1] } uris=""; suites=""; types="" }
            /^[[:space:]]*$/ { flush(); next }
            /^[[:space:]]*#/ { next }
            tolower($1) == "uris:"   { $1=""; uris=$0; sub(/^ +/, "", uris) }
            tolower($1) == "suites:" { $1=""; suites=$0; sub(/^ +/, "", suites) }
            tolower($1) == "types:"  { $1=""; types=$0; sub(/^ +/, "", types) }
            END { flush() }' "$f"
    done
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [ -f "$f" ] || continue
        # deb [opts] URI SUITE COMPONENTS...
        sed -e 's/\[[^]]*\]//' "$f" | awk -v want="$want" '$1 == "deb" && $3 == want { print $2 }'
    done
}

if [ -z "${MIRROR:-}" ]; then
    MIRROR=$(host_uri_for_suite "$SUITE" | head -n1)
    if [ -z "$MIRROR" ]; then
        # Host may be another release: take any Debian mirror it uses.
        host_codename=$(sed -n 's/^VERSION_CODENAME=//p' /etc/os-release 2>/dev/null | tr -d '"')
        [ -n "$host_codename" ] && MIRROR=$(host_uri_for_suite "$host_codename" | head -n1)
    fi
    MIRROR=${MIRROR:-http://deb.debian.org/debian}
fi
SECURITY=$(host_uri_for_suite "${SUITE}-security" | head -n1)
SECURITY=${SECURITY:-http://deb.debian.org/debian-security}

ROOTFS=$(mktemp -d /var/tmp/orch-rootfs.XXXXXX)
cleanup() { rm -rf --one-file-system "$ROOTFS"; }
trap cleanup EXIT
mkdir -p "$CACHE"

say "debootstrap --variant=minbase --include=$PKGS $SUITE $ROOTFS $MIRROR"
start=$(date +%s)
if ! debootstrap --variant=minbase --include="$PKGS" --cache-dir="$CACHE" \
        "$SUITE" "$ROOTFS" "$MIRROR" >/tmp/orch-debootstrap.log 2>&1; then
    tail -n 20 /tmp/orch-debootstrap.log >&2
    die "debootstrap failed (full log: /tmp/orch-debootstrap.log)"
fi

# Make it look like the official slim image: full apt sources, no caches,
# no docs/man/locales (now or for later installs), no host identity files.
cat >"$ROOTFS/etc/apt/sources.list" <<SRC
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb $SECURITY $SUITE-security main
SRC
mkdir -p "$ROOTFS/etc/dpkg/dpkg.cfg.d"
cat >"$ROOTFS/etc/dpkg/dpkg.cfg.d/docker-slim" <<'CFG'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/lintian/*
CFG
find "$ROOTFS/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete 2>/dev/null || true
rm -rf "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/info/* "$ROOTFS"/usr/share/locale/* \
       "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/cache/apt/*.bin \
       "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/log/*.log "$ROOTFS"/tmp/* \
       "$ROOTFS"/debootstrap
: >"$ROOTFS/etc/resolv.conf"
: >"$ROOTFS/etc/hostname"
rm -f "$ROOTFS/etc/machine-id" && : >"$ROOTFS/etc/machine-id"

say "importing rootfs ($(du -sh --one-file-system "$ROOTFS" | cut -f1)) as $TAG"
tar --numeric-owner --xattrs -C "$ROOTFS" -c . \
    | docker import --change 'CMD ["bash"]' --change 'ENV LANG=C.UTF-8' \
        --message "debootstrap $SUITE minbase ($PKGS) from $MIRROR" - "$TAG" >/dev/null \
    || die "docker import failed"
say "built $TAG in $(( $(date +%s) - start ))s (mirror $MIRROR, packages: $PKGS)"
