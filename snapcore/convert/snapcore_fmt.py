"""Format ``snapcore``: a snapcore store, read and written.

Source: a committed step of a store (a directory, an fsspec URL, or the ``store``
option: a ``snapcore.Store`` with its host and remote tiers), read through snapcore's
own reader (hashes checked, each chunk from the fastest tier holding it intact), one
tensor at a time, or one range of a tensor larger than the converter's window:
``read_into`` reads the whole chunks holding it into the converter's reused buffer (a
tensor that is not one contiguous piece of its blob, or a range that does not cover
whole chunks, is read whole into new memory instead); a sharded snapshot (format 3)
gives full tensors, assembled from the ranks' pieces, and rank 0's values. Tensors that
are one tensor in the snapshot (tied weights) are listed once, the other paths as
aliases. Non-tensor leaves become values: ints, floats, strings, bools and None by
dotted path; other values (NumPy arrays, bytes, generators, enums...) have no place in
the other formats and are listed in ``skipped``.

Sink: each tensor is written into the new snapshot's data file as it arrives, straight
from the converter's buffer, and hashed on the way (``snapcore.write.stream``); the sink
keeps only the manifest's records and the tree (dotted names split into nested dicts,
values first, then tensors in order, aliases last: the tensor they are the same as, so
they stay tied). ``commit`` writes the manifest, step ``step`` (default 0): an ordinary
committed snapshot, chunked and hashed as ``snapcore.save`` would, with codec ``none``.
Memory: the tensor being written, whatever the checkpoint's size. A tensor larger than
the converter's window may arrive in ranges (``write_range``), each written into its
blob as it comes. A local target is written into a temporary store beside it and
renamed into place once committed. A URL target (object storage) must hold no object
yet; it is written into a temporary local store (a new directory under ``tmp_dir``,
default the system's temporary directory), and once that step is committed it is
uploaded by snapcore's upload (``write.upload.StepUpload``: the data file streamed as
one object, the manifest PUT last, as a save's upload does), then the temporary store
is removed. The temporary directory needs room for the whole snapshot (checked before
the first tensor); the upload holds the object writer's part buffers, not the file.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from .. import api
from .. import manifest as mf
from ..durable import fsync_dir
from ..planning.layout import ALIGN, contiguous_strides
from ..tiers import LocalTier, RemoteStoreTier, Store, as_store
from ..tree import decode_float, flatten, join_path
from ..write.stream import PAGE, StreamWriter
from ..write.upload import StepUpload
from .base import Format, TensorInfo, Value, register

log = logging.getLogger(__name__)


def _store(path: Any, options: dict[str, Any]) -> Store:
    store = options.get("store")
    if store is not None:
        return store
    base = as_store(path)
    return Store(
        local=base.local, remote=base.remote, storage_options=options.get("storage_options")
    )


def detect(path: Path) -> bool:
    """A directory holding step directories (committed or not)."""
    if not path.is_dir():
        return False
    return any(p.name.startswith("step-") and p.is_dir() for p in path.iterdir())


class SnapcoreSource:
    def __init__(self, path: Any, options: dict[str, Any]) -> None:
        self.store = _store(path, options)
        try:
            self.reader = api.open_reader(self.store, step=options.get("step"))
        except BaseException:
            self.close()
            raise
        # a tensor read whole for ``read_into``'s ranges, kept until its last range
        self._whole: tuple[str, torch.Tensor] | None = None
        self._tensors: list[tuple[str, int]] = []
        self._values: dict[str, Value] = {}
        self.skipped: list[str] = []
        self._walk(self.reader.tree, "")
        self._first: dict[int, str] = {}
        self._aliases: dict[str, str] = {}
        self._index: dict[str, int] = {}
        for name, i in self._tensors:
            if i in self._first:
                self._aliases[name] = self._first[i]
            else:
                self._first[i] = name
                self._index[name] = i

    def _walk(self, node: dict[str, Any], path: str) -> None:
        (kind, value), *_ = node.items()
        if kind == "tensor":
            self._tensors.append((path or "<root>", value))
        elif kind == "dict":
            for k, v in value:
                self._walk(v, join_path(path, k))
        elif kind in ("list", "tuple"):
            for i, v in enumerate(value):
                self._walk(v, join_path(path, i))
        elif kind == "stateful":
            self._walk(value["state"], path)
        elif kind == "float":
            self._values[path] = decode_float(value)
        elif kind in ("int", "str", "bool"):
            self._values[path] = value
        elif kind == "none":
            self._values[path] = None
        else:
            self.skipped.append(f"{path or '<root>'} ({kind})")

    def tensors(self) -> Iterator[TensorInfo]:
        for name, i in self._index.items():
            e = self.reader.m.tensors[i]
            yield TensorInfo(name, e.torch_dtype, tuple(e.shape))

    def aliases(self) -> dict[str, str]:
        return dict(self._aliases)

    def read(self, info: TensorInfo) -> torch.Tensor:
        self._whole = None
        i = self._index[info.name]
        try:
            t = self.reader.tensor(i, info.name)
            # a view of a larger blob, or a strided one: a tensor of its own bytes, so
            # the blob is freed now
            if not t.is_contiguous() or t.untyped_storage().nbytes() != t.nbytes:
                t = t.clone(memory_format=torch.contiguous_format)
        finally:
            self.reader.release(i)
        return t

    def read_range(self, info: TensorInfo, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of the tensor in C order, as a 1-D tensor."""
        return self.read_into(info, start, stop, None)

    def read_into(
        self, info: TensorInfo, start: int | None, stop: int | None, buf: torch.Tensor | None
    ) -> torch.Tensor:
        """The tensor (``start`` None) or its elements ``[start, stop)`` as a 1-D tensor.

        Into ``buf`` (the converter's reused uint8 buffer) when the tensor is one
        contiguous piece of its blob and the chunks holding the range fit in ``buf``:
        those whole chunks are read by the reader (each one's xxh3 checked, a damaged
        one read from the next tier) and the result is a view of ``buf``. Otherwise
        (a sharded or strided tensor, a range that does not cover its chunks, no
        buffer) the tensor is read whole into new memory, as ``read`` does, and kept
        until its last range is taken."""
        i = self._index[info.name]
        e = self.reader.m.tensors[i]
        numel = math.prod(e.shape)
        if start is None:
            start, stop, shape = 0, numel, tuple(e.shape)
        else:
            assert stop is not None
            if not 0 <= start <= stop <= numel:
                raise ValueError(f"{info.name}: elements [{start}, {stop}) of {numel}")
            shape = (stop - start,)
        if self._whole is not None and self._whole[0] != info.name:
            self._whole = None  # another tensor's
        if buf is not None:
            t = self._chunks_into(i, start, stop, buf)
            if t is not None:
                if stop == numel:
                    self._whole = None
                return t.view(shape)
        whole = self._whole
        if whole is None or whole[0] != info.name:
            whole = self._whole = (info.name, self.read(info))
        t = whole[1]
        if shape != tuple(e.shape):
            t = t.view(-1)[start:stop]
        if stop == numel:
            self._whole = None  # the last range: dropped once the caller drops it
        return t

    def _chunks_into(self, i: int, start: int, stop: int, buf: torch.Tensor) -> torch.Tensor | None:
        """Elements ``[start, stop)`` of tensor ``i`` (one contiguous piece of its blob),
        read as the whole chunks that hold them into ``buf``; None where that is not
        possible (the caller reads another way)."""
        e = self.reader.m.tensors[i]
        dtype, size = e.torch_dtype, e.torch_dtype.itemsize
        if not self.reader.whole(i) or e.pieces[0].strides != contiguous_strides(e.shape):
            return None
        p = e.pieces[0]
        lo, hi = p.byte_offset + start * size, p.byte_offset + stop * size
        if hi == lo:
            return torch.empty(0, dtype=dtype)
        jobs: list[tuple[int, int, int]] = []  # (blob, chunk, position in the blob)
        pos = 0
        for j, c in enumerate(self.reader.m.blobs[p.blob].chunks):
            if pos < hi and pos + c.raw_length > lo and c.raw_length:
                jobs.append((p.blob, j, pos))
            pos += c.raw_length
        if not jobs or jobs[0][2] > lo or pos < hi:
            return None  # chunks that do not hold the range: the manifest's checks say why
        first = jobs[0][2]
        last = self.reader.m.blobs[p.blob].chunks[jobs[-1][1]]
        span = jobs[-1][2] + last.raw_length - first
        if buf.dtype != torch.uint8 or buf.numel() < span or (lo - first) % size:
            return None
        base = buf.data_ptr()
        self.reader.read_chunks([(b, j, base + at - first) for b, j, at in jobs])
        return buf[lo - first : hi - first].view(dtype)

    def values(self) -> dict[str, Value]:
        return dict(self._values)

    def metadata(self) -> dict[str, str]:
        m = self.reader.m
        return {"source_format": "snapcore", "snapcore.step": str(m.step)}

    def close(self) -> None:
        self._whole = None
        self.store.__exit__(None, None, None)


