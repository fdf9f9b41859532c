"""The `peer` bench's fake Messages API and script, read back through the real SDK."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import anthropic

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from fakeserver import Exchange, serve  # noqa: E402
from peerrun import CHILD_PROMPT, ROOT_ANSWER, ROOT_PROMPT, Script, measure  # noqa: E402

TOOLS = {
    "orch": [{"name": n, "input_schema": {"type": "object"}} for n in ("task", "read_file")],
    "claude": [{"name": n, "input_schema": {"type": "object"}} for n in ("Agent", "Read")],
}


def _ask(client: anthropic.Anthropic, stream: bool, **kw: Any) -> list[dict[str, Any]]:
    args: dict[str, Any] = {"model": "m", "max_tokens": 100, **kw}
    if stream:
        with client.messages.stream(**args) as s:
            msg = s.get_final_message()
    else:
        msg = client.messages.create(**args)
    return [b.model_dump(exclude_none=True) for b in msg.content]


def test_streamed_and_plain_answers_carry_the_same_script(tmp_path: Path) -> None:
    script = Script()
    script.repo = tmp_path
    with serve(script) as fake:
        client = anthropic.Anthropic(base_url=fake.base_url, api_key="x", max_retries=0)
        for tool, (delegate, read) in {
            "orch": ("task", "read_file"),
            "claude": ("Agent", "Read"),
        }.items():
            tools = TOOLS[tool]
            root = [{"role": "user", "content": ROOT_PROMPT}]
            plain = _ask(client, False, messages=root, tools=tools)
            streamed = _ask(client, True, messages=root, tools=tools)
            assert plain == streamed
            assert plain[0]["name"] == delegate
            assert plain[0]["input"]["prompt"] == CHILD_PROMPT
            child = [{"role": "user", "content": CHILD_PROMPT}]
            call = _ask(client, True, messages=child, tools=tools)[0]
            assert call["name"] == read
            assert str(tmp_path / "notes.txt") in str(call["input"]) or call["input"] == {
                "path": "notes.txt"
            }
            done = root + [
                {"role": "assistant", "content": plain},
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": plain[0]["id"], "content": "x"}
                    ],
                },
            ]
            assert _ask(client, True, messages=done, tools=tools)[0]["text"] == ROOT_ANSWER
        # a side call (no tools, e.g. a title) gets a short text, not the script
        assert _ask(client, False, messages=[{"role": "user", "content": ROOT_PROMPT}]) == [
            {"type": "text", "text": "OK"}
        ]
        count = client.messages.count_tokens(
            model="m", messages=[{"role": "user", "content": "hi"}]
        )
        assert count.input_tokens > 0
        labels = [e.label for e in fake.exchanges]
    assert labels.count("root") == 6 and labels.count("child") == 2 and "side" in labels


def _ex(label: str, recv: float, sent: float, body: dict[str, Any] | None = None) -> Exchange:
    return Exchange("POST", "/v1/messages", body or {}, {}, recv, sent, label)


def test_measures_come_from_the_server_stamps() -> None:
    child_body = {
        "system": "s" * 400,
        "messages": [{"role": "system", "content": "m" * 400}, {"role": "user", "content": "x"}],
        "tools": [{"name": "Read"}],
    }
    ex = [
        Exchange("HEAD", "/", None, {}, 10.0, 10.001),
        _ex("side", 10.2, 10.21),
        _ex("root", 10.5, 10.6),
        _ex("child", 10.65, 10.7, child_body),
        _ex("child", 10.72, 10.8),
        _ex("root", 10.9, 11.0),
    ]
    got = measure("claude", ex, 9.8, 11.05)
    assert round(got["start_to_first_request_ms"]) == 400  # the side call is the first request
    assert round(got["start_to_root_request_ms"]) == 700
    assert round(got["delegation_ms"]) == 50
    assert round(got["tool_step_ms"]) == 20
    assert round(got["last_response_to_exit_ms"]) == 50
    assert round(got["wall_ms"]) == 1250
    assert got["child_tools"] == 1 and got["side_requests"] == 1
    assert got["child_system_tools_tokens"] == (800 + len('[{"name": "Read"}]')) // 4
