"""What crosses the container boundary, as data: git bundles and ``.worktreeinclude`` copies.

In: the host bundles the run's starting commit from the user's repository (found from
the run record's working directory, never from a tree a sandbox writes) with the hardened
git of :mod:`orchestrator.project.git`, and tars it, with the included files read from the
*user's* tree by :mod:`.includes` (through :mod:`orchestrator.fs.safefs`), into a host-owned
temp file streamed to the container on the stdin of one ``docker exec`` (the engine's
``put_archive`` cannot write a tmpfs under a read-only root), where ``tar`` unpacks it
and git clones it into ``/workspace``.

Out: the container's work arrives as a bundle stream (``git bundle create -``) written
to a host-owned temp file, capped at ``sandbox.bundle_max_bytes``; the host checks it
(``git bundle verify``: a bundle whose prerequisites are in the repository), reads its
one head, and unpacks its objects (``git bundle unbundle``, no transport, no checkout,
no hooks: ``GIT_DIR`` is the user's repository, never a directory the sandbox wrote).
Refs are then moved with ``update-ref`` by the caller.
"""

from __future__ import annotations

import asyncio
import atexit
import hashlib
import io
import os
import re
import shutil
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import OrchError
from ...fs import private
from ...project.git import RepoPaths, first_line, git

_SHA = re.compile(r"^[0-9a-f]{40,64}$")

# -- the scripts git runs inside the container (as the sandbox user) ------------------------

NEEDS = "the sandbox image needs python3 and git; run `orch sandbox build`"
# POSIX sh (any image has one): check the image, unpack the archive from stdin, clone the
# bundle into /workspace, copy the includes in.
SETUP = r"""command -v python3 >/dev/null && command -v git >/dev/null || { echo NEEDS; exit 4; }
test -w /workspace || { echo NOT-WRITABLE; exit 3; }
set -e
IN=$(mktemp -d /workspace/.orch-in.XXXXXX)
tar -x -C "$IN" -f -
cd /workspace
git init -q
git fetch -q --no-tags "$IN/in/base.bundle" "$REF:refs/heads/$BRANCH"
git checkout -q -f "$BRANCH"
if [ -d "$IN/in/include" ]; then cp -an "$IN/in/include/." . ; fi
rm -rf "$IN"
"""
# Commit every change (message on stdin) but untracked files matching $ORCH_EXCLUDE (the
# run's commit_exclude patterns, one a line), like the host's commits of a worktree: no hooks,
# fsmonitor or filter drivers run (a run's own config could make its export fail or lie
# about its files). Then say on stderr how many commits HEAD is past $START
# ("orch-ahead=x": HEAD unusable) and, when there are some, stream them as a bundle.
EXPORT = r"""cd /workspace || { echo orch-ahead=x >&2; exit 0; }
off=(-c core.hooksPath=/dev/null -c core.fsmonitor=false -c commit.gpgSign=false)
while read -r key _; do
  name=${key#filter.}; name=${name%.*}
  off+=(-c "filter.$name.clean=" -c "filter.$name.smudge=" -c "filter.$name.process="
        -c "filter.$name.required=false")
done < <(git config --get-regexp '^filter\..*\.(clean|smudge|process|required)$' 2>/dev/null)
if [ -n "${ORCH_EXCLUDE-}" ] && ex=$(mktemp); then  # build artefacts stay out of the commit
  printf '%s' "$ORCH_EXCLUDE" > "$ex"; off+=(-c "core.excludesFile=$ex")
fi
g() { git "${off[@]}" "$@"; }
# add fails on a file that vanishes mid-walk (try again) or on a nested repository without a
# commit: then add the rest, and each nested repository that has a commit on its own
if ! g add -A 2>/dev/null && ! g add -A 2>/dev/null; then
  set --
  nested=()
  while IFS= read -r -d '' e; do
    case "$e" in '?? '*/) set -- "$@" ":(exclude,literal)${e#?? }"; nested+=("${e#?? }") ;; esac
  done < <(g status --porcelain -z --untracked-files=all --ignore-submodules=dirty)
  g add -A -- . "$@" >/dev/null 2>&1
  for p in "${nested[@]}"; do g add -- ":(literal)${p%/}" >/dev/null 2>&1; done
fi
g commit --no-verify -q --cleanup=whitespace -F - >/dev/null 2>&1  # nothing staged: no commit
n=$(g rev-list --count "$START..HEAD" 2>/dev/null) || n=x
echo "orch-ahead=$n" >&2
case "$n" in x|0) exit 0 ;; esac
exec git -c core.hooksPath=/dev/null bundle create -q - HEAD "^$START"
"""


def ahead_of(stderr: bytes) -> int | None:
    """The count EXPORT reported, None when the repository was unusable."""
    for line in reversed(stderr.decode("utf-8", "replace").splitlines()):
        if line.startswith("orch-ahead="):
            value = line.removeprefix("orch-ahead=")
            return int(value) if value.isdigit() else None
    return None


@dataclass
class Staging:
    """A host-owned temp directory (0700) for one run's bundles and archive: in orch's
    private root (``fs/private.py``), never under ``TMPDIR`` (a checkout's, maybe: an agent
    would swap the bundle a host git fetches)."""

    dir: Path = field(default_factory=lambda: private.temp_dir("bundles", "run-"))

    def path(self, name: str) -> Path:
        return self.dir / name

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


