"""Restore to the GPU: chunks read into a pinned ring, copied to their devices on the side
stream, each device's current stream made to wait for the copies.

The chunks go in batches of up to ``RING_SLOT_BYTES`` (a larger chunk is a batch of its
own). Every worker thread (``SNAPCORE_THREADS``) reads and hash-checks one batch at a time
into a slot of a registered (pinned) ring, then queues the slot's host-to-device copies
and takes the next batch: the reads of all workers run at once while the copies of the
batches read before run on the GPU. The ring has one slot per worker plus
``SPARE_SLOTS`` (in flight to the GPU), within ``SNAPCORE_RESTORE_RING_MB`` (fewer
workers then); a slot is read into again only once its copies have completed.

Each slot is an arena of its own, made (allocated, faulted, pinned) by the worker that
first reads into it: making the ring runs in parallel and overlaps the reads. Each
restore makes its ring and frees it when it returns, unless
``SNAPCORE_RESTORE_RING_KEEP`` asks to keep it for the next restore (a job that restores
again and again; then ``release_ring``, ``snapcore.close`` or the interpreter's exit
frees it). No torch pinned allocation (torch caches those, rounded up to a power of two,
for the life of the process) and no blocking ``copy_`` per tensor: each slot's copies go
to the native copier of each device at once (merged where they continue one another, one
``cuMemcpyBatchAsync`` where the driver has it), queued on the device's side stream after
the work already on its current stream (the restoring thread's, taken before the workers
start: torch's current stream is per thread).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import _native, settings
from ..errors import SnapcoreError
from .arena import HostArena

# The bytes of one batch (one slot of the ring); a chunk larger than this gets a slot of
# its own size.
RING_SLOT_BYTES = 64 << 20
# Slots beyond one per worker: batches read and in flight to the GPU while every worker
# reads the next one.
SPARE_SLOTS = 2

# Where the last restore to the GPU in this process spent its time (for benchmarks: see
# bench_gpu.py): bytes, workers, slots, slot_bytes, reads (batches read), ring_made (the
# slots this restore made; those of a kept ring are not made again), and seconds: ring_s, read_s,
# queue_s and wait_s summed over the workers (making and pinning slots, reading and
# checking chunks, queueing the copies, waiting for a slot's copies), drain_s (waiting
# for the last copies), close_s (closing the copiers, freeing the ring), total_s (wall).
last_profile: dict[str, float] = {}

log = logging.getLogger("snapcore")


class _Ring:
    """The ring: its slots, each an arena of its own (pinned in the first target device's
    context; portable, so every device's copies use it), made by the worker that first
    reads into it, so that making the ring overlaps the reads instead of preceding them."""

    def __init__(self, slot_bytes: int, device: int) -> None:
        self.slot_bytes, self.device = slot_bytes, device
        self.lock = threading.Lock()
        self.arenas: dict[int, HostArena] = {}

    def fits(self, slot_bytes: int) -> bool:
        """Whether it serves slots of ``slot_bytes``: of that size (larger slots would
        take the ring past SNAPCORE_RESTORE_RING_MB), and pinned (a ring whose pinning
        failed is not kept: the next restore tries again)."""
        with self.lock:
            pinned = all(a.native.pinned for a in self.arenas.values())
        return self.slot_bytes == slot_bytes and pinned

    def address(self, s: int) -> tuple[int, bool]:
        """Slot ``s``'s address, and whether it was made now (by the one worker that
        holds the slot)."""
        with self.lock:
            arena = self.arenas.get(s)
        if arena is not None:
            return arena.address, False
        arena = HostArena(self.slot_bytes, device=self.device, threads=1)  # workers: parallel
        with self.lock:
            self.arenas[s] = arena
        return arena.address, True

    @property
    def size(self) -> int:
        with self.lock:
            return sum(a.size for a in self.arenas.values())

    def close(self) -> None:
        """Free every slot; the first failure is raised once all were tried."""
        first: Exception | None = None
        with self.lock:
            arenas, self.arenas = list(self.arenas.values()), {}
        for arena in arenas:
            try:
                arena.close()
            except Exception as e:
                first = first or e
        if first is not None:
            raise first


_ring_lock = threading.Lock()  # one restore to the GPU at a time uses the ring
_ring: _Ring | None = None  # the ring kept (SNAPCORE_RESTORE_RING_KEEP)
_leaked: list[_Ring] = []  # rings an interruption left possibly in use: never freed


def _close_ring(ring: _Ring) -> None:
    """Free ``ring``; a failure (pinned memory that stays) is logged, not raised."""
    size = ring.size
    try:
        ring.close()
    except Exception as e:
        log.warning("freeing the restore ring (%d bytes): %s", size, e)


def _forget_in_child() -> None:
    """A forked child: the parent's lock may be held, its ring is not the child's (the
    arenas are MADV_DONTFORK, and CUDA is unusable there)."""
    global _ring_lock, _ring
    _ring_lock = threading.Lock()
    _ring = None


os.register_at_fork(after_in_child=_forget_in_child)


def release_ring() -> None:
    """Free the pinned ring kept for the next restore to the GPU (if any); a failure to
    free it is logged."""
    global _ring
    with _ring_lock:
        ring, _ring = _ring, None
    if ring is not None:
        _close_ring(ring)


def _take_ring(slot_bytes: int, device: int) -> _Ring:
    """The kept ring if it serves slots of ``slot_bytes``, else a new one (the old one
    freed first). Called with ``_ring_lock`` held."""
    global _ring
    ring, _ring = _ring, None
    if ring is not None and ring.fits(slot_bytes):
        return ring
    if ring is not None:
        _close_ring(ring)
    return _Ring(slot_bytes, device)


@dataclass
class ChunkCopies:
    """One chunk to read, and where its bytes go on the devices."""

    blob: int
    chunk: int
    nbytes: int  # its raw (decoded) length
    # (device, destination address on it, offset in the chunk, bytes)
    copies: list[tuple[int, int, int, int]] = field(default_factory=list)


def _batches(chunks: list[ChunkCopies], slot: int) -> Iterator[list[ChunkCopies]]:
    batch: list[ChunkCopies] = []
    size = 0
    for c in chunks:
        if batch and size + c.nbytes > slot:
            yield batch
            batch, size = [], 0
        batch.append(c)
        size += c.nbytes
    if batch:
        yield batch


class _Slots:
    """The ring's slots: free ones, and those whose copies are in flight (oldest first)."""

    def __init__(self, count: int) -> None:
        self.lock = threading.Lock()
        self.free = list(range(count))
        self.flying: deque[tuple[int, list[Any]]] = deque()

    def take(self) -> tuple[int, list[Any]]:
        """A slot to read into, and the events to wait for before doing so (the copies of
        the oldest slot in flight, when none is free)."""
        with self.lock:
            if self.free:
                return self.free.pop(0), []
            return self.flying.popleft()

    def fly(self, slot: int, events: list[Any]) -> None:
        with self.lock:
            self.flying.append((slot, events))

    def drop(self, slot: int) -> None:
        """A slot read into whose copies were never queued (a failed read)."""
        with self.lock:
            self.free.append(slot)

    def wait_all(self, *, quiet: bool = False) -> None:
        """Wait for every copy in flight (``quiet``: whatever an event raises). A slot
        leaves the list only once its copies were waited for: an interrupted wait is
        taken up again by the next call."""
        while True:
            with self.lock:
                if not self.flying:
                    return
                s, events = self.flying[0]
            for ev in events:
                if quiet:
                    with contextlib.suppress(Exception):
                        ev.synchronize()
                else:
                    ev.synchronize()
            with self.lock:
                if self.flying and self.flying[0][0] == s:
                    self.flying.popleft()
                    self.free.append(s)


