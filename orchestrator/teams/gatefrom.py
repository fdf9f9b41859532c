"""``gate_from``: whose tests a team's gate runs. With ``"candidate"`` the gate runs on the
writer's branch as it is, tests included: a writer that edits a test (or a ``conftest.py``
that ends pytest with 0) passes. With ``"base"`` (the default, unless the repository is
trusted: ``orch trust``) it runs on a commit orch makes on the host, never checked out:
the candidate's tree with every *test path* put back as the base has it (a test file the
writer added is left out, one it deleted or changed is the base's again).

Test paths (:func:`is_test_path`, :func:`config_changed`), the line drawn: what decides
whether the gate passes, rather than the code under test:

- test files and directories: any part named ``test``, ``tests``, ``testing``, ``__tests__``,
  ``spec``, ``specs``, ``e2e``, ``testdata``; names ``test_*.py``, ``*_test.py``,
  ``*_tests.py``, ``conftest.py``, ``*_test.go``, ``*_spec.rb``, ``*.test.*``, ``*.spec.*``,
  ``*Test.java``/``*Tests.java``/``*Test.kt``;
- the configuration of test runners, coverage, type checkers and linters (:data:`CONFIG_NAMES`,
  :data:`CONFIG_PREFIXES`): ``pytest.ini``, ``tox.ini``, ``noxfile.py``, ``.coveragerc``,
  ``mypy.ini``, ``ruff.toml``, ``jest.config.*``, ``vitest.config.*``, ``tsconfig*.json``...;
- modules that would shadow the runner itself (``pytest.py``, ``_pytest/``, ``unittest/``,
  ``node_modules/``);
- shared manifests, whole, when their test sections changed (:data:`CONFIG_KEYS`:
  ``pyproject.toml``'s ``tool.pytest``/``tool.coverage``/``tool.mypy``..., ``package.json``'s
  ``scripts`` and runner keys, ``setup.cfg``'s ``[tool:pytest]``/``[coverage:*]``...);
- what the gate command names: a relative path among its words (``sh ci/check.sh``), and
  the file of a task runner it calls (``make``: ``Makefile``; ``npm``/``yarn``/``pnpm``:
  ``package.json``; ``tox``, ``nox``, ``just``, ``task``).

Left as the candidate's: the code under test. Code a test imports runs in the test's
process and can still end it early (``atexit`` + ``os._exit(0)`` in a module): the gate
narrows what a writer can talk round; the reviewers read the rest.
"""

from __future__ import annotations

import asyncio
import configparser
import contextlib
import fnmatch
import hashlib
import json
import os
import posixpath
import shlex
import tempfile
import tomllib
import zlib
from typing import Any, Literal

from ..errors import OrchError
from ..project.git import RepoPaths, git
from ..workspaces.settle import commit_env

GateFrom = Literal["base", "candidate"]

TEST_DIRS = frozenset(["test", "tests", "testing", "__tests__", "spec", "specs", "e2e", "testdata"])
TEST_GLOBS = (
    "test_*.py",
    "*_test.py",
    "*_tests.py",
    "*_test.go",
    "*_spec.rb",
    "*.test.*",
    "*.spec.*",
    "*test.java",
    "*tests.java",
    "*test.kt",
)
CONFIG_NAMES = frozenset(
    [
        "conftest.py",
        "pytest.ini",
        ".pytest.ini",
        "tox.ini",
        "noxfile.py",
        ".coveragerc",
        "mypy.ini",
        ".mypy.ini",
        "ruff.toml",
        ".ruff.toml",
        ".flake8",
        ".pylintrc",
        "pylintrc",
        "pyrightconfig.json",
        "phpunit.xml",
        "phpunit.xml.dist",
        "biome.json",
        ".nycrc",
        ".nycrc.json",
        # modules that would shadow the runner
        "pytest.py",
        "py.py",
        "unittest.py",
        "pytest",
        "_pytest",
        "unittest",
        "pluggy",
        "node_modules",
    ]
)
CONFIG_PREFIXES = (
    "jest.config.",
    "vitest.config.",
    "vitest.workspace.",
    "karma.conf.",
    "playwright.config.",
    "cypress.config.",
    ".mocharc",
    "babel.config.",
    ".babelrc",
    "tsconfig",
    ".eslintrc",
    "eslint.config.",
)
CONFIG_KEYS: dict[str, tuple[str, ...]] = {
    "pyproject.toml": (
        "tool.pytest",
        "tool.coverage",
        "tool.tox",
        "tool.mypy",
        "tool.ruff",
        "tool.pylint",
        "tool.pyright",
        "tool.hatch.envs",
        "tool.pdm.scripts",
        "tool.poe",
        "tool.nox",
    ),
    "package.json": (
        "scripts",
        "jest",
        "mocha",
        "ava",
        "vitest",
        "nyc",
        "c8",
        "eslintConfig",
        "babel",
    ),
    "setup.cfg": ("tool:pytest", "coverage:", "mypy", "flake8", "pylint"),
}
RUNNER_FILES = {
    "make": ("Makefile", "makefile", "GNUmakefile"),
    "npm": ("package.json",),
    "npx": ("package.json",),
    "yarn": ("package.json",),
    "pnpm": ("package.json",),
    "bun": ("package.json", "bunfig.toml"),
    "tox": ("tox.ini",),
    "nox": ("noxfile.py",),
    "just": ("justfile", "Justfile", ".justfile"),
    "task": ("Taskfile.yml", "Taskfile.yaml"),
}

