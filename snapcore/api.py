"""The public functions: save, async_save, restore, load."""

from __future__ import annotations

import os
import time
from typing import Any

from .engine import SaveHandle, SaveStats, engine_for
from .read import Reader, RestoreInfo
from .store import LocalStore

StorePath = str | os.PathLike[str]


def async_save(
    state: object,
    store: StorePath,
    *,
    step: int,
    overlap: bool = False,
    budget_bytes: int | None = None,
) -> SaveHandle:
    """Snapshot ``state`` as ``step``; return as soon as the state is staged.

    The snapshot is durable once ``handle.wait()`` returns. By default the state may be
    changed as soon as this returns. With ``overlap=True`` the copies of tensors that the
    state's optimizers write run on while training goes on, and each optimizer's next
    ``step()`` waits for them (or call ``handle.staged()``). ``budget_bytes`` bounds the
    host memory used for staging (default: the size of the state); a smaller budget
    streams the state through the arena, and the call then blocks until the last part is
    staged. A failure in the background is raised by ``handle.wait()`` and, if nobody
    waited, by the next save to the same store.
    """
    return engine_for(store).async_save(state, step, overlap=overlap, budget=budget_bytes)


def save(
    state: object, store: StorePath, *, step: int, budget_bytes: int | None = None
) -> SaveStats:
    """Snapshot ``state`` as ``step`` and return once it is durable (committed)."""
    return async_save(state, store, step=step, budget_bytes=budget_bytes).wait()


def _reader(store: StorePath, step: int | None, verify: bool) -> Reader:
    local = LocalStore(store)
    chosen = local.resolve_step(step)
    return Reader(local, local.read_manifest(chosen), verify=verify)


def restore(
    state: Any, store: StorePath, *, step: int | None = None, verify: bool = True
) -> RestoreInfo:
    """Load a committed snapshot into ``state`` in place (tensors keep device and storage).

    ``step=None`` takes the newest committed snapshot. Raises ``SnapshotNotFound`` when
    there is none, ``CorruptSnapshot`` when a chunk fails its hash (``verify=False``
    skips the hashes), ``StateMismatch`` when the state cannot take the snapshot.
    """
    t0 = time.perf_counter()
    reader = _reader(store, step, verify)
    n = reader.restore(state)
    return RestoreInfo(
        step=reader.m.step, bytes=reader.m.nbytes, seconds=time.perf_counter() - t0, tensors=n
    )


def load(store: StorePath, *, step: int | None = None, verify: bool = True) -> Any:
    """Read a committed snapshot as plain Python values and CPU tensors.

    Objects that were saved through ``state_dict()`` come back as their state dicts. No
    model, optimizer or process group is needed.
    """
    return _reader(store, step, verify).load_tree()


def wait_all(store: StorePath) -> None:
    """Wait until the last snapshot to ``store`` is durable (raises its failure)."""
    engine_for(store).wait()
