"""orchestrator.fs.safefs: race-free file primitives beneath a workspace root.

Real files in tmp_path. Most tests run twice, through openat2 and through the
component walk fallback. The race tests swap a directory for a symlink out of
the workspace from another process while reading and writing through it.
"""

from __future__ import annotations

import os
import posixpath
import select
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.fs import safefs
from orchestrator.fs.safefs import DEFAULT_MAX_READ, Beneath, TooManyEntries, UnsafePath, normalize

SECRET = b"SECRET"


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    root.mkdir()
    return root


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    out = tmp_path / "outside"
    out.mkdir()
    (out / "secret").write_bytes(SECRET)
    (out / "f").write_bytes(SECRET)
    return out


def _open(ws: Path, mode: str) -> Beneath:
    fs = Beneath(ws, use_openat2=mode == "openat2")
    if mode == "openat2" and not fs.uses_openat2:
        fs.close()
        pytest.skip("openat2 is not available here (old kernel or seccomp)")
    return fs


@pytest.fixture(params=["openat2", "walk"])
def fs(request: pytest.FixtureRequest, ws: Path) -> Iterator[Beneath]:
    with _open(ws, str(request.param)) as b:
        yield b


def _outside_untouched(outside: Path) -> None:
    assert sorted(os.listdir(outside)) == ["f", "secret"]
    assert (outside / "secret").read_bytes() == SECRET
    assert (outside / "f").read_bytes() == SECRET


# -- paths --------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["../x", "/etc/passwd", "a/../../x", "..", "./..", "a/\x00b"])
def test_lexical_escapes_are_refused_by_every_operation(fs: Beneath, bad: str) -> None:
    for op in (
        lambda: fs.read(bad),
        lambda: fs.write(bad, b"x"),
        lambda: fs.stat(bad),
        lambda: fs.is_file(bad),
        lambda: fs.is_dir(bad),
        lambda: fs.remove(bad),
        lambda: fs.remove_tree(bad),
        lambda: list(fs.walk(bad)),
    ):
        with pytest.raises(UnsafePath):
            op()


def test_normalize_is_lexical_and_stays_inside() -> None:
    assert normalize("a/./b//c/") == "a/b/c"
    assert normalize("a/../b") == "b"
    assert normalize("") == normalize(".") == ""
    with pytest.raises(UnsafePath, match="absolute"):
        normalize("/etc/passwd")
    with pytest.raises(UnsafePath, match=r"'\.\.'"):
        normalize("a/../../x")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", "..", ".", ""]), max_size=8))
def test_normalize_never_yields_an_escape(parts: list[str]) -> None:
    rel = "/".join(parts)
    depth, climbs = 0, False
    for p in parts:
        depth += {"..": -1, ".": 0, "": 0}.get(p, 1)
        climbs = climbs or depth < 0
    if rel.startswith("/") or climbs:
        with pytest.raises(UnsafePath):
            normalize(rel)
        return
    norm = posixpath.normpath(rel or ".")
    assert normalize(rel) == ("" if norm == "." else norm)


def test_relative_maps_absolute_paths_under_the_root(fs: Beneath, ws: Path) -> None:
    assert fs.relative(str(ws / "src" / "a.py")) == "src/a.py"
    assert fs.relative(str(ws)) == ""
    assert fs.relative("/etc/passwd") == "/etc/passwd"
    assert fs.relative(str(ws) + "_evil/x") == str(ws) + "_evil/x"
    assert fs.relative("src/a.py") == "src/a.py"


# -- reading ------------------------------------------------------------------------


def test_read_returns_data_and_full_size(fs: Beneath, ws: Path) -> None:
    (ws / "src").mkdir()
    (ws / "src" / "a.py").write_bytes(b"0123456789")
    assert fs.read("src/a.py") == (b"0123456789", 10)
    assert fs.read("./src//a.py", 4) == (b"0123", 10)
    assert fs.read("src/a.py", 0) == (b"", 10)
    with pytest.raises(FileNotFoundError):
        fs.read("src/missing.py")
    with pytest.raises(IsADirectoryError):
        fs.read("src")
    with pytest.raises(NotADirectoryError):
        fs.read("src/a.py/x")


