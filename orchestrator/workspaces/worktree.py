"""Worktree tier: each run gets its own git checkout and branch; work comes back as a branch.

The worktree is made under ``<main repo root>/.orch/worktrees/<run_id>`` (the
main root is the directory holding the common ``.git``, even when the base is
itself a worktree of a parent run) on a new branch ``orch/<agent>/<short id>``
based on the current HEAD of ``spec.base``: the user's HEAD for a root run, the
parent's worktree HEAD for a nested child. Only committed state is carried:
uncommitted changes of the user (or of a parent run) are NOT in the new
worktree. Git-ignored or untracked files named by ``options["include"]`` and
``.worktreeinclude`` (glob patterns) are copied in; copies left unchanged are
not committed back.

The worktree is locked while the run lives. At close (also on cancellation:
the close is shielded) every uncommitted change, untracked files included, is
committed on the branch as ``orch <agent> <orch@localhost>`` with ``orch-run``
and ``orch-status`` trailers. A branch with no commits beyond its base is
deleted with its worktree; otherwise the worktree directory is removed and the
branch kept. ``git worktree add/remove`` and ``git branch -D`` are serialized
per repository (an asyncio lock and an flock on ``.orch/worktrees.lock``).

Continuing a branch: ``options["branch"]`` names an existing ``orch/*`` branch
(left by an earlier run, e.g. a writer going on after a review) to check out in
the new worktree instead of making a new one. New work is committed on it; it
is never deleted, even when the run changed nothing (nor by a salvage: only a
run's own ``orch/<agent>/<short id>`` branch is). ``options["base"]`` is the
commit its artifact is measured from (default: the branch tip, i.e. only what
this run adds).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
from collections.abc import Awaitable, Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar

from ..errors import OrchError, UsageError
from ..worktrees import (
    NOT_A_REPO,
    RETRIES,
    GitError,
    diff_stats,
    ensure_orch_dir,
    first_line,
    git,
    git_repo_root,
    git_retry,
    is_ancestor,
    lock_contention,
    main_repo_root,
    main_root_from,
    orch_dir,
    repo_lock,
    rev,
    short_run_id,
    worktree_entries,
)
from .base import ProcessResult, RunOutcome, WorkspaceSpec, run_process

T = TypeVar("T")

__all__ = ["WorktreeWorkspace", "branch_name", "git_repo_root", "salvage_worktree"]

ORCH_EMAIL = "orch@localhost"
INCLUDE_FILE = ".worktreeinclude"
_BASE_IN_REASON = re.compile(r"\(base ([0-9a-f]{7,64})\)")


# -- pure helpers -----------------------------------------------------------------------


def ref_component(name: str) -> str:
    """``name`` made safe as one component of a branch name."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip(".-")
    safe = re.sub(r"\.{2,}", ".", safe).removesuffix(".lock")
    return safe or "agent"


def branch_name(agent: str, run_id: str) -> str:
    return f"orch/{ref_component(agent)}/{short_run_id(run_id)}"


def agent_of_branch(branch: str) -> str:
    parts = branch.split("/")
    return parts[1] if len(parts) == 3 and parts[0] == "orch" else "agent"


def commit_message(description: str, run_id: str, status: str) -> str:
    return f"{description.strip() or 'orch run'}\n\norch-run: {run_id}\norch-status: {status}\n"


def commit_env(agent: str) -> dict[str, str]:
    name = f"orch {agent}"
    return {"GIT_AUTHOR_NAME": name, "GIT_AUTHOR_EMAIL": ORCH_EMAIL,
            "GIT_COMMITTER_NAME": name, "GIT_COMMITTER_EMAIL": ORCH_EMAIL}  # fmt: skip


def owns_branch(branch: str, run_id: str) -> bool:
    """True for the branch a run makes for itself (``orch/<agent>/<short id>``)."""
    parts = branch.split("/")
    return len(parts) == 3 and parts[0] == "orch" and parts[2] == short_run_id(run_id)


