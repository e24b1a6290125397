"""Crash-safe file writing: write a temporary file, fsync it, rename it over the target.

A reader therefore sees either the old complete file or the new complete file, never a torn
one, even after ``kill -9`` or a power loss (the directory is fsynced after the rename).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

TMP_SUFFIX = ".tmp"


def fsync_dir(path: Path) -> None:
    """Persist a rename inside ``path`` (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    with AtomicFile(path) as handle:
        handle.write(data)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


class AtomicFile:
    """``with AtomicFile(path) as f: f.write(...)`` streams into ``path + ".tmp"`` and publishes
    it under ``path`` only when the block exits without an exception (otherwise the temporary
    file is removed and ``path`` is untouched)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + TMP_SUFFIX)
        self._handle: BinaryIO | None = None

    def __enter__(self) -> BinaryIO:
        self._handle = open(self.tmp, "wb")  # noqa: SIM115 - closed in __exit__
        return self._handle

    def __exit__(self, exc_type, exc, tb) -> None:
        handle = self._handle
        assert handle is not None
        if exc_type is not None:
            handle.close()
            self.tmp.unlink(missing_ok=True)
            return
        handle.flush()
        os.fsync(handle.fileno())
        handle.close()
        os.replace(self.tmp, self.path)
        fsync_dir(self.path.parent)
