"""`orch trust`: let a repository's own settings that run commands or weaken isolation apply.

What is gated, the hash and the store are in ``orchestrator/trust.py``.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Annotated

import typer

from .. import trust as trusting
from ..catalog.agent_trust import load_trusted
from ..errors import UsageError
from ..process.opened import root_of
from ..project import truststore
from .common import WorkdirOpt, handles_errors, out, print_json
from .safe import safe_text


def _say(text: str) -> None:
    out.print(safe_text(text), soft_wrap=True)  # one line each, whatever the width


def _status(t: trusting.Trust) -> str:
    if t.digest is None:
        return "nothing to trust (no gated settings)"
    if t.trusted:
        return "yes"
    if t.recorded is not None:
        return "no: the settings changed since they were trusted"
    return "no"


@handles_errors
def trust(
    show: Annotated[
        bool, typer.Option("--show", help="Print what would be trusted and whether it is.")
    ] = False,
    revoke: Annotated[
        bool, typer.Option("--revoke", help="Stop trusting this repository.")
    ] = False,
    workdir: WorkdirOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Let this repository's settings that run commands or weaken isolation apply.

    Hooks, sandbox.os = "off", network = "host", ... (docs/REFERENCE.md: Workspace trust)
    are left out of a repository's orch.toml until it is trusted; a change to them needs
    trust again.
    """
    if show and revoke:
        raise UsageError("--show and --revoke do not go together; use one of them")
    root = root_of(workdir)
    if revoke:
        removed = truststore.revoke(root)
        if as_json:
            print_json({"root": str(root), "revoked": removed})
        else:
            what = "no longer trusted" if removed else "was not trusted"
            _say(f"{root}: {what}")
        return
    _, t = load_trusted(root)
    if not show and t.digest is not None and not t.trusted:
        trusting.record(t)
        t = replace(t, recorded=t.digest)
    if as_json:
        print_json(
            {
                "root": str(root),
                "settings": t.relevant,
                "sha256": t.digest,
                "trusted": t.trusted,
                "recorded_sha256": t.recorded,
                "trust_file": str(truststore.trust_file()),
            }
        )
        return
    if not show:
        if t.digest is None:
            _say(f"{root}: nothing to trust (its settings need no trust)")
        else:
            names = ", ".join(t.relevant)
            _say(f"{root}: trusted {names} (sha256 {t.digest})")
        return
    _say(f"repository  {root}")
    _say(f"trusted     {_status(t)}")
    if t.digest is None:
        return
    _say(f"sha256      {t.digest}")
    _say("settings")
    for name, value in t.relevant.items():
        text = json.dumps(value, sort_keys=True, ensure_ascii=False)
        _say(f"  {name} = {text}")


def register(app: typer.Typer) -> None:
    app.command("trust")(trust)
