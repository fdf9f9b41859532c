"""The Messages API's accounting as a pure model: what a request's usage is, what the prompt
cache reads and writes, and when the API refuses a request. A fake server applies it to each
``POST /v1/messages`` (``admit`` when the request is read, ``sent`` once the response is
written), so orch's tests and benchmarks see the numbers the real API would report.

Thread-safe (one lock around the cache), with an injectable clock (``time.monotonic`` by
default) for the TTLs. Token counts are an estimate (``tokens``), the same everywhere here.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_WINDOW = 200_000
MAX_BREAKPOINTS = 4
LOOKBACK = 20
# the framing of the assistant turn a request ends with: after every block a breakpoint can
# mark, so never cached (the real API's input_tokens is never 0)
TURN_TOKENS = 3
TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}
DEFAULT_MIN_CACHEABLE = 1024
# model id prefix -> minimum cacheable prompt length in tokens (first match wins)
MIN_CACHEABLE = (
    ("claude-opus-4-5", 4096),
    ("claude-haiku-4-5", 4096),
    ("claude-3-5-haiku", 2048),
    ("claude-3-haiku", 2048),
    ("claude-sonnet-4", 1024),
    ("claude-opus-4", 1024),
)


def canonical(value: Any) -> str:
    """``value`` as canonical JSON text (sorted keys, no spaces, ASCII): what the estimate
    counts and the cache keys hash, whatever key order or spacing a client sent."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def tokens(value: Any) -> int:
    """The one token estimate: a string's characters / 4, anything else its canonical JSON
    text's characters / 4; at least 1."""
    text = value if isinstance(value, str) else canonical(value)
    return max(1, len(text) // 4)


def min_cacheable(model: str) -> int:
    """Docs, "Prompt caching", cache limitations: the minimum cacheable prompt length is
    1024 tokens for Claude Sonnet 4/4.5 and Opus 4/4.1, 4096 for Opus 4.5 and Haiku 4.5,
    2048 for Haiku 3 and 3.5; "shorter prompts cannot be cached, even if marked with
    cache_control". An unknown model: 1024."""
    for prefix, least in MIN_CACHEABLE:
        if model.startswith(prefix):
            return least
    return DEFAULT_MIN_CACHEABLE


def api_error(kind: str, message: str, request_id: str) -> dict[str, Any]:
    """Docs, "Errors": an error is JSON with a top-level ``error`` object (its ``type`` and
    ``message``) and the ``request_id``."""
    return {
        "type": "error",
        "error": {"type": kind, "message": message},
        "request_id": request_id,
    }


class Refused(Exception):
    """A request the API answers with an error: ``status`` and the JSON ``body``."""

    def __init__(self, status: int, kind: str, message: str, request_id: str) -> None:
        super().__init__(message)
        self.status = status
        self.body = api_error(kind, message, request_id)


@dataclass(frozen=True)
class Unit:
    """One cacheable block of a request: a tool, a system block or a message's content
    block. ``key`` hashes everything up to and including it (cache_control excluded);
    ``ttl`` is its breakpoint's lifetime ("5m" or "1h"), None for no breakpoint."""

    section: str  # "tools", "system" or "messages"
    tokens: int
    key: str
    ttl: str | None = None
    marks: int = 0  # cache_control markers in the block (a tool_result's inner blocks too)


def _bare(block: Any) -> Any:
    """``block`` without its cache_control (nor its inner blocks')."""
    if not isinstance(block, dict):
        return block
    out = {k: v for k, v in block.items() if k != "cache_control"}
    if isinstance(out.get("content"), list):
        out["content"] = [_bare(b) for b in out["content"]]
    return out


def _markers(block: Any) -> list[Any]:
    if not isinstance(block, dict):
        return []
    found = [block["cache_control"]] if "cache_control" in block else []
    inner = block.get("content")
    if isinstance(inner, list):
        found += [b["cache_control"] for b in inner if isinstance(b, dict) and "cache_control" in b]
    return found


def _blocks(content: Any) -> list[Any]:
    """A system prompt's or a message's content as blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    return list(content) if isinstance(content, list) else []


def _ttl(marker: Any, request_id: str) -> str:
    ttl = marker.get("ttl", "5m") if isinstance(marker, dict) else "5m"
    if ttl not in TTL_SECONDS:
        message = "cache_control.ttl: Input should be '5m' or '1h'"
        raise Refused(400, "invalid_request_error", message, request_id)
    return str(ttl)


def units(body: Mapping[str, Any], request_id: str = "") -> list[Unit]:
    """Docs, "Prompt caching": "prefixes are created in the following order: tools, system,
    then messages"; the cache key is the whole prefix up to a block, so a change anywhere
    before it is a miss. Changing ``tool_choice`` or the thinking parameters invalidates the
    messages' entries (they are in the messages' keys here)."""
    context = canonical({"tool_choice": body.get("tool_choice"), "thinking": body.get("thinking")})
    parts: list[tuple[str, Any, str]] = []
    tools = body.get("tools")
    for tool in tools if isinstance(tools, list) else []:
        parts.append(("tools", tool, canonical(["tool", _bare(tool)])))
    for block in _blocks(body.get("system")):
        parts.append(("system", block, canonical(["system", _bare(block)])))
    messages = body.get("messages")
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        role = message.get("role") if isinstance(message, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        for block in _blocks(content):
            parts.append(
                ("messages", block, canonical(["message", i, role, _bare(block), context]))
            )
    digest = hashlib.sha256()
    out: list[Unit] = []
    for section, block, described in parts:
        digest.update(described.encode() + b"\n")
        marks = _markers(block)
        out.append(
            Unit(
                section=section,
                tokens=tokens(_bare(block)),
                key=digest.copy().hexdigest(),
                ttl=_ttl(marks[-1], request_id) if marks else None,
                marks=len(marks),
            )
        )
    return out


@dataclass(frozen=True)
class Admitted:
    """A request the API took: its input as the API reports it, and the cache entries it
    writes once its response begins."""

    model: str
    request_id: str
    input_tokens: int
    cache_read_input_tokens: int
    cache_creation_input_tokens: int
    ephemeral_5m_input_tokens: int
    ephemeral_1h_input_tokens: int
    writes: tuple[tuple[str, float], ...] = ()  # (key, TTL in seconds)

    @property
    def prompt_tokens(self) -> int:
        """Docs: total input = cache_read_input_tokens + cache_creation_input_tokens +
        input_tokens."""
        return self.input_tokens + self.cache_read_input_tokens + self.cache_creation_input_tokens

    def usage(self, content: Any) -> dict[str, Any]:
        """The response's ``usage`` for a reply of ``content`` (its output tokens estimated
        from its size). Docs: ``input_tokens`` are the tokens after the last breakpoint,
        neither read from nor written to the cache; ``cache_creation`` splits the writes by
        TTL."""
        return {
            "input_tokens": self.input_tokens,
            "cache_creation_input_tokens": self.cache_creation_input_tokens,
            "cache_read_input_tokens": self.cache_read_input_tokens,
            "cache_creation": {
                "ephemeral_5m_input_tokens": self.ephemeral_5m_input_tokens,
                "ephemeral_1h_input_tokens": self.ephemeral_1h_input_tokens,
            },
            "output_tokens": tokens(content),
            "service_tier": "standard",
        }


class Messages:
    """The accounting of one API organization: its prompt cache, its models' windows."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] | None = None,
        windows: Mapping[str, int] | None = None,
        default_window: int = DEFAULT_WINDOW,
        min_lengths: Mapping[str, int] | None = None,
    ) -> None:
        self.clock = clock or time.monotonic
        self.windows = dict(windows or {})
        self.default_window = default_window
        self.min_lengths = dict(min_lengths or {})
        self._cache: dict[tuple[str, str], tuple[float, float]] = {}  # -> (expiry, ttl s)
        self._lock = threading.Lock()
        self._ids = itertools.count(1)

    def window(self, model: str) -> int:
        return self.windows.get(model, self.default_window)

    def set_window(self, model: str, size: int) -> None:
        self.windows[model] = size

    def min_cacheable(self, model: str) -> int:
        return self.min_lengths[model] if model in self.min_lengths else min_cacheable(model)

    def count(self, body: Mapping[str, Any]) -> int:
        """The whole input of ``body`` (what ``/v1/messages/count_tokens`` answers)."""
        return sum(u.tokens for u in units(body)) + TURN_TOKENS

    def request_id(self) -> str:
        with self._lock:
            return f"req_fake{next(self._ids):016x}"

    def entries(self, model: str | None = None) -> int:
        """Live cache entries (of ``model``)."""
        now = self.clock()
        with self._lock:
            return sum(
                1 for (m, _), (exp, _) in self._cache.items() if exp > now and model in (None, m)
            )

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()

    def admit(self, body: Mapping[str, Any]) -> Admitted:
        """The usage of ``body`` against the cache as it is now; raises ``Refused``.

        Docs, "Prompt caching": up to 4 cache breakpoints ("A maximum of 4 blocks with
        cache_control may be provided"); for each breakpoint the system checks for a hit at
        that position and at earlier block boundaries up to 20 blocks before it, and uses
        the longest matching prefix; a hit refreshes the entry's lifetime at no cost (here:
        the entry read and those at this request's breakpoints inside what it read). What a
        request does not read is written up to its last breakpoint, an entry per breakpoint
        with that breakpoint's TTL ("5m" unless ``ttl`` says "1h"); writes are split by TTL
        per segment between breakpoints. A prefix under the model's minimum is neither
        written nor read. Docs, "Context windows": a prompt over the window is refused with
        ``prompt is too long: N tokens > W maximum`` (400, invalid_request_error)."""
        request_id = self.request_id()
        model = str(body.get("model", ""))
        found = units(body, request_id)
        marks = sum(u.marks for u in found)
        if marks > MAX_BREAKPOINTS:
            raise Refused(
                400,
                "invalid_request_error",
                f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. "
                f"Found {marks}.",
                request_id,
            )
        sums = list(itertools.accumulate(u.tokens for u in found))
        total = (sums[-1] if sums else 0) + TURN_TOKENS
        window = self.window(model)
        if total > window:
            raise Refused(
                400,
                "invalid_request_error",
                f"prompt is too long: {total} tokens > {window} maximum",
                request_id,
            )
        points = [i for i, u in enumerate(found) if u.ttl is not None]
        least = self.min_cacheable(model)
        with self._lock:
            now = self.clock()
            hit = -1
            for b in points:
                for j in range(b, max(-1, b - LOOKBACK - 1), -1):
                    if j <= hit:
                        break
                    if self._live((model, found[j].key), now):
                        hit = j
                        break
            for j in {hit, *(b for b in points if b <= hit)} - {-1}:
                self._refresh((model, found[j].key), now)
        read = sums[hit] if hit >= 0 else 0
        upto = read
        split = {"5m": 0, "1h": 0}
        writes: list[tuple[str, float]] = []
        for b in points:
            ttl = found[b].ttl or "5m"
            if b > hit and sums[b] >= least:
                split[ttl] += sums[b] - upto
                upto = sums[b]
                writes.append((found[b].key, TTL_SECONDS[ttl]))
        return Admitted(
            model=model,
            request_id=request_id,
            input_tokens=total - upto,
            cache_read_input_tokens=read,
            cache_creation_input_tokens=upto - read,
            ephemeral_5m_input_tokens=split["5m"],
            ephemeral_1h_input_tokens=split["1h"],
            writes=tuple(writes),
        )

    def sent(self, admitted: Admitted) -> None:
        """The response to ``admitted`` was sent: its entries become readable now. Docs: "a
        cache entry only becomes available after the first response begins"; concurrent
        requests sent before it miss (and write the same prefix again)."""
        with self._lock:
            now = self.clock()
            for key, ttl in admitted.writes:
                entry = (admitted.model, key)
                old = self._cache.get(entry)
                if old is not None and old[0] > now:
                    self._cache[entry] = (max(old[0], now + ttl), max(old[1], ttl))
                else:
                    self._cache[entry] = (now + ttl, ttl)

    def _live(self, entry: tuple[str, str], now: float) -> bool:
        found = self._cache.get(entry)
        if found is None:
            return False
        if found[0] <= now:
            del self._cache[entry]
            return False
        return True

    def _refresh(self, entry: tuple[str, str], now: float) -> None:
        """Docs: "the cache is refreshed for no additional cost each time the cached content
        is used" (for its own TTL)."""
        if self._live(entry, now):
            expiry, ttl = self._cache[entry]
            self._cache[entry] = (max(expiry, now + ttl), ttl)
