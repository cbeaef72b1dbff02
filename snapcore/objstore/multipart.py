"""Writing one object: a single PUT or an S3 multipart upload (parts in flight at once, the
complete retried and recognised by its ETag when its answer was lost, aborted on failure),
or on other file systems a hidden temporary file renamed into place; and ObjectWriter,
which streams an object in parts through either.

An object becomes visible under its name only once it is complete: on S3 through a single
PUT or a completed multipart upload, elsewhere by renaming a hidden temporary file into
place.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import functools
import hashlib
import io
import logging
import os
import secrets
import threading
from collections.abc import Callable
from typing import Any

import xxhash

from ..errors import RemoteError
from .connection import Connection

log = logging.getLogger(__name__)

S3_MIN_PART = 5 << 20  # S3's smallest part, except the last one
S3_MAX_PART = 5 << 30
S3_MAX_PARTS = 10_000


class _PartReader(io.RawIOBase):
    """A read-only file over the first ``length`` bytes of a buffer, without copying it.

    botocore refuses a memoryview body, and aiohttp warns about (and sends in one piece) a
    large bytes body; a file it reads in small pieces from the executor, so a part is
    never copied whole.
    """

    def __init__(self, buf: bytes | bytearray, length: int) -> None:
        super().__init__()
        self._view = memoryview(buf).toreadonly()[:length]
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        end = len(self._view)
        if size is not None and size >= 0:
            end = min(end, self._pos + size)
        start, self._pos = self._pos, max(self._pos, end)
        return bytes(self._view[start:end])

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), len(self._view) - self._pos))
        memoryview(b).cast("B")[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n

    def close(self) -> None:
        self._view.release()
        super().close()


class S3Upload:
    """One object's way onto S3: a single PUT, or a multipart upload started by the first
    part (so an object of one part costs one request)."""

    def __init__(self, conn: Connection, name: str) -> None:
        self.conn = conn
        self.name = name
        self.bucket, self.key, _ = conn.fs.split_path(conn.path(name))
        self.upload_id: str | None = None
        self.etags: dict[int, str] = {}
        self.stopping = False
        self._start_lock = asyncio.Lock()

    def _stop(self) -> bool:
        return self.stopping

    async def _s3(self, op: str, **kwargs: Any) -> Any:
        call = self.conn.fs._call_s3
        return await self.conn.retry(
            op,
            self.name,
            lambda: call(op, Bucket=self.bucket, Key=self.key, **kwargs),
            stop=self._stop,
        )

    async def put(self, buf: bytes | bytearray, length: int) -> None:
        # A fresh reader per attempt: a failed attempt may have consumed part of the body.
        call = self.conn.fs._call_s3
        await self.conn.retry(
            "put_object",
            self.name,
            lambda: call(
                "put_object", Bucket=self.bucket, Key=self.key, Body=_PartReader(buf, length)
            ),
            stop=self._stop,
        )

    async def part(self, number: int, buf: bytearray, length: int) -> None:
        async with self._start_lock:
            if self.upload_id is None:
                self.upload_id = (await self._s3("create_multipart_upload"))["UploadId"]
        call = self.conn.fs._call_s3
        response = await self.conn.retry(
            "upload_part",
            self.name,
            lambda: call(
                "upload_part",
                Bucket=self.bucket,
                Key=self.key,
                UploadId=self.upload_id,
                PartNumber=number,
                Body=_PartReader(buf, length),
            ),
            stop=self._stop,
        )
        self.etags[number] = response["ETag"]

    async def complete(self) -> None:
        parts = [{"PartNumber": k, "ETag": v} for k, v in sorted(self.etags.items())]
        try:
            await self._s3(
                "complete_multipart_upload",
                UploadId=self.upload_id,
                MultipartUpload={"Parts": parts},
            )
        except RemoteError:
            # An attempt whose answer was lost may have completed the upload, and then its
            # retry finds no such upload: the object's ETag tells whether it is ours.
            if not await self._completed(parts):
                raise

    async def _completed(self, parts: list[dict[str, Any]]) -> bool:
        try:
            info = await self.conn.call("info", self.conn.path(self.name))
        except Exception:
            return False
        digests = b"".join(bytes.fromhex(p["ETag"].strip('"')) for p in parts)
        expected = f"{hashlib.md5(digests).hexdigest()}-{len(parts)}"
        return str(info.get("ETag", "")).strip('"') == expected

    async def abort(self) -> None:
        if self.upload_id is None:
            return  # nothing was started: a failed single PUT leaves nothing behind
        self.stopping = False  # the abort itself must be tried, and retried
        try:
            await self._s3("abort_multipart_upload", UploadId=self.upload_id)
        except RemoteError as e:
            if e.errno != errno.ENOENT:
                log.warning(
                    "multipart upload %s of %s could not be aborted (%s); it stays invisible "
                    "but its parts are stored until a lifecycle rule removes them",
                    self.upload_id,
                    self.conn.where(self.name),
                    e,
                )
                raise
        finally:
            self.stopping = True


class FileUpload:
    """One object's way onto a file system (file://, memory://, any fsspec one without S3's
    multipart API): parts are written in order to a hidden temporary name in the same
    directory, renamed into place on close, so a partial object is never visible.

    Writes to an open file are not retried (a failed write leaves the file at an unknown
    length); opening, renaming and removing are.
    """

    def __init__(self, conn: Connection, name: str) -> None:
        self.conn = conn
        self.name = name
        self.path = conn.path(name)
        directory, _, base = self.path.rpartition("/")
        self.tmp = f"{directory}/.{base}.{secrets.token_hex(6)}.partial"
        self.stopping = False
        self._file: Any = None
        self._next = 1
        self._turn = asyncio.Condition()
        self._broken = False
        self._io_lock = threading.Lock()  # a write in the executor vs. close from abort

    async def put(self, buf: bytes | bytearray, length: int) -> None:
        await self.part(1, buf, length)
        await self.complete()

    async def part(self, number: int, buf: bytes | bytearray, length: int) -> None:
        async with self._turn:
            await self._turn.wait_for(lambda: self._next == number or self._broken)
            try:
                if self._broken or self.stopping:
                    raise RemoteError(
                        "write abandoned: an earlier part failed or the upload is aborting",
                        url=self.conn.url,
                        name=self.name,
                        op="write",
                    )
                if self._file is None:
                    self._file = await self.conn.retry(
                        "open", self.name, lambda: asyncio.to_thread(self._open)
                    )
                await self.conn.retry(
                    "write",
                    self.name,
                    lambda: asyncio.to_thread(self._write, buf, length),
                    idempotent=False,
                )
                self._next += 1
            except BaseException:
                self._broken = True
                raise
            finally:
                self._turn.notify_all()

    def _open(self) -> Any:
        return self.conn.fs.open(self.tmp, "wb")

    def _write(self, buf: bytes | bytearray, length: int) -> None:
        with self._io_lock:
            if self._file is None or self._file.closed:
                raise ValueError("the temporary file was closed by an abort")
            with memoryview(buf) as view:
                self._file.write(view[:length])

    def _close_file(self, *, sync: bool) -> None:
        with self._io_lock:
            f = self._file
            if f is None or f.closed:
                return
            if sync:  # durable before it becomes visible, like the local store's files
                f.flush()
                with contextlib.suppress(AttributeError, OSError, ValueError):
                    os.fsync(f.fileno())
            f.close()

    async def complete(self) -> None:
        if self._file is None:  # an empty object: create it
            self._file = await self.conn.retry(
                "open", self.name, lambda: asyncio.to_thread(self._open)
            )
        await self.conn.retry(
            "close",
            self.name,
            lambda: asyncio.to_thread(self._close_file, sync=True),
            idempotent=False,
        )
        await self.conn.retry(
            "rename", self.name, lambda: self.conn.call("mv", self.tmp, self.path)
        )

    async def abort(self) -> None:
        self.stopping = True
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self._close_file, sync=False)
        if self._file is None:
            return
        try:
            await self.conn.retry("delete", self.name, lambda: self.conn.call("rm_file", self.tmp))
        except RemoteError as e:
            if e.errno != errno.ENOENT:
                raise


def new_upload(conn: Connection, name: str) -> S3Upload | FileUpload:
    """The way object ``name`` goes onto ``conn``'s store: multipart on S3, a renamed
    temporary file elsewhere."""
    return S3Upload(conn, name) if conn.is_s3 else FileUpload(conn, name)


class ObjectWriter:
    """Streams one object to the tier in parts of ``part_bytes``, ``max_inflight`` of them
    uploading at once; keeps the xxh3_128 of the bytes written.

    Memory is bounded: a write() that would start one part more than ``max_inflight``
    blocks until one finishes, so a writer holds at most ``max_inflight + 1`` part buffers
    (buffers are reused). Each byte is copied once, from the caller's buffer into a part
    buffer, so the caller may reuse its buffer as soon as write() returns.

    Calls are serialized by a lock, but the object is the bytes in the order the calls
    ran: write from one thread (or order the calls yourself).
    """

    def __init__(
        self,
        conn: Connection,
        name: str,
        *,
        part_bytes: int,
        max_inflight: int,
        on_finish: Callable[[ObjectWriter], None] = lambda w: None,
    ) -> None:
        self._conn = conn
        self._on_finish = on_finish
        self.name = name
        self._upload = new_upload(conn, name)
        self._part_bytes = part_bytes
        self._hash = xxhash.xxh3_128()
        self._size = 0
        self._buf: bytearray | None = None
        self._fill = 0
        self._free: list[bytearray] = []
        self._slots = threading.Semaphore(max_inflight)
        self._parts: list[concurrent.futures.Future[None]] = []
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._state = "open"  # open | closed | failed | aborted
        self._result: tuple[int, str] | None = None

    def __repr__(self) -> str:
        return f"ObjectWriter({self._conn.where(self.name)!r}, {self._state})"

    def __enter__(self) -> ObjectWriter:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    # -- writing ----------------------------------------------------------------------------
    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append ``data``; blocks while ``max_inflight`` parts are uploading."""
        with self._lock:
            self._check_open()
            view = memoryview(data)
            if not view.c_contiguous:
                raise ValueError("ObjectWriter.write needs a contiguous buffer")
            view = view.cast("B")
            self._hash.update(view)  # xxhash releases the GIL on large buffers
            self._size += len(view)
            pos = 0
            while pos < len(view):
                space = self._free_space_locked()
                n = min(len(space), len(view) - pos)
                space[:n] = view[pos : pos + n]
                self._fill += n
                pos += n

    @property
    def upload(self) -> S3Upload | FileUpload:
        """The upload under this writer (its requests, for a test to replay one)."""
        return self._upload

    def free_space(self) -> memoryview:
        """The unfilled end of the current part buffer, for a caller that reads into it
        (ObjectStoreClient.upload_file) instead of calling write(); then advance()."""
        with self._lock:
            self._check_open()
            return self._free_space_locked()

    def advance(self, n: int) -> None:
        """Account for ``n`` bytes put into the space free_space() returned."""
        with self._lock:
            assert self._buf is not None and self._fill + n <= self._part_bytes
            with memoryview(self._buf) as view:
                self._hash.update(view[self._fill : self._fill + n])
            self._fill += n
            self._size += n

    def _free_space_locked(self) -> memoryview:
        if self._error is not None:
            self._fail()
        if self._fill == self._part_bytes:
            # More bytes follow, so the full buffer is a part of a multipart upload.
            self._submit_part()
        if self._buf is None:
            self._buf = self._free.pop() if self._free else bytearray(self._part_bytes)
            self._fill = 0
        return memoryview(self._buf)[self._fill :]

    def _submit_part(self) -> None:
        assert self._buf is not None
        number = len(self._parts) + 1
        if self._conn.is_s3 and number > S3_MAX_PARTS:
            self._fail(
                RemoteError(
                    f"the object needs more than {S3_MAX_PARTS} parts of {self._part_bytes} "
                    "bytes: raise part_bytes",
                    url=self._conn.url,
                    name=self.name,
                    op="upload_part",
                )
            )
        self._slots.acquire()  # backpressure: at most max_inflight parts in flight
        if self._error is not None:
            self._slots.release()
            self._fail()
        buf, length = self._buf, self._fill
        self._buf, self._fill = None, 0
        try:
            fut = self._conn.loop.submit(self._upload.part(number, buf, length), internal=True)
        except BaseException:
            self._slots.release()
            raise
        fut.add_done_callback(functools.partial(self._part_done, buf))
        self._parts.append(fut)

    def _part_done(self, buf: bytearray, fut: concurrent.futures.Future[None]) -> None:
        # Runs on the loop thread.
        if fut.cancelled():
            error: BaseException | None = concurrent.futures.CancelledError()
        else:
            error = fut.exception()
        if error is None:
            self._free.append(buf)
        elif self._error is None:
            self._error = error
        self._slots.release()

    # -- finishing --------------------------------------------------------------------------
    def close(self) -> tuple[int, str]:
        """Finish the upload and check that the object exists with exactly the size written;
        returns (size, xxh3_128 hex). On failure nothing is left visible under the name
        and RemoteError is raised. Calling it again returns the same result."""
        with self._lock:
            if self._state == "closed":
                assert self._result is not None
                return self._result
            self._check_open()
            loop = self._conn.loop
            try:
                if not self._parts:  # it fits in one part: a single request
                    buf = self._buf if self._buf is not None else bytearray()
                    loop.run(self._upload.put(buf, self._fill), internal=True)
                else:
                    if self._fill:
                        self._submit_part()
                    concurrent.futures.wait(self._parts)
                    if self._error is not None:
                        self._fail()
                    loop.run(self._upload.complete(), internal=True)
            except BaseException as e:
                if self._state == "failed":  # _fail() already aborted the upload
                    raise
                self._fail(e)
            try:
                size = loop.run(self._conn.size(self.name), internal=True)
                if size != self._size:
                    raise RemoteError(
                        f"uploaded object has {size} bytes, {self._size} were written",
                        url=self._conn.url,
                        name=self.name,
                        op="verify",
                    )
            except BaseException as e:
                # The object is visible and wrong (or unverifiable): take it away.
                with contextlib.suppress(Exception):
                    loop.run(self._conn.delete(self.name), internal=True)
                self._state = "failed"
                self._release_buffers()
                if isinstance(e, RemoteError):
                    raise
                raise RemoteError(
                    f"verify failed: {e}", url=self._conn.url, name=self.name, op="verify"
                ) from e
            self._state = "closed"
            self._release_buffers()
            self._result = (self._size, self._hash.hexdigest())
            self._on_finish(self)
            return self._result

    def abort(self) -> None:
        """Give the upload up: nothing becomes visible under the name. A no-op once the
        writer is closed, failed or aborted."""
        with self._lock:
            if self._state != "open":
                return
            self._state = "aborted"
            self._settle_and_abort()

    def _check_open(self) -> None:
        if self._state == "failed":
            raise RemoteError(
                "this upload failed earlier", url=self._conn.url, name=self.name, op="write"
            ) from self._error
        if self._state != "open":
            raise ValueError(f"{self!r} is {self._state}")

    def _fail(self, cause: BaseException | None = None) -> None:
        """Abort the whole upload after a failure, then raise it as a RemoteError."""
        error = cause or self._error
        assert error is not None
        self._state = "failed"
        self._error = self._error or error
        self._settle_and_abort()
        if isinstance(error, RemoteError) or not isinstance(error, Exception):
            raise error  # RemoteError as it is; KeyboardInterrupt and the like untouched
        raise RemoteError(
            f"upload failed: {type(error).__name__}: {error}",
            url=self._conn.url,
            name=self.name,
            op="upload",
        ) from error

    def _settle_and_abort(self) -> None:
        # Parts in flight stop at their next attempt; wait for them so that the abort is the
        # last request of this upload and nothing lands after it.
        self._upload.stopping = True
        concurrent.futures.wait(self._parts)
        try:
            self._conn.loop.run(self._upload.abort(), internal=True)
        except Exception as e:
            log.warning("abort of the upload of %s failed: %s", self._conn.where(self.name), e)
        finally:
            self._release_buffers()
            self._on_finish(self)

    def _release_buffers(self) -> None:
        self._buf = None
        self._fill = 0
        self._free.clear()
