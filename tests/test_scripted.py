"""The scripted model is strict: it says exactly where a script and a run disagree."""

from __future__ import annotations

import asyncio

import pytest

from orchestrator.models import ModelRequest, ScriptedModel, ScriptError


def req(
    agent: str = "general",
    prompt: str = "hello",
    run_id: str = "r1",
    depth: int = 0,
    messages: list[dict[str, object]] | None = None,
) -> ModelRequest:
    return ModelRequest(
        system="s",
        messages=messages or [{"role": "user", "content": prompt}],
        tools=[],
        model="m",
        max_tokens=10,
        agent=agent,
        run_id=run_id,
        depth=depth,
    )


def test_conversations_are_keyed_per_agent_and_prompt() -> None:
    model = ScriptedModel.from_yaml(
        """
conversations:
  - agent: explorer
    prompt: "alpha"
    turns: [{text: "A"}]
  - agent: explorer
    prompt: "beta"
    turns: [{text: "B"}]
  - agent: general
    turns: [{text: "G"}]
"""
    )

    async def go() -> list[str]:
        # the order of arrival does not matter: each run finds its own conversation
        b = await model.complete(req("explorer", "do beta", "r2", 1))
        g = await model.complete(req("general", "x", "r0"))
        a = await model.complete(req("explorer", "do alpha", "r1", 1))
        return [a.text, b.text, g.text]

    assert asyncio.run(go()) == ["A", "B", "G"]
    assert model.problems() == []


def test_unexpected_call_names_the_agent_and_the_conversations() -> None:
    model = ScriptedModel.from_yaml(
        "conversations:\n  - agent: general\n    turns: [{text: x}]\n", "s.yaml"
    )
    with pytest.raises(ScriptError) as e:
        asyncio.run(model.complete(req("explorer", "find things", "r9", 1)))
    msg = str(e.value)
    assert "s.yaml" in msg and "'explorer'" in msg and "depth 1" in msg
    assert "find things" in msg and "#1 (agent=general)" in msg


def test_run_asking_past_its_turns_is_an_error() -> None:
    model = ScriptedModel.from_yaml(
        "conversations:\n  - turns:\n    - tool_calls: [{tool: glob, input: {pattern: '*'}}]\n"
    )
    asyncio.run(model.complete(req()))
    with pytest.raises(ScriptError, match="has 1 turns, but run r1 asked for turn 2"):
        asyncio.run(model.complete(req()))


def test_malformed_step_is_reported_with_its_location() -> None:
    with pytest.raises(ScriptError, match=r"conversations\.0\.turns\.1\.tool_calls\.0\.tool"):
        ScriptedModel.from_yaml(
            "conversations:\n  - turns:\n    - text: ok\n    - tool_calls: [{input: {}}]\n"
        )
    with pytest.raises(ScriptError, match=r"s\.yaml:3: not valid YAML"):
        ScriptedModel.from_yaml("conversations:\n  - turns:\n   - [unclosed\n", "s.yaml")
    with pytest.raises(ScriptError, match="turns.0.txt: Extra inputs"):
        ScriptedModel.from_yaml("conversations:\n  - turns: [{txt: typo}]\n")


def test_unconsumed_turns_and_runs_are_reported() -> None:
    model = ScriptedModel.from_yaml(
        "conversations:\n  - agent: general\n    turns: [{text: a}, {text: b}]\n"
        "  - agent: explorer\n    runs: 2\n    turns: [{text: c}]\n"
    )
    asyncio.run(model.complete(req()))
    problems = model.problems()
    assert any("expected 2 run(s), served 0" in p for p in problems)
    assert any("run r1 stopped after turn 1 of 2" in p for p in problems)
    with pytest.raises(ScriptError, match="not fully used"):
        model.verify()


def test_expect_result_checks_what_the_tools_returned() -> None:
    model = ScriptedModel.from_yaml(
        "conversations:\n  - turns:\n    - tool_calls: [{tool: glob}]\n"
        "    - expect_result: 'pyproject'\n      text: done\n"
    )
    asyncio.run(model.complete(req()))
    later = req(
        messages=[
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": []},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "x", "content": "README.md"}],
            },
        ]
    )
    with pytest.raises(ScriptError, match="expected the previous results to match /pyproject/"):
        asyncio.run(model.complete(later))
