"""Where a Python interpreter loads code from before and beside what it is asked to run.

A file in any of these places runs inside the interpreter, unasked: ``sitecustomize`` and
``usercustomize`` from anywhere on the search path, a module that shadows one the program
imports, a ``.pth`` file's ``import`` line in a site directory. So the places are: the
search path after ``site`` (each site directory's ``.pth`` entries included, also those
that do not exist yet: a ``.pth`` names a directory an agent may make later), the user
site directory, the interpreter's prefixes and its ``pyvenv.cfg``, and the files of the
modules already loaded. orch's own interpreter is checked at the door
(``process/interpreter.py``), a hook's by the hook guard (``hookguard.py``); both with
the guard's ``passes_through`` rule against the workspaces.
"""

from __future__ import annotations

import contextlib
import json
import os
import site
import subprocess
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

PROBE_TIMEOUT_S = 10.0
# What another interpreter says of itself without running ``site`` (``-I -S``): nothing of
# its site directories runs. Its venv is found as ``site.venv`` would, without the
# ``addsitepackages`` that would run their ``.pth`` files.
PROBE = """
import json, os, site, sys
exe = os.path.abspath(sys.executable); bin_dir = os.path.dirname(exe)
top = os.path.dirname(bin_dir); prefixes = [sys.prefix, sys.exec_prefix]; user = True
cfg = [c for c in (os.path.join(bin_dir, 'pyvenv.cfg'), os.path.join(top, 'pyvenv.cfg'))
       if os.path.isfile(c)]
if cfg:
    shared = 'true'
    with open(cfg[0], encoding='utf-8') as f:
        for line in f:
            k, _, v = line.partition('=')
            if k.strip().lower() == 'include-system-site-packages':
                shared = v.strip().lower()
    prefixes = [top] + (prefixes if shared == 'true' else [])
    user = shared == 'true'
print(json.dumps({'path': sys.path, 'site': site.getsitepackages(prefixes),
    'user': site.getusersitepackages() if user else None, 'prefixes': prefixes + cfg}))
"""


@dataclass(frozen=True)
class Place:
    """A file or directory an interpreter loads code from, and why it does."""

    path: str
    why: str


def pth_entries(sitedir: str) -> Iterator[tuple[str, str]]:
    """(directory, ``.pth`` file) for every directory a ``.pth`` file of ``sitedir`` adds
    to the search path, whether or not it exists yet (``site`` adds those that do)."""
    with contextlib.suppress(OSError):
        names = sorted(n for n in os.listdir(sitedir) if n.endswith(".pth"))
        for name in names:
            pth = os.path.join(sitedir, name)
            with contextlib.suppress(OSError, UnicodeDecodeError), open(pth) as f:
                for line in f:
                    if line.startswith("#") or not line.strip():
                        continue
                    if line.startswith(("import ", "import\t")):
                        continue  # code: what it loads comes from the places checked here
                    yield os.path.join(sitedir, line.rstrip()), pth


def _site_places(sitedirs: Iterable[str], why: str) -> Iterator[Place]:
    for sitedir in dict.fromkeys(sitedirs):
        yield Place(sitedir, why)
        for entry, pth in pth_entries(sitedir):
            yield Place(entry, f"named by {pth}")


def _is_site_dir(entry: str) -> bool:
    return os.path.basename(entry.rstrip(os.sep)) in ("site-packages", "dist-packages")


def own_places(skip_first: bool) -> list[Place]:
    """The places this interpreter loads code from (``skip_first``: not ``sys.path[0]``,
    the directory a ``python -m``/``-c`` was typed in, which belongs to that command
    alone); the files of loaded modules are :func:`loaded_files`."""
    found = [Place(sys.executable, "orch's Python interpreter")]
    found += [Place(p, "its prefix (pyvenv.cfg)") for p in {sys.prefix, sys.exec_prefix}]
    env_path = set(os.environ.get("PYTHONPATH", "").split(os.pathsep)) - {""}
    for entry in sys.path[1:] if skip_first else sys.path:
        why = "PYTHONPATH" if entry in env_path and not sys.flags.ignore_environment else ""
        found.append(Place(os.path.abspath(entry), why or "sys.path"))
    sitedirs = [*site.getsitepackages(), *(e for e in sys.path if _is_site_dir(e))]
    if site.ENABLE_USER_SITE:
        sitedirs.append(site.getusersitepackages())
    found += _site_places(sitedirs, "a site directory")
    return found


def loaded_files() -> Iterator[Place]:
    """The file of every module this interpreter has loaded (``sitecustomize`` among them,
    if one ran), and the directories an editable install's finder maps a package to."""
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if isinstance(file, str):
            yield Place(file, f"module {name}")
        mapping = getattr(module, "MAPPING", None)  # setuptools' __editable___*_finder
        if name.startswith("__editable__") and isinstance(mapping, dict):
            for package, where in mapping.items():
                if isinstance(where, str):
                    yield Place(where, f"an editable install of {package}")


_ASKED: dict[tuple[str, ...], dict[str, Any]] = {}  # an interpreter's answer, per process


def _ask(python: str, cwd: str, env: Mapping[str, str]) -> dict[str, Any]:
    """What ``python`` (started with ``env``) says of its paths; an interpreter does not
    move its prefix or site directories, so it is asked once (what its ``.pth`` files
    name is read each time)."""
    asked: tuple[str, ...] = ()
    with contextlib.suppress(OSError):
        st = os.stat(python)
        asked = (python, os.path.realpath(python), str(st.st_mtime_ns), json.dumps(dict(env)))
    if asked and asked in _ASKED:
        return _ASKED[asked]
    done = subprocess.run(
        [python, "-I", "-S", "-c", PROBE],
        capture_output=True,
        cwd=cwd,
        env=dict(env),
        timeout=PROBE_TIMEOUT_S,
        check=False,
    )
    said = json.loads(done.stdout)
    if not isinstance(said, dict):
        raise ValueError("not an object")
    if asked and len(_ASKED) < 64:
        _ASKED[asked] = said
    return said


def probe_places(
    python: str, *, site_runs: bool, cwd: str, env: Mapping[str, str]
) -> list[Place] | str:
    """The places interpreter ``python`` loads code from when started with ``env``,
    without ``-S`` (``site_runs``) or with it; a one-line reason when it cannot say (it is
    asked with ``-I -S``, so nothing of those places runs while it answers)."""
    try:
        said = _ask(python, cwd, env)
        path, sitedirs, user = list(said["path"]), list(said["site"]), said["user"]
        prefixes = list(said["prefixes"])
    except (OSError, subprocess.SubprocessError, ValueError, KeyError, TypeError) as e:
        return f"{python} did not say where it imports from ({type(e).__name__})"
    found = [Place(str(p), "its prefix (pyvenv.cfg)") for p in prefixes]
    found += [Place(str(p), "its sys.path") for p in path]
    if site_runs:
        found += _site_places(map(str, sitedirs), "a site directory")
        if user:
            found += _site_places([str(user)], "its user site directory")
    return found
