"""A container run's work out of its sandbox: at close, and salvaged after a crash.

One path for both (:func:`export_work`, :func:`land`): git in the container commits
every change but build artefacts (the run's ``commit_exclude`` patterns as its
``core.excludesFile``; a salvage uses the defaults; tracked files are committed anyway;
hooks, fsmonitor and filter drivers off) and streams a bundle of the new
commits over ``docker exec`` into a host-owned temp file, capped at
``sandbox.bundle_max_bytes``; the host unbundles it with the hardened git of
:mod:`orchestrator.project.git` into the user's repository (``GIT_DIR`` is that repository, never
a directory the sandbox wrote) and compare-and-swaps the run's branch onto its one head.

**Salvage** (:func:`salvage_container`): when a run's owner process died, reconcile finds
the container in the run's resources; while it still lives (its main process is
``sleep <ttl_s>``), the same export runs with everything taken from the host's own
records: the container id from the resources table, the repository, branch, starting
commit, sandbox user and bundle cap from the run record's ``workspace`` (written by the
owner when the workspace opened), never from anything inside the sandbox. Then the
container is removed; the message says which branch and commit kept the work, or why
nothing could be kept (engine unreachable, container gone, bundle too large).

**Checkpoints** (``refs/orch/checkpoints/<child run id>``: a nested container child's
start) are registered as resources of the child: removed at its close, and by reconcile
when its owner died; :func:`prune_refs` removes those of ended runs and the temporary
``refs/orch/in/<pid>-*`` of dead processes (``orch worktrees prune``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import ValidationError

from ...config import DEFAULT_COMMIT_EXCLUDE, SandboxSettings
from ...errors import OrchError, UsageError
from ...pgroups import process_start
from ...project.git import RepoPaths, git
from ...project.repo import discover, is_ancestor, rev
from ..branch import ref_component
from ..saved import BranchState
from ..settle import commit_env, commit_message
from .docker import MANAGED, OWNER_UID, TOKEN, docker_client, docker_errors, remove_by_id
from .dockerexec import Sandbox
from .transfer import EXPORT, ahead_of, unpack


class RunRecord(Protocol):
    """What a salvage reads of a run's record (``run.RunRecord``; not imported: the record
    holds a spec, which holds this tier's config)."""

    run_id: str
    agent: str
    description: str
    workspace: dict[str, Any]


EXPORT_TIMEOUT_S = 600.0  # a close
SALVAGE_TIMEOUT_S = 120.0  # a salvage runs inside some `orch` command: bounded tighter
CHECKPOINTS = "refs/orch/checkpoints/"
_SHA = re.compile(r"^[0-9a-f]{40,64}$")
_USER = re.compile(r"^([0-9]+):([0-9]+)$")
_ID = re.compile(r"^[0-9a-f]{64}$")


# -- the one way out --------------------------------------------------------------------


async def export_work(
    box: Sandbox,
    main: RepoPaths,
    start: str,
    agent: str,
    message: str,
    *,
    cap: int,
    timeout_s: float = EXPORT_TIMEOUT_S,
    exported: Callable[[], None] | None = None,
    exclude: Sequence[str] = DEFAULT_COMMIT_EXCLUDE,
) -> str | None:
    """Commit inside (but untracked files matching ``exclude``) and bring the work out in
    the same exec; unpack it into ``main``. Returns the new tip, None when HEAD is not past
    ``start``. ``exported`` is called once the container is no longer needed (the bundle
    is on the host, or there is no work): the close removes the container meanwhile."""
    env = {
        **commit_env(ref_component(agent)),
        "START": start,
        "ORCH_EXCLUDE": "".join(f"{p}\n" for p in exclude),
    }
    with tempfile.TemporaryDirectory(prefix="orch-out-") as tmp:
        path = Path(tmp) / "out.bundle"
        with path.open("wb") as f:
            got = await box.call(
                ["bash", "-c", EXPORT],
                message.encode(),
                env=env,
                out_cap=cap,
                timeout_s=timeout_s,
                out_file=f,
                via_server=True,
            )
        if got.overflow:
            raise OrchError(
                f"the sandbox's work is over sandbox.bundle_max_bytes ({cap:,} bytes); "
                "it was not taken"
            )
        if got.timed_out:
            raise OrchError(f"exporting the sandbox's work took over {timeout_s:g} s")
        ahead = ahead_of(got.err)
        if ahead is None:
            raise OrchError("the sandbox's git repository is unusable; its work is lost")
        if ahead != 0 and got.code != 0:
            err = got.err.decode("utf-8", "replace").strip().splitlines()
            raise OrchError(f"git bundle failed in the sandbox: {(err or ['?'])[-2:]}")
        if exported is not None:  # only now: what was refused above is never removed
            exported()
        if ahead == 0:
            return None
        return await unpack(main, path)