def test_symlink_out_as_file_is_refused(fs: Beneath, ws: Path, outside: Path) -> None:
    (ws / "link").symlink_to(outside / "secret")
    with pytest.raises(UnsafePath, match="'link' is a symlink"):
        fs.read("link")
    assert not fs.is_file("link")
    assert stat.S_ISLNK(fs.stat("link").st_mode)


def test_symlink_out_as_directory_component_is_refused(
    fs: Beneath, ws: Path, outside: Path
) -> None:
    (ws / "a").mkdir()
    (ws / "a" / "d").symlink_to(outside)
    with pytest.raises(UnsafePath, match="goes through symlink 'a/d'"):
        fs.read("a/d/secret")
    with pytest.raises(UnsafePath):
        fs.stat("a/d/secret")
    assert not fs.is_dir("a/d") and not fs.is_file("a/d/secret")


def test_symlinks_inside_the_workspace_are_refused_too(fs: Beneath, ws: Path) -> None:
    (ws / "real").mkdir()
    (ws / "real" / "x.txt").write_text("ok")
    (ws / "alias.txt").symlink_to("real/x.txt")
    (ws / "dalias").symlink_to("real")
    assert fs.read("real/x.txt")[0] == b"ok"
    with pytest.raises(UnsafePath, match="never follow symlinks"):
        fs.read("alias.txt")
    with pytest.raises(UnsafePath, match="symlink 'dalias'"):
        fs.read("dalias/x.txt")


def test_symlink_loop_is_refused(fs: Beneath, ws: Path) -> None:
    (ws / "loop").symlink_to("loop")
    with pytest.raises(UnsafePath):
        fs.read("loop")
    with pytest.raises(UnsafePath):
        fs.read("loop/x")


def test_hard_link_is_refused_for_read_and_write(fs: Beneath, ws: Path, outside: Path) -> None:
    os.link(outside / "secret", ws / "h")
    with pytest.raises(UnsafePath, match="hard links"):
        fs.read("h")
    with pytest.raises(UnsafePath, match="hard links"):
        fs.write("h", b"overwritten")
    _outside_untouched(outside)


def _in_thread(fn: Callable[[], object]) -> BaseException | None:
    """Run ``fn`` in a thread that must finish within 5 s; what it raised."""
    box: list[BaseException | None] = [None]

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # reported to the test
            box[0] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(5)
    assert not t.is_alive(), "blocked"
    return box[0]


def test_fifo_is_refused_without_blocking(fs: Beneath, ws: Path) -> None:
    os.mkfifo(ws / "pipe")
    err = _in_thread(lambda: fs.read("pipe"))
    assert isinstance(err, UnsafePath) and "FIFO" in str(err)
    assert isinstance(_in_thread(lambda: fs.write("pipe", b"x")), UnsafePath)
    assert stat.S_ISFIFO((ws / "pipe").lstat().st_mode)


