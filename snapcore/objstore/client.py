"""ObjectStoreClient: snapshot objects under an fsspec URL (``s3://`` through s3fs, ``file://``,
``memory://``), read and written through blocking methods.

The engine's threads call plain blocking methods. The I/O runs as coroutines on a private
event loop in one background thread (snapcore.objstore.loop), so that several parts of an
upload and many range reads are in flight at once without a thread per request (s3fs is
asyncio-native). Only writing differs between stores (snapcore.objstore.multipart),
because S3 has multipart uploads and file systems have rename.

A manifest is committed with ``put_bytes`` (one PUT) after ``ObjectWriter.close`` has
confirmed every data object it references.

Every request is retried on transient errors with exponential backoff and jitter
(snapcore.objstore.retry). (aiohttp still resends an idempotent request once, unlogged,
when its connection drops before the answer: integrity does not depend on it, since S3
checks each body's checksum and close() checks the object's size.)
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from collections.abc import Callable
from typing import Any

import aiofiles

from ..errors import RemoteError
from .connection import Connection, check_name
from .loop import Loop, bounded
from .multipart import S3_MAX_PART, S3_MAX_PARTS, S3_MIN_PART, ObjectWriter, new_upload

log = logging.getLogger(__name__)


async def _aio_open(path: str | os.PathLike[str]) -> Any:
    # Unbuffered: readinto() then fills the part buffer straight from the kernel.
    return await aiofiles.open(path, "rb", buffering=0)


async def _aio_readinto(f: Any, view: memoryview) -> int:
    return int(await f.readinto(view) or 0)


async def _aio_close(f: Any) -> None:
    await f.close()


class ObjectStoreClient:
    """Snapshot objects under an fsspec URL, read and written through blocking methods that
    any thread may call at once; the requests run on the tier's own event loop (so they
    must not be called from that loop, and a tier does not survive a fork). close() it
    when done: it stops the loop's thread and closes the connections.

    ``retries`` is how many times a request is tried again after a transient error (so
    ``retries + 1`` attempts at most); the wait before retry k is ``backoff_s * 2**k``
    (capped at 30 s) times a random factor in [0.5, 1). ``part_bytes`` is the part size
    of streamed uploads (at least 5 MiB on S3) and ``max_inflight`` the number of
    requests one call keeps in flight (parts of one writer, ranges of one read_ranges).
    """

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        retries: int = 5,
        backoff_s: float = 0.2,
        part_bytes: int = 16 << 20,
        max_inflight: int = 4,
    ) -> None:
        if retries < 0 or backoff_s < 0 or max_inflight < 1 or part_bytes < 1:
            raise ValueError("retries and backoff_s must be >= 0, max_inflight and part_bytes >= 1")
        self._conn = Connection(url, storage_options, retries=retries, backoff_s=backoff_s)
        self.url = self._conn.url
        self.retries = retries
        self.backoff_s = backoff_s
        self.part_bytes = part_bytes
        self.max_inflight = max_inflight
        if self._conn.is_s3 and not S3_MIN_PART <= part_bytes <= S3_MAX_PART:
            raise ValueError(f"part_bytes must lie in [5 MiB, 5 GiB] on S3, not {part_bytes}")
        self._writers: weakref.WeakSet[ObjectWriter] = weakref.WeakSet()
        self._conn.open()
        self._loop = self._conn.loop

    def __repr__(self) -> str:
        return f"ObjectStoreClient({self.url!r})"

    def __enter__(self) -> ObjectStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def loop(self) -> Loop:
        """The event loop the tier's requests run on (Loop.run runs a coroutine there)."""
        return self._loop

    @property
    def closed(self) -> bool:
        """Whether close() was called."""
        return self._loop.closing

    # -- writing ----------------------------------------------------------------------------
    def open_writer(self, name: str, *, part_bytes: int | None = None) -> ObjectWriter:
        """A writer that streams one object in parts; nothing is visible until its close().
        ``part_bytes``: this object's part size (default: the client's)."""
        check_name(name)
        if self._loop.closing:
            raise RemoteError("the remote tier is closed", url=self.url, name=name)
        w = ObjectWriter(
            self._conn,
            name,
            part_bytes=part_bytes or self.part_bytes,
            max_inflight=self.max_inflight,
            on_finish=self._writers.discard,
        )
        self._writers.add(w)
        return w

    def upload_file(
        self,
        local_path: str | os.PathLike[str],
        name: str,
        progress: Callable[[int], None] | None = None,
    ) -> tuple[int, str]:
        """Stream a local file into object ``name``; returns (size, xxh3_128 hex).
        ``progress(n)`` is called as each ``n`` bytes are handed to the writer.

        The file is read (with aiofiles, off the event loop) straight into the writer's part
        buffers, so its bytes are copied once on the way to the network. Its size is known,
        so on S3 a file larger than ``S3_MAX_PARTS`` parts of ``part_bytes`` goes in parts
        large enough for it (whole MiB): memory grows with the file past that size only.
        """
        size = os.stat(local_path).st_size
        part = self.part_bytes
        if self._conn.is_s3 and size > part * S3_MAX_PARTS:
            part = -(-size // (S3_MAX_PARTS << 20)) << 20
        w = self.open_writer(name, part_bytes=part)
        try:
            f = self._loop.run(_aio_open(local_path))
            try:
                done = 0
                while done < size:
                    space = w.free_space()
                    n = self._loop.run(_aio_readinto(f, space[: size - done]))
                    if not n:
                        raise RemoteError(
                            f"{local_path} shrank to {done} bytes while it was uploaded "
                            f"(it had {size})",
                            url=self.url,
                            name=name,
                            op="upload_file",
                        )
                    w.advance(n)
                    done += n
                    if progress is not None:
                        progress(n)
            finally:
                self._loop.run(_aio_close(f), internal=True)
            return w.close()
        except BaseException:
            w.abort()
            raise

    def put_bytes(self, name: str, data: bytes) -> None:
        """Write a whole object in one request: how manifests are committed, because one PUT
        is atomic on S3 (and a rename is, elsewhere)."""
        check_name(name)
        upload = new_upload(self._conn, name)
        buf = bytes(data)
        try:
            self._loop.run(upload.put(buf, len(buf)))
        except BaseException:
            with contextlib.suppress(Exception):
                self._loop.run(upload.abort(), internal=True)
            raise

    # -- reading ----------------------------------------------------------------------------
    def read_bytes(self, name: str) -> bytes:
        """The whole object."""
        check_name(name)
        conn = self._conn
        return self._loop.run(
            conn.retry("get", name, lambda: conn.call("cat_file", conn.path(name)))
        )

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        """Exactly ``length`` bytes at ``offset``; RemoteError if the object is shorter."""
        check_name(name)
        return self._loop.run(self._conn.read_range(name, offset, length))

    def read_ranges(self, requests: list[tuple[str, int, int]]) -> list[bytes]:
        """Many (name, offset, length) ranges, up to ``max_inflight`` at once, in order."""
        for name, _, _ in requests:
            check_name(name)
        coros = (self._conn.read_range(*r) for r in requests)
        return self._loop.run(bounded(coros, self.max_inflight))

    def size(self, name: str) -> int | None:
        """The object's size, None if there is no such object."""
        check_name(name)
        return self._loop.run(self._conn.size(name))

    def list(self, prefix: str = "") -> list[str]:
        """Names of every object that is ``prefix`` or lies under ``prefix/``, recursively,
        sorted. Objects whose names break the naming rule (such as the hidden temporary
        files of uploads in progress) are left out."""
        if prefix:
            check_name(prefix.rstrip("/"), what="prefix")
        return self._loop.run(self._conn.list(prefix.rstrip("/")))

    def delete(self, names: list[str]) -> None:
        """Delete objects; a missing one is not an error."""
        for name in names:
            check_name(name)
        self._loop.run(bounded((self._conn.delete(n) for n in names), self.max_inflight))

    # -- shutting down ----------------------------------------------------------------------
    def close(self) -> None:
        """Abort writers still open, close connections and stop the loop thread. Idempotent;
        later calls on the tier raise RemoteError."""
        if not self._loop.start_closing():
            return
        for w in list(self._writers):
            try:
                w.abort()
            except Exception as e:  # closing goes on; the writer's owner sees its own error
                log.warning("aborting the upload of %s on close: %s", self._conn.where(w.name), e)
        self._conn.close()
