"""snapcore's exception classes: one per failure family, all re-exported by the package.

The native extension raises these too (its binding maps C++ exceptions onto them), so a
caller never needs to know which half of snapcore failed.
"""

from __future__ import annotations

import errno


class SnapcoreError(Exception):
    """Base class of every error snapcore raises on purpose."""


class SnapshotNotFound(SnapcoreError, LookupError):
    """No committed snapshot matches the request (empty store, or no such step)."""


class CorruptSnapshot(SnapcoreError):
    """Data of a committed snapshot does not match its manifest (hash, size, truncation).

    Attributes name what is damaged so an operator can act on it.
    """

    def __init__(
        self,
        message: str,
        *,
        step: int | None = None,
        tensor: str | None = None,
        chunk: int | None = None,
        file: str | None = None,
    ) -> None:
        super().__init__(message)
        self.step = step
        self.tensor = tensor
        self.chunk = chunk
        self.file = file


class InvalidManifest(CorruptSnapshot):
    """A manifest is not valid JSON, fails the schema, or points outside its store."""


class UnsafeCheckpoint(InvalidManifest):
    """A foreign checkpoint (DCP's ``.metadata``, a ``torch.save`` file) could only be read
    by running code it names: a pickled global outside snapcore's allow-list, or a payload
    ``torch.load(weights_only=True)`` refuses. snapcore refuses it and runs nothing
    (docs/security.md). ``file`` names the file; ``name`` the refused global, when known.
    """

    def __init__(self, message: str, *, file: str, name: str | None = None) -> None:
        super().__init__(message, file=file)
        self.name = name


class UnsupportedState(SnapcoreError, TypeError):
    """A leaf of the state tree is of a type snapcore refuses to save (it never pickles)."""

    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(message)
        self.path = path


class StateMismatch(SnapcoreError, ValueError):
    """The state given to restore() cannot take the snapshot (missing key, shape, dtype)."""


class SnapshotFailed(SnapcoreError):
    """A background snapshot failed; raised by handle.wait() and by the next save.

    The original error is chained as ``__cause__``.
    """

    def __init__(self, message: str, *, step: int | None = None, tier: str | None = None):
        super().__init__(message)
        self.step = step
        self.tier = tier


class NativeError(SnapcoreError, RuntimeError):
    """An error inside the native extension that is not an I/O error."""


class CudaError(NativeError):
    """A CUDA driver call failed, or CUDA is needed and unavailable."""


class StorageError(SnapcoreError, OSError):
    """An I/O error while writing or reading a store; keeps errno and the file name."""


class RemoteError(StorageError):
    """A request to the remote tier failed for good: after its retries, or at once when the
    error cannot go away by retrying (not found, access denied, bad request).

    ``url`` is the tier's URL, ``name`` the object (None for the tier as a whole) and ``op``
    the request that failed. ``errno`` is ENOENT or EACCES when the store answered
    not-found or denied, the cause's errno where it has one, EIO otherwise. The last
    underlying error is chained as ``__cause__``.
    """

    def __init__(
        self,
        message: str,
        *,
        url: str,
        name: str | None = None,
        op: str | None = None,
        code: int = errno.EIO,
    ) -> None:
        super().__init__(code, message, url if name is None else f"{url}/{name}")
        self.url = url
        self.name = name
        self.op = op


class StoreInUse(StorageError):
    """Another live process saves to the same store: its writer lock is held.

    ``pid`` and ``host`` name that process when its lock file says (else ``None``).
    """

    def __init__(
        self, message: str, *, path: str, pid: int | None = None, host: str | None = None
    ) -> None:
        super().__init__(errno.EBUSY, message, path)
        self.message = message
        self.pid = pid
        self.host = host

    def __str__(self) -> str:
        return self.message


__all__ = [
    "CorruptSnapshot",
    "CudaError",
    "InvalidManifest",
    "NativeError",
    "RemoteError",
    "SnapcoreError",
    "SnapshotFailed",
    "SnapshotNotFound",
    "StateMismatch",
    "StorageError",
    "StoreInUse",
    "UnsafeCheckpoint",
    "UnsupportedState",
]
