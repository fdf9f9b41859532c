"""A model that sends malformed content: the model layer passes it on and never raises.

Through the real `anthropic` SDK against the fake Messages API (tests/fakeapi.py), and
through the scripted model. What becomes of such a block (a tool error for a non-object
input) is the agent loop's business; here only: it arrives, exactly as sent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import anthropic
import pytest

from orchestrator.models.anthropic import AnthropicModel
from orchestrator.models.base import ModelRequest, ModelResponse
from orchestrator.models.scripted import ScriptedModel
from tests.fakeapi import FakeAPI, serve


def _request(run_id: str = "r1") -> ModelRequest:
    return ModelRequest(
        system="s",
        messages=[{"role": "user", "content": "go"}],
        tools=[],
        model="claude-test",
        max_tokens=64,
        run_id=run_id,
    )


class Replies:
    """The fake API answers with whatever reply the test sets next."""

    def __init__(self) -> None:
        self.reply: dict[str, Any] = {}
        self.base_url = ""

    def __call__(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.reply


@pytest.fixture(scope="module")
def replies() -> Iterator[Replies]:
    r = Replies()
    with serve(FakeAPI(r)) as running:  # one server: its shutdown takes half a second
        r.base_url = running.base_url
        yield r


def _complete(
    replies: Replies, content: Any, stop_reason: Any = "tool_use", **extra: Any
) -> ModelResponse:
    replies.reply = {"content": content, "stop_reason": stop_reason, **extra}

    async def go() -> ModelResponse:
        client = anthropic.AsyncAnthropic(
            api_key="sk-test-fake", base_url=replies.base_url, max_retries=0
        )
        try:
            return await AnthropicModel(client, "claude-test").complete(_request())
        finally:
            await client.close()

    assert replies.base_url.startswith("http://127.0.0.1:")
    return asyncio.run(go())


HOSTILE_INPUTS = {
    "string": "rm -rf /",
    "json in a string": '{"command": "ls"}',
    "list": ["ls", "-la"],
    "number": 42,
    "float": 1.5,
    "bool": True,
    "null": None,
    "empty object": {},
    "nested object": {"command": "ls", "extra": [1, {"deep": None}]},
}


@pytest.mark.parametrize("raw", HOSTILE_INPUTS.values(), ids=HOSTILE_INPUTS.keys())
def test_tool_use_input_arrives_exactly_as_sent(replies: Replies, raw: Any) -> None:
    response = _complete(
        replies, [{"type": "tool_use", "id": "toolu_1", "name": "bash", "input": raw}]
    )
    assert response.content == [{"type": "tool_use", "id": "toolu_1", "name": "bash", "input": raw}]
    assert response.tool_uses == response.content
    assert type(response.tool_uses[0]["input"]) is type(raw)  # 1.5 stays a float, True a bool
    assert response.stop_reason == "tool_use" and response.text == ""


def test_missing_fields_stay_missing(replies: Replies) -> None:
    """No id, no name, no input: the block says so (absent), it does not invent values."""
    content = [
        {"type": "tool_use", "name": "bash", "input": {"command": "ls"}},
        {"type": "tool_use", "id": "toolu_2", "input": {"command": "ls"}},
        {"type": "tool_use", "id": "toolu_3", "name": "bash"},
        {"type": "tool_use"},
        {"type": "tool_use", "id": None, "name": None, "input": None},
        {"type": "tool_use", "id": 7, "name": ["bash"], "input": "x"},
    ]
    response = _complete(replies, content)
    assert response.content == content
    assert len(response.tool_uses) == len(content)


def test_duplicate_tool_use_ids_pass_through(replies: Replies) -> None:
    content = [
        {"type": "text", "text": "twice"},
        {"type": "tool_use", "id": "toolu_same", "name": "bash", "input": {"command": "a"}},
        {"type": "tool_use", "id": "toolu_same", "name": "bash", "input": {"command": "b"}},
        {"type": "tool_use", "id": "toolu_same", "name": "read_file", "input": "c"},
    ]
    response = _complete(replies, content)
    assert response.content == content
    assert [b["input"] for b in response.tool_uses] == [{"command": "a"}, {"command": "b"}, "c"]
    assert response.text == "twice"


@pytest.mark.parametrize(
    "content",
    [
        [{"type": "text"}],
        [{"type": "text", "text": None}],
        [{"type": "text", "text": 12}],
        ["a bare string"],
        [None],
        [3],
        [{"no_type": True}],
        [{"type": "something_new", "data": 1}],
        [],
        None,
        "not a list",
    ],
    ids=repr,
)
def test_malformed_content_does_not_raise(replies: Replies, content: Any) -> None:
    response = _complete(replies, content, stop_reason=None)
    assert isinstance(response.content, list)
    assert all(isinstance(b, dict) for b in response.content)
    assert isinstance(response.text, str) and isinstance(response.raw_text, str)
    assert response.tool_uses == []
    assert response.stop_reason == "end_turn"


@pytest.mark.parametrize(
    "usage",
    [None, "lots", {}, {"input_tokens": "12", "output_tokens": None}, {"input_tokens": -3}],
    ids=repr,
)
def test_usage_that_is_not_a_count_is_zero(replies: Replies, usage: Any) -> None:
    response = _complete(replies, [{"type": "text", "text": "hi"}], "end_turn", usage=usage)
    assert response.text == "hi"
    assert (response.usage.input_tokens, response.usage.output_tokens) == (0, 0)


def test_response_properties_tolerate_any_block() -> None:
    response = ModelResponse(
        content=[
            {"type": "text", "text": "a"},
            {"type": "text"},
            {"type": "text", "text": None},
            {"type": "tool_use", "input": "x"},
            "stray",  # type: ignore[list-item]
            None,  # type: ignore[list-item]
            {"type": "text", "text": "b"},
        ]
    )
    assert response.text == "a\n\n\nb"
    assert response.raw_text == "ab"
    assert response.tool_uses == [{"type": "tool_use", "input": "x"}]


SCRIPT = """
conversations:
  - turns:
      - tool_calls:
          - {tool: bash, input: "rm -rf /"}
          - {tool: bash, input: [ls, -la]}
          - {tool: bash, input: 3}
          - {tool: bash, input: null}
          - {tool: bash, id: dup}
          - {tool: read_file, id: dup, input: {path: a}}
        blocks:
          - {type: tool_use, input: {command: ls}}
          - {type: tool_use, id: dup, name: bash, input: "x"}
      - text: done
"""


def test_scripted_model_sends_hostile_tool_calls_as_written() -> None:
    model = ScriptedModel.from_yaml(SCRIPT, "hostile")
    response = asyncio.run(model.complete(_request()))
    inputs = [b.get("input", "<absent>") for b in response.tool_uses]
    assert inputs == ["rm -rf /", ["ls", "-la"], 3, None, {}, {"path": "a"}, {"command": "ls"}, "x"]
    assert [b.get("id") for b in response.tool_uses][4:] == ["dup", "dup", None, "dup"]
    assert "name" not in response.tool_uses[6] and "id" not in response.tool_uses[6]
    assert response.stop_reason == "tool_use"
    assert asyncio.run(model.complete(_request())).text == "done"
    model.verify()
