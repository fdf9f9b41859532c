"""The fakes' Messages API rules (orchestrator/testing/messages.py): usage, the prompt cache
by the documented prefix rules, the window's refusal; pure, then over loopback."""

from __future__ import annotations

import asyncio
import http.client
import json
import sys
import threading
from pathlib import Path
from typing import Any

import anthropic
import pytest

from orchestrator.models.anthropic import AnthropicModel
from orchestrator.models.base import ContextOverflow, ModelRequest
from orchestrator.testing.messages import (
    LOOKBACK,
    TURN_TOKENS,
    Admitted,
    Messages,
    Refused,
    canonical,
    min_cacheable,
    tokens,
    units,
)
from tests.fakeapi import FakeAPI, serve, text_reply

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import fakeserver  # noqa: E402

SONNET = "claude-sonnet-4-5"
EPH = {"type": "ephemeral"}
HOUR = {"type": "ephemeral", "ttl": "1h"}


def text(chars: int, tag: str = "", mark: dict[str, str] | None = None) -> dict[str, Any]:
    block: dict[str, Any] = {"type": "text", "text": f"{tag}:" + "x" * chars}
    if mark is not None:
        block["cache_control"] = mark
    return block


def tool(name: str, chars: int = 2000, mark: dict[str, str] | None = None) -> dict[str, Any]:
    t: dict[str, Any] = {
        "name": name,
        "description": "d" * chars,
        "input_schema": {"type": "object", "properties": {}},
    }
    if mark is not None:
        t["cache_control"] = mark
    return t


def body(
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    system: Any = None,
    model: str = SONNET,
    **extra: Any,
) -> dict[str, Any]:
    out: dict[str, Any] = {"model": model, "max_tokens": 1000, "messages": messages, **extra}
    if tools is not None:
        out["tools"] = tools
    if system is not None:
        out["system"] = system
    return out


def user(*blocks: dict[str, Any]) -> dict[str, Any]:
    return {"role": "user", "content": list(blocks)}


def upto(b: dict[str, Any], n: int) -> int:
    """Tokens of the first ``n`` blocks of ``b`` (tools, system, messages)."""
    return sum(u.tokens for u in units(b)[:n])


def blocks(b: dict[str, Any]) -> int:
    """Tokens of every block of ``b``."""
    return upto(b, len(units(b)))


def total(b: dict[str, Any]) -> int:
    """The whole input of ``b``: its blocks and the framing of the turn it asks for."""
    return blocks(b) + TURN_TOKENS


def cycle(rules: Messages, b: dict[str, Any]) -> Admitted:
    """One request answered: admitted, then its response sent."""
    admitted = rules.admit(b)
    rules.sent(admitted)
    return admitted


def figures(a: Admitted) -> tuple[int, int, int]:
    return a.cache_read_input_tokens, a.cache_creation_input_tokens, a.input_tokens


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# -- the estimate and the key ---------------------------------------------------------------


def test_tokens_are_canonical_json_chars_over_four() -> None:
    assert tokens("abcdefgh") == 2 and tokens("") == 1
    a = {"type": "text", "text": "y" * 400}
    assert tokens(a) == len(canonical(a)) // 4
    assert tokens({"text": "y" * 400, "type": "text"}) == tokens(a)  # key order does not count
    # cache_control is not content: neither counted nor keyed
    (plain_unit,) = units(body([user(a)]))
    (marked_unit,) = units(body([user({**a, "cache_control": EPH})]))
    assert (plain_unit.tokens, plain_unit.key) == (marked_unit.tokens, marked_unit.key)
    assert marked_unit.ttl == "5m" and plain_unit.ttl is None
    # a string system or content is one text block
    as_string = units(body([{"role": "user", "content": "hi"}], system="S"))
    as_blocks = units(
        body([user({"type": "text", "text": "hi"})], system=[{"type": "text", "text": "S"}])
    )
    assert [u.key for u in as_string] == [u.key for u in as_blocks] and len(as_string) == 2


def test_prefix_order_is_tools_system_messages() -> None:
    b = body([user(text(10, "m"))], tools=[tool("t")], system=[text(10, "s")])
    assert [u.section for u in units(b)] == ["tools", "system", "messages"]
    assert total(b) == sum(u.tokens for u in units(b)) + TURN_TOKENS


