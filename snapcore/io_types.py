"""The types the stages pass each other: staging -> persist -> upload.

A leaf module, like torchsnapshot's io_types.py: every stage imports it and it imports
none of them, so no stage needs another's module for a type.
"""

from __future__ import annotations

import threading
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


class Progress:
    """How far the call has staged a whole image that the persist side reads while it is
    being staged (the pipelined whole mode): bytes [0, ``upto``) of the image are in the
    arena for good. ``fail`` wakes every waiter with the staging's error."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.upto = 0
        self.ended = False  # every byte staged and the call's staging returned
        self.error: BaseException | None = None

    def advance(self, upto: int) -> None:
        with self._cond:
            self.upto = upto
            self._cond.notify_all()

    def end(self) -> None:
        with self._cond:
            self.ended = True
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            self.error = error
            self._cond.notify_all()

    def wait_for(self, end: int) -> None:
        """Block until bytes [0, ``end``) of the image are staged; raise
        ``StagingAborted`` if staging failed."""
        with self._cond:
            while self.error is None and self.upto < end:
                self._cond.wait()
            if self.error is not None:
                raise StagingAborted("staging was interrupted") from self.error

    def wait_end(self) -> None:
        """Block until staging has ended; raise ``StagingAborted`` if it failed."""
        with self._cond:
            while self.error is None and not self.ended:
                self._cond.wait()
            if self.error is not None:
                raise StagingAborted("staging was interrupted") from self.error


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
    # The pipelined whole mode: the window is handed over before it is staged, and this
    # says how far staging has got (the persist side reads nothing beyond it).
    progress: Progress | None = None


class StagingAborted(SnapcoreError):
    """The persist side of a snapshot whose staging raised (to the caller of the save)."""


@dataclass
class Aborted:
    """Put in the window queue when staging failed: nothing may be committed."""

    error: BaseException


# What the staging side puts in a snapshot's window queue: a staged window, the end of
# the snapshot (None), or Aborted.
WindowItem = Window | Aborted | None
