"""`orch dashboard`: the live web view of this project's runs (orchestrator/dashboard/)."""

from __future__ import annotations

import webbrowser
from typing import Annotated

import typer

from .common import WorkdirOpt, err, handles_errors, open_project, out


def register(app: typer.Typer) -> None:
    app.command("dashboard")(dashboard)


@handles_errors
def dashboard(
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port (0: a free one).")] = 0,
    host: Annotated[str, typer.Option(help="A loopback address to listen on.")] = "127.0.0.1",
    no_open: Annotated[bool, typer.Option("--no-open", help="Do not open a browser.")] = False,
    workdir: WorkdirOpt = None,
) -> None:
    """Serve a live dashboard of this project's runs on loopback; prints its URL (with a
    token: keep it to yourself). Ctrl-C stops it."""
    from ..dashboard.server import Served

    project = open_project(workdir, quiet=True)
    served = Served(project.store, project.root, host, port)
    out.print(served.url, soft_wrap=True)
    err.print("orch: dashboard running; Ctrl-C stops it (the URL holds its token)")
    opener = None
    if not no_open:  # through a page of the user's with a one-time code: no token in a file
        try:
            opener = served.opener()
        except OSError as e:
            err.print(f"orch: no browser opened ({e}); open the URL above yourself")
        else:
            webbrowser.open(opener.as_uri())
    try:
        served.run()
    except KeyboardInterrupt:
        pass
    finally:
        served.close()
        if opener is not None:
            opener.unlink(missing_ok=True)
