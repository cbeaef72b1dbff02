"""The upload stage: a snapshot committed locally (or in host memory) goes to object storage.

``StepUpload`` uploads one committed snapshot to a remote tier and commits it there; it
needs no engine, so ``snapcore convert`` uploads the step it streamed into a temporary
local store with it too (snapcore/convert/snapcore_fmt.py), and the remote gets what a
save's upload gives. ``Upload`` is the engine's job around it: it runs on the engine's
upload thread, one snapshot after another, so a slow or dead object store never holds up
staging or local commits, and reports the outcome on the save's handle.

Chunks the remote tier already holds (same content, same codec) are referenced, not
uploaded again. The remote manifest is written last, with one PUT, after the data object
is complete and its size checked (each request's body carries a checksum that S3
verifies; chunk hashes are checked on read). Memory: the data object is streamed from
the local file (or host memory) through the object writer's part buffers
(``ObjectStoreClient.part_bytes`` times ``max_inflight + 1``), plus one chunk where
chunks are copied one by one.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .. import manifest as mf
from ..directory import part_file_name, rank_prefix, step_dir_name
from ..io_types import ChunkKey, Location
from .commit import ShardedSave, part_ref
from .manifest_builder import BlobRecord, ChunkRecord, build_manifest, restrict

if TYPE_CHECKING:
    from ..staging.arena import HostArena
    from ..staging.handle import SaveHandle
    from ..tiers import LocalTier, RemoteStoreTier
    from .engine import Engine

log = logging.getLogger(__name__)

__all__ = ["StepUpload", "Upload", "Uploaded"]


class Upload:
    """The engine's upload of one snapshot (a ``StepUpload`` with the engine's remote
    tier, codec and chunk index), its outcome reported on ``handle``, then the engine's
    housekeeping (chunk index, retention) after the commit."""

    def __init__(
        self,
        engine: Engine,
        handle: SaveHandle,
        source: LocalTier,
        m: mf.Manifest,
        arena: HostArena | None = None,
        sharded: ShardedSave | None = None,
    ) -> None:
        self.engine = engine
        self.handle = handle
        self.source = source
        self.m = m
        self.arena = arena
        self.sharded = sharded

    def run(self) -> None:
        engine = self.engine
        remote: RemoteStoreTier = engine.remote  # type: ignore[assignment]
        try:
            job = StepUpload(
                remote,
                self.source,
                self.m,
                codec=engine.config.codec_for("remote"),
                # read once the upload's pending mark is written (StepUpload.run), not
                # when the job was made: the uploads before it added to it, and
                # retention (rank 0's, of a sharded save) may have removed steps since
                index=lambda: engine.index.get("remote"),
                arena=self.arena,
                sharded=self.sharded,
            )
            done = job.run()
        except BaseException as e:
            log.error("upload of step %d to %s failed: %s", self.m.step, engine.remote_url, e)
            if self.sharded is not None:
                self.sharded.fail(("remote",), self.m.step, e)
            self.handle.resolve("remote", e)
            return
        self.handle.stats.written["remote"] = done.written
        self.handle.stats.reused["remote"] = done.reused
        engine.after_commit("remote", done.manifest, self.handle, before=done.end)
        self.handle.resolve("remote")


@dataclass
class Uploaded:
    """A committed upload: the remote's manifest, the bytes written and those referenced
    from earlier snapshots. ``end()`` removes the upload's pending mark: the caller's
    housekeeping after the commit (its failure cannot undo the commit)."""

    manifest: mf.Manifest
    written: int
    reused: int
    remote: RemoteStoreTier
    token: str

    def end(self) -> None:
        self.remote.end(self.manifest.step, self.token)


class StepUpload:
    """Upload one committed snapshot to ``remote`` and commit it there. ``source`` is the
    tier whose committed manifest ``m`` is read; with ``arena`` set, chunks are read from
    host memory instead of that tier's files. ``codec``: the remote's codec (chunks in
    another are re-encoded); ``index``: the chunks the remote holds already, by (xxh3,
    raw length, codec), referenced rather than uploaded (None: none), or a function
    that reads them, called once the upload's pending mark is written: a collection
    that lists the store after that spares every object, and one that listed it before
    has removed its steps' manifests already, which the index then no longer names (a
    chunk index read before the mark could name an object that collection deletes:
    another process's retention, rank 0's in a sharded save). A sharded save
    uploads its rank's part without the node copies (``PartSpec.drop``): object storage
    gets each box of the job once, and rank 0 writes the step's index. ``progress(n)``
    is called as each ``n`` bytes of the data object go to the upload.

    ``run()`` marks the upload pending, writes one data object
    (``step-N/data-TOKEN-rR.bin``), then the manifest with one PUT: a failure anywhere
    raises (a ``RemoteError`` names the object and the URL) and leaves no manifest, the
    data object aborted and the pending mark removed where the store still answers."""

    def __init__(
        self,
        remote: RemoteStoreTier,
        source: LocalTier,
        m: mf.Manifest,
        *,
        codec: str = "none",
        index: dict[ChunkKey, Location] | Callable[[], dict[ChunkKey, Location]] | None = None,
        arena: HostArena | None = None,
        sharded: ShardedSave | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        self.remote = remote
        self.progress = progress
        self.source = source
        self.codec = codec
        self._index = index
        self.sharded = sharded
        drop = sharded.spec.drop.get("remote", frozenset()) if sharded is not None else ()
        self.m = restrict(m, drop)
        self.trimmed = self.m is not m  # the source's data file holds chunks we leave out
        self.arena = arena

    def _end(self, token: str) -> None:
        """Remove the pending mark after a failure, without hiding that failure (a dead
        server fails this too; garbage collection honours the mark for its grace time)."""
        try:
            self.remote.end(self.m.step, token)
        except Exception as e:
            log.warning("%s: the pending mark %s stays: %s", self.remote.describe(), token, e)

    def run(self) -> Uploaded:
        from .. import codec

        m, remote, target = self.m, self.remote, self.codec
        token = secrets.token_hex(6)
        where = step_dir_name(m.step)
        rank = 0
        if self.sharded is not None:  # thousands of ranks: spread over S3 prefixes
            rank = self.sharded.spec.rank
            where = f"{where}/{rank_prefix(rank)}"
        name = f"{where}/data-{token}-r{rank}.bin"
        remote.begin(m.step, token)
        try:  # after the mark (the class's docstring)
            index = self._index() if callable(self._index) else self._index
        except BaseException:
            self._end(token)
            raise
        index = {} if index is None else index
        biggest = max((c.length for b in m.blobs for c in b.chunks), default=0)
        raw_max = max((c.raw_length for b in m.blobs for c in b.chunks), default=0)
        buf = torch.empty(biggest, dtype=torch.uint8)
        raw_buf = torch.empty(raw_max if self._any_codec() else 0, dtype=torch.uint8)
        writer = None
        pos = 0
        new: dict[tuple[str, int, str], tuple[int, int]] = {}
        placed: dict[tuple[int, int], tuple[str, int, str]] = {}
        locs: dict[tuple[int, int], Location] = {}
        stored: dict[tuple[int, int], int] = {}
        reused = 0
        whole = self._whole_file(index, target)
        if whole is not None:  # the object is this snapshot's local file, as it is
            try:
                size, _ = remote.upload_file(str(self.source.root / whole), name, self.progress)
            except BaseException:
                self._end(token)
                raise
            for b_i, blob in enumerate(m.blobs):
                for j, c in enumerate(blob.chunks):
                    f = m.files[c.file]
                    key = (c.xxh3, c.raw_length, target)
                    if f.name == whole:
                        locs[(b_i, j)] = Location(name, c.offset, c.length, size)
                    else:
                        locs[(b_i, j)] = index[key]
                        reused += c.raw_length
                    stored[(b_i, j)] = locs[(b_i, j)].length
            return self._finish(token, locs, stored, size, reused)
        try:
            for b_i, blob in enumerate(m.blobs):
                for j, c in enumerate(blob.chunks):
                    key = (c.xxh3, c.raw_length, target)
                    if key in new:
                        placed[(b_i, j)] = key
                        stored[(b_i, j)] = new[key][1]
                        continue
                    old = index.get(key)
                    if old is not None:
                        locs[(b_i, j)] = old
                        stored[(b_i, j)] = old.length
                        reused += c.raw_length
                        continue
                    view = self._stored(c, buf)
                    if c.codec != target:
                        raw = view
                        if c.codec != "none":
                            codec.decode(
                                view,
                                codec=c.codec,
                                element_size=blob.element_size,
                                raw_length=c.raw_length,
                                out=raw_buf.data_ptr(),
                            )
                            raw = _mv(raw_buf, c.raw_length)
                        view = memoryview(
                            codec.encode(raw, codec=target, element_size=blob.element_size)
                        )
                    if writer is None:
                        writer = remote.open_writer(name)
                    writer.write(view)
                    if self.progress is not None:
                        self.progress(len(view))
                    new[key] = (pos, len(view))
                    placed[(b_i, j)] = key
                    stored[(b_i, j)] = len(view)
                    pos += len(view)
            size = 0
            if writer is not None:
                size, _ = writer.close()
                if size != pos:
                    raise OSError(f"{remote.describe()}/{name}: {size} bytes stored, {pos} sent")
        except BaseException:
            if writer is not None:
                with contextlib.suppress(Exception):  # it logs why; the first error is raised
                    writer.abort()
            self._end(token)
            raise
        for at, key in placed.items():
            offset, length = new[key]
            locs[at] = Location(name, offset, length, size)
        return self._finish(token, locs, stored, size, reused)

    def _finish(
        self,
        token: str,
        locs: dict[tuple[int, int], Location],
        stored: dict[tuple[int, int], int],
        size: int,
        reused: int,
    ) -> Uploaded:
        remote = self.remote
        rm = self._manifest(locs, stored, self.codec)
        sh = self.sharded
        try:
            if sh is None:
                remote.commit(rm)
            else:  # this rank's part, then the index once every rank's part is there
                data = rm.dumps()
                name = part_file_name(rm.step, sh.spec.rank, token, spread=True)
                remote.put(name, data)
                sh.commit("remote", rm.step, part_ref(sh.spec.rank, name, data), remote.commit)
        except BaseException:
            self._end(token)
            raise
        return Uploaded(rm, size, reused, remote, token)

    def _whole_file(self, index: dict[tuple[str, int, str], Location], target: str) -> str | None:
        """The name of this snapshot's local data file if the remote needs exactly the
        chunks it holds, in the same codec (the common case): it is then uploaded as is."""
        if self.arena is not None or self.trimmed:
            return None
        own = f"{step_dir_name(self.m.step)}/data-"
        mine = {f.name for f in self.m.files if f.name.startswith(own)}
        if len(mine) != 1:
            return None
        (whole,) = mine
        for b in self.m.blobs:
            for c in b.chunks:
                in_file = self.m.files[c.file].name == whole
                if c.codec != target:
                    return None
                if in_file == ((c.xxh3, c.raw_length, target) in index):
                    return None  # a chunk of the file the remote has, or one it lacks elsewhere
        return whole

    def _any_codec(self) -> bool:
        return any(c.codec != "none" for b in self.m.blobs for c in b.chunks)

    def _stored(self, c: mf.Chunk, buf: torch.Tensor) -> memoryview:
        if self.arena is not None:
            return self.arena.view(c.offset, c.length)
        self.source.read_into(self.m.files[c.file].name, c.offset, c.length, buf.data_ptr())
        return _mv(buf, c.length)

    def _manifest(
        self, locs: dict[tuple[int, int], Location], stored: dict[tuple[int, int], int], codec: str
    ) -> mf.Manifest:
        """The remote's manifest: the local one's tensors and tree, its chunks where the
        remote stores them (its time and writer are the local snapshot's)."""
        m = self.m
        blobs = [
            BlobRecord(
                blob.nbytes,
                blob.element_size,
                [
                    ChunkRecord(locs[(b_i, j)], stored[(b_i, j)], c.xxh3, codec, c.raw_length)
                    for j, c in enumerate(blob.chunks)
                ],
            )
            for b_i, blob in enumerate(m.blobs)
        ]
        return build_manifest(
            step=m.step,
            blobs=blobs,
            tensors=m.tensors,
            tree=m.tree,
            created_unix=m.created_unix,
            writer=m.writer,
            part=m.part,
        )


def _mv(t: torch.Tensor, n: int) -> memoryview:
    import ctypes

    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")
