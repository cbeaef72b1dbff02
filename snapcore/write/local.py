"""Writing a staged snapshot to the node's tiers: its manifest into host memory (the
arena is the data), and its chunks to local disk, sharing unchanged chunks with earlier
snapshots.

Runs on the engine's persist thread (write/job.py). The hash thread hashes chunks in
arena order while this thread writes them, so writing starts as soon as the first chunk
is hashed; both spend their time in native code with the GIL released.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .. import _native, settings
from .. import manifest as mf
from ..directory import Pending
from ..io_types import ChunkKey, Location
from ..staging.handle import SaveHandle
from ..tiers import HostTier
from .chunks import Staged
from .commit import OutcomeUnknown, ShardedSave, part_ref
from .manifest_builder import kept, staged_manifest

log = logging.getLogger(__name__)

PAGE = _native.page_size()
WRITE_RUN_BYTES = 256 << 20  # the largest single write of consecutive chunks


def commit_host(
    host: HostTier, s: Staged, handle: SaveHandle, sharded: ShardedSave | None = None
) -> None:
    """Commit a snapshot staged in ``host``'s slot: its data is the arena, so only the
    manifest is written (a sharded save: this rank's part, then the index, write/commit.py)."""
    size = os.stat(host.slot_path(s.slot)).st_size
    locs = [Location(host.slot_name(s.slot), off, n, size) for _, _, off, n in s.chunks]
    drop = s.drops.get("host", ())
    m = staged_manifest(s, locs, ["none"] * len(locs), [n for *_, n in s.chunks], drop)
    pending = host.store.begin(s.step)
    try:
        if sharded is None:
            pending.commit(m)
        else:
            data = m.dumps()
            name = pending.write_part(sharded.spec.rank, data)
            try:
                ref = part_ref(sharded.spec.rank, name, data)
                sharded.commit("host", s.step, ref, pending.commit)
            except OutcomeUnknown:
                pending.settle()  # the step may be committed with this part: keep it
                raise
            if not pending.committed:  # rank 0 committed it by writing the index
                pending.settle()
    except BaseException:
        if not pending.committed:
            pending.abort()
        raise
    handle.stats.written["host"] = s.layout.total


class LocalWriter:
    """Writes the chunks of one snapshot that the local tier does not hold yet.

    Uncompressed chunks keep their arena offset modulo the page size, so runs of them go
    out as single O_DIRECT writes straight from the arena; compressed chunks are encoded
    on the encoder pool, a few ahead of the writer.
    """

    def __init__(
        self,
        s: Staged,
        pending: Pending,
        handle: SaveHandle,
        *,
        root: Path,
        codec: str,
        index: dict[ChunkKey, Location],
        encoder: Callable[[], ThreadPoolExecutor],
        encode_ahead: int,
        helpers: list[Any] | None = None,
        rank: int = 0,
    ) -> None:
        self.helpers = helpers if helpers is not None else []  # futures the job waits for
        self.s = s
        self.pending = pending
        self.handle = handle
        self.codec = codec
        self.index = index  # where the tier already stores each chunk content
        self.encoder = encoder
        self.encode_ahead = encode_ahead
        self.name = pending.data_name(rank)
        self.path = root / self.name
        self.skip: set[int] = set()  # chunks of blobs this tier's part leaves out

    def write(self, ready: list[threading.Event], hashing: Any) -> mf.Manifest:
        s, index = self.s, self.index
        n = len(s.chunks)
        locs: list[Location | None] = [None] * n
        stored = [0] * n
        new: dict[ChunkKey, tuple[int, int]] = {}
        placed: list[int] = []  # chunks written into this snapshot's file
        encoded: dict[int, Any] = {}
        writer, spare = data_writer(self.pending, self.path, s.layout.total)
        self.handle.stats.o_direct = writer.direct
        end = 0
        run: list[int] | None = None  # [file offset, arena offset, length]
        reused = 0
        drop = s.drops.get("local", ())
        keep, _ = kept(s.layout.entries, len(s.layout.blobs), drop)
        skip = self.skip = {k for k, c in enumerate(s.chunks) if c[0] not in keep}  # not here

        def flush() -> None:
            nonlocal run
            if run is not None:
                writer.write_at(run[0], s.arena.address + run[1], run[2])
                run = None

        try:
            for k, (_, _, off, length) in enumerate(s.chunks):
                if k in skip:
                    continue
                if not ready[k].is_set():
                    flush()  # write what is hashed while the hash thread goes on
                while not ready[k].wait(0.1):
                    if hashing.done():
                        hashing.result()  # raises the hash thread's error
                key: ChunkKey = (s.digests[k], length, self.codec)
                if key in new:
                    locs[k], stored[k] = None, new[key][1]
                    placed.append(k)
                    continue
                old = index.get(key)
                if old is not None:
                    locs[k], stored[k] = old, old.length
                    reused += length
                    continue
                if self.codec == "none":
                    pos = end + (off - end) % PAGE  # same offset in a page as in the arena
                    if run is not None and pos == run[0] + run[2] and off == run[1] + run[2]:
                        run[2] += length
                    else:
                        flush()
                        run = [pos, off, length]
                    if run[2] >= WRITE_RUN_BYTES:
                        flush()
                    new[key] = (pos, length)
                    stored[k] = length
                    end = pos + length
                else:
                    flush()
                    data = bytes(self._encoded(k, encoded, ready, new, index))
                    nbytes = len(data)
                    writer.write_at(end, address_of(data), nbytes)
                    new[key] = (end, nbytes)
                    stored[k] = nbytes
                    end += nbytes
                placed.append(k)
            flush()
            if placed:
                trim(self.path, spare, end)
            writer.sync()
        finally:
            for fut in encoded.values():  # look-ahead work nobody will use: stop it
                fut.cancel()
            writer.close()
        size = end
        for k in placed:
            pos, nbytes = new[(s.digests[k], s.chunks[k][3], self.codec)]
            locs[k] = Location(self.name, pos, nbytes, size)
        if not placed and not (spare is not None and self.pending.store.give_back(self.path)):
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
        self.handle.stats.written["local"] = size
        self.handle.stats.reused["local"] = reused
        # A shared chunk was looked up with this tier's codec, so every chunk has it.
        return staged_manifest(s, locs, [self.codec] * n, stored, drop)

    def _encoded(
        self,
        k: int,
        cache: dict[int, Any],
        ready: list[threading.Event],
        new: dict[ChunkKey, tuple[int, int]],
        index: dict[ChunkKey, Location],
    ) -> Any:
        """Encode chunk ``k``, and start encoding the next few that will be written (not
        those the tier already holds) on the encoder pool."""
        from .. import codec

        s = self.s
        pool = self.encoder()
        for j in range(k, min(k + self.encode_ahead, len(s.chunks))):
            if j in cache or j in self.skip or not ready[j].is_set():
                continue
            key = (s.digests[j], s.chunks[j][3], self.codec)
            if j > k and (key in new or key in index):
                continue
            if j > k and any(key == (s.digests[i], s.chunks[i][3], self.codec) for i in cache):
                continue  # the same content is being encoded already
            b_i, _, off, length = s.chunks[j]
            cache[j] = pool.submit(
                codec.encode,
                s.arena.view(off, length),
                codec=self.codec,
                element_size=s.layout.blobs[b_i].element_size,
            )
            self.helpers.append(cache[j])
        return cache.pop(k).result()


def data_writer(pending: Pending, path: Path, size: int) -> tuple[Any, int | None]:
    """A writer of a new data file at ``path`` in ``pending``'s step, of at most ``size``
    bytes, and the size of the spare it writes over: a data file retention freed
    (docs/format.md, "Spare data files"), whose blocks an O_DIRECT write reuses without
    allocating new ones (30-35% faster on ext4 than a new file). None: a new file. Where
    the file system has no room for what the spare does not hold, the spares go first."""
    store = pending.store
    spare = store.take_spare(path, size) if settings.recycle() else None
    if spare is None or spare < size:
        store.room_for(path, size - (spare or 0))
    direct = settings.o_direct() == "auto"
    return _native.FileWriter(str(path), direct=direct, truncate=spare is None), spare


def trim(path: Path, spare: int | None, size: int) -> None:
    """Cut a spare written over back to the ``size`` bytes written, before the fsync that
    makes the file durable (its size is in the manifest)."""
    if spare is not None and spare > size:
        os.truncate(path, size)


def address_of(data: bytes) -> int:
    """The address of a bytes object's buffer (valid while ``data`` lives)."""
    return ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value or 0
