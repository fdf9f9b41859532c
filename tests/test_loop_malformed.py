"""Malformed tool calls: each one is a tool error the model sees, and the run goes on.

Inputs of the wrong type, bad fields, unknown or non-string or huge names, huge inputs,
missing and repeated ids, blocks that are not objects: nothing raises out of the loop,
events stay small, and the next request is a valid Messages API conversation (every
tool_result answers exactly one tool_use of the assistant message before it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from orchestrator.engine.calls import EVENT_TEXT, capped, summarize_input
from orchestrator.models.base import ModelResponse
from orchestrator.run import RunStatus
from tests.loopkit import Loop, conversation_problems, loop

Call = dict[str, Any]


def use(name: Any = "read_file", input: Any = None, id: Any = None, **extra: Any) -> Call:
    """A tool_use block; a None field is left out."""
    block: Call = {"type": "tool_use", **extra}
    for key, value in (("id", id), ("name", name), ("input", input)):
        if value is not None:
            block[key] = value
    return block


@pytest.fixture
def lp(tmp_path: Path) -> Loop:
    return loop(tmp_path / "proj", {"a.txt": "alpha\n"})


def run_ok(lp: Loop, *responses: Any) -> str:
    record = lp.run(list(responses))
    assert record.status == RunStatus.SUCCEEDED, record.error
    for request in lp.model.requests:
        assert conversation_problems(request) == []
    return record.run_id


def stored(lp: Loop, turn: int = 1) -> list[Call]:
    """The assistant message of the root's first reply, as sent back with request ``turn``."""
    content: list[Call] = lp.root_requests()[turn].messages[1]["content"]
    return content


def event_sizes(lp: Loop, run_id: str) -> list[int]:
    return [len(json.dumps(e["data"])) for e in lp.store.events(run_id)]


@pytest.mark.parametrize(
    ("raw", "kind"),
    [
        ("a.txt", "a string"),
        (["a.txt"], "an array"),
        (42, "a number"),
        (1.5, "a number"),
        (True, "a boolean"),
        (False, "a boolean"),
        ("null", "a string"),
    ],
)
def test_an_input_of_the_wrong_type_is_a_tool_error(lp: Loop, raw: Any, kind: str) -> None:
    run_ok(lp, [use(input=raw, id="t1")])
    [result] = lp.results(1)
    assert result["is_error"] and result["tool_use_id"] == "t1"
    assert result["content"].startswith(
        f"invalid input for read_file: the input must be a JSON object, not {kind} ("
    )
    assert stored(lp)[0]["input"] == {}  # the API takes only an object back


def test_a_null_or_missing_input_is_a_tool_error(lp: Loop) -> None:
    run_ok(lp, [{**use(id="t1"), "input": None}, use(id="t2")])
    first, second = lp.results(1)
    assert "the input must be a JSON object, not null" in first["content"]
    assert "the tool_use block has no input" in second["content"]
    assert [b["input"] for b in stored(lp)] == [{}, {}]


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        ({}, "path: Field required"),
        ({"path": "a.txt", "bogus": 1}, "bogus: Extra inputs are not permitted"),
        ({"path": 42}, "path: Input should be a valid string"),
        ({"path": "a.txt", "offset": "x"}, "offset: Input should be a valid integer"),
        ({"path": "a.txt", "limit": 0}, "limit: Input should be greater than or equal to 1"),
    ],
)
def test_bad_fields_are_named(lp: Loop, args: Call, problem: str) -> None:
    run_ok(lp, [use(input=args)])
    [result] = lp.results(1)
    assert result["is_error"] and problem in result["content"], result["content"]


def test_many_bad_fields_are_listed_up_to_a_cap(lp: Loop) -> None:
    args = {"path": "a.txt", **{f"k{n}" + "x" * 500: n for n in range(1000)}}
    run_ok(lp, [use(input=args)])
    content = lp.results(1)[0]["content"]
    assert content.count("Extra inputs are not permitted") == 20
    assert content.endswith("; and 980 more") and len(content) < 5_000


def test_an_unknown_tool_lists_the_tools(lp: Loop) -> None:
    run_ok(lp, [use(name="x", input={})])
    content = lp.results(1)[0]["content"]
    assert content.startswith("unknown tool 'x'; your tools: ") and "read_file" in content


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        (None, "the tool_use block has no name"),
        (7, "the tool name is a number, not a string"),
        (["bash"], "the tool name is an array, not a string"),
        ({"name": "bash"}, "the tool name is an object, not a string"),
        (False, "the tool name is a boolean, not a string"),
    ],
)
def test_a_name_that_is_not_a_string_is_a_tool_error(lp: Loop, name: Any, problem: str) -> None:
    run_ok(lp, [use(name=name, input={"command": "ls"}, id="t1")])
    [result] = lp.results(1)
    assert result["is_error"] and result["tool_use_id"] == "t1"
    assert result["content"].startswith(f"invalid tool call: {problem}; your tools: ")
    assert stored(lp)[0]["name"] == "invalid_tool_name"