def lock_reason(run_id: str, base: str) -> str:
    return f"orch run {run_id} (base {base})"


async def await_shielded(aw: Awaitable[T]) -> T:
    """Run ``aw`` to completion even if the caller is cancelled meanwhile, then re-cancel."""
    task = asyncio.ensure_future(aw)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done():
                cancelled = True
        except BaseException:
            break
    if cancelled and not task.cancelled() and task.exception() is None:
        raise asyncio.CancelledError
    return task.result()


# -- filesystem helpers (blocking: run them in a thread) ---------------------------------


def _prepare(main_root: Path, base_top: Path) -> list[str]:
    """Make ``.orch`` and return the ``.worktreeinclude`` patterns of the base, if any."""
    ensure_orch_dir(main_root)
    try:
        text = (base_top / INCLUDE_FILE).read_text(errors="replace")
    except OSError:
        return []
    return [line.strip() for line in text.splitlines()]


def _include_candidates(top: Path, patterns: Iterable[str]) -> list[str]:
    """Relative paths of existing files under ``top`` matched by the glob patterns."""
    top_real = top.resolve()
    found: dict[str, None] = {}
    for raw in patterns:
        pattern = raw.strip().lstrip("/").rstrip("/")
        if not pattern or pattern.startswith("#"):
            continue
        try:
            matches = list(top.glob(pattern))
        except (ValueError, NotImplementedError):
            continue
        for match in matches:
            files = [p for p in match.rglob("*") if p.is_file()] if match.is_dir() else [match]
            for path in files:
                try:
                    rel = path.relative_to(top)
                    path.resolve().relative_to(top_real)  # skip anything resolving outside
                except (ValueError, OSError):
                    continue
                if not rel.parts or rel.parts[0] in (".git", ".orch") or ".." in rel.parts:
                    continue
                if not path.is_file():
                    continue
                found[rel.as_posix()] = None
    return list(found)


def _copy_includes(top: Path, dest_root: Path, rels: list[str]) -> dict[str, tuple[int, int]]:
    """Copy files into the new worktree; returns (size, mtime_ns) of each copy made."""
    copied: dict[str, tuple[int, int]] = {}
    dest_real = dest_root.resolve()
    for rel in rels:
        dest = dest_root / rel
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.parent.resolve().relative_to(dest_real)
            if dest.exists() or dest.is_symlink():
                continue
            shutil.copy2(top / rel, dest)
            st = dest.stat()
        except (OSError, ValueError):
            continue
        copied[rel] = (st.st_size, st.st_mtime_ns)
    return copied


def _drop_unchanged_copies(root: Path, copied: Mapping[str, tuple[int, int]]) -> None:
    """Included copies the run did not touch go away so they are not committed back."""
    for rel, (size, mtime) in copied.items():
        path = root / rel
        with contextlib.suppress(OSError):
            st = path.stat()
            if (st.st_size, st.st_mtime_ns) == (size, mtime):
                path.unlink()


def _same_path(a: Path, b: Path) -> bool:
    return a.resolve() == b.resolve()


def _discard_dir(path: Path, main_root: Path) -> None:
    if path.parent == orch_dir(main_root) / "worktrees":
        shutil.rmtree(path, ignore_errors=True)


# -- settling a worktree: commit its work, then remove it --------------------------------


async def remove_worktree(main_root: Path, path: Path, branch: str | None) -> None:
    """Unlock and remove a worktree, then delete ``branch`` when given."""
    async with repo_lock(main_root):
        await git("worktree", "unlock", str(path), cwd=main_root, check=False)
        result = await git_retry(
            "worktree", "remove", "--force", "--force", str(path), cwd=main_root, check=False
        )
        if result.code != 0:
            await asyncio.to_thread(_discard_dir, path, main_root)
            await git("worktree", "prune", cwd=main_root, check=False)
        if branch:
            await git_retry("branch", "-D", branch, cwd=main_root, check=False)


