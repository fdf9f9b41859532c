"""A fake Messages API's answers for team runs: writers that write calc.py, reviewers that
answer verdicts, each told apart by the agent its system prompt names (tests/fakeapi.py
serves them through the real SDK)."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tests.fakeapi import system_text, text_reply

BUGGY = "def add(a, b):\n    return a - b\n"
GATE = "grep -q 'a + b' calc.py"  # busybox and any host shell have grep
FIXED = "def add(a, b):\n    return a + b\n"


def agent_of(body: dict[str, Any]) -> str:
    m = re.search(r"You are agent '([^']+)' at delegation depth", system_text(body))
    assert m, "every request names its agent in the system prompt"
    return m.group(1)


def text_of(message: dict[str, Any]) -> str:
    content = message["content"]
    if isinstance(content, str):
        return content
    return "\n".join(str(b.get("text", "")) for b in content if isinstance(b, dict))


def verdict(kind: str, summary: str, choice: int | None = None, **comment: Any) -> str:
    data: dict[str, Any] = {"verdict": kind, "summary": summary, "comments": []}
    if comment:
        data["comments"] = [{"path": "calc.py", "line": 2, **comment}]
    if choice is not None:
        data["choice"] = choice
    return json.dumps(data)


@dataclass
class TeamAPI:
    """Writers: writer k (numbered by its first request) writes ``contents(k, attempt)``;
    reviewers answer ``verdicts[agent]`` (a text, or a function of the prompt)."""

    contents: Callable[[int, int], str]
    verdicts: dict[str, str | Callable[[str], str]]
    hold: threading.Event | None = None  # set: the first writer request waits for it
    writers: int = 0
    prompts: dict[str, list[str]] = field(default_factory=dict)  # agent -> first messages
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, body: dict[str, Any]) -> dict[str, Any]:
        agent, messages = agent_of(body), body["messages"]
        last = messages[-1]
        if len(messages) == 1:
            with self.lock:
                self.prompts.setdefault(agent, []).append(text_of(last))
        if agent.startswith("writer"):
            return self.writer(messages)
        answer = self.verdicts[agent]
        return text_reply(answer if isinstance(answer, str) else answer(text_of(messages[0])))

    def writer(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        last = messages[-1]
        if isinstance(last["content"], list) and any(
            isinstance(b, dict) and b.get("type") == "tool_result" for b in last["content"]
        ):
            return text_reply("Wrote calc.py.")
        seen = re.search(r"toolu_w(\d+)_", json.dumps(messages))
        if seen is None:  # a new writer: the next number
            with self.lock:
                self.writers += 1
                k = self.writers
            if self.hold is not None and k == 1:
                self.hold.wait(60)
        else:
            k = int(seen.group(1))
        attempt = sum(1 for m in messages if m["role"] == "user" and text_of(m).strip())
        call = {
            "type": "tool_use",
            "id": f"toolu_w{k}_{attempt}",
            "name": "write_file",
            "input": {"path": "calc.py", "content": self.contents(k, attempt)},
        }
        return {"content": [call], "stop_reason": "tool_use"}
