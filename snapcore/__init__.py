"""snapcore: fast, safe, asynchronous checkpointing for PyTorch training."""

from __future__ import annotations

from .api import (
    HostAreaInfo,
    async_save,
    close,
    committed,
    free_host,
    host_areas,
    load,
    prepare,
    restore,
    save,
    wait_all,
)
from .errors import (
    CorruptSnapshot,
    CudaError,
    InvalidManifest,
    NativeError,
    RemoteError,
    SnapcoreError,
    SnapshotFailed,
    SnapshotNotFound,
    StateMismatch,
    StorageError,
    StoreInUse,
    UnsafeCheckpoint,
    UnsupportedState,
)
from .read import RestoreInfo
from .rng import RNGState
from .scheduling.checkpointer import Checkpointer
from .staging.handle import SaveHandle, SaveStats
from .tiers import PeerSpec, Retention, Store

__version__ = "0.1.0"

__all__ = [
    "Checkpointer",
    "CorruptSnapshot",
    "CudaError",
    "HostAreaInfo",
    "InvalidManifest",
    "NativeError",
    "PeerSpec",
    "RNGState",
    "RemoteError",
    "RestoreInfo",
    "Retention",
    "SaveHandle",
    "SaveStats",
    "SnapcoreError",
    "SnapshotFailed",
    "SnapshotNotFound",
    "StateMismatch",
    "StorageError",
    "Store",
    "StoreInUse",
    "UnsafeCheckpoint",
    "UnsupportedState",
    "async_save",
    "close",
    "committed",
    "free_host",
    "host_areas",
    "load",
    "prepare",
    "restore",
    "save",
    "wait_all",
]