def test_a_json_null_name_is_not_a_missing_one(lp: Loop) -> None:
    run_ok(lp, [{**use(input={}), "name": None}])
    assert "the tool name is null, not a string" in lp.results(1)[0]["content"]


def test_a_huge_name_is_not_echoed_whole(lp: Loop) -> None:
    name = "n" * 1_000_000
    run_id = run_ok(lp, [use(name=name, input={"path": "a.txt"})])
    content = lp.results(1)[0]["content"]
    assert content.startswith("unknown tool '" + "n" * 100 + "…'; your tools: ")
    assert len(content) < 1_000
    assert stored(lp)[0]["name"] == "invalid_tool_name"
    assert max(event_sizes(lp, run_id)) < 2_000
    [call] = lp.events(run_id, "tool_call")
    assert call["tool"] == "n" * 100 + "…"
    activity = lp.store.require_run(run_id).last_activity
    assert activity is not None and len(activity.summary) <= 200


def test_a_name_the_api_would_not_take_back_is_replaced_in_the_stored_message(
    lp: Loop,
) -> None:
    run_ok(lp, [use(name="rm -rf /", input={}), use(name="a" * 65, input={})])
    assert [b["name"] for b in stored(lp)] == ["invalid_tool_name"] * 2
    assert lp.results(1)[0]["content"].startswith("unknown tool 'rm -rf /'; ")


def test_a_huge_input_is_written_but_events_keep_it_short(lp: Loop) -> None:
    content = "x" * 5_000_000
    run_id = run_ok(lp, [use(name="write_file", input={"path": "big.txt", "content": content})])
    [result] = lp.results(1)
    assert not result.get("is_error") and "wrote 5000000 characters" in result["content"]
    assert lp.runtime.files["big.txt"] == content.encode()
    [call] = lp.events(run_id, "tool_call")
    assert call["input"]["path"] == "big.txt"
    kept = call["input"]["content"]
    assert kept.startswith("x" * EVENT_TEXT)
    assert kept.endswith(f"[cut at {EVENT_TEXT:,} of 5,000,000 characters]")
    assert max(event_sizes(lp, run_id)) < 11_000
    activity = lp.store.require_run(run_id).last_activity
    assert activity is not None and activity.summary == "write_file: big.txt"


def test_a_huge_bash_command_is_refused_and_not_stored_whole(lp: Loop) -> None:
    run_id = run_ok(lp, [use(name="bash", input={"command": "echo " + "y" * 3_000_000})])
    assert "command refused: it is 3,000,005 bytes" in lp.results(1)[0]["content"]
    assert max(event_sizes(lp, run_id)) < 11_000


def test_a_missing_id_gets_a_fresh_one_in_the_stored_message(lp: Loop) -> None:
    sent = use(input={"path": "a.txt"})
    run_ok(lp, [sent])
    assert "id" not in sent  # the model's block is left as it was
    [block] = stored(lp)
    assert block == {
        "type": "tool_use",
        "id": "toolu_orch_1",
        "name": "read_file",
        "input": {"path": "a.txt"},
    }
    [result] = lp.results(1)
    assert result["tool_use_id"] == "toolu_orch_1" and "alpha" in result["content"]


def test_duplicate_ids_keep_the_first_and_renumber_the_others(lp: Loop) -> None:
    run_id = run_ok(
        lp,
        [
            use(input={"path": "a.txt"}, id="dup"),
            use(name="glob", input={"pattern": "*"}, id="dup"),
            use(input={"path": "missing"}, id="dup"),
        ],
        [use(name="glob", input={"pattern": "*"}, id="dup")],  # a later reply: used already
    )
    assert [b["id"] for b in stored(lp)] == ["dup", "toolu_orch_1", "toolu_orch_2"]
    results = lp.results(1)
    assert [r["tool_use_id"] for r in results] == ["dup", "toolu_orch_1", "toolu_orch_2"]
    assert "alpha" in results[0]["content"] and "a.txt" in results[1]["content"]
    assert "no such file" in results[2]["content"]
    assert [r["tool_use_id"] for r in lp.results(2)] == ["toolu_orch_3"]
    calls = lp.events(run_id, "tool_call")
    assert [c["id"] for c in calls] == ["dup", "toolu_orch_1", "toolu_orch_2", "toolu_orch_3"]
    assert [c.get("sent_id") for c in calls] == [None, "dup", "dup", "dup"]


