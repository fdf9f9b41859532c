"""The Docker engine, as the container tier uses it: the client and its errors, the sandbox
user, the labels that say who made a container, and making, removing and reaping
containers (blocking calls: the workspace and the pool run them in a thread; reconcile
and the CLI call them as they are).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import time
from collections.abc import Iterator, Mapping
from typing import Any

from ...config import SandboxSettings
from ...egress.bridge import SOCKET_INSIDE
from ...egress.proxy import Door
from ...egress.rules import Reach
from ...errors import OrchError, UsageError
from ...pgroups import process_start

WORKSPACE = "/workspace"
MANAGED = "orch.managed"
TOKEN = "orch.token"  # per container, random; the store records it (resource_ref)
OWNER_UID = "orch.owner_uid"
# the sandbox settings that are Docker host-config options of the same name
HOST_CONFIG = {
    "network_mode",
    "cap_drop",
    "security_opt",
    "read_only",
    "pids_limit",
    "mem_limit",
    "init",
}
TMPFS = "rw,nosuid,nodev,exec"  # Docker makes tmpfs noexec unless told
DEFAULT_IMAGE = SandboxSettings().image
_API_VERSION: dict[str, str] = {}

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


def owner_labels(run_id: str = "", chain_id: str = "", agent: str = "") -> dict[str, str]:
    """A new container's labels: who made it, and its ``TOKEN`` (random, recorded with the
    run's resource): reconcile removes only a container whose token and uid it recorded."""
    pid = os.getpid()
    return {
        MANAGED: "true",
        "orch.run_id": run_id,
        "orch.chain_id": chain_id,
        "orch.agent": agent,
        "orch.owner_pid": str(pid),
        "orch.owner_start": str(process_start(pid) or ""),
        OWNER_UID: str(os.getuid()),
        TOKEN: secrets.token_hex(16),
        "orch.created_at": f"{time.time():.3f}",
    }


def resource_ref(container_id: str, labels: Mapping[str, str]) -> str:
    """How a run's container is registered: its id and its token."""
    return f"{container_id} {labels.get(TOKEN, '')}"


# -- making and removing containers ----------------------------------------------------


def create_container(
    client: Any,
    cfg: SandboxSettings,
    uid: int,
    gid: int,
    labels: dict[str, str],
    *,
    network_mode: str,
    egress: Door | None = None,
) -> str:
    """Create (not start) a locked-down container; returns its id (blocking).

    No host directory (and no volume) is mounted: ``/workspace``, ``/tmp`` and ``$HOME``
    are tmpfs (the workspace owned by the sandbox user, ``sandbox.workspace_size``); the
    root filesystem is read-only. ``network_mode``: Docker's (``network_mode``, below).
    ``egress``: the run's door to the egress proxy: its socket mounted at ``SOCKET_INSIDE``
    (then the only way out) and the proxy variables in every process's environment.
    """
    api = client.api
    owned = f"uid={uid},gid={gid}"
    tmpfs = {
        "/tmp": f"{TMPFS},size={cfg.tmp_size},mode=1777",
        WORKSPACE: f"{TMPFS},size={cfg.workspace_size},{owned},mode=0755",
        cfg.home: f"{TMPFS},size={cfg.home_size},{owned},mode=0700",
    }
    lockdown = cfg.model_dump(include=HOST_CONFIG)  # as the settings name it
    lockdown["network_mode"] = network_mode
    mount = {str(egress.socket): {"bind": SOCKET_INSIDE, "mode": "rw"}} if egress else None
    host = api.create_host_config(
        **lockdown,
        binds=mount,
        memswap_limit=cfg.memswap_limit or cfg.mem_limit,
        nano_cpus=int(cfg.cpus * 1e9),
        auto_remove=True,
        tmpfs=tmpfs,
    )
    env = {
        "PATH": cfg.path,
        "HOME": cfg.home,
        "LANG": "C.UTF-8",
        "GIT_CONFIG_COUNT": "1",
        "GIT_CONFIG_KEY_0": "safe.directory",
        "GIT_CONFIG_VALUE_0": "*",
        "GIT_TERMINAL_PROMPT": "0",
        **(egress.env() if egress is not None else {}),
    }
    labels = {**labels, "orch.image": cfg.image}
    with docker_errors(cfg.image):
        made = api.create_container(
            cfg.image,
            ["sleep", str(cfg.ttl_s)],
            user=f"{uid}:{gid}",
            working_dir=WORKSPACE,
            environment=env,
            labels=labels,
            host_config=host,
            hostname="sandbox",
        )
    return str(made["Id"])


def network_mode(cfg: SandboxSettings, reach: Reach) -> str:
    """Docker's network for a run's container: ``sandbox.network_mode`` only when the run's
    network is the host's; else none (an allow-list goes through the egress proxy)."""
    return cfg.network_mode if reach.mode == "host" else "none"


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


def remove_container(container_id: str) -> None:
    """Remove a container (running or not) and its workspace volume: crash reconcile."""
    client = docker_client()
    try:
        remove_by_id(client, container_id)
    finally:
        client.close()


def _owner_alive(labels: Mapping[str, str]) -> bool:
    try:
        pid = int(labels.get("orch.owner_pid", ""))
    except ValueError:
        return False
    started = process_start(pid)
    recorded = labels.get("orch.owner_start", "")
    return started is not None and (not recorded or recorded == str(started))


def list_containers(client: Any) -> list[dict[str, Any]]:
    """Every orch container (found by label), with its labels and whether its owner lives."""
    with docker_errors():
        found = client.api.containers(all=True, filters={"label": f"{MANAGED}=true"})
    return [
        {
            "id": c["Id"],
            "image": c.get("Image", ""),
            "state": c.get("State", ""),
            "status": c.get("Status", ""),
            "labels": c.get("Labels") or {},
            "owner_alive": _owner_alive(c.get("Labels") or {}),
        }
        for c in found
    ]


def reap_by_label(run_ids: set[str] | None = None) -> list[str]:
    """Remove orch containers whose owner process is dead (of ``run_ids`` only, if given)."""
    client = docker_client()
    removed: list[str] = []
    try:
        for c in list_containers(client):
            labels = c["labels"]
            if labels.get(OWNER_UID, str(os.getuid())) != str(os.getuid()):
                continue  # another user's (an older orch set no uid: its TTL ends it)
            if c["owner_alive"] or (
                run_ids is not None and labels.get("orch.run_id") not in run_ids
            ):
                continue
            remove_by_id(client, c["id"])
            removed.append(c["id"])
    finally:
        client.close()
    return removed
