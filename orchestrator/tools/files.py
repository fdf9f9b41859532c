"""File tools: read_file, write_file, edit_file, glob, grep.

Every path goes through ``policy.confine`` against the workspace root, so
``..``, absolute paths outside, symlinks out, symlink loops, hard links and
writes into ``.git`` or orch's control files are refused whichever tier the
workspace is. glob and grep skip what confine would refuse.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import Field

from ..policy import PathRefused, confine
from .base import Tool, ToolFailure, ToolInput, ToolOutput

if TYPE_CHECKING:
    from ..agent import RunContext

SKIP_DIRS = {".git", ".orch", "node_modules", "__pycache__", ".venv"}
MAX_GLOB = 1000
MAX_GREP = 500


def _confine(ctx: RunContext, path: str, *, write: bool) -> Path:
    try:
        return confine(ctx.workspace.root, path, write=write)
    except PathRefused as e:
        raise ToolFailure(str(e)) from e


def _rel(ctx: RunContext, path: Path) -> str:
    return path.relative_to(ctx.workspace.root.resolve()).as_posix()


def _read_text(path: Path, *, strict: bool = False) -> str:
    """A file's text; undecodable bytes become U+FFFD unless ``strict`` (edits must not)."""
    data = path.read_bytes()
    if b"\x00" in data[:8192]:
        raise ToolFailure(f"{path.name} looks binary; read_file returns text only")
    if not strict:
        return data.decode("utf-8", errors="replace")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ToolFailure(
            f"{path.name} is not valid UTF-8 (byte {e.start}); edit_file would corrupt it. "
            "Leave it, or convert it with bash (e.g. iconv) if that is intended"
        ) from None


class ReadFileInput(ToolInput):
    path: str = Field(description="File path, relative to the workspace root.")
    offset: int | None = Field(default=None, ge=1, description="First line to read (1-based).")
    limit: int | None = Field(default=None, ge=1, description="Number of lines to read.")


class ReadFileTool(Tool):
    name = "read_file"
    description = "Read a text file in the workspace. Use offset/limit for parts of large files."
    input_model = ReadFileInput
    read_only = True

    async def run(self, ctx: RunContext, args: ReadFileInput) -> ToolOutput:
        path = _confine(ctx, args.path, write=False)
        if not path.is_file():
            raise ToolFailure(f"no such file: {args.path}")
        text = await asyncio.to_thread(_read_text, path)
        ctx.evidence.note_read(_rel(ctx, path))
        if args.offset is None and args.limit is None:
            return ToolOutput(text)
        lines = text.splitlines(keepends=True)
        start = (args.offset or 1) - 1
        end = start + args.limit if args.limit else len(lines)
        note = f"[lines {start + 1}-{min(end, len(lines))} of {len(lines)}]\n"
        return ToolOutput(note + "".join(lines[start:end]))


class WriteFileInput(ToolInput):
    path: str = Field(description="File path, relative to the workspace root.")
    content: str = Field(description="The whole new content of the file.")


class WriteFileTool(Tool):
    name = "write_file"
    description = "Create or overwrite a file in the workspace with the given content."
    input_model = WriteFileInput

    async def run(self, ctx: RunContext, args: WriteFileInput) -> ToolOutput:
        path = _confine(ctx, args.path, write=True)
        if path.is_dir():
            raise ToolFailure(f"{args.path} is a directory")

        def write() -> None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(args.content, encoding="utf-8")

        await asyncio.to_thread(write)
        ctx.evidence.note_written(_rel(ctx, path))
        return ToolOutput(f"wrote {len(args.content)} characters to {_rel(ctx, path)}")


class EditFileInput(ToolInput):
    path: str = Field(description="File path, relative to the workspace root.")
    old_text: str = Field(min_length=1, description="Exact text to replace; must occur once.")
    new_text: str = Field(description="Replacement text.")


