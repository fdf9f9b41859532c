"""Fuzz the agent loop with hostile model responses (hypothesis).

A model plays generated responses: lists of tool_use blocks with real and junk names,
inputs of every JSON shape (and the malformed ones: strings, lists, numbers, null,
absent), ids missing, repeated, of the wrong type or not matching the API's pattern,
text blocks good and bad, and blocks that are not objects at all; then a final answer.
All of it runs through the real loop (policy, validation, tools) on the in-memory
workspace. Per example: the run succeeds (a loop that never finishes may only fail at
max_turns), nothing escapes as an exception, no tool_result carries a traceback, every
request the model received is a valid Messages API conversation, and the stored events
stay small.

The CI variant replays a fixed set of examples (derandomized, about 30 s); the ``slow``
one runs ten times as many and only when asked for: ``pytest -m slow tests/test_fuzz_loop.py``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.models.base import ModelResponse
from orchestrator.run import RunStatus
from orchestrator.workspaces.base import ProcessResult
from tests.loopkit import Loop, conversation_problems, loop

CI_EXAMPLES = 2_000
SLOW_EXAMPLES = 20_000
EVENT_LIMIT = 40_000  # characters of JSON any one stored event may take

REAL_TOOLS = [
    "bash",
    "read_file",
    "write_file",
    "edit_file",
    "glob",
    "grep",
    "task",
    "task_output",
    "task_stop",
    "load_skill",
]
HUGE = "h" * 1_000_000  # a name, a content, a command: events must not keep it whole
JUNK_NAMES = ["", " ", "unknown", "Bash", "read_file ", "rm -rf /", "x" * 300, "名前", "a.b"]
FILES = {"a.txt": "alpha\nbeta\n", "src/app.py": "def main():\n    return 42\n"}
COMMANDS = {"ls": ProcessResult(0, "a.txt\nsrc\n"), "echo hi": ProcessResult(0, "hi\n")}
PATHS = ["a.txt", "src/app.py", "new.txt", "/fake/workspace/a.txt", "../out", "", "a\x00b", "."]

MISSING = object()  # a field left out of the block

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=30)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)
path = st.sampled_from(PATHS) | st.text(max_size=12)
text = st.text(max_size=40)


task_id = st.sampled_from(["nope", "", "r-000000000000"]) | st.text(max_size=12)
# Per real tool: inputs close to valid (often valid, sometimes refused by the policy).
PLAUSIBLE: dict[str, st.SearchStrategy[dict[str, Any]]] = {
    "bash": st.fixed_dictionaries(
        {"command": st.sampled_from(["ls", "echo hi", "rm -rf /", "", "sudo id", HUGE])},
        optional={"timeout_s": st.sampled_from([1, 0, -1, 5000, 0.5, "10", None])},
    ),
    "read_file": st.fixed_dictionaries(
        {"path": path}, optional={"offset": st.integers(-2, 5), "limit": st.integers(-2, 5)}
    ),
    "write_file": st.fixed_dictionaries({"path": path, "content": text | st.just(HUGE)}),
    "edit_file": st.fixed_dictionaries(
        {"path": path, "old_text": st.sampled_from(["alpha", "a", "42", ""]) | text},
        optional={"new_text": text},
    ),
    "glob": st.fixed_dictionaries(
        {"pattern": st.sampled_from(["*", "**/*.py", "[", "(", "a+", "../*", "/x"]) | text}
    ),
    "grep": st.fixed_dictionaries(
        {"pattern": st.sampled_from(["alpha", "(", ".*", "x+"]) | text},
        optional={"path": path, "glob": st.sampled_from(["*.py", "../*"]) | text},
    ),
    "task": st.fixed_dictionaries(
        {"description": text, "prompt": text},
        optional={
            "subagent_type": st.sampled_from(["general", "nobody"]) | text,
            "run_in_background": st.booleans(),
            "isolation": st.sampled_from(["none", "worktree", "bogus"]),
            "model": st.sampled_from(["", "sonnet"]),
        },
    ),
    "task_output": st.fixed_dictionaries(
        {"task_id": task_id},
        optional={"block": st.booleans(), "timeout_s": st.sampled_from([0, 0.01, -1])},
    ),
    "task_stop": st.fixed_dictionaries({"task_id": task_id}),
    "load_skill": st.fixed_dictionaries({"name": st.sampled_from(["x", ""]) | text}),
}
extras = st.dictionaries(st.text(max_size=8), json_values, min_size=1, max_size=2)
any_input = st.one_of(
    st.sampled_from(sorted(PLAUSIBLE)).flatmap(PLAUSIBLE.__getitem__),  # another tool's
    st.dictionaries(st.text(max_size=10), json_values, max_size=4),
    json_values,  # strings, lists, numbers, bools, null
    st.just(MISSING),
)
any_name = st.one_of(
    st.sampled_from([*JUNK_NAMES, HUGE]),
    st.text(max_size=12),
    st.just(MISSING),
    json_values,
)
ids = st.one_of(
    st.sampled_from(["dup", "dup", "toolu_1", "toolu_2", "", "has space", "x" * 100]),
    st.just(MISSING),
    st.none(),
    st.integers(),
    st.text(max_size=10),
    st.lists(st.integers(), max_size=2),
)


@st.composite
def tool_use(draw: st.DrawFn) -> dict[str, Any]:
    """Mostly a real tool with an input meant for it (maybe with extra fields); else junk."""
    real = draw(st.integers(0, 3)) > 0
    name = draw(st.sampled_from(REAL_TOOLS) if real else any_name)
    if real and draw(st.integers(0, 3)) > 0:
        value = draw(PLAUSIBLE[name])
        if draw(st.integers(0, 4)) == 0:
            value = {**value, **draw(extras)}
    else:
        value = draw(any_input)
    block: dict[str, Any] = {"type": "tool_use"}
    for key, field in (("id", draw(ids)), ("name", name), ("input", value)):
        if field is not MISSING:
            block[key] = field
    if draw(st.integers(0, 9)) == 0:
        block[draw(st.sampled_from(["cache_control", "extra", "type2"]))] = draw(json_values)
    return block


blocks = st.one_of(
    tool_use(),
    tool_use(),
    tool_use(),
    st.just({"type": "tool_use"}),
    st.builds(lambda t: {"type": "text", "text": t}, text),
    st.sampled_from([{"type": "text"}, {"type": "text", "text": 3}, {"type": "text", "text": ""}]),
    st.sampled_from([{}, {"type": 7}, {"type": "tool_result", "tool_use_id": "dup"}]),
    st.sampled_from([None, 1, "text", ["tool_use"], True]),
)
responses = st.builds(
    ModelResponse,
    content=st.lists(blocks, max_size=6),
    stop_reason=st.sampled_from(["tool_use", "tool_use", "end_turn", "max_tokens"]),
)
scripts = st.lists(responses, max_size=4)


def _check(lp: Loop, script: list[ModelResponse]) -> None:
    lp.runtime.files = {k: v.encode() for k, v in FILES.items()}
    record = lp.run(script, max_turns=12)
    if record.status != RunStatus.SUCCEEDED:
        assert record.status == RunStatus.FAILED, (record.status, record.error)
        assert record.error is not None and record.error.startswith("max_turns"), record.error
    assert lp.model.requests, "the model was never asked"
    prompts = {r.run_id: r.prompt for r in lp.store.list_runs(chain_id=record.chain_id)}
    assert all(r.status.ended for r in lp.store.list_runs(chain_id=record.chain_id))
    for request in lp.model.requests:
        first = {"role": "user", "content": prompts[request.run_id]}
        assert request.messages[0] == first, request.messages[0]
        problems = conversation_problems(request)
        assert not problems, problems
    for run_id in prompts:
        for event in lp.store.events(run_id):
            size = len(json.dumps(event["data"], ensure_ascii=False))
            assert size < EVENT_LIMIT, (event["kind"], size)


def _fuzz(tmp_path: Path, examples: int) -> None:
    lp = loop(tmp_path / "proj", dict(FILES), COMMANDS)
    count = 0

    @settings(
        max_examples=examples,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(script=scripts)
    def check(script: list[ModelResponse]) -> None:
        nonlocal count
        count += 1
        _check(lp, script)

    start = time.monotonic()
    check()
    print(f"\n{count} examples in {time.monotonic() - start:.1f}s")
    assert count >= examples * 0.95  # hypothesis may stop early only on an exhausted space


def test_fuzz_loop(tmp_path: Path) -> None:
    _fuzz(tmp_path, CI_EXAMPLES)


@pytest.mark.slow
def test_fuzz_loop_long(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    if "slow" not in (request.config.option.markexpr or ""):
        pytest.skip(f"{SLOW_EXAMPLES:,} examples take minutes: run with -m slow")
    _fuzz(tmp_path, SLOW_EXAMPLES)