def test_socket_and_device_files_are_refused(fs: Beneath, ws: Path) -> None:
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(ws / "sock"))
        with pytest.raises(UnsafePath, match="socket"):
            fs.read("sock")
    if os.geteuid() != 0:
        return  # mknod needs root
    os.mknod(ws / "zero", 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # like /dev/zero
    err = _in_thread(lambda: fs.read("zero"))
    assert isinstance(err, UnsafePath) and "device" in str(err)


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_cap_is_honoured_on_a_3gib_sparse_file(fs: Beneath, ws: Path) -> None:
    with open(ws / "big", "wb") as f:
        f.truncate(3 << 30)
    before = _rss()
    data, size = fs.read("big", 1 << 20)
    grew = _rss() - before
    assert len(data) == 1 << 20 and size == 3 << 30
    assert grew < 8 << 20, f"RSS grew by {grew >> 20} MiB"
    del data
    data, size = fs.read("big")
    assert len(data) == DEFAULT_MAX_READ and size == 3 << 30
    assert _rss() - before < DEFAULT_MAX_READ + (32 << 20)


# -- writing ------------------------------------------------------------------------


def test_write_creates_parents(fs: Beneath, ws: Path) -> None:
    fs.write("a/b/c.txt", b"hello")
    assert (ws / "a" / "b" / "c.txt").read_bytes() == b"hello"
    assert fs.is_dir("a/b") and fs.is_file("a/b/c.txt")
    with pytest.raises(FileNotFoundError):
        fs.write("x/y.txt", b"", make_parents=False)
    assert not (ws / "x").exists()
    (ws / "file").write_text("")
    with pytest.raises(NotADirectoryError):
        fs.write("file/y.txt", b"")


def test_write_refuses_a_symlinked_parent(fs: Beneath, ws: Path, outside: Path) -> None:
    (ws / "d").symlink_to(outside)
    for rel in ("d/new.txt", "d/sub/new.txt", "d/secret"):
        with pytest.raises(UnsafePath, match="symlink"):
            fs.write(rel, b"pwned")
    (ws / "link").symlink_to(outside / "secret")
    with pytest.raises(UnsafePath, match="symlink"):
        fs.write("link", b"pwned")
    _outside_untouched(outside)


def test_write_is_an_atomic_replace_keeping_the_mode(fs: Beneath, ws: Path) -> None:
    target = ws / "run.sh"
    target.write_bytes(b"old")
    target.chmod(0o751)
    inode = target.stat().st_ino
    with open(target, "rb") as held:
        fs.write("run.sh", b"new content")
        assert held.read() == b"old"  # the old inode was replaced, not rewritten
    assert target.read_bytes() == b"new content"
    assert target.stat().st_ino != inode
    assert stat.S_IMODE(target.stat().st_mode) == 0o751
    assert sorted(os.listdir(ws)) == ["run.sh"]  # no temp file left
    (ws / "dir").mkdir()
    with pytest.raises(IsADirectoryError):
        fs.write("dir", b"x")
    with pytest.raises(IsADirectoryError):
        fs.write("", b"x")


def test_failed_write_leaves_no_temp_file(
    fs: Beneath, ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="No space"):
        fs.write("f.txt", b"data")
    assert os.listdir(ws) == []


# -- inspecting, listing --------------------------------------------------------------


def test_stat_is_file_is_dir_never_follow(fs: Beneath, ws: Path, outside: Path) -> None:
    (ws / "d").mkdir()
    (ws / "d" / "f").write_text("x")
    (ws / "out").symlink_to(outside)
    assert fs.is_dir("") and fs.is_dir("d") and fs.is_file("d/f")
    assert not fs.is_file("d") and not fs.is_dir("d/f") and not fs.is_file("missing")
    assert not fs.is_dir("out") and not fs.is_file("out/secret")
    assert stat.S_ISLNK(fs.stat("out").st_mode)
    assert fs.stat("d/f").st_size == 1


def _tree(ws: Path, outside: Path) -> None:
    for rel in (
        "README.md",
        "a.txt",
        "b.txt",
        "ab.txt",
        ".hidden.md",
        "setup.py",
        "src/main.py",
        "src/util.py",
        "src/notes.md",
        "src/pkg/mod.py",
        "src/pkg/deep/x.py",
        "tests/test_main.py",
        "docs/guide.md",
        "docs/img/logo.png",
        ".git/config",
        "node_modules/lib/index.js",
    ):
        (ws / rel).parent.mkdir(parents=True, exist_ok=True)
        (ws / rel).write_text(rel)
    (ws / "src" / "escape").symlink_to(outside)
    (ws / "src" / "alias.py").symlink_to("main.py")
    (ws / "src" / "inner").symlink_to("pkg")


def test_walk_lists_regular_files_and_never_descends_symlinks(
    fs: Beneath, ws: Path, outside: Path
) -> None:
    _tree(ws, outside)
    got = list(fs.walk())
    assert sorted(got) == [
        ".hidden.md",
        "README.md",
        "a.txt",
        "ab.txt",
        "b.txt",
        "docs/guide.md",
        "docs/img/logo.png",
        "setup.py",
        "src/main.py",
        "src/notes.md",
        "src/pkg/deep/x.py",
        "src/pkg/mod.py",
        "src/util.py",
        "tests/test_main.py",
    ]
    assert got.index("setup.py") < got.index("docs/guide.md")  # a dir's files first
    assert list(fs.walk("src/pkg")) == ["src/pkg/mod.py", "src/pkg/deep/x.py"]
    assert list(fs.walk(".git")) == [".git/config"]  # skip_dirs apply below the start only
    assert "node_modules/lib/index.js" in list(fs.walk(skip_dirs=frozenset()))
    with pytest.raises(UnsafePath):
        list(fs.walk("src/escape"))
    with pytest.raises(TooManyEntries):
        list(fs.walk(max_entries=5))


GLOB_PATTERNS = [
    "**/*.py",
    "src/*.py",
    "*.md",
    "*.txt",
    "?.txt",
    "[ab].txt",
    "[!a]*.txt",
    "src/**/*.py",
    "src/*/*.py",
    "**/test_*.py",
    "**/pkg/**/*.py",
    "docs/*/*",
    "**/*",
    "README.md",
    "src/main.py",
    "nope/*.py",
    ".hidden*",
    "**/*.MD",
]


def test_glob_matches_path_glob_for_regular_files(fs: Beneath, ws: Path, outside: Path) -> None:
    _tree(ws, outside)
    skip = safefs.DEFAULT_SKIP_DIRS
    for pattern in GLOB_PATTERNS:
        expected = sorted(
            p.relative_to(ws).as_posix()
            for p in ws.glob(pattern)
            if p.is_file()
            and not any(part.is_symlink() for part in [p, *p.parents] if part != ws)
            and not skip & set(p.relative_to(ws).parts[:-1])
        )
        assert fs.glob(pattern) == (expected, False), pattern


def test_glob_trailing_double_star_limit_and_refusals(fs: Beneath, ws: Path, outside: Path) -> None:
    _tree(ws, outside)
    assert fs.glob("docs/**") == (["docs/guide.md", "docs/img/logo.png"], False)
    matches, truncated = fs.glob("**/*.py", limit=2)
    assert len(matches) == 2 and truncated
    assert fs.glob("**/*", max_entries=3)[1]
    assert fs.glob("src/escape/*") == ([], False)
    for bad in ("../*", "/etc/*", "src/../../*"):
        with pytest.raises(UnsafePath):
            fs.glob(bad)


# -- removing -----------------------------------------------------------------------


def test_remove_unlinks_files_and_links_never_targets(fs: Beneath, ws: Path, outside: Path) -> None:
    (ws / "f").write_text("x")
    (ws / "link").symlink_to(outside / "secret")
    (ws / "d").mkdir()
    fs.remove("f")
    fs.remove("link")
    assert sorted(os.listdir(ws)) == ["d"]
    with pytest.raises(IsADirectoryError):
        fs.remove("d")
    with pytest.raises(FileNotFoundError):
        fs.remove("f")
    _outside_untouched(outside)


def test_remove_tree_never_follows_a_symlink_out(fs: Beneath, ws: Path, outside: Path) -> None:
    (ws / "copy" / "a" / "b").mkdir(parents=True)
    (ws / "copy" / "a" / "b" / "f").write_text("x")
    (ws / "copy" / "top.txt").write_text("x")
    (ws / "copy" / "a" / "out").symlink_to(outside)
    (ws / "copy" / "a" / "outfile").symlink_to(outside / "secret")
    os.mkfifo(ws / "copy" / "pipe")
    (ws / "copy" / "a" / "b").chmod(0o555)  # a read-only directory, e.g. a Go module cache
    (ws / "keep").write_text("k")
    fs.remove_tree("copy")
    assert sorted(os.listdir(ws)) == ["keep"]
    _outside_untouched(outside)
    (ws / "lnk").symlink_to(outside)
    fs.remove_tree("lnk")  # a symlink at the top: only the link goes
    _outside_untouched(outside)
    (ws / "sub").mkdir()
    (ws / "sub" / "lnk").symlink_to(outside)
    with pytest.raises(UnsafePath):
        fs.remove_tree("sub/lnk/f")
    with pytest.raises(FileNotFoundError):
        fs.remove_tree("missing")
    with pytest.raises(UnsafePath, match="root"):
        fs.remove_tree("")
    _outside_untouched(outside)


# -- mechanism ----------------------------------------------------------------------


def test_openat2_refused_by_seccomp_falls_back_to_the_walk(
    ws: Path, outside: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refused(dirfd: int, path: str, flags: int) -> int:
        raise OSError(1, "Operation not permitted")  # what Docker's seccomp profile says

    monkeypatch.setattr(safefs, "_openat2", refused)
    (ws / "d").symlink_to(outside)
    (ws / "ok.txt").write_text("ok")
    with Beneath(ws) as fs:
        assert not fs.uses_openat2
        assert fs.read("ok.txt") == (b"ok", 2)
        with pytest.raises(UnsafePath):
            fs.read("d/secret")


def test_closed_after_with(ws: Path) -> None:
    with Beneath(ws) as fs:
        fd = fs._fd
        os.fstat(fd)
    with pytest.raises(OSError):
        os.fstat(fd)


# -- the race -----------------------------------------------------------------------

# Swaps two names as fast as it can (renameat2 RENAME_EXCHANGE, so both always
# exist; three renames where that is missing). Exits by itself after 30 s.
ATTACKER = r"""
import ctypes, os, sys, time
a, b = os.fsencode(sys.argv[1]), os.fsencode(sys.argv[2])
libc = ctypes.CDLL(None, use_errno=True)
def exchange():
    if libc.renameat2(-100, a, -100, b, 2) != 0:
        raise OSError(ctypes.get_errno(), "renameat2")
def renames():
    os.rename(a, a + b".t"); os.rename(b, a); os.rename(a + b".t", b)
swap = exchange
try:
    swap(); swap()
except (AttributeError, OSError):
    swap = renames
print("ready", flush=True)
end = time.monotonic() + 30
while time.monotonic() < end:
    for _ in range(500):
        swap()
"""


@pytest.fixture
def race(ws: Path, outside: Path) -> Iterator[Path]:
    """ws/d flips between a real directory (f = "inside") and a symlink to outside."""
    (ws / "d").mkdir()
    (ws / "d" / "f").write_bytes(b"inside")
    (ws / "alt").symlink_to(outside)
    cmd = [sys.executable, "-c", ATTACKER, str(ws / "d"), str(ws / "alt")]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE) as proc:
        try:
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], 15)
            assert ready and proc.stdout.readline() == b"ready\n", "attacker did not start"
            yield ws
        finally:
            proc.kill()