async def commit_all(root: Path, agent: str, message: str) -> bool:
    """Commit every change in the worktree at ``root``; False when there was nothing to commit."""
    top = await git("rev-parse", "--show-toplevel", cwd=root, check=False)
    if top.code != 0 or not await asyncio.to_thread(_same_path, Path(top.out.strip()), root):
        return False  # not a worktree any more: never commit some other tree by mistake
    status = await git("status", "--porcelain", "-z", "--untracked-files=all", cwd=root)
    if not status.out:
        return False
    await git_retry("add", "-A", cwd=root)
    if (await git("diff", "--cached", "--quiet", cwd=root, check=False)).code == 0:
        return False
    await git_retry(
        "-c", "commit.gpgsign=false", "-c", "core.hooksPath=/dev/null", "-c", "gc.auto=0",
        "commit", "--no-verify", "-q", "--cleanup=whitespace", "-m", message,
        cwd=root, env=commit_env(agent),
    )  # fmt: skip
    return True


async def _settle(
    main_root: Path, root: Path, branch: str, base: str, agent: str, message: str,
    keep_branch: bool = False,
) -> list[dict[str, Any]]:  # fmt: skip
    """Commit the work in ``root`` on ``branch``; remove the worktree; keep a branch with work
    (and always with ``keep_branch``: a branch the run did not create)."""
    if await asyncio.to_thread(root.is_dir):
        await commit_all(root, agent, message)
    head = await rev("HEAD", root) if await asyncio.to_thread(root.is_dir) else None
    tip = await rev(f"refs/heads/{branch}", main_root)
    extra: list[str] = []
    if head and head != tip:  # the run moved HEAD off its branch: keep what HEAD holds too
        if tip is None or await is_ancestor(main_root, tip, head):
            await git("update-ref", f"refs/heads/{branch}", head, cwd=main_root)
        elif not await is_ancestor(main_root, head, tip) and not await is_ancestor(
            main_root, head, base
        ):
            extra.append(f"{branch}-head")
            await git("update-ref", f"refs/heads/{branch}-head", head, cwd=main_root)
    artifacts: list[dict[str, Any]] = []
    for name in [branch, *extra]:
        commit = await rev(f"refs/heads/{name}", main_root)
        if commit is None:
            continue
        ahead = await git("rev-list", "--count", f"{base}..{commit}", cwd=main_root)
        if int(ahead.out.strip() or 0) == 0:
            continue
        files, ins, dels = await diff_stats(main_root, base, commit)
        artifacts.append(
            {"kind": "branch", "branch": name, "base": base, "commit": commit,
             "files_changed": files, "insertions": ins, "deletions": dels}
        )  # fmt: skip
    keep = keep_branch or any(a["branch"] == branch for a in artifacts)
    await remove_worktree(main_root, root, None if keep else branch)
    return artifacts


async def salvage_worktree(path: Path, run_id: str, status: str) -> dict[str, Any] | None:
    """Commit the leftover work of an interrupted run and remove its worktree; keep its branch.

    Returns the branch artifact, or None when there was no worktree or no work (then the
    worktree and its branch are removed). Work is never deleted.
    """
    exists = await asyncio.to_thread(path.is_dir)
    if not exists and not await asyncio.to_thread(path.parent.is_dir):
        return None
    try:
        main_root = await main_repo_root(path if exists else path.parent)
    except UsageError:
        return None
    real = await asyncio.to_thread(path.resolve)
    entries = await worktree_entries(main_root)
    same = [await asyncio.to_thread(_same_path, Path(e["worktree"]), real) for e in entries]
    entry = next((e for e, hit in zip(entries, same, strict=True) if hit), None)
    if entry is None:
        return None  # not a registered worktree: leave it alone
    branch = entry.get("branch")
    if not branch:  # detached: give its commits a branch to live on
        branch = f"orch/salvaged/{short_run_id(run_id)}"
    found = _BASE_IN_REASON.search(entry.get("locked", ""))
    base = found.group(1) if found else None
    if base is None:
        user_head = await rev("HEAD", main_root)
        tip = await rev(f"refs/heads/{branch}", main_root) or entry.get("HEAD", "")
        merge_base = await git("merge-base", user_head or "HEAD", tip, cwd=main_root, check=False)
        base = merge_base.out.strip() or tip
    agent = agent_of_branch(branch)
    message = commit_message("", run_id, status)
    keep = not owns_branch(branch, run_id)  # a continued branch is never the run's to delete
    artifacts = await _settle(main_root, real, branch, base, agent, message, keep)
    return artifacts[0] if artifacts else None


