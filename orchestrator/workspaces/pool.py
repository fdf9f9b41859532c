"""Sandbox slots and the warm pool of them.

A *slot* is one locked-down container and its host directories under
``<main repo>/.orch/sandboxes/<name>/`` (the layout is described in ``container.py``):
it can be started before its worktree is known, because its ``work`` directory,
mounted at ``/workspace``, is renamed into ``.orch/worktrees/<run_id>`` and the
worktree is created into it on claim (a bind mount follows a renamed directory;
``git worktree add`` accepts an existing empty one).

:class:`ContainerPool` keeps ``pool_size`` slots of one repository started, so a
``ContainerWorkspace`` opened while the pool is open claims one in milliseconds
instead of starting a container (``async with ContainerPool(repo, settings):``).
Pooled containers carry ``orch.pool=true`` and an empty ``orch.run_id`` (labels are
fixed at creation); a claim registers the container with its run. Unclaimed
containers are removed when the pool closes; if orch dies they go at their TTL or
with ``orch sandbox prune`` (their owner pid is dead). This module also holds the
engine helpers both tiers use: the client, its errors, the sandbox user and labels.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import struct
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from pydantic import ValidationError

from ..config import SandboxSettings
from ..errors import OrchError, UsageError
from ..repo import admin_dir, ensure_orch_dir, locate, orch_dir
from .worktree import await_shielded

WORKSPACE = "/workspace"
COMMON = "/orch/common"
GITDIR = "/orch/gitdir"
MANAGED = "orch.managed"
TMPFS = "rw,nosuid,nodev,exec"  # Docker makes tmpfs noexec unless told
DEFAULT_IMAGE = SandboxSettings().image
_API_VERSION: dict[str, str] = {}
REFILL_DELAY_S = 0.25

# -- the engine -------------------------------------------------------------------------


def _unreachable(detail: object) -> OrchError:
    return OrchError(
        f"Docker is not reachable ({str(detail)[:160]}): start the engine (`sudo systemctl start "
        "docker`, or `bash .ci/docker-up` in the orch repo) or point DOCKER_HOST at it"
    )


def _image_missing(image: str) -> OrchError:
    if image == DEFAULT_IMAGE:
        return OrchError(f"image {image} not found: run `orch sandbox build`")
    return OrchError(f"image {image} not found: build or load it first (orch never pulls images)")


def docker_client() -> Any:
    """A connected ``docker.DockerClient`` (close it); one clear OrchError when there is none."""
    import docker
    from docker.errors import DockerException

    host = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    if host.startswith("unix://"):  # check first: a failed docker-py client leaks its socket
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(5)
            try:
                probe.connect(host.removeprefix("unix://"))
            except OSError as e:
                raise _unreachable(f"{host}: {e.strerror or e}") from None
    try:
        client = docker.from_env(version=_API_VERSION.get("v"), max_pool_size=64)
    except DockerException as e:
        raise _unreachable(e) from None
    _API_VERSION.setdefault("v", client.api.api_version)  # later clients skip the negotiation
    return client


@contextlib.contextmanager
def docker_errors(image: str = "") -> Iterator[None]:
    """Engine errors as OrchError: unreachable, image missing, or the API's explanation."""
    from docker.errors import APIError, DockerException, ImageNotFound

    try:
        yield
    except ImageNotFound:
        raise _image_missing(image) from None
    except APIError as e:
        raise OrchError(f"docker: {e.explanation or e}") from None
    except (OSError, DockerException) as e:  # the SDK's connection errors are OSErrors
        raise _unreachable(e) from None


def sandbox_settings(options: Mapping[str, Any]) -> SandboxSettings:
    try:
        return SandboxSettings.model_validate(options.get("sandbox") or {})
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise UsageError(f"bad setting 'sandbox.{where}': {first['msg']}") from None


def sandbox_user(cfg: SandboxSettings) -> tuple[int, int]:
    """``(uid, gid)`` the container runs as: never 0."""
    if cfg.user:
        uid_s, _, gid_s = cfg.user.partition(":")
        try:
            uid, gid = int(uid_s), int(gid_s or uid_s)
        except ValueError:
            raise UsageError(f"sandbox.user {cfg.user!r} must be numeric 'uid:gid'") from None
    elif os.geteuid() == 0:
        uid, gid = cfg.uid, cfg.gid
    else:
        uid, gid = os.getuid(), os.getgid()
    if uid == 0:
        raise UsageError("the sandbox never runs as uid 0: set sandbox.user to an unprivileged uid")
    return uid, gid


