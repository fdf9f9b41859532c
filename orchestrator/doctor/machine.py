"""``orch doctor``'s checks of the machine: Python, git, bubblewrap, Docker and the sandbox
image, the model API's credentials and endpoint."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

from ..errors import OrchError
from ..models import api_env
from .base import Check, Status

if TYPE_CHECKING:
    from ..config import Settings
    from ..models.config import Endpoint
    from ..models.registry import ApiEnv

MIN_PYTHON = (3, 11)
PROBE_TIMEOUT_S = 3.0  # the model endpoint: any HTTP answer within it counts as reachable


def _run(argv: list[str], timeout: float = 10.0) -> tuple[int, str]:
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return -1, str(e)
    text = (done.stdout or done.stderr).strip()
    return done.returncode, text.splitlines()[0] if text else ""


# -- the machine ------------------------------------------------------------------------


def check_python() -> Check:
    version = ".".join(map(str, sys.version_info[:3]))
    detail = f"Python {version} ({sys.executable})"
    if sys.version_info[:2] < MIN_PYTHON:
        want = ".".join(map(str, MIN_PYTHON))
        fix = f"install Python {want} or newer and reinstall orch with it (pip install orch)"
        return Check(name="python", status=Status.FAIL, detail=detail, fix=fix, required=True)
    return Check(name="python", status=Status.OK, detail=detail, required=True)


def check_git() -> Check:
    from ..fs.hostprograms import host_program  # the git orch runs (none in a checkout)

    git = host_program("git")
    fix = "install git (apt-get install git); the worktree and container tiers need it"
    if git is None:
        detail = "git not found on PATH"
        return Check(name="git", status=Status.FAIL, detail=detail, fix=fix, required=True)
    code, text = _run([git, "--version"])
    if code != 0:
        detail = f"{git} does not run ({text or f'exit status {code}'})"
        return Check(name="git", status=Status.FAIL, detail=detail, fix=fix, required=True)
    return Check(name="git", status=Status.OK, detail=f"{text} ({git})", required=True)


def check_bwrap(settings: Settings) -> Check:
    """The bubblewrap the host tiers would run under, and that it makes a sandbox here."""
    from ..bwrap.find import BWRAP_ENV, effective_setting
    from ..bwrap.profile import bwrap_choice

    if settings.sandbox.os == "off":
        return Check(
            name="bwrap",
            status=Status.WARN,
            detail='sandbox.os = "off": commands of the shared and worktree tiers run unsandboxed',
            fix='remove sandbox.os = "off" from orch.toml or ~/.orch/config.toml',
        )
    setting = effective_setting(settings.sandbox.bwrap)
    named = f"${BWRAP_ENV}" if os.environ.get(BWRAP_ENV) else "sandbox.bwrap"
    choice = bwrap_choice(settings.sandbox.bwrap)
    if choice.path is None:
        detail, fix = _split_reason(choice.reason, setting)
        return Check(name="bwrap", status=Status.FAIL, detail=detail, fix=fix, required=True)
    version = choice.version or "version unknown"
    detail = f"{choice.source} {choice.path} ({version}; {named} = {setting!r}) works"
    return Check(name="bwrap", status=Status.OK, detail=detail, required=True)


def _split_reason(reason: str | None, setting: str) -> tuple[str, str]:
    """The cause and the fix of a one-line reason ("cause; fix: ..." or "cause: FIX")."""
    from ..bwrap.find import FIX

    reason = reason or f"no bwrap works here (sandbox.bwrap = {setting!r})"
    if "; fix: " in reason:
        cause, _, fix = reason.partition("; fix: ")
        return cause, fix
    if reason.endswith(f": {FIX}"):
        return reason.removesuffix(f": {FIX}"), FIX
    if setting == "system":
        return reason, 'apt-get install bubblewrap, or set sandbox.bwrap = "auto" (bundled)'
    if setting not in ("auto", "bundled"):
        return reason, f'fix or remove sandbox.bwrap = "{setting}" (or set it to "auto")'
    return reason, FIX


def check_docker(settings: Settings) -> list[Check]:
    """The Docker engine and the sandbox image (only the container tier needs them)."""
    from ..workspaces.container.docker import docker_client

    image = settings.sandbox.image
    try:
        client = docker_client()
    except OrchError as e:
        fix = "start the Docker engine (systemctl start docker) or set DOCKER_HOST to one"
        skipped = Check(
            name="image", status=Status.SKIP, detail=f"{image}: not checked (no Docker engine)"
        )
        return [Check(name="docker", status=Status.WARN, detail=str(e), fix=fix), skipped]
    try:
        try:
            version = str(client.version().get("Version", "?"))
        except Exception as e:  # an engine that answers the socket but not the API
            detail = f"the Docker engine does not answer ({e})"
            fix = "restart the Docker engine (systemctl restart docker)"
            skipped = Check(name="image", status=Status.SKIP, detail=f"{image}: not checked")
            return [Check(name="docker", status=Status.WARN, detail=detail, fix=fix), skipped]
        engine = Check(name="docker", status=Status.OK, detail=f"Docker engine {version}")
        return [engine, _image(client, image)]
    finally:
        client.close()


def _image(client: object, image: str) -> Check:
    from docker.errors import DockerException, ImageNotFound

    try:
        found = client.images.get(image)  # type: ignore[attr-defined]
    except ImageNotFound:
        fix = (
            "orch sandbox build"
            if image == "orch-sandbox:latest"
            else f"docker pull {image}, or set sandbox.image (orch sandbox build makes "
            "orch-sandbox:latest)"
        )
        detail = f"{image} is not present: the container tier cannot start"
        return Check(name="image", status=Status.WARN, detail=detail, fix=fix)
    except DockerException as e:
        detail = f"{image}: the engine could not look it up ({e})"
        return Check(name="image", status=Status.WARN, detail=detail, fix="orch sandbox build")
    short = str(getattr(found, "short_id", "")).removeprefix("sha256:")
    return Check(name="image", status=Status.OK, detail=f"{image} present ({short})")


# -- the model API ----------------------------------------------------------------------


def shown_url(url: str) -> str:
    """A URL safe to print: no user, no password, no query or fragment (they may hold keys)."""
    parts = urlsplit(url.strip())
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    try:
        port = parts.port
    except ValueError:
        port = None
    netloc = f"{host}:{port}" if port is not None else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def _api(model: str, endpoints: Mapping[str, Endpoint] | None = None) -> ApiEnv | str:
    """The API settings of the provider of ``model`` (the project's default model; a named
    endpoint of ``endpoints``), or why there are none."""
    try:
        return api_env(model, endpoints)
    except OrchError as e:
        return str(e)


def _check_named(api: ApiEnv) -> Check:
    """A named endpoint's: its URL is the setting's, its key in its own variable."""
    where = shown_url(api.default_url)
    if api.credentials and not os.environ.get(api.credentials[0]):
        detail = f"{api.credentials[0]} not set: {api.title} ({where}) has no key"
        return Check(
            name="api", status=Status.WARN, detail=detail, fix=f"export {api.credentials[0]}=..."
        )
    keys = f"{api.credentials[0]} set" if api.credentials else "no key_env (it needs no key)"
    return Check(name="api", status=Status.OK, detail=f"{api.title}: {keys}; {where}")


def check_api(model: str = "", endpoints: Mapping[str, Endpoint] | None = None) -> Check:
    """Which credentials and base URL the model client would use (never their values)."""
    api = _api(model, endpoints)
    if isinstance(api, str):
        fix = "set `model` (or ORCH_MODEL) to an alias, a model id or a known PREFIX + id"
        return Check(name="api", status=Status.FAIL, detail=api, fix=fix)
    if not api.base_url:
        return _check_named(api)
    have = [name for name in api.credentials if os.environ.get(name)]
    base = os.environ.get(api.base_url, "").strip()
    where = f"{api.base_url}={shown_url(base)}" if base else f"{api.base_url} not set"
    if not have and not base:
        *some, last = api.names
        detail = f"no {', '.join(some)} or {last} set: only scripted models can run"
        fix = f"export {api.credentials[0]}=... (or {api.base_url}=URL of a compatible server)"
        fix += ", or pass --model scripted:FILE"
        return Check(name="api", status=Status.WARN, detail=detail, fix=fix)
    keys = (
        ", ".join(f"{n} set" for n in have) if have else "no API key set (the server may need none)"
    )
    return Check(name="api", status=Status.OK, detail=f"{keys}; {where}")


Probe = Callable[[str, float], str | None]


def http_probe(url: str, timeout: float) -> str | None:
    """None when anything at ``url`` gives an HTTP answer (any status), else why not."""
    request = urllib.request.Request(url, method="HEAD", headers={"User-Agent": "orch-doctor"})
    try:
        with urllib.request.urlopen(request, timeout=timeout):  # noqa: S310 (http/https only)
            return None
    except urllib.error.HTTPError:
        return None  # 401, 404, 405: it answered
    except urllib.error.URLError as e:
        return str(e.reason)
    except (OSError, ValueError) as e:
        return str(e) or type(e).__name__


def check_endpoint(
    offline: bool,
    probe: Probe = http_probe,
    model: str = "",
    endpoints: Mapping[str, Endpoint] | None = None,
) -> Check:
    """Whether the model endpoint answers HTTP within ``PROBE_TIMEOUT_S`` (no key is sent)."""
    if offline:
        return Check(name="endpoint", status=Status.SKIP, detail="not probed (--offline)")
    api = _api(model, endpoints)
    if isinstance(api, str):
        return Check(name="endpoint", status=Status.SKIP, detail="not probed (see api)")
    base = os.environ.get(api.base_url, "").strip() if api.base_url else ""
    named = not api.base_url  # a named endpoint: always probed at its setting's URL
    if not named and not base and not any(os.environ.get(n) for n in api.credentials):
        detail = "not probed: no credentials or base URL set (see api)"
        return Check(name="endpoint", status=Status.SKIP, detail=detail)
    url = shown_url(base or api.default_url)
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return Check(
            name="endpoint",
            status=Status.FAIL,
            detail=f"{api.base_url} {url!r} is not an http(s) URL",
            fix=f"export {api.base_url}=https://HOST[:PORT] (or unset it for {api.title})",
        )
    why = probe(url, PROBE_TIMEOUT_S)
    if why is None:
        return Check(name="endpoint", status=Status.OK, detail=f"{url} answers")
    detail = f"{url} does not answer within {PROBE_TIMEOUT_S:g} s ({why})"
    fix = f"check the network (and HTTPS_PROXY), or that the server at {api.base_url or url} runs"
    fix += "; --offline skips this check"
    return Check(name="endpoint", status=Status.FAIL, detail=detail, fix=fix)
