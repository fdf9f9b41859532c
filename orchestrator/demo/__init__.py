"""The offline demo: a small project and a model script that delegates over it."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from ..fs.safefs import Beneath

HERE = Path(__file__).parent

FILES = {
    "pyproject.toml": (
        '[project]\nname = "inventory"\nversion = "0.3.0"\n\n'
        '[project.optional-dependencies]\ntest = ["pytest>=8", "pytest-cov"]\n\n'
        '[tool.pytest.ini_options]\ntestpaths = ["tests"]\n'
    ),
    "src/inventory/__init__.py": '"""Stock keeping for a small shop."""\n',
    "src/inventory/stock.py": (
        "def restock(levels: dict[str, int], item: str, n: int) -> None:\n"
        "    levels[item] = levels.get(item, 0) + n\n"
    ),
    "src/inventory/report.py": (
        "def low(levels: dict[str, int], floor: int = 3) -> list[str]:\n"
        "    return sorted(k for k, v in levels.items() if v < floor)\n"
    ),
    "tests/test_stock.py": (
        "from inventory.stock import restock\n\n\ndef test_restock() -> None:\n"
        "    levels: dict[str, int] = {}\n    restock(levels, 'tea', 2)\n"
        "    assert levels == {'tea': 2}\n"
    ),
}


@contextmanager
def demo_project(where: Path | None = None, *, keep: bool = False) -> Iterator[tuple[Path, Path]]:
    """The demo project and its model script, written to ``where``, else to a new temp dir.

    A temp dir is removed on the way out however the demo ends (done, failed, Ctrl+C), unless
    ``keep``; a directory the user named is theirs and stays."""
    made = where is None
    root = Path(tempfile.mkdtemp(prefix="orch-demo-")) if where is None else where
    try:
        root.mkdir(parents=True, exist_ok=True)
        for rel, text in FILES.items():
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        script = root / ".orch-demo-script.yaml"
        shutil.copyfile(HERE / "demo.yaml", script)
        yield root.resolve(), script
    finally:
        if made and not keep:
            remove_demo(root)


def remove_demo(root: Path) -> None:
    """Delete the demo's temp dir: through dir fds, symlinks unlinked and never followed,
    read-only directories an agent left opened up first (safefs)."""
    with suppress(FileNotFoundError):
        Beneath(root.parent).remove_tree(root.name)