def _despite_interrupts(fn: Callable[[], object]) -> BaseException | None:
    """Call ``fn`` until it returns, whatever interrupts it (a KeyboardInterrupt while the
    workers still write into the ring, or the GPU still reads it, must not free the ring
    under them); the first interruption is returned, to be raised once it is safe. An
    error (an ``Exception``) is raised at once: it would come again."""
    first: BaseException | None = None
    while True:
        try:
            fn()
            return first
        except Exception:
            raise
        except BaseException as e:  # KeyboardInterrupt, SystemExit from a signal handler
            first = first or e


def fill_devices(
    chunks: list[ChunkCopies], read: Callable[[list[tuple[int, int, int]]], None]
) -> None:
    """Read ``chunks`` with ``read`` (jobs of (blob, chunk, host address): the reader's
    verified read, called from the workers, one batch per call) into the pinned ring and
    copy them to their devices.

    Returns once every copy has completed; a failure (a chunk damaged in every tier, a
    driver error) stops the workers, waits for the copies already queued, and raises.
    """
    if not chunks:
        return
    t_start = time.perf_counter()
    devices = sorted({d for c in chunks for d, *_ in c.copies})
    # torch's current stream is per thread: the restoring thread's, for the workers
    streams = {d: torch.cuda.current_stream(d).cuda_stream for d in devices}
    total = sum(c.nbytes for c in chunks)
    slot = max(max(c.nbytes for c in chunks), min(RING_SLOT_BYTES, total))
    batches = list(_batches(chunks, slot))
    workers = max(1, min(settings.threads(), len(batches)))
    count = min(len(batches), workers + SPARE_SLOTS, max(2, settings.restore_ring_bytes() // slot))
    if count < len(batches):  # slots are read into again: one at least is in flight
        workers = max(1, min(workers, count - 1))
    global _ring
    with _ring_lock:
        ring = _take_ring(slot, devices[0])
        prof: dict[str, float] = {
            "bytes": total,
            "workers": workers,
            "slots": count,
            "slot_bytes": ring.slot_bytes,
            "reads": 0,
            "ring_made": 0,
        }
        prof.update(
            dict.fromkeys(("ring_s", "read_s", "queue_s", "wait_s", "drain_s", "close_s"), 0.0)
        )
        ok, settled = False, [False]
        try:
            _run(batches, read, ring, count, workers, streams, prof, settled)
            ok = True
        finally:
            if not settled[0]:  # interrupted before the workers were known to be done
                _leaked.append(ring)  # never freed: a worker or a copy may still use it
                log.error(
                    "restore to the GPU interrupted before its workers ended: its ring "
                    "(%d bytes) is left allocated",
                    ring.size,
                )
            elif ok and settings.restore_ring_keep():
                _ring = ring
            else:  # not kept, or after a failure, which may have left it in any state
                t = time.perf_counter()
                _close_ring(ring)
                prof["close_s"] += time.perf_counter() - t
            prof["total_s"] = time.perf_counter() - t_start
            last_profile.clear()
            last_profile.update(prof)


def _run(
    batches: list[list[ChunkCopies]],
    read: Callable[[list[tuple[int, int, int]]], None],
    ring: _Ring,
    count: int,
    workers: int,
    streams: dict[int, int],
    prof: dict[str, float],
    settled: list[bool],
) -> None:
    """The workers' run. ``settled[0]`` is set once no worker can touch the ring any more
    and every copy queued was waited for (or the driver failed): only then may the ring
    be freed; an interruption that leaves it unset leaves the ring to be leaked."""
    slots = _Slots(count)
    queue_lock = threading.Lock()  # the copiers, the profile, the failure
    copiers: dict[int, Any] = {}
    todo = deque(batches)
    failed: list[BaseException] = []

    def add(key: str, seconds: float) -> None:
        with queue_lock:
            prof[key] += seconds

    def work() -> None:
        while True:
            with queue_lock:
                if failed or not todo:
                    return
                batch = todo.popleft()
            t = time.perf_counter()
            s, events = slots.take()
            try:
                for ev in events:  # the slot's previous copies have read it
                    ev.synchronize()
            except BaseException:
                slots.fly(s, events)  # waited for again before anything is freed
                raise
            events = []  # a failure's traceback keeps this frame: no event in it
            add("wait_s", time.perf_counter() - t)
            t = time.perf_counter()
            try:
                base, made = ring.address(s)
            except BaseException:
                slots.drop(s)
                raise
            if made:
                with queue_lock:
                    prof["ring_made"] += 1
                    prof["ring_s"] += time.perf_counter() - t
            jobs: list[tuple[int, int, int]] = []
            per_device: dict[int, list[tuple[int, int, int]]] = {}
            pos = 0
            for c in batch:
                jobs.append((c.blob, c.chunk, base + pos))
                for device, dst, offset, n in c.copies:
                    per_device.setdefault(device, []).append((dst, base + pos + offset, n))
                pos += c.nbytes
            t = time.perf_counter()
            try:
                read(jobs)
            except BaseException:
                slots.drop(s)
                raise
            add("read_s", time.perf_counter() - t)
            t = time.perf_counter()
            queued: list[Any] = []
            try:
                with queue_lock:
                    prof["reads"] += 1
                    for device, copies in per_device.items():
                        if device not in copiers:
                            copiers[device] = _native.CudaCopier(device)
                        ev = copiers[device].h2d(copies, streams[device])
                        queued.append(ev)
                        ev.make_stream_wait(streams[device])  # the state's next use waits
                    prof["queue_s"] += time.perf_counter() - t
            finally:
                slots.fly(s, queued)

    # Workers that began (and so may touch the ring) and have not ended; those that end.
    count_of = {"running": 0, "ended": 0}
    changed = threading.Condition(queue_lock)

    def guarded() -> None:
        with changed:
            if failed:  # stopped before it began: it touches nothing
                count_of["ended"] += 1
                changed.notify_all()
                return
            count_of["running"] += 1
        try:
            work()
        except BaseException as e:
            stop(e)
        finally:
            with changed:
                count_of["running"] -= 1
                count_of["ended"] += 1
                changed.notify_all()

    def stop(e: BaseException) -> None:  # the workers take no further batch
        with queue_lock:
            failed.append(e)

    pool = ThreadPoolExecutor(workers, thread_name_prefix="snapcore-h2d") if workers > 1 else None

    def work_all() -> BaseException | None:
        """Run the workers until every one has ended; an interruption is returned at once
        (``settle``, in the cleanup, stops the workers and waits for them)."""
        if pool is None:
            guarded()  # in this thread: it catches what interrupts it
            return None
        try:
            for _ in range(workers):
                pool.submit(guarded)
            pool.shutdown(wait=False)
            with changed:
                changed.wait_for(
                    lambda: (
                        count_of["ended"] == workers or (bool(failed) and count_of["running"] == 0)
                    )
                )
            return None
        except BaseException as e:
            log.warning("restore to the GPU interrupted: waiting for its workers' batches")
            return e

    def close_copiers() -> None:
        while copiers:  # each waits for its side stream: a backstop for lost events
            copier = copiers.pop(next(iter(copiers)))  # in the order they were made
            with contextlib.suppress(Exception):
                copier.close()

    def settle() -> None:
        """No worker runs, and none will begin: whatever left ``work_all`` early (an
        interruption), the workers stop here at their next batch, and their threads go."""
        with changed:
            if count_of["ended"] < workers and not failed:
                failed.append(SnapcoreError("the restore to the GPU was interrupted"))
            changed.wait_for(lambda: count_of["running"] == 0)
        if pool is not None:
            pool.shutdown(wait=True)

    interrupted: BaseException | None = None
    try:
        interrupted = work_all()
        if interrupted is not None:
            raise interrupted
        if failed:
            raise failed[0]
        t = time.perf_counter()
        slots.wait_all()
        prof["drain_s"] = time.perf_counter() - t
    finally:
        # After a failure or an interruption too: no worker runs, nothing queued
        # outlives this, whatever interrupts it.
        first_late = _despite_interrupts(settle)
        second = _despite_interrupts(lambda: slots.wait_all(quiet=True))
        t = time.perf_counter()
        third = _despite_interrupts(close_copiers)
        prof["close_s"] = time.perf_counter() - t
        settled[0] = True
        late = first_late or second or third
        if late is not None and interrupted is None:
            raise late
