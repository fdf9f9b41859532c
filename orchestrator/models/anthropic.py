"""AnthropicModel: the Messages API through ``anthropic.AsyncAnthropic``.

ANTHROPIC_API_KEY and ANTHROPIC_BASE_URL work as in the SDK, so any
Messages-API-compatible server can stand in; the SDK's own retries (with
backoff on 429 / 5xx / dropped connections) apply.
"""

from __future__ import annotations

import os
from typing import Any

import anthropic

from .base import Block, ModelError, ModelRequest, ModelResponse, ModelUsage


def has_credentials() -> bool:
    return any(
        os.environ.get(k)
        for k in ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "ANTHROPIC_BASE_URL")
    )


def make_client(max_retries: int = 4) -> anthropic.AsyncAnthropic:
    key = os.environ.get("ANTHROPIC_API_KEY")
    if not key and not os.environ.get("ANTHROPIC_AUTH_TOKEN"):
        key = "orch-no-key"  # a compatible server behind ANTHROPIC_BASE_URL may need none
    return anthropic.AsyncAnthropic(api_key=key, max_retries=max_retries)


def _block(b: Any) -> Block:
    kind = getattr(b, "type", None)
    if kind == "text":
        return {"type": "text", "text": b.text}
    if kind == "tool_use":
        return {"type": "tool_use", "id": b.id, "name": b.name, "input": dict(b.input or {})}
    dumped: Block = b.model_dump(exclude_none=True)
    return dumped


class AnthropicModel:
    def __init__(self, client: anthropic.AsyncAnthropic, model_id: str) -> None:
        self.client = client
        self.model_id = model_id

    async def complete(self, request: ModelRequest) -> ModelResponse:
        kwargs: dict[str, Any] = {
            "model": request.model or self.model_id,
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
            raise ModelError(f"model API error {e.status_code}: {e.message}") from e
        except anthropic.APIConnectionError as e:
            raise ModelError(
                f"cannot reach the model API ({e}); check ANTHROPIC_BASE_URL and the network"
            ) from e
        usage = ModelUsage(
            input_tokens=int(getattr(response.usage, "input_tokens", 0) or 0),
            output_tokens=int(getattr(response.usage, "output_tokens", 0) or 0),
        )
        return ModelResponse(
            content=[_block(b) for b in response.content],
            stop_reason=str(response.stop_reason or "end_turn"),
            usage=usage,
        )
