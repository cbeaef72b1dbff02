"""Format ``safetensors``: one ``.safetensors`` file, or a directory in Hugging Face's
sharded layout (``model-00001-of-0000N.safetensors`` and ``model.safetensors.index.json``
with ``metadata.total_size`` and ``weight_map``). Read and written with the
``safetensors`` library, the format's reference implementation: no header is parsed here.

Source: tensors are read one at a time with ``safe_open`` (a sharded directory through
its index, shard by shard). Aliases are safetensors' own convention (``save_model``):
a ``__metadata__`` entry ``{removed name: kept name}`` for a tensor that shared storage
with a kept one; values written by this module come back from ``snapcore.values``.

Sink: a single file when every tensor fits one ``--shard-size``, else the sharded layout,
shards cut at ``--shard-size`` the way ``save_pretrained`` cuts them (a tensor larger than
the size gets a shard of its own). Each shard is written once its tensors have arrived,
so memory holds at most one shard's tensors plus the one being read: a smaller
``--shard-size`` bounds memory further. Every header's ``__metadata__`` holds
``format: pt`` and the aliases whose kept tensor is in that file; the last file's (the
only one's) also holds the provenance (``snapcore.*`` keys) and the values as one JSON
object (``snapcore.values``) (tensors that
were one tensor in the source: written once, as ``save_model`` does). Everything is
written into a temporary name beside the target, fsynced, and renamed into place by
``commit``; ``abort`` removes it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .base import Format, TensorInfo, Value, register

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
VALUES_KEY = "snapcore.values"
_SHARD = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")

# safetensors' dtype names (the format's spec), for listing tensors without reading them
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "C64": torch.complex64,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
}
for _name, _attr in (
    ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E4M3FNUZ", "float8_e4m3fnuz"),
    ("F8_E5M2", "float8_e5m2"),
    ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
    ("F8_E8M0", "float8_e8m0fnu"),
):
    if hasattr(torch, _attr):
        _DTYPES[_name] = getattr(torch, _attr)


def detect(path: Path) -> bool:
    if path.is_file():
        return path.suffix == ".safetensors"
    if path.is_dir():
        return (path / INDEX).is_file() or any(path.glob("*.safetensors"))
    return False


def _files(path: Path) -> list[Path]:
    """The files of a checkpoint: one file, a sharded directory's shards (from its index)
    or a directory's ``*.safetensors`` files."""
    if path.is_file():
        return [path]
    index = path / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index}: not a safetensors index ({e})") from None
        for n in names:
            if not isinstance(n, str) or "/" in n or n.startswith("."):
                raise ValueError(f"{index}: a shard name that is not a file here: {n!r}")
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            where = str(path / missing[0])
            raise FileNotFoundError(2, "a shard the index names is missing", where)
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(2, "no .safetensors file", str(path))
    return files


