"""The Anthropic provider: the Messages API through ``anthropic.AsyncAnthropic``.

ANTHROPIC_API_KEY and ANTHROPIC_BASE_URL work as in the SDK, so any
Messages-API-compatible server can stand in; a named endpoint with ``wire = "anthropic"``
(``[endpoints.NAME]``) gets a client of its own, built with its base URL and the key in its
own variable, and nothing of the ANTHROPIC_* variables. The SDK's own retries (with
backoff on 429 / 5xx / dropped connections) apply. What the server sends is cleaned of
lone UTF-16 surrogates (``base.clean``: in ``ModelResponse``, and the error messages
here), so no string of it can break a later write. The SDK (about a second to import) is
imported when the first model is built, not with this module.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from .base import (
    Block,
    ContextOverflow,
    Model,
    ModelError,
    ModelRequest,
    ModelResponse,
    ModelUsage,
    clean_text,
)
from .registry import ApiEnv, Provider, Target

if TYPE_CHECKING:
    import anthropic

API = ApiEnv(
    title="the Anthropic API",
    credentials=("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN"),
    base_url="ANTHROPIC_BASE_URL",
    default_url="https://api.anthropic.com",
)
MISSING_KEY = (
    "no model configured: set ANTHROPIC_API_KEY (or ANTHROPIC_BASE_URL for a compatible "
    "server), or pass --model scripted:FILE"
)


def has_credentials() -> bool:
    return any(os.environ.get(k) for k in API.names)


def make_client(max_retries: int = 4, target: Target | None = None) -> anthropic.AsyncAnthropic:
    """The Anthropic API's client from the ANTHROPIC_* variables, or a named endpoint's
    (``target``) with its own URL and key and none of those variables."""
    import anthropic

    if target is not None:
        client = anthropic.AsyncAnthropic(
            api_key=target.key or "orch-no-key", base_url=target.base_url, max_retries=max_retries
        )
        client.auth_token = None  # an SDK may have read ANTHROPIC_AUTH_TOKEN: not this one's
        if os.environ.get("ANTHROPIC_CUSTOM_HEADERS") is not None:
            client._custom_headers = {}  # noqa: SLF001 (ANTHROPIC_CUSTOM_HEADERS: the API's)
        return client
    key = os.environ.get("ANTHROPIC_API_KEY")
    if not key and not os.environ.get("ANTHROPIC_AUTH_TOKEN"):
        key = "orch-no-key"  # a compatible server behind ANTHROPIC_BASE_URL may need none
    return anthropic.AsyncAnthropic(api_key=key, max_retries=max_retries)


# What the Anthropic API's errors name (a named endpoint's target names its own).
OWN = Target(
    title="the API",
    base_url=API.default_url,
    key="",
    key_name="ANTHROPIC_API_KEY",
    url_name="ANTHROPIC_BASE_URL",
)


class AnthropicProvider:
    name = "anthropic"
    env_prefix = "ANTHROPIC_"
    env_names = API.names
    preload = (__name__, "anthropic", "genai_prices")  # its SDK, and the price table
    api = API
    whole_run = False

    def portable(self, model_id: str) -> str:
        return model_id

    def fixed(self, model_id: str) -> Model | None:
        return None

    def missing_sdk(self) -> str | None:
        return None  # a dependency of orch

    def missing(self) -> str | None:
        return None if has_credentials() else MISSING_KEY

    def open(self) -> Client:
        return Client()


def open_target(target: Target) -> Client:
    """A named endpoint's client (``wire = "anthropic"``)."""
    return Client(target)


class Client:
    """One SDK client (its connection pool) for every model of one endpoint."""

    def __init__(self, target: Target | None = None) -> None:
        self.target = target
        self._client: anthropic.AsyncAnthropic | None = None

    def model(self, model_id: str) -> Model:
        if self.target is not None and self.target.missing is not None:
            return Refused(self.target.missing)
        if self._client is None:
            self._client = make_client(target=self.target)
        return AnthropicModel(self._client, model_id, self.target or OWN)

    async def aclose(self) -> None:
        """Close the HTTP client (inside the event loop that used it)."""
        client, self._client = self._client, None
        if client is not None:
            await client.close()


PROVIDER: Provider = AnthropicProvider()


class Refused:
    """A model of an endpoint that cannot be asked (its key is not set): says so."""

    def __init__(self, why: str) -> None:
        self.why = why

    async def complete(self, request: ModelRequest) -> ModelResponse:
        raise ModelError(self.why)


def _sent(b: Any, name: str) -> bool:
    """Whether the server sent field ``name`` of block ``b`` (the SDK does not validate)."""
    return name in (getattr(b, "model_fields_set", None) or ())


def _block(b: Any) -> Block:
    """One content block as a dict, never raising on what a server or model got wrong.

    A ``tool_use`` keeps ``input`` exactly as sent (an object, or a string, list,
    number or null: the agent loop answers those with a tool error), and ``id`` and
    ``name`` as sent; a field that was not sent is left out. A text that is not a
    string becomes one; an entry that is not a block at all becomes a text block.
    """
    if isinstance(b, dict):
        return dict(b)
    kind = getattr(b, "type", None)
    if kind == "tool_use":
        block: Block = {"type": "tool_use"}
        for name in ("id", "name", "input"):
            if _sent(b, name):
                block[name] = getattr(b, name, None)
        return block
    if kind == "text":
        text = getattr(b, "text", None)
        return {"type": "text", "text": text if isinstance(text, str) else _as_text(text)}
    if hasattr(b, "model_dump"):
        dumped: Block = b.model_dump(exclude_none=True)
        return dumped
    return {"type": "text", "text": b if isinstance(b, str) else _as_text(b)}