def process_start(pid: int) -> int | None:
    from .base import process_start

    return process_start(pid)


def owner_labels(run_id: str = "", chain_id: str = "", agent: str = "") -> dict[str, str]:
    pid = os.getpid()
    return {MANAGED: "true", "orch.run_id": run_id, "orch.chain_id": chain_id,
            "orch.agent": agent, "orch.owner_pid": str(pid),
            "orch.owner_start": str(process_start(pid) or ""),
            "orch.created_at": f"{time.time():.3f}"}  # fmt: skip


# -- slots: the host directories of one container ---------------------------------------


@dataclass
class Slot:
    dir: Path  # <main>/.orch/sandboxes/<name>
    common: Path  # the repository's git dir (mounted read-only)
    work: Path  # mounted at /workspace: the worktree is made in it
    container_id: str = ""
    created: float = field(default_factory=time.monotonic)

    @property
    def gitdir(self) -> Path:
        return self.dir / "gitdir"

    @property
    def links(self) -> Path:
        return self.dir / "links"


def _acl(uid: int) -> bytes:
    """A POSIX ACL (xattr format): owner rwx, user ``uid`` rwx, group r-x, mask rwx, other r-x."""
    none = 0xFFFFFFFF
    entries = [(0x01, 7, none), (0x02, 7, uid), (0x04, 5, none), (0x10, 7, none), (0x20, 5, none)]
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries)


def make_slot(main_root: Path, common: Path, uid: int, gid: int, work: Path | None = None) -> Slot:
    """Create the slot directories (blocking); ``work`` defaults to ``<slot>/work``.

    As root, ``work`` is shared with ``uid`` by a default ACL (inherited by all it will hold).
    """
    ensure_orch_dir(main_root)
    where = orch_dir(main_root) / "sandboxes" / uuid.uuid4().hex[:12]
    slot = Slot(where, common, work or where / "work")
    for d in (slot.gitdir, slot.links, slot.work):
        d.mkdir(parents=True)
    if os.geteuid() == 0:
        os.chown(slot.gitdir, uid, gid)
        try:
            for name in ("system.posix_acl_access", "system.posix_acl_default"):
                os.setxattr(slot.work, name, _acl(uid))
        except OSError as e:
            shutil.rmtree(slot.dir, ignore_errors=True)
            with contextlib.suppress(OSError):
                slot.work.rmdir()
            raise OrchError(
                f"cannot share {slot.work} with the sandbox user by ACL ({e.strerror}): "
                "put the repository on a filesystem with POSIX ACLs, or run orch as non-root"
            ) from None
    return slot


def create_container(
    client: Any, cfg: SandboxSettings, slot: Slot, uid: int, gid: int, labels: dict[str, str]
) -> str:
    """Create (not start) the locked-down container of ``slot``; returns its id (blocking)."""
    from docker.types import Mount

    api = client.api
    mounts = [
        Mount(WORKSPACE, str(slot.work), type="bind"),
        Mount(COMMON, str(slot.common), type="bind", read_only=True),
        Mount(GITDIR, str(slot.gitdir), type="bind"),
        Mount(str(slot.common / "worktrees"), str(slot.links), type="bind", read_only=True),
    ]
    host = api.create_host_config(
        network_mode=cfg.network_mode, cap_drop=cfg.cap_drop, security_opt=cfg.security_opt,
        read_only=cfg.read_only, pids_limit=cfg.pids_limit, mem_limit=cfg.mem_limit,
        memswap_limit=cfg.memswap_limit or cfg.mem_limit, nano_cpus=int(cfg.cpus * 1e9),
        init=cfg.init, auto_remove=True, mounts=mounts,
        tmpfs={"/tmp": f"{TMPFS},size={cfg.tmp_size},mode=1777",
               cfg.home: f"{TMPFS},size={cfg.home_size},uid={uid},gid={gid},mode=0700"},
    )  # fmt: skip
    env = {"PATH": cfg.path, "HOME": cfg.home, "LANG": "C.UTF-8", "GIT_CONFIG_COUNT": "1",
           "GIT_CONFIG_KEY_0": "safe.directory", "GIT_CONFIG_VALUE_0": "*"}  # fmt: skip
    labels = {**labels, "orch.slot": str(slot.dir), "orch.image": cfg.image}
    with docker_errors(cfg.image):
        made = api.create_container(
            cfg.image, ["sleep", str(cfg.ttl_s)], user=f"{uid}:{gid}", working_dir=WORKSPACE,
            environment=env, labels=labels, host_config=host, hostname="sandbox",
        )  # fmt: skip
    slot.container_id = str(made["Id"])
    return slot.container_id


