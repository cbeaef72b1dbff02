"""Format ``torch``: a file written by ``torch.save`` (docs/security.md).

Read only with ``torch.load(path, weights_only=True, mmap=True)``: torch's restricted
unpickler, which rebuilds tensors, containers and plain values and refuses every other
global. snapcore never falls back to a full unpickling: a file that ``weights_only``
refuses raises ``UnsafeCheckpoint`` naming the file (and the global, when torch names it).
``mmap=True`` (files in torch's zip format, the default since torch 1.6) keeps the
tensors on disk until they are read, so memory stays bounded by the tensor being
converted; a legacy (non-zip) file is loaded whole.

Nested dicts, lists and tuples are flattened into dotted names (``optim.param_groups.0.lr``);
tensors are tensors, int/float/str/bool/None are values, anything else (a ``torch.Size``,
``bytes``...) is skipped with a warning naming it.

Writing holds every tensor until ``commit``: ``torch.save`` takes the whole nested dict at
once, so the sink's memory is the checkpoint's size (not bounded, unlike the other
formats). The file is written under a temporary name beside the target, fsynced and
renamed. The provenance metadata has no place in a ``torch.save`` file and is dropped.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..errors import UnsafeCheckpoint
from . import _nested
from .base import Format, TensorInfo, Value, register

__all__ = ["TorchSink", "TorchSource", "detect"]

_ZIP_MAGIC = b"PK\x03\x04"


def detect(path: Path) -> bool:
    """A regular file in torch's zip format, or a legacy pickle (protocol 2 to 5), that
    is not a safetensors file (an 8-byte header length followed by ``{``)."""
    try:
        if not path.is_file():
            return False
        with open(path, "rb") as f:
            head = f.read(9)
    except OSError:
        return False
    if head[:4] == _ZIP_MAGIC:
        return True
    is_pickle = len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5
    return is_pickle and head[8:9] != b"{"


def _refused_global(message: str) -> str | None:
    m = re.search(r"GLOBAL ([\w.]+)", message) or re.search(r"global ([\w.]+)", message)
    return m.group(1) if m else None


def load_weights_only(path: Path) -> Any:
    """``torch.load(path, weights_only=True)``, with ``mmap=True`` where the file allows it;
    a refused payload raises UnsafeCheckpoint naming the file."""
    mmap = False
    with contextlib.suppress(OSError), open(path, "rb") as f:
        mmap = f.read(4) == _ZIP_MAGIC
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:  # weights_only refused a global: nothing ran
        name = _refused_global(str(e))
        what = f"the global {name}" if name else "an object"
        raise UnsafeCheckpoint(
            f"{path}: refused: reading it would unpickle {what}, which "
            "torch.load(weights_only=True) does not allow; unpickling it could run code, "
            "and snapcore never loads a torch file unrestricted (docs/security.md)",
            file=str(path),
            name=name,
        ) from None
    except (RuntimeError, EOFError, ValueError) as e:
        raise UnsafeCheckpoint(
            f"{path}: not a readable torch.save file: {e}", file=str(path)
        ) from e


class TorchSource:
    def __init__(self, path: Path, options: dict[str, Any] | None = None) -> None:
        self.path = Path(path)
        obj = load_weights_only(self.path)
        if isinstance(obj, torch.Tensor):
            obj = {"tensor": obj}  # a bare tensor gets a name
        self._tensors: dict[str, torch.Tensor] = {}
        self._values: dict[str, Value] = {}
        for name, leaf in _nested.flatten(obj):
            if isinstance(leaf, torch.Tensor):
                if leaf.layout != torch.strided:
                    _nested.log.warning(
                        "%s: skipping %r: a %s tensor", self.path, name, leaf.layout
                    )
                    continue
                self._tensors[name] = leaf
            else:
                self._values.update(_nested.plain_values(name, leaf, str(self.path)))

    def tensors(self) -> Iterator[TensorInfo]:
        for name, t in self._tensors.items():
            yield TensorInfo(name, t.dtype, tuple(t.shape))

    def read(self, info: TensorInfo) -> torch.Tensor:
        return self._tensors[info.name].detach().contiguous()

    def values(self) -> dict[str, Value]:
        return dict(self._values)

    def metadata(self) -> dict[str, str]:
        return {"format": "torch", "source": str(self.path)}

    def close(self) -> None:
        self._tensors.clear()


class TorchSink(_nested.WholeStateSink):
    """Collects the tensors and writes one ``torch.save`` file at ``commit`` (memory: the
    whole checkpoint, see the module's docstring)."""

    def _write(self, state: dict[str, Any], tmp: Path) -> None:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())


FORMAT = register(
    Format(
        name="torch",
        detect=detect,
        source=lambda path, options: TorchSource(path, options),
        sink=lambda path, options: TorchSink(path, options),
    )
)