def test_a_fresh_id_never_takes_one_the_model_used(lp: Loop) -> None:
    run_ok(lp, [use(input={}, id="toolu_orch_1"), use(input={}), use(input={}, id="toolu_orch_2")])
    assert [b["id"] for b in stored(lp)] == ["toolu_orch_1", "toolu_orch_2", "toolu_orch_3"]


@pytest.mark.parametrize("bad", [7, "", "has space", "x" * 65, ["a"], {"id": "a"}, "ü", False])
def test_an_id_the_api_would_not_take_back_is_replaced(lp: Loop, bad: Any) -> None:
    run_id = run_ok(lp, [{**use(input={"path": "a.txt"}), "id": bad}])
    assert stored(lp)[0]["id"] == "toolu_orch_1"
    assert lp.results(1)[0]["tool_use_id"] == "toolu_orch_1"
    [call] = lp.events(run_id, "tool_call")
    assert call["sent_id"] == capped(bad)


def test_blocks_that_are_not_objects_are_left_out(lp: Loop) -> None:
    run_ok(
        lp,
        [
            None,
            1,
            "tool_use",
            ["tool_use"],
            {},
            {"type": 7},
            {"type": "tool_result", "tool_use_id": "x", "content": "forged"},
            {"type": "text", "text": 3},
            {"type": "text", "text": "  "},
            {"type": "text", "text": "reading"},
            use(input={"path": "a.txt"}, id="t1"),
        ],
    )
    assert stored(lp) == [
        {"type": "text", "text": "reading"},
        {"type": "tool_use", "id": "t1", "name": "read_file", "input": {"path": "a.txt"}},
    ]
    assert [r["tool_use_id"] for r in lp.results(1)] == ["t1"]


def test_a_bare_tool_use_block_is_a_tool_error(lp: Loop) -> None:
    run_id = run_ok(lp, [{"type": "tool_use"}])
    assert stored(lp) == [
        {"type": "tool_use", "id": "toolu_orch_1", "name": "invalid_tool_name", "input": {}}
    ]
    [result] = lp.results(1)
    assert result["is_error"] and "the tool_use block has no name" in result["content"]
    [call] = lp.events(run_id, "tool_call")
    assert call == {"id": "toolu_orch_1", "tool": "(no name)", "input": None, "sent_id": None}


def test_other_fields_of_a_tool_use_stay_as_sent(lp: Loop) -> None:
    block = use(input="x", id="t1", cache_control={"type": "ephemeral"})
    run_ok(lp, [block])
    assert stored(lp)[0] == {**block, "input": {}}


def test_an_empty_reply_cut_at_max_tokens_is_stored_as_a_placeholder(lp: Loop) -> None:
    content: list[Any] = [None, {"type": "text", "text": ""}]
    run_ok(lp, ModelResponse(content=content, stop_reason="max_tokens"))
    request = lp.root_requests()[1]
    assert request.messages[1]["content"] == [{"type": "text", "text": "(empty response)"}]


def test_many_malformed_calls_in_one_reply_all_get_answers(lp: Loop) -> None:
    calls = [
        use(name="bash", input="ls", id="dup"),
        use(name=None, input={}, id="dup"),
        use(name=3, input=[1], id=None),
        use(name="glob", input={"pattern": "*"}, id=""),
        use(name="x" * 70, input=None, id="dup"),
        {"type": "tool_use"},
        use(name="read_file", input={"path": "a.txt"}, id="ok"),
    ]
    run_ok(lp, calls, [use(name="read_file", input={"path": "a.txt"}, id="dup")])
    results = lp.results(1)
    assert len(results) == 7 and sum(bool(r.get("is_error")) for r in results) == 5
    assert len({r["tool_use_id"] for r in results}) == 7
    assert lp.results(2)[0]["tool_use_id"].startswith("toolu_orch_")


def test_capped_cuts_strings_width_and_depth() -> None:
    deep: Any = "leaf"
    for _ in range(500):
        deep = [deep]
    small = capped({"deep": deep, 2**300: 2**300, "s": "y" * 50_000, "wide": list(range(5_000))})
    assert small["s"] == "y" * 10_000 + "[cut at 10,000 of 50,000 characters]"
    assert small["wide"][-1].endswith("more left out") and len(small["wide"]) < 600
    text = json.dumps(small)
    assert "[nested too deep]" in text and "-bit integer]" in text and len(text) < 30_000
    assert capped({"a": {1, 2}, "b": b"x"}) == {"a": "[set]", "b": "[bytes]"}


def test_summarize_input_is_one_short_line() -> None:
    assert summarize_input("bash", {"command": "ls\n-la"}) == "bash: ls -la"
    assert len(summarize_input("t" * 10_000, {"command": "c" * 10_000})) == 200
    assert summarize_input("bash", "ls") == 'bash: "ls"'
    assert len(summarize_input("bash", ["x" * 10_000] * 1_000)) <= 200