def test_output_tokens_from_the_reply_size() -> None:
    rules = Messages()
    admitted = rules.admit(body([user(text(100, "q"))]))
    content = [{"type": "text", "text": "z" * 800}]
    usage = admitted.usage(content)
    assert usage["output_tokens"] == tokens(content)
    assert usage["input_tokens"] == total(body([user(text(100, "q"))]))
    assert usage["cache_read_input_tokens"] == usage["cache_creation_input_tokens"] == 0


# -- writes, reads, partial hits --------------------------------------------------------------


def _agent_body(last: str, *, facts: str = "run-1") -> dict[str, Any]:
    """Tools (last one marked), a marked stable system block then the run's facts, and a
    user message marked on its first block with a second block after the breakpoint."""
    return body(
        [user(text(3000, last, EPH), text(400, "tail"))],
        tools=[tool("a"), tool("b", mark=EPH)],
        system=[text(4000, "stable", EPH), text(300, facts)],
    )


def test_first_request_writes_up_to_the_last_breakpoint_and_the_next_reads_it() -> None:
    rules = Messages()
    b = _agent_body("q1")
    first = cycle(rules, b)
    assert figures(first) == (0, upto(b, 5), total(b) - upto(b, 5))
    assert first.ephemeral_5m_input_tokens == upto(b, 5) and first.ephemeral_1h_input_tokens == 0
    assert rules.entries(SONNET) == 3  # an entry per breakpoint: tools, system, message
    again = cycle(rules, b)
    assert figures(again) == (upto(b, 5), 0, total(b) - upto(b, 5))
    assert again.prompt_tokens == total(b) == first.prompt_tokens


def test_a_changed_message_reads_the_system_prefix_and_writes_the_rest() -> None:
    rules = Messages()
    cycle(rules, _agent_body("q1"))
    b = _agent_body("q2")
    partial = cycle(rules, b)
    assert figures(partial) == (upto(b, 3), upto(b, 5) - upto(b, 3), total(b) - upto(b, 5))
    # other facts after the stable block: the tools and the stable system block still hit
    other = _agent_body("q1", facts="run-2")
    assert figures(cycle(rules, other))[0] == upto(other, 3)


def test_changed_tools_miss_everything_and_another_model_has_its_own_cache() -> None:
    rules = Messages()
    b = _agent_body("q1")
    cycle(rules, b)
    changed = {**b, "tools": [tool("a"), tool("c", mark=EPH)]}
    assert figures(rules.admit(changed))[0] == 0
    assert figures(rules.admit({**b, "model": "claude-opus-4-1"}))[0] == 0


def test_tool_choice_invalidates_the_messages_entries_only() -> None:
    rules = Messages()
    b = _agent_body("q1")
    cycle(rules, b)
    forced = {**b, "tool_choice": {"type": "any"}}
    assert figures(rules.admit(forced))[0] == upto(b, 3)  # the system breakpoint's prefix


def test_a_growing_conversation_reads_the_previous_end_by_looking_back() -> None:
    rules = Messages()
    first = body([user(text(5000, "u1", EPH))])
    cycle(rules, first)
    turn = {"role": "assistant", "content": [text(200, "a1")]}
    second = body([user(text(5000, "u1")), turn, user(text(300, "u2", EPH))])
    assert figures(cycle(rules, second)) == (
        upto(second, 1),
        blocks(second) - upto(second, 1),
        TURN_TOKENS,
    )


# -- the 20-block look-back and the minimum length --------------------------------------------


def _blocks_after(n: int) -> dict[str, Any]:
    """A first block of 5000 characters, then ``n`` small ones, the last one marked."""
    more = [text(10, f"b{i}") for i in range(n)]
    if more:
        more[-1] = {**more[-1], "cache_control": EPH}
    return body([user(text(5000, "head", EPH if not more else None), *more)])


def test_look_back_reaches_twenty_blocks_before_a_breakpoint_and_no_further() -> None:
    for extra, hits in ((LOOKBACK, True), (LOOKBACK + 1, False)):
        rules = Messages()
        cycle(rules, _blocks_after(0))
        b = _blocks_after(extra)
        read, written, _ = figures(rules.admit(b))
        if hits:
            assert (read, written) == (upto(b, 1), blocks(b) - upto(b, 1))
        else:
            assert (read, written) == (0, blocks(b))


