"""What a team's reviewers see and answer, and what the team makes of their answers.

A reviewer gets each candidate branch's ``git diff base..branch`` (changes to control files
listed first) with the test gate's result beside it, and answers with one JSON object;
:func:`parse_verdict` takes bare JSON, a fenced block or JSON in prose, and says in
:class:`VerdictError` what is wrong with anything else, so the reviewer can be asked once
more (:func:`reviewer_retry`). With several candidates (best of N) the verdict names its
``choice``; :func:`decide` turns every reviewer's verdict into the chosen candidate and
whether the team's ``approve`` rule (all, majority, any) is met. Comments go back to the
writer together, each tagged with its reviewer (:func:`for_writer`).
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..branches import control_changes
from ..errors import OrchError
from ..project.git import RepoPaths, git
from ..untrusted import escaped, framed
from .gatefrom import is_test_path

DIFF_LIMIT = 60_000  # characters of the diff put in the reviewer's prompt
ANSWER_QUOTE = 2_000  # characters of a malformed answer quoted back to the reviewer
_FENCE = re.compile(r"```[ \t]*(?:json|JSON)?[ \t]*\n(.*?)\n?[ \t]*```", re.DOTALL)


VERDICT_FORMAT = (
    '{"verdict": "approve" | "changes_requested", "summary": "<two or three sentences>", '
    '"comments": [{"path": "<file path relative to the repository root>", '
    '"line": <line number in the new version>, "comment": "<the problem and a fix>"}]}'
)


# -- the verdict --------------------------------------------------------------------


class Comment(BaseModel):
    """One review comment on a line of the branch's version of a file."""

    model_config = ConfigDict(extra="ignore")

    path: str = Field(min_length=1)
    line: int = Field(ge=1)
    comment: str = Field(min_length=1)


class Verdict(BaseModel):
    """What the reviewer answers with (extra keys are ignored)."""

    model_config = ConfigDict(extra="ignore")

    verdict: Literal["approve", "changes_requested"]
    summary: str
    comments: list[Comment] = Field(default_factory=list)
    choice: int | None = None  # best of N: the candidate the verdict is on

    @property
    def approved(self) -> bool:
        return self.verdict == "approve"


class VerdictError(OrchError):
    """The reviewer's answer is not a valid verdict; the message says what is wrong."""


def parse_verdict(text: str) -> Verdict:
    """The verdict in a reviewer's final text: bare JSON, a ```json fence, or JSON in prose."""
    stripped = text.strip()
    if not stripped:
        raise VerdictError("the answer is empty; expected one JSON object")
    fenced = _FENCE.search(stripped)
    candidate = fenced.group(1).strip() if fenced else stripped
    try:
        data: Any = json.loads(candidate)
    except json.JSONDecodeError as e:
        problem = f"the answer is not a JSON object ({e.msg} at line {e.lineno} column {e.colno})"
        start = candidate.find("{")  # JSON with prose around it
        if start < 0:
            raise VerdictError(problem) from None
        try:
            data, _ = json.JSONDecoder().raw_decode(candidate[start:])
        except json.JSONDecodeError:
            raise VerdictError(problem) from None
    if not isinstance(data, dict):
        raise VerdictError(f"the answer is JSON but not an object (got {type(data).__name__})")
    try:
        return Verdict.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'verdict'}: {err['msg']}"
            for err in e.errors()[:5]
        )
        raise VerdictError(f"the JSON object is not a valid verdict ({problems})") from None


# -- prompts ------------------------------------------------------------------------


def format_comments(verdict: Verdict) -> str:
    lines = [f"- {c.path}:{c.line}: {c.comment}" for c in verdict.comments]
    return escaped("\n".join(lines) or "(no line comments)")


