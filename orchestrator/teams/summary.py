"""A team run in words: the text of its root run's output, and of ``orch team status``."""

from __future__ import annotations

from ..untrusted import one_line
from .progress import TeamResult


def summary(res: TeamResult) -> str:
    """Plain lines (the CLI escapes them when it draws them)."""
    plan = res.plan
    reviewers = ", ".join(plan.reviewers)
    writers = f"{plan.writers} x {plan.writer}" if plan.writers > 1 else plan.writer
    if plan.lead is not None:
        writers = f"lead {plan.lead} + {plan.teammates} x {plan.writer}"
    where = "" if plan.lead is not None else f", round {res.rounds} of {res.max_rounds}"
    lines = [f"{plan.title}: {writers} + {reviewers} (approve: {plan.approve}){where}"]
    if res.resumed_from:
        lines.append(f"continues team run {res.resumed_from}")
    if res.branch:
        stat = res.diffstat
        changed = (
            f", {stat.get('files_changed', 0)} file(s) +{stat.get('insertions', 0)} "
            f"-{stat.get('deletions', 0)}"
            if stat
            else ""
        )
        lines.append(
            f"branch {res.branch} at {(res.commit or '')[:12]} (base {res.base[:12]}{changed})"
        )
    if res.board is not None:
        lines.append(f"lead {plan.lead}, {plan.teammates} teammate(s); the board:")
        for t in res.board.tasks:
            who = f" [{t.owner}]" if t.owner else ""
            lines.append(f"  {t.id} {t.state}{who}: {one_line(t.title)}")
    for g in res.gates:
        if plan.lead is not None:  # a task's gate: its number, its attempt
            again = f" (attempt {g.round})" if g.round > 1 else ""
            lines.append(f"t{g.candidate}{again}: {g.headline()}")
            continue
        which = f" candidate {g.candidate}" if plan.writers > 1 else ""
        lines.append(f"round {g.round}{which}: {g.headline()}")
    for r in res.reviews:
        seen = ", ".join(map(str, r.candidates))
        chose = f", chose candidate {r.chosen} of {seen}" if len(r.candidates) > 1 else ""
        state = "approved" if r.approved else "not approved"
        lines.append(f"round {r.round} review: {state} ({r.approvals} approval(s){chose})")
        for note in r.notes:
            v = note.verdict
            picked = f" (candidate {v.choice})" if len(r.candidates) > 1 else ""
            lines.append(f"  [{note.reviewer}] {v.verdict}{picked}: {one_line(v.summary)}")
            lines += [
                f"    - {one_line(c.path)}:{c.line}: {one_line(c.comment)}" for c in v.comments
            ]
    for c in res.kept():
        why = f" ({one_line(c.error)})" if c.state == "failed" and c.error else f" ({c.state})"
        lines.append(f"kept candidate {c.number}: {c.branch}{why}")
    if res.merged:
        lines.append(f"merged into your HEAD at {(res.merge_commit or '')[:12]}")
    if res.approved:
        lines.append("approved")
    if res.error:
        error = one_line(res.error)
        lines.append(f"error: {error}" if res.approved else f"not approved: {error}")
    return "\n".join(lines)