def start_container(client: Any, container_id: str) -> None:
    with docker_errors():
        client.api.start(container_id)


def _chown_tree(top: Path, uid: int, gid: int) -> None:
    """``uid:gid`` for everything under ``top`` except ``top`` itself and ``top/.git``."""
    stack = [str(top)]
    while stack:
        here = stack.pop()
        with os.scandir(here) as entries:
            for entry in entries:
                if here == str(top) and entry.name == ".git":
                    continue
                with contextlib.suppress(OSError):
                    os.lchown(entry.path, uid, gid)
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)


def attach_tree(slot: Slot, tree: Path, uid: int, gid: int) -> str:
    """Give the container git access to the worktree now at ``tree``; returns its gitdir."""
    gitdir = admin_dir(slot.common, tree)  # from the common dir, never the tree's .git
    if gitdir is None:
        raise OrchError(f"{tree} is not a registered worktree of {slot.common}")
    (slot.dir / "claim.json").write_text(json.dumps({"worktree": str(tree), "gitdir": str(gitdir)}))
    for name in ("HEAD", "index"):
        with contextlib.suppress(FileNotFoundError):
            shutil.copyfile(gitdir / name, slot.gitdir / name)
    (slot.gitdir / "commondir").write_text(COMMON + "\n")
    (slot.gitdir / "gitdir").write_text(WORKSPACE + "/.git\n")
    if os.geteuid() == 0:
        _chown_tree(slot.gitdir, uid, gid)
        _chown_tree(tree, uid, gid)
        with contextlib.suppress(OSError):  # .git stays orch's alone: no inherited ACL entry
            os.removexattr(tree / ".git", "system.posix_acl_access")
        os.chmod(tree / ".git", 0o644)
    os.symlink(GITDIR, slot.links / gitdir.name)
    return str(gitdir)


def _restore_gitfile(tree: Path, gitdir: str) -> None:
    """The worktree's ``.git`` file as git wrote it, whatever the container did to it."""
    dot = tree / ".git"
    want = f"gitdir: {gitdir}\n"
    if not tree.is_dir():
        return
    with contextlib.suppress(OSError):
        st = dot.lstat()
        if dot.is_file() and not dot.is_symlink() and st.st_uid == os.geteuid():
            if dot.read_text() == want:
                return
    if dot.is_dir() and not dot.is_symlink():
        shutil.rmtree(dot, ignore_errors=True)
    else:
        dot.unlink(missing_ok=True)
    dot.write_text(want)


def release_slot(slot_dir: Path) -> None:
    """After its container is gone: restore the worktree's ``.git`` file, delete the slot."""
    if slot_dir.parent.name != "sandboxes" or slot_dir.parent.parent.name != ".orch":
        return  # not one of ours: never delete what a label merely names
    with contextlib.suppress(OSError, ValueError, KeyError):
        claim = json.loads((slot_dir / "claim.json").read_text())
        _restore_gitfile(Path(claim["worktree"]), claim["gitdir"])
    shutil.rmtree(slot_dir, ignore_errors=True)


# -- removal and reaping (sync: reconcile and the CLI call these) ------------------------


def remove_by_id(client: Any, container_id: str) -> dict[str, str]:
    """Force-remove a container and wait until it is gone; returns its labels."""
    from docker.errors import APIError, NotFound

    api = client.api
    labels: dict[str, str] = {}
    with docker_errors():
        try:
            labels = api.inspect_container(container_id)["Config"].get("Labels") or {}
            api.remove_container(container_id, force=True)
        except NotFound:
            return labels
        except APIError as e:
            if e.status_code != 409:  # 409: auto-remove already in progress
                raise
        end = time.monotonic() + 15
        while time.monotonic() < end:
            try:
                api.inspect_container(container_id)
            except NotFound:
                return labels
            time.sleep(0.05)
    raise OrchError(f"container {container_id[:12]} was not removed within 15 s")


# -- the warm pool ----------------------------------------------------------------------

_POOLS: dict[tuple[str, str], ContainerPool] = {}


