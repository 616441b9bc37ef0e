"""Atomic file writes: nothing is lost if a save is interrupted.

The data goes to a temp file in the target's folder, is flushed and fsynced, then
``os.replace``d over the target (atomic on POSIX), and the folder is fsynced so the
rename itself survives a crash. A failure at any point leaves the old file intact
and no temp file behind.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import IO, Any


def atomic_write(path: str | os.PathLike, write: Callable[[IO[Any]], None], *, binary: bool = True) -> str:
    """Call ``write(f)`` on a temp file, then move it over `path`; returns `path`."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        # mkstemp makes the file 0600; a saved file gets what a plain open() would give it
        # (0666 less the umask), as torch.save's files do.
        os.chmod(tmp, 0o666 & ~_umask())
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(folder)
    return path


def _umask() -> int:
    """The process's umask, read without changing it where Linux says it (setting it to read
    it, even for an instant, would race with threads creating files)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def fsync_dir(folder: str) -> None:
    """Make the rename durable (POSIX); best effort elsewhere."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