# -- the workspace ----------------------------------------------------------------------


class WorktreeWorkspace:
    isolation = "worktree"

    def __init__(self, spec: WorkspaceSpec) -> None:
        self.spec = spec
        self.base_path = spec.base.resolve()
        self.root: Path = self.base_path  # the worktree once entered
        continued = spec.options.get("branch")
        # an existing branch to go on with: checked out, committed on, never deleted
        self.continued: str | None = str(continued) if continued else None
        self.branch = self.continued or branch_name(spec.agent, spec.run_id)
        self.base_commit = ""
        self.main_root: Path | None = None
        self._outcome: RunOutcome | None = None
        self._created = False
        self._owns_branch = False
        self._copied: dict[str, tuple[int, int]] = {}
        self._artifacts: list[dict[str, Any]] = []

    async def __aenter__(self) -> Self:
        try:
            await await_shielded(self._create())
        except BaseException:
            await await_shielded(self._discard())
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        outcome = RunOutcome.at_exit(self._outcome, exc_type, self.spec.description)
        await await_shielded(self._close(outcome))

    async def exec(
        self, command: str, *, timeout_s: float, env: Mapping[str, str]
    ) -> ProcessResult:
        if not self._created:  # never run in the user's tree by mistake
            raise OrchError("the worktree workspace is not open; use it inside `async with`")
        return await run_process(
            ["bash", "-c", command], cwd=self.root, env=env, timeout_s=timeout_s,
            sink=self.spec.sink, run_id=self.spec.run_id,
        )  # fmt: skip

    def set_outcome(self, outcome: RunOutcome) -> None:
        self._outcome = outcome

    def info(self) -> dict[str, Any]:
        repo = str(self.main_root) if self.main_root else None
        return {"isolation": self.isolation, "root": str(self.root), "branch": self.branch,
                "base": self.base_commit, "repo": repo}  # fmt: skip

    def artifacts(self) -> list[dict[str, Any]]:
        return [dict(a) for a in self._artifacts]

    # -- internals ----------------------------------------------------------------------

    async def _create(self) -> None:
        spec = self.spec
        probe = await git(
            "rev-parse", "--path-format=absolute", "--git-common-dir", "--show-toplevel",
            "-q", "--verify", "HEAD^{commit}",
            cwd=self.base_path, check=False,
        )  # fmt: skip
        lines = probe.out.splitlines()
        if len(lines) < 2:
            raise UsageError(NOT_A_REPO.format(path=self.base_path))
        if probe.code != 0 or len(lines) < 3:
            raise UsageError(
                f"the git repository at {lines[1]} has no commits yet; "
                "make a first commit or use isolation 'shared'"
            )
        main_root = main_root_from(lines[0], lines[1])
        base_top, self.base_commit = Path(lines[1]), lines[2]
        if self.continued is not None:
            self.base_commit = await self._continued_base(main_root)
        self.main_root = main_root
        patterns = await asyncio.to_thread(_prepare, main_root, base_top)
        include = spec.options.get("include") or []
        patterns = [*([include] if isinstance(include, str) else include), *patterns]
        path = orch_dir(main_root) / "worktrees" / spec.run_id
        reason = lock_reason(spec.run_id, self.base_commit)
        async with repo_lock(main_root):
            await self._add(main_root, path, reason)
        self.root = path
        self._created = True
        spec.sink.register_resource(spec.run_id, "worktree", str(path))
        if patterns:
            await self._copy_includes(base_top, patterns)

    async def _continued_base(self, main_root: Path) -> str:
        """Check ``options["branch"]`` and return the commit its work is measured from."""
        branch = self.branch
        if not branch.startswith("orch/") or ".." in branch:
            raise UsageError(f"can only continue an orch/* branch, not {branch!r}")
        tip = await rev(f"refs/heads/{branch}", main_root)
        if tip is None:
            raise UsageError(f"branch {branch} does not exist; see `orch worktrees list`")
        base = self.spec.options.get("base")
        if not base:
            return tip
        commit = await rev(str(base), main_root)
        if commit is None:
            raise UsageError(f"base {base!r} for branch {branch} is not a commit")
        return commit

    async def _add(self, main_root: Path, path: Path, reason: str) -> None:
        delay = 0.05
        for attempt in range(RETRIES):
            args = ["worktree", "add", "--lock", "--reason", reason]
            # an existing branch (continued, or made by an earlier attempt that failed) is
            # checked out as it is; otherwise the branch is made here from the base
            if self.continued is not None or self._owns_branch:
                args += [str(path), self.branch]
            else:
                args += ["-b", self.branch, str(path), self.base_commit]
            result = await git(*args, cwd=main_root, check=False)
            if result.code == 0:
                self._owns_branch = self.continued is None
                return
            if self.continued is not None:
                if "already" in result.err:  # checked out (or used) by another worktree
                    raise OrchError(
                        f"branch {self.branch} is in use by another worktree "
                        f"({first_line(result.err)}); wait for that run to end"
                    )
            elif "a branch named" in result.err and not self._owns_branch:
                raise OrchError(
                    f"branch {self.branch} already exists; merge or delete it "
                    "(orch worktrees prune) and run again"
                )
            elif not self._owns_branch and await rev(f"refs/heads/{self.branch}", main_root):
                self._owns_branch = True
            if not lock_contention(result) or attempt == RETRIES - 1:
                raise GitError(f"git worktree add failed: {first_line(result.err or result.out)}")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def _copy_includes(self, base_top: Path, patterns: list[str]) -> None:
        rels = await asyncio.to_thread(_include_candidates, base_top, patterns)
        if not rels:
            return
        tracked: set[str] = set()
        for i in range(0, len(rels), 200):
            chunk = [f":(literal){r}" for r in rels[i : i + 200]]
            listed = await git("ls-files", "-z", "--", *chunk, cwd=base_top, check=False)
            tracked.update(p for p in listed.out.split("\0") if p)
        wanted = [r for r in rels if r not in tracked]
        self._copied = await asyncio.to_thread(_copy_includes, base_top, self.root, wanted)

    async def _discard(self) -> None:
        """Undo a creation that failed or was cancelled half way (there is no work yet)."""
        main_root = self.main_root
        if main_root is None:
            return
        if self._created:
            await remove_worktree(main_root, self.root, None if self.continued else self.branch)
            self.spec.sink.release_resource(self.spec.run_id, "worktree", str(self.root))
        elif self._owns_branch:
            path = orch_dir(main_root) / "worktrees" / self.spec.run_id
            await remove_worktree(main_root, path, self.branch)
        self._created = False
        self.root = self.base_path

    async def _close(self, outcome: RunOutcome) -> None:
        if not self._created or self.main_root is None:
            return
        if self._copied:
            await asyncio.to_thread(_drop_unchanged_copies, self.root, self._copied)
        message = commit_message(
            outcome.description or self.spec.description, self.spec.run_id, outcome.status
        )
        self._artifacts = await _settle(
            self.main_root, self.root, self.branch, self.base_commit,
            ref_component(self.spec.agent), message, self.continued is not None,
        )  # fmt: skip
        self._created = False
        self.spec.sink.release_resource(self.spec.run_id, "worktree", str(self.root))
