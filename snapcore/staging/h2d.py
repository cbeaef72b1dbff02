"""Restore to the GPU: chunks read into a pinned ring, copied to their devices on the side
stream, each device's current stream made to wait for the copies.

The chunks go in batches of up to ``RING_SLOT_BYTES`` (a larger chunk is a batch of its
own). Every worker thread (``SNAPCORE_THREADS``) reads and hash-checks one batch at a time
into a slot of a registered (pinned) ring, then queues the slot's host-to-device copies
and takes the next batch: the reads of all workers run at once while the copies of the
batches read before run on the GPU. The ring has one slot per worker plus
``SPARE_SLOTS`` (in flight to the GPU), within ``SNAPCORE_RESTORE_RING_MB`` (fewer
workers then); a slot is read into again only once its copies have completed.

The ring is made (allocated, faulted, pinned) by the first restore to the GPU and kept
for the next ones (``release_ring`` frees it; ``snapcore.close`` and the interpreter's
exit do). No torch pinned allocation (torch caches those, rounded up to a power of two,
for the life of the process) and no blocking ``copy_`` per tensor: each slot's copies go
to the native copier of each device at once (merged where they continue one another, one
``cuMemcpyBatchAsync`` where the driver has it), queued on the device's side stream after
the work already on its current stream (the restoring thread's, taken before the workers
start: torch's current stream is per thread).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import _native, settings
from .arena import HostArena

# The bytes of one batch (one slot of the ring); a chunk larger than this gets a slot of
# its own size.
RING_SLOT_BYTES = 64 << 20
# Slots beyond one per worker: batches read and in flight to the GPU while every worker
# reads the next one.
SPARE_SLOTS = 2

# Where the last restore to the GPU in this process spent its time (for benchmarks: see
# bench_gpu.py): bytes, workers, slots, slot_bytes, reads (batches read), ring_made (1
# when this restore made the ring, 0 when it reused the last one's), and seconds:
# ring_s (making and pinning the ring), read_s, queue_s and wait_s summed over the
# workers (reading and checking chunks, queueing the copies, waiting for a slot's
# copies), drain_s (waiting for the last copies), close_s, total_s (wall time).
last_profile: dict[str, float] = {}

_ring_lock = threading.Lock()  # one restore to the GPU at a time uses the ring
_ring: HostArena | None = None


def release_ring() -> None:
    """Free the pinned ring that restores to the GPU keep between them (if any)."""
    global _ring
    with _ring_lock:
        if _ring is not None:
            _ring.close()
            _ring = None


def _take_ring(size: int, device: int) -> tuple[HostArena, bool]:
    """The kept ring if it holds ``size`` bytes, else a new one (the old one freed first);
    and whether it was made now. Called with ``_ring_lock`` held."""
    global _ring
    if _ring is not None and _ring.fits(size, device) and not _ring.native.closed:
        return _ring, False
    if _ring is not None:
        _ring.close()
        _ring = None
    # Pinned in the first device's context; portable, so every device's copies use it.
    _ring = HostArena(size, device=device)
    return _ring, True


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
        """Wait for every copy in flight (``quiet``: whatever an event raises)."""
        while True:
            with self.lock:
                if not self.flying:
                    return
                s, events = self.flying.popleft()
                self.free.append(s)
            for ev in events:
                if quiet:
                    with contextlib.suppress(Exception):
                        ev.synchronize()
                else:
                    ev.synchronize()


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
    with _ring_lock:
        ring, made = _take_ring(slot * count, devices[0])
        prof: dict[str, float] = {
            "bytes": total,
            "workers": workers,
            "slots": count,
            "slot_bytes": slot,
            "reads": 0,
            "ring_made": int(made),
            "ring_s": time.perf_counter() - t_start,
        }
        prof.update(dict.fromkeys(("read_s", "queue_s", "wait_s", "drain_s", "close_s"), 0.0))
        try:
            _run(batches, read, ring, slot, count, workers, streams, prof)
        except BaseException:
            _drop_ring()  # a driver error may have left the ring in any state
            raise
        finally:
            prof["total_s"] = time.perf_counter() - t_start
            last_profile.clear()
            last_profile.update(prof)


def _drop_ring() -> None:
    global _ring
    if _ring is not None:
        with contextlib.suppress(Exception):
            _ring.close()
        _ring = None


def _run(
    batches: list[list[ChunkCopies]],
    read: Callable[[list[tuple[int, int, int]]], None],
    ring: HostArena,
    slot: int,
    count: int,
    workers: int,
    streams: dict[int, int],
    prof: dict[str, float],
) -> None:
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
            base = ring.address + s * slot
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

    def guarded() -> None:
        try:
            work()
        except BaseException as e:
            with queue_lock:
                failed.append(e)

    try:
        if workers == 1:
            guarded()
        else:
            with ThreadPoolExecutor(workers, thread_name_prefix="snapcore-h2d") as pool:
                for f in [pool.submit(guarded) for _ in range(workers)]:
                    f.result()
        if failed:
            raise failed[0]
        t = time.perf_counter()
        slots.wait_all()
        prof["drain_s"] = time.perf_counter() - t
    finally:
        slots.wait_all(quiet=True)  # after a failure: nothing queued outlives this
        t = time.perf_counter()
        for copier in copiers.values():
            with contextlib.suppress(Exception):
                copier.close()
        prof["close_s"] = time.perf_counter() - t