class _Ref:
    """A tensor leaf of the sink's tree: the index the stream writer gave it."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def _node(obj: Any) -> dict[str, Any]:
    """The manifest tree node of the sink's nested dict (``_Ref`` leaves are tensors;
    the plain values are encoded by snapcore's own ``tree.flatten``)."""
    if isinstance(obj, _Ref):
        return {"tensor": obj.index}
    if isinstance(obj, dict):
        return {"dict": [[k, _node(v)] for k, v in obj.items()]}
    return flatten(obj).tree


def _new_remote(url: str, storage_options: dict[str, Any] | None) -> RemoteStoreTier:
    """The remote tier of a URL target, which must hold no object yet (convert writes a
    new target, as it refuses a local one that is not empty)."""
    remote = RemoteStoreTier(url, storage_options)
    try:
        names = remote.rt.list("")
        if names:
            more = f" and {len(names) - 1} more" if len(names) > 1 else ""
            raise FileExistsError(
                f"{url} is not empty ({names[0]}{more}): convert writes a new target"
            )
    except BaseException:
        remote.close()
        raise
    return remote


class SnapcoreSink:
    def __init__(self, path: Any, options: dict[str, Any]) -> None:
        self.step = options.get("step") or 0
        self.storage_options = options.get("storage_options")
        self.target = path
        self.tree: dict[str, Any] = {}
        self._by_name: dict[str, Any] = {}
        self._aliases: dict[str, str] = {}
        self._tmp: Path | None = None
        self._stream: StreamWriter | None = None
        self._remote: RemoteStoreTier | None = None
        self.upload_bytes = 0  # what commit uploads (a URL target), known after begin
        self.upload_progress: Callable[[int], None] | None = None  # set by the driver
        tmp_dir = options.get("tmp_dir")
        self.tmp_dir = Path(tmp_dir) if tmp_dir is not None else None
        if isinstance(path, str):  # a URL: checked (and its server reached) before any work
            if self.tmp_dir is not None and not self.tmp_dir.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, "tmp_dir is not a directory", str(tmp_dir))
            self._remote = _new_remote(path, self.storage_options)

    def begin(
        self,
        infos: list[TensorInfo],
        aliases: dict[str, str],
        metadata: dict[str, str] | None = None,
    ) -> None:
        self._aliases = dict(aliases)
        if self._remote is not None:  # the temporary store holds the whole snapshot
            base = self._tmp_base()
            # each tensor's bytes, moved to a page offset or aligned: at most a page more
            need = sum(math.prod(i.shape) * i.dtype.itemsize + max(PAGE, ALIGN) for i in infos)
            self.upload_bytes = sum(i.nbytes for i in infos)
            free = shutil.disk_usage(base).free
            if free < need:
                raise OSError(
                    errno.ENOSPC,
                    f"the temporary store of the upload to {self.target} needs {need} bytes, "
                    f"{free} are free there (give a directory with room: --tmp-dir, tmp_dir=)",
                    str(base),
                )

    def _tmp_base(self) -> Path:
        """Where a URL target's temporary store is made."""
        return self.tmp_dir if self.tmp_dir is not None else Path(tempfile.gettempdir())

    def _put(self, name: str, value: Any) -> None:
        parts = name.split(".")
        node = self.tree
        for k, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(f"{'.'.join(parts[: k + 1])} is a leaf and a prefix of {name}")
            node = child
        if parts[-1] in node:
            raise ValueError(f"{name} is given twice, or is a leaf and a prefix")
        node[parts[-1]] = value

    def _writer(self) -> StreamWriter:
        """The stream writer of the temporary store (made on first use): beside a local
        target, under ``tmp_dir`` for a URL target."""
        if self._stream is None:
            if self._remote is not None:
                base, prefix = self._tmp_base(), "snapcore-convert-"
            else:
                target = Path(self.target).absolute()
                base, prefix = target.parent, f".{target.name}."
            self._tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
            self._stream = StreamWriter(self._tmp, self.step)
        return self._stream

    keeps_tensors = False  # done with a tensor's memory when ``write`` returns

    def write(self, info: TensorInfo, tensor: torch.Tensor) -> None:
        value = _Ref(self._writer().add(tensor))
        self._put(info.name, value)
        self._by_name[info.name] = value

    def write_range(self, info: TensorInfo, start: int, piece: torch.Tensor) -> None:
        """Elements ``[start, start + piece.numel())`` of ``info``, in order: written
        into the tensor's blob as they arrive."""
        if piece.dtype != info.dtype or piece.dim() != 1:
            raise ValueError(f"{info.name}: a range of {piece.dtype} {tuple(piece.shape)}")
        if start == 0:
            ref = _Ref(self._writer().add_tensor(info.dtype, info.shape))
            self._put(info.name, ref)
            self._by_name[info.name] = ref
        value = self._by_name.get(info.name)
        if value is None:
            raise ValueError(f"{info.name}: a range at element {start} before the first")
        self._writer().write(value.index, start * info.dtype.itemsize, piece)

    def write_values(self, values: dict[str, Value]) -> None:
        for name, value in values.items():
            self._put(name, value)

    def commit(self, metadata: dict[str, str]) -> None:
        for alias, target in self._aliases.items():
            self._put(alias, self._by_name[target])
        m = self._writer().commit(_node(self.tree))
        assert self._tmp is not None
        if self._remote is not None:
            self._upload(m)
            return
        target = Path(self.target).absolute()
        if target.is_dir():
            target.rmdir()  # empty, as convert checked: replaced by the new store
        os.replace(self._tmp, target)
        self._tmp = None
        fsync_dir(target.parent)

    def _upload(self, m: mf.Manifest) -> None:
        """Upload the step committed in the temporary store, as a save's upload does (the
        manifest PUT last); then the temporary store goes."""
        assert self._remote is not None and self._tmp is not None
        done = StepUpload(
            self._remote, LocalTier(self._tmp), m, progress=self.upload_progress
        ).run()
        try:
            done.end()  # the pending mark: after the commit, its failure undoes nothing
        except Exception as e:
            log.warning("%s: the upload's pending mark stays: %s", self.target, e)
        self._remote.close()
        self._remote = None
        shutil.rmtree(self._tmp, ignore_errors=True)
        self._tmp = None

    def abort(self) -> None:
        self.tree.clear()
        self._by_name.clear()
        if self._stream is not None:
            self._stream.abort()
            self._stream = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        if self._remote is not None:
            self._remote.close()
            self._remote = None


FORMAT = register(Format("snapcore", detect, SnapcoreSource, SnapcoreSink))