def test_minimum_cacheable_lengths() -> None:
    assert min_cacheable("claude-sonnet-4-5") == min_cacheable("claude-sonnet-4-20250514") == 1024
    assert min_cacheable("claude-opus-4-1-20250805") == min_cacheable("claude-opus-4") == 1024
    assert min_cacheable("claude-opus-4-5-20251101") == 4096
    assert min_cacheable("claude-haiku-4-5") == 4096
    assert min_cacheable("claude-3-5-haiku-20241022") == min_cacheable("claude-3-haiku") == 2048
    assert min_cacheable("some-other-model") == 1024


def test_a_prefix_under_the_minimum_is_neither_written_nor_read() -> None:
    b = body([user(text(3000, "short", EPH), text(5000, "long", EPH))], model="claude-haiku-4-5")
    assert upto(b, 1) < 1024 < upto(b, 2) < 4096
    for model, writes in (("claude-haiku-4-5", False), (SONNET, True)):
        rules = Messages()
        sent = {**b, "model": model}
        first = cycle(rules, sent)
        if writes:  # the short breakpoint is not written: the long one's write covers it
            assert figures(first) == (0, blocks(b), TURN_TOKENS) and rules.entries() == 1
        else:
            assert figures(first) == (0, 0, total(b)) and rules.entries() == 0
            assert figures(cycle(rules, sent)) == (0, 0, total(b))
    lowered = Messages(min_lengths={"claude-haiku-4-5": 100})
    cycle(lowered, b)
    assert figures(lowered.admit(b))[0] == blocks(b)


# -- lifetimes ------------------------------------------------------------------------------


def test_five_minute_entries_expire_and_a_read_refreshes_them() -> None:
    clock = Clock()
    rules = Messages(clock=clock)
    b = _blocks_after(0)
    cycle(rules, b)
    clock.now += 299
    assert figures(cycle(rules, b))[0] == blocks(b)  # read: lives 300 s from now
    clock.now += 299
    assert figures(cycle(rules, b))[0] == blocks(b)
    clock.now += 301
    assert figures(cycle(rules, b)) == (0, blocks(b), TURN_TOKENS)  # expired: written again


def test_one_hour_entries_and_the_writes_split_by_ttl() -> None:
    clock = Clock()
    rules = Messages(clock=clock)
    b = body([user(text(5000, "m", EPH))], tools=[tool("t", 6000, mark=HOUR)])
    first = cycle(rules, b)
    assert first.ephemeral_1h_input_tokens == upto(b, 1)
    assert first.ephemeral_5m_input_tokens == blocks(b) - upto(b, 1)
    assert first.usage([])["cache_creation"] == {
        "ephemeral_5m_input_tokens": first.ephemeral_5m_input_tokens,
        "ephemeral_1h_input_tokens": first.ephemeral_1h_input_tokens,
    }
    clock.now += 1800  # the 5m entry is gone, the hour's is not
    half = cycle(rules, b)
    assert figures(half) == (upto(b, 1), blocks(b) - upto(b, 1), TURN_TOKENS)
    clock.now += 3599  # the read at 1800 s refreshed the hour
    assert figures(rules.admit(b))[0] == upto(b, 1)
    clock.now += 3601
    assert figures(rules.admit(b))[0] == 0


def test_a_bad_ttl_is_refused() -> None:
    with pytest.raises(Refused) as refused:
        Messages().admit(body([user(text(10, "m", {"type": "ephemeral", "ttl": "2h"}))]))
    assert refused.value.status == 400


# -- refusals -------------------------------------------------------------------------------


def test_more_than_four_breakpoints_is_a_400() -> None:
    marked = [text(10, f"m{i}", EPH) for i in range(5)]
    with pytest.raises(Refused) as refused:
        Messages().admit(body([user(*marked)]))
    assert refused.value.status == 400
    error = refused.value.body["error"]
    assert error == {
        "type": "invalid_request_error",
        "message": "A maximum of 4 blocks with cache_control may be provided. Found 5.",
    }
    Messages().admit(body([user(*marked[:4])]))  # four are fine


def test_a_prompt_over_the_window_is_refused_with_the_real_body() -> None:
    rules = Messages(windows={"tiny": 500})
    b = body([user(text(4000, "big"))], model="tiny")
    with pytest.raises(Refused) as refused:
        rules.admit(b)
    assert refused.value.status == 400
    sent = refused.value.body
    assert set(sent) == {"type", "error", "request_id"} and sent["type"] == "error"
    assert sent["request_id"].startswith("req_")
    assert sent["error"] == {
        "type": "invalid_request_error",
        "message": f"prompt is too long: {total(b)} tokens > 500 maximum",
    }
    assert Messages().window("tiny") == 200_000
    rules.admit({**b, "model": SONNET})  # another model's window


