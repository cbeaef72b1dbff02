"""The ``snapcore`` command: one module per verb, sharing the store arguments and the
output helpers (docs/cli.md). Verbs open a store's tiers for reading only: no engine,
arena or thread is made to list, inspect or verify."""

from __future__ import annotations

from .main import build_parser, main
from .output import human_bytes

__all__ = ["build_parser", "human_bytes", "main"]
