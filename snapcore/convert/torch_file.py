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

Writing streams, in torch's own format (``torch.save`` pickles the whole nested dict at
once, so it does not write the file itself). At ``begin`` the sink knows every tensor
(name, dtype, shape) and the values. It runs ``torch.save`` of the nested state under
``torch.serialization.skip_data`` with placeholder tensors (storages cut from one
read-only anonymous mapping, never touched: no RSS, no commit charge), into ``_Sparse``,
a file object in memory that keeps what torch writes and not the holes it seeks over
where the bytes would go. Read back with ``zipfile``, that gives torch's records: the
pickle (``data.pkl``: storage keys, dtypes, shapes, strides, tied tensors as one
storage), ``.format_version``, ``.storage_alignment``, ``byteorder``, ``version`` and
``.data/serialization_id``. The file is then written with ``zipfile`` (stored, ZIP64):
the small records copied in torch's order, and each storage's record
(``archive/data/N``) streamed from the tensor, or its ranges, as it arrives (``order``
asks for the tensors in torch's storage order, so the layout is torch's). ``zipfile``
computes each record's CRC-32 as it writes; each record's bytes start at a multiple of
the storage alignment (64), padded as torch pads, with an extra field in the local
header, so ``torch.load`` maps them (``mmap=True``). Memory: the tensor (or range)
being written; the sink keeps none. The file is written under a temporary name beside
the target, fsynced and renamed at ``commit``. The provenance metadata has no place in a
``torch.save`` file and is dropped.
"""

from __future__ import annotations

import bisect
import contextlib
import io
import math
import mmap
import os
import pickle
import re
import struct
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.serialization import skip_data

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


def _view_key(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What makes two tensors of a loaded file one and the same (``torch.load`` gives
    tied tensors one storage); None for a tensor with no bytes, which ties nothing."""
    storage = t.untyped_storage()
    if t.numel() == 0 or storage.data_ptr() == 0:
        return None
    return (storage.data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape), t.stride())


class TorchSource:
    def __init__(self, path: Path, options: dict[str, Any] | None = None) -> None:
        self.path = Path(path)
        obj = load_weights_only(self.path)
        if isinstance(obj, torch.Tensor):
            obj = {"tensor": obj}  # a bare tensor gets a name
        self._tensors: dict[str, torch.Tensor] = {}
        self._values: dict[str, Value] = {}
        self._aliases: dict[str, str] = {}
        first: dict[tuple[Any, ...], str] = {}
        for name, leaf in _nested.flatten(obj):
            if isinstance(leaf, torch.Tensor):
                if leaf.layout != torch.strided:
                    _nested.log.warning(
                        "%s: skipping %r: a %s tensor", self.path, name, leaf.layout
                    )
                    continue
                view = _view_key(leaf)
                if view is not None and view in first:  # tied: the same view again
                    self._aliases[name] = first[view]
                    continue
                if view is not None:
                    first[view] = name
                self._tensors[name] = leaf
            else:
                self._values.update(_nested.plain_values(name, leaf, str(self.path)))

    def tensors(self) -> Iterator[TensorInfo]:
        for name, t in self._tensors.items():
            yield TensorInfo(name, t.dtype, tuple(t.shape))

    def aliases(self) -> dict[str, str]:
        """Names that are the same tensor as an earlier one (tied weights: the same
        storage, offset, dtype, shape and strides), each to that first name."""
        return dict(self._aliases)

    def read(self, info: TensorInfo) -> torch.Tensor:
        return self._tensors[info.name].detach().contiguous()

    def values(self) -> dict[str, Value]:
        return dict(self._values)

    def metadata(self) -> dict[str, str]:
        return {"format": "torch", "source": str(self.path)}

    def close(self) -> None:
        self._tensors.clear()