async def move_branch(main: RepoPaths, branch: str, tip: str, continued: bool) -> bool:
    """Point ``branch`` at ``tip``: a new branch only if nobody made it meanwhile (or made
    it at ``tip``), a continued one only forward (compare-and-swap). False when it could
    not."""
    ref = f"refs/heads/{branch}"
    if not continued:
        made = await git("update-ref", ref, tip, "0" * 40, repo=main, check=False)
        return made.code == 0 or await rev(ref, main) == tip
    current = await rev(ref, main)
    if current is None or not await is_ancestor(main, current, tip):
        return False
    moved = await git("update-ref", ref, tip, current, repo=main, check=False)
    return moved.code == 0


async def land(main: RepoPaths, branch: str, tip: str, continued: bool) -> str:
    """``tip`` on ``branch``, or on ``<branch>-head`` when the branch moved meanwhile or was
    rewritten (both kept). Returns the branch that holds it."""
    if await move_branch(main, branch, tip, continued):
        return branch
    head = f"{branch}-head"
    await git("update-ref", f"refs/heads/{head}", tip, repo=main)
    return head


# -- salvage after a crash (sync entry: reconcile calls it) ------------------------------


class _Gone(Exception):
    pass


def reap_resource(record: RunRecord | None, kind: str, ref: str) -> list[str]:
    """Reap a container-tier resource of a run whose owner is gone: a container (its work
    salvaged first) or a checkpoint ref. Never raises; returns what was done."""
    if kind == "checkpoint":
        return asyncio.run(drop_checkpoint(ref))
    return asyncio.run(salvage_container(record, ref))


def _proof(found: dict[str, Any] | None, container_id: str, token: str) -> str:
    """Why the container is not provably the one the run made ('' when it is): the exact
    id, orch's label, this uid, and the token recorded with the resource (``docker.py``)."""
    if found is None:
        return ""  # gone: nothing to act on
    labels = (found.get("Config") or {}).get("Labels") or {}
    if not _ID.match(container_id) or found.get("Id") != container_id:
        return "the record names no container id"
    if labels.get(MANAGED) != "true" or labels.get(OWNER_UID) != str(os.getuid()):
        return "it is not an orch container of this user"
    if not token or not secrets.compare_digest(labels.get(TOKEN, ""), token):
        return "its token is not the one recorded when it was made"
    return ""


async def salvage_container(record: RunRecord | None, ref: str) -> list[str]:
    container_id, _, token = ref.partition(" ")
    short = container_id[:12]
    try:
        client = await asyncio.to_thread(docker_client)
    except OrchError as e:
        return [f"could not reach container {short} to keep its work ({e}); its TTL still ends it"]
    try:
        found = await asyncio.to_thread(_inspect, client, container_id)
    except OrchError as e:
        client.close()
        return [f"could not inspect container {short} ({e}); its TTL still ends it"]
    if why := _proof(found, container_id, token):
        client.close()
        return [f"left container {short} alone: {why}"]
    removal: list[asyncio.Future[dict[str, str]]] = []

    def remove() -> None:  # once the work is out (or cannot be): meanwhile the host imports it
        if not removal:
            removal.append(
                asyncio.ensure_future(asyncio.to_thread(remove_by_id, client, container_id))
            )

    try:
        kept, why = "", ""
        try:
            kept = await _export_from(client, record, container_id, remove)
        except _Gone:
            return [f"container {short} was already gone (the work in it is lost)"]
        except OrchError as e:
            why = str(e)
        if why and not removal:
            return [
                f"could not keep the work in container {short}: {why}; left it "
                "running until its TTL (`orch sandbox ps`)"
            ]
        remove()
        try:
            await removal[0]
            removed = f"removed container {short}"
        except OrchError as e:
            removed = f"could not remove container {short}: {e}"
        if kept:
            return [kept, removed]
        if why:  # the bundle was out, its import failed
            return [
                f"could not keep the work in container {short}: {why}",
                f"{removed} (the work in it is lost)",
            ]
        return [f"{removed} (it held no new work)"]
    finally:
        client.close()


class ContainerState(BranchState):
    """What a container run saves (its ``info()``), with what a salvage after a crash
    needs: the starting commit, the container, the sandbox user and the bundle cap."""

    isolation: Literal["container"] = "container"
    start: str = ""  # the commit the container started from
    continued: bool = False  # the branch was continued (it is never deleted)
    container: str = ""  # the container id's first 12 characters
    image: str = ""
    user: str = ""  # "uid:gid"
    pooled: bool = False
    bundle_max_bytes: int | None = None
    discard: bool = False  # a throwaway checkout (a team's gate or reviewer): nothing out


