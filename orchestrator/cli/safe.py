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

from rich.markup import escape
from rich.text import Text

from ..untrusted import shown as shown  # re-exported: the CLI shows through this module


def safe_text(value: object, style: str = "", *, multiline: bool = False) -> Text:
    """``value`` as a Rich ``Text``: controls written out, never parsed as markup."""
    return Text(shown(value, multiline=multiline), style=style)


def safe_markup(value: object) -> str:
    """``value`` to put inside a Rich markup string: controls written out, markup escaped."""
    return escape(shown(value))
