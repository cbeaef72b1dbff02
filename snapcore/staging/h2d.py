"""Restore to the GPU: chunks read into a pinned ring, copied to their devices on the side
stream, each device's current stream made to wait for the copies.

The chunks are read (and hash-checked) by the reader's threads into one slot of a ring
of two registered (pinned) slots while the other slot's host-to-device copies run; a slot
is read into again only once its copies have completed. No torch pinned allocation (torch
caches those, rounded up to a power of two, for the life of the process) and no blocking
``copy_`` per tensor: each slot's copies go to the native copier of each device at once
(merged where they continue one another, one ``cuMemcpyBatchAsync`` where the driver has
it), queued on the device's side stream after the work already on its current stream.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import _native
from .arena import HostArena

# One slot of the ring; a chunk larger than this gets a slot of its own size.
RING_SLOT_BYTES = 256 << 20

# Where the last restore to the GPU in this process spent its time (for benchmarks: see
# bench_gpu.py): bytes, slots, slot_bytes, reads (calls of the reader), and seconds in
# ring_s (making and pinning the ring), read_s (reading and checking chunks), queue_s
# (queueing the copies), wait_s (waiting for a slot's copies), close_s, total_s.
last_profile: dict[str, float] = {}


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


def fill_devices(
    chunks: list[ChunkCopies], read: Callable[[list[tuple[int, int, int]]], None]
) -> None:
    """Read ``chunks`` with ``read`` (jobs of (blob, chunk, host address), the reader's
    parallel verified read) into a pinned ring and copy them to their devices.

    Returns once every copy has completed (the ring is then freed); a failure (a chunk
    damaged in every tier, a driver error) waits for the copies already queued first.
    """
    if not chunks:
        return
    t_start = time.perf_counter()
    devices = sorted({d for c in chunks for d, *_ in c.copies})
    total = sum(c.nbytes for c in chunks)
    slot = max(max(c.nbytes for c in chunks), min(RING_SLOT_BYTES, total))
    slots = 1 if total <= slot else 2
    prof = {"bytes": total, "slots": slots, "slot_bytes": slot, "reads": 0}
    prof.update(dict.fromkeys(("ring_s", "read_s", "queue_s", "wait_s", "close_s"), 0.0))
    # Pinned in the first device's context; portable, so every device's copies use it.
    ring = HostArena(slot * slots, device=devices[0])
    prof["ring_s"] = time.perf_counter() - t_start
    copiers: dict[int, Any] = {}
    pending: list[list[Any]] = [[] for _ in range(slots)]
    try:
        for k, batch in enumerate(_batches(chunks, slot)):
            s = k % slots
            t = time.perf_counter()
            for ev in pending[s]:  # the slot's previous copies have read it
                ev.synchronize()
            pending[s] = []
            prof["wait_s"] += time.perf_counter() - t
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
            read(jobs)
            prof["reads"] += 1
            prof["read_s"] += time.perf_counter() - t
            t = time.perf_counter()
            for device, copies in per_device.items():
                if device not in copiers:
                    copiers[device] = _native.CudaCopier(device)
                stream = torch.cuda.current_stream(device).cuda_stream
                ev = copiers[device].h2d(copies, stream)
                ev.make_stream_wait(stream)  # the state's next use waits on the GPU
                pending[s].append(ev)
            prof["queue_s"] += time.perf_counter() - t
        t = time.perf_counter()
        for evs in pending:
            while evs:
                evs[0].synchronize()
                evs.pop(0)
        prof["wait_s"] += time.perf_counter() - t
    finally:
        for evs in pending:  # after a failure: nothing queued may outlive the ring
            for ev in evs:
                with contextlib.suppress(Exception):
                    ev.synchronize()
        t = time.perf_counter()
        for copier in copiers.values():
            with contextlib.suppress(Exception):
                copier.close()
        ring.close()
        prof["close_s"] = time.perf_counter() - t
        prof["total_s"] = time.perf_counter() - t_start
        last_profile.clear()
        last_profile.update(prof)
