"""Models: one async seam (``Model``), the Anthropic API and a scripted player."""

from __future__ import annotations

from pathlib import Path
from types import TracebackType
from typing import Any, Self

from ..config import Settings
from ..errors import UsageError
from .base import Model, ModelError, ModelRequest, ModelResponse, ModelUsage
from .scripted import ScriptedModel, ScriptError

__all__ = [
    "Model",
    "ModelError",
    "ModelProvider",
    "ModelRequest",
    "ModelResponse",
    "ModelUsage",
    "ScriptError",
    "ScriptedModel",
]

MISSING_KEY = (
    "no model configured: set ANTHROPIC_API_KEY (or ANTHROPIC_BASE_URL for a compatible "
    "server), or pass --model scripted:FILE"
)


class ModelProvider:
    """Turns model names (aliases, ids, ``scripted:PATH``) into Model objects.

    ``scripted`` (or a ``scripted:PATH`` spec) and ``model`` (any object implementing
    :class:`Model`, for tests and embedders) each make ``get`` return that one model for
    every name; ``model`` wins if both are given.
    """

    def __init__(
        self,
        settings: Settings,
        spec: str | None = None,
        *,
        scripted: ScriptedModel | None = None,
        model: Model | None = None,
    ) -> None:
        self.settings = settings
        self.scripted = scripted
        spec = spec or settings.model
        if scripted is None and model is None and spec.startswith("scripted:"):
            self.scripted = ScriptedModel.load(Path(spec.removeprefix("scripted:")))
        self.fixed: Model | None = model if model is not None else self.scripted
        if model is not None:
            self.default = "model"
        elif self.scripted is not None:
            self.default = "scripted"
        else:
            self.default = settings.resolve_model(spec)
        self._models: dict[str, Model] = {}
        self._client: Any = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the HTTP client (inside the event loop that used it)."""
        client, self._client = self._client, None
        self._models.clear()
        if client is not None:
            await client.close()

    def resolve(self, name: str | None) -> str:
        return self.settings.resolve_model(name) if name else self.default

    def check_ready(self) -> None:
        if self.fixed is None:
            from .anthropic import has_credentials

            if not has_credentials():
                raise UsageError(MISSING_KEY)

    def get(self, name: str) -> Model:
        if self.fixed is not None:
            return self.fixed
        if name not in self._models:
            from .anthropic import AnthropicModel, make_client

            if self._client is None:
                self._client = make_client()
            self._models[name] = AnthropicModel(self._client, name)
        return self._models[name]