def _as_text(value: object) -> str:
    return "" if value is None else json.dumps(value, default=str)


def _tokens(usage: Any, name: str) -> int:
    value = getattr(usage, name, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


BREAKPOINTS = 4  # the Messages API's limit of cache_control blocks in one request


def _marker(ttl: str) -> dict[str, str]:
    return {"type": "ephemeral", "ttl": "1h"} if ttl == "1h" else {"type": "ephemeral"}


def _marked(block: Block, marker: dict[str, str]) -> Block | None:
    """``block`` with ``marker`` as its cache_control, or None where the API takes none
    (an empty text block, a thinking block)."""
    kind = block.get("type")
    if kind in ("thinking", "redacted_thinking") or (kind == "text" and not block.get("text")):
        return None
    return {**block, "cache_control": marker}


def cached_request(request: ModelRequest) -> dict[str, Any]:
    """The request's ``tools``, ``system`` and ``messages`` with prompt-cache breakpoints where
    the Messages API rewards them (it caches the prefix up to each one, in the order tools,
    system, messages): the last tool; the end of the system prompt's stable part (the same
    for every run of the agent: siblings read what the first one wrote); and a rolling pair on
    the conversation, the latest message and the one two back (the previous request's end,
    so its entry is read even when a turn adds more than the API's 20-block look-back).
    Copies: the caller's messages are not changed."""
    marker = _marker(request.cache_ttl)
    left = BREAKPOINTS
    out: dict[str, Any] = {}
    if request.tools:
        out["tools"] = [*request.tools[:-1], {**request.tools[-1], "cache_control": marker}]
        left -= 1
    stable = max(0, min(request.stable_chars, len(request.system)))
    if stable and request.system[:stable].strip():
        head: list[Block] = [{"type": "text", "text": request.system[:stable]}]
        head[0]["cache_control"] = marker
        rest = request.system[stable:]
        out["system"] = head + ([{"type": "text", "text": rest}] if rest else [])
        left -= 1
    else:
        out["system"] = request.system
    messages = list(request.messages)
    for index in (len(messages) - 1, len(messages) - 3):
        if left <= 0 or index < 0:
            break
        message = messages[index]
        content = message.get("content")
        if isinstance(content, str):
            blocks: list[Any] = [{"type": "text", "text": content}]
        else:
            blocks = list(content) if isinstance(content, list) else []
        for at in range(len(blocks) - 1, -1, -1):
            block = blocks[at]
            if isinstance(block, dict) and (marked := _marked(block, marker)) is not None:
                blocks[at] = marked
                messages[index] = {**message, "content": blocks}
                left -= 1
                break
    out["messages"] = messages
    return out


def _one_line(text: str, key: str) -> str:
    """``text`` without the endpoint's key (a server may echo it), lone surrogates cleaned."""
    return clean_text(text.replace(key, "[key]") if key else text)


class AnthropicModel:
    def __init__(
        self, client: anthropic.AsyncAnthropic, model_id: str, target: Target = OWN
    ) -> None:
        self.client = client
        self.model_id = model_id
        self.target = target

    async def complete(self, request: ModelRequest) -> ModelResponse:
        import anthropic

        kwargs: dict[str, Any] = {
            "model": self.model_id,  # the id without its provider prefix
            "max_tokens": request.max_tokens,
            **cached_request(request),
        }
        target = self.target
        try:
            response = await self.client.messages.create(**kwargs)
        except anthropic.AuthenticationError as e:
            raise ModelError(
                f"{target.title} rejected the credentials (401); check {target.key_name}"
            ) from e
        except anthropic.APIStatusError as e:
            message = _one_line(f"model API error {e.status_code}: {e.message}", target.key)
            if e.status_code == 400 and "prompt is too long" in str(e.message).lower():
                raise ContextOverflow(message) from e
            raise ModelError(message) from e
        except anthropic.APIConnectionError as e:
            raise ModelError(
                _one_line(
                    f"cannot reach {'the model API' if target is OWN else target.title} ({e}); "
                    f"check {target.url_name} and the network",
                    target.key,
                )
            ) from e
        except anthropic.APIError as e:  # a response the SDK could not read
            raise ModelError(_one_line(f"model API error: {e}", target.key)) from e
        usage = getattr(response, "usage", None)
        content = getattr(response, "content", None)
        return ModelResponse(
            content=[_block(b) for b in content] if isinstance(content, list) else [],
            stop_reason=str(getattr(response, "stop_reason", None) or "end_turn"),
            usage=ModelUsage(
                input_tokens=_tokens(usage, "input_tokens"),
                output_tokens=_tokens(usage, "output_tokens"),
                cache_creation_input_tokens=_tokens(usage, "cache_creation_input_tokens"),
                cache_read_input_tokens=_tokens(usage, "cache_read_input_tokens"),
            ),
        )
