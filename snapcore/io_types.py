"""The types the stages pass each other: staging -> persist -> upload.

A leaf module, like torchsnapshot's io_types.py: every stage imports it and it imports
none of them, so no stage needs another's module for a type.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import SnapcoreError

if TYPE_CHECKING:
    import torch

    from .staging.arena import HostArena

# A chunk's content address within a tier, and where that tier stores it.
ChunkKey = tuple[str, int, str]  # (xxh3, raw_length, codec)


@dataclass(frozen=True)
class Location:
    name: str  # file, relative to the tier root
    offset: int
    length: int
    file_size: int


@dataclass
class Window:
    """A byte range [start, end) of the snapshot image, staged at ``arena_offset``."""

    arena: HostArena
    start: int
    end: int
    arena_offset: int
    half: int
    deferred: list[Callable[[], None]] = field(default_factory=list)  # CPU copies run later
    pending: list[Future[None]] = field(default_factory=list)  # copies running (overlap)
    events: list[Any] = field(default_factory=list)  # CUDA events to wait for before reading
    keep: list[torch.Tensor] = field(default_factory=list)  # alive until the copies ran


class StagingAborted(SnapcoreError):
    """The persist side of a snapshot whose staging raised (to the caller of the save)."""


@dataclass
class Aborted:
    """Put in the window queue when staging failed: nothing may be committed."""

    error: BaseException


# What the staging side puts in a snapshot's window queue: a staged window, the end of
# the snapshot (None), or Aborted.
WindowItem = Window | Aborted | None
