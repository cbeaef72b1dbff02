"""The contract every format of ``snapcore convert`` implements (docs/cli.md, "convert").

A conversion streams: a ``Source`` lists its tensors (name, dtype, shape) without
reading them and reads one at a time; a ``Sink`` takes them one at a time and makes the
target visible only at ``commit`` (temporary names, fsync, rename), so an interrupted
conversion leaves nothing that looks complete. Memory stays bounded by the largest
tensor plus the formats' own buffers, whatever the checkpoint's size.

Names are dotted paths of the state (``model.layers.0.weight``, ``optim.state.0.exp_avg``).
Non-tensor values (ints, floats, strings, bools, None) travel separately as
``values``: a dict from dotted path to value. Nothing here pickles; a format that must
read a pickle (DCP's ``.metadata``, a ``torch.save`` file) does so only through an
allow-list (docs/security.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

__all__ = ["FORMATS", "Format", "Sink", "Source", "TensorInfo", "Value"]

Value = str | int | float | bool | None


@dataclass(frozen=True)
class TensorInfo:
    """A tensor of a checkpoint, before it is read."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class Source(Protocol):
    """A checkpoint read tensor by tensor."""

    def tensors(self) -> Iterator[TensorInfo]:
        """Every tensor, in a stable order (the checkpoint's own), without reading any."""
        ...

    def read(self, info: TensorInfo) -> torch.Tensor:
        """The whole tensor, on the CPU, contiguous, with ``info``'s dtype and shape.
        Called once per tensor; the caller drops it before the next."""
        ...

    def values(self) -> dict[str, Value]:
        """The non-tensor values, by dotted path."""
        ...

    def metadata(self) -> dict[str, str]:
        """Provenance (the source format, step, writer...), strings only."""
        ...

    def close(self) -> None: ...


class Sink(Protocol):
    """A checkpoint written tensor by tensor; visible only once committed."""

    def write(self, info: TensorInfo, tensor: torch.Tensor) -> None:
        """Add one tensor (CPU, contiguous, ``info``'s dtype and shape)."""
        ...

    def write_values(self, values: dict[str, Value]) -> None:
        """Add the non-tensor values (called once, before ``commit``)."""
        ...

    def commit(self, metadata: dict[str, str]) -> None:
        """Make the target complete and visible, atomically (fsync, rename)."""
        ...

    def abort(self) -> None:
        """Remove whatever was written; the target is as it was before."""
        ...


@dataclass(frozen=True)
class Format:
    """A format ``snapcore convert`` reads and writes.

    ``detect(path)``: whether ``path`` looks like this format (for ``--from`` left out);
    ``source(path, options)`` and ``sink(path, options)`` open it; ``options`` carries
    the command's format options (``step``, ``shard_size``, ``storage_options``...).
    """

    name: str
    detect: Callable[[Path], bool]
    source: Callable[[Path, dict[str, Any]], Source]
    sink: Callable[[Path, dict[str, Any]], Sink]


# name -> Format; each format module registers itself (snapcore/convert/__init__.py
# imports them).
FORMATS: dict[str, Format] = {}


def register(fmt: Format) -> Format:
    if fmt.name in FORMATS:
        raise ValueError(f"format {fmt.name!r} is registered twice")
    FORMATS[fmt.name] = fmt
    return fmt
