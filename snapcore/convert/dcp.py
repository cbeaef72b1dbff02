"""Format ``dcp``: a ``torch.distributed.checkpoint`` directory (``.metadata`` and
``__N_M.distcp`` files, DCP's default ``FileSystemWriter`` layout), read and written with
no process group (docs/security.md).

Reading. DCP's ``.metadata`` is a pickle, and torch's ``FileSystemReader.read_metadata``
unpickles it with no restriction: a hostile checkpoint runs code the moment it is opened.
snapcore unpickles it with ``_MetadataUnpickler``, whose ``find_class`` gives only the
globals a real ``.metadata`` holds (``ALLOWED_GLOBALS``, found by reading torch 2.13's
``metadata.py``/``filesystem.py`` and the opcodes of files ``dcp.save`` wrote) and raises
``UnsafeCheckpoint`` naming any other global before it is looked up, so nothing runs. The
result is then checked field by field (types, shapes, chunks in bounds and covering their
tensor exactly, data files inside the directory) before anything is read.

Each tensor is assembled from its chunks: a chunk is a ``torch.save``'d tensor at
(file, offset, length) in a ``.distcp`` file, read with ``torch.load(weights_only=True)``
from that byte range only, one tensor at a time (memory: the tensor being converted).
Non-tensor entries are ``torch.save``'d objects, read the same way; plain values
(int, float, str, bool, None, and lists, tuples and dicts of them, flattened into dotted
names) are kept, anything else is skipped with a warning naming it. Stream transforms
(DCP's experimental ``_extensions``, e.g. zstd) and the safetensors serialization format
are not supported and raise an error naming the entry.

Writing uses DCP's own ``dcp.save`` with its ``FileSystemWriter`` (``no_dist=True``), so
the files and ``.metadata`` are DCP's, streamed: ``begin`` starts ``dcp.save`` on a
thread of its own with the state's structure, every tensor a placeholder on the meta
device (its shape and dtype: all DCP's planner needs), and the planner's
``lookup_object`` (``DefaultSavePlanner``'s documented extension point) takes each real
tensor from the converter when DCP's writer comes to it (``_Handoff``). ``order`` asks
DCP's planner for its order, so the converter reads the tensors in the order DCP writes
them, and each ``write`` returns once DCP is done with that tensor: memory is the tensor
being written and the one read ahead, whatever the checkpoint's size. The writer runs
with ``single_file_per_rank=False``, one ``__0_N.distcp`` file per tensor or value: with
one file per rank (its default) ``FileSystemWriter`` keeps every tensor of the file
until the file is closed (torch 2.13's ``_write_files_from_queue`` holds them in a dict),
which is the whole checkpoint; both layouts are DCP's own and read the same. A tensor
with aliases (tied names) is kept until DCP has written it under every name. The sink
used without ``begin`` (the contract allows it) gathers the tensors and saves them whole
at ``commit``. DCP writes into a temporary directory beside the target (files and
``.metadata`` fsynced by DCP); the sink fsyncs that directory and renames it onto the
target; ``abort`` stops DCP's thread (its wait for the next tensor raises) and removes
the directory. DCP writes a plain tensor as one ``WriteItem``, resolved whole (only a
``DTensor`` or ``ShardedTensor``, which need a process group, is written in chunks), so a
tensor larger than the window is read whole.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import threading
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem as _dcp_fs
from torch.distributed.checkpoint import metadata as _dcp_md

from ..durable import fsync_dir
from ..errors import CorruptSnapshot, InvalidManifest, StorageError, UnsafeCheckpoint
from . import _nested
from .base import Format, TensorInfo, Value, register

__all__ = ["ALLOWED_GLOBALS", "DcpSink", "DcpSource", "detect", "read_metadata"]

METADATA_FILE = ".metadata"


def detect(path: Path) -> bool:
    """A directory holding a ``.metadata`` file."""
    try:
        return path.is_dir() and (path / METADATA_FILE).is_file()
    except OSError:
        return False


# ---------------------------------------------------------------------------------------
# The allow-listed unpickler
# ---------------------------------------------------------------------------------------


def _layout(name: object) -> torch.layout:
    """Stands in for ``torch.serialization._get_layout`` (how a ``torch.layout`` pickles:
    ``_get_layout("torch.strided")``): only the names of torch's layout objects."""
    layouts = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
    if not isinstance(name, str) or name not in layouts:
        raise InvalidManifest(f"not a torch layout: {name!r}")
    return layouts[name]


