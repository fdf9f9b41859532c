"""A fake Messages API's answers for a lead team (tests/fakeapi.py serves them through the
real SDK): a lead that puts three tasks on the board, teammates that claim, write, message
and hand in, reviewers that approve. Each agent is told apart by its system prompt."""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field
from typing import Any

from tests.fakeapi import text_reply
from tests.teamapi import agent_of, text_of

# the gate: sub.py, once it exists, must subtract
GATE = "if [ -f sub.py ]; then grep -q 'a - b' sub.py; fi"
FILES = {
    "add": ("add.py", "def add(a, b):\n    return a + b\n"),
    "sub": ("sub.py", "def sub(a, b):\n    return a - b\n"),
    "doc": ("DOC.md", "add() and sub() live in add.py and sub.py.\n"),
}
WRONG_SUB = "def sub(a, b):\n    return a + b\n"
APPROVE = json.dumps({"verdict": "approve", "summary": "Fine.", "comments": []})


def calls(*items: tuple[str, dict[str, Any]], tag: str) -> dict[str, Any]:
    content = [
        {"type": "tool_use", "id": f"toolu_{tag}_{i}", "name": name, "input": args}
        for i, (name, args) in enumerate(items)
    ]
    return {"content": content, "stop_reason": "tool_use"}


def results(messages: list[dict[str, Any]]) -> str:
    """Every tool result and notification the conversation holds so far."""
    return json.dumps([m["content"] for m in messages if m["role"] == "user"])


@dataclass
class LeadAPI:
    hold: threading.Event | None = None  # set: a teammate's doc task waits for it
    doc_started: threading.Event = field(default_factory=threading.Event)
    sent: list[str] = field(default_factory=list)  # who messaged whom
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, body: dict[str, Any]) -> dict[str, Any]:
        agent, messages = agent_of(body), body["messages"]
        if agent == "planner":
            return self.lead(messages)
        if agent == "writer":
            return self.teammate(messages)
        return text_reply(APPROVE)

    def lead(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        turn = sum(1 for m in messages if m["role"] == "assistant")
        last = json.dumps(messages[-1]["content"])
        if "interrupted" in text_of(messages[0]):  # a new lead of a resumed team (its old
            # conversation was not kept): the board has every task already; wait them out
            if turn > 0 and all(f"t{k} done" in last for k in (1, 2, 3)):
                return text_reply("All three tasks are merged.")
            return calls(("board_wait", {"timeout_s": 60}), tag=f"lead{turn}")
        if turn == 0:
            return calls(
                ("board_add", {"title": "add", "detail": "add(a, b) in add.py"}),
                ("board_add", {"title": "sub", "detail": "sub(a, b) in sub.py"}),
                tag="lead0",
            )
        if turn == 1:
            return calls(
                ("board_add", {"title": "doc", "detail": "DOC.md", "depends_on": ["t1"]}),
                tag="lead1",
            )
        if all(f"t{k} done" in last for k in (1, 2, 3)):
            return text_reply("All three tasks are merged.")
        return calls(("board_wait", {"timeout_s": 60}), tag=f"lead{turn}")

    def teammate(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        first = text_of(messages[0])
        name = re.search(r"You are (teammate-\d+)", first)
        assert name, first[:200]
        me = name.group(1)
        other = "teammate-2" if me == "teammate-1" else "teammate-1"
        seen = results(messages)
        turn = sum(1 for m in messages if m["role"] == "assistant")
        tag = f"{me}_{len(messages)}"
        if turn == 0:
            return calls(("board_claim", {}), tag=tag)
        claimed = re.search(r"Claimed (t\d+): (\w+)", seen)
        if claimed is None:
            return text_reply("Nothing to do.")
        task_id, title = claimed.group(1), claimed.group(2)
        if "Handed in" in seen:
            return text_reply(f"Handed in {task_id}.")
        path, content = FILES[title]
        if title == "add" and "Sent to" not in seen:
            with self.lock:
                self.sent.append(f"{me}->{other}")
            return calls(
                ("message", {"to": other, "text": "add.py is on its way; build on it"}),
                tag=tag,
            )
        if title == "sub" and "came back before" not in seen:
            if '<message from=\\"' not in seen and turn < 30:  # wait for the add teammate's
                return calls(("board_wait", {"timeout_s": 20}), tag=tag)
            content = WRONG_SUB  # its first try fails the gate
        if title == "doc" and self.hold is not None:
            self.doc_started.set()
            self.hold.wait(120)
        if "wrote" not in seen:
            return calls(("write_file", {"path": path, "content": content}), tag=tag)
        return calls(("board_done", {"task_id": task_id, "summary": f"{path} written"}), tag=tag)
