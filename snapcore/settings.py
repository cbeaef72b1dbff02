"""Settings from environment variables: one getter each, and a context-manager override.

Every variable is documented in docs/configuration.md.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

_overrides: dict[str, Any] = {}


def _get(name: str, default: str) -> str:
    if name in _overrides:
        return str(_overrides[name])
    return os.environ.get(name, default)


@contextlib.contextmanager
def override(**values: Any) -> Iterator[None]:
    """Temporarily set settings by variable name, e.g. ``override(SNAPCORE_O_DIRECT="off")``."""
    saved = dict(_overrides)
    _overrides.update(values)
    try:
        yield
    finally:
        _overrides.clear()
        _overrides.update(saved)


def o_direct() -> str:
    """SNAPCORE_O_DIRECT: ``auto`` (O_DIRECT where the file system allows it), or ``off``."""
    value = _get("SNAPCORE_O_DIRECT", "auto").lower()
    if value not in ("auto", "off"):
        raise ValueError(f"SNAPCORE_O_DIRECT must be 'auto' or 'off', not {value!r}")
    return value


def recycle() -> bool:
    """SNAPCORE_RECYCLE: ``on`` (data files that retention frees on local disk are kept as
    spares and written over by the next saves), or ``off`` (deleted)."""
    value = _get("SNAPCORE_RECYCLE", "on").lower()
    if value not in ("on", "off"):
        raise ValueError(f"SNAPCORE_RECYCLE must be 'on' or 'off', not {value!r}")
    return value == "on"


def pipeline() -> str:
    """SNAPCORE_PIPELINE: whether the default mode's CPU staging is pipelined with hashing
    and writing: ``auto`` (when the copies leave a core to them: ``SNAPCORE_THREADS``
    below the number of cores), ``on``, or ``off``."""
    value = _get("SNAPCORE_PIPELINE", "auto").lower()
    if value not in ("auto", "on", "off"):
        raise ValueError(f"SNAPCORE_PIPELINE must be 'auto', 'on' or 'off', not {value!r}")
    return value


def pipelined() -> bool:
    """Whether SNAPCORE_PIPELINE asks for the pipelined whole mode on this machine."""
    value = pipeline()
    if value == "auto":
        return threads() < cores()
    return value == "on"


def cores() -> int:
    """The cores this process may run on: its CPU affinity (a rank pinned to its share
    of a node by torchrun's or a launcher's binding), not every core of the machine."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity on this platform
        return max(1, os.cpu_count() or 1)


def threads() -> int:
    """SNAPCORE_THREADS: worker threads for copies and reads (0 = one per core this
    process may run on, ``cores()``)."""
    n = int(_get("SNAPCORE_THREADS", "0"))
    return n if n > 0 else cores()


def chunk_bytes() -> int:
    """SNAPCORE_CHUNK_MB: the largest chunk (unit of hashing and parallel reads), in MiB."""
    mb = int(_get("SNAPCORE_CHUNK_MB", "64"))
    if not 0 < mb <= 1024:  # readers refuse chunks over 1 GiB (manifest.MAX_CHUNK_BYTES)
        raise ValueError("SNAPCORE_CHUNK_MB must be between 1 and 1024")
    return mb << 20


def restore_ring_bytes() -> int:
    """SNAPCORE_RESTORE_RING_MB: the pinned memory a restore to the GPU reads into (its
    ring: staging/h2d.py), in MiB, at most; the ring has two slots at least, each as large
    as the largest chunk, so a chunk of more than half of it makes the ring larger."""
    mb = int(_get("SNAPCORE_RESTORE_RING_MB", "1024"))
    if mb <= 0:
        raise ValueError("SNAPCORE_RESTORE_RING_MB must be a positive number of MiB")
    return mb << 20


def restore_ring_keep() -> bool:
    """SNAPCORE_RESTORE_RING_KEEP: keep the restore ring (pinned) for the next restore to
    the GPU instead of freeing it when the restore returns (default off)."""
    return _get("SNAPCORE_RESTORE_RING_KEEP", "0") not in ("0", "off", "false", "no", "")


def huge_pages() -> bool:
    """SNAPCORE_HUGE_PAGES: ask for transparent huge pages for the host arena (default on)."""
    return _get("SNAPCORE_HUGE_PAGES", "1") not in ("0", "off", "false", "no")


def commit_timeout_s() -> float:
    """SNAPCORE_COMMIT_TIMEOUT_S: how long the ranks of a sharded save wait for each other
    (every rank's part, the coordinator's verdict) before the step fails, naming the
    ranks that did not answer (default 600)."""
    value = float(_get("SNAPCORE_COMMIT_TIMEOUT_S", "600"))
    if not value > 0:
        raise ValueError("SNAPCORE_COMMIT_TIMEOUT_S must be a positive number of seconds")
    return value


def request_timeout_s() -> float:
    """SNAPCORE_REQUEST_TIMEOUT_S: the longest one request to object storage may take
    (one attempt; a timed-out attempt is retried like a dropped connection; default 600)."""
    value = float(_get("SNAPCORE_REQUEST_TIMEOUT_S", "600"))
    if not value > 0:
        raise ValueError("SNAPCORE_REQUEST_TIMEOUT_S must be a positive number of seconds")
    return value


def peer_timeout_s() -> float:
    """SNAPCORE_PEER_TIMEOUT_S: how long a step of a peer-tier transfer (a send or receive
    on snapcore's peer group) may wait for the partner before the transfer fails
    (default: SNAPCORE_COMMIT_TIMEOUT_S)."""
    raw = _get("SNAPCORE_PEER_TIMEOUT_S", "")
    value = float(raw) if raw else commit_timeout_s()
    if not value > 0:
        raise ValueError("SNAPCORE_PEER_TIMEOUT_S must be a positive number of seconds")
    return value


def failure_domain() -> str | None:
    """SNAPCORE_FAILURE_DOMAIN: this node's failure domain (a rack, a power feed): the
    peer tier prefers partners in another one. Unset: unknown."""
    value = _get("SNAPCORE_FAILURE_DOMAIN", "").strip()
    return value or None
