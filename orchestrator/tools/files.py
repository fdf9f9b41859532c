"""File tools: read_file, write_file, edit_file, glob, grep.

A path is checked here by its words (relative to the workspace, no ``..`` out, no
writes into ``.git`` or orch's control files), then handed to the run's
:class:`~orchestrator.workspaces.base.Runtime`, which opens it race-free beneath
the workspace root (no symlink followed, no hard link, no special file) or, in a
container, inside the sandbox. Reads are capped before any byte is loaded. The
runtime refuses the workspace's hidden paths and ``.orch/`` on the path it opens,
and its walks skip them (``workspaces/hiding.py``): every tool here goes through it.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import PurePosixPath

from pydantic import Field

from ..fs.safefs import UnsafePath
from ..policy.checks import is_control
from .base import Tool, ToolContext, ToolFailure, ToolInput, ToolOutput

MAX_GLOB = 1000
MAX_GREP = 500


def workspace_path(ctx: ToolContext, path: str, *, write: bool) -> str:
    """``path`` as a clean path relative to the workspace root, or a ToolFailure."""
    if not path or "\x00" in path:
        raise ToolFailure("empty or invalid path")
    root = str(ctx.runtime.root)
    if path.startswith("/"):
        norm = posixpath.normpath(path)
        if norm != root and not norm.startswith(root.rstrip("/") + "/"):
            raise ToolFailure(f"path {path!r} is outside the workspace ({root})")
        path = norm[len(root) :].lstrip("/")
    rel = posixpath.normpath(path)
    if rel == ".." or rel.startswith("../"):
        raise ToolFailure(f"path {path!r} resolves outside the workspace ({root})")
    parts = PurePosixPath(rel).parts
    if write and rel == ".":
        raise ToolFailure("cannot write to the workspace root itself")
    if write and any(p.lower() == ".git" for p in parts):
        raise ToolFailure(f"path {path!r} is inside .git; writes there are refused")
    if write and is_control(parts):
        raise ToolFailure(
            f"path {path!r} is an orch control file (settings, hooks, agents, skills or "
            "run state) that steers future runs; writes are refused; edit it yourself"
        )
    return rel


async def _read(ctx: ToolContext, rel: str, *, strict: bool = False) -> str:
    """A file's text; undecodable bytes become U+FFFD unless ``strict`` (edits must not)."""
    cap = ctx.settings.max_read_bytes
    try:
        got = await ctx.runtime.read_file(rel, max_bytes=cap)
    except FileNotFoundError:
        raise ToolFailure(f"no such file: {rel}") from None
    except IsADirectoryError:
        raise ToolFailure(f"{rel} is a directory; use glob to list it") from None
    except (UnsafePath, OSError) as e:
        raise ToolFailure(f"{rel}: {e}") from None
    if got.size > cap:
        raise ToolFailure(
            f"{rel} is {got.size:,} bytes, over the {cap:,}-byte read limit; read parts of it "
            "with bash (head, sed -n) or grep it"
        )
    data = got.data
    if b"\x00" in data[:8192]:
        raise ToolFailure(f"{rel} looks binary; read_file returns text only")
    if not strict:
        return data.decode("utf-8", errors="replace")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ToolFailure(
            f"{rel} is not valid UTF-8 (byte {e.start}); edit_file would corrupt it. "
            "Leave it, or convert it with bash (e.g. iconv) if that is intended"
        ) from None


async def _write(ctx: ToolContext, rel: str, text: str) -> None:
    try:
        await ctx.runtime.write_file(rel, text.encode("utf-8"))
    except IsADirectoryError:
        raise ToolFailure(f"{rel} is a directory") from None
    except (UnsafePath, OSError) as e:
        raise ToolFailure(f"{rel}: {e}") from None


class ReadFileInput(ToolInput):
    path: str = Field(description="File path, relative to the workspace root.")
    offset: int | None = Field(default=None, ge=1, description="First line to read (1-based).")
    limit: int | None = Field(default=None, ge=1, description="Number of lines to read.")


class ReadFileTool(Tool):
    name = "read_file"
    description = "Read a text file in the workspace. Use offset/limit for parts of large files."
    input_model = ReadFileInput

    async def run(self, ctx: ToolContext, args: ReadFileInput) -> ToolOutput:
        rel = workspace_path(ctx, args.path, write=False)
        text = await _read(ctx, rel)
        ctx.evidence.note_read(rel)
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
    writes = True

    async def run(self, ctx: ToolContext, args: WriteFileInput) -> ToolOutput:
        rel = workspace_path(ctx, args.path, write=True)
        await _write(ctx, rel, args.content)
        ctx.evidence.note_written(rel)
        return ToolOutput(f"wrote {len(args.content)} characters to {rel}")


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
    writes = True

    async def run(self, ctx: ToolContext, args: EditFileInput) -> ToolOutput:
        rel = workspace_path(ctx, args.path, write=True)
        text = await _read(ctx, rel, strict=True)
        count = text.count(args.old_text)
        if count != 1:
            raise ToolFailure(f"old_text occurs {count} times in {rel}; it must occur exactly once")
        await _write(ctx, rel, text.replace(args.old_text, args.new_text, 1))
        ctx.evidence.note_written(rel)
        return ToolOutput(f"edited {rel}")


class GlobInput(ToolInput):
    pattern: str = Field(description="Glob relative to the workspace root, e.g. 'src/**/*.py'.")


class GlobTool(Tool):
    name = "glob"
    description = "List workspace files matching a glob pattern (relative paths, sorted)."
    input_model = GlobInput

    async def run(self, ctx: ToolContext, args: GlobInput) -> ToolOutput:
        parts = PurePosixPath(args.pattern).parts
        if args.pattern.startswith("/") or ".." in parts or not parts:
            raise ToolFailure("glob patterns must be relative to the workspace, without '..'")
        try:
            lines, more = await ctx.runtime.glob(args.pattern, limit=MAX_GLOB)
        except UnsafePath as e:  # outside, or a hidden path named
            raise ToolFailure(str(e)) from None
        except ValueError as e:
            raise ToolFailure(f"bad glob pattern: {e}") from e
        if more:
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

    async def run(self, ctx: ToolContext, args: GrepInput) -> ToolOutput:
        try:
            re.compile(args.pattern)
        except re.error as e:
            raise ToolFailure(f"bad regular expression: {e}") from e
        rel = workspace_path(ctx, args.path, write=False) if args.path else None
        if args.glob and (args.glob.startswith("/") or ".." in PurePosixPath(args.glob).parts):
            raise ToolFailure("glob patterns must be relative to the workspace, without '..'")
        try:
            hits = await ctx.runtime.grep(
                args.pattern, path=None if rel == "." else rel, glob=args.glob, limit=MAX_GREP + 1
            )
        except (UnsafePath, OSError) as e:
            raise ToolFailure(f"{args.path}: {e}") from None
        if len(hits) > MAX_GREP:
            hits = [*hits[:MAX_GREP], f"[stopped at {MAX_GREP} matches; narrow the search]"]
        return ToolOutput("\n".join(hits) if hits else "no matches")
