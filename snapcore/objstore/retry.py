"""Which failures of an object-store request are worth a retry, and the retry loop itself:
exponential backoff with jitter, each retry logged, a final failure raised as RemoteError.

The retries of botocore and s3fs underneath are switched off (snapcore.objstore.connection),
so that this one policy applies.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import http.client
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from ..errors import RemoteError

log = logging.getLogger(__name__)

T = TypeVar("T")

MAX_BACKOFF_S = 30.0

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


def errno_of(exc: BaseException) -> int:
    """The errno a RemoteError carries: the cause's own (ENOENT, EACCES, ENOSPC on a file
    system, ECONNREFUSED), EIO where the cause has none."""
    if isinstance(exc, FileNotFoundError):
        return errno.ENOENT
    if isinstance(exc, PermissionError):
        return errno.EACCES
    if isinstance(exc, OSError) and exc.errno:
        return int(exc.errno)
    return errno.EIO


def where(url: str, name: str | None) -> str:
    """The address of object ``name`` under ``url`` (the tier itself for None)."""
    return url if name is None else f"{url}/{name}"


@dataclass(frozen=True)
class RetryPolicy:
    """Requests to the tier at ``url``: ``retries`` retries after a transient error (so
    ``retries + 1`` attempts at most), the wait before retry k ``backoff_s * 2**k`` (capped
    at MAX_BACKOFF_S) times a random factor in [0.5, 1)."""

    url: str
    retries: int
    backoff_s: float

    async def run(
        self,
        op: str,
        name: str | None,
        fn: Callable[[], Awaitable[T]],
        *,
        stop: Callable[[], bool] | None = None,
        idempotent: bool = True,
    ) -> T:
        """``fn()`` until it succeeds, fails for good, or ``retries`` retries are spent.

        ``stop()`` true abandons the request before its next attempt; a request that is
        not ``idempotent`` is never retried. A RemoteError from ``fn`` passes unchanged.
        """
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
                        code=errno_of(e),
                    ) from e
                delay = min(self.backoff_s * 2**attempt, MAX_BACKOFF_S) * random.uniform(0.5, 1)
                attempt += 1
                log.warning(
                    "remote %s of %s failed (%s: %s); retry %d of %d in %.2f s",
                    op,
                    where(self.url, name),
                    type(e).__name__,
                    e,
                    attempt,
                    self.retries,
                    delay,
                )
                await asyncio.sleep(delay)
