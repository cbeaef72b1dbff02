"""Tier 2: snapshot objects under an fsspec URL (``s3://`` through s3fs, ``file://``,
``memory://``).

The engine's threads call plain blocking methods. The I/O runs as coroutines on a private
event loop in one background thread, so that several parts of an upload and many range
reads are in flight at once without a thread per request (s3fs is asyncio-native). File
systems without an async implementation (local, memory) run their blocking calls in that
loop's executor behind the same coroutine calls, so reads, listings and deletes take one
code path; only writing differs, because S3 has multipart uploads and file systems have
rename.

An object becomes visible under its name only once it is complete: on S3 through a single
PUT or a completed multipart upload, elsewhere by renaming a hidden temporary file into
place. A manifest is committed with ``put_bytes`` (one PUT) after ``ObjectWriter.close``
has confirmed every data object it references.

Every request is retried on transient errors with exponential backoff and jitter. The
retries of botocore and s3fs underneath are switched off, so that one policy applies and
each retry is logged. (aiohttp still resends an idempotent request once, unlogged, when
its connection drops before the answer: integrity does not depend on it, since S3 checks
each body's checksum and close() checks the object's size.)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import functools
import hashlib
import http.client
import io
import logging
import os
import random
import re
import secrets
import threading
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, TypeVar

import aiofiles
import fsspec
import xxhash

from .errors import RemoteError

log = logging.getLogger(__name__)

T = TypeVar("T")

S3_MIN_PART = 5 << 20  # S3's smallest part, except the last one
S3_MAX_PART = 5 << 30
S3_MAX_PARTS = 10_000
MAX_BACKOFF_S = 30.0

_NAME_COMPONENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
_MAX_NAME_COMPONENTS = 4


def check_name(name: str, *, what: str = "object name") -> str:
    """Refuse a name that could escape the tier's root: the rule of docs/format.md, "Files"
    (a relative POSIX path of at most 4 components, none of them '.', '..' or hidden)."""
    parts = name.split("/") if isinstance(name, str) else []
    if (
        not parts
        or len(parts) > _MAX_NAME_COMPONENTS
        or not all(_NAME_COMPONENT.fullmatch(p) for p in parts)
    ):
        raise ValueError(
            f"{what} {name!r} is not a relative name of at most {_MAX_NAME_COMPONENTS} "
            "components matching [A-Za-z0-9_][A-Za-z0-9._-]* (docs/format.md)"
        )
    return name


# -- which errors are worth a retry ---------------------------------------------------------

_PERMANENT = (
    FileNotFoundError,
    PermissionError,
    FileExistsError,
    IsADirectoryError,
    NotADirectoryError,
)
_TRANSIENT_ERRNOS = frozenset(
    {
        errno.ECONNRESET,
        errno.ECONNREFUSED,
        errno.ECONNABORTED,
        errno.ETIMEDOUT,
        errno.EPIPE,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.ENETDOWN,
        errno.EAGAIN,
    }
)
# S3 error codes that say "try again" although some come with a 4xx status.
_TRANSIENT_CODES = frozenset(
    {
        "InternalError",
        "ServiceUnavailable",
        "SlowDown",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "BadDigest",
        "IncompleteBody",
        "XAmzContentSHA256Mismatch",
    }
)


@functools.cache
def _transient_types() -> tuple[type[BaseException], ...]:
    # Imported here: botocore and aiohttp come with s3fs, and only S3 needs them.
    types: list[type[BaseException]] = [ConnectionError, TimeoutError, http.client.IncompleteRead]
    with contextlib.suppress(ImportError):
        import botocore.exceptions as be

        types += [be.HTTPClientError, be.ConnectionError, be.IncompleteReadError]
    with contextlib.suppress(ImportError):
        import aiohttp

        types += [aiohttp.ClientConnectionError, aiohttp.ClientPayloadError]
    return tuple(types)


def _s3_answer(exc: BaseException) -> tuple[int, str] | None:
    """(HTTP status, error code) of a botocore ClientError, None for any other error."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict) or "Error" not in response:
        return None
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
    return int(status), str(response["Error"].get("Code", ""))


