"""Atomic file replacement: a reader sees the old file or the new one, never a part of either.

One durability rule for every file the project rewrites in place (the server's checkpoint and
its run log on resume, a node's privacy ledger and its round state):

1. write into a temporary file in the target's folder (a rename is atomic only within one
   filesystem), created exclusively under a fresh name, so two writers never share it;
2. flush and ``fsync`` the file, so its bytes are on disk before its name is;
3. ``os.replace`` it onto the target (atomic on POSIX, and on Windows for files);
4. ``fsync`` the folder, so the rename itself survives a power cut.

A kill at any point leaves the old file whole; a power cut after ``write_atomically`` returns
leaves the new one. If writing fails, the temporary file is removed and the error raised.

Permissions: ``mode`` goes to ``os.open``, so the process's umask applies as it does for
``open()``. ``PRIVATE`` (0600) is the default: a node's ledger and state are its own. Files an
operator shares (checkpoints, run logs) pass ``SHARED`` (0666 less the umask, what ``open()``
gives). An existing target's mode is not kept: the new file has ``mode``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, Final

__all__ = ["PRIVATE", "SHARED", "open_atomic", "write_atomically"]

#: Owner read/write only.
PRIVATE: Final = 0o600
#: What ``open(path, "w")`` creates: everyone may read and write, less the umask.
SHARED: Final = 0o666


@contextlib.contextmanager
def open_atomic(path: str | os.PathLike[str], *, mode: int = PRIVATE) -> Iterator[BinaryIO]:
    """A binary file that replaces ``path`` when the ``with`` block ends without an error.

    Example::

        with open_atomic(path) as fh:
            torch.save(state, fh)

    Raises:
        FileNotFoundError: ``path``'s folder does not exist.
    """
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_folder(target.parent)


def write_atomically(
    path: str | os.PathLike[str], data: bytes | str, *, mode: int = PRIVATE
) -> None:
    """Replaces ``path`` with ``data`` (``str`` is written as UTF-8) by ``open_atomic``'s rule."""
    with open_atomic(path, mode=mode) as fh:
        fh.write(data.encode() if isinstance(data, str) else data)


def _fsync_folder(folder: Path) -> None:
    """Makes a rename in ``folder`` durable (POSIX; a no-op where folders cannot be opened)."""
    if not hasattr(os, "O_DIRECTORY"):  # Windows: the rename is durable as it stands
        return
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as err:
        # Some network and FUSE filesystems cannot sync a folder; the rename is done anyway.
        if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)
