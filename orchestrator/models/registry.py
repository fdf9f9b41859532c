"""Model providers, chosen by the prefix of a model spec.

A spec is ``PREFIX`` + the provider's own name for a model: ``scripted:FILE`` plays a
script, ``anthropic/claude-sonnet-4-5`` is the Anthropic Messages API, ``openai/gpt-4o``
and ``openrouter/anthropic/claude-sonnet-4.5`` go over Chat Completions, and ``NAME/ID``
goes to ``[endpoints.NAME]`` of the settings (its wire, its base URL, the key in its own
variable). A spec without a prefix (an id such as ``claude-sonnet-4-5``, or what an alias
in the settings resolved to) goes to :data:`DEFAULT`. :data:`PROVIDERS` maps each prefix
to the module that holds the provider's ``PROVIDER`` object (or ``module:NAME``); a module
is imported the first time its provider is asked for, and keeps its SDK out of its top
level (that is imported when a model is built).

The wire is apart from the endpoint: a wire module (:data:`WIRES`) opens a client for any
:class:`Target`, built with that endpoint's key explicitly, so no client reads another
endpoint's variable.

Adding a provider: one module in this folder with a ``PROVIDER`` (see :class:`Provider`)
and one line in :data:`PROVIDERS`. What the rest of orch needs to know of a provider it
asks here: which environment variables carry its settings (a sandbox never sees them, a
Ray node gets the spawner's), what the warm process imports ahead, and where its API is
configured (``orch doctor`` checks it).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from ..errors import UsageError
from .base import Model
from .config import Endpoint

# prefix -> the module of its provider. A prefix ends in ":" or "/".
PROVIDERS: dict[str, str] = {
    "scripted:": "orchestrator.models.scripted",
    "anthropic/": "orchestrator.models.anthropic",
    "openai/": "orchestrator.models.openai",
    "openrouter/": "orchestrator.models.openai:OPENROUTER",
}
# a named endpoint's wire -> the module whose ``open_target`` opens a client for it
WIRES: dict[str, str] = {
    "anthropic": "orchestrator.models.anthropic",
    "openai": "orchestrator.models.openai",
}
DEFAULT = "anthropic/"  # the provider of a spec without a prefix
_PREFIX = re.compile(r"^[a-z][a-z0-9_-]*[:/]")  # what a spec's provider prefix looks like
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # an endpoint's name
Endpoints = Mapping[str, Endpoint]


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


@dataclass(frozen=True)
class Target:
    """One endpoint as a wire's client sees it: where its requests go, with its own key
    (read from its own variable only), and what an error names instead of any value."""

    title: str  # "the OpenAI API", "endpoint 'local'"
    base_url: str
    key: str = field(repr=False)  # "": none (never in a repr, a log or an error)
    key_name: str  # what an authentication error names: the key's variable
    url_name: str  # what a connection error names: a variable, or the setting
    own_env: bool = True  # the SDK's own service: its other variables (org, headers) apply
    missing: str | None = None  # why no request can be made (one line), else None


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


def _load(path: str) -> object:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name or "PROVIDER")


def provider(prefix: str) -> Provider:
    found: Provider = _load(PROVIDERS[prefix])  # type: ignore[assignment]
    return found


def providers() -> list[Provider]:
    return [provider(p) for p in PROVIDERS]


class EndpointProvider:
    """``NAME/ID`` for ``[endpoints.NAME]`` of the settings: its wire to its base URL, with
    the key in its own variable (``key_env``) and nothing of any other's."""

    env_prefix = None
    whole_run = False

    def __init__(self, name: str, endpoint: Endpoint) -> None:
        self.name = name
        self.endpoint = endpoint
        self.env_names: tuple[str, ...] = (endpoint.key_env,) if endpoint.key_env else ()
        self.api = ApiEnv(
            title=f"endpoint {name!r}",
            credentials=self.env_names,
            base_url="",  # none: the URL is the setting's
            default_url=endpoint.base_url,
        )

    @property
    def preload(self) -> tuple[str, ...]:
        return _wire_provider(self.endpoint.wire).preload

    def portable(self, model_id: str) -> str:
        return model_id

    def fixed(self, model_id: str) -> Model | None:
        return None

    def missing(self) -> str | None:
        key_env = self.endpoint.key_env
        if key_env and not os.environ.get(key_env):
            return f"endpoint {self.name!r} has no key: set {key_env} (its key_env)"
        return _wire_provider(self.endpoint.wire).missing_sdk()

    def target(self) -> Target:
        key_env = self.endpoint.key_env
        return Target(
            title=self.api.title,
            base_url=self.endpoint.base_url,
            key=os.environ.get(key_env, "") if key_env else "",
            key_name=key_env or f"key_env of [endpoints.{self.name}] (none is set)",
            url_name=f"base_url of [endpoints.{self.name}]",
            own_env=False,
            missing=self.missing(),
        )

    def open(self) -> Session:
        wire = importlib.import_module(WIRES[self.endpoint.wire])
        opened: Callable[[Target], Session] = wire.open_target
        return opened(self.target())


