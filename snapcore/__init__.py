"""snapcore: fast, safe, asynchronous checkpointing for PyTorch training."""

from __future__ import annotations

from .api import async_save, load, restore, save
from .engine import SaveHandle, SaveStats
from .errors import (
    CorruptSnapshot,
    CudaError,
    InvalidManifest,
    NativeError,
    SnapcoreError,
    SnapshotFailed,
    SnapshotNotFound,
    StateMismatch,
    StorageError,
    UnsupportedState,
)
from .read import RestoreInfo

__version__ = "0.1.0"

__all__ = [
    "CorruptSnapshot",
    "CudaError",
    "InvalidManifest",
    "NativeError",
    "RestoreInfo",
    "SaveHandle",
    "SaveStats",
    "SnapcoreError",
    "SnapshotFailed",
    "SnapshotNotFound",
    "StateMismatch",
    "StorageError",
    "UnsupportedState",
    "async_save",
    "load",
    "restore",
    "save",
]
