"""Model providers chosen by a spec's prefix: the routing (built-in prefixes and the
settings' named endpoints), the unknown-prefix error (also through the CLI), what a provider
tells the rest of orch, a provider added by one module and one registry line, and the SDK
imported only when a model is built."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from orchestrator.bwrap.profile import is_secret_name
from orchestrator.config import DEFAULT_SECRET_PATTERNS, Settings
from orchestrator.errors import UsageError
from orchestrator.models import Model, ModelProvider, ModelRequest, ModelResponse, registry
from orchestrator.models.anthropic import AnthropicModel
from orchestrator.models.config import Endpoint
from orchestrator.models.scripted import ScriptedModel
from orchestrator.policy.checks import scrubbed_env
from tests.fakeapi import FakeAPI, serve, text_reply
from tests.support import init_repo, orch, write_script

KNOWN = ("scripted:FILE", "anthropic/ID", "openai/ID", "openrouter/ID")


def _request(model: str) -> ModelRequest:
    messages = [{"role": "user", "content": "go"}]
    return ModelRequest(system="s", messages=messages, tools=[], model=model, max_tokens=16)


@pytest.mark.parametrize(
    ("spec", "provider", "model_id"),
    [
        ("claude-sonnet-4-5", "anthropic", "claude-sonnet-4-5"),
        ("anthropic/claude-sonnet-4-5", "anthropic", "claude-sonnet-4-5"),
        ("anthropic/openai/gpt-4o", "anthropic", "openai/gpt-4o"),  # a proxy's id, sent whole
        ("anthropic.claude-v2:1", "anthropic", "anthropic.claude-v2:1"),  # no prefix: a dot
        ("scripted:/tmp/s.yaml", "scripted", "/tmp/s.yaml"),
        ("scripted:rel/s.yaml", "scripted", "rel/s.yaml"),
        ("openai/gpt-4o", "openai", "gpt-4o"),
        ("openrouter/anthropic/claude-sonnet-4.5", "openrouter", "anthropic/claude-sonnet-4.5"),
    ],
)
def test_a_spec_goes_to_the_provider_of_its_prefix(spec: str, provider: str, model_id: str) -> None:
    route = registry.route(spec)
    assert (route.provider.name, route.model_id) == (provider, model_id)


@pytest.mark.parametrize("spec", ["mistral/large", "gemini:pro", "bedrock/anthropic.claude"])
def test_an_unknown_prefix_is_one_line_naming_the_known_ones(spec: str) -> None:
    with pytest.raises(UsageError) as caught:
        registry.route(spec)
    message = str(caught.value)
    assert "\n" not in message and repr(spec) in message
    assert all(k in message for k in KNOWN), message
    assert f"anthropic/{spec}" in message  # how to send such an id whole
    with pytest.raises(UsageError):
        ModelProvider(Settings(), spec)
    with pytest.raises(UsageError):
        ModelProvider(Settings(model=spec))


def test_aliases_and_ids_keep_working_and_an_agents_model_is_checked() -> None:
    settings = Settings(model_aliases={"sonnet": "claude-sonnet-4-5", "fast": "anthropic/x-1"})
    assert ModelProvider(settings).default == "claude-sonnet-4-5"  # the setting: sonnet
    assert ModelProvider(settings, "claude-opus-4-5").default == "claude-opus-4-5"
    provider = ModelProvider(settings, "fast")
    assert provider.default == "anthropic/x-1" and provider.fixed is None
    assert provider.resolve("sonnet") == "claude-sonnet-4-5"
    assert provider.resolve(None) == "anthropic/x-1"
    with pytest.raises(UsageError, match="unknown provider 'mistral/'"):
        provider.resolve("mistral/large")
    assert provider.resolve("openai/gpt-4o") == "openai/gpt-4o"
    model = provider.get("anthropic/x-1")
    assert isinstance(model, AnthropicModel) and model.model_id == "x-1"
    assert provider.get("x-1") is not model and provider.get("anthropic/x-1") is model
    asyncio.run(provider.aclose())


def test_a_scripted_spec_plays_for_every_agent(tmp_path: Path) -> None:
    script = write_script(tmp_path, {"conversations": [{"turns": [{"text": "hi"}]}]})
    provider = ModelProvider(Settings(), f"scripted:{script}")
    assert provider.default == "scripted" and isinstance(provider.scripted, ScriptedModel)
    assert provider.get("claude-opus-4-5") is provider.scripted
    assert provider.resolve("openai/gpt-4o") == "openai/gpt-4o"  # not asked: the script plays
    provider.check_ready()  # no key needed
    with pytest.raises(UsageError, match="whole run"):
        registry.provider("scripted:").open()


def test_the_prefix_is_not_sent_to_the_api(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeAPI(lambda body: text_reply("done"))
    with serve(fake) as running:
        monkeypatch.setenv("ANTHROPIC_BASE_URL", running.base_url)
        monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-test-fake")

        async def go() -> ModelResponse:
            async with ModelProvider(Settings(), "anthropic/claude-test") as provider:
                provider.check_ready()
                return await provider.get(provider.default).complete(_request(provider.default))

        assert asyncio.run(go()).text == "done"
        assert [body["model"] for body in running.requests] == ["claude-test"]


def test_the_anthropic_provider_needs_a_key_or_a_base_url(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "ANTHROPIC_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(UsageError, match="ANTHROPIC_API_KEY"):
        ModelProvider(Settings(), "anthropic/claude-test").check_ready()
    monkeypatch.setenv("ANTHROPIC_BASE_URL", "http://127.0.0.1:9")
    ModelProvider(Settings(), "anthropic/claude-test").check_ready()


def test_what_providers_tell_the_rest_of_orch() -> None:
    names = registry.env_names()
    assert {"ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN", "ANTHROPIC_BASE_URL"} <= set(names)
    assert {"OPENAI_API_KEY", "OPENAI_BASE_URL", "OPENROUTER_API_KEY"} <= set(names)
    assert registry.secret_prefixes() == ("ANTHROPIC_", "OPENAI_", "OPENROUTER_")
    for prefix in registry.secret_prefixes():  # scrubbed from hooks and commands
        assert f"{prefix}*" in DEFAULT_SECRET_PATTERNS
    assert all(is_secret_name(n) for n in (*names, "ANTHROPIC_MODEL"))  # never in a sandbox
    assert {"anthropic", "openai"} <= set(registry.preload_modules())
    api = registry.api_env("scripted:x.yaml")  # a script has no API: the default's is checked
    assert api.base_url == "ANTHROPIC_BASE_URL" and api.default_url.startswith("https://")


# -- a provider added by one module (this one) and one registry line ----------------------


class EchoModel:
    def __init__(self, model_id: str) -> None:
        self.model_id = model_id

    async def complete(self, request: ModelRequest) -> ModelResponse:
        text = f"{self.model_id}: {request.system}"
        return ModelResponse(content=[{"type": "text", "text": text}])


class EchoSession:
    closed = 0

    def model(self, model_id: str) -> Model:
        return EchoModel(model_id)

    async def aclose(self) -> None:
        EchoSession.closed += 1


class EchoProvider:
    name = "echo"
    env_prefix = "ECHO_"
    env_names = ("ECHO_URL",)
    preload = ("json",)
    api = None
    whole_run = False

    def portable(self, model_id: str) -> str:
        return model_id

    def fixed(self, model_id: str) -> Model | None:
        return None

    def missing(self) -> str | None:
        return None

    def open(self) -> EchoSession:
        return EchoSession()


PROVIDER: registry.Provider = EchoProvider()


def test_a_new_provider_is_one_module_and_one_registry_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(registry.PROVIDERS, "echo/", __name__)
    assert "ECHO_URL" in registry.env_names() and "ECHO_" in registry.secret_prefixes()
    assert "json" in registry.preload_modules()
    assert not registry.whole_run("echo/one") and registry.portable("echo/one") == "echo/one"
    with pytest.raises(UsageError, match="echo/ID"):
        registry.route("other/x")

    async def go() -> str:
        async with ModelProvider(Settings(), "echo/one") as provider:
            provider.check_ready()
            first = await provider.get(provider.default).complete(_request("echo/one"))
            other = await provider.get("echo/two").complete(_request("echo/two"))
            return f"{first.text} | {other.text}"

    closed = EchoSession.closed
    assert asyncio.run(go()) == "one: s | two: s"
    assert EchoSession.closed == closed + 1  # one session for the provider, closed once


# -- the edges ----------------------------------------------------------------------------


def test_the_cli_says_an_unknown_prefix_in_one_line(project: Path) -> None:
    repo = init_repo(project)
    r = orch("task", "Say hi", "--model", "mistral/large", cwd=repo)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "unknown provider 'mistral/'" in r.stderr and all(k in r.stderr for k in KNOWN)


def test_the_doctor_names_a_model_setting_of_an_unknown_provider(project: Path) -> None:
    repo = init_repo(project)
    r = orch("doctor", "--json", "--offline", cwd=repo, env={"ORCH_MODEL": "mistral/large"})
    assert "Traceback" not in r.stderr, r.stderr
    checks = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
    assert checks["api"]["status"] == "fail" and checks["endpoint"]["status"] == "skip"
    assert "unknown provider 'mistral/'" in checks["api"]["detail"]
    assert "ORCH_MODEL" in checks["api"]["fix"]


def test_importing_orch_does_not_import_the_sdk() -> None:
    code = (
        "import sys, orchestrator.models, orchestrator.config, orchestrator.bwrap.profile\n"
        "from orchestrator.models import ModelProvider\n"
        "from orchestrator.config import Settings\n"
        "p = ModelProvider(Settings())\n"
        "print('anthropic' in sys.modules, 'openai' in sys.modules)\n"
        "p.get(p.default)\n"
        "print('anthropic' in sys.modules, 'openai' in sys.modules)\n"
        "p.get('openai/gpt-4o')\n"
        "print('openai' in sys.modules)\n"
    )
    env = {"PATH": "/usr/bin:/bin", "ANTHROPIC_API_KEY": "sk-test-fake", "OPENAI_API_KEY": "sk-x"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False", "True", "False", "True"]


def test_the_cli_and_the_doctor_name_an_endpoints_missing_key(project: Path) -> None:
    repo = init_repo(project)
    config = Path.home() / ".orch" / "config.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(
        '[endpoints.local]\nbase_url = "http://127.0.0.1:9/v1"\nkey_env = "LOCAL_LLM_KEY"\n'
    )
    env = {"LOCAL_LLM_KEY": "", "OPENAI_API_KEY": "", "OPENAI_BASE_URL": ""}
    r = orch("task", "Say hi", "--model", "local/llama", cwd=repo, env=env)
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "endpoint 'local' has no key: set LOCAL_LLM_KEY" in r.stderr
    r = orch("task", "Say hi", "--model", "openai/gpt-4o", cwd=repo, env=env)
    assert r.returncode != 0 and "set OPENAI_API_KEY" in r.stderr, r.stderr
    r = orch("doctor", "--json", "--offline", cwd=repo, env={**env, "ORCH_MODEL": "local/llama"})
    checks = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
    assert "LOCAL_LLM_KEY not set" in checks["api"]["detail"], checks["api"]


def test_a_script_plays_the_whole_run_and_travels_as_an_absolute_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the CLI and the worker host ask of a model spec, answered by its provider."""
    monkeypatch.chdir(tmp_path)
    assert registry.whole_run("scripted:s.yaml") and not registry.whole_run("claude-x")
    assert registry.portable("scripted:s.yaml") == f"scripted:{tmp_path / 's.yaml'}"
    assert registry.portable("anthropic/claude-x") == "anthropic/claude-x"
    assert registry.portable("claude-x") == "claude-x"  # no prefix added


