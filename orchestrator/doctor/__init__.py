"""``orch doctor``: what this machine and this project have of what orch needs.

Each check gives a status (``ok``, ``warn``, ``fail``, or ``skip`` when it was not made),
a one-line detail, and the exact fix (a command or a setting) when it is not ok. The
checks only look: they create no state dir, start no process and send no credential.
A check marked ``required`` is one the default tiers (shared, worktree) need; ``orch
doctor`` exits non-zero when one of them fails. ``machine.py`` has the checks of the
machine, ``project.py`` those of the project's state (settings and trust, what orch's
Python loads, store, warm process, worker host).
"""

from __future__ import annotations

from pathlib import Path

from .base import Check, Report, Status
from .machine import (
    Probe,
    check_api,
    check_bwrap,
    check_docker,
    check_endpoint,
    check_git,
    check_python,
    http_probe,
)
from .project import check_hosts, check_imports, check_store, project_settings

__all__ = ["Check", "Report", "Status", "diagnose"]


def diagnose(workdir: Path, *, offline: bool = False, probe: Probe = http_probe) -> Report:
    """Every check for the project at ``workdir``, in the order they are shown."""
    settings, trust_check = project_settings(workdir)
    checks = [check_python(), check_imports(workdir), check_git(), check_bwrap(settings)]
    checks += check_docker(settings)
    model = settings.resolve_model(None)  # the project's default: its provider's API
    endpoints = settings.endpoints  # a named endpoint's URL and key variable
    checks += [check_api(model, endpoints), check_endpoint(offline, probe, model, endpoints)]
    checks += [check_store(workdir, settings), trust_check, *check_hosts(workdir, settings)]
    ok = not any(c.required and c.status is Status.FAIL for c in checks)
    return Report(ok=ok, checks=checks)
