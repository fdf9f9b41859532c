"""Frontmatter: the YAML header of an agent or skill file, read forgivingly, with line numbers.

Real-world agent files carry unquoted colons in their descriptions; a value that
YAML refuses is retried as a quoted string (with a warning) so one odd line hides
nothing. Errors name ``path:LINE``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ..errors import OrchError

# libyaml's loader where PyYAML has it (5-10x faster: agent files are read by every run),
# the same safe construction either way
SAFE_LOADER: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

_TOP_COMMA = re.compile(r",(?![^()]*\))")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")
_KEY_LINE = re.compile(r"^([A-Za-z_][\w-]*)[ \t]*:(?:[ \t]+(.*?))?[ \t]*$")


class DefinitionError(OrchError):
    """A definition file that cannot be loaded; the message reads ``path:LINE: ...``."""

    exit_code = 2

    def __init__(self, path: Path | str, line: int, problem: str) -> None:
        self.path = str(path)
        self.line = line
        self.problem = problem
        super().__init__(f"{self.path}:{line}: {problem}")


@dataclass
class Frontmatter:
    """Frontmatter data, the file line of each top-level key, the body, parse warnings."""

    path: str
    data: dict[str, Any]
    key_lines: dict[str, int]
    body: str
    warnings: list[str]

    def line(self, key: str) -> int:
        return self.key_lines.get(key, 1)

    def error(self, key: str, problem: str) -> DefinitionError:
        return DefinitionError(self.path, self.line(key), problem)

    def opt_str(self, key: str, example: str) -> str | None:
        value = self.data.get(key)
        if value is not None and not isinstance(value, str):
            raise self.error(key, f"{key!r} must be a string, not {value!r}; e.g. {example}")
        return (value or "").strip() or None

    def req_str(self, key: str, example: str) -> str:
        if (value := self.opt_str(key, example)) is None:
            raise self.error(key, f"missing {key!r}; add a line like {example}")
        return value

    def unsupported(self, known: frozenset[str]) -> None:
        unknown = [k for k in self.data if k not in known]
        self.warnings += [f"field {k!r} is not supported yet; ignored" for k in unknown]

    def str_list(self, key: str, example: str) -> list[str] | None:
        value = self.data.get(key)
        if value is None:
            return None
        if isinstance(value, str):  # commas inside parentheses stay: "Task(a, b), Read"
            value = _TOP_COMMA.split(value)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            what = f"a comma-separated string or a list of strings, not {type(value).__name__}"
            raise self.error(key, f"{key!r} must be {what}; e.g. {example}")
        return [v.strip().strip("\"'") for v in value if v.strip().strip("\"'")]

    def check_name(self, name: str, kind: str) -> str:
        if not _NAME_RE.match(name):
            what = "letters, digits, '-', '_', '.' and ':'"
            raise self.error("name", f"{kind} name {name!r} may hold only {what}")
        return name


def _split_frontmatter(text: str, path: str) -> tuple[list[str], int, str]:
    """(frontmatter lines, file line number of the first of them, body)."""
    lines = text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n").split("\n")
    start = next((i for i, ln in enumerate(lines) if ln.strip()), len(lines))
    if start == len(lines) or lines[start].rstrip() != "---":
        fix = "start the file with '---', 'name: ...', 'description: ...', '---' lines"
        raise DefinitionError(path, min(start + 1, len(lines)), f"no YAML frontmatter; {fix}")
    for end in range(start + 1, len(lines)):
        if lines[end].rstrip() == "---":
            return lines[start + 1 : end], start + 2, "\n".join(lines[end + 1 :])
    raise DefinitionError(path, start + 1, "the frontmatter is never closed; add a '---' line")


def _plain_value_span(lines: list[str], idx: int) -> tuple[int, int] | None:
    """The top-level ``key: plain value`` entry (with continuation lines) holding ``idx``."""
    first = idx
    while first > 0 and (not lines[first].strip() or lines[first][:1] in " \t"):
        first -= 1
    m = _KEY_LINE.match(lines[first])
    if m is None or not m.group(2) or m.group(2)[0] in "\"'[{|>&*!%@`#":
        return None
    end = first + 1
    while end < len(lines) and (not lines[end].strip() or lines[end][:1] in " \t"):
        end += 1
    return first, end


def _load_yaml(fm: list[str], first_line: int, path: str) -> tuple[Any, list[str]]:
    """Parse frontmatter. A plain value YAML rejects (``description: a: b``, common in the
    wild and accepted by Claude Code) is read as text, with a warning."""
    work = list(fm)
    warnings: list[str] = []
    while True:
        try:
            return yaml.load("\n".join(work), Loader=SAFE_LOADER), warnings
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            # An error found at the very end (an unclosed quote or bracket) began earlier.
            late = mark is not None and mark.line >= len(work) - 1
            mark = (getattr(e, "context_mark", None) if late else None) or mark
            idx = max(0, min(mark.line, len(work) - 1)) if mark is not None else 0
            problem = getattr(e, "problem", None) or str(e)
            span = _plain_value_span(work, idx) if mark is not None and work else None
            if span is None:
                fix = "fix the syntax, e.g. quote values that contain ': '"
                bad = f"frontmatter is not valid YAML ({problem}); {fix}"
                raise DefinitionError(path, first_line + idx, bad) from e
            a, b = span
            m = _KEY_LINE.match(work[a])
            assert m is not None
            text = " ".join(s.strip() for s in [m.group(2), *work[a + 1 : b]] if s.strip())
            quoted = f"{m.group(1)}: {json.dumps(text, ensure_ascii=False)}"
            work[a:b] = [quoted] + [""] * (b - a - 1)  # blank lines keep the numbering
            warnings.append(
                f"line {first_line + a}: the value of {m.group(1)!r} is not valid YAML "
                f"({problem}); read as plain text (quote it to silence this warning)"
            )


def parse_frontmatter(text: str, path: str) -> Frontmatter:
    fm, first_line, body = _split_frontmatter(text, path)
    data, warnings = _load_yaml(fm, first_line, path)
    if data is None:
        raise DefinitionError(path, first_line - 1, "empty frontmatter; add name and description")
    if not isinstance(data, dict):
        bad = f"the frontmatter must be 'key: value' lines, not a {type(data).__name__}"
        raise DefinitionError(path, first_line, bad)
    lines: dict[str, int] = {}
    for i, raw in enumerate(fm):
        if m := _KEY_LINE.match(raw):
            lines.setdefault(m.group(1), first_line + i)
    return Frontmatter(path, {str(k): v for k, v in data.items()}, lines, body.strip(), warnings)