def is_transient(exc: BaseException) -> bool:
    """Whether a retry may succeed: connection refused or reset, timeouts, HTTP 5xx, 408,
    429 and S3's throttling codes. Not-found, denied and malformed requests are final."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, _PERMANENT):
            return False
        answer = _s3_answer(e)
        if answer is not None:  # the store answered: its status decides
            status, code = answer
            return status >= 500 or status in (408, 429) or code in _TRANSIENT_CODES
        if isinstance(e, _transient_types()):
            return True
        if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
            return True
        # s3fs turns a ClientError into an OSError and chains the original.
        e = e.__cause__ or e.__context__
    return False


def _errno_of(exc: BaseException) -> int:
    """The errno a RemoteError carries: the cause's own (ENOENT, EACCES, ENOSPC on a file
    system, ECONNREFUSED), EIO where the cause has none."""
    if isinstance(exc, FileNotFoundError):
        return errno.ENOENT
    if isinstance(exc, PermissionError):
        return errno.EACCES
    if isinstance(exc, OSError) and exc.errno:
        return int(exc.errno)
    return errno.EIO


# -- plumbing -------------------------------------------------------------------------------


class _Loop:
    """One event loop in one daemon thread: where every request of a tier runs.

    Daemon, so that a tier nobody closed cannot keep the interpreter from exiting.
    """

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


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


async def _aio_open(path: str | os.PathLike[str]) -> Any:
    # Unbuffered: readinto() then fills the part buffer straight from the kernel.
    return await aiofiles.open(path, "rb", buffering=0)


async def _aio_readinto(f: Any, view: memoryview) -> int:
    return int(await f.readinto(view) or 0)


async def _aio_close(f: Any) -> None:
    await f.close()


# -- the tier -------------------------------------------------------------------------------


class RemoteTier:
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
        protocol, _ = fsspec.core.split_protocol(url)
        protocol = protocol or "file"
        cls = fsspec.get_filesystem_class(protocol)
        self.url = url.rstrip("/")
        self.retries = retries
        self.backoff_s = backoff_s
        self.part_bytes = part_bytes
        self.max_inflight = max_inflight
        self._root = cls._strip_protocol(url).rstrip("/")
        self._is_s3 = protocol in ("s3", "s3a")
        if self._is_s3:
            if not self._root:
                raise ValueError(f"{url!r} names no bucket")
            if not S3_MIN_PART <= part_bytes <= S3_MAX_PART:
                raise ValueError(f"part_bytes must lie in [5 MiB, 5 GiB] on S3, not {part_bytes}")
        options = dict(storage_options or {})
        if self._is_s3:
            # One retry policy, ours: botocore's own would retry (silently) under it.
            config = dict(options.get("config_kwargs") or {})
            config.setdefault("retries", {"total_max_attempts": 1})
            options["config_kwargs"] = config
            # Listings are cached by default, and a cached listing hides new objects.
            options.setdefault("use_listings_cache", False)
        if protocol in ("file", "local"):
            options.setdefault("auto_mkdir", True)
        self._state_lock = threading.Lock()
        self._closing = False
        self._stopping = False
        self._writers: weakref.WeakSet[ObjectWriter] = weakref.WeakSet()
        self._loop = _Loop(f"snapcore-remote {self.url}")
        try:
            self._fs = self._loop.submit(self._open_fs(cls, options)).result()
        except BaseException:
            self._loop.stop()
            raise
        self._async = bool(getattr(self._fs, "async_impl", False))

    async def _open_fs(self, cls: type, options: dict[str, Any]) -> Any:
        if not getattr(cls, "async_impl", False):
            return cls(skip_instance_cache=True, **options)
        fs = cls(
            asynchronous=True,
            loop=asyncio.get_running_loop(),
            skip_instance_cache=True,
            **options,
        )
        if self._is_s3:
            fs.retries = 1  # s3fs's own retry loop; ours is outside it
            await fs.set_session()
        return fs

    def __repr__(self) -> str:
        return f"RemoteTier({self.url!r})"

    def __enter__(self) -> RemoteTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- running coroutines -----------------------------------------------------------------
    def _submit(self, coro: Coroutine[Any, Any, T], *, internal: bool = False) -> Any:
        with self._state_lock:
            if self._stopping or (self._closing and not internal):
                coro.close()
                raise RemoteError("the remote tier is closed", url=self.url, op="submit")
            return self._loop.submit(coro)

    def _run(self, coro: Coroutine[Any, Any, T], *, internal: bool = False) -> T:
        if threading.current_thread() is self._loop.thread:
            coro.close()
            raise RuntimeError("RemoteTier's blocking methods cannot run on its own loop")
        fut = self._submit(coro, internal=internal)
        try:
            return fut.result()
        except concurrent.futures.CancelledError:
            raise RemoteError("the remote tier was closed", url=self.url) from None
        except BaseException:
            fut.cancel()  # an interrupt (Ctrl-C) leaves no request behind
            raise

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """The file system's ``method``: its coroutine where it has one, else the blocking
        call in the loop's executor."""
        if self._async:
            return await getattr(self._fs, "_" + method)(*args, **kwargs)
        return await asyncio.to_thread(getattr(self._fs, method), *args, **kwargs)

    async def _retry(
        self,
        op: str,
        name: str | None,
        fn: Callable[[], Awaitable[T]],
        *,
        stop: Callable[[], bool] | None = None,
        idempotent: bool = True,
    ) -> T:
        """``fn()`` until it succeeds, fails for good, or ``retries`` retries are spent."""
        attempt = 0
        while True:
            if stop is not None and stop():
                raise RemoteError(
                    f"{op} abandoned: the upload is aborting", url=self.url, name=name, op=op
                )
            try:
                return await fn()
            except RemoteError:
                raise
            except Exception as e:
                transient = idempotent and is_transient(e)
                if not transient or attempt >= self.retries or (stop is not None and stop()):
                    tries = f" after {attempt + 1} attempts" if attempt else ""
                    raise RemoteError(
                        f"{op} failed{tries}: {type(e).__name__}: {e}",
                        url=self.url,
                        name=name,
                        op=op,
                        code=_errno_of(e),
                    ) from e
                delay = min(self.backoff_s * 2**attempt, MAX_BACKOFF_S) * random.uniform(0.5, 1)
                attempt += 1
                log.warning(
                    "remote %s of %s failed (%s: %s); retry %d of %d in %.2f s",
                    op,
                    self._where(name),
                    type(e).__name__,
                    e,
                    attempt,
                    self.retries,
                    delay,
                )
                await asyncio.sleep(delay)

    async def _bounded(self, coros: Iterable[Coroutine[Any, Any, T]]) -> list[T]:
        """Run ``coros`` with at most ``max_inflight`` at once; results in order. On the first
        failure the others are cancelled and it is raised."""
        sem = asyncio.Semaphore(self.max_inflight)

        async def one(c: Coroutine[Any, Any, T]) -> T:
            async with sem:
                return await c

        tasks = [asyncio.ensure_future(one(c)) for c in coros]
        if not tasks:
            return []
        _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for t in tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
        return [t.result() for t in tasks]

    def _path(self, name: str) -> str:
        return f"{self._root}/{name}"

    def _where(self, name: str | None) -> str:
        return self.url if name is None else f"{self.url}/{name}"

    # -- writing ----------------------------------------------------------------------------
    def open_writer(self, name: str) -> ObjectWriter:
        """A writer that streams one object in parts; nothing is visible until its close()."""
        check_name(name)
        if self._closing:
            raise RemoteError("the remote tier is closed", url=self.url, name=name)
        w = ObjectWriter(self, name)
        self._writers.add(w)
        return w

    def _new_upload(self, name: str) -> _S3Upload | _FileUpload:
        return _S3Upload(self, name) if self._is_s3 else _FileUpload(self, name)

    def upload_file(self, local_path: str | os.PathLike[str], name: str) -> tuple[int, str]:
        """Stream a local file into object ``name``; returns (size, xxh3_128 hex).

        The file is read (with aiofiles, off the event loop) straight into the writer's part
        buffers, so its bytes are copied once on the way to the network.
        """
        w = self.open_writer(name)
        try:
            size = os.stat(local_path).st_size
            f = self._run(_aio_open(local_path))
            try:
                done = 0
                while done < size:
                    space = w._free_space()
                    n = self._run(_aio_readinto(f, space[: size - done]))
                    if not n:
                        raise RemoteError(
                            f"{local_path} shrank to {done} bytes while it was uploaded "
                            f"(it had {size})",
                            url=self.url,
                            name=name,
                            op="upload_file",
                        )
                    w._advance(n)
                    done += n
            finally:
                self._run(_aio_close(f), internal=True)
            return w.close()
        except BaseException:
            w.abort()
            raise

    def put_bytes(self, name: str, data: bytes) -> None:
        """Write a whole object in one request: how manifests are committed, because one PUT
        is atomic on S3 (and a rename is, elsewhere)."""
        check_name(name)
        upload = self._new_upload(name)
        buf = bytes(data)
        try:
            self._run(upload.put(buf, len(buf)))
        except BaseException:
            with contextlib.suppress(Exception):
                self._run(upload.abort(), internal=True)
            raise

    # -- reading ----------------------------------------------------------------------------
    def read_bytes(self, name: str) -> bytes:
        """The whole object."""
        check_name(name)
        return self._run(self._retry("get", name, lambda: self._call("cat_file", self._path(name))))

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        """Exactly ``length`` bytes at ``offset``; RemoteError if the object is shorter."""
        check_name(name)
        return self._run(self._read_range(name, offset, length))

    def read_ranges(self, requests: list[tuple[str, int, int]]) -> list[bytes]:
        """Many (name, offset, length) ranges, up to ``max_inflight`` at once, in order."""
        for name, _, _ in requests:
            check_name(name)
        return self._run(self._bounded(self._read_range(*r) for r in requests))

    async def _read_range(self, name: str, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0:
            raise ValueError(f"bad range of {name!r}: offset {offset}, length {length}")
        if length == 0:
            return b""
        path = self._path(name)
        data = await self._retry(
            "get",
            name,
            lambda: self._call("cat_file", path, start=offset, end=offset + length),
        )
        if len(data) != length:
            raise RemoteError(
                f"short read: {len(data)} of {length} bytes at offset {offset}",
                url=self.url,
                name=name,
                op="get",
            )
        return bytes(data)

    def size(self, name: str) -> int | None:
        """The object's size, None if there is no such object."""
        check_name(name)
        return self._run(self._size(name))

    async def _size(self, name: str) -> int | None:
        try:
            info = await self._retry("info", name, lambda: self._call("info", self._path(name)))
        except RemoteError as e:
            if e.errno == errno.ENOENT:
                return None
            raise
        return int(info["size"]) if info.get("type") == "file" else None

    def list(self, prefix: str = "") -> list[str]:
        """Names of every object that is ``prefix`` or lies under ``prefix/``, recursively,
        sorted. Objects whose names break the naming rule (such as the hidden temporary
        files of uploads in progress) are left out."""
        if prefix:
            check_name(prefix.rstrip("/"), what="prefix")
        return self._run(self._list(prefix.rstrip("/")))

    async def _list(self, prefix: str) -> list[str]:
        base = self._path(prefix) if prefix else self._root
        try:
            paths = await self._retry("list", prefix or None, lambda: self._call("find", base))
        except RemoteError as e:
            if e.errno == errno.ENOENT:
                return []
            raise
        names = []
        for p in paths:
            if p.startswith(self._root + "/"):
                name = p[len(self._root) + 1 :]
                with contextlib.suppress(ValueError):
                    names.append(check_name(name))
        return sorted(names)

    def delete(self, names: list[str]) -> None:
        """Delete objects; a missing one is not an error."""
        for name in names:
            check_name(name)
        self._run(self._bounded(self._delete_one(n) for n in names))

    async def _delete_one(self, name: str) -> None:
        try:
            await self._retry("delete", name, lambda: self._call("rm_file", self._path(name)))
        except RemoteError as e:
            if e.errno != errno.ENOENT:
                raise

    # -- shutting down ----------------------------------------------------------------------
    def close(self) -> None:
        """Abort writers still open, close connections and stop the loop thread. Idempotent;
        later calls on the tier raise RemoteError."""
        with self._state_lock:
            if self._closing:
                return
            self._closing = True
        for w in list(self._writers):
            try:
                w.abort()
            except Exception as e:  # closing goes on; the writer's owner sees its own error
                log.warning("aborting the upload of %s on close: %s", self._where(w.name), e)
        with self._state_lock:
            self._stopping = True
            fut = self._loop.submit(self._shutdown())
        try:
            fut.result()
        finally:
            self._loop.stop()

    async def _shutdown(self) -> None:
        me = asyncio.current_task()
        others = [t for t in asyncio.all_tasks() if t is not me]
        for t in others:
            t.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        creator = getattr(self._fs, "_s3creator", None)
        if creator is not None:
            with contextlib.suppress(Exception):
                await creator.__aexit__(None, None, None)
        loop = asyncio.get_running_loop()
        await loop.shutdown_asyncgens()
        await loop.shutdown_default_executor()


# -- uploads --------------------------------------------------------------------------------


class _S3Upload:
    """One object's way onto S3: a single PUT, or a multipart upload started by the first
    part (so an object of one part costs one request)."""

    def __init__(self, tier: RemoteTier, name: str) -> None:
        self.tier = tier
        self.name = name
        self.bucket, self.key, _ = tier._fs.split_path(tier._path(name))
        self.upload_id: str | None = None
        self.etags: dict[int, str] = {}
        self.stopping = False
        self._start_lock = asyncio.Lock()

    def _stop(self) -> bool:
        return self.stopping

    async def _s3(self, op: str, **kwargs: Any) -> Any:
        call = self.tier._fs._call_s3
        return await self.tier._retry(
            op,
            self.name,
            lambda: call(op, Bucket=self.bucket, Key=self.key, **kwargs),
            stop=self._stop,
        )

    async def put(self, buf: bytes | bytearray, length: int) -> None:
        # A fresh reader per attempt: a failed attempt may have consumed part of the body.
        call = self.tier._fs._call_s3
        await self.tier._retry(
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
        call = self.tier._fs._call_s3
        response = await self.tier._retry(
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
            info = await self.tier._call("info", self.tier._path(self.name))
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
                    self.tier._where(self.name),
                    e,
                )
                raise
        finally:
            self.stopping = True


class _FileUpload:
    """One object's way onto a file system (file://, memory://, any fsspec one without S3's
    multipart API): parts are written in order to a hidden temporary name in the same
    directory, renamed into place on close, so a partial object is never visible.

    Writes to an open file are not retried (a failed write leaves the file at an unknown
    length); opening, renaming and removing are.
    """

    def __init__(self, tier: RemoteTier, name: str) -> None:
        self.tier = tier
        self.name = name
        self.path = tier._path(name)
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
                        url=self.tier.url,
                        name=self.name,
                        op="write",
                    )
                if self._file is None:
                    self._file = await self.tier._retry(
                        "open", self.name, lambda: asyncio.to_thread(self._open)
                    )
                await self.tier._retry(
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
        return self.tier._fs.open(self.tmp, "wb")

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
            self._file = await self.tier._retry(
                "open", self.name, lambda: asyncio.to_thread(self._open)
            )
        await self.tier._retry(
            "close",
            self.name,
            lambda: asyncio.to_thread(self._close_file, sync=True),
            idempotent=False,
        )
        await self.tier._retry(
            "rename", self.name, lambda: self.tier._call("mv", self.tmp, self.path)
        )

    async def abort(self) -> None:
        self.stopping = True
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self._close_file, sync=False)
        if self._file is None:
            return
        try:
            await self.tier._retry(
                "delete", self.name, lambda: self.tier._call("rm_file", self.tmp)
            )
        except RemoteError as e:
            if e.errno != errno.ENOENT:
                raise


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

    def __init__(self, tier: RemoteTier, name: str) -> None:
        self._tier = tier
        self.name = name
        self._upload = tier._new_upload(name)
        self._part_bytes = tier.part_bytes
        self._hash = xxhash.xxh3_128()
        self._size = 0
        self._buf: bytearray | None = None
        self._fill = 0
        self._free: list[bytearray] = []
        self._slots = threading.Semaphore(tier.max_inflight)
        self._parts: list[concurrent.futures.Future[None]] = []
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._state = "open"  # open | closed | failed | aborted
        self._result: tuple[int, str] | None = None

    def __repr__(self) -> str:
        return f"ObjectWriter({self._tier._where(self.name)!r}, {self._state})"

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

    def _free_space(self) -> memoryview:
        """The unfilled end of the current part buffer, for upload_file to read into."""
        with self._lock:
            self._check_open()
            return self._free_space_locked()

    def _advance(self, n: int) -> None:
        """Account for ``n`` bytes put into the space _free_space() returned."""
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
        if self._tier._is_s3 and number > S3_MAX_PARTS:
            self._fail(
                RemoteError(
                    f"the object needs more than {S3_MAX_PARTS} parts of {self._part_bytes} "
                    "bytes: raise part_bytes",
                    url=self._tier.url,
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
            fut = self._tier._submit(self._upload.part(number, buf, length), internal=True)
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
            tier = self._tier
            try:
                if not self._parts:  # it fits in one part: a single request
                    buf = self._buf if self._buf is not None else bytearray()
                    tier._run(self._upload.put(buf, self._fill), internal=True)
                else:
                    if self._fill:
                        self._submit_part()
                    concurrent.futures.wait(self._parts)
                    if self._error is not None:
                        self._fail()
                    tier._run(self._upload.complete(), internal=True)
            except BaseException as e:
                if self._state == "failed":  # _fail() already aborted the upload
                    raise
                self._fail(e)
            try:
                size = tier._run(tier._size(self.name), internal=True)
                if size != self._size:
                    raise RemoteError(
                        f"uploaded object has {size} bytes, {self._size} were written",
                        url=tier.url,
                        name=self.name,
                        op="verify",
                    )
            except BaseException as e:
                # The object is visible and wrong (or unverifiable): take it away.
                with contextlib.suppress(Exception):
                    tier._run(tier._delete_one(self.name), internal=True)
                self._state = "failed"
                self._release_buffers()
                if isinstance(e, RemoteError):
                    raise
                raise RemoteError(
                    f"verify failed: {e}", url=tier.url, name=self.name, op="verify"
                ) from e
            self._state = "closed"
            self._release_buffers()
            self._result = (self._size, self._hash.hexdigest())
            tier._writers.discard(self)
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
                "this upload failed earlier", url=self._tier.url, name=self.name, op="write"
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
            url=self._tier.url,
            name=self.name,
            op="upload",
        ) from error

    def _settle_and_abort(self) -> None:
        # Parts in flight stop at their next attempt; wait for them so that the abort is the
        # last request of this upload and nothing lands after it.
        self._upload.stopping = True
        concurrent.futures.wait(self._parts)
        try:
            self._tier._run(self._upload.abort(), internal=True)
        except Exception as e:
            log.warning("abort of the upload of %s failed: %s", self._tier._where(self.name), e)
        finally:
            self._release_buffers()
            self._tier._writers.discard(self)

    def _release_buffers(self) -> None:
        self._buf = None
        self._fill = 0
        self._free.clear()