@pytest.mark.parametrize("mode", ["openat2", "walk"])
def test_race_never_reads_or_writes_outside(race: Path, outside: Path, mode: str) -> None:
    seen: dict[str, int] = {"inside": 0, "refused": 0, "error": 0}
    writes = 0
    with _open(race, mode) as fs:
        start = time.monotonic()
        reads = 0
        while time.monotonic() - start < 8:
            for _ in range(100):
                try:
                    data, _ = fs.read("d/f")
                except UnsafePath:
                    seen["refused"] += 1
                except OSError:
                    seen["error"] += 1
                else:
                    assert data != SECRET, f"read outside after {reads} reads"
                    assert data == b"inside"
                    seen["inside"] += 1
                reads += 1
                if reads % 3 == 0:
                    try:
                        fs.write("d/g", b"written %d" % writes)
                    except (UnsafePath, OSError):
                        pass
                    writes += 1
            enough = reads >= 2000 and writes >= 500 and seen["inside"] and seen["refused"]
            if enough and time.monotonic() - start > 1.5:  # some 20,000 tries each
                break
    assert reads >= 2000 and writes >= 500
    assert seen["inside"] and seen["refused"], f"the swap never showed: {seen}"
    _outside_untouched(outside)


def test_race_is_real_for_a_naive_check_then_open(race: Path, outside: Path) -> None:
    """The same attack against resolve()-then-open: shows the race test can catch a leak."""
    root = race.resolve()

    def naive_read(rel: str) -> bytes:
        path = (root / rel).resolve()
        if not path.is_relative_to(root):
            raise PermissionError(f"{rel} resolves outside")
        return path.read_bytes()

    escapes = tries = 0
    start = time.monotonic()
    while time.monotonic() - start < 4 and not escapes:
        for _ in range(100):
            tries += 1
            try:
                escapes += naive_read("d/f") == SECRET
            except OSError:
                pass
    if not escapes:
        pytest.skip(f"the naive check-then-open never escaped in {tries} tries here")
    assert escapes >= 1
