"""Untrusted text on the terminal: shown as data, never obeyed.

What a model or a sandbox wrote (descriptions, final texts, errors, activity
summaries, agent names from agent files, branch names, event data) may hold
terminal escape sequences (clear the screen, OSC 52 writes the clipboard, OSC 8
links), bidi overrides that reorder what is shown, or Rich markup (``[/]``
raises, ``[link=…]`` makes a link). Every such string goes through
:func:`shown` (a plain string) or :func:`safe_text` (a ``rich.text.Text``,
which Rich never parses as markup) before it is printed:

- C0 and C1 control characters and DEL are written out: ``\\x1b``, ``\\x07``,
  ``\\x9b``; ``\\n`` and ``\\t`` too, except in a multi-line text
  (``multiline=True``), which keeps its lines and tabs;
- bidi controls (U+202A–U+202E, U+2066–U+2069, U+200E, U+200F, U+061C) and
  line/paragraph separators (U+2028, U+2029) are written out as ``\\u202e``…

``--json`` output needs none of this: ``json.dumps`` writes every control and
non-ASCII character as a ``\\uXXXX`` escape and the text round-trips exactly.
"""

from __future__ import annotations

import re

from rich.markup import escape
from rich.text import Text

_BIDI = "\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\u2028\u2029"
_ONE_LINE = re.compile(f"[\x00-\x1f\x7f-\x9f{_BIDI}]")
_MULTI_LINE = re.compile(f"[\x00-\x08\x0b-\x1f\x7f-\x9f{_BIDI}]")
_NAMED = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _written_out(m: re.Match[str]) -> str:
    ch = m.group()
    if ch in _NAMED:
        return _NAMED[ch]
    code = ord(ch)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def shown(value: object, *, multiline: bool = False) -> str:
    """``value`` as text with every control and bidi character written out.

    Safe to write to a terminal; NOT safe as Rich markup (use :func:`safe_text`
    or :func:`safe_markup` for Rich).
    """
    text = value if isinstance(value, str) else ("" if value is None else str(value))
    if multiline:
        return _MULTI_LINE.sub(_written_out, text.replace("\r\n", "\n"))
    return _ONE_LINE.sub(_written_out, text)


def safe_text(value: object, style: str = "", *, multiline: bool = False) -> Text:
    """``value`` as a Rich ``Text``: controls written out, never parsed as markup."""
    return Text(shown(value, multiline=multiline), style=style)


def safe_markup(value: object) -> str:
    """``value`` to put inside a Rich markup string: controls written out, markup escaped."""
    return escape(shown(value))