def _saved(record: RunRecord | None) -> ContainerState | None:
    """The run record's workspace as the container tier saved it, if it did."""
    data = record.workspace if record is not None else {}
    if data.get("isolation") != "container":
        return None
    try:
        return ContainerState.model_validate(data)
    except ValidationError:
        return None


def _where(record: RunRecord | None, container_id: str) -> tuple[ContainerState, str, str]:
    """The run record's workspace (written by the owner), checked: (saved, user, branch)."""
    ws = _saved(record)
    if not isinstance(ws, ContainerState) or not ws.repo:
        raise OrchError("its run had not opened its workspace (no work to keep)")
    if not container_id.startswith(ws.container or "-"):
        raise OrchError("the run record names another container")
    if not _SHA.match(ws.start):
        raise OrchError("the run record has no starting commit")
    branch = ws.branch
    if not branch.startswith("orch/") or ".." in branch:
        raise OrchError(f"the run record's branch {branch!r} is not an orch branch")
    user = _USER.match(ws.user)
    if user is None or int(user.group(1)) == 0:
        raise OrchError("the run record has no sandbox user")
    return ws, user.group(0), branch


def _inspect(client: Any, container_id: str) -> dict[str, Any] | None:
    from docker.errors import NotFound

    with docker_errors():
        try:
            found: dict[str, Any] = client.api.inspect_container(container_id)
        except NotFound:
            return None
    return found


async def _export_from(
    client: Any, record: RunRecord | None, container_id: str, exported: Callable[[], None]
) -> str:
    """Export the work of a live container; '' when it held none."""
    ws, user, branch = _where(record, container_id)
    assert record is not None
    if ws.discard:  # its changes were never to be kept: the container only goes
        return ""
    state = await asyncio.to_thread(_inspect, client, container_id)
    if state is None:
        raise _Gone
    if not (state.get("State") or {}).get("Running"):
        raise OrchError("it is not running any more")
    repo = Path(str(ws.repo))
    try:
        main = (await discover(repo)).main()
    except UsageError:
        raise OrchError(f"its repository {repo} is not there any more") from None
    if main.main_root != repo:
        raise OrchError(f"the run record's repository {repo} is not a main checkout")
    defaults = SandboxSettings()
    cap = ws.bundle_max_bytes or defaults.bundle_max_bytes
    cfg = SandboxSettings(image=ws.image or defaults.image, bundle_max_bytes=cap)
    box = Sandbox(client, container_id, cfg, user)
    message = commit_message(record.description, record.run_id, "interrupted")
    tip = await export_work(
        box,
        main,
        ws.start,
        record.agent,
        message,
        cap=cfg.bundle_max_bytes,
        timeout_s=SALVAGE_TIMEOUT_S,
        exported=exported,
    )
    if tip is None:
        return ""
    kept = await land(main, branch, tip, ws.continued)
    return f"kept work on branch {kept} at {tip}"


# -- checkpoint refs ------------------------------------------------------------------------


def checkpoint_resource(ref: str, main_root: Path) -> str:
    """The resource ``ref`` of a checkpoint: the ref name and the repository holding it."""
    return f"{ref} {main_root}"


async def drop_checkpoint(resource: str) -> list[str]:
    ref, _, where = resource.partition(" ")
    if not ref.startswith(CHECKPOINTS) or ".." in ref or not where:
        return []
    try:
        main = (await discover(Path(where))).main()
    except UsageError:
        return []
    if main.main_root != Path(where):
        return []
    gone = await git("update-ref", "-d", ref, repo=main, check=False)
    return [f"deleted {ref}"] if gone.code == 0 else []


def _pid_alive(name: str) -> bool:
    pid = name.partition("-")[0]
    return pid.isdigit() and process_start(int(pid)) is not None


async def prune_refs(repo_root: Path, is_running: Callable[[str], bool]) -> list[str]:
    """Delete checkpoints of runs that are not running and the temporary bundle refs
    (``refs/orch/in/<pid>-<commit>``) of processes that are gone."""
    main = (await discover(repo_root)).main()
    listed = await git("for-each-ref", "--format=%(refname)", "refs/orch/", repo=main)
    deleted: list[str] = []
    for ref in listed.out.split():
        if ref.startswith(CHECKPOINTS):
            stale = not is_running(ref.removeprefix(CHECKPOINTS))
        elif ref.startswith("refs/orch/in/"):
            stale = not _pid_alive(ref.removeprefix("refs/orch/in/"))
        else:
            continue
        if stale:
            with contextlib.suppress(OrchError):
                await git("update-ref", "-d", ref, repo=main)
                deleted.append(ref)
    return deleted