class _Sparse:
    """A file object in memory for ``torch.save`` under ``skip_data``: torch writes the
    zip's headers and small records and seeks over the storages' bytes, which are never
    stored (a hole reads as zeros). ``zipfile`` then reads the small records back from it.
    Memory: the headers and the small records (the pickle), not the tensors."""

    def __init__(self) -> None:
        self._starts: list[int] = []  # offsets of the written pieces, ascending
        self._pieces: list[bytes] = []
        self._pos = 0
        self._size = 0

    def write(self, data: Any) -> int:
        piece = bytes(data)
        if self._starts and self._pos < self._starts[-1] + len(self._pieces[-1]):
            raise io.UnsupportedOperation("torch skeleton: a write behind the end")
        if piece:
            self._starts.append(self._pos)
            self._pieces.append(piece)
        self._pos += len(piece)
        self._size = max(self._size, self._pos)
        return len(piece)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise ValueError("torch skeleton: a seek before the start")
        self._pos = base + offset
        self._size = max(self._size, self._pos)  # a hole at the end is still the file's
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, n: int = -1) -> bytes:
        end = self._size if n is None or n < 0 else min(self._size, self._pos + n)
        out = bytearray(max(0, end - self._pos))
        k = max(0, bisect.bisect_right(self._starts, self._pos) - 1)
        while k < len(self._starts) and self._starts[k] < end:
            a, piece = self._starts[k], self._pieces[k]
            lo, hi = max(a, self._pos), min(a + len(piece), end)
            if lo < hi:
                out[lo - self._pos : hi - self._pos] = piece[lo - a : hi - a]
            k += 1
        self._pos = max(self._pos, end)
        return bytes(out)

    def flush(self) -> None:
        pass

    def seekable(self) -> bool:
        return True


_ALIGN = 64  # torch's storage alignment when the skeleton does not name one
_PAD_ID = b"FB"  # the id of the extra field torch pads its local headers with
_ZIP64_EXTRA = 20  # the ZIP64 extra zipfile adds to a local header (force_zip64)


class _Slot:
    """A placeholder for a tensor in the nested state, by name (``_storage_order``)."""

    def __init__(self, name: str) -> None:
        self.name = name


def _storage_order(
    names: list[str], aliases: dict[str, str], values: dict[str, Value]
) -> list[str]:
    """The tensors (aliases resolved) in the order ``torch.save`` of the nested state
    numbers their storages: the order the pickler first meets them, walking the nested
    dicts in insertion order, which is the order ``_nested.flatten`` walks them."""
    slots = {n: _Slot(n) for n in names}
    leaves: dict[str, Any] = dict(slots)
    leaves.update({a: slots[t] for a, t in aliases.items()})
    leaves.update(values)
    out: list[str] = []
    seen: set[str] = set()
    for _, leaf in _nested.flatten(_nested.unflatten(leaves)):
        if isinstance(leaf, _Slot) and leaf.name not in seen:
            seen.add(leaf.name)
            out.append(leaf.name)
    return out