# -- named endpoints ([endpoints.NAME]) ---------------------------------------------------

LOCAL_KEY = "sk-local-KEY-2222"


def _local(url: str = "http://127.0.0.1:9/v1", **kw: Any) -> dict[str, Endpoint]:
    return {"local": Endpoint(base_url=url, key_env=kw.pop("key_env", "LOCAL_LLM_KEY"), **kw)}


@pytest.fixture
def no_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "OPENROUTER_API_KEY", "LOCAL_LLM_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("OPENROUTER_BASE_URL", raising=False)


def test_a_named_endpoint_routes_and_says_which_variable_is_missing(
    monkeypatch: pytest.MonkeyPatch, no_keys: None
) -> None:
    settings = Settings(endpoints=_local())
    found = registry.route("local/llama3:8b", settings.endpoints)
    assert (found.provider.name, found.model_id) == ("local", "llama3:8b")
    assert registry.env_names(settings.endpoints)[-1] == "LOCAL_LLM_KEY"
    assert not registry.whole_run("local/llama") and registry.portable("local/x") == "local/x"
    with pytest.raises(UsageError) as caught:
        registry.route("local/llama")  # no such endpoint without the settings
    assert "\n" not in str(caught.value) and "[endpoints.NAME]" in str(caught.value)
    with pytest.raises(UsageError, match=r"known: .*openrouter/ID, local/ID"):
        ModelProvider(settings, "other/llama")
    with pytest.raises(UsageError, match="set LOCAL_LLM_KEY"):
        ModelProvider(settings, "local/llama").check_ready()
    monkeypatch.setenv("LOCAL_LLM_KEY", LOCAL_KEY)
    ModelProvider(settings, "local/llama").check_ready()
    with pytest.raises(UsageError, match="set OPENAI_API_KEY"):
        ModelProvider(settings, "openai/gpt-4o").check_ready()
    with pytest.raises(UsageError, match="set OPENROUTER_API_KEY"):
        ModelProvider(settings, "openrouter/x/y").check_ready()
    with pytest.raises(UsageError, match="built-in provider"):
        ModelProvider(Settings(endpoints={"openai": Endpoint(base_url="http://h")}))
    keyless = Settings(endpoints=_local(key_env=None))
    ModelProvider(keyless, "local/llama").check_ready()  # a local server may need no key


