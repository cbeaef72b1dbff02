"""``snapcore convert``: snapshots to and from safetensors, DCP and torch.save files,
streaming tensor by tensor (docs/cli.md). The contract every format implements is in
``base.py``; each format is a module that registers itself."""

from __future__ import annotations

from . import dcp, torch_file  # noqa: F401  (each registers its format)
from .base import FORMATS, Format, Sink, Source, TensorInfo, Value

__all__ = ["FORMATS", "Format", "Sink", "Source", "TensorInfo", "Value"]
