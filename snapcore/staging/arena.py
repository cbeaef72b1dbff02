"""The host arena: staging memory allocated, pinned and faulted once, then reused."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .. import _native, settings


class HostArena:
    """A native arena plus a byte view of it that torch and xxhash can use."""

    def __init__(self, size: int, shm_path: Path | None = None) -> None:
        self.native = _native.Arena(
            size,
            shm_path=str(shm_path) if shm_path else None,
            huge_pages=settings.huge_pages(),
            pin=True,
            prefault=True,
            threads=settings.threads(),
        )
        self.size = size
        self.address = self.native.address
        self._buf = (ctypes.c_char * size).from_address(self.address)
        self.u8 = torch.frombuffer(self._buf, dtype=torch.uint8)

    def view(self, offset: int, nbytes: int) -> memoryview:
        return memoryview(self._buf).cast("B")[offset : offset + nbytes]

    def close(self) -> None:
        self.u8 = torch.empty(0, dtype=torch.uint8)
        self.native.close()
