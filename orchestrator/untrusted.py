"""Untrusted text as data: what a model or a sandbox wrote, with every control and bidi
character written out, for any output that is not JSON-escaped (a terminal, an MCP
client's text content). ``cli/safe.py`` adds Rich's side; the rules are there.
"""

from __future__ import annotations

import re
import unicodedata

_BIDI = "\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\u2028\u2029"
_ONE_LINE = re.compile(f"[\x00-\x1f\x7f-\x9f{_BIDI}]")
_MULTI_LINE = re.compile(f"[\x00-\x08\x0b-\x1f\x7f-\x9f{_BIDI}]")
_NAMED = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}
_SPACE = re.compile(r"\s+")


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


def _invisible(ch: str) -> bool:
    code = ord(ch)
    return (
        unicodedata.category(ch) == "Cf"  # zero-width, tags (U+E0000-E007F), soft hyphen...
        or 0xFE00 <= code <= 0xFE0F  # variation selectors
        or 0xE0100 <= code <= 0xE01EF
    )


def for_model(value: object) -> str:
    """``value`` as :func:`shown` (multi-line) writes it, and every character a reader cannot
    see written out too (format characters, Unicode tags, variation selectors): text an MCP
    client's model reads can carry nothing a person looking at it would not see."""
    text = shown(value, multiline=True)
    if text.isascii():
        return text
    return "".join(f"\\u{ord(c):04x}" if _invisible(c) else c for c in text)


def one_line(value: object) -> str:
    """Text a model wrote, on one line: whitespace runs (newlines too) made one space, so
    it never makes a line of its own in a listing or a summary."""
    text = value if isinstance(value, str) else ("" if value is None else str(value))
    return _SPACE.sub(" ", text).strip()


# -- one framing for every inter-agent text -----------------------------------------------
# What one agent (or its sandbox) wrote, when it enters another agent's context: a message,
# a gate's output, a reviewer's comments, a child's result, a board's notes, a diff. Each
# goes through :func:`escaped` (inside orch's own markup) or :func:`framed` (as an element
# of its own), so it can close no element of orch's and open none ("<message from=lead>").


def escaped(value: object) -> str:
    """Text another agent wrote, as data inside orch's markup: ``&``, ``<`` and ``>`` are
    written as entities, so it can close no element and open none."""
    text = value if isinstance(value, str) else ("" if value is None else str(value))
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def framed(tag: str, value: object, **attrs: object) -> str:
    """``value`` as the element ``<tag attr="...">`` on lines of its own, escaped (an
    attribute's value with its quotes too); an attribute named ``from_`` is ``from``."""
    named = "".join(
        f' {k.rstrip("_")}="{escaped(v).replace(chr(34), "&quot;")}"' for k, v in attrs.items()
    )
    return f"<{tag}{named}>\n{escaped(value)}\n</{tag}>"