class SafetensorsSource:
    def __init__(self, path: Any, options: dict[str, Any]) -> None:
        self.files = _files(Path(path))
        self._where: dict[str, int] = {}
        self._infos: list[TensorInfo] = []
        self._meta: dict[str, str] = {}
        self._values: dict[str, Value] = {}
        alias_entries: dict[str, str] = {}
        self._open: tuple[int, Any] | None = None
        for k, f in enumerate(self.files):
            with safe_open(f, framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 (safe_open is not iterable)
                    if name in self._where:
                        raise ValueError(f"{name} is in {self.files[self._where[name]]} and {f}")
                    sl = st.get_slice(name)
                    dtype = _DTYPES.get(sl.get_dtype())
                    if dtype is None:
                        raise ValueError(f"{f}: {name}: dtype {sl.get_dtype()} has no torch type")
                    self._where[name] = k
                    self._infos.append(TensorInfo(name, dtype, tuple(sl.get_shape())))
                for key, value in (st.metadata() or {}).items():
                    if key == VALUES_KEY:
                        if not self._values:
                            try:
                                loaded = json.loads(value)
                            except ValueError as e:
                                raise ValueError(f"{f}: {VALUES_KEY} is not JSON: {e}") from None
                            if not isinstance(loaded, dict):
                                raise ValueError(f"{f}: {VALUES_KEY} is not a JSON object")
                            self._values = loaded
                    else:
                        alias_entries[key] = value
                        self._meta.setdefault(key, value)
        # save_model's convention: {removed name: kept name}, a name no tensor has
        self._aliases = {
            k: v
            for k, v in alias_entries.items()
            if k not in self._where and v in self._where and k != "format"
        }
        for k in self._aliases:
            self._meta.pop(k, None)

    def tensors(self) -> Iterator[TensorInfo]:
        return iter(self._infos)

    def aliases(self) -> dict[str, str]:
        return dict(self._aliases)

    def read(self, info: TensorInfo) -> torch.Tensor:
        k = self._where[info.name]
        if self._open is None or self._open[0] != k:
            self._close()
            handle = safe_open(self.files[k], framework="pt")
            self._open = (k, handle.__enter__())
        return self._open[1].get_tensor(info.name).contiguous()

    def values(self) -> dict[str, Value]:
        return dict(self._values)

    def metadata(self) -> dict[str, str]:
        out = {k: v for k, v in self._meta.items() if k != "format"}
        out["source_format"] = "safetensors"
        return out

    def _close(self) -> None:
        if self._open is not None:
            self._open[1].__exit__(None, None, None)
            self._open = None

    def close(self) -> None:
        self._close()


class SafetensorsSink:
    def __init__(self, path: Any, options: dict[str, Any]) -> None:
        self.target = Path(path).absolute()
        self.shard_size = int(options.get("shard_size") or 5 * 1000**3)
        self._tmp: Path | None = None
        self._shards: list[list[TensorInfo]] = []
        self._shard_of: dict[str, int] = {}
        self._pending: dict[int, dict[str, torch.Tensor]] = {}
        self._aliases: dict[str, str] = {}
        self._values: dict[str, Value] = {}
        self._written: list[Path] = []
        self._began = False

    # -- planning ----------------------------------------------------------------------
    def begin(self, infos: list[TensorInfo], aliases: dict[str, str]) -> None:
        shards: list[list[TensorInfo]] = []
        size = 0
        for info in infos:
            if not shards or (size + info.nbytes > self.shard_size and shards[-1]):
                shards.append([])
                size = 0
            shards[-1].append(info)
            size += info.nbytes
        self._shards = shards or [[]]
        self._shard_of = {i.name: k for k, s in enumerate(self._shards) for i in s}
        self._aliases = dict(aliases)
        self._began = True
        if self.target.suffix == ".safetensors" and len(self._shards) > 1:
            total = sum(i.nbytes for i in infos)
            raise ValueError(
                f"{total} bytes of tensors need {len(self._shards)} files of --shard-size "
                f"{self.shard_size} bytes: give a directory as the target, not "
                f"{self.target.name}"
            )
        self._tmp = Path(tempfile.mkdtemp(prefix=f".{self.target.name}.", dir=self.target.parent))

    def _name(self, k: int) -> str:
        if len(self._shards) == 1:
            return self.target.name if self.target.suffix == ".safetensors" else SINGLE
        return f"model-{k + 1:05d}-of-{len(self._shards):05d}.safetensors"

    # -- writing -----------------------------------------------------------------------
    def write_values(self, values: dict[str, Value]) -> None:
        self._values = dict(values)

    def write(self, info: TensorInfo, tensor: torch.Tensor) -> None:
        if not self._began:
            raise RuntimeError("safetensors sink: begin() was not called")
        k = self._shard_of[info.name]
        self._pending.setdefault(k, {})[info.name] = tensor
        if len(self._pending[k]) == len(self._shards[k]) and k < len(self._shards) - 1:
            self._flush(k, None)  # the last shard waits for the values and provenance

    def _header(self, k: int, metadata: dict[str, str] | None) -> dict[str, str]:
        meta = {"format": "pt"}
        if metadata is not None:
            meta |= {
                (key if key.startswith("snapcore.") else f"snapcore.{key}"): str(v)
                for key, v in metadata.items()
            }
            if self._values:
                meta[VALUES_KEY] = json.dumps(self._values, separators=(",", ":"))
        names = {i.name for i in self._shards[k]}
        meta |= {a: t for a, t in sorted(self._aliases.items()) if t in names}
        return meta

    def _flush(self, k: int, metadata: dict[str, str] | None) -> None:
        assert self._tmp is not None
        tensors = self._pending.pop(k, {})
        path = self._tmp / self._name(k)
        save_file(tensors, path, metadata=self._header(k, metadata))
        del tensors
        _fsync(path)
        self._written.append(path)

    def commit(self, metadata: dict[str, str]) -> None:
        if not self._began:
            self.begin([], {})
        assert self._tmp is not None
        last = len(self._shards) - 1
        # the shards before the last were written as they filled: the last one's header
        # takes the values and the provenance
        self._flush(last, metadata)
        if len(self._shards) > 1:
            self._write_index()
        _fsync(self._tmp)
        if self.target.suffix == ".safetensors":
            os.replace(self._tmp / self._name(0), self.target)
            shutil.rmtree(self._tmp, ignore_errors=True)
        else:
            if self.target.is_dir():
                self.target.rmdir()  # empty, as convert checked
            os.replace(self._tmp, self.target)
        self._tmp = None
        _fsync(self.target.parent)

    def _write_index(self) -> None:
        assert self._tmp is not None
        total = sum(i.nbytes for s in self._shards for i in s)
        weight_map = {i.name: self._name(k) for k, s in enumerate(self._shards) for i in s}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        path = self._tmp / INDEX
        path.write_text(json.dumps(index, indent=2) + "\n")
        _fsync(path)

    def abort(self) -> None:
        self._pending.clear()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


FORMAT = register(Format("safetensors", detect, SafetensorsSource, SafetensorsSink))