# -- in ---------------------------------------------------------------------------------


_BUNDLES: dict[tuple[str, str], Path] = {}  # (common dir, commit) -> bundle file
_LOCKS: dict[tuple[str, str], asyncio.Lock] = {}
_CACHE_DIR: list[Path] = []
BUNDLE_CACHE = 16


def _cache_dir() -> Path:
    if not _CACHE_DIR:
        made = private.temp_dir("bundles", "base-")
        atexit.register(shutil.rmtree, made, True)
        _CACHE_DIR.append(made)
    return _CACHE_DIR[0]


def bundle_ref(commit: str) -> str:
    """The name the starting commit has in its bundle (and, briefly, in the repository)."""
    return f"refs/orch/in/{os.getpid()}-{commit}"


async def base_bundle(repo: RepoPaths, commit: str) -> Path:
    """A bundle of ``commit`` (all its history) under :func:`bundle_ref`, made once per
    repository and commit in this process (children fanned out from one base share it);
    host-owned, in a 0700 temp dir."""
    key = (str(repo.common_dir), commit)
    async with _LOCKS.setdefault(key, asyncio.Lock()):
        found = _BUNDLES.get(key)
        if found is not None and found.is_file():
            return found
        name = hashlib.sha256("\0".join(key).encode()).hexdigest()[:32]
        path = _cache_dir() / f"{name}.bundle"
        tmp = path.with_suffix(".tmp")
        for stale in (tmp, tmp.with_suffix(".tmp.lock")):  # a cancelled try's (the dir is ours)
            stale.unlink(missing_ok=True)
        await bundle_commit(repo, commit, tmp, bundle_ref(commit))
        tmp.replace(path)
        _BUNDLES[key] = path
        while len(_BUNDLES) > BUNDLE_CACHE:
            _BUNDLES.pop(next(iter(_BUNDLES))).unlink(missing_ok=True)
        return path


def drop_stale_lock(repo: RepoPaths, ref: str) -> None:
    """Remove the lock a git killed mid-write left on ``ref`` (cancelling a git command kills
    it: the next ``update-ref`` of that name would fail on "File exists"). Only for a ref of
    this process's own (its name holds our pid: no other process takes it), opened beneath
    the repository without following a link."""
    *dirs, name = ref.split("/")
    try:
        fd = os.open(repo.common_dir, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        for part in dirs:
            inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = inner
        os.unlink(f"{name}.lock", dir_fd=fd)
    except OSError:  # no such lock (the usual case), or a planted link: left alone
        pass
    finally:
        os.close(fd)


async def bundle_commit(repo: RepoPaths, commit: str, dest: Path, ref: str) -> None:
    """``dest``: a bundle of ``commit`` (all its history) under the name ``ref`` (one of
    this process's: a lock a cancelled try left on it is removed first)."""
    drop_stale_lock(repo, ref)
    try:  # the ref goes whatever happens, also when cancelled while it is being made
        await git("update-ref", ref, commit, repo=repo)
        await git("bundle", "create", "-q", str(dest), ref, repo=repo)
    finally:
        await asyncio.shield(git("update-ref", "-d", ref, repo=repo, check=False))


def _dir(name: str, uid: int, gid: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.uid, info.gid = tarfile.DIRTYPE, 0o755, uid, gid
    return info


def write_archive(
    dest: Path, bundle: Path, includes: dict[str, bytes], uid: int, gid: int
) -> dict[str, str]:
    """The tar SETUP unpacks: ``in/base.bundle`` and ``in/include/…``,
    owned by the sandbox user. Returns the sha256 of each include. Blocking."""
    digests: dict[str, str] = {}
    made: set[str] = set()
    with tarfile.open(dest, "w") as tar:
        tar.addfile(_dir("in", uid, gid))
        info = tar.gettarinfo(str(bundle), "in/base.bundle")
        info.uid, info.gid, info.mode, info.uname, info.gname = uid, gid, 0o644, "", ""
        with bundle.open("rb") as f:
            tar.addfile(info, f)
        for rel, data in sorted(includes.items()):
            parts = rel.split("/")
            for i in range(len(parts)):
                name = "/".join(["in", "include", *parts[:i]])
                if name not in made:
                    made.add(name)
                    tar.addfile(_dir(name, uid, gid))
            file = tarfile.TarInfo(f"in/include/{rel}")
            file.size, file.mode, file.uid, file.gid = len(data), 0o644, uid, gid
            tar.addfile(file, io.BytesIO(data))
            digests[rel] = hashlib.sha256(data).hexdigest()
    return digests


# -- out --------------------------------------------------------------------------------


async def unpack(repo: RepoPaths, bundle: Path) -> str:
    """Unpack the bundle's objects into ``repo`` (``unbundle`` checks that its prerequisites
    are there) and return its one head; refs are moved by the caller (``update-ref`` of a
    branch refuses anything but a commit)."""
    got = await git("bundle", "unbundle", str(bundle), repo=repo, check=False)
    if got.code != 0:
        raise OrchError(f"the sandbox's work is not a valid bundle: {first_line(got.err)}")
    tips = [line.split()[0] for line in got.out.splitlines() if line.strip()]
    if len(tips) != 1 or not _SHA.match(tips[0]):
        raise OrchError(f"the sandbox's bundle names {len(tips)} heads; expected one")
    return tips[0]