Entry = tuple[str, str, str]  # (mode, type, object id)
Tree = dict[str, Entry]


def is_test_path(path: str) -> bool:
    """A test file, a test directory's content, or a test runner's configuration (by name;
    shared manifests are judged by :func:`config_changed`)."""
    parts = path.split("/")
    if any(p.casefold() in TEST_DIRS or p in CONFIG_NAMES for p in parts):
        return True
    name = parts[-1].casefold()
    return name.startswith(CONFIG_PREFIXES) or any(fnmatch.fnmatch(name, g) for g in TEST_GLOBS)


def _sections(kind: str, text: str | None) -> dict[str, Any] | None:
    if text is None:
        return {}
    try:
        if kind == "setup.cfg":
            cfg = configparser.RawConfigParser(strict=False, interpolation=None)
            cfg.read_string(text)
            return {s: dict(cfg[s]) for s in cfg.sections()}
        value = tomllib.loads(text) if kind.endswith(".toml") else json.loads(text)
    except (ValueError, configparser.Error, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _pick(data: dict[str, Any], kind: str, key: str) -> Any:
    if kind == "setup.cfg":  # a section, or every section with this prefix
        return {
            s: v for s, v in data.items() if s == key or key.endswith(":") and s.startswith(key)
        }
    value: Any = data
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def config_changed(path: str, old: str | None, new: str | None) -> bool:
    """Whether a shared manifest's test sections differ (one that does not parse: yes)."""
    kind = posixpath.basename(path)
    if kind not in CONFIG_KEYS:
        return False
    before, after = _sections(kind, old), _sections(kind, new)
    if before is None or after is None:
        return True
    return any(_pick(before, kind, k) != _pick(after, kind, k) for k in CONFIG_KEYS[kind])


INTERPRETERS = frozenset(
    [
        "sh",
        "bash",
        "dash",
        "zsh",
        "python",
        "python3",
        "node",
        "deno",
        "bun",
        "ruby",
        "perl",
        "php",
        "tclsh",
    ]
)


def named_by(command: str, paths: set[str]) -> set[str]:
    """The files of ``paths`` the gate command runs: a command word that is one of them
    (``./ci/check.sh``), the script an interpreter is given (``sh ci/check.sh``,
    ``python tools/run_tests.py``), and the files of the task runners it calls (``make``:
    ``Makefile``...). A file it only reads (``grep -q x calc.py``) is the code under test."""
    try:
        lexer = shlex.shlex(command, posix=True, punctuation_chars=";&|()")
        lexer.whitespace_split = True
        words = list(lexer)
    except ValueError:
        words = command.split()
    found: set[str] = set()
    simple: list[str] = []
    for word in [*words, ";"]:
        if word and set(word) <= set(";&|()"):
            found |= _runs(simple, paths)
            simple = []
        elif not (not simple and "=" in word and not word.startswith(("=", "/", "."))):
            simple.append(word)  # (an assignment before the command is skipped)
    return found


def _runs(words: list[str], paths: set[str]) -> set[str]:
    if not words:
        return set()
    first, found = words[0], set()
    if first in ("env", "exec", "time", "nice", "timeout", "xargs") and len(words) > 1:
        rest = words[1:]
        if first == "timeout":
            rest = [w for w in rest if not w.startswith("-")][1:]
        return _runs(rest, paths)
    rel = posixpath.normpath(first.removeprefix("./"))
    if rel in paths:
        found.add(rel)
    name = posixpath.basename(first)
    found.update(f for f in RUNNER_FILES.get(name, ()) if f in paths)
    if name.rstrip("0123456789.") in INTERPRETERS:
        args = [w for w in words[1:] if not w.startswith("-")]
        if args and "-m" not in words and "-c" not in words:
            script = posixpath.normpath(args[0].removeprefix("./"))
            if script in paths:
                found.add(script)
    return found


# -- the gate's commit --------------------------------------------------------------------


async def _tree(repo: RepoPaths, rev: str, *, recursive: bool = True) -> Tree:
    args = ["ls-tree", "-z", "--full-tree", *(["-r"] if recursive else []), rev]
    out = (await git(*args, repo=repo)).out
    entries: Tree = {}
    for line in out.split("\0"):
        head, sep, path = line.partition("\t")
        fields = head.split()
        if sep and len(fields) == 3:
            entries[path] = (fields[0], fields[1], fields[2])
    return entries


async def _text(repo: RepoPaths, entry: Entry | None) -> str | None:
    if entry is None or entry[1] != "blob":
        return None
    return (await git("cat-file", "blob", entry[2], repo=repo)).out


async def swapped(
    repo: RepoPaths, base: str, candidate: str, command: str
) -> dict[str, Entry | None]:
    """The test paths whose candidate version differs from the base's, each with what the
    gate gets there: the base's entry, or None (the candidate added it)."""
    before, after = await _tree(repo, base), await _tree(repo, candidate)
    named = named_by(command, set(before) | set(after))
    out: dict[str, Entry | None] = {}
    for path in sorted(set(before) | set(after)):
        old, new = before.get(path), after.get(path)
        if old == new:
            continue
        if is_test_path(path) or path in named:
            out[path] = old
        elif posixpath.basename(path) in CONFIG_KEYS and config_changed(
            path, await _text(repo, old), await _text(repo, new)
        ):
            out[path] = old
    return out


def _store_tree(repo: RepoPaths, entries: Tree, hexlen: int) -> str:
    """Write a tree object as git does (a loose object in the repository's object store,
    written whole then renamed into place); its id."""
    items = []
    for name, (mode, kind, oid) in entries.items():
        if "\ufffd" in name:
            raise OrchError(f"cannot build the gate's commit: {name!r} is not a UTF-8 file name")
        items.append((name + "/" if kind == "tree" else name, name, mode.lstrip("0"), oid))
    body = b"".join(
        f"{mode} {name}".encode() + b"\0" + bytes.fromhex(oid)
        for _, name, mode, oid in sorted(items, key=lambda i: i[0].encode())
    )
    raw = b"tree %d\0" % len(body) + body
    oid = hashlib.new("sha256" if hexlen == 64 else "sha1", raw).hexdigest()
    folder = repo.common_dir / "objects" / oid[:2]
    target = folder / oid[2:]
    if target.exists():
        return oid
    folder.mkdir(mode=0o755, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="tmp_obj_", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(zlib.compress(raw))
        os.chmod(tmp, 0o444)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return oid


async def _rebuild(
    repo: RepoPaths, tree: str | None, changes: dict[str, Entry | None], hexlen: int
) -> str | None:
    """``tree`` (None: none) with ``changes`` (paths relative to it) made; None: empty."""
    entries = await _tree(repo, tree, recursive=False) if tree else {}
    deeper: dict[str, dict[str, Entry | None]] = {}
    for path, entry in changes.items():
        head, sep, rest = path.partition("/")
        if sep:
            deeper.setdefault(head, {})[rest] = entry
        elif entry is None:
            entries.pop(head, None)
        else:
            entries[head] = entry
    for name, below in deeper.items():
        old = entries.get(name)
        sub = await _rebuild(repo, old[2] if old and old[1] == "tree" else None, below, hexlen)
        if sub is None:
            entries.pop(name, None)
        else:
            entries[name] = ("040000", "tree", sub)
    if not entries:
        return None
    return await asyncio.to_thread(_store_tree, repo, entries, hexlen)


async def gate_commit(
    repo: RepoPaths, base: str, candidate: str, command: str
) -> tuple[str, list[str]]:
    """The commit the gate runs on with ``gate_from = "base"``: ``candidate`` with its test
    paths as the base has them (``candidate`` itself when it changed none), and those paths.
    The commit is made on the host from git objects (nothing checked out, no index)."""
    changes = await swapped(repo, base, candidate, command)
    if not changes:
        return candidate, []
    root = (await git("rev-parse", f"{candidate}^{{tree}}", repo=repo)).out.strip()
    hexlen = len(root)
    tree = await _rebuild(repo, root, changes, hexlen)
    if tree is None:  # every file was a test path the base does not have
        tree = await asyncio.to_thread(_store_tree, repo, {}, hexlen)
    message = f"orch gate: the base's tests ({base[:12]}) on {candidate[:12]}"
    made = await git(
        "commit-tree", tree, "-p", candidate, "-m", message, repo=repo, identity=commit_env("team")
    )
    return made.out.strip(), sorted(changes)
