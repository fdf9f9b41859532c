"""`orch adopt-state`: vouch for a state directory an older orch made (``statedir.py``)."""

from __future__ import annotations

from pathlib import Path

import typer

from ..errors import UsageError
from ..project import statedir
from ..project.paths import project_root
from .common import WorkdirOpt, handles_errors, out
from .safe import safe_text


@handles_errors
def adopt_state(
    workdir: WorkdirOpt = None,
) -> None:
    """Mark this project's state directory (.orch, or $ORCH_HOME) as made by you.

    For a store an older orch made: orch refuses state without your owner mark, since a
    checkout or a copy could plant runs whose resources it would then kill or remove.
    Only adopt a directory you know your own orch made. A symlink, a directory git tracks
    state in, or one of another user is still refused.
    """
    wd = (workdir or Path.cwd()).expanduser()
    if not wd.is_dir():
        raise UsageError(f"--workdir {wd} is not a directory; pass an existing directory")
    done = statedir.adopt(statedir.state_path(project_root(wd)))
    out.print(safe_text(f"{done}: marked as yours; orch uses it again"), soft_wrap=True)


def register(app: typer.Typer) -> None:
    app.command(name="adopt-state")(adopt_state)