def _path(*parts: object) -> str:
    """Stands in for ``pathlib.*Path`` (``StorageMeta.checkpoint_id`` pickles as the path of
    the directory DCP wrote to): the path as a string, without instantiating a Path class
    (a WindowsPath cannot be made on Linux)."""
    if not all(isinstance(p, str) for p in parts):
        raise InvalidManifest(f"not a path: {parts!r}")
    return str(PurePosixPath(*parts)) if parts else ""  # type: ignore[arg-type]


def _windows_path(*parts: object) -> str:
    if not all(isinstance(p, str) for p in parts):
        raise InvalidManifest(f"not a path: {parts!r}")
    return str(PureWindowsPath(*parts)) if parts else ""  # type: ignore[arg-type]


def _allowed_globals() -> dict[tuple[str, str], Any]:
    allowed: dict[tuple[str, str], Any] = {}
    md = "torch.distributed.checkpoint.metadata"
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",  # an Enum: TensorProperties pickles its memory format so
    ):
        allowed[(md, name)] = getattr(_dcp_md, name)
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _dcp_fs._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    # torch.float32 & co pickle as ("torch", "float32"): exactly the dtype objects, and
    # layout and memory-format objects (never pickled by torch 2.13, but plain values)
    for name, value in vars(torch).items():
        if isinstance(value, torch.dtype | torch.layout | torch.memory_format):
            allowed[("torch", name)] = value
    allowed[("torch.serialization", "_get_layout")] = _layout
    for cls in ("PosixPath", "PurePosixPath", "Path", "PurePath"):
        allowed[("pathlib", cls)] = _path
    for cls in ("WindowsPath", "PureWindowsPath"):
        allowed[("pathlib", cls)] = _windows_path
    allowed[("collections", "OrderedDict")] = OrderedDict
    for plain in (dict, list, tuple, set, frozenset, int, float, complex, str, bytes, bool):
        allowed[("builtins", plain.__name__)] = plain
    return allowed


