"""The Anthropic provider: the Messages API through ``anthropic.AsyncAnthropic``.

ANTHROPIC_API_KEY and ANTHROPIC_BASE_URL work as in the SDK, so any
Messages-API-compatible server can stand in; the SDK's own retries (with
backoff on 429 / 5xx / dropped connections) apply. What the server sends is cleaned of
lone UTF-16 surrogates (``base.clean``: in ``ModelResponse``, and the error messages
here), so no string of it can break a later write. The SDK (about a second to import) is
imported when the first model is built, not with this module.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from .base import Block, Model, ModelError, ModelRequest, ModelResponse, ModelUsage, clean_text
from .registry import ApiEnv, Provider

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


def make_client(max_retries: int = 4) -> anthropic.AsyncAnthropic:
    import anthropic

    key = os.environ.get("ANTHROPIC_API_KEY")
    if not key and not os.environ.get("ANTHROPIC_AUTH_TOKEN"):
        key = "orch-no-key"  # a compatible server behind ANTHROPIC_BASE_URL may need none
    return anthropic.AsyncAnthropic(api_key=key, max_retries=max_retries)


class AnthropicProvider:
    name = "anthropic"
    env_prefix = "ANTHROPIC_"
    env_names = API.names
    preload = (__name__, "anthropic")
    api = API
    whole_run = False

    def portable(self, model_id: str) -> str:
        return model_id

    def fixed(self, model_id: str) -> Model | None:
        return None

    def missing(self) -> str | None:
        return None if has_credentials() else MISSING_KEY

    def open(self) -> Client:
        return Client()


class Client:
    """One SDK client (its connection pool) for every model of an engine."""

    def __init__(self) -> None:
        self._client: anthropic.AsyncAnthropic | None = None

    def model(self, model_id: str) -> Model:
        if self._client is None:
            self._client = make_client()
        return AnthropicModel(self._client, model_id)

    async def aclose(self) -> None:
        """Close the HTTP client (inside the event loop that used it)."""
        client, self._client = self._client, None
        if client is not None:
            await client.close()


PROVIDER: Provider = AnthropicProvider()


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


class AnthropicModel:
    def __init__(self, client: anthropic.AsyncAnthropic, model_id: str) -> None:
        self.client = client
        self.model_id = model_id

    async def complete(self, request: ModelRequest) -> ModelResponse:
        import anthropic

        kwargs: dict[str, Any] = {
            "model": self.model_id,  # the id without its provider prefix
            "max_tokens": request.max_tokens,
            "system": request.system,
            "messages": request.messages,
        }
        if request.tools:
            kwargs["tools"] = request.tools
        try:
            response = await self.client.messages.create(**kwargs)
        except anthropic.AuthenticationError as e:
            raise ModelError(
                "the API rejected the credentials (401); check ANTHROPIC_API_KEY"
            ) from e
        except anthropic.APIStatusError as e:
            raise ModelError(clean_text(f"model API error {e.status_code}: {e.message}")) from e
        except anthropic.APIConnectionError as e:
            raise ModelError(
                clean_text(
                    f"cannot reach the model API ({e}); check ANTHROPIC_BASE_URL and the network"
                )
            ) from e
        except anthropic.APIError as e:  # a response the SDK could not read
            raise ModelError(clean_text(f"model API error: {e}")) from e
        usage = getattr(response, "usage", None)
        content = getattr(response, "content", None)
        return ModelResponse(
            content=[_block(b) for b in content] if isinstance(content, list) else [],
            stop_reason=str(getattr(response, "stop_reason", None) or "end_turn"),
            usage=ModelUsage(
                input_tokens=_tokens(usage, "input_tokens"),
                output_tokens=_tokens(usage, "output_tokens"),
            ),
        )