def tagged(notes: list[tuple[str, Verdict]]) -> str:
    """Every reviewer's verdict and comments, each tagged with its reviewer."""
    parts = []
    for tag, v in notes:
        lines = [f"- [{tag}] {c.path}:{c.line}: {c.comment}" for c in v.comments]
        body = "\n".join(lines) or f"- [{tag}] (no line comments)"
        parts.append(framed("review", f"[{tag}] {v.verdict}: {v.summary}\n{body}", by=tag))
    return "\n\n".join(parts)


def for_writer(n: int, notes: list[tuple[str, Verdict]]) -> str:
    """The message a writer gets when the reviewers did not approve its change."""
    return (
        f"Round {n}: the reviewers did not approve your change yet. Address every comment "
        "below (each is tagged with its reviewer), keep working on the same branch, then "
        f"answer with your summary as before.\n\n{tagged(notes)}\n"
    )


def writer_followup(task: str, branch: str, n: int, message: str) -> str:
    """A writer's prompt when its earlier conversation is not kept: the task, then what to do."""
    return (
        f"{task}\n\n---\nRound {n}: you continue on the same branch, {branch}. Your earlier "
        f"commits are checked out in your workspace.\n\n{message}"
    )


CHOICE_FORMAT = '"choice": <the number of the candidate you judge best; your verdict is on it>'


def reviewer_prompt(
    task: str,
    shown: list[tuple[int, str, str, str]],
    base: str,
    n: int,
    rounds: int,
    previous: Verdict | None,
) -> str:
    """A reviewer's prompt. ``shown``: (candidate, branch, commit, diff and gate text) of
    each candidate that passed the gate; the first is checked out in its workspace."""
    earlier = ""
    if previous is not None:
        earlier = (
            "\nIn the previous round you requested these changes; check they were made:\n"
            f"{escaped(previous.summary)}\n{format_comments(previous)}\n"
        )
    first_branch = shown[0][1]
    if len(shown) == 1:
        _, branch, commit, body = shown[0]
        head = (
            f"Review round {n} of {rounds}: review branch {branch} (commit {commit[:12]}) "
            f"against base {base[:12]}."
        )
        fmt = VERDICT_FORMAT
    else:
        head = (
            f"Review round {n} of {rounds}: {len(shown)} writers each made a candidate "
            f"change from base {base[:12]}. Choose the best candidate, and give your verdict "
            "on it."
        )
        fmt = VERDICT_FORMAT[:-1] + ", " + CHOICE_FORMAT + "}"
    blocks = []
    for number, branch, commit, body in shown:
        label = f"Candidate {number}: " if len(shown) > 1 else ""
        blocks.append(f"## {label}branch {branch} (commit {commit[:12]})\n{body}")
    return (
        f"{head}\n\nThe task the change implements:\n{framed('task', task)}\n\n"
        f"Branch {first_branch} is checked out in your workspace: read its files with "
        f"read_file, glob and grep.\n{earlier}\n" + "\n\n".join(blocks) + "\n\nAnswer ONLY "
        f"with one JSON object, no prose around it:\n{fmt}\n"
    )


def candidate_block(base: str, commit: str, diff: str, gate: str) -> str:
    """One candidate as a reviewer sees it: the gate's result, then the diff."""
    return f"{gate}\nThe diff (git diff {base[:12]}..{commit[:12]}):\n{framed('diff', diff)}"


def reviewer_retry(first_prompt: str, answer: str, problem: str) -> str:
    quoted = answer.strip()[:ANSWER_QUOTE] or "(empty)"
    return (
        f"{first_prompt}\n---\nYour previous answer was not a valid verdict: {problem}.\n"
        f"Your previous answer was:\n{framed('previous_answer', quoted)}\n"
        "Answer again with ONLY the JSON object in the format above.\n"
    )


def check_choice(verdict: Verdict, candidates: list[int]) -> Verdict:
    """The verdict, its ``choice`` checked against the candidates shown (VerdictError)."""
    if len(candidates) == 1:
        return verdict.model_copy(update={"choice": candidates[0]})
    if verdict.choice is None:
        raise VerdictError(
            f'"choice" is missing: name the best candidate ({", ".join(map(str, candidates))})'
        )
    if verdict.choice not in candidates:
        raise VerdictError(
            f'"choice" is {verdict.choice}, not one of the candidates '
            f"({', '.join(map(str, candidates))})"
        )
    return verdict


