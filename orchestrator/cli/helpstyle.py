"""Help in Typer's classic look (``--json`` alone, ``--agent TEXT``, ``[shared|worktree|...]``),
and a mistyped command line answered in one line.

Typer 0.2x prints every parameter's Python type instead (``--json <bool>``,
``<list[Path]>``, a required argument as ``{prompt}``): ``TyperArgument.display_type``
and ``_usage_display_name`` in ``typer/core.py``, with no setting to turn it off. The root
group (``OrchGroup``, ``typer.Typer(cls=OrchGroup)``) gives every parameter of every command
below it, at any depth, the classic rendering when the CLI is built, so a new command needs
nothing to look like the others. It leans on those two methods: pyproject.toml pins the
Typer it was written for, and tests/test_help.py renders every command's help.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, get_args

import typer
from typer._click.exceptions import NoArgsIsHelpError, UsageError
from typer.core import TyperArgument, TyperGroup, TyperOption

from .common import fail

_NAMES: dict[Any, str] = {str: "TEXT", int: "INTEGER", float: "FLOAT", bool: "BOOLEAN"}


def classic_type(param: TyperArgument | TyperOption, ctx: Any) -> str | None:
    """The value placeholder click has always shown: none for a flag, ``TEXT``,
    ``INTEGER RANGE``, ``PATH``, ``[a|b|c]`` for choices; a metavar given wins."""
    if param.metavar is not None:  # an argument shows it as its name already
        return None if isinstance(param, TyperArgument) else param.metavar
    if isinstance(param, TyperOption) and (param.is_flag or param.count):
        return None
    desc = param.type_descriptor
    if desc.is_choice:  # Typer's own "<a|b>" (or "<list[a|b]>"), choices as the user types them
        inner = param.display_type(ctx).strip("<>")
        return "[" + inner.removeprefix("list[").removesuffix("]") + "]"
    annotation = desc.annotation
    if desc.is_list and get_args(annotation):
        annotation = get_args(annotation)[0]
    if desc.is_path or (isinstance(annotation, type) and issubclass(annotation, Path)):
        return "PATH"
    name = _NAMES.get(annotation) or getattr(annotation, "__name__", "VALUE").upper()
    return f"{name} RANGE" if desc.is_ranged else name


class ClassicArgument(TyperArgument):
    def display_type_rich(self, ctx: Any) -> str | None:
        return classic_type(self, ctx)

    def _usage_display_name(self) -> str:
        name = self.metavar or (self.name or "").upper()
        name = name if self.required else f"[{name}]"
        return name + ("..." if self.nargs != 1 else "")


class ClassicOption(TyperOption):
    def display_type_rich(self, ctx: Any) -> str | None:
        shown = classic_type(self, ctx)
        return f"{shown}..." if shown and self.nargs != 1 else shown


def restyle(command: Any) -> None:
    """Give ``command`` (and every command below it) the classic rendering."""
    help_option = command.get_help_option(typer.Context(command))  # made now, and kept
    for param in [*command.params, help_option]:
        if type(param) is TyperArgument:
            param.__class__ = ClassicArgument  # same object and state, other rendering
        elif type(param) is TyperOption:
            param.__class__ = ClassicOption
    for sub in getattr(command, "commands", {}).values():
        restyle(sub)


def usage_line(e: UsageError) -> str:
    """A usage error as one line that says where help is (Typer draws a box of many)."""
    message = e.format_message().replace("Value error, ", "").rstrip(".")
    where = e.ctx.command_path if e.ctx is not None else "orch"
    return f"{message[:1].lower()}{message[1:]}; see `{where} --help`"


class OrchGroup(TyperGroup):
    """The root group: builds as Typer's, then restyles the help of everything below it;
    a bad option or argument of any command below it is one line on stderr and exit 2."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        restyle(self)

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        with one_line_usage_errors():  # `orch --bogus`
            return super().parse_args(ctx, args)

    def invoke(self, ctx: Any) -> Any:
        with one_line_usage_errors():  # everything below: `orch task --isolation vm`, ...
            return super().invoke(ctx)


@contextmanager
def one_line_usage_errors() -> Iterator[None]:
    try:
        yield
    except NoArgsIsHelpError:  # a group called bare: its help, as Typer shows it
        raise
    except UsageError as e:
        raise fail(usage_line(e), 2) from None
