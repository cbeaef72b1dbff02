"""Dotted names to and from nested dicts, and the atomic file commit the torch and DCP
formats share."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..durable import fsync_dir
from ..errors import UnsupportedState

log = logging.getLogger("snapcore.convert")

PLAIN = (str, int, float, bool, type(None))


def flatten(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Leaves of nested dicts, lists and tuples, by dotted path (list items by index).
    Leaves are yielded as they are (tensors, plain values or anything else: the caller
    decides what to keep)."""
    if isinstance(obj, dict):
        items: Any = ((str(k), v) for k, v in obj.items())
    elif type(obj) in (list, tuple):
        items = ((str(i), v) for i, v in enumerate(obj))
    else:
        yield prefix, obj
        return
    for key, value in items:
        yield from flatten(value, f"{prefix}.{key}" if prefix else key)


def unflatten(leaves: dict[str, Any]) -> dict[str, Any]:
    """The nested dict of string keys whose dotted paths are ``leaves``' names.

    Raises UnsupportedState when one name is a prefix of another (``a`` and ``a.b``):
    no nested dict holds both."""
    root: dict[str, Any] = {}
    for name, value in leaves.items():
        parts = name.split(".")
        node = root
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                prefix = ".".join(parts[: i + 1])
                raise UnsupportedState(
                    f"{name!r} and {prefix!r} cannot both be keys of a nested state dict",
                    path=name,
                )
            node = child
        if parts[-1] in node:
            raise UnsupportedState(
                f"{name!r} is both a leaf and a prefix of other names", path=name
            )
        node[parts[-1]] = value
    return root


def plain_values(name: str, obj: Any, where: str) -> dict[str, Any]:
    """The plain values (int, float, str, bool, None) in ``obj`` by dotted path; anything
    else is skipped with a warning naming it."""
    out: dict[str, Any] = {}
    for path, leaf in flatten(obj, name):
        if isinstance(leaf, PLAIN):
            out[path] = leaf
        elif isinstance(leaf, torch.Tensor):  # a tensor inside a non-tensor entry
            log.warning("%s: skipping %r: a tensor inside a non-tensor entry", where, path)
        else:
            log.warning(
                "%s: skipping %r: a %s is not a plain value (int, float, str, bool, None)",
                where,
                path,
                type(leaf).__name__,
            )
    return out


def temp_name(target: Path) -> Path:
    """A temporary name beside ``target``, in the same directory (so the rename is atomic)."""
    return target.with_name(f".{target.name}.tmp-{os.getpid()}")


def commit_rename(tmp: Path, target: Path) -> None:
    """Move the fsynced ``tmp`` onto ``target`` and fsync the parent directory. A directory
    replaces only an absent or empty one (rename(2) refuses a full one)."""
    os.replace(tmp, target)
    fsync_dir(target.parent)
