"""The host arena: staging memory allocated, pinned and faulted once, then reused."""

from __future__ import annotations

import ctypes
import warnings
from collections.abc import Iterable
from pathlib import Path

import torch

from .. import _native, settings
from ..errors import SnapcoreError


def pin_device(devices: Iterable[torch.device]) -> int | None:
    """The CUDA device whose primary context pins an arena for tensors on ``devices``: the
    first CUDA tensor's (the current device for one with no index); None when there is no
    CUDA tensor, and then nothing is pinned."""
    for d in devices:
        if d.type == "cuda":
            return d.index if d.index is not None else torch.cuda.current_device()
    return None


def numa_node(device: int | None) -> int:
    """The NUMA node of CUDA device ``device`` (sysfs, through the driver's PCI bus id), where
    an arena pinned for it should live: its copies then cross no socket link. -1 when there
    is no device, CUDA is unavailable, or the machine has one node."""
    if device is None or not _native.cuda_available():
        return -1
    try:
        return _native.cuda_device_numa_node(device)
    except (SnapcoreError, ValueError):
        return -1


class HostArena:
    """A native arena plus a byte view of it that torch and xxhash can use.

    ``device`` is the CUDA device the state lives on (see ``pin_device``): the arena is
    pinned in its primary context (portable, so copies from other devices are pinned too),
    and not pinned at all when it is None.
    """

    def __init__(
        self,
        size: int,
        shm_path: Path | None = None,
        device: int | None = None,
        *,
        threads: int | None = None,
    ) -> None:
        self.native = _native.Arena(
            size,
            shm_path=str(shm_path) if shm_path else None,
            huge_pages=settings.huge_pages(),
            pin=device is not None,
            device=device or 0,
            numa_node=numa_node(device),
            prefault=True,
            threads=settings.threads() if threads is None else threads,  # to fault it
        )
        if self.native.pin_error is not None:
            warnings.warn(
                f"the staging arena ({size} bytes) is unpinned: pinning it on CUDA device "
                f"{device} failed ({self.native.pin_error}); copies from the GPU will be "
                "slower",
                RuntimeWarning,
                stacklevel=2,
            )
        self.size = size
        self.device = device  # asked for; self.native.pinned says whether it is pinned
        self.address = self.native.address
        self._buf = (ctypes.c_char * size).from_address(self.address)
        self.u8 = torch.frombuffer(self._buf, dtype=torch.uint8)

    def fits(self, size: int, device: int | None) -> bool:
        """Whether this arena serves a state of ``size`` bytes whose CUDA tensors are on
        ``device``: large enough, and pinned (or asked to be) if the state has CUDA
        tensors. A pinned arena is portable: any device's copies use it."""
        return self.size >= size and (device is None or self.device is not None)

    def view(self, offset: int, nbytes: int) -> memoryview:
        return memoryview(self._buf).cast("B")[offset : offset + nbytes]

    def close(self) -> None:
        self.u8 = torch.empty(0, dtype=torch.uint8)
        self.native.close()
