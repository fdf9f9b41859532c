"""The Docker engine helpers of the container tier, and the warm pool of started containers.

A sandbox container shares no host directory: its ``/workspace`` is a tmpfs of its own,
filled with data (a git bundle, ``.worktreeinclude`` copies) when a run
claims it (``container.py``). So a container can be started before its run is known:
:class:`ContainerPool` keeps ``pool_size`` of them started, and a ``ContainerWorkspace``
opened while the pool is open claims one in milliseconds instead of starting one
(``async with ContainerPool(repo, settings):``). Pooled containers carry
``orch.pool=true`` and an empty ``orch.run_id`` (labels are fixed at creation); a claim
registers the container with its run. Unclaimed containers are removed when the pool
closes; if orch dies they go at their TTL or with ``orch sandbox prune`` (their owner pid
is dead). This module also holds what every part of the tier uses: the client, its
errors, the sandbox user and the labels.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from pydantic import ValidationError

from ..config import SandboxSettings
from ..errors import OrchError, UsageError
from .boxchannel import Server, start_server
from .worktree import await_shielded

WORKSPACE = "/workspace"
MANAGED = "orch.managed"
TOKEN = "orch.token"  # per container, random; the store records it (resource_ref)
OWNER_UID = "orch.owner_uid"
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
    """``(uid, gid)`` the container runs as: ``sandbox.user``, else ``sandbox.uid:gid``
    (the image's ``/workspace`` owner); never 0. No host file is shared, so the host's own
    uid does not matter."""
    if cfg.user:
        uid_s, _, gid_s = cfg.user.partition(":")
        try:
            uid, gid = int(uid_s), int(gid_s or uid_s)
        except ValueError:
            raise UsageError(f"sandbox.user {cfg.user!r} must be numeric 'uid:gid'") from None
    else:
        uid, gid = cfg.uid, cfg.gid
    if uid == 0:
        raise UsageError("the sandbox never runs as uid 0: set sandbox.user to an unprivileged uid")
    return uid, gid


def process_start(pid: int) -> int | None:
    from .base import process_start

    return process_start(pid)


def owner_labels(run_id: str = "", chain_id: str = "", agent: str = "") -> dict[str, str]:
    """A new container's labels: who made it, and its ``TOKEN`` (random, recorded with the
    run's resource): reconcile removes only a container whose token and uid it recorded."""
    pid = os.getpid()
    return {MANAGED: "true", "orch.run_id": run_id, "orch.chain_id": chain_id,
            "orch.agent": agent, "orch.owner_pid": str(pid),
            "orch.owner_start": str(process_start(pid) or ""), OWNER_UID: str(os.getuid()),
            TOKEN: secrets.token_hex(16), "orch.created_at": f"{time.time():.3f}"}  # fmt: skip


def resource_ref(container_id: str, labels: Mapping[str, str]) -> str:
    """How a run's container is registered: its id and its token."""
    return f"{container_id} {labels.get(TOKEN, '')}"


# -- one container ------------------------------------------------------------------------


@dataclass
class Warm:
    """A started container with an empty ``/workspace`` (its own anonymous volume), and
    its program server, greeted, when it started."""

    container_id: str
    created: float = field(default_factory=time.monotonic)
    server: Server | None = None
    token: str = ""


def create_container(
    client: Any, cfg: SandboxSettings, uid: int, gid: int, labels: dict[str, str]
) -> str:
    """Create (not start) a locked-down container; returns its id (blocking).

    No host directory (and no volume) is mounted: ``/workspace``, ``/tmp`` and ``$HOME``
    are tmpfs (the workspace owned by the sandbox user, ``sandbox.workspace_size``); the
    root filesystem is read-only.
    """
    api = client.api
    host = api.create_host_config(
        network_mode=cfg.network_mode, cap_drop=cfg.cap_drop, security_opt=cfg.security_opt,
        read_only=cfg.read_only, pids_limit=cfg.pids_limit, mem_limit=cfg.mem_limit,
        memswap_limit=cfg.memswap_limit or cfg.mem_limit, nano_cpus=int(cfg.cpus * 1e9),
        init=cfg.init, auto_remove=True,
        tmpfs={"/tmp": f"{TMPFS},size={cfg.tmp_size},mode=1777",
               WORKSPACE: f"{TMPFS},size={cfg.workspace_size},uid={uid},gid={gid},mode=0755",
               cfg.home: f"{TMPFS},size={cfg.home_size},uid={uid},gid={gid},mode=0700"},
    )  # fmt: skip
    env = {"PATH": cfg.path, "HOME": cfg.home, "LANG": "C.UTF-8", "GIT_CONFIG_COUNT": "1",
           "GIT_CONFIG_KEY_0": "safe.directory", "GIT_CONFIG_VALUE_0": "*",
           "GIT_TERMINAL_PROMPT": "0"}  # fmt: skip
    labels = {**labels, "orch.image": cfg.image}
    with docker_errors(cfg.image):
        made = api.create_container(
            cfg.image, ["sleep", str(cfg.ttl_s)], user=f"{uid}:{gid}", working_dir=WORKSPACE,
            environment=env, labels=labels, host_config=host, hostname="sandbox",
        )  # fmt: skip
    return str(made["Id"])


def start_container(client: Any, container_id: str) -> None:
    with docker_errors():
        client.api.start(container_id)


# -- removal and reaping (sync: reconcile and the CLI call these) ------------------------


def remove_by_id(client: Any, container_id: str) -> dict[str, str]:
    """Force-remove a container and wait until it is gone; returns its labels."""
    from docker.errors import APIError, NotFound

    api = client.api
    labels: dict[str, str] = {}
    with docker_errors():
        try:
            labels = api.inspect_container(container_id)["Config"].get("Labels") or {}
            api.remove_container(container_id, force=True, v=True)
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

_POOLS: dict[str, ContainerPool] = {}


def _pool_key(cfg: SandboxSettings) -> str:
    return cfg.model_dump_json(exclude={"pool_size"})


def claim_warm(cfg: SandboxSettings) -> Warm | None:
    """A started container of an open pool with these settings, if one is ready."""
    pool = _POOLS.get(_pool_key(cfg))
    return pool.take() if pool is not None else None


class ContainerPool:
    """``size`` (default ``sandbox.pool_size``) started containers, each with an empty
    ``/workspace``.

    ``async with ContainerPool(project_root, settings.sandbox):`` around a run is a no-op at
    ``pool_size`` 0; otherwise container workspaces opened inside it (with the same sandbox
    settings) claim a started container instead of starting one. ``repo`` only names the
    project in messages: a warm container holds nothing of any repository until claimed.
    """

    def __init__(
        self, repo: Path, settings: SandboxSettings | None = None, *, size: int | None = None
    ) -> None:
        self.repo = repo.resolve()
        self.cfg = settings or SandboxSettings()
        self.size = self.cfg.pool_size if size is None else size
        self.ready: list[Warm] = []
        self.claimed = 0
        self.error: OrchError | None = None  # the last failure to start a container
        self._stale: list[Warm] = []
        self._wake = asyncio.Event()
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._client: Any = None
        self._key: str | None = None

    async def __aenter__(self) -> Self:
        if self.size <= 0:
            return self  # pool_size 0: nothing to keep warm (and no engine needed)
        self.uid, self.gid = sandbox_user(self.cfg)
        key = _pool_key(self.cfg)
        if key in _POOLS:
            raise UsageError(f"a container pool with these settings is already open ({self.repo})")
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
        warm, self.ready, self._stale = [*self.ready, *self._stale], [], []
        await asyncio.gather(*(asyncio.to_thread(self._discard, w) for w in warm))
        if self._client is not None:
            self._client.close()
            self._client = None

    def take(self) -> Warm | None:
        """A ready container (never one past half its TTL), or None; the pool refills behind
        it, a moment later, so starting the next container does not slow this claim down."""
        asyncio.get_running_loop().call_later(REFILL_DELAY_S, self._wake.set)
        while self.ready:
            warm = self.ready.pop(0)
            if time.monotonic() - warm.created < self.cfg.ttl_s / 2:
                self.claimed += 1
                return warm
            self._stale.append(warm)
        return None

    async def wait_ready(self, count: int | None = None) -> None:
        """Wait until ``count`` (default: all) containers are ready; raise the pool's start
        error. Bound it with ``asyncio.timeout``."""
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
            for warm in stale:
                await asyncio.to_thread(self._discard, warm)
            while len(self.ready) < self.size:
                try:
                    await await_shielded(self._make())  # never leave a half-made one behind
                except OrchError as e:
                    self.error = e
                    self._changed.set()
                    await asyncio.sleep(5)  # the engine or the image may come back
                    break
            await self._wake.wait()

    async def _make(self) -> None:
        labels = {**owner_labels(), "orch.pool": "true"}
        cid = await asyncio.to_thread(
            create_container, self._client, self.cfg, self.uid, self.gid, labels
        )
        try:
            await asyncio.to_thread(start_container, self._client, cid)
        except BaseException:
            await asyncio.to_thread(self._discard, Warm(cid))
            raise
        user = f"{self.uid}:{self.gid}"
        server = await asyncio.to_thread(
            start_server, self._client, cid, user, WORKSPACE, wait=True
        )
        self.error = None
        self.ready.append(Warm(cid, server=server, token=labels[TOKEN]))
        self._changed.set()

    def _discard(self, warm: Warm) -> None:
        if warm.server is not None:
            warm.server.close()
        with contextlib.suppress(OrchError):
            remove_by_id(self._client, warm.container_id)
