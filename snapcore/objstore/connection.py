"""One object store as uploads and reads see it: an fsspec file system opened on the
tier's event loop (snapcore.objstore.loop), with the naming rule and the asynchronous
requests (size, ranged read, listing, delete) that every call is made of, each retried
by the tier's policy (snapcore.objstore.retry).

File systems without an async implementation (local, memory) run their blocking calls in
the loop's executor behind the same coroutine calls, so reads, listings and deletes take
one code path.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import fsspec

from .. import settings
from ..errors import RemoteError
from .loop import Loop
from .retry import RetryPolicy, where

T = TypeVar("T")

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


class Connection:
    """The file system under ``url``. Construction only parses the URL (``is_s3`` is then
    known); ``open()`` starts the loop and opens the file system on it, ``close()`` closes
    both."""

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        *,
        retries: int,
        backoff_s: float,
    ) -> None:
        protocol, _ = fsspec.core.split_protocol(url)
        protocol = protocol or "file"
        self._cls = fsspec.get_filesystem_class(protocol)
        self.url = url.rstrip("/")
        self.root = self._cls._strip_protocol(url).rstrip("/")
        self.is_s3 = protocol in ("s3", "s3a")
        if self.is_s3 and not self.root:
            raise ValueError(f"{url!r} names no bucket")
        self.policy = RetryPolicy(self.url, retries, backoff_s)
        options = dict(storage_options or {})
        if self.is_s3:
            # One retry policy, ours: botocore's own would retry (silently) under it.
            config = dict(options.get("config_kwargs") or {})
            config.setdefault("retries", {"total_max_attempts": 1})
            options["config_kwargs"] = config
            # Listings are cached by default, and a cached listing hides new objects.
            options.setdefault("use_listings_cache", False)
        if protocol in ("file", "local"):
            options.setdefault("auto_mkdir", True)
        self._options = options
        self.fs: Any = None
        self.is_async = False
        self.loop: Loop

    def open(self) -> None:
        """Start the loop's thread and open the file system on it."""
        self.loop = Loop(f"snapcore-remote {self.url}", self.url)
        try:
            self.fs = self.loop.submit(self._open_fs()).result()
        except BaseException:
            self.loop.stop()
            raise
        self.is_async = bool(getattr(self.fs, "async_impl", False))

    async def _open_fs(self) -> Any:
        cls = self._cls
        if not getattr(cls, "async_impl", False):
            return cls(skip_instance_cache=True, **self._options)
        fs = cls(
            asynchronous=True,
            loop=asyncio.get_running_loop(),
            skip_instance_cache=True,
            **self._options,
        )
        if self.is_s3:
            fs.retries = 1  # s3fs's own retry loop; ours is outside it
            await fs.set_session()
        return fs

    def close(self) -> None:
        """Cancel the requests in flight, close the connections, stop the loop's thread."""
        self.loop.shutdown(self._close_fs)

    async def _close_fs(self) -> None:
        creator = getattr(self.fs, "_s3creator", None)
        if creator is not None:
            with contextlib.suppress(Exception):
                await creator.__aexit__(None, None, None)

    # -- requests ---------------------------------------------------------------------------
    def path(self, name: str) -> str:
        """The file system's path of object ``name``."""
        return f"{self.root}/{name}"

    def where(self, name: str | None) -> str:
        """The URL of object ``name`` (the tier's for None), for messages."""
        return where(self.url, name)

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """The file system's ``method``: its coroutine where it has one, else the blocking
        call in the loop's executor."""
        if self.is_async:
            return await getattr(self.fs, "_" + method)(*args, **kwargs)
        return await asyncio.to_thread(getattr(self.fs, method), *args, **kwargs)

    async def retry(
        self,
        op: str,
        name: str | None,
        fn: Callable[[], Awaitable[T]],
        *,
        stop: Callable[[], bool] | None = None,
        idempotent: bool = True,
    ) -> T:
        """``fn()`` under the tier's retry policy (RetryPolicy.run), each attempt bounded
        by SNAPCORE_REQUEST_TIMEOUT_S: a server that accepts a request and then neither
        reads nor answers (aiohttp puts no timeout on sending a body) costs an attempt,
        which is retried as a transient failure, never a hang."""
        timeout = settings.request_timeout_s()

        async def attempt() -> T:
            return await asyncio.wait_for(fn(), timeout)

        return await self.policy.run(op, name, attempt, stop=stop, idempotent=idempotent)

    async def read_range(self, name: str, offset: int, length: int) -> bytes:
        """Exactly ``length`` bytes at ``offset``; RemoteError if the object is shorter."""
        if offset < 0 or length < 0:
            raise ValueError(f"bad range of {name!r}: offset {offset}, length {length}")
        if length == 0:
            return b""
        path = self.path(name)
        data = await self.retry(
            "get",
            name,
            lambda: self.call("cat_file", path, start=offset, end=offset + length),
        )
        if len(data) != length:
            raise RemoteError(
                f"short read: {len(data)} of {length} bytes at offset {offset}",
                url=self.url,
                name=name,
                op="get",
            )
        return bytes(data)

    async def size(self, name: str) -> int | None:
        """The object's size, None if there is no such object."""
        try:
            info = await self.retry("info", name, lambda: self.call("info", self.path(name)))
        except RemoteError as e:
            if e.errno == errno.ENOENT:
                return None
            raise
        return int(info["size"]) if info.get("type") == "file" else None

    async def list(self, prefix: str) -> list[str]:
        """Names under ``prefix`` (all for ""), sorted, those breaking the naming rule left
        out."""
        base = self.path(prefix) if prefix else self.root
        try:
            paths = await self.retry("list", prefix or None, lambda: self.call("find", base))
        except RemoteError as e:
            if e.errno == errno.ENOENT:
                return []
            raise
        names = []
        for p in paths:
            if p.startswith(self.root + "/"):
                name = p[len(self.root) + 1 :]
                with contextlib.suppress(ValueError):
                    names.append(check_name(name))
        return sorted(names)

    async def delete(self, name: str) -> None:
        """Delete one object; a missing one is not an error."""
        try:
            await self.retry("delete", name, lambda: self.call("rm_file", self.path(name)))
        except RemoteError as e:
            if e.errno != errno.ENOENT:
                raise
