"""Making a file system change durable: the one fsync of a directory every writer uses.

A leaf with no torch and nothing else of snapcore, so that the run journal (written by
crash-test children that never import torch) can use it too.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """fsync a directory, so that the entries made in it (a new file, a rename) survive a
    power loss."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    """fsync a file that is already written and closed (its data and size)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def allocated_bytes(root: str | Path) -> int:
    """The blocks allocated to the files under ``root`` (what they take in memory on a
    tmpfs, or on disk), in bytes; files that go meanwhile count nothing."""
    total = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
    return total
