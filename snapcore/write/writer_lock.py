"""The writer lock: one live process saves to a store at a time.

Held (flock) by the process that saves to a store, from its first save until its engine
is closed, in the store's local directory (else its host-memory area). Its name holds
nothing rank-specific: when sharded snapshots come, the ranks of one job will share one
lock (taken by one rank on their behalf) rather than each take their own.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from ..errors import StorageError, StoreInUse

log = logging.getLogger(__name__)

WRITER_LOCK = "writer.lock"

_writer_locks: dict[str, list[int]] = {}  # lock path -> [fd, engines of this process]
_writer_locks_lock = threading.Lock()


def take(directory: Path, describe: str) -> str:
    """Hold ``directory``/writer.lock for this process (engines of one process share it);
    raise StoreInUse when another live process holds it. Returns the lock's path."""
    path = str(directory / WRITER_LOCK)
    with _writer_locks_lock:
        held = _writer_locks.get(path)
        if held is not None:
            held[1] += 1
            return path
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise StorageError(
                e.errno, f"cannot open the writer lock of {describe}: {e.strerror}", path
            ) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _lock_holder(fd)
            os.close(fd)
            pid, host = holder.get("pid"), holder.get("host")
            who = f"pid {pid} on {host}" if pid is not None else "a process that did not say"
            raise StoreInUse(
                f"{describe} is being saved to by another live process ({who}; it holds "
                f"{path}): two writers would delete each other's snapshots. Save to another "
                "store, or end that process first",
                path=path,
                pid=pid if isinstance(pid, int) else None,
                host=host if isinstance(host, str) else None,
            ) from None
        except OSError as e:  # a file system without flock: a second writer goes unseen
            log.warning("no writer lock on %s (%s): a second writer is not detected", path, e)
        me = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()})
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, me.encode(), 0)
        _writer_locks[path] = [fd, 1]
        return path


def release(path: str) -> None:
    with _writer_locks_lock:
        held = _writer_locks.get(path)
        if held is None:
            return
        held[1] -= 1
        if held[1] == 0:
            del _writer_locks[path]
            os.close(held[0])  # drops the flock; the file stays (unlinking it would race)


def holder(directory: Path) -> dict[str, Any] | None:
    """Who holds ``directory``'s writer lock (pid, host, since, as far as it says), or
    None when no live process does. Engines of this process count as holders."""
    path = str(directory / WRITER_LOCK)
    with _writer_locks_lock:
        held = _writer_locks.get(path)
        if held is not None:
            return _lock_holder(held[0])
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _lock_holder(fd)
    finally:
        os.close(fd)
    return None


def _lock_holder(fd: int) -> dict[str, Any]:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}
