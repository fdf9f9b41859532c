"""Container tier: the run works in a locked-down Docker container that shares nothing with
the host; its starting state goes in as data and its work comes out as data.

One trust boundary: the host never opens, runs git in, or deletes anything in a tree the
sandbox can write.

- **Storage**: no host directory (and no volume) is mounted. ``/workspace`` is a tmpfs
  of ``sandbox.workspace_size`` (1 GiB) owned by the sandbox user: its size is capped,
  it never touches the host's disk, it goes with the container whatever happens, and a
  checkout into it is many times faster than into a volume; its pages count against
  the container's memory limit. (An anonymous volume would take ``put_archive``, which
  cannot write a tmpfs under a read-only root, but is disk-backed and uncapped.)
- **In**: the host bundles the starting commit from the user's repository (the run's
  working directory, resolved through ``repo.locate``; never a sandbox-writable dir),
  tars it with the ``.worktreeinclude`` files read from the *user's* tree by safefs,
  and streams the archive on the stdin of one docker exec that unpacks it and clones it
  into ``/workspace`` on branch ``orch/<agent>/<id>``.
- **Tools** run inside (:mod:`.runtime`, :mod:`.inside.files`); ``bash`` is a docker exec.
- **Out**: at close (also on cancel: shielded) git in the container commits every change
  as ``orch <agent> <orch@localhost>`` with ``orch-run``/``orch-status`` trailers and
  streams ``git bundle create - HEAD ^<start>`` over docker exec into a host temp file
  (capped at ``sandbox.bundle_max_bytes``); the host verifies and unbundles it into the
  user's repository and moves ``refs/heads/orch/<agent>/<id>`` (:mod:`.transfer`). A
  run that changed nothing leaves no branch. ``ContainerConfig.branch`` continues a
  branch: the container starts from its tip and the branch moves only forward.
- **Nested container children** start from the parent's committed state: the parent's
  work is committed inside its container, exported the same way into
  ``refs/orch/checkpoints/<child run id>``, and the child starts from that commit.
- **Crash**: when orch dies before the close, reconcile salvages the work while the
  container lives: the same export, with the repository, branch and starting commit
  taken from the run record (:mod:`.export`); then the container is removed.
- **Limits**: ``sandbox.max_per_chain`` live containers per chain (a run beyond it is
  refused, naming the setting); reads capped inside; the bundle capped on the host.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal

from ...egress.proxy import Door
from ...errors import OrchError, UsageError
from ...project.git import git
from ...project.repo import locate, rev
from ...project.statedir import sign
from ..base import ProcessResult, RunOutcome, Runtime, TierConfig, WorkspaceSpec
from ..branch import branch_name, continued_start, with_branch
from ..hiding import hidden_reason, hidden_rels, mirrored
from ..includes import excluded_paths, include_files, untracked
from ..lifetime import Shielded
from ..settle import branch_artifacts, commit_message
from .docker import (
    TOKEN,
    WORKSPACE,
    create_container,
    docker_client,
    network_mode,
    owner_labels,
    remove_by_id,
    resource_ref,
    sandbox_user,
    start_container,
)
from .dockerexec import Sandbox
from .export import ContainerState, checkpoint_resource, export_work, land
from .pool import claim_warm
from .runtime import ContainerRuntime
from .transfer import NEEDS, SETUP, Staging, base_bundle, bundle_ref, write_archive

FILL_IN_MEMORY = 64 * 1024 * 1024  # archives up to this go through the program server


class ContainerWorkspace(Shielded):
    isolation = "container"

    def __init__(self, spec: WorkspaceSpec) -> None:
        self.spec = spec
        self.cfg = spec.sandbox
        self.root: Path = spec.base.resolve()  # on the host: the user's main checkout
        self.continued: str | None = spec.branch or None
        self.branch = self.continued or branch_name(spec.agent, spec.run_id)
        self.start = ""  # the commit the container starts from
        self.base_commit = ""  # the commit the artifact is measured from
        self.main: Any = None  # RepoPaths of the user's repository
        self.container_id = ""
        self._ref = ""  # the registered resource: id and token (docker.resource_ref)
        self.pooled = False
        self.uid = self.gid = 0
        self.box: Sandbox | None = None
        self._client: Any = None
        self._registered = False
        self._counted = False
        self._ready = False  # the tree is set up inside: there may be work to export
        self.live = False  # open: it may run commands; a child may start from it
        self._checkpoint_ref = ""
        self._digests: dict[str, str] = {}
        self._lock = asyncio.Lock()  # one commit + export at a time
        self._outcome: RunOutcome | None = None
        self._artifacts: list[dict[str, Any]] = []

    async def _open(self) -> None:
        await self._start()

    async def _undo(self) -> None:
        await self._close(None)

    async def _shut(self, exc_type: type[BaseException] | None) -> None:
        await self._close(RunOutcome.at_exit(self._outcome, exc_type, self.spec.description))

    async def exec(
        self, command: str, *, timeout_s: float, env: Mapping[str, str]
    ) -> ProcessResult:
        if not self.live or self.box is None:  # never run anywhere else by mistake
            raise OrchError("the container workspace is not open; use it inside `async with`")
        return await self.box.run(command, timeout_s, env)

    async def _run(self, command: str, timeout_s: float, env: Mapping[str, str]) -> ProcessResult:
        return await self.exec(command, timeout_s=timeout_s, env=env)

    def set_outcome(self, outcome: RunOutcome) -> None:
        self._outcome = outcome

    def info(self) -> dict[str, Any]:
        repo = str(self.main.main_root) if self.main else None
        saved = ContainerState(
            root=WORKSPACE,
            branch=self.branch,
            base=self.base_commit,
            start=self.start,
            repo=repo,
            continued=self.continued is not None,
            container=self.container_id[:12],
            image=self.cfg.image,
            user=f"{self.uid}:{self.gid}",
            pooled=self.pooled,
            bundle_max_bytes=self.cfg.bundle_max_bytes,
            discard=self.spec.discard,
            network=self._network(),
        )
        return saved.dump()

    def _network(self) -> str | dict[str, Any]:
        """What its commands reach: the allow-list, else Docker's network (``network_mode``)."""
        if self.spec.network.mode == "allow":
            return self.spec.network.info()
        return "none" if network_mode(self.cfg, self.spec.network) == "none" else "host"

    def artifacts(self) -> list[dict[str, Any]]:
        return [dict(a) for a in self._artifacts]

    def runtime(self) -> Runtime:
        if self.box is None:
            raise OrchError("the container workspace is not open")
        hidden = hidden_rels(self.spec, mirrored(self.root))  # the clone mirrors the user's tree
        return ContainerRuntime(self.box, self._run, WORKSPACE, hidden)

    # -- opening ------------------------------------------------------------------------

    async def _start(self) -> None:
        spec = self.spec
        self.uid, self.gid = sandbox_user(self.cfg)
        if spec.chain.containers >= self.cfg.max_per_chain:
            raise OrchError(
                f"this chain already runs {self.cfg.max_per_chain} containers "
                "(sandbox.max_per_chain); wait for one to end or raise the setting"
            )
        spec.chain.containers += 1
        self._counted = True
        located = await locate(self.root)  # not a repository: UsageError
        self.main = main = located.main()
        self.root = main.main_root
        await self._choose_start(located)
        includes_task = asyncio.create_task(self._includes())
        try:
            self._client = await asyncio.to_thread(docker_client)
            # a pool's containers have sandbox.network_mode and no way to the egress proxy
            mode = network_mode(self.cfg, spec.network)
            pooled = mode == self.cfg.network_mode and spec.egress is None
            warm = await claim_warm(self.cfg, spec.chain_id) if pooled else None
            if warm is not None:
                self.container_id, self.pooled = warm.container_id, True
                ref = resource_ref(warm.container_id, {TOKEN: warm.token})
                self._ref = sign(spec.run_id, "container", ref)
                self._register()
            else:
                labels = owner_labels(spec.run_id, spec.chain_id, spec.agent)
                self.container_id = await asyncio.to_thread(
                    create_container,
                    self._client,
                    self.cfg,
                    self.uid,
                    self.gid,
                    labels,
                    network_mode=mode,
                    egress=spec.egress,
                )
                self._ref = sign(spec.run_id, "container", resource_ref(self.container_id, labels))
                self._register()
                await asyncio.to_thread(start_container, self._client, self.container_id)
            self.box = Sandbox(self._client, self.container_id, self.cfg, f"{self.uid}:{self.gid}")
            if warm is not None:  # its program server greeted already: the fill needs no exec
                self.box.server = warm.server
            archive, staging = await includes_task
        except BaseException:
            includes_task.cancel()
            with contextlib.suppress(BaseException):
                (await includes_task)[1].remove()
            raise
        try:
            await self._fill(archive)
        finally:
            await asyncio.to_thread(staging.remove)
        if spec.egress is not None:
            await self._bridge(spec.egress)
        if self.box.server is None:  # it starts (and greets) during the model's first turn
            await asyncio.to_thread(self.box.start_server)
        self._ready = True
        self.live = True

    async def _choose_start(self, located: Any) -> None:
        main = self.main
        parent = self.spec.parent
        if self.continued is not None:
            self.start, self.base_commit = await continued_start(
                main, self.branch, self.spec.branch_base
            )
            return
        if await rev(f"refs/heads/{self.branch}", main):
            raise OrchError(
                f"branch {self.branch} already exists; merge or delete it "
                "(orch worktrees prune) and run again"
            )
        if (
            isinstance(parent, ContainerWorkspace)
            and parent.live
            and parent.main is not None
            and parent.root == main.main_root
        ):
            self._checkpoint_ref = f"refs/orch/checkpoints/{self.spec.run_id}"
            self.spec.sink.register_resource(  # a crash leaves it to reconcile
                self.spec.run_id, "checkpoint", checkpoint_resource(self._checkpoint_ref, self.root)
            )
            head: str | None = await parent.checkpoint(self._checkpoint_ref, self.spec.run_id)
        else:
            head = await rev("HEAD", located)
        if head is None:
            raise UsageError(
                f"the git repository at {main.main_root} has no commits yet; "
                "make a first commit or use isolation 'shared'"
            )
        self.start = self.base_commit = head

    async def _bridge(self, door: Door) -> None:
        """The egress bridge, started once: the container's ``127.0.0.1:3128`` to the run's
        proxy socket (the proxy variables are in the container's environment)."""
        assert self.box is not None
        try:
            await asyncio.to_thread(self.box.start_daemon, door.daemon(), b"ready\n", 30)
        except OrchError as e:
            raise OrchError(
                f"the egress bridge did not start in image {self.cfg.image} (a network "
                f"allow-list needs python3 in the image): {e}"
            ) from None

    async def _includes(self) -> tuple[Path, Staging]:
        """The archive to put into /workspace (bundle + includes), in a host temp dir."""
        staging = await asyncio.to_thread(Staging)
        try:
            bundle = await base_bundle(self.main, self.start)
            patterns = list(self.spec.include)
            never = excluded_paths(self.spec)
            tree = self.main.main_root
            files = await asyncio.to_thread(include_files, tree, patterns, never)
            keep = await untracked(self.main, sorted(files)) if files else []
            hidden = hidden_rels(self.spec, mirrored(self.root))  # a hidden file never goes in
            chosen = {rel: files[rel] for rel in keep if hidden_reason(rel, hidden) is None}
            archive = staging.path("in.tar")
            self._digests = await asyncio.to_thread(
                write_archive, archive, bundle, chosen, self.uid, self.gid
            )
        except BaseException:
            staging.remove()
            raise
        return archive, staging

    async def _fill(self, archive: Path) -> None:
        assert self.box is not None
        env = {"REF": bundle_ref(self.start), "BRANCH": self.branch}
        # a pool's container has its server greeted already: the claim needs no exec (a new
        # one's starts after the fill, off the path to the first model request)
        small = self.pooled and await asyncio.to_thread(
            lambda: archive.stat().st_size <= FILL_IN_MEMORY
        )
        data = await asyncio.to_thread(archive.read_bytes) if small else archive
        made = await self.box.call(
            ["sh", "-c", SETUP], data, out_cap=65536, timeout_s=600, env=env, via_server=small
        )  # (a larger archive streams from its file)
        if b"NEEDS" in made.out:
            raise OrchError(NEEDS)
        if b"NOT-WRITABLE" in made.out:
            raise OrchError(
                f"the sandbox user {self.uid}:{self.gid} cannot write {WORKSPACE} in image "
                f"{self.cfg.image}; check sandbox.user and the image"
            )
        if made.code != 0:
            detail = (made.err or made.out).decode("utf-8", "replace").strip().splitlines()
            raise OrchError(f"could not set up the sandbox's tree: {(detail or ['?'])[-1][:200]}")

    def _register(self) -> None:
        self.spec.sink.register_resource(self.spec.run_id, "container", self._ref)
        self._registered = True

    # -- work out -----------------------------------------------------------------------

    async def _export(self, message: str, exported: Callable[[], None] | None = None) -> str | None:
        """Commit inside and bring the work out in the same exec: the new tip, or None."""
        assert self.box is not None and self.main is not None
        async with self._lock:
            return await export_work(
                self.box,
                self.main,
                self.start,
                self.spec.agent,
                message,
                cap=self.cfg.bundle_max_bytes,
                exported=exported,
                exclude=list(self.spec.commit_exclude),
            )

    async def checkpoint(self, ref: str, child_run_id: str) -> str:
        """Commit this run's work so far and bring it out into ``ref``: a nested child's
        start. Returns the commit (the start when there is no work yet)."""
        message = commit_message(
            f"checkpoint for child run {child_run_id}", self.spec.run_id, "running"
        )
        tip = await self._export(message)
        if tip is None:
            return self.start
        await git("update-ref", ref, tip, repo=self.main)
        return tip

    async def _settle(
        self, outcome: RunOutcome, exported: Callable[[], None] | None = None
    ) -> None:
        assert self.box is not None and self.main is not None
        if self._digests:
            runtime = ContainerRuntime(self.box, self._run, WORKSPACE)
            with contextlib.suppress(OrchError, OSError, ValueError):
                await runtime.prune(self._digests)
        message = commit_message(
            outcome.description or self.spec.description, self.spec.run_id, outcome.status
        )
        tip = await self._export(message, exported)
        branch, known = self.branch, dict[str, str]()
        if tip is not None:  # moved meanwhile, or rewritten: on <branch>-head, both kept
            branch = await land(self.main, self.branch, tip, self.continued is not None)
            known = {branch: tip}
        self._artifacts = await branch_artifacts(
            self.main, [self.branch, branch], known, self.base_commit, self.start
        )

    # -- closing ------------------------------------------------------------------------

    async def _close(self, outcome: RunOutcome | None) -> None:
        self.live = False
        failure: OrchError | None = None
        removal: list[asyncio.Future[dict[str, str]]] = []

        def remove() -> None:  # once the work is out: the host imports it meanwhile
            if not removal and self.container_id and self._client is not None:
                gone = asyncio.to_thread(remove_by_id, self._client, self.container_id)
                removal.append(asyncio.ensure_future(gone))

        try:
            if self._ready and outcome is not None and self.box is not None and self.spec.discard:
                self._ready = False  # a throwaway checkout (a gate, a reviewer): nothing out
            elif self._ready and outcome is not None and self.box is not None:
                self._ready = False
                try:
                    await self._settle(outcome, remove)
                except OrchError as e:
                    failure = e
            remove()
            if removal:
                try:
                    await removal[0]
                except OrchError as e:
                    failure = failure or e
                else:
                    if self._registered:
                        self.spec.sink.release_resource(self.spec.run_id, "container", self._ref)
        finally:
            if removal and not removal[0].done():  # a non-OrchError above: still wait for it
                with contextlib.suppress(Exception):
                    await removal[0]
            await self._release()
        if failure is not None:
            raise failure

    async def _release(self) -> None:
        """What the close always does, whatever failed before: the checkpoint ref this run
        started from goes, the chain's count, the client."""
        if self.main is not None and self._checkpoint_ref:
            ref, self._checkpoint_ref = self._checkpoint_ref, ""
            gone = await git("update-ref", "-d", ref, repo=self.main, check=False)
            if gone.code == 0 or await rev(ref, self.main) is None:
                resource = checkpoint_resource(ref, self.root)
                self.spec.sink.release_resource(self.spec.run_id, "checkpoint", resource)
        if self._counted:
            self._counted = False
            self.spec.chain.containers -= 1
        if self.box is not None:
            self.box.close()
        if self._client is not None:
            self._client.close()
            self._client = None


class ContainerConfig(TierConfig):
    """``isolation: container``: the run's own branch, worked on in a locked-down Docker
    sandbox that shares no host directory."""

    type: Literal["container"] = "container"
    branch: str | None = None
    base: str | None = None
    discard: bool = False  # nothing is brought out: the container goes with its changes
    needs_git: ClassVar[bool] = True

    def provision(self, spec: WorkspaceSpec) -> ContainerWorkspace:
        return ContainerWorkspace(with_branch(spec, self.branch, self.base, self.discard))
