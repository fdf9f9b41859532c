"""What a team's reviewer sees and answers: the branch's diff, the prompts of both roles, and
the JSON :class:`Verdict` parsed from the reviewer's final text (:mod:`orchestrator.teams.pair`
runs the rounds).

The reviewer gets ``git diff base..branch`` (changes to control files listed first) and
answers with one JSON object; :func:`parse_verdict` takes bare JSON, a fenced block or JSON
in prose, and says in :class:`VerdictError` what is wrong with anything else, so the
reviewer can be asked once more (:func:`reviewer_retry`).
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
    return "\n".join(lines) or "(no line comments)"


def writer_followup(task: str, branch: str, n: int, verdict: Verdict) -> str:
    return (
        f"{task}\n\n---\nRound {n}: you continue on the same branch, {branch}. Your earlier "
        "commits are checked out in your workspace. The reviewer requested changes; address "
        "every comment below, then answer with your summary as before.\n\n"
        f"Review summary: {verdict.summary}\n\nReview comments:\n{format_comments(verdict)}\n"
    )


def reviewer_prompt(
    task: str,
    branch: str,
    base: str,
    commit: str,
    diff: str,
    n: int,
    rounds: int,
    previous: Verdict | None,
) -> str:
    earlier = ""
    if previous is not None:
        earlier = (
            "\nIn the previous round you requested these changes; check they were made:\n"
            f"{previous.summary}\n{format_comments(previous)}\n"
        )
    return (
        f"Review round {n} of {rounds}: review branch {branch} (commit {commit[:12]}) "
        f"against base {base[:12]}.\n\nThe task the change implements:\n<task>\n{task}\n"
        "</task>\n\nThe branch is checked out in your workspace: read its files with "
        f"read_file, glob and grep.\n{earlier}\nThe diff (git diff {base[:12]}..{commit[:12]}):"
        f"\n```diff\n{diff}\n```\n\nAnswer ONLY with one JSON object, no prose around it:\n"
        f"{VERDICT_FORMAT}\n"
    )


def reviewer_retry(first_prompt: str, answer: str, problem: str) -> str:
    quoted = answer.strip()[:ANSWER_QUOTE] or "(empty)"
    return (
        f"{first_prompt}\n---\nYour previous answer was not a valid verdict: {problem}.\n"
        f"Your previous answer was:\n<previous_answer>\n{quoted}\n</previous_answer>\n"
        "Answer again with ONLY the JSON object in the format above.\n"
    )


# -- the diff -----------------------------------------------------------------------

DIFF_FLAGS = ("--no-color", "--no-ext-diff", "--no-textconv", "--ignore-submodules=dirty")


async def branch_diff(repo: RepoPaths, base: str, commit: str, limit: int = DIFF_LIMIT) -> str:
    """The branch's diff for the reviewer; changes to control files are listed first."""
    result = await git("diff", *DIFF_FLAGS, base, commit, repo=repo)
    text = result.out
    if len(text) > limit:
        stat = await git("diff", "--stat", *DIFF_FLAGS, base, commit, repo=repo)
        text = (
            f"{text[:limit]}\n[diff cut at {limit:,} of {len(text):,} characters; read the "
            f"files for the rest. Files changed:]\n{stat.out}"
        )
    text = text or "(empty diff: the branch has no changes against the base)"
    control = await asyncio.to_thread(control_changes, repo, base, commit)
    if control:
        text = (
            "[CONTROL FILES CHANGED: these steer orch, git or CI on the user's machine; they are "
            "not merged without --allow-control-files. Review them first:]\n"
            + "\n".join(f"  {p}" for p in control)
            + "\n\n"
            + text
        )
    return text
