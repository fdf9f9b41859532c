"""A team's test gate: its command, run in the writer's sandbox on the writer's branch.

The gate is a run of its own (agent ``gate``, a child of the team's root, shown by ``orch
tree``) whose body is :class:`GateDriver`: it runs the team's ``gate`` command once in its
workspace, a throwaway checkout of the candidate branch (``discard``: nothing it changes is
kept) in the writer's tier, with the writer agent's network setting and the sandbox's
limits. It so needs no trust, and nothing a repository plants (a dropped hook, a changed
setting) can skip it: the team runs it whatever the repository says. A command that exits
non-zero, or runs past ``gate_timeout``, fails the gate.
"""

from __future__ import annotations

import shlex
import time
from typing import Any

from pydantic import BaseModel, Field

from ..catalog.definitions import AgentDefinition
from ..egress.rules import NetworkSetting
from ..engine.agent import LoopOutcome
from ..engine.runner import Driven
from ..run import RunRecord, RunStatus
from ..untrusted import escaped, framed

OUTPUT_KEPT = 6_000  # characters of a gate's output kept (the end, where failures show)
GRACE_S = 30.0  # the gate run's own timeout beyond the command's (its checkout, its close)


class GateResult(BaseModel):
    """One gate run on one candidate branch, as the team reports it."""

    round: int
    candidate: int  # 1.. (best of N); 1 with one writer
    run_id: str
    commit: str  # the branch tip the gate ran on
    command: str
    passed: bool
    exit_code: int | None = None  # None: killed (timed out, cancelled) or never ran
    timed_out: bool = False
    seconds: float = 0.0
    output: str = ""  # the end of its output, at most OUTPUT_KEPT characters
    error: str | None = None  # why the gate could not run at all (its run failed)
    gate_from: str = "candidate"  # whose tests it ran: "base" or "candidate" (gatefrom.py)
    swapped: list[str] = Field(default_factory=list)  # test paths it took from the base

    def headline(self) -> str:
        if self.error is not None:
            return f"gate could not run: {self.error}"
        if self.timed_out:
            return f"gate timed out after {self.seconds:.0f}s: {self.command}"
        state = "passed" if self.passed else f"failed (exit {self.exit_code})"
        took = f" (the base's version of {len(self.swapped)} test path(s))" if self.swapped else ""
        return f"gate {state} in {self.seconds:.1f}s: {self.command}{took}"


KEPT_BYTES = 200_000  # of a gate's output, its end, whatever its length


def wrapped(command: str, timeout_s: float) -> str:
    """The gate's command in a shell of its own (its ``exit`` is its own) under ``timeout``
    when the sandbox has one (so a gate past its time still shows what it printed), its
    output kept to its last KEPT_BYTES (the runtime keeps a command's first megabyte)."""
    inner, limit = shlex.quote(command), f"{timeout_s:.3f}"
    return (
        'f=$(mktemp 2>/dev/null || echo "${TMPDIR:-/tmp}/orch-gate.$$"); '
        f"if command -v timeout >/dev/null 2>&1; then timeout -k 5 {limit} sh -c {inner}; "
        f'else sh -c {inner}; fi >"$f" 2>&1; rc=$?; n=$(wc -c <"$f"); '
        f'if [ "$n" -gt {KEPT_BYTES} ]; then echo "[$n bytes of output; its end:]"; fi; '
        f'tail -c {KEPT_BYTES} "$f"; rm -f "$f"; exit $rc'
    )


def trim(results: list[GateResult], candidate: int) -> None:
    """An earlier gate's output is its writer's past: keep a few lines of it (the last
    result of each candidate stays whole), so a team's record stays small."""
    for g in results:
        if g.candidate == candidate and len(g.output) > 500:
            g.output = tail(g.output, 500)


def tail(text: str, limit: int = OUTPUT_KEPT) -> str:
    """The end of ``text``, at most ``limit`` characters, saying what was cut."""
    if len(text) <= limit:
        return text
    return f"[... {len(text) - limit:,} earlier characters cut ...]\n" + text[-limit:]


