"""A snapshot written tensor by tensor, as the bytes arrive (``snapcore convert``'s
snapcore target): the engine takes a whole state and stages it in an arena; this writer
takes one tensor (or one piece of a tensor's bytes) at a time, writes it straight from
the caller's memory into the step's data file and hashes it on the way, and keeps
nothing but the manifest's records. Memory: what the caller holds, plus nothing.

The result is an ordinary committed snapshot of a local directory store (format 2,
docs/format.md): the same commit protocol (writer lock, ``Pending`` step with its lock
file, data fsynced, manifest last through ``Pending.commit``), one blob per tensor cut
into chunks of ``SNAPCORE_CHUNK_MB`` at the same boundaries as the engine cuts them (so
the chunk hashes are the ones ``snapcore.save`` would record), codec ``none`` (as the
engine's streaming path), and the manifest from the one builder
(``manifest_builder.build_manifest``). The caller gives the tree, with ``{"tensor": i}``
for the ``i``-th tensor it added.
"""

from __future__ import annotations

import contextlib
import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import xxhash

from .. import _native, settings
from .. import manifest as mf
from ..directory import LocalDirectory, Pending
from ..io_types import Location
from ..planning.layout import ALIGN, align_up, contiguous_strides
from . import writer_lock
from .manifest_builder import BlobRecord, ChunkRecord, build_manifest

__all__ = ["StreamWriter"]

PAGE = _native.page_size()


@dataclass
class _Blob:
    """One tensor's bytes in the data file: ``nbytes`` at ``offset`` (placed when the
    first bytes arrive), ``written`` of them so far, in order."""

    nbytes: int
    element_size: int
    offset: int = -1
    written: int = 0
    digests: list[str] = field(default_factory=list)
    partial: Any = None  # the hasher of a chunk that a piece ended inside