# -- the decision -------------------------------------------------------------------


def decide(
    verdicts: list[Verdict], approve: Literal["all", "majority", "any"]
) -> tuple[int, int, bool]:
    """(the chosen candidate, the approvals it has, approved?) from every reviewer's verdict.

    The chosen candidate is the one most reviewers chose (a tie: the lowest number). A
    reviewer approves it only by approving it: an approval of another candidate does not
    count. ``approve``: ``all`` reviewers, a strict ``majority`` of them, or ``any`` one.
    """
    counts: dict[int, int] = {}
    for v in verdicts:
        assert v.choice is not None  # check_choice set it
        counts[v.choice] = counts.get(v.choice, 0) + 1
    chosen = min(counts, key=lambda c: (-counts[c], c))
    approvals = sum(1 for v in verdicts if v.approved and v.choice == chosen)
    need = {"all": len(verdicts), "majority": len(verdicts) // 2 + 1, "any": 1}[approve]
    return chosen, approvals, approvals >= need


# -- the diff -----------------------------------------------------------------------

DIFF_FLAGS = ("--no-color", "--no-ext-diff", "--no-textconv", "--ignore-submodules=dirty")


def _ordered(diff: str, names: list[str], first: list[str]) -> str:
    """``diff`` with the files of ``first`` (in that order) before the others. ``names``:
    its files in git's order, one section each (else the diff is left as it is)."""
    starts = [i for i, line in enumerate(diff.split("\n")) if line.startswith("diff --git ")]
    if not first or len(starts) != len(names):
        return diff
    lines = diff.split("\n")
    bounds = [*starts, len(lines)]
    section = {n: "\n".join(lines[bounds[i] : bounds[i + 1]]) for i, n in enumerate(names)}
    head = "\n".join(lines[: starts[0]]) if starts else ""
    rest = [n for n in names if n not in set(first)]
    ordered = [section[n] for n in [*first, *rest] if n in section]
    return "\n".join(p for p in [head, *ordered] if p)


def _listed(title: str, paths: list[str]) -> str:
    return f"[{title}]\n" + "\n".join(f"  {p}" for p in paths) + "\n\n"


async def branch_diff(repo: RepoPaths, base: str, commit: str, limit: int = DIFF_LIMIT) -> str:
    """The branch's diff for a person or a reviewer: changes to control files listed first,
    then changes to tests and their configuration (``gatefrom.is_test_path``), then the
    rest; each file's diff in that order too."""
    flags = (*DIFF_FLAGS, "--no-renames")
    result = await git("diff", *flags, base, commit, repo=repo)
    named = await git("diff", "--name-only", "-z", *flags, base, commit, repo=repo)
    names = [n for n in named.out.split("\0") if n]
    control = await asyncio.to_thread(control_changes, repo, base, commit)
    tests = [n for n in names if n not in control and is_test_path(n)]
    text = _ordered(result.out, names, [*control, *tests])
    if len(text) > limit:
        stat = await git("diff", "--stat", *flags, base, commit, repo=repo)
        text = (
            f"{text[:limit]}\n[diff cut at {limit:,} of {len(text):,} characters; read the "
            f"files for the rest. Files changed:]\n{stat.out}"
        )
    text = text or "(empty diff: the branch has no changes against the base)"
    if tests:
        text = (
            _listed(
                "TESTS OR TEST CONFIGURATION CHANGED: a gate with gate_from = base runs the "
                "base's versions; check these changes do not weaken what the tests prove:",
                tests,
            )
            + text
        )
    if control:
        text = (
            _listed(
                "CONTROL FILES CHANGED: these steer orch, git, CI, editors or agents on the "
                "user's machine; they are not merged without --allow-control-files. Review "
                "them first:",
                control,
            )
            + text
        )
    return text
