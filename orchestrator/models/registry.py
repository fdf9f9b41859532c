"""Model providers, chosen by the prefix of a model spec.

A spec is ``PREFIX`` + the provider's own name for a model: ``scripted:FILE`` plays a
script, ``anthropic/claude-sonnet-4-5`` is the Anthropic Messages API. A spec without a
prefix (an id such as ``claude-sonnet-4-5``, or what an alias in the settings resolved to)
goes to :data:`DEFAULT`. :data:`PROVIDERS` maps each prefix to the module that holds the
provider's ``PROVIDER`` object; a module is imported the first time its provider is asked
for, and keeps its SDK out of its top level (that is imported when a model is built).

Adding a provider: one module in this folder with a ``PROVIDER`` (see :class:`Provider`)
and one line in :data:`PROVIDERS`. What the rest of orch needs to know of a provider it
asks here: which environment variables carry its settings (a sandbox never sees them, a
Ray node gets the spawner's), what the warm process imports ahead, and where its API is
configured (``orch doctor`` checks it).
"""

from __future__ import annotations

import contextlib
import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ..errors import UsageError
from .base import Model

# prefix -> the module of its provider. A prefix ends in ":" or "/".
PROVIDERS: dict[str, str] = {
    "scripted:": "orchestrator.models.scripted",
    "anthropic/": "orchestrator.models.anthropic",
}
DEFAULT = "anthropic/"  # the provider of a spec without a prefix
_PREFIX = re.compile(r"^[a-z][a-z0-9_-]*[:/]")  # what a spec's provider prefix looks like


@dataclass(frozen=True)
class ApiEnv:
    """Where a provider's HTTP API client reads its settings (``orch doctor`` checks it)."""

    title: str  # "the Anthropic API"
    credentials: tuple[str, ...]  # variables that hold a key or token, the first one preferred
    base_url: str  # the variable naming a compatible server instead of ``default_url``
    default_url: str

    @property
    def names(self) -> tuple[str, ...]:
        return (*self.credentials, self.base_url)


class Session(Protocol):
    """A provider's open client: builds its models, closed when the run's engine is."""

    def model(self, model_id: str) -> Model: ...

    async def aclose(self) -> None: ...


class Provider(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def env_prefix(self) -> str | None:
        """Every variable that carries its settings starts with this (all are secrets)."""

    @property
    def env_names(self) -> tuple[str, ...]:
        """The variables its client reads (a Ray node runs with the spawner's values)."""

    @property
    def preload(self) -> tuple[str, ...]:
        """Modules the warm process and the worker host import ahead (its SDK)."""

    @property
    def api(self) -> ApiEnv | None: ...

    @property
    def whole_run(self) -> bool:
        """One model answers every agent of a run (a script, which keeps its place in the
        run): a run's spec then names no model, and each detached run gets a runner of its
        own instead of sharing one."""

    def portable(self, model_id: str) -> str:
        """``model_id`` as another process (another working directory) must read it."""

    def fixed(self, model_id: str) -> Model | None:
        """The one model that answers every agent of the run (a script), or None when
        each agent gets the model it names (built by :meth:`open`'s session)."""

    def missing(self) -> str | None:
        """None when it can make models here, else what to set (a one-line message)."""

    def open(self) -> Session: ...


@dataclass(frozen=True)
class Route:
    prefix: str
    provider: Provider
    model_id: str  # the spec without its prefix


def provider(prefix: str) -> Provider:
    found: Provider = importlib.import_module(PROVIDERS[prefix]).PROVIDER
    return found


def providers() -> list[Provider]:
    return [provider(p) for p in PROVIDERS]


def route(spec: str) -> Route:
    """Which provider serves ``spec`` (aliases resolved already), and its name there."""
    for prefix in PROVIDERS:
        if spec.startswith(prefix):
            return Route(prefix, provider(prefix), spec.removeprefix(prefix))
    if match := _PREFIX.match(spec):
        known = ", ".join(f"{p}ID" if p.endswith("/") else f"{p}FILE" for p in PROVIDERS)
        raise UsageError(
            f"model {spec!r}: unknown provider {match.group()!r}; known: {known} (an id or "
            f"alias without a prefix goes to {DEFAULT}; write {DEFAULT}{spec} to send it whole)"
        )
    return Route(DEFAULT, provider(DEFAULT), spec)


def whole_run(spec: str) -> bool:
    """True if ``spec``'s one model answers every agent of the run (see :class:`Provider`)."""
    return route(spec).provider.whole_run


def reads_host(spec: str) -> bool:
    """True if ``spec``'s model reads a file on the host (a script, ``scripted:FILE``): a
    repository's settings may name one only once trusted (``trust.py``)."""
    try:
        return whole_run(spec)
    except UsageError:  # an unknown provider: the run fails on it, with one line
        return False


def portable(spec: str) -> str:
    """``spec`` as a detached process reads it (a script's path made absolute)."""
    found = route(spec)
    prefix = found.prefix if spec.startswith(found.prefix) else ""
    return prefix + found.provider.portable(found.model_id)


def _each(attribute: Callable[[Provider], tuple[str, ...]]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(name for p in providers() for name in attribute(p)))


def env_names() -> tuple[str, ...]:
    """The variables any provider's client reads."""
    return _each(lambda p: p.env_names)


def secret_prefixes() -> tuple[str, ...]:
    """The prefixes of every variable that carries a provider's settings."""
    return _each(lambda p: (p.env_prefix,) if p.env_prefix else ())


def preload_modules() -> tuple[str, ...]:
    return _each(lambda p: p.preload)


def preload() -> None:
    """Import every provider's SDK now (one not installed is skipped)."""
    for name in preload_modules():
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def api_env(spec: str) -> ApiEnv:
    """The API settings of the provider of ``spec``, or of :data:`DEFAULT`'s when that
    provider has no API (a script). Raises UsageError for an unknown prefix."""
    for each in (route(spec).provider, provider(DEFAULT)):
        if each.api is not None:
            return each.api
    raise UsageError(f"no model provider with an API for {spec!r}")