def _post(base_url: str, payload: dict[str, Any]) -> tuple[int, dict[str, Any], str]:
    conn = http.client.HTTPConnection(base_url.removeprefix("http://"), timeout=30)
    try:
        conn.request(
            "POST", "/v1/messages", json.dumps(payload), {"content-type": "application/json"}
        )
        response = conn.getresponse()
        return response.status, json.loads(response.read()), response.getheader("request-id", "")
    finally:
        conn.close()


def test_the_fake_api_refuses_over_its_window_and_orch_sees_context_overflow() -> None:
    api = FakeAPI(lambda b: text_reply("never"))
    api.set_window(SONNET, 1000)
    with serve(api):
        status, data, rid = _post(api.base_url, body([user(text(8000, "big"))]))
        assert status == 400 and data["request_id"] == rid
        assert data["error"]["message"].startswith("prompt is too long: ")
        assert data["error"]["message"].endswith(" tokens > 1000 maximum")

        async def go() -> None:
            client = anthropic.AsyncAnthropic(
                api_key="sk-test-fake", base_url=api.base_url, max_retries=0
            )
            messages = [{"role": "user", "content": "y" * 8000}]
            request = ModelRequest("s", messages, [], SONNET, max_tokens=100)
            try:
                await AnthropicModel(client, SONNET).complete(request)
            finally:
                await client.close()

        with pytest.raises(ContextOverflow, match="prompt is too long"):
            asyncio.run(go())
    assert api.usages == [None, None] and len(api.requests) == 2


def test_the_fake_api_reports_cache_usage_through_the_sdk() -> None:
    api = FakeAPI(lambda b: text_reply("ok"))
    b = _agent_body("q1")
    with serve(api):

        async def go() -> list[Any]:
            client = anthropic.AsyncAnthropic(
                api_key="sk-test-fake", base_url=api.base_url, max_retries=0
            )
            try:
                return [(await client.messages.create(**b)).usage for _ in range(2)]
            finally:
                await client.close()

        first, second = asyncio.run(go())
    assert (first.cache_read_input_tokens, first.cache_creation_input_tokens) == (0, upto(b, 5))
    assert (second.cache_read_input_tokens, second.cache_creation_input_tokens) == (upto(b, 5), 0)
    assert second.input_tokens == total(b) - upto(b, 5)
    assert api.answered()[1]["cache_read_input_tokens"] == upto(b, 5)


def test_concurrent_siblings_that_start_together_do_not_hit_each_other() -> None:
    api = FakeAPI(lambda b: text_reply("ok"), delay_s=0.3)
    b = _agent_body("q1")
    with serve(api):
        got: list[tuple[int, dict[str, Any], str]] = []
        threads = [threading.Thread(target=lambda: got.append(_post(api.base_url, b)))]
        threads.append(threading.Thread(target=lambda: got.append(_post(api.base_url, b))))
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert [g[0] for g in got] == [200, 200]
        for _, data, _ in got:  # both wrote the same prefix: neither saw the other's
            assert data["usage"]["cache_read_input_tokens"] == 0
            assert data["usage"]["cache_creation_input_tokens"] == upto(b, 5)
        status, later, _ = _post(api.base_url, b)  # once they were answered, it reads
    assert status == 200 and later["usage"]["cache_read_input_tokens"] == upto(b, 5)


def test_the_bench_fake_server_keeps_the_usage_it_reported() -> None:
    b = _agent_body("q1")
    with fakeserver.serve(lambda body: ("turn", text_reply("ok"))) as fake:
        for _ in range(2):
            assert _post(fake.base_url, b)[0] == 200
        conn = http.client.HTTPConnection(f"127.0.0.1:{fake.port}", timeout=30)
        conn.request("POST", "/v1/messages/count_tokens", json.dumps(b))
        counted = json.loads(conn.getresponse().read())
        conn.close()
        fake.rules.set_window(SONNET, 10)
        assert _post(fake.base_url, b)[0] == 400
    first, second, refused = fake.messages()
    assert first.usage is not None and second.usage is not None and refused.usage is None
    assert first.usage["cache_creation_input_tokens"] == upto(b, 5)
    assert second.usage["cache_read_input_tokens"] == upto(b, 5)
    assert counted == {"input_tokens": total(b)} and refused.status == 400