def _bytes_of(t: torch.Tensor) -> tuple[memoryview, int]:
    """A contiguous CPU tensor's bytes (no copy) and their address; the caller keeps
    ``t`` alive while the view is used."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"expected a contiguous CPU tensor, not {t.device} {tuple(t.stride())}")
    flat = t.reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy()), t.data_ptr()


class StreamWriter:
    """Writes step ``step`` of the local directory store ``root`` tensor by tensor.

    ``add_tensor(dtype, shape)`` declares the next tensor (its index in the manifest);
    ``write(i, offset, data)`` gives bytes ``[offset, offset + data.nbytes)`` of tensor
    ``i``'s C-order image, in order (each piece starts where the last ended; the pieces
    of different tensors may interleave); ``add(t)`` does both for a whole tensor. A
    write that fails leaves the writer refusing every later write and the commit.
    ``commit(tree)`` checks that every tensor is whole, fsyncs the data and commits the
    manifest; ``abort()`` (or any failure of ``commit``) leaves no committed step and
    removes this writer's files. Not thread-safe: one caller at a time.
    """

    def __init__(self, root: str | Path, step: int) -> None:
        self.directory = LocalDirectory(root)
        self.directory.ensure()
        self.step = step
        self._where = f"{self.directory.root}, step {step}"  # for messages
        self._lock: str | None = writer_lock.take(self.directory.root, str(self.directory.root))
        self._writer: Any = None
        self.pending: Pending | None = None
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="snapcore-stream-hash")
        self._failed: str | None = None  # why a write failed: the writer is then unusable
        try:
            self.directory.collect_leftovers()  # an interrupted writer's files, as a save does
            self.pending = self.directory.begin(step)
            self.name = self.pending.data_name(0)
            self._writer = _native.FileWriter(
                str(self.directory.root / self.name), direct=settings.o_direct() == "auto"
            )
        except BaseException:
            self.abort()
            raise
        self.chunk_bytes = settings.chunk_bytes()
        self.end = 0  # the end of the last blob placed (its whole size reserved): the file size
        self.blobs: list[_Blob] = []
        self.entries: list[mf.TensorEntry] = []
        self.committed: mf.Manifest | None = None

    # -- writing ---------------------------------------------------------------------------
    def add_tensor(self, dtype: torch.dtype, shape: tuple[int, ...]) -> int:
        """Declare the next tensor (its bytes come through ``write``); its index."""
        shape = tuple(int(s) for s in shape)
        nbytes = math.prod(shape) * dtype.itemsize
        i = len(self.entries)
        self.blobs.append(_Blob(nbytes, dtype.itemsize))
        self.entries.append(
            mf.TensorEntry(
                mf.dtype_name(dtype),
                shape,
                [mf.Piece((0,) * len(shape), shape, i, 0, contiguous_strides(shape))],
            )
        )
        return i

    def add(self, tensor: torch.Tensor) -> int:
        """A whole tensor (CPU, contiguous), written now; its index."""
        i = self.add_tensor(tensor.dtype, tuple(tensor.shape))
        self.write(i, 0, tensor)
        return i

    def write(self, i: int, offset: int, data: torch.Tensor) -> None:
        """Bytes ``[offset, offset + data.nbytes)`` of tensor ``i`` (``data``: a CPU,
        contiguous tensor of any dtype and shape holding them), written and hashed now
        (the hash on a thread while this one writes; both without the GIL)."""
        b = self.blobs[i]
        view, address = _bytes_of(data)
        n = len(view)
        if self._failed is not None:
            raise RuntimeError(
                f"{self._where}: an earlier write failed ({self._failed}); abort this writer"
            )
        if offset != b.written or offset + n > b.nbytes:
            raise ValueError(
                f"{self._where}: tensor {i}: bytes [{offset}, {offset + n}) given after "
                f"{b.written} of {b.nbytes}: pieces must come in order and stay inside it"
            )
        if n == 0:
            return
        if b.offset < 0:  # place the blob: same offset in a page as the memory (O_DIRECT)
            pos = self.end + (address - self.end) % PAGE
            if pos % ALIGN:
                pos = align_up(self.end, ALIGN)
            b.offset = pos
            # the whole blob is reserved now: a tensor placed before this one's last piece
            # comes after it, never inside it
            self.end = b.offset + b.nbytes
        try:
            hashed: Future[None] = self._hasher.submit(self._hash, b, offset, view)
            try:
                self._writer.write_at(b.offset + offset, address, n)
            finally:
                hashed.result()
        except BaseException as e:
            # the piece may be hashed but not written, or the reverse: the blob's digests
            # no longer match its bytes, so nothing more may be written or committed
            self._failed = f"tensor {i}, bytes [{offset}, {offset + n}): {e}"
            raise
        b.written += n

    def _hash(self, b: _Blob, offset: int, view: memoryview) -> None:
        """Hash bytes ``[offset, offset + len(view))`` of blob ``b`` into its chunks."""
        pos, stop, c = offset, offset + len(view), self.chunk_bytes
        while pos < stop:
            chunk_end = min((pos // c + 1) * c, b.nbytes)
            end = min(chunk_end, stop)
            part = view[pos - offset : end - offset]
            if b.partial is None and pos % c == 0 and end == chunk_end:
                b.digests.append(xxhash.xxh3_128_hexdigest(part))
            else:
                if b.partial is None:
                    b.partial = xxhash.xxh3_128()
                b.partial.update(part)
                if end == chunk_end:
                    b.digests.append(b.partial.hexdigest())
                    b.partial = None
            pos = end

    # -- the commit ------------------------------------------------------------------------
    def commit(self, tree: dict[str, Any]) -> mf.Manifest:
        """Make the step committed with ``tree`` (``{"tensor": i}`` nodes name the
        tensors added); returns its manifest. Any failure aborts."""
        try:
            assert self.pending is not None
            if self._failed is not None:
                raise RuntimeError(f"{self._where}: a write failed ({self._failed})")
            short = [i for i, b in enumerate(self.blobs) if b.written != b.nbytes]
            if short:
                b = self.blobs[short[0]]
                raise ValueError(
                    f"{self._where}: tensor {short[0]} is not whole: {b.written} of "
                    f"{b.nbytes} bytes written"
                )
            self._writer.sync()
            self._writer.close()
            blobs = []
            for b in self.blobs:
                chunks = []
                for j, digest in enumerate(b.digests):
                    start = j * self.chunk_bytes
                    n = min(self.chunk_bytes, b.nbytes - start)
                    loc = Location(self.name, b.offset + start, n, self.end)
                    chunks.append(ChunkRecord(loc, n, digest, "none", n))
                blobs.append(BlobRecord(b.nbytes, b.element_size, chunks))
            if self.end == 0:  # no byte to keep: no data file
                (self.directory.root / self.name).unlink(missing_ok=True)
            m = build_manifest(step=self.step, blobs=blobs, tensors=self.entries, tree=tree)
            # what every reader checks, before the commit makes it visible
            mf.parse(m.dumps(), where=f"{self._where}: the manifest")
            self.pending.commit(m)
        except BaseException:
            self.abort()
            raise
        self.committed = m
        self._close()
        return m

    def abort(self) -> None:
        """Leave no trace of this step: its data file and lock go (idempotent)."""
        if self._writer is not None:
            with contextlib.suppress(Exception):
                self._writer.close()
        if self.pending is not None and not self.pending.committed:
            with contextlib.suppress(Exception):
                self.pending.abort()
        self._close()

    def _close(self) -> None:
        self._hasher.shutdown(wait=True)
        if self._lock is not None:
            writer_lock.release(self._lock)
            self._lock = None
