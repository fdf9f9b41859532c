"""Tables that fit the terminal: one line a row at any width, cells cut with ``…``.

A :class:`Column` says how it gives way when the width is short: ``flex`` columns
(descriptions, activities) shrink first, down to ``least`` cells; then columns with a
``drop`` rank leave, highest rank first; then every column is cut, widest first. Cells
are :class:`rich.text.Text` that never wrap, so no row ever takes two lines. The table
is laid out when it is rendered, at the width it is given then (a live view follows the
terminal's size).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from rich import box
from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text

from .safe import shown

FLEX_FLOOR = 4  # a flex column keeps this many cells before fixed columns are cut
GAP = 2  # cells between two columns (a divider and one padding: collapse_padding)


@dataclass(frozen=True)
class Column:
    header: str
    justify: Literal["left", "right"] = "left"
    flex: bool = False  # shrinks first
    least: int = 8  # a flex column keeps this many cells before other columns go
    drop: int = 0  # 0: stays; otherwise leaves when short of width, highest first


def cell(value: object, style: str = "") -> Text:
    """A table cell of untrusted text: controls written out, one line, cut with ``…``."""
    return Text(shown(value), style=style, no_wrap=True, overflow="ellipsis")


def one_line(text: Text) -> Text:
    """``text`` as a cell: one line, cut with ``…``."""
    text.no_wrap, text.overflow = True, "ellipsis"
    return text


def _fill(budget: int, wants: list[int]) -> list[int]:
    """Share ``budget`` cells between columns wanting ``wants``: equal shares, none given
    more than it wants, what one leaves going to the others."""
    got = [0] * len(wants)
    open_ = [i for i, w in enumerate(wants) if w > 0]
    while open_ and budget > 0:
        share = max(1, budget // len(open_))
        for i in list(open_):
            give = min(share, wants[i] - got[i], budget)
            got[i] += give
            budget -= give
            if got[i] >= wants[i]:
                open_.remove(i)
            if budget == 0:
                break
    return got


def _cut_widest(widths: dict[int, int], excess: int, floor: int) -> int:
    """Take up to ``excess`` cells off ``widths`` (in place), one at a time from the widest
    column, none below ``floor``; returns what is still in excess."""
    while excess > 0 and widths and max(widths.values()) > floor:
        i = max(widths, key=lambda k: widths[k])
        widths[i] -= 1
        excess -= 1
    return excess


def layout(columns: Sequence[Column], natural: Sequence[int], width: int) -> list[int | None]:
    """Each column's width at ``width`` cells, or None where it leaves."""
    shown_ = [True] * len(columns)
    for rank in sorted({c.drop for c in columns if c.drop}, reverse=True) + [0]:
        idx = [i for i, s in enumerate(shown_) if s]
        room = width - GAP * (len(idx) - 1)
        fixed = sum(natural[i] for i in idx if not columns[i].flex)
        flex = [i for i in idx if columns[i].flex]
        least = sum(min(natural[i], columns[i].least) for i in flex)
        if fixed + least <= room or rank == 0:
            break
        for i, c in enumerate(columns):
            if c.drop == rank:
                shown_[i] = False
    idx = [i for i, s in enumerate(shown_) if s]
    room = max(len(idx), width - GAP * (len(idx) - 1))
    widths = {i: natural[i] for i in idx}
    flex = [i for i in idx if columns[i].flex]
    fixed = sum(natural[i] for i in idx if not columns[i].flex)
    if flex and fixed + sum(natural[i] for i in flex) > room:
        floors = [min(natural[i], columns[i].least) for i in flex]
        wants = [natural[i] - f for i, f in zip(flex, floors, strict=True)]
        extra = _fill(max(0, room - fixed - sum(floors)), wants)
        for i, f, e in zip(flex, floors, extra, strict=True):
            widths[i] = f + e
    over = sum(widths.values()) - room
    if over > 0:  # the last resort: the flex columns go down to a few cells, then all
        narrow = {i: widths[i] for i in flex}
        over = _cut_widest(narrow, over, FLEX_FLOOR)
        widths.update(narrow)
        _cut_widest(widths, over, 1)
    return [widths.get(i) for i in range(len(columns))]


class FitTable:
    """A table of one-line cells laid out at render time for the width it is given."""

    def __init__(self, columns: Sequence[Column], title: Text | None = None) -> None:
        self.columns = list(columns)
        self.rows: list[list[Text]] = []
        self.title = title
        self.notes: list[Text] = []  # lines under the table, each one line too

    def add_row(self, *cells: Text) -> None:
        self.rows.append(list(cells))

    def table(self, width: int) -> Table:
        natural = [
            max([len(c.header), *(r[i].cell_len for r in self.rows)])
            for i, c in enumerate(self.columns)
        ]
        widths = layout(self.columns, natural, width)
        keep = [i for i, w in enumerate(widths) if w is not None]
        title = one_line(self.title.copy()) if self.title is not None else None
        table = Table(
            title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
            padding=(0, 1), collapse_padding=True, expand=False, title_justify="left",
        )  # fmt: skip
        for i in keep:
            c = self.columns[i]
            header = Text(c.header, style="bold", no_wrap=True, overflow="ellipsis")
            table.add_column(
                header, justify=c.justify, no_wrap=True, overflow="ellipsis",
                width=widths[i], min_width=widths[i], max_width=widths[i],
            )  # fmt: skip
        for row in self.rows:
            table.add_row(*(one_line(row[i]) for i in keep))
        return table

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield self.table(options.max_width)
        for note in self.notes:
            yield one_line(note.copy())
