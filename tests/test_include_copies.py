"""Host-side copies into a sandbox follow no link (issue 20, class 4), through the real CLI.

A repository's ``.worktreeinclude`` names a symlink to ``~/.ssh/id_rsa``, a symlinked
directory, a symlink to orch's store, ``.orch/orch.db``, the state dir where ``$ORCH_HOME``
puts it inside the repository, a ``sandbox.hidden`` path, and a directory that a thread
swaps for a symlink to ``~/.ssh`` in a loop while the copy runs. A worktree child (and a
container child) sees none of those contents, nor another run's prompt from the store; the
real listed files still arrive.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.support import git, init_repo, need_bwrap, orch, sandbox_image

SSH_KEY = "SSH-PRIVATE-KEY-" + uuid.uuid4().hex
DIR_SECRET = "OUTSIDE-DIR-SECRET-" + uuid.uuid4().hex
HIDDEN_SECRET = "HIDDEN-PATH-SECRET-" + uuid.uuid4().hex
PRIVATE_PROMPT = "PRIVATE-PROMPT-" + uuid.uuid4().hex
REAL = "REAL-LISTED-CONTENT-" + uuid.uuid4().hex

INCLUDE = """\
local.cfg
conf
key
linked
dblink
.orch/orch.db
.orch
state
private
racy
racy/id_rsa
"""

# Everything the child's workspace holds (but .git), names and contents, into a new file
# that is committed on the run's branch.
LOOK = (
    "{ find . -path ./.git -prune -o -print | sort; "
    "find . -path ./.git -prune -o -type f ! -name seen.md -print0 | xargs -0 cat; "
    "} > seen.md 2>&1; echo looked"
)


def _script(where: Path) -> Path:
    path = where / f"look-{uuid.uuid4().hex[:8]}.yaml"
    turns = [{"tool_calls": [{"tool": "bash", "input": {"command": LOOK}}]}, {"text": "looked"}]
    path.write_text(yaml.safe_dump({"conversations": [{"turns": turns}]}))
    return path


@pytest.fixture
def planted(tmp_path: Path, hermetic_git: Path) -> Path:
    """The repository with its planted links (HOME is the suite's fake one, in tmp)."""
    home = Path(os.environ["HOME"])
    (home / ".ssh").mkdir(mode=0o700)
    (home / ".ssh" / "id_rsa").write_text(SSH_KEY + "\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text(DIR_SECRET + "\n")
    repo = init_repo(tmp_path / "repo", {".worktreeinclude": INCLUDE, "README.md": "hi\n"})
    (repo / "local.cfg").write_text(REAL + "\n")
    (repo / "conf").mkdir()
    (repo / "conf" / "settings.ini").write_text(REAL + "-conf\n")
    (repo / "key").symlink_to(home / ".ssh" / "id_rsa")
    (repo / "linked").symlink_to(outside, target_is_directory=True)
    (repo / "dblink").symlink_to(".orch/orch.db")
    (repo / "private").mkdir()
    (repo / "private" / "notes.txt").write_text(HIDDEN_SECRET + "\n")
    (repo / "racy.d").mkdir()
    (repo / "racy.d" / "id_rsa").write_text("decoy\n")
    (repo / "racy.l").symlink_to(home / ".ssh", target_is_directory=True)
    (home / ".orch").mkdir(exist_ok=True)
    (home / ".orch" / "config.toml").write_text(f'[sandbox]\nhidden = ["{repo / "private"}"]\n')
    return repo


@pytest.fixture
def racing(planted: Path) -> Iterator[None]:
    """A thread swapping ``racy`` between a real directory and a symlink to ~/.ssh, each
    rename atomic, until the test ends (at most 300 s)."""
    stop = threading.Event()

    def swap() -> None:
        deadline = time.monotonic() + 300
        names = [("racy.d", "racy"), ("racy", "racy.d"), ("racy.l", "racy"), ("racy", "racy.l")]
        while not stop.is_set() and time.monotonic() < deadline:
            for src, dst in names:
                try:
                    os.rename(planted / src, planted / dst)
                except OSError:
                    pass

    thread = threading.Thread(target=swap, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)


def _seen(repo: Path, tier: str, env: dict[str, str]) -> str:
    """What a run of ``tier`` found in its workspace (its committed seen.md)."""
    secret = orch("task", "--isolation", "shared", "--model", f"scripted:{_script(repo.parent)}",
                  PRIVATE_PROMPT, cwd=repo, env=env, timeout=120)  # fmt: skip
    assert secret.returncode == 0, secret.stderr  # another run's prompt is in the store now
    got = orch("task", "--isolation", tier, "--json", "--model",
               f"scripted:{_script(repo.parent)}", "look around", cwd=repo, env=env,
               timeout=240)  # fmt: skip
    assert got.returncode == 0, got.stderr
    run_id = json.loads(got.stdout)["run_id"]
    result = json.loads(orch("result", run_id, "--json", cwd=repo, env=env).stdout)
    assert result["status"] == "succeeded", result
    (art,) = result["artifacts"]
    return git(repo, "show", f"{art['branch']}:seen.md")


def _check(seen: str) -> None:
    for secret in (SSH_KEY, DIR_SECRET, HIDDEN_SECRET, PRIVATE_PROMPT, "SQLite format"):
        assert secret not in seen, seen
    names = seen.split("\n")
    for name in ("./key", "./linked", "./dblink", "./.orch/orch.db", "./state", "./private"):
        assert not any(n == name or n.startswith(name + "/") for n in names), seen
    assert REAL in seen and f"{REAL}-conf" in seen  # the real listed files arrived
    assert "./local.cfg" in names and "./conf/settings.ini" in names


STATE_HOMES = [pytest.param(False, id="store-in-.orch"), pytest.param(True, id="ORCH_HOME-in-repo")]


@pytest.mark.bwrap
@pytest.mark.parametrize("orch_home_inside", STATE_HOMES)
def test_a_worktree_child_gets_no_linked_racy_hidden_or_store_file(
    planted: Path, racing: None, orch_home_inside: bool
) -> None:
    need_bwrap()
    env = {"ORCH_HOME": str(planted / "state")} if orch_home_inside else {}
    _check(_seen(planted, "worktree", env))


@pytest.mark.docker
@pytest.mark.parametrize("orch_home_inside", STATE_HOMES)
def test_a_container_child_gets_no_linked_racy_hidden_or_store_file(
    planted: Path, racing: None, orch_home_inside: bool
) -> None:
    sandbox_image()
    env = {"ORCH_HOME": str(planted / "state")} if orch_home_inside else {}
    _check(_seen(planted, "container", env))