def _placeholders(infos: list[TensorInfo]) -> dict[str, torch.Tensor]:
    """A tensor of each ``info``'s dtype and shape whose memory is never touched: each
    is a storage of its own (one storage key each in ``torch.save``) cut from one
    read-only anonymous mapping, reserved and never committed, so that neither RSS nor
    the kernel's commit charge grows with the checkpoint's size. (A ``torch.empty`` per
    tensor would cost about a page of RSS for each one below malloc's mmap threshold,
    measured 430 MiB for 100,000 tensors of 16 KiB, and fails for a tensor larger than
    the memory the kernel commits; ``torch.save`` under ``skip_data`` reads neither.)"""
    offsets: list[int] = []
    total = 0
    for info in infos:
        offsets.append(total)
        total += -(-max(1, info.nbytes) // _ALIGN) * _ALIGN  # distinct, aligned addresses
    if not infos:
        return {}
    area = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
    with warnings.catch_warnings():  # read-only on purpose: nothing writes to it
        warnings.simplefilter("ignore", UserWarning)
        whole = torch.frombuffer(area, dtype=torch.uint8).untyped_storage()
    out: dict[str, torch.Tensor] = {}
    for info, off in zip(infos, offsets, strict=True):
        storage = whole[off : off + info.nbytes]
        t = torch.empty(0, dtype=info.dtype)
        out[info.name] = t.set_(storage, 0, info.shape, _contiguous_strides(info.shape))
    return out


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides: list[int] = []
    step = 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(1, n)
    return tuple(reversed(strides))


class _Record:
    """One record of the zip, read from the skeleton: a storage's (``key``, no bytes) or
    a small one (``data``)."""

    def __init__(self, info: zipfile.ZipInfo, key: str | None, data: bytes) -> None:
        self.info, self.key, self.data = info, key, data


def _skeleton(nested: dict[str, Any]) -> list[_Record]:
    """``torch.save(nested)`` under ``skip_data`` into memory (``_Sparse``: the storages'
    bytes are holes, never stored), read back with ``zipfile``: torch's own records, in
    torch's order, the small ones with their bytes."""
    buf = _Sparse()
    with skip_data():
        torch.save(nested, buf)
    records: list[_Record] = []
    with zipfile.ZipFile(buf) as zf:  # type: ignore[arg-type]
        for info in zf.infolist():
            m = re.fullmatch(r"(?:[^/]*/)?data/(\d+)", info.filename)
            key = m.group(1) if m else None
            records.append(_Record(info, key, b"" if key is not None else zf.read(info)))
    return records


class TorchSink:
    """Writes one file in ``torch.save``'s format, tensor by tensor (see the module's
    docstring): the zip's records are torch's own, from ``torch.save`` of the state with
    placeholders under ``skip_data``; each storage's record is streamed from the tensors
    given, so memory is the tensor (or range) being written. Used without ``begin`` (as
    the bare ``Sink`` contract allows), it gathers the tensors and writes them at
    ``commit``."""

    keeps_tensors = False  # each write is done with the tensor's memory when it returns

    def __init__(self, path: Path, options: dict[str, Any] | None = None) -> None:
        self.path = Path(path)
        self._tmp = _nested.temp_name(self.path)
        self._values: dict[str, Value] = {}
        self._planned: dict[str, TensorInfo] = {}
        self._keys: dict[str, str] = {}  # tensor name -> its storage's key
        self._records: dict[str, _Record] = {}  # storage key -> its record
        self._trailer: list[_Record] = []  # the small records after the storages
        self._written: set[str] = set()  # tensors whose record is complete
        self._current: tuple[str, Any, int] | None = None  # name, open record, elements
        self._gathered: dict[str, torch.Tensor] = {}  # written before any begin()
        self._file: Any = None
        self._zip: zipfile.ZipFile | None = None
        self._align = _ALIGN

    def write_values(self, values: dict[str, Value]) -> None:
        if self._zip is not None:
            raise RuntimeError("torch sink: write_values() after begin()")
        self._values = dict(values)

    def order(self, infos: list[TensorInfo], aliases: dict[str, str]) -> list[TensorInfo]:
        """The tensors in the order ``torch.save`` numbers (and lays out) their storages,
        so that the file is laid out as torch lays it out."""
        by_name = {i.name: i for i in infos}
        return [by_name[n] for n in _storage_order(list(by_name), aliases, self._values)]

    def begin(
        self,
        infos: list[TensorInfo],
        aliases: dict[str, str],
        metadata: dict[str, str] | None = None,
    ) -> None:
        """Write the records that come before the storages' (the pickle first) under a
        temporary name; each tensor's record follows as it is written."""
        planned = {i.name: i for i in infos}
        if len(planned) != len(infos):
            raise ValueError("a tensor name is given twice")
        for alias, target in aliases.items():
            if target not in planned:
                raise ValueError(f"{alias}: an alias of {target!r}, not a tensor given")
        order = _storage_order(list(planned), aliases, self._values)
        fakes = _placeholders(infos)
        leaves: dict[str, Any] = dict(fakes)
        leaves.update({a: fakes[t] for a, t in aliases.items()})  # one storage: tied
        leaves.update(self._values)
        records = _skeleton(_nested.unflatten(leaves))
        del fakes, leaves  # the reserved mapping goes with them
        keys = {n: str(k) for k, n in enumerate(order)}
        storages = {r.key: r for r in records if r.key is not None}
        if (
            set(storages) != set(keys.values())
            or any(storages[keys[n]].info.file_size != planned[n].nbytes for n in order)
            or not self._numbered_as(order, planned, aliases)
        ):
            raise RuntimeError(  # torch numbered its storages otherwise: refuse to guess
                f"{self.path}: torch.save laid out {len(storages)} storages, not the "
                f"{len(order)} tensors in the order snapcore expects"
            )
        for r in records:
            if r.key is None and r.info.filename.endswith("/.storage_alignment"):
                self._align = int(r.data.decode("ascii"))
        self._planned, self._keys, self._records = planned, keys, storages
        first = next((k for k, r in enumerate(records) if r.key is not None), len(records))
        self._trailer = [r for r in records[first:] if r.key is None]
        self._remove_tmp()
        self._file = open(self._tmp, "wb")  # noqa: SIM115 (closed by commit or abort)
        self._zip = zipfile.ZipFile(self._file, "w", zipfile.ZIP_STORED, allowZip64=True)
        for r in records[:first]:
            self._put(r.info, r.data)

    def _numbered_as(
        self, order: list[str], planned: dict[str, TensorInfo], aliases: dict[str, str]
    ) -> bool:
        """Whether ``torch.save`` numbers the storages as ``order`` says (storage ``k``
        is ``order[k]``). The sizes checked in ``begin`` cannot tell tensors of one size
        apart (a permutation of them would put each one's bytes under another's key):
        where two sizes are equal, a second skeleton with placeholders of distinct sizes
        (``order[k]``: ``k + 1`` bytes) names each storage by its size."""
        sizes = [planned[n].nbytes for n in order]
        if len(set(sizes)) == len(sizes):
            return True  # the sizes identify the storages already
        size = {n: k + 1 for k, n in enumerate(order)}
        # the state as begin() gives it to torch.save (its insertion order), other sizes
        fakes = _placeholders([TensorInfo(n, torch.uint8, (size[n],)) for n in planned])
        leaves: dict[str, Any] = dict(fakes)
        leaves.update({a: fakes[t] for a, t in aliases.items()})
        leaves.update(self._values)
        records = _skeleton(_nested.unflatten(leaves))
        del fakes, leaves
        return all(r.info.file_size == int(r.key) + 1 for r in records if r.key is not None)

    def _open(self, like: zipfile.ZipInfo, size: int) -> Any:
        """Open a record named as ``like`` for ``size`` bytes, its bytes starting at a
        multiple of the storage alignment (torch's reader maps them, ``mmap=True``):
        torch pads with an extra field in the local header, and so does this."""
        assert self._zip is not None
        info = zipfile.ZipInfo(like.filename, date_time=like.date_time)
        info.compress_type = zipfile.ZIP_STORED
        info.file_size = size
        fixed = 30 + len(info.filename.encode("utf-8")) + 4 + _ZIP64_EXTRA
        pad = -(self._file.tell() + fixed) % self._align
        info.extra = _PAD_ID + struct.pack("<H", pad) + b"Z" * pad
        out = self._zip.open(info, "w", force_zip64=True)
        if self._file.tell() % self._align:
            out.close()
            raise RuntimeError(f"{self._tmp}: {info.filename}'s bytes are not aligned")
        return out

    def _put(self, like: zipfile.ZipInfo, data: bytes) -> None:
        with self._open(like, len(data)) as out:
            out.write(data)

    def _target(self, info: TensorInfo, t: torch.Tensor, shaped: bool, what: str) -> str:
        if self._zip is None:
            raise RuntimeError("torch sink: begin() was not called")
        planned = self._planned.get(info.name)
        if planned is None:
            raise ValueError(f"{info.name}: not a tensor given to begin()")
        if planned != info or t.dtype != info.dtype or not shaped or t.device.type != "cpu":
            shape = "1-D, " if what else ""
            raise ValueError(
                f"{info.name}: given {what}{t.dtype} {tuple(t.shape)} on {t.device}, "
                f"planned {planned.dtype} {planned.shape} ({shape}CPU)"
            )
        if info.name in self._written:
            raise ValueError(f"{info.name}: written twice")
        return self._keys[info.name]

    def _append(self, info: TensorInfo, start: int, piece: torch.Tensor) -> None:
        """Elements ``[start, start + piece.numel())`` of ``info``, appended to its
        record (opened by its first piece, closed by its last: a record is written in
        one go, so the pieces of one tensor come in order, before the next tensor)."""
        numel = math.prod(info.shape)
        if self._current is None:
            if start != 0:
                raise ValueError(f"{info.name}: range at {start}, expected 0")
            record = self._records[self._keys[info.name]]
            self._current = (info.name, self._open(record.info, info.nbytes), 0)
        name, out, done = self._current
        if name != info.name:
            raise ValueError(f"{info.name}: written while {name} is half written")
        n = piece.numel()
        if start != done or start + n > numel:
            raise ValueError(f"{info.name}: range [{start}, {start + n}) is out of order")
        out.write(piece.detach().reshape(-1).view(torch.uint8).numpy())
        done += n
        self._current = (name, out, done)
        if done == numel:
            self._current = None
            out.close()  # zipfile writes the record's CRC-32 and sizes into its header
            self._written.add(name)

    def write(self, info: TensorInfo, tensor: torch.Tensor) -> None:
        if self._zip is None:  # used without begin(): gathered, written by commit
            if info.name in self._gathered:
                raise ValueError(f"{info.name}: written twice")
            self._gathered[info.name] = tensor.detach().clone()
            return
        self._target(info, tensor, tuple(tensor.shape) == info.shape, "")
        self._append(info, 0, tensor.contiguous())

    def write_range(self, info: TensorInfo, start: int, piece: torch.Tensor) -> None:
        """Elements ``[start, start + piece.numel())`` of ``info`` (1-D, CPU), in order:
        a tensor larger than the converter's window is never whole in memory."""
        self._target(info, piece, piece.dim() == 1, "a range ")
        self._append(info, start, piece.contiguous())

    def commit(self, metadata: dict[str, str]) -> None:
        try:
            if self._zip is None:  # used without begin(): what write() gathered
                gathered, self._gathered = self._gathered, {}
                infos = [TensorInfo(n, t.dtype, tuple(t.shape)) for n, t in gathered.items()]
                infos = self.order(infos, {})
                self.begin(infos, {}, metadata)
                for info in infos:
                    self.write(info, gathered.pop(info.name))
            missing = [n for n in self._planned if n not in self._written]
            if missing:
                raise ValueError(f"torch sink: not written: {', '.join(missing[:5])}")
            for r in self._trailer:
                self._put(r.info, r.data)
            assert self._zip is not None
            self._zip.close()  # the central directory
            self._zip = None
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None
            _nested.commit_rename(self._tmp, self.path)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        self._gathered.clear()
        current, self._current = self._current, None
        zf, self._zip = self._zip, None
        f, self._file = self._file, None
        with contextlib.suppress(Exception):  # the file is removed: errors do not matter
            if current is not None:
                current[1].close()
            if zf is not None:
                zf.close()
        if f is not None:
            with contextlib.suppress(OSError):
                f.close()
        self._remove_tmp()

    def _remove_tmp(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._tmp)


FORMAT = register(
    Format(
        name="torch",
        detect=detect,
        source=lambda path, options: TorchSource(path, options),
        sink=lambda path, options: TorchSink(path, options),
    )
)
