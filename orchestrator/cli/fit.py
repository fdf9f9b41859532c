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

from rich.cells import cell_len, set_cell_size
from rich.console import Console, ConsoleOptions, RenderResult
from rich.text import Span, Text

from .safe import shown

FLEX_FLOOR = 4  # a flex column keeps this many cells before fixed columns are cut
GAP = 2  # blanks between two columns


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

    def lines(self, width: int) -> list[Text]:
        """The title, the header, its rule and one line a row, none wider than ``width``.

        Drawn by hand, not by ``rich.table``: a frame of a live view with a hundred rows
        is then a few milliseconds, not a fifth of a second."""
        natural = [
            max([len(c.header), *(r[i].cell_len for r in self.rows)])
            for i, c in enumerate(self.columns)
        ]
        widths = layout(self.columns, natural, width)
        keep = [(i, w) for i, w in enumerate(widths) if w is not None]
        header = [Text(c.header, style="bold") for c in self.columns]
        lines = [] if self.title is None else [self._fit(self.title, width)]
        lines.append(self._line(header, keep))
        lines.append(Text("─" * (sum(w for _, w in keep) + GAP * (len(keep) - 1)), style="dim"))
        lines += [self._line(row, keep) for row in self.rows]
        return lines + [self._fit(note, width) for note in self.notes]

    @staticmethod
    def _fit(text: Text, width: int) -> Text:
        cut = text.copy()
        cut.truncate(max(1, width), overflow="ellipsis")
        return cut

    def _line(self, cells: list[Text], keep: list[tuple[int, int]]) -> Text:
        """One line of cells, each cut or padded to its width, as one ``Text`` (its styles
        as spans): cheap to draw many times a second."""
        plain: list[str] = []
        spans: list[Span] = []
        at = 0  # characters so far (spans count characters; widths count cells)
        for n, (i, width) in enumerate(keep):
            if n:
                plain.append(" " * GAP)
                at += GAP
            piece = cells[i]
            text = piece.plain
            if cell_len(text) > width:
                text = set_cell_size(text, width - 1) + "…" if width > 1 else "…"
            pad = " " * (width - cell_len(text))
            if self.columns[i].justify == "right":
                plain.append(pad)
                at += len(pad)
            if piece.style:
                spans.append(Span(at, at + len(text), piece.style))
            for span in piece.spans:
                if span.start < len(text):
                    spans.append(Span(at + span.start, at + min(span.end, len(text)), span.style))
            plain.append(text)
            at += len(text)
            if self.columns[i].justify != "right" and n < len(keep) - 1:
                plain.append(pad)  # no trailing blanks after the last column
                at += len(pad)
        return Text("".join(plain), spans=spans, no_wrap=True, overflow="ellipsis")

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        for line in self.lines(options.max_width):
            yield one_line(line)