class EditFileTool(Tool):
    name = "edit_file"
    description = (
        "Replace one exact occurrence of old_text with new_text in a file. "
        "Fails if old_text occurs zero or several times: include more context to make it unique."
    )
    input_model = EditFileInput

    async def run(self, ctx: RunContext, args: EditFileInput) -> ToolOutput:
        path = _confine(ctx, args.path, write=True)
        if not path.is_file():
            raise ToolFailure(f"no such file: {args.path}")
        text = await asyncio.to_thread(_read_text, path, strict=True)
        count = text.count(args.old_text)
        if count != 1:
            raise ToolFailure(
                f"old_text occurs {count} times in {args.path}; it must occur exactly once"
            )
        new = text.replace(args.old_text, args.new_text, 1)
        await asyncio.to_thread(path.write_text, new, encoding="utf-8")
        ctx.evidence.note_written(_rel(ctx, path))
        return ToolOutput(f"edited {_rel(ctx, path)}")


def _walk(root: Path, pattern: str) -> list[Path]:
    out: list[Path] = []
    for p in sorted(root.glob(pattern)):
        rel = p.relative_to(root)
        if any(part in SKIP_DIRS for part in rel.parts):
            continue
        try:
            if not p.resolve().is_relative_to(root):
                continue  # a symlink out is never listed
        except (OSError, RuntimeError):  # RuntimeError: a symlink loop (Python 3.11)
            continue
        out.append(p)
        if len(out) > MAX_GLOB:
            break
    return out


class GlobInput(ToolInput):
    pattern: str = Field(description="Glob relative to the workspace root, e.g. 'src/**/*.py'.")


class GlobTool(Tool):
    name = "glob"
    description = "List workspace files matching a glob pattern (relative paths, sorted)."
    input_model = GlobInput
    read_only = True

    async def run(self, ctx: RunContext, args: GlobInput) -> ToolOutput:
        if Path(args.pattern).is_absolute() or ".." in Path(args.pattern).parts:
            raise ToolFailure("glob patterns must be relative to the workspace, without '..'")
        root = ctx.workspace.root.resolve()
        try:
            paths = await asyncio.to_thread(_walk, root, args.pattern)
        except (ValueError, NotImplementedError) as e:
            raise ToolFailure(f"bad glob pattern: {e}") from e
        lines = [p.relative_to(root).as_posix() for p in paths[:MAX_GLOB]]
        if len(paths) > MAX_GLOB:
            lines.append(f"[more than {MAX_GLOB} matches; narrow the pattern]")
        return ToolOutput("\n".join(lines) if lines else "no matches")


class GrepInput(ToolInput):
    pattern: str = Field(description="Python regular expression to search for.")
    path: str | None = Field(
        default=None, description="File or directory to search (default: all)."
    )
    glob: str | None = Field(
        default=None, description="Only files matching this glob, e.g. '*.py'."
    )


class GrepTool(Tool):
    name = "grep"
    description = "Search file contents with a regular expression; prints path:line: text."
    input_model = GrepInput
    read_only = True

    async def run(self, ctx: RunContext, args: GrepInput) -> ToolOutput:
        try:
            regex = re.compile(args.pattern)
        except re.error as e:
            raise ToolFailure(f"bad regular expression: {e}") from e
        root = ctx.workspace.root.resolve()
        base = _confine(ctx, args.path, write=False) if args.path else root

        def search() -> list[str]:
            if base.is_file():
                files = [base]
            else:
                files = [p for p in _walk(base, "**/" + (args.glob or "*")) if p.is_file()]
            hits: list[str] = []
            for f in files:
                try:
                    if f.stat().st_nlink > 1:
                        continue  # a hard link may be a file outside: read_file refuses it too
                    data = f.read_bytes()
                except OSError:
                    continue
                if b"\x00" in data[:8192]:
                    continue
                for n, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
                    if regex.search(line):
                        hits.append(f"{f.relative_to(root).as_posix()}:{n}: {line[:300]}")
                        if len(hits) >= MAX_GREP:
                            hits.append(f"[stopped at {MAX_GREP} matches; narrow the search]")
                            return hits
            return hits

        hits = await asyncio.to_thread(search)
        return ToolOutput("\n".join(hits) if hits else "no matches")
