"""Models: one async seam (``Model``), providers chosen by a spec's prefix (``registry``):
the Anthropic API, Chat Completions (OpenAI, OpenRouter), the settings' named endpoints
and a scripted player."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Protocol

from ..errors import UsageError
from .base import Model, ModelError, ModelRequest, ModelResponse, ModelUsage
from .config import Endpoint
from .registry import (
    Route,
    Session,
    api_env,
    endpoint_keys,
    env_names,
    named_endpoints,
    portable,
    preload,
    preload_modules,
    route,
    whole_run,
)
from .registry import secret_prefixes as secret_env_prefixes
from .scripted import ScriptedModel, ScriptError

__all__ = [
    "Model",
    "ModelError",
    "ModelProvider",
    "ModelRequest",
    "ModelResponse",
    "ModelSettings",
    "ModelUsage",
    "ScriptError",
    "ScriptedModel",
    "api_env",
    "endpoint_keys",
    "env_names",
    "portable",
    "preload",
    "preload_modules",
    "route",
    "secret_env_prefixes",
    "whole_run",
]


class ModelSettings(Protocol):
    """What of the settings choosing a model takes (``config.Settings`` has it)."""

    @property
    def model(self) -> str: ...

    @property
    def endpoints(self) -> Mapping[str, Endpoint]: ...

    def resolve_model(self, name: str | None) -> str: ...


class ModelProvider(contextlib.AbstractAsyncContextManager["ModelProvider", None]):
    """Turns model names (aliases, ids, ``PREFIX`` + a provider's name) into Model objects.

    The run's spec (``spec``, else the ``model`` setting) names the default model; the
    settings' ``endpoints`` add a provider each (``NAME/ID``), with one client each. A
    provider whose one model answers every agent (``scripted:PATH``) makes ``get`` return
    that model for every name; so do ``scripted`` and ``model`` (any object implementing
    :class:`Model`, for tests and embedders); ``model`` wins if both are given.
    """

    def __init__(
        self,
        settings: ModelSettings,
        spec: str | None = None,
        *,
        scripted: ScriptedModel | None = None,
        model: Model | None = None,
    ) -> None:
        self.settings = settings
        self.endpoints = dict(settings.endpoints)
        named_endpoints(self.endpoints)  # a bad name: one line now, not at an agent's turn
        self.scripted = scripted
        self.fixed: Model | None = model if model is not None else scripted
        self.route: Route | None = None
        if model is not None:
            self.default = "model"
        elif scripted is not None:
            self.default = "scripted"
        else:
            spec = settings.resolve_model(spec or settings.model)
            self.route = route(spec, self.endpoints)
            self.fixed = self.route.provider.fixed(self.route.model_id)
            self.default = spec if self.fixed is None else self.route.provider.name
            if isinstance(self.fixed, ScriptedModel):
                self.scripted = self.fixed
        self._models: dict[str, Model] = {}
        self._sessions: dict[str, Session] = {}  # prefix -> that endpoint's open client

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the providers' clients (inside the event loop that used them)."""
        sessions, self._sessions = self._sessions, {}
        self._models.clear()
        for session in sessions.values():
            await session.aclose()

    def resolve(self, name: str | None) -> str:
        """The model an agent asking for ``name`` gets (an unknown prefix is a UsageError)."""
        if not name:
            return self.default
        resolved = self.settings.resolve_model(name)
        if self.fixed is None:
            route(resolved, self.endpoints)
        return resolved

    def check_ready(self) -> None:
        if self.route is not None and self.fixed is None:
            if problem := self.route.provider.missing():
                raise UsageError(problem)

    def get(self, name: str) -> Model:
        if self.fixed is not None:
            return self.fixed
        if name not in self._models:
            where = route(name, self.endpoints)
            if where.prefix not in self._sessions:
                self._sessions[where.prefix] = where.provider.open()
            self._models[name] = self._sessions[where.prefix].model(where.model_id)
        return self._models[name]
