"""``orch sandbox``: build the sandbox image, show the lockdown, list and prune containers."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Annotated, Any

import typer

from ..catalog.agent_trust import load_trusted
from ..errors import OrchError
from ..process.opened import root_of
from .common import WorkdirOpt, age, announce_trust, handles_errors, print_json
from .safe import shown

sandbox_app = typer.Typer(
    help="Container sandboxes: build the image, show the lockdown, list and prune containers.",
    no_args_is_help=True,
)

JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")]


def build_script() -> Path:
    """``build.sh`` of the image build: shipped in the wheel, or in a checkout's sandboxes/."""
    from ..catalog.definitions import bundled_dir

    found = bundled_dir("sandboxes")
    script = found / "build.sh" if found else None
    if script is None or not script.is_file():
        raise OrchError(
            "the sandbox image build (sandboxes/build.sh) is not part of this install; "
            "reinstall orch (pip install --force-reinstall orch) or run it from a checkout"
        )
    return script


@sandbox_app.command("build")
@handles_errors
def build_cmd(
    base: Annotated[
        str | None, typer.Option("--base", help="Base image (default debian:bookworm-slim).")
    ] = None,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run", help="Decide the base image (pulling it), then print the builds instead."
        ),
    ] = False,
) -> None:
    """Build orch-sandbox:latest (sandboxes/build.sh). When no registry answers within a few
    seconds (REGISTRY_TIMEOUT, default 4), it builds a Debian base with debootstrap instead."""
    from ..workspaces.container.docker import docker_client

    script = build_script()
    docker_client().close()  # one clear line when the engine is not reachable
    from ..fs.hostprograms import host_path, host_program  # none an agent could plant

    env = {**os.environ, "PATH": host_path(), **({"BASE": base} if base else {})}
    argv = [host_program("bash") or "/bin/bash", str(script), *(["--dry-run"] if dry_run else [])]
    out = subprocess.PIPE
    proc = subprocess.Popen(
        argv, env=env, stdout=out, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL
    )
    fallback = ""
    assert proc.stdout is not None
    for line in proc.stdout:
        typer.echo(shown(line.rstrip("\n")))
        if ("debootstrap" in line or "cannot pull" in line) and not fallback:
            fallback = line.strip().removeprefix("build.sh: ")
    code = proc.wait()
    if fallback:
        did = "would fall back" if dry_run else "fell back"
        typer.echo(
            f"orch: no usable base image: {did} to debootstrap ({shown(fallback)})", err=True
        )
    if code != 0:
        raise OrchError(f"sandbox build failed (exit {code}); see the output above")


def _effective(as_root: bool, workdir: Path | None) -> dict[str, Any]:
    from ..workspaces.container.docker import sandbox_user

    settings, trust = load_trusted(root_of(workdir))
    announce_trust(trust)
    cfg = settings.sandbox
    data = cfg.model_dump()
    data["memswap_limit"] = cfg.memswap_limit or cfg.mem_limit
    uid, gid = sandbox_user(cfg)
    how = (
        "sandbox.user" if cfg.user else ("sandbox.uid (orch runs as root)" if as_root else "yours")
    )
    data["effective_user"] = f"{uid}:{gid}"
    data["effective_user_from"] = how
    return data


@sandbox_app.command("config")
@handles_errors
def config_cmd(workdir: WorkdirOpt = None, as_json: JsonFlag = False) -> None:
    """Print the sandbox settings in effect: the limits every container gets."""
    data = _effective(os.geteuid() == 0, workdir)
    if as_json:
        print_json(data)
        return
    for key, value in data.items():
        typer.echo(f"{key:<20} {shown(value)}")


def _rows() -> list[dict[str, Any]]:
    from ..workspaces.container.docker import docker_client, list_containers

    client = docker_client()
    try:
        found = list_containers(client)
    finally:
        client.close()
    rows = []
    for c in found:
        labels = c["labels"]
        created = labels.get("orch.created_at", "")
        rows.append(
            {
                "id": c["id"][:12],
                "run_id": labels.get("orch.run_id") or None,
                "chain_id": labels.get("orch.chain_id") or None,
                "agent": labels.get("orch.agent"),
                "pool": labels.get("orch.pool") == "true",
                "owner_pid": labels.get("orch.owner_pid"),
                "owner_alive": c["owner_alive"],
                "state": c["state"],
                "status": c["status"],
                "image": c["image"],
                "created_at": float(created) if created else None,
            }
        )
    return rows


@sandbox_app.command("ps")
@handles_errors
def ps_cmd(as_json: JsonFlag = False) -> None:
    """List orch's containers (found by label), with their run and owner."""
    rows = _rows()
    if as_json:
        print_json(rows)
        return
    if not rows:
        typer.echo("no orch containers")
        return
    typer.echo(f"{'container':<13} {'run':<16} {'owner':<14} {'state':<9} {'age':>5}  image")
    for r in rows:  # labels and names of containers: shown, never obeyed
        run = shown(r["run_id"] or ("(pool)" if r["pool"] else "-"))
        owner = shown(f"{r['owner_pid']} {'alive' if r['owner_alive'] else 'dead'}")
        typer.echo(
            f"{shown(r['id']):<13} {run:<16} {owner:<14} {shown(r['state']):<9} "
            f"{age(r['created_at']):>5}  {shown(r['image'])}"
        )


@sandbox_app.command("prune")
@handles_errors
def prune_cmd(workdir: WorkdirOpt = None, as_json: JsonFlag = False) -> None:
    """Remove orch containers whose owner process is gone (first, the ended runs of this
    project that own one get their work saved to their branches)."""
    from ..process.reconcile import reconcile
    from ..store import open_store
    from ..workspaces.container.docker import reap_by_label

    root = root_of(workdir)
    store = open_store(root, load_trusted(root)[0].store)  # ORCH_STORE, or `store` if trusted
    try:
        reconcile(store)  # salvages what this project's interrupted runs left in containers
    finally:
        store.close()
    removed = reap_by_label()
    if as_json:
        print_json({"removed_containers": removed})
        return
    for cid in removed:
        typer.echo(f"removed container {shown(cid[:12])}")
    if not removed:
        typer.echo("nothing to prune")
