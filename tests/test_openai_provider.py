"""The Chat Completions wire and its endpoints (``openai/``, ``openrouter/``, a named
``[endpoints.NAME]``), through the real `openai` SDK against a fake server on loopback:
the conversions both ways, usage with cached tokens, errors and retries, and a delegating
chain that mixes three endpoints, each request carrying its own endpoint's key only."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from orchestrator.catalog.definitions import load_catalog
from orchestrator.config import Settings
from orchestrator.errors import UsageError
from orchestrator.models import ModelProvider, ModelRequest, ModelResponse, pricing
from orchestrator.models import openai as wire
from orchestrator.models.base import ContextOverflow, ModelError
from orchestrator.models.config import Endpoint, Price
from orchestrator.run import RunStatus
from orchestrator.spec import RunSpec
from orchestrator.store import open_store
from tests import fakeapi
from tests.fakeopenai import FakeChat, serve, system_text, text_reply, tool_reply

OPENAI_KEY = "sk-openai-KEY-1111"
LOCAL_KEY = "sk-local-KEY-2222"
ANTHROPIC_KEY = "sk-ant-KEY-3333"
ROUTER_KEY = "sk-or-KEY-4444"
KEYS = (OPENAI_KEY, LOCAL_KEY, ANTHROPIC_KEY, ROUTER_KEY)


@pytest.fixture(autouse=True)
def _no_chat_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "OPENAI_API_KEY",
        "OPENAI_BASE_URL",
        "OPENAI_ORG_ID",
        "OPENAI_PROJECT_ID",
        "OPENAI_ADMIN_KEY",
        "OPENAI_CUSTOM_HEADERS",
        "OPENROUTER_API_KEY",
        "OPENROUTER_BASE_URL",
        "LOCAL_LLM_KEY",
    ):
        monkeypatch.delenv(name, raising=False)


def _request(messages: list[dict[str, Any]] | None = None, **kw: Any) -> ModelRequest:
    return ModelRequest(
        system=kw.pop("system", "You help."),
        messages=messages or [{"role": "user", "content": "go"}],
        tools=kw.pop("tools", []),
        model=kw.pop("model", "openai/gpt-4o"),
        max_tokens=kw.pop("max_tokens", 64),
    )


def _ask(settings: Settings, spec: str, request: ModelRequest) -> ModelResponse:
    async def go() -> ModelResponse:
        async with ModelProvider(settings, spec) as provider:
            return await provider.get(spec).complete(request)

    return asyncio.run(go())


# -- the conversions ---------------------------------------------------------------------

READ = {"name": "read_file", "description": "Read.", "input_schema": {"type": "object"}}


def test_a_conversation_becomes_chat_messages() -> None:
    request = _request(
        [
            {"role": "user", "content": "look"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "two at once"},
                    {"type": "tool_use", "id": "c1", "name": "read_file", "input": {"path": "a"}},
                    {"type": "tool_use", "id": "c2", "name": "bash", "input": "{broken"},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "c1", "content": "A"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "c2",
                        "content": [{"type": "text", "text": "bad input"}],
                        "is_error": True,
                    },
                    {"type": "text", "text": "note: 1 child running"},
                ],
            },
        ],
        tools=[READ],
    )
    body = wire.body(request, "gpt-4o")
    assert body["messages"] == [
        {"role": "system", "content": "You help."},
        {"role": "user", "content": "look"},
        {
            "role": "assistant",
            "content": "two at once",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "read_file", "arguments": '{"path": "a"}'},
                },
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "bash", "arguments": "{broken"},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "A"},
        {"role": "tool", "tool_call_id": "c2", "content": "[tool error] bad input"},
        {"role": "user", "content": "note: 1 child running"},
    ]
    assert body["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "read_file",
                "description": "Read.",
                "parameters": {"type": "object"},
            },
        }
    ]
    assert body["max_tokens"] == 64 and body["model"] == "gpt-4o"
    assert "prompt_cache_key" not in body  # a compatible server may refuse what it lacks
    official = wire.body(request, "gpt-4o", official=True)  # its reasoning models need this
    assert official["max_completion_tokens"] == 64 and "max_tokens" not in official
    stable = dataclasses.replace(request, stable_chars=4)  # the agent's own part: a cache key
    keys = {wire.body(stable, "m", official=True)["prompt_cache_key"] for _ in range(2)}
    assert len(keys) == 1 and "prompt_cache_key" not in official
    only_calls = wire.messages(
        _request([{"role": "assistant", "content": [request.messages[1]["content"][1]]}])
    )
    assert only_calls[1]["content"] is None and len(only_calls[1]["tool_calls"]) == 1


@pytest.mark.parametrize(
    ("finish", "stop"),
    [
        ("tool_calls", "tool_use"),
        ("length", "max_tokens"),
        ("stop", "end_turn"),
        (None, "end_turn"),
    ],
)
def test_a_completion_becomes_the_seams_response(finish: str | None, stop: str) -> None:
    completion = {
        "choices": [
            {
                "message": {"content": "hi", "tool_calls": []},
                "finish_reason": finish,
            }
        ],
        "usage": {
            "prompt_tokens": 2000,
            "completion_tokens": 7,
            "prompt_tokens_details": {"cached_tokens": 1536},
        },
    }
    response = wire.response(completion)
    assert response.stop_reason == stop and response.text == "hi"
    assert (response.usage.input_tokens, response.usage.cache_read_input_tokens) == (464, 1536)
    assert response.usage.output_tokens == 7 and response.usage.prompt_tokens == 2000


def test_tool_calls_keep_invalid_arguments_raw() -> None:
    calls = [
        {"id": "a", "function": {"name": "read_file", "arguments": '{"path": "x"}'}},
        {"id": "b", "function": {"name": "bash", "arguments": '{"command": "ls"'}},
        {"id": "c", "function": {"name": "glob", "arguments": ""}},
        {"id": "d", "function": {"name": "grep", "arguments": "[1, 2]"}},
    ]
    response = wire.response(
        {"choices": [{"message": {"content": None, "tool_calls": calls}, "finish_reason": "stop"}]}
    )
    assert [b.get("input") for b in response.tool_uses] == [
        {"path": "x"},
        '{"command": "ls"',  # the agent loop answers it with a tool error
        {},
        [1, 2],
    ]
    assert response.stop_reason == "tool_use" and response.usage.prompt_tokens == 0
    with pytest.raises(ModelError, match="no choice"):
        wire.response({"choices": [], "error": {"message": "upstream down"}})


# -- through the real SDK ------------------------------------------------------------------


def _tools_then_text(body: dict[str, Any]) -> dict[str, Any]:
    if not any(m["role"] == "tool" for m in body["messages"]):
        return tool_reply(("read_file", {"path": "a.txt"}), ("bash", {"command": "ls"}))
    return text_reply("done")


@pytest.fixture
def oai(monkeypatch: pytest.MonkeyPatch) -> Any:
    with serve(FakeChat(_tools_then_text, key=OPENAI_KEY)) as fake:
        monkeypatch.setenv("OPENAI_BASE_URL", fake.base_url)
        monkeypatch.setenv("OPENAI_API_KEY", OPENAI_KEY)
        yield fake


def test_parallel_tool_calls_and_usage_through_the_sdk(oai: FakeChat) -> None:
    response = _ask(Settings(), "openai/gpt-4o", _request(tools=[READ]))
    assert [(b["name"], b["input"]) for b in response.tool_uses] == [
        ("read_file", {"path": "a.txt"}),
        ("bash", {"command": "ls"}),
    ]
    assert response.stop_reason == "tool_use"
    body, usage = oai.answered[0]
    assert body["model"] == "gpt-4o" and body["max_tokens"] == 64  # a compatible server's
    assert body["tools"][0]["function"]["name"] == "read_file"
    assert response.usage.input_tokens == usage["prompt_tokens"] > 0
    assert response.usage.output_tokens == usage["completion_tokens"] > 0
    assert oai.headers[0]["authorization"] == f"Bearer {OPENAI_KEY}"


def test_a_long_prompt_reads_its_prefix_from_the_cache(oai: FakeChat) -> None:
    system = "You are careful. " * 400  # ≈ 1700 tokens: cacheable
    oai.responder = lambda body: text_reply("ok")
    first = _ask(Settings(), "openai/gpt-4o", _request(system=system))
    second = _ask(
        Settings(), "openai/gpt-4o", _request([{"role": "user", "content": "again"}], system=system)
    )
    assert first.usage.cache_read_input_tokens == 0
    cached = second.usage.cache_read_input_tokens
    assert cached >= 1024 and cached % 128 == 0
    assert second.usage.prompt_tokens == oai.answered[1][1]["prompt_tokens"]
    short = _ask(Settings(), "openai/gpt-4o", _request())
    again = _ask(Settings(), "openai/gpt-4o", _request())
    assert short.usage.cache_read_input_tokens == again.usage.cache_read_input_tokens == 0


def test_a_prompt_over_the_window_is_a_context_overflow(oai: FakeChat) -> None:
    oai.window = 100
    with pytest.raises(ContextOverflow) as caught:
        _ask(Settings(), "openai/gpt-4o", _request(system="x" * 2000))
    message = str(caught.value)
    assert "\n" not in message and message.startswith("model API error 400: ")
    assert "maximum context length is 100 tokens" in message


def test_the_sdk_retries_and_errors_are_one_line(
    oai: FakeChat, monkeypatch: pytest.MonkeyPatch
) -> None:
    oai.responder = lambda body: text_reply("made it")
    oai.fail_first = 3  # 429, 500, 503: the SDK retries them
    assert _ask(Settings(), "openai/gpt-4o", _request()).text == "made it"
    assert oai.served == 4

    oai.served, oai.fail_first, oai.faults = 0, 1000, (500,)
    with pytest.raises(ModelError, match=r"^model API error 500: injected$"):
        _ask(Settings(), "openai/gpt-4o", _request())

    oai.fail_first = 0
    monkeypatch.setenv("OPENAI_API_KEY", "sk-wrong-KEY-9999")
    with pytest.raises(ModelError) as caught:
        _ask(Settings(), "openai/gpt-4o", _request())
    assert "(401); check OPENAI_API_KEY" in str(caught.value)
    assert "9999" not in str(caught.value)

    monkeypatch.setattr(wire, "MAX_RETRIES", 0)
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")
    with pytest.raises(ModelError) as caught:
        _ask(Settings(), "openai/gpt-4o", _request())
    message = str(caught.value)
    assert "cannot reach the OpenAI API" in message and "check OPENAI_BASE_URL" in message
    assert "\n" not in message and "sk-wrong" not in message


def test_a_server_echoing_the_key_has_it_cut_from_the_error(oai: FakeChat) -> None:
    oai.fail_first, oai.faults = 1000, (400,)
    oai.fail_with = {"error": {"message": f"bad request from {OPENAI_KEY}", "code": None}}
    with pytest.raises(ModelError) as caught:
        _ask(Settings(), "openai/gpt-4o", _request())
    assert OPENAI_KEY not in str(caught.value) and "[key]" in str(caught.value)


def test_openrouter_sends_the_id_whole_with_its_own_key_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with serve(FakeChat(lambda body: text_reply("routed"), key=ROUTER_KEY)) as router:
        monkeypatch.setenv("OPENROUTER_BASE_URL", router.base_url)
        monkeypatch.setenv("OPENROUTER_API_KEY", ROUTER_KEY)
        monkeypatch.setenv("OPENAI_API_KEY", OPENAI_KEY)  # OpenAI's: never sent there
        monkeypatch.setenv("OPENAI_ORG_ID", "org-openai-only")
        monkeypatch.setenv("OPENAI_CUSTOM_HEADERS", f"X-Leak: {OPENAI_KEY}")
        spec = "openrouter/anthropic/claude-sonnet-4.5"
        assert _ask(Settings(), spec, _request(model=spec)).text == "routed"
        assert router.requests[0]["model"] == "anthropic/claude-sonnet-4.5"
        sent = json.dumps(router.headers)
        assert ROUTER_KEY in sent and OPENAI_KEY not in sent and "org-openai-only" not in sent
    assert pricing.split(spec) == ("openrouter", "anthropic/claude-sonnet-4.5")


def test_without_the_sdk_the_error_says_what_to_install(
    oai: FakeChat, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "openai", None)  # import openai: ImportError
    with pytest.raises(UsageError, match=r"pip install 'orch\[openai\]'"):
        ModelProvider(Settings(), "openai/gpt-4o").check_ready()
    with pytest.raises(ModelError, match=r"pip install 'orch\[openai\]'"):
        _ask(Settings(), "openai/gpt-4o", _request())


# -- a named endpoint on the Messages wire ----------------------------------------------


def _local(url: str = "http://127.0.0.1:9/v1", **kw: Any) -> dict[str, Endpoint]:
    return {"local": Endpoint(base_url=url, key_env=kw.pop("key_env", "LOCAL_LLM_KEY"), **kw)}


def test_a_named_anthropic_endpoint_gets_its_own_url_and_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", ANTHROPIC_KEY)
    monkeypatch.setenv("ANTHROPIC_AUTH_TOKEN", "tok-anthropic-only")
    monkeypatch.setenv("PROXY_KEY", LOCAL_KEY)
    with fakeapi.serve(fakeapi.FakeAPI(lambda body: fakeapi.text_reply("proxied"))) as proxy:
        endpoints = {
            "proxy": Endpoint(base_url=proxy.base_url, wire="anthropic", key_env="PROXY_KEY")
        }
        spec = "proxy/claude-x"
        assert _ask(Settings(endpoints=endpoints), spec, _request(model=spec)).text == "proxied"
        assert proxy.requests[0]["model"] == "claude-x"
        sent = json.dumps(proxy.headers)
        held = proxy.headers[0].get("x-api-key", "") + proxy.headers[0].get("authorization", "")
        assert LOCAL_KEY in held  # the header an SDK version puts it in
        assert ANTHROPIC_KEY not in sent and "tok-anthropic-only" not in sent


# -- a chain across three endpoints ------------------------------------------------------

AGENTS = {
    "lead": "openai/gpt-4o",
    "local-reader": "local/llama",
    "claude-checker": "claude-sonnet-4-5",
}


def _agent(body: dict[str, Any]) -> str:
    text = system_text(body) or fakeapi.system_text(body)
    return next(name for name in AGENTS if f"You are agent '{name}'" in text)


def _chat(body: dict[str, Any]) -> dict[str, Any]:
    turn = sum(m["role"] == "assistant" for m in body["messages"])
    if _agent(body) == "lead":
        if turn == 0:  # two calls at once: a read and a child on the local endpoint
            child = {
                "description": "local look",
                "subagent_type": "local-reader",
                "prompt": "Read notes.txt, show the environment, then ask the checker.",
            }
            return tool_reply(("read_file", {"path": "notes.txt"}), ("task", child))
        return text_reply("lead done")
    if turn == 0:
        return tool_reply(
            ("read_file", {"path": "notes.txt"}),
            ("bash", {"command": "env"}),
            ("read_file", '{"path": "notes.txt"'),  # invalid JSON: a tool error, not a crash
        )
    if turn == 1:
        check = {"description": "check", "subagent_type": "claude-checker", "prompt": "Check."}
        return tool_reply(("task", check))
    return text_reply("local done")


def _agent_files(root: Path) -> None:
    agents = root / ".orch" / "agents"
    agents.mkdir(parents=True)
    for name, model in AGENTS.items():
        (agents / f"{name}.md").write_text(
            f"---\nname: {name}\ndescription: The {name}.\nmodel: {model}\n---\n\nYou work.\n"
        )


def _tool_messages(fake: FakeChat, agent: str, turn: int) -> list[str]:
    """The tool results the agent's request of ``turn`` answered with (its last turn's)."""
    messages = [b for b, _ in fake.answered if _agent(b) == agent][turn]["messages"]
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return [m["content"] for m in messages[last:] if m["role"] == "tool"]


def test_a_chain_mixes_endpoints_and_each_keeps_its_key(
    project: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (project / "notes.txt").write_text("NOTES-7781\n")
    _agent_files(project)
    monkeypatch.setenv("OPENAI_API_KEY", OPENAI_KEY)
    monkeypatch.setenv("OPENAI_ORG_ID", "org-openai-only")
    monkeypatch.setenv("LOCAL_LLM_KEY", LOCAL_KEY)
    monkeypatch.setenv("ANTHROPIC_API_KEY", ANTHROPIC_KEY)
    anthropic_reply = fakeapi.FakeAPI(lambda body: fakeapi.text_reply("checker ok"))
    with (
        serve(FakeChat(_chat, key=OPENAI_KEY)) as oai,
        serve(FakeChat(_chat, key=LOCAL_KEY)) as local,
        fakeapi.serve(anthropic_reply) as anth,
    ):
        monkeypatch.setenv("OPENAI_BASE_URL", oai.base_url)
        monkeypatch.setenv("ANTHROPIC_BASE_URL", anth.base_url)
        settings = Settings(
            max_depth=2,
            endpoints=_local(local.base_url),
            prices={"local/llama": Price(input=1.0, output=2.0)},
            sandbox={"os": "off"},  # the command's environment is the scrubbed one, as is
        )
        store = open_store(project)
        provider = ModelProvider(settings)
        from orchestrator.engine.runner import Runner

        runner = Runner(
            settings=settings, store=store, catalog=load_catalog(project), models=provider
        )

        async def go() -> Any:
            async with provider:
                spec = RunSpec(prompt="Lead the look.", workdir=project, agent="lead")
                return await asyncio.wait_for(runner.run(spec), 300)

        root = asyncio.run(go())
        assert root.status == RunStatus.SUCCEEDED, root.error
        assert root.output == "lead done"

        # each endpoint got its own agent's requests, the model id without its prefix
        assert {(_agent(b), b["model"]) for b in oai.requests} == {("lead", "gpt-4o")}
        assert {(_agent(b), b["model"]) for b in local.requests} == {("local-reader", "llama")}
        assert {b["model"] for b in anth.requests} == {"claude-sonnet-4-5"}
        # ...with its own key, and nothing of another's
        for fake, own in ((oai, OPENAI_KEY), (local, LOCAL_KEY), (anth, ANTHROPIC_KEY)):
            sent = json.dumps(fake.headers) + json.dumps(fake.requests)
            assert own in sent and not [k for k in KEYS if k != own and k in sent]
        assert "org-openai-only" not in json.dumps(local.headers)

        # the tools ran: a read, the command's environment without any key, a tool error
        lead_results = _tool_messages(oai, "lead", 1)
        assert "NOTES-7781" in lead_results[0] and "local done" in lead_results[1]
        notes, env, bad = _tool_messages(local, "local-reader", 1)
        assert "NOTES-7781" in notes and "[tool error]" in bad
        assert "ORCH_DEPTH=1" in env and not [k for k in KEYS if k in env]
        assert "LOCAL_LLM_KEY" not in env and "OPENAI_" not in env
        assert "checker ok" in _tool_messages(local, "local-reader", 2)[0]

    runs = {r.agent: r for r in store.list_runs(chain_id=root.chain_id)}
    assert {a: r.model for a, r in runs.items()} == AGENTS
    for agent, fake in (("lead", oai), ("local-reader", local)):
        usage = runs[agent].usage
        reported = [u for b, u in fake.answered if _agent(b) == agent]
        cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in reported)
        assert usage.cache_read_input_tokens == cached
        assert usage.input_tokens == sum(u["prompt_tokens"] for u in reported) - cached > 0
        assert usage.output_tokens == sum(u["completion_tokens"] for u in reported) > 0
    assert runs["lead"].usage.cache_read_input_tokens > 0  # its second request: the prefix
    checker = runs["claude-checker"].usage
    assert checker.output_tokens > 0 and checker.cost_usd > 0
    # dollars: OpenAI's table for the lead, [prices."local/llama"] for the local model
    assert runs["lead"].usage.cost_usd > 0
    local_usage = runs["local-reader"].usage
    expected = (
        local_usage.input_tokens * 1.0
        + local_usage.output_tokens * 2.0
        + local_usage.cache_read_input_tokens * 0.1
    ) / 1e6
    assert local_usage.cost_usd == pytest.approx(expected)

    # no key anywhere orch keeps anything: records, events, transcripts, outputs, files
    kept = ""
    for run in runs.values():
        kept += run.model_dump_json() + json.dumps(store.events(run.run_id), default=str)
        kept += json.dumps(store.transcript(run.run_id)) + (store.output(run.run_id) or "")
    assert "NOTES-7781" in kept and not [k for k in KEYS if k in kept]
    store.close()
    for path in (project, Path.home()):
        for file in path.rglob("*"):
            if file.is_file():
                data = file.read_bytes()
                assert not [k for k in KEYS if k.encode() in data], file
