"""Whose a definition is, the user's or the repository's: one rule for agents, skills, teams
and MCP declarations, and the one way the repository's files of them are read.

**A directory** of definitions is the repository's when

- the repository's settings name it (an ``agents_dirs`` entry of its ``orch.toml`` that the
  user's own settings do not name), **wherever it points**: ``/proc/self/cwd/...``,
  ``/proc/<pid>/root/...``, ``..``, a bind or a link are not looked through, the name is
  enough;
- it lies in the project, by its path as written or by its real path (every link followed
  by the kernel), or its real path cannot be found (fail closed);
- it is the project's own: ``.orch/agents``, ``.claude/agents``, ``.orch/skills``,
  ``.claude/skills`` (team files, ``.orch/teams``, and ``.mcp.json`` are only ever read
  from the project: always the repository's).

**A file** is the repository's when the directory it was found in is, or its own real path
lies in the project (``~/.orch/agents/x.md`` linking into the checkout). Everything else
(``--agents-dir``, the user's ``~/.orch/config.toml``, ``~/.orch/agents``, ``~/.orch/skills``,
``~/.orch/mcp.json``, bundled) is the user's. Trust floors (``agent_trust.py``), the user's
MCP servers (``engine/mcptools.py``: never offered to a repository agent or anything below
it) and ``orch agents validate`` (``mcpcheck.py``) all ask :class:`Owners`.

**Reading**: the repository's agent and skill files, and their directories, are read beneath
the project's real root through :mod:`orchestrator.fs.safefs` (:meth:`Owners.read`): a link
is followed only while it stays in the project and leads to no hidden path (``.orch/`` but
the catalog's own ``.orch/agents``, ``.orch/skills``; ``sandbox.hidden``; the usual secrets;
the state directory), and the file then opened is that very path with no link followed, a
regular file with one link, capped, as memory files, team files and ``.mcp.json`` are.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, Self, TypeVar

from ..fs.realpath import resolved
from ..fs.safefs import Beneath, UnsafePath
from .frontmatter import DefinitionError

if TYPE_CHECKING:
    from ..trust import Trust

MAX_FILE_BYTES = 256 * 1024  # an agent or skill file of the repository's
STATE_NAME = ".orch"
# the .orch paths the catalog itself reads (every other .orch path is hidden)
CATALOG_DIRS = frozenset({(STATE_NAME, "agents"), (STATE_NAME, "skills")})
_HOW = "a repository's agent and skill files are read only inside it"
SKIP = re.compile(r"^((?i:readme\.md)|LICENSE.*|\..*)$")  # not license-engineer.md


class Definition(Protocol):
    """An agent or skill definition (pydantic models of ``definitions.py``)."""

    name: str

    def model_copy(
        self, *, update: Mapping[str, Any] | None = None, deep: bool = False
    ) -> Self: ...


_D = TypeVar("_D", bound=Definition)


def _fold(parts: Iterable[str]) -> tuple[str, ...]:
    return tuple(p.casefold() for p in parts if p not in ("", "."))


def hidden_for_catalog(rel: str, hidden: Sequence[str]) -> bool:
    """Whether the project-relative ``rel`` is (or is below) a path no definition may be
    read from: ``hiding.hidden_reason``'s rule, but the catalog's own ``.orch`` dirs."""
    parts = _fold(rel.split("/"))
    own = parts[:2] in CATALOG_DIRS
    if STATE_NAME in (parts[2:] if own else parts):
        return True
    for entry in hidden:
        h = _fold(entry.split("/"))
        if h and h != (STATE_NAME,) and parts[: len(h)] == h:
            return True
    return False


@dataclass(frozen=True)
class Owners:
    """The ownership rule for one project (see the module's doc)."""

    root: Path | None = None  # the project, absolute
    real: Path | None = None  # its real path
    named: frozenset[Path] = frozenset()  # directories the repository's settings name
    hidden: tuple[str, ...] = ()  # project-relative paths no definition may be read from

    @classmethod
    def of(
        cls,
        root: Path | None,
        named: Iterable[Path] = (),
        hidden_entries: Sequence[str] = (),
    ) -> Owners:
        """``named``: directories the repository's settings name (made absolute from
        ``root``); ``hidden_entries``: ``sandbox.hidden``."""
        if root is None:
            return cls()
        from ..workspaces.hiding import hidden_within

        absolute = Path(os.path.abspath(root))
        real = resolved(absolute) or absolute
        hidden = hidden_within([real], hidden_entries, os.environ.get("ORCH_HOME"))
        mine = frozenset(Path(os.path.abspath(absolute / Path(d).expanduser())) for d in named)
        return cls(absolute, real, mine, hidden)

    @classmethod
    def for_trust(
        cls, root: Path | None, trust: Trust | None, hidden_entries: Sequence[str] = ()
    ) -> Owners:
        """The rule with the directories ``trust`` says the repository's settings name."""
        named = [Path(d) for d in trust.agents_dirs] if trust is not None else []
        return cls.of(root, named, hidden_entries)

    def inside(self, path: Path | str) -> bool:
        """``path`` lies in the project, as written or by its real path (or cannot be
        found: the repository's, its files get no say over the user's)."""
        if self.root is None or self.real is None:
            return False
        absolute = Path(os.path.abspath(path))
        if absolute.is_relative_to(self.root) or absolute.is_relative_to(self.real):
            return True
        real = resolved(absolute)
        if real is None:
            return os.path.lexists(absolute)  # there, but it cannot be resolved
        return real.is_relative_to(self.real)

    def repository_dir(self, directory: Path | str) -> bool:
        """Whether the definitions of ``directory`` are the repository's."""
        if self.root is None:
            return False
        return Path(os.path.abspath(directory)) in self.named or self.inside(directory)

    def _beneath(self, path: Path | str, what: str) -> str:
        """``path``'s real path relative to the project's real root; DefinitionError when
        it leads out of the project or to a hidden path."""
        assert self.real is not None
        found = resolved(path)
        if found is None:
            raise DefinitionError(Path(path), 1, f"cannot read the {what}: it is not there")
        if found != self.real and not found.is_relative_to(self.real):
            raise DefinitionError(
                Path(path), 1, f"the {what} leads outside the project (to {found}); {_HOW}"
            )
        rel = "" if found == self.real else found.relative_to(self.real).as_posix()
        if rel and hidden_for_catalog(rel, self.hidden):
            raise DefinitionError(
                Path(path), 1, f"the {what} leads to {rel!r}, hidden from agents; {_HOW}"
            )
        return rel

    def listing(self, directory: Path) -> list[str]:
        """The names in the repository's ``directory`` (sorted); DefinitionError when it
        leads out of the project or to a hidden path."""
        if self.real is None:
            raise DefinitionError(directory, 1, f"no project to read it in; {_HOW}")
        rel = self._beneath(directory, "directory")
        try:  # names only: each file is then read by ``read``, which checks it again
            return sorted(os.listdir(self.real / rel))
        except OSError as e:
            raise DefinitionError(directory, 1, f"cannot list the directory ({e})") from None

    def read(self, path: Path) -> str:
        """The text of the repository's file ``path``, read beneath the project (see the
        module's doc); DefinitionError with one line when it may not or cannot be."""
        if self.real is None:
            raise DefinitionError(path, 1, f"no project to read it in; {_HOW}")
        rel = self._beneath(path, "file")
        try:
            with Beneath(self.real) as fs:
                data, size = fs.read(rel, MAX_FILE_BYTES)
        except (OSError, UnsafePath) as e:
            raise DefinitionError(path, 1, f"cannot read the file ({e})") from None
        if size > MAX_FILE_BYTES:
            raise DefinitionError(
                path, 1, f"{size:,} bytes, over the {MAX_FILE_BYTES:,} a definition may be"
            )
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DefinitionError(path, 1, f"cannot read the file as UTF-8 text ({e})") from None


def read_text(path: Path) -> str:
    """A file of the user's (a link there is the user's choice), as UTF-8 text."""
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DefinitionError(path, 1, f"cannot read the file as UTF-8 text ({e})") from e


def found_in(
    kind: Literal["agents", "skills"],
    directory: Path,
    owners: Owners,
    parse: Callable[[str, Path, str | None], _D],
    errors: list[DefinitionError],
    bundled: Path | None = None,
) -> list[tuple[Path, _D]] | None:
    """The definitions of ``directory`` in name order (a file that does not load: in
    ``errors``); an agent or skill of the repository's (``owner.py``) says so. The repository's
    files, and the repository's directory, are read beneath the project (``Owners.read``);
    None when the directory may not be read (why: in ``errors``)."""
    theirs = owners.repository_dir(directory)
    try:
        names = owners.listing(directory) if theirs else sorted(os.listdir(directory))
    except DefinitionError as e:
        errors.append(e)
        return None
    except OSError:
        return None
    if kind == "agents":
        paths = [directory / n for n in names if n.endswith(".md") and not SKIP.match(n)]
    else:
        paths = [directory / n / "SKILL.md" for n in names if not n.startswith(".")]
    out: list[tuple[Path, _D]] = []
    for path in (p for p in paths if p.is_file()):
        label = path.stem if kind == "agents" else path.parent.name
        mine = theirs or owners.inside(path)
        try:
            text = owners.read(path) if mine else read_text(path)
            d = parse(text, path, f"bundled:{label}" if directory == bundled else None)
        except DefinitionError as e:
            errors.append(e)
            continue
        out.append((path, d.model_copy(update={"repository": True}) if mine else d))
    return out


def first_of_each_name(
    kind: Literal["agents", "skills"],
    dirs: Iterable[Path],
    owners: Owners,
    parse: Callable[[str, Path, str | None], _D],
    bundled: Path | None = None,
) -> list[tuple[Path, _D]]:
    """Each directory in the catalog's order, once, and in it the first file of each name
    (a file that does not load, or a directory that may not be read: the catalog reports
    it). Trust floors compare what these give with what the catalog kept."""
    out: list[tuple[Path, _D]] = []
    seen: set[Path] = set()
    for directory in dirs:
        if not directory.is_dir() or directory.resolve() in seen:
            continue
        loaded = found_in(kind, directory, owners, parse, [], bundled)
        if loaded is None:
            continue
        seen.add(directory.resolve())
        here: set[str] = set()
        for path, d in loaded:
            if d.name not in here:
                here.add(d.name)
                out.append((path, d))
    return out