# (module, name) -> the object find_class returns; anything else is refused.
ALLOWED_GLOBALS: dict[tuple[str, str], Any] = _allowed_globals()


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only ``ALLOWED_GLOBALS``: every other global (whatever
    opcode names it: GLOBAL, STACK_GLOBAL, INST, OBJ) raises before it is imported, so a
    REDUCE, BUILD or NEWOBJ of it never runs. Persistent ids and extension codes are
    refused too."""

    def __init__(self, file: Any, *, where: str) -> None:
        super().__init__(file)
        self._where = where

    def find_class(self, module: str, name: str) -> Any:
        try:
            return ALLOWED_GLOBALS[(module, name)]
        except (KeyError, TypeError):
            raise UnsafeCheckpoint(
                f"{self._where}: refused: it names the global {module}.{name}, which is "
                "not one of DCP's metadata types; unpickling it could run code, so "
                "snapcore does not (docs/security.md)",
                file=self._where,
                name=f"{module}.{name}",
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpoint(
            f"{self._where}: refused: a persistent id ({pid!r}) has no place in DCP metadata",
            file=self._where,
        )


def _bad(where: str, why: str) -> InvalidManifest:
    return InvalidManifest(f"{where}: not a valid DCP metadata file: {why}", file=where)


def _is_size(v: Any) -> bool:
    return isinstance(v, torch.Size) and all(type(d) is int and d >= 0 for d in v)


def _check_chunks(where: str, fqn: str, tm: Any) -> None:
    size = tm.size
    if not isinstance(tm.chunks, list) or not tm.chunks:
        raise _bad(where, f"{fqn!r} has no chunks")
    boxes = []
    for c in tm.chunks:
        if not isinstance(c, _dcp_md.ChunkStorageMetadata):
            raise _bad(where, f"{fqn!r}: a chunk is a {type(c).__name__}")
        if not (_is_size(c.offsets) and _is_size(c.sizes)):
            raise _bad(where, f"{fqn!r}: a chunk's offsets or sizes are not sizes")
        if len(c.offsets) != len(size) or len(c.sizes) != len(size):
            raise _bad(where, f"{fqn!r}: a chunk's rank differs from the tensor's")
        if any(o + s > d for o, s, d in zip(c.offsets, c.sizes, size, strict=True)):
            raise _bad(where, f"{fqn!r}: chunk at {list(c.offsets)} lies outside {list(size)}")
        boxes.append((tuple(c.offsets), tuple(c.sizes)))
    total = 1
    for d in size:
        total *= d
    vol = 0
    for _, s in boxes:
        n = 1
        for d in s:
            n *= d
        vol += n
    if total == 0:
        return  # an empty tensor: nothing to cover
    # disjoint chunks whose volumes add up to the tensor's cover it exactly
    if vol != total:
        raise _bad(where, f"{fqn!r}: its chunks hold {vol} elements, the tensor {total}")
    nonempty = [b for b in boxes if all(s > 0 for s in b[1])]
    nonempty.sort()
    for i, (oa, sa) in enumerate(nonempty):
        for ob, sb in nonempty[i + 1 :]:
            if ob[0] >= oa[0] + sa[0]:
                break  # sorted by first offset: no later chunk can overlap this one
            if all(
                a0 < b0 + bs and b0 < a0 + as_
                for a0, as_, b0, bs in zip(oa, sa, ob, sb, strict=True)
            ):
                raise _bad(where, f"{fqn!r}: chunks at {list(oa)} and {list(ob)} overlap")


def _check_metadata(md: Any, where: str) -> None:
    if not isinstance(md, _dcp_md.Metadata):
        raise _bad(where, f"it holds a {type(md).__name__}, not a Metadata")
    sdm = getattr(md, "state_dict_metadata", None)
    if not isinstance(sdm, dict):
        raise _bad(where, "no state_dict_metadata")
    for fqn, entry in sdm.items():
        if not isinstance(fqn, str):
            raise _bad(where, f"a key is a {type(fqn).__name__}: {fqn!r}")
        if isinstance(entry, _dcp_md.BytesStorageMetadata):
            continue
        if not isinstance(entry, _dcp_md.TensorStorageMetadata):
            raise _bad(where, f"{fqn!r} is a {type(entry).__name__}")
        props = getattr(entry, "properties", None)
        if not isinstance(props, _dcp_md.TensorProperties) or not isinstance(
            getattr(props, "dtype", None), torch.dtype
        ):
            raise _bad(where, f"{fqn!r} has no dtype")
        if not _is_size(getattr(entry, "size", None)):
            raise _bad(where, f"{fqn!r}: its size is not a torch.Size")
        _check_chunks(where, fqn, entry)
    storage = getattr(md, "storage_data", None)
    if not isinstance(storage, dict):
        raise _bad(where, "no storage_data (not written by FileSystemWriter)")
    for key, info in storage.items():
        if not isinstance(key, _dcp_md.MetadataIndex) or not isinstance(key.fqn, str):
            raise _bad(where, f"a storage key is a {type(key).__name__}")
        if key.offset is not None and not _is_size(key.offset):
            raise _bad(where, f"{key.fqn!r}: a storage key's offset is not a size")
        if not isinstance(info, _dcp_fs._StorageInfo):
            raise _bad(where, f"{key.fqn!r}: its storage info is a {type(info).__name__}")
        rel, off, length = (
            getattr(info, "relative_path", None),
            getattr(info, "offset", None),
            getattr(info, "length", None),
        )
        if not isinstance(rel, str) or type(off) is not int or type(length) is not int:
            raise _bad(where, f"{key.fqn!r}: malformed storage info {info!r}")
        if off < 0 or length < 0:
            raise _bad(where, f"{key.fqn!r}: negative offset or length")


def read_metadata(path: Path) -> Any:
    """DCP's ``Metadata`` of the directory ``path``, unpickled through the allow-list and
    checked; raises UnsafeCheckpoint (a refused global) or InvalidManifest."""
    where = str(Path(path) / METADATA_FILE)
    try:
        with open(where, "rb") as f:
            md = _MetadataUnpickler(f, where=where).load()
    except (UnsafeCheckpoint, InvalidManifest) as e:
        if isinstance(e, UnsafeCheckpoint) or e.file:
            raise
        raise _bad(where, str(e)) from None
    except OSError as e:
        raise StorageError(e.errno or 0, f"{where}: cannot read: {e.strerror}", where) from e
    except Exception as e:  # a malformed pickle: any error of the unpickler's
        raise _bad(where, f"{type(e).__name__}: {e}") from None
    _check_metadata(md, where)
    return md


# ---------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------


class _FileSlice(io.RawIOBase):
    """A read-only, seekable view of ``length`` bytes at ``offset`` of an open file."""

    def __init__(self, fd: int, offset: int, length: int) -> None:
        super().__init__()
        self._fd, self._start, self._len, self._pos = fd, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._len}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf).cast("B")
        n = min(len(view), self._len - self._pos)
        if n <= 0:
            return 0
        got = os.preadv(self._fd, [view[:n]], self._start + self._pos)
        self._pos += got
        return got


class DcpSource:
    def __init__(self, path: Path, options: dict[str, Any] | None = None) -> None:
        self.path = Path(path)
        self._root = self.path.resolve()
        self._md = read_metadata(self.path)
        self._where = str(self.path / METADATA_FILE)
        # (fqn, offsets or None) -> _StorageInfo
        self._storage: dict[tuple[str, tuple[int, ...] | None], Any] = {
            (k.fqn, None if k.offset is None else tuple(k.offset)): v
            for k, v in self._md.storage_data.items()
        }
        self._fds: dict[str, int] = {}
        sdm = self._md.state_dict_metadata
        self._infos = [
            TensorInfo(fqn, e.properties.dtype, tuple(e.size))
            for fqn, e in sdm.items()
            if isinstance(e, _dcp_md.TensorStorageMetadata)
        ]
        for info in self._infos:  # every chunk must have its storage, before any read
            for c in sdm[info.name].chunks:
                self._locate(info.name, tuple(c.offsets))

    def _locate(self, fqn: str, offsets: tuple[int, ...] | None) -> Any:
        sinfo = self._storage.get((fqn, offsets))
        if sinfo is None:
            at = "" if offsets is None else f" at {list(offsets)}"
            raise _bad(self._where, f"{fqn!r}{at} has no storage entry")
        if getattr(sinfo, "transform_descriptors", None):
            raise InvalidManifest(
                f"{self._where}: {fqn!r} was written with stream transforms "
                f"{list(sinfo.transform_descriptors)} (DCP's experimental _extensions), "
                "which snapcore does not read",
                file=self._where,
            )
        rel = sinfo.relative_path
        full = (self._root / rel).resolve()
        if Path(rel).is_absolute() or not full.is_relative_to(self._root):
            raise _bad(self._where, f"{fqn!r}: data file {rel!r} lies outside {self._root}")
        return sinfo

    def _fd(self, rel: str) -> int:
        fd = self._fds.get(rel)
        if fd is None:
            full = self._root / rel
            try:
                fd = os.open(full, os.O_RDONLY)
            except OSError as e:
                raise CorruptSnapshot(
                    f"{full}: cannot open a DCP data file: {e.strerror}", file=str(full)
                ) from e
            self._fds[rel] = fd
        return fd

    def _load(self, fqn: str, offsets: tuple[int, ...] | None) -> Any:
        sinfo = self._locate(fqn, offsets)
        full = str(self._root / sinfo.relative_path)
        fd = self._fd(sinfo.relative_path)
        size = os.fstat(fd).st_size
        if sinfo.offset + sinfo.length > size:
            raise CorruptSnapshot(
                f"{full}: {fqn!r} lies at bytes {sinfo.offset}..{sinfo.offset + sinfo.length}"
                f" of a {size}-byte file (truncated?)",
                tensor=fqn,
                file=full,
            )
        stream = io.BufferedReader(_FileSlice(fd, sinfo.offset, sinfo.length), 1 << 20)
        try:
            return torch.load(stream, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            raise UnsafeCheckpoint(
                f"{full}: refused {fqn!r}: its payload is not a tensor or plain data "
                "that torch.load(weights_only=True) allows; unpickling it could run code",
                file=full,
            ) from None
        except Exception as e:
            raise CorruptSnapshot(
                f"{full}: cannot read {fqn!r} at byte {sinfo.offset}: {e}",
                tensor=fqn,
                file=full,
            ) from e

    def tensors(self) -> Iterator[TensorInfo]:
        yield from self._infos

    def read(self, info: TensorInfo) -> torch.Tensor:
        entry = self._md.state_dict_metadata[info.name]
        out: torch.Tensor | None = None
        for c in entry.chunks:
            offsets, sizes = tuple(c.offsets), tuple(c.sizes)
            t = self._load(info.name, offsets)
            if not isinstance(t, torch.Tensor) or t.dtype != info.dtype or tuple(t.shape) != sizes:
                got = (
                    f"a {t.dtype} tensor of shape {list(t.shape)}"
                    if isinstance(t, torch.Tensor)
                    else f"a {type(t).__name__}"
                )
                raise CorruptSnapshot(
                    f"{self.path}: the chunk of {info.name!r} at {list(offsets)} holds {got}, "
                    f"the metadata says {info.dtype} of shape {list(sizes)}",
                    tensor=info.name,
                    file=str(self.path),
                )
            if sizes == info.shape:  # one chunk is the whole tensor
                return t.detach().contiguous()
            if out is None:
                out = torch.empty(info.shape, dtype=info.dtype)
            view = out
            for dim, (o, s) in enumerate(zip(offsets, sizes, strict=True)):
                view = view.narrow(dim, o, s)
            view.copy_(t)
            del t
        if out is None:
            out = torch.empty(info.shape, dtype=info.dtype)
        return out

    def values(self) -> dict[str, Value]:
        out: dict[str, Value] = {}
        for fqn, e in self._md.state_dict_metadata.items():
            if isinstance(e, _dcp_md.BytesStorageMetadata):
                obj = self._load(fqn, None)
                out.update(_nested.plain_values(fqn, obj, str(self.path)))
        return out

    def metadata(self) -> dict[str, str]:
        meta = {"format": "dcp", "source": str(self.path)}
        if isinstance(self._md.version, str):
            meta["dcp_version"] = self._md.version
        return meta

    def close(self) -> None:
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)


# ---------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------


class _Handoff:
    """Tensors passed from the converter's thread (``put``) to DCP's writer thread
    (``take``, from the planner's ``lookup_object``), one at a time.

    ``put`` returns once DCP has finished with everything given so far and waits for a
    tensor not given yet (or DCP is done): the converter's tensor is then written, and
    dropped by both sides, before the next one is handed over. A name DCP asks for that
    is not the next one given does not block the converter: what it gives meanwhile is
    kept until DCP asks for it (memory then grows; it does not happen with the order
    ``order`` gives, which is DCP's own plan order)."""

    def __init__(self, names: dict[str, list[str]]) -> None:
        self._names = names  # a tensor's name -> every fqn DCP writes it under (aliases)
        self._cond = threading.Condition()
        self._ready: dict[str, torch.Tensor] = {}  # fqn -> tensor, given, not yet taken
        self._waiting: str | None = None  # the fqn DCP waits for (absent from _ready)
        self._closed = False  # every tensor was given
        self._stopped: str | None = None  # why DCP must stop (the conversion failed)
        self.done = False  # DCP's thread has ended
        self.failure: BaseException | None = None
        self.unused: list[str] = []  # given, never asked for by DCP (when it ended)

    def put(self, name: str, tensor: torch.Tensor) -> None:
        with self._cond:
            for fqn in self._names.get(name, [name]):
                self._ready[fqn] = tensor
            self._cond.notify_all()
            while not self.done and (self._waiting is None or self._waiting in self._ready):
                self._cond.wait()

    def take(self, fqn: str) -> torch.Tensor:
        with self._cond:
            while fqn not in self._ready:
                if self._stopped is not None:
                    raise RuntimeError(f"DCP target: {self._stopped}")
                if self._closed:
                    # DCP wraps what its planner raises: the sink raises this instead
                    self.failure = ValueError(f"DCP target: {fqn} was planned but never given")
                    raise self.failure
                self._waiting = fqn
                self._cond.notify_all()
                self._cond.wait()
            self._waiting = None
            return self._ready.pop(fqn)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def stop(self, why: str) -> None:
        with self._cond:
            self._stopped = why
            self._cond.notify_all()

    def finished(self) -> None:
        with self._cond:
            self.done = True
            self.unused = sorted(self._ready)
            self._ready.clear()
            self._cond.notify_all()


def _planner_class() -> type:
    import torch.distributed.checkpoint as dcp

    class StreamPlanner(dcp.DefaultSavePlanner):
        """DCP's default planner, whose tensors are placeholders on the meta device
        (shape and dtype: all the plan needs) until ``lookup_object`` (the planner's
        documented extension point) takes the real one from the hand-off."""

        def __init__(self, handoff: _Handoff | None) -> None:
            super().__init__()
            self.handoff = handoff

        def lookup_object(self, index: Any) -> Any:
            obj = super().lookup_object(index)
            if isinstance(obj, torch.Tensor) and obj.is_meta and self.handoff is not None:
                return self.handoff.take(index.fqn)
            return obj

    return StreamPlanner


class DcpSink:
    """Writes with DCP's own ``dcp.save`` and ``FileSystemWriter`` on a thread of its
    own, fed tensor by tensor (see the module's docstring)."""

    def __init__(self, path: Path, options: dict[str, Any] | None = None) -> None:
        self.path = Path(path)
        if self.path.exists() and (not self.path.is_dir() or any(self.path.iterdir())):
            raise StorageError(
                17, f"{self.path}: the target exists (DCP writes a new directory)", str(path)
            )
        self._tmp = _nested.temp_name(self.path)
        self._leaves: dict[str, Any] = {}  # dotted name -> value, or a meta placeholder
        self._handoff: _Handoff | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def write_values(self, values: dict[str, Value]) -> None:
        self._leaves.update(values)

    def _skeleton(self, infos: list[TensorInfo], aliases: dict[str, str]) -> dict[str, Any]:
        leaves = dict(self._leaves)
        by_name = {i.name: i for i in infos}
        for info in infos:
            leaves[info.name] = torch.empty(info.shape, dtype=info.dtype, device="meta")
        for alias, target in aliases.items():
            i = by_name[target]
            leaves[alias] = torch.empty(i.shape, dtype=i.dtype, device="meta")
        return _nested.unflatten(leaves)

    def order(self, infos: list[TensorInfo], aliases: dict[str, str]) -> list[TensorInfo]:
        """The tensors in the order DCP's plan writes them (asked of DCP's planner)."""
        planner = _planner_class()(None)
        planner.set_up_planner(self._skeleton(infos, aliases), None, True)
        plan = planner.create_local_plan()
        names = {i.name: i for i in infos}
        out: list[TensorInfo] = []
        seen: set[str] = set()
        for item in plan.items:
            name = aliases.get(item.index.fqn, item.index.fqn)
            if name in names and name not in seen:
                seen.add(name)
                out.append(names[name])
        return out + [i for i in infos if i.name not in seen]

    def begin(
        self,
        infos: list[TensorInfo],
        aliases: dict[str, str],
        metadata: dict[str, str] | None = None,
    ) -> None:
        """Start ``dcp.save`` of the planned state on DCP's thread: it plans, writes the
        values, then asks for each tensor in its order."""
        names: dict[str, list[str]] = {i.name: [i.name] for i in infos}
        for alias, target in aliases.items():
            names[target].append(alias)
        state = self._skeleton(infos, aliases)
        self._handoff = handoff = _Handoff(names)
        planner = _planner_class()(handoff)
        self._remove_tmp()

        def run() -> None:
            try:
                self._save(state, planner)
            except BaseException as e:
                self._error = e
            finally:
                handoff.finished()

        self._thread = threading.Thread(target=run, name="snapcore-convert-dcp", daemon=True)
        self._thread.start()

    def _save(self, state: dict[str, Any], planner: Any) -> None:
        """DCP's own save of ``state`` into the temporary directory (files and
        ``.metadata`` fsynced by DCP), one file per tensor."""
        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():
            # no_dist=True is the point: DCP's warning that it saves in one process
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(
                state,
                storage_writer=dcp.FileSystemWriter(
                    self._tmp, sync_files=True, single_file_per_rank=False
                ),
                planner=planner,
                no_dist=True,
            )

    def write(self, info: TensorInfo, tensor: torch.Tensor) -> None:
        if self._handoff is None:  # used without begin(): gathered, saved whole by commit
            self._leaves[info.name] = tensor.detach().clone()
            return
        self._handoff.put(info.name, tensor)
        self._raise()

    def _raise(self) -> None:
        """DCP's own error (a full disk, a bad value...), raised in the converter."""
        if self._handoff is not None and self._handoff.failure is not None:
            raise self._handoff.failure
        if self._error is not None:
            raise self._error

    def commit(self, metadata: dict[str, str]) -> None:
        try:
            if self._handoff is None or self._thread is None:
                import torch.distributed.checkpoint as dcp

                self._remove_tmp()
                self._save(_nested.unflatten(self._leaves), dcp.DefaultSavePlanner())
            else:
                self._handoff.close()
                self._thread.join()
                self._raise()
                if self._handoff.unused:  # DCP wrote without them: not the checkpoint given
                    raise ValueError(
                        f"DCP target {self.path}: {', '.join(self._handoff.unused[:8])} "
                        "given but not in DCP's plan"
                    )
            fsync_dir(self._tmp)
            _nested.commit_rename(self._tmp, self.path)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        if self._handoff is not None and self._thread is not None:
            self._handoff.stop("the conversion was aborted")
            self._thread.join()
        self._leaves.clear()
        self._remove_tmp()

    def _remove_tmp(self) -> None:
        if self._tmp.is_dir() and not self._tmp.is_symlink():
            shutil.rmtree(self._tmp, ignore_errors=True)


FORMAT = register(
    Format(
        name="dcp",
        detect=detect,
        source=lambda path, options: DcpSource(path, options),
        sink=lambda path, options: DcpSink(path, options),
    )
)