def _pool_key(common: Path, cfg: SandboxSettings) -> tuple[str, str]:
    return str(common), cfg.model_dump_json(exclude={"pool_size"})


def claim_slot(common: Path, cfg: SandboxSettings) -> Slot | None:
    """A started slot of an open pool for this repository and these settings, if one is ready."""
    pool = _POOLS.get(_pool_key(common, cfg))
    return pool.take() if pool is not None else None


class ContainerPool:
    """``size`` (default ``sandbox.pool_size``) started slots of the repository at ``repo``.

    ``async with ContainerPool(project_root, settings.sandbox):`` around a run is a no-op at
    ``pool_size`` 0; otherwise container workspaces of that repository (with the same
    sandbox settings) opened inside it claim a started container instead of starting one.
    """

    def __init__(
        self, repo: Path, settings: SandboxSettings | None = None, *, size: int | None = None
    ) -> None:
        self.repo = repo.resolve()
        self.cfg = settings or SandboxSettings()
        self.size = self.cfg.pool_size if size is None else size
        self.ready: list[Slot] = []
        self.claimed = 0
        self.error: OrchError | None = None  # the last failure to start a slot
        self._stale: list[Slot] = []
        self._wake = asyncio.Event()
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._client: Any = None
        self._key: tuple[str, str] | None = None

    async def __aenter__(self) -> Self:
        if self.size <= 0:
            return self  # pool_size 0: nothing to keep warm (and no engine needed)
        self.uid, self.gid = sandbox_user(self.cfg)
        repo = await locate(self.repo)  # not a repository: UsageError
        self.common, self.main_root = repo.common_dir, repo.main_root
        key = _pool_key(self.common, self.cfg)
        if key in _POOLS:
            raise UsageError(f"a container pool for {self.main_root} is already open")
        self._client = await asyncio.to_thread(docker_client)
        self._key = key
        _POOLS[key] = self
        self._task = asyncio.create_task(self._refill(), name="orch-container-pool")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await await_shielded(self._close())

    async def _close(self) -> None:
        if self._key is not None:
            _POOLS.pop(self._key, None)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        slots, self.ready, self._stale = [*self.ready, *self._stale], [], []
        await asyncio.gather(*(asyncio.to_thread(self._discard, s) for s in slots))
        if self._client is not None:
            self._client.close()
            self._client = None

    def take(self) -> Slot | None:
        """A ready slot (never one past half its TTL), or None; the pool refills behind it,
        a moment later, so starting the next container does not slow this claim down."""
        asyncio.get_running_loop().call_later(REFILL_DELAY_S, self._wake.set)
        while self.ready:
            slot = self.ready.pop(0)
            if time.monotonic() - slot.created < self.cfg.ttl_s / 2:
                self.claimed += 1
                return slot
            self._stale.append(slot)
        return None

    async def wait_ready(self, count: int | None = None) -> None:
        """Wait until ``count`` (default: all) slots are ready; raise the pool's start error.

        Bound it with ``asyncio.timeout``."""
        want = self.size if count is None else count
        while len(self.ready) < want:
            if self.error is not None:
                raise self.error
            self._changed.clear()
            await self._changed.wait()

    async def _refill(self) -> None:
        while True:
            self._wake.clear()
            stale, self._stale = self._stale, []
            for slot in stale:
                await asyncio.to_thread(self._discard, slot)
            while len(self.ready) < self.size:
                try:
                    await await_shielded(self._make())  # never leave a half-made slot behind
                except OrchError as e:
                    self.error = e
                    self._changed.set()
                    await asyncio.sleep(5)  # the engine or the image may come back
                    break
            await self._wake.wait()

    async def _make(self) -> None:
        labels = {**owner_labels(), "orch.pool": "true"}
        slot = await asyncio.to_thread(make_slot, self.main_root, self.common, self.uid, self.gid)
        try:
            await asyncio.to_thread(
                create_container, self._client, self.cfg, slot, self.uid, self.gid, labels
            )
            await asyncio.to_thread(start_container, self._client, slot.container_id)
        except BaseException:
            await asyncio.to_thread(self._discard, slot)
            raise
        self.error = None
        self.ready.append(slot)
        self._changed.set()

    def _discard(self, slot: Slot) -> None:
        if slot.container_id:
            with contextlib.suppress(OrchError):
                remove_by_id(self._client, slot.container_id)
        release_slot(slot.dir)