def test_the_doctor_names_a_named_endpoints_key(
    monkeypatch: pytest.MonkeyPatch, no_keys: None
) -> None:
    from orchestrator.doctor.machine import check_api, check_endpoint

    endpoints = _local("http://user:pw@127.0.0.1:9/v1")
    check = check_api("local/llama", endpoints)
    assert check.status.value == "warn" and "LOCAL_LLM_KEY not set" in check.detail
    assert check.fix == "export LOCAL_LLM_KEY=..." and "pw" not in check.detail
    monkeypatch.setenv("LOCAL_LLM_KEY", LOCAL_KEY)
    check = check_api("local/llama", endpoints)
    assert check.status.value == "ok" and LOCAL_KEY not in check.detail
    probed: list[str] = []
    check_endpoint(False, lambda url, t: probed.append(url), "local/llama", endpoints)
    assert probed == ["http://127.0.0.1:9/v1"]
    assert "OPENAI_API_KEY" in check_api("openai/gpt-4o").detail


def test_a_key_variable_that_looks_ordinary_is_scrubbed_too() -> None:
    settings = Settings(endpoints=_local(key_env="LLAMA_ACCESS"))
    env = scrubbed_env(settings, {"LLAMA_ACCESS": LOCAL_KEY, "PATH": "/bin"})
    assert env == {"PATH": "/bin"}