class _Wire(Protocol):
    @property
    def preload(self) -> tuple[str, ...]: ...

    def missing_sdk(self) -> str | None: ...


def _wire_provider(wire: str) -> _Wire:
    found: _Wire = importlib.import_module(WIRES[wire]).PROVIDER
    return found


def named_endpoints(endpoints: Endpoints | None) -> dict[str, EndpointProvider]:
    """The named endpoints' providers by prefix (``NAME/``); a name that is not one word or
    is a built-in provider's is a UsageError."""
    taken = {p.rstrip(":/") for p in PROVIDERS}
    named: dict[str, EndpointProvider] = {}
    for name, endpoint in (endpoints or {}).items():
        if not _NAME.fullmatch(name) or name in taken:
            why = "a built-in provider's" if name in taken else "not a plain name"
            raise UsageError(
                f"[endpoints.{name}]: the name is {why}; give it another (letters, digits, "
                f"'.', '_', '-'; not {', '.join(sorted(taken))})"
            )
        named[f"{name}/"] = EndpointProvider(name, endpoint)
    return named


def route(spec: str, endpoints: Endpoints | None = None) -> Route:
    """Which provider serves ``spec`` (aliases resolved already), and its name there:
    a built-in prefix, else a named endpoint of ``endpoints`` (the settings')."""
    for prefix in PROVIDERS:
        if spec.startswith(prefix):
            return Route(prefix, provider(prefix), spec.removeprefix(prefix))
    named = named_endpoints(endpoints)
    for prefix, found in named.items():
        if spec.startswith(prefix):
            return Route(prefix, found, spec.removeprefix(prefix))
    if match := _PREFIX.match(spec):
        known = ", ".join(f"{p}ID" if p.endswith("/") else f"{p}FILE" for p in PROVIDERS)
        known += "".join(f", {p}ID" for p in named)
        raise UsageError(
            f"model {spec!r}: unknown provider {match.group()!r}; known: {known} "
            f"([endpoints.NAME] in the settings adds NAME/ID; an id or alias without a "
            f"prefix goes to {DEFAULT}; write {DEFAULT}{spec} to send it whole)"
        )
    return Route(DEFAULT, provider(DEFAULT), spec)


def _builtin(spec: str) -> Route | None:
    """The route of ``spec`` among the built-in providers; None for any other prefix (a
    named endpoint's, or an unknown one: the run fails on that, with one line)."""
    try:
        return route(spec)
    except UsageError:
        return None


def whole_run(spec: str) -> bool:
    """True if ``spec``'s one model answers every agent of the run (see :class:`Provider`);
    False for a named endpoint's or an unknown prefix."""
    found = _builtin(spec)
    return found is not None and found.provider.whole_run


def reads_host(spec: str) -> bool:
    """True if ``spec``'s model reads a file on the host (a script, ``scripted:FILE``): a
    repository's settings may name one only once trusted (``trust.py``)."""
    return whole_run(spec)


def portable(spec: str) -> str:
    """``spec`` as a detached process reads it (a script's path made absolute)."""
    found = _builtin(spec)
    if found is None:
        return spec
    prefix = found.prefix if spec.startswith(found.prefix) else ""
    return prefix + found.provider.portable(found.model_id)


def _each(attribute: Callable[[Provider], tuple[str, ...]]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(name for p in providers() for name in attribute(p)))


def env_names(endpoints: Endpoints | None = None) -> tuple[str, ...]:
    """The variables any provider's client reads (and each named endpoint's key variable)."""
    return (*_each(lambda p: p.env_names), *endpoint_keys(endpoints))


def endpoint_keys(endpoints: Endpoints | None) -> tuple[str, ...]:
    """The key variable of each named endpoint: never in a sandbox, a hook or the store."""
    found = (e.key_env for e in (endpoints or {}).values() if e.key_env)
    return tuple(dict.fromkeys(found))


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


def api_env(spec: str, endpoints: Endpoints | None = None) -> ApiEnv:
    """The API settings of the provider of ``spec``, or of :data:`DEFAULT`'s when that
    provider has no API (a script). Raises UsageError for an unknown prefix. A named
    endpoint's has no ``base_url`` variable: its ``default_url`` is the setting."""
    for each in (route(spec, endpoints).provider, provider(DEFAULT)):
        if each.api is not None:
            return each.api
    raise UsageError(f"no model provider with an API for {spec!r}")
