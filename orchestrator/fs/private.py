"""orch's private root: where the paths that steer orch live, never where the environment
(``TMPDIR``) or a workspace puts them.

``~/.orch/run`` (mode 0700, ours; ``run`` no symlink): the key its
sockets prove themselves with (``socket.key``), the dashboard's opener pages, the egress
proxy's doors and the container tier's bundles. Hidden in every sandbox: ``~/.orch`` is
covered in every host sandbox (``bwrap.profile.HOME_SECRETS``, and any path component named
``.orch`` inside a workspace), and a container sees no host path but the one door socket
bound in; ``workspaces.hiding.private_paths`` names it to every host sandbox explicitly
(whatever ``HOME`` a command is given). A directory on the way that is a symlink, or not
ours alone, is refused.

Standard library only: the ``orch`` entry point reads the key before anything else loads.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import shutil
import stat
from pathlib import Path

ROOT = Path(".orch") / "run"  # under the user's HOME
KEY_NAME = "socket.key"
KEY_BYTES = 32


class NoPrivateRoot(OSError):
    """orch's private root cannot be made ours alone; the message says why and what to do."""


def _home() -> Path:
    home = os.environ.get("HOME")
    if not home or not os.path.isabs(home):
        import pwd

        home = pwd.getpwuid(os.getuid()).pw_dir
    return Path(home)


def _own_dir(path: Path, *, link_ok: bool = False) -> None:
    """``path`` a directory of ours alone (made 0700 if missing); a symlink is refused
    (``link_ok``: followed, to a directory of ours alone: a user's ``~/.orch`` may be one)."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.stat(path) if link_ok else os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise NoPrivateRoot(f"{path} is not a directory: remove it and run again")
    if st.st_uid != os.getuid():
        raise NoPrivateRoot(f"{path} belongs to uid {st.st_uid}: remove it and run again")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)


def expected_root() -> Path:
    """Where the private root is (made or not)."""
    return _home() / ROOT


def private_root() -> Path:
    """``~/.orch/run``, made and checked to be ours alone; :class:`NoPrivateRoot` if not."""
    home = _home()
    root = home / ROOT
    try:
        _own_dir(root.parent, link_ok=True)
        _own_dir(root)
    except NoPrivateRoot:
        raise
    except OSError as e:
        raise NoPrivateRoot(
            f"cannot make {root} ({e.strerror}): check that {home} is yours"
        ) from None
    return root


def private_dir(name: str) -> Path:
    """A directory of the private root's (``egress``, ``dashboard``...), ours alone."""
    path = private_root() / name
    _own_dir(path)
    return path


def temp_dir(name: str, prefix: str) -> Path:
    """A new empty directory (0700) under :func:`private_dir` ``name``: what
    ``tempfile.mkdtemp`` made under ``TMPDIR`` before (issue 38: TMPDIR may be in a
    checkout). The caller removes it (:func:`remove`)."""
    parent = private_dir(name)
    while True:
        path = parent / f"{prefix}{secrets.token_hex(8)}"
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
            return path


def remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def socket_key() -> bytes:
    """The user's key for orch's sockets (``~/.orch/run/socket.key``, 0600), made on first
    use: both ends of a connection prove they hold it before anything else is sent."""
    root = private_root()
    dfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.flock(dfd, fcntl.LOCK_EX)  # a racing process never reads a key half written
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(KEY_NAME, flags, 0o600, dir_fd=dfd)
        except FileExistsError:
            pass
        else:
            key = secrets.token_bytes(KEY_BYTES)
            try:
                os.write(fd, key.hex().encode() + b"\n")
            finally:
                os.close(fd)
            return key
        fd = os.open(KEY_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        try:
            st = os.fstat(fd)
            data = os.read(fd, 256).strip()
        finally:
            os.close(fd)
    finally:
        os.close(dfd)
    path = root / KEY_NAME
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_nlink != 1:
        raise NoPrivateRoot(f"{path} is not a file of yours alone: remove it and run again")
    if st.st_mode & 0o077:
        raise NoPrivateRoot(f"{path} is readable by others: remove it and run again")
    try:
        key = bytes.fromhex(data.decode("ascii"))
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise NoPrivateRoot(f"{path} is damaged: remove it (orch makes a new one)")
    return key