class GateDriver:
    """The body of a gate run: the command, once, in the run's workspace."""

    def __init__(self, command: str, timeout_s: float, network: NetworkSetting | None) -> None:
        self.command = command
        self.timeout_s = timeout_s
        self.definition = AgentDefinition(
            name="gate",
            description="A team's test gate: its command in the writer's sandbox.",
            tools=[],
            network=network,  # the writer agent's: the same network as the writer had
            system_prompt="",
            source="orch team",
        )

    async def drive(self, run: Driven) -> LoopOutcome:
        started = time.monotonic()
        result = await run.runtime.exec(
            wrapped(self.command, self.timeout_s), timeout_s=self.timeout_s + 15, env=run.env
        )
        seconds = round(time.monotonic() - started, 3)
        # timeout(1) ends a command past its time with 124 (137 when it had to kill it)
        timed_out = result.timed_out or (
            result.exit_code in (124, 137) and seconds >= self.timeout_s
        )
        passed = result.exit_code == 0 and not timed_out
        facts: dict[str, Any] = {
            "kind": "gate",
            "command": self.command,
            "exit_code": result.exit_code,
            "timed_out": timed_out,
            "seconds": seconds,
            "passed": passed,
        }
        run.runner.event(run.record.run_id, "gate_result", facts)
        text = tail(result.output)
        if passed:
            return LoopOutcome(RunStatus.SUCCEEDED, text, None, [facts])
        why = f"timed out after {self.timeout_s:g}s" if timed_out else f"exit {result.exit_code}"
        return LoopOutcome(RunStatus.FAILED, text, f"gate {why}: {self.command}", [facts])


def gate_result(
    record: RunRecord, round_no: int, candidate: int, commit: str, command: str
) -> GateResult:
    """What a finished gate run says."""
    facts = next((a for a in record.artifacts if a.get("kind") == "gate"), None)
    where = {"round": round_no, "candidate": candidate, "run_id": record.run_id}
    where |= {"commit": commit, "command": command}
    if facts is None:  # the run failed before the command ran (its checkout, a limit)
        timed_out = record.status == RunStatus.TIMED_OUT
        why = record.error or record.status.value
        return GateResult(**where, passed=False, timed_out=timed_out, error=why)
    return GateResult(
        **where,
        passed=bool(facts.get("passed")) and record.status == RunStatus.SUCCEEDED,
        exit_code=facts.get("exit_code"),
        timed_out=bool(facts.get("timed_out")),
        seconds=float(facts.get("seconds") or 0.0),
        output=record.output or "",  # cut once, by the gate run (``tail``)
    )


def for_writer(gate: GateResult) -> str:
    """The message a writer gets when its change failed the gate."""
    return (
        f"The test gate failed on your change ({escaped(gate.headline())}), so no reviewer has "
        "seen it yet. Fix what fails, keep working on the same branch, then answer with your "
        f"summary as before.\n{base_tests(gate)}\nThe gate's output (its end):\n"
        f"{framed('gate_output', gate.output or '(none)')}\n"
    )


def base_tests(gate: GateResult) -> str:
    """What a gate with ``gate_from = "base"`` ran instead of the branch's tests."""
    if not gate.swapped:
        return ""
    shown = ", ".join(gate.swapped[:20]) + (", ..." if len(gate.swapped) > 20 else "")
    return (
        "\nThe gate ran the base's tests and test configuration, not the branch's: its "
        f"version of {escaped(shown)} was not used (gate_from = base).\n"
    )


def for_reviewer(gate: GateResult | None) -> str:
    """What a reviewer is told about the gate beside the diff."""
    if gate is None:
        return "This team has no test gate: check the tests yourself.\n"
    shown = tail(gate.output, 2_000) or "(no output)"
    return (
        f"The test gate passed on this commit ({escaped(gate.headline())}). {base_tests(gate)}"
        f"Its output (its end):\n{framed('gate_output', shown)}\n"
    )
