"""``snapcore convert``: snapshots to and from safetensors, DCP and torch.save files,
streaming tensor by tensor (docs/cli.md). The contract every format implements is in
``base.py``; each format is a module that registers itself."""

from __future__ import annotations

from . import dcp, safetensors_fmt, snapcore_fmt, torch_file  # each registers its format
from .base import FORMATS, Format, Sink, Source, TensorInfo, Value
from .run import ConvertStats, convert

__all__ = [
    "FORMATS",
    "ConvertStats",
    "Format",
    "Sink",
    "Source",
    "TensorInfo",
    "Value",
    "convert",
    "dcp",
    "safetensors_fmt",
    "snapcore_fmt",
    "torch_file",
]
