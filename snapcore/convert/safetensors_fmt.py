"""Format ``safetensors``: one ``.safetensors`` file, or a directory in Hugging Face's
sharded layout (``model-00001-of-0000N.safetensors`` and ``model.safetensors.index.json``
with ``metadata.total_size`` and ``weight_map``).

snapcore reads and writes the format itself, streaming, and never imports the
``safetensors`` library (the tests use it, and transformers, as the judges of what is
written here). The format (https://huggingface.co/docs/safetensors): an 8-byte
little-endian unsigned length ``N``, then ``N`` bytes of UTF-8 JSON (padded with spaces),
then the tensors' bytes. The JSON maps each tensor's name to ``{"dtype": "F32",
"shape": [...], "data_offsets": [begin, end]}`` (offsets into the bytes after the header,
contiguous, covering them exactly, little-endian, C order) plus an optional
``"__metadata__"`` of strings.

Source: each file's header is read and checked before any tensor (``_read_header``: a
bounded length, strict JSON without duplicate keys, known dtypes, sizes that match the
offsets, offsets that tile the rest of the file exactly); anything else raises
``InvalidManifest`` naming the file. A tensor is read straight into the converter's
buffer (``read_into``: O_DIRECT where the file system takes it, several pieces in
flight, the page cache otherwise) or into a new tensor: one tensor in memory at a time;
a tensor larger than the converter's window is read range by range instead
(``read_range``), never whole. A file cut short after its header was checked raises
``CorruptSnapshot`` naming the file and the tensor. Aliases are
safetensors' own convention (``save_model``): a ``__metadata__`` entry ``{removed name:
kept name}`` for a tensor that shared storage with a kept one; values written by this
module come back from ``snapcore.values``.

Sink: a single file when every tensor fits one ``--shard-size``, else the sharded
layout, shards cut at ``--shard-size`` the way ``save_pretrained`` cuts them (a tensor
larger than the size gets a shard of its own). ``begin`` gets every tensor up front, so
each file's header (and every tensor's offset in it) is known before its first tensor
arrives: tensors are laid out as the library's writer lays them out (larger items first,
then by name, so each is aligned to its item size) and each one is written at its offset
(``pwrite``) as it arrives and dropped: the sink holds no tensor (a tensor larger than
the converter's window arrives in ranges, ``write_range``, each written at its place).
Every header's ``__metadata__`` holds ``format: pt`` and the aliases whose kept tensor
is in that file; the last file's (the only one's) also holds the provenance
(``snapcore.*`` keys) and the values as one JSON object (``snapcore.values``); the
driver gives both before the first tensor (values, then ``begin``'s ``metadata``).
Tensors that were one tensor in the source are written once, as ``save_model`` does.
Everything is written into a temporary directory beside the target, fsynced, and renamed
into place by ``commit``; ``abort`` removes it.
"""

from __future__ import annotations

import ctypes
import errno
import json
import math
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import settings
from ..durable import fsync_dir, fsync_file
from ..errors import CorruptSnapshot, InvalidManifest
from ..planning.layout import ALIGN, align_up
from .base import Format, TensorInfo, Value, register

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
VALUES_KEY = "snapcore.values"
META_KEY = "__metadata__"
# the library's own bound on a header (its MAX_HEADER_SIZE): refused before it is read
MAX_HEADER = 100_000_000
_SHARD = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")

# the format's dtype names (its spec) and their torch types
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
_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in _DTYPES.items()}
# the order in which the library's writer lays tensors out (then by name): wider items
# first, so that each tensor starts at a multiple of its item size
_ORDER = ("U64", "I64", "F64", "C64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16")
_ORDER += ("F8_E5M2FNUZ", "F8_E4M3FNUZ", "F8_E8M0", "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL")
_RANK = {name: k for k, name in enumerate(_ORDER)}

# O_DIRECT reads (``SafetensorsSource.read_into``): file offsets, lengths and addresses
# aligned to a page (every logical block size up to it), in pieces of DIRECT_PIECE bytes,
# DIRECT_THREADS of them in flight; READ_SLACK: the bytes a buffer needs beyond the range
# it receives (the aligned start of the buffer, the block-aligned head and tail)
DIRECT_ALIGN = 4096
DIRECT_PIECE = 32 << 20
DIRECT_THREADS = 2
READ_SLACK = 3 * DIRECT_ALIGN


def _little_endian() -> None:
    if sys.byteorder != "little":  # the format is little-endian; tensors are copied as is
        raise NotImplementedError("safetensors: only little-endian machines are supported")


def _buffer(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, as a writable buffer (no copy). The caller
    keeps ``t`` alive while the buffer is used."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


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


# -- reading -----------------------------------------------------------------------------
@dataclass(frozen=True)
class _Entry:
    info: TensorInfo
    file: int  # index into the source's files
    offset: int  # absolute, in the file
    nbytes: int


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"the key {k!r} is given twice")
        out[k] = v
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _pread_exact(fd: int, buf: memoryview, offset: int) -> int:
    """Fill ``buf`` from ``offset``; returns the bytes read (fewer only at end of file)."""
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


def _pread_direct(fd: int, address: int, nbytes: int, offset: int) -> int:
    """Fill ``nbytes`` at ``address`` from ``offset`` of an O_DIRECT descriptor (all three
    aligned to ``DIRECT_ALIGN``); returns the bytes read, fewer only at the end of the
    file (a read that stops inside a block has reached it)."""
    done = 0
    while done < nbytes:
        view = memoryview((ctypes.c_char * (nbytes - done)).from_address(address + done))
        n = os.preadv(fd, [view.cast("B")], offset + done)
        done += n
        if n == 0 or n % DIRECT_ALIGN:
            break
    return done


def _read_header(path: Path, fd: int) -> tuple[list[tuple[TensorInfo, int, int]], dict[str, str]]:
    """The tensors of an open safetensors file (info, absolute offset, bytes), in the
    file's order, and its ``__metadata__``; ``InvalidManifest`` naming the file for
    anything the format does not allow. Nothing is read but the length and the header."""

    def bad(why: str) -> InvalidManifest:
        return InvalidManifest(f"{path}: not a valid safetensors file: {why}", file=str(path))

    size = os.fstat(fd).st_size
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        raise bad(f"{size} bytes, too short for the header's length")
    n = int.from_bytes(head, "little")
    if n > MAX_HEADER:
        raise bad(f"a header of {n} bytes (the most is {MAX_HEADER})")
    if 8 + n > size:
        raise bad(f"a header of {n} bytes in a file of {size} bytes (truncated?)")
    raw = bytearray(n)
    if _pread_exact(fd, memoryview(raw), 8) != n:
        raise bad("the header is truncated")
    try:
        text = raw.decode("utf-8")
        if not text.startswith("{"):
            raise ValueError("the header is not a JSON object")
        header = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise bad(f"the header is not valid JSON: {e}") from None
    del raw, text
    if not isinstance(header, dict):
        raise bad("the header is not a JSON object")
    meta = header.pop(META_KEY, None)
    if meta is None:
        meta = {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise bad(f"{META_KEY} is not an object of strings")
    tensors: list[tuple[TensorInfo, int, int, int]] = []  # info, begin, end, position
    for name, spec in header.items():
        where = f"tensor {name!r}"
        if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
            raise bad(f"{where}: not {{dtype, shape, data_offsets}}")
        dtype = _DTYPES.get(spec["dtype"]) if isinstance(spec["dtype"], str) else None
        if dtype is None:
            raise bad(f"{where}: unknown dtype {spec['dtype']!r}")
        shape, offsets = spec["shape"], spec["data_offsets"]
        if not isinstance(shape, list) or not all(type(d) is int and 0 <= d < 2**63 for d in shape):
            raise bad(f"{where}: shape {shape!r} is not a list of non-negative integers")
        if math.prod(max(d, 1) for d in shape) * dtype.itemsize >= 2**63:
            raise bad(f"{where}: shape {shape!r} is too large")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise bad(f"{where}: data_offsets {offsets!r} are not [begin, end]")
        if offsets[1] > size - 8 - n:
            data = size - 8 - n
            raise bad(
                f"{where}: data_offsets {offsets!r} past the {data} bytes of data (truncated?)"
            )
        info = TensorInfo(name, dtype, tuple(shape))
        if offsets[1] - offsets[0] != info.nbytes:
            raise bad(
                f"{where}: data_offsets {offsets!r} hold {offsets[1] - offsets[0]} bytes, "
                f"its dtype and shape {info.nbytes}"
            )
        tensors.append((info, offsets[0], offsets[1], len(tensors)))
    # the offsets tile the data exactly: no gap, no overlap, nothing after the last
    end = 0
    for info, b, e, _ in sorted(tensors, key=lambda t: (t[1], t[2])):
        if b != end:
            what = "overlaps another" if b < end else f"leaves a gap at byte {end}"
            raise bad(f"tensor {info.name!r}: data_offsets [{b}, {e}] {what}")
        end = e
    if 8 + n + end != size:
        raise bad(
            f"the tensors end at byte {8 + n + end} of a file of {size} bytes"
            + (" (truncated?)" if 8 + n + end > size else "")
        )
    out = [(info, 8 + n + b, e - b) for info, b, e, _ in tensors]
    return out, meta


class SafetensorsSource:
    def __init__(self, path: Any, options: dict[str, Any]) -> None:
        _little_endian()
        self.files = _files(Path(path))
        self._entries: dict[str, _Entry] = {}
        self._meta: dict[str, str] = {}
        self._values: dict[str, Value] = {}
        alias_entries: dict[str, str] = {}
        self._open: tuple[int, int, int | None] | None = None  # (file index, fd, O_DIRECT fd)
        # reads into given buffers go through O_DIRECT until the file system refuses it
        self._direct = settings.o_direct() == "auto"
        self._pool: ThreadPoolExecutor | None = None  # the O_DIRECT reads' threads
        self.read_slack = READ_SLACK  # what ``read_into``'s buffers need beyond the bytes
        for k, f in enumerate(self.files):
            fd = os.open(f, os.O_RDONLY)
            try:
                tensors, meta = _read_header(f, fd)
            finally:
                os.close(fd)
            for info, offset, nbytes in tensors:
                if info.name in self._entries:
                    first = self.files[self._entries[info.name].file]
                    raise ValueError(f"{info.name} is in {first} and {f}")
                self._entries[info.name] = _Entry(info, k, offset, nbytes)
            for key, value in meta.items():
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
            if k not in self._entries and v in self._entries and k != "format"
        }
        for k in self._aliases:
            self._meta.pop(k, None)

    def tensors(self) -> Iterator[TensorInfo]:
        return (e.info for e in self._entries.values())

    def aliases(self) -> dict[str, str]:
        return dict(self._aliases)

    def read(self, info: TensorInfo) -> torch.Tensor:
        return self.read_into(info, None, None, None)

    def read_range(self, info: TensorInfo, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of the tensor in C order (a positioned read of
        that byte range only), as a 1-D tensor."""
        return self.read_into(info, start, stop, None)

    def read_into(
        self, info: TensorInfo, start: int | None, stop: int | None, buf: torch.Tensor | None
    ) -> torch.Tensor:
        """The tensor (``start`` None) or its elements ``[start, stop)`` as a 1-D tensor,
        read into the bytes of ``buf`` (a uint8 tensor at least that large, which the
        result is a view of), or into new memory (``buf`` None). The converter passes
        buffers it reuses from one tensor to the next, faulted in once.

        Into a buffer with ``read_slack`` bytes to spare, the read goes around the page
        cache (O_DIRECT: the block-aligned bytes around the range, several pieces in
        flight) and the result starts at a 64-byte aligned address of ``buf`` (the
        sink's O_DIRECT writes need it); where O_DIRECT is off or refused
        (``SNAPCORE_O_DIRECT=off``; tmpfs before Linux 6.6, some FUSE), and into new
        memory, with positioned reads through the page cache."""
        entry = self._entries[info.name]
        dtype = entry.info.dtype
        numel = math.prod(entry.info.shape)
        if start is None:
            start, stop, shape = 0, numel, tuple(entry.info.shape)
        else:
            assert stop is not None
            if not 0 <= start <= stop <= numel:
                raise ValueError(f"{info.name}: elements [{start}, {stop}) of {numel}")
            shape = (stop - start,)
        fd, direct_fd = self._file(entry.file)
        n = (stop - start) * dtype.itemsize
        at = entry.offset + start * dtype.itemsize
        if buf is None:
            t = torch.empty(shape, dtype=dtype)
        else:
            if buf.dtype != torch.uint8 or buf.numel() < n:
                raise ValueError(f"{info.name}: a buffer of {buf.numel()} bytes for {n}")
            if n and direct_fd is not None and buf.numel() >= n + READ_SLACK:
                first = self._read_direct(entry, direct_fd, at, n, buf)
                if first is not None:
                    return buf[first : first + n].view(dtype).view(shape)
            t = buf[:n].view(dtype).view(shape)
        if n and _pread_exact(fd, _buffer(t), at) != n:
            raise self._truncated(entry)
        return t

    def _truncated(self, entry: _Entry) -> CorruptSnapshot:
        where = str(self.files[entry.file])
        return CorruptSnapshot(
            f"{where}: {entry.info.name}: the file ends inside the tensor (truncated since "
            "it was opened?)",
            tensor=entry.info.name,
            file=where,
        )

    def _file(self, k: int) -> tuple[int, int | None]:
        """The descriptors of file ``k`` (buffered, and O_DIRECT where used), opened once
        while its tensors are read."""
        if self._open is None or self._open[0] != k:
            self._close()
            fd = os.open(self.files[k], os.O_RDONLY)
            direct_fd = None
            if self._direct:
                try:
                    direct_fd = os.open(self.files[k], os.O_RDONLY | os.O_DIRECT)
                except OSError:  # EINVAL: a file system without O_DIRECT (old tmpfs, some FUSE)
                    self._direct = False
            self._open = (k, fd, direct_fd)
        return self._open[1], self._open[2]

    def _read_direct(
        self, entry: _Entry, fd: int, at: int, n: int, buf: torch.Tensor
    ) -> int | None:
        """Bytes ``[at, at + n)`` of the entry's file into ``buf`` through the O_DIRECT
        descriptor ``fd``: the block-aligned bytes around them are read in pieces on
        ``DIRECT_THREADS`` threads, and each piece, once read, is moved down by the few
        bytes that put the first byte at a 64-byte aligned address (while the next
        pieces are still being read). Returns where in ``buf`` the bytes start, or None
        where the file system refuses the read (O_DIRECT is then off for this source)."""
        base = buf.data_ptr()
        first = at - at % DIRECT_ALIGN  # the file's bytes [first, end) are read...
        end = align_up(at + n, DIRECT_ALIGN)
        into = align_up(base, DIRECT_ALIGN)  # ... to address ``into``
        assert into + (end - first) <= base + buf.numel()  # READ_SLACK covers it
        head = at - first
        shift = (into + head) % ALIGN  # the data start moves down to an aligned address
        if self._pool is None:
            self._pool = ThreadPoolExecutor(DIRECT_THREADS, thread_name_prefix="snapcore-read")
        pieces = [
            (k, min(DIRECT_PIECE, end - first - k)) for k in range(0, end - first, DIRECT_PIECE)
        ]
        futures: list[Future[int]] = [
            self._pool.submit(_pread_direct, fd, into + k, m, first + k) for k, m in pieces
        ]
        got = 0  # bytes read, from ``first``, without a gap
        try:
            for (k, m), future in zip(pieces, futures, strict=True):
                r = future.result()
                lo, hi = max(k, head), min(k + r, head + n)  # the range's bytes in this piece
                if shift and hi > lo:  # below it: the previous piece, moved already
                    ctypes.memmove(into + lo - shift, into + lo, hi - lo)
                got = k + r
                if r < m:  # the end of the file
                    break
        except OSError as e:
            wait(futures)  # no read may still write into the buffer
            if e.errno == errno.EINVAL and self._open is not None:  # O_DIRECT refused
                self._direct = False
                os.close(fd)
                self._open = (self._open[0], self._open[1], None)
                return None
            where = str(self.files[entry.file])
            raise OSError(e.errno, f"{e.strerror} (reading {entry.info.name})", where) from None
        finally:
            wait(futures)
        if got < head + n:
            raise self._truncated(entry)
        return into + head - shift - base

    def values(self) -> dict[str, Value]:
        return dict(self._values)

    def metadata(self) -> dict[str, str]:
        out = {k: v for k, v in self._meta.items() if k != "format"}
        out["source_format"] = "safetensors"
        return out

    def _close(self) -> None:
        if self._open is not None:
            _, fd, direct_fd = self._open
            self._open = None
            os.close(fd)
            if direct_fd is not None:
                os.close(direct_fd)

    def close(self) -> None:
        self._close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


# -- writing -----------------------------------------------------------------------------
def _layout(infos: list[TensorInfo]) -> dict[str, tuple[int, int]]:
    """Each tensor's data_offsets in its file, in the library writer's order (``_ORDER``,
    then by name): every tensor starts at a multiple of its item size, as the header is
    padded to 8 bytes, and a file is byte for byte the one ``save_file`` would write."""
    out: dict[str, tuple[int, int]] = {}
    at = 0
    for info in sorted(infos, key=lambda i: (_RANK[_NAMES[i.dtype]], i.name)):
        out[info.name] = (at, at + info.nbytes)
        at += info.nbytes
    return out


class _File:
    """One file being written: its header is on disk before the first tensor, each tensor
    goes to its offset as it arrives."""

    def __init__(self, path: Path, infos: list[TensorInfo], meta: dict[str, str]) -> None:
        self.path = path
        self.infos = infos
        self.meta = meta
        self.offsets = _layout(infos)
        self.missing = {i.name for i in infos}
        self.progress: dict[str, int] = {}  # bytes written of a tensor given in ranges
        self.fd: int | None = None
        self.data_start = 0
        self.finished = False

    def header(self) -> bytes:
        by_name = {i.name: i for i in self.infos}
        header: dict[str, Any] = {META_KEY: self.meta}
        for name, (b, e) in sorted(self.offsets.items(), key=lambda kv: kv[1]):
            info = by_name[name]
            header[name] = {
                "dtype": _NAMES[info.dtype],
                "shape": list(info.shape),
                "data_offsets": [b, e],
            }
        raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        return len(raw).to_bytes(8, "little") + raw

    def open(self) -> None:
        head = self.header()
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        _pwrite_all(self.fd, memoryview(head), 0)
        self.data_start = len(head)

    def write(self, info: TensorInfo, tensor: torch.Tensor) -> None:
        if self.fd is None:
            self.open()
        assert self.fd is not None
        b, e = self.offsets[info.name]
        if e > b:
            _pwrite_all(self.fd, _buffer(tensor), self.data_start + b)
        self.missing.discard(info.name)

    def write_range(self, info: TensorInfo, start: int, piece: torch.Tensor) -> None:
        """Elements ``[start, start + piece.numel())`` of ``info``, in order: the tensor
        counts as written once its last range is."""
        if self.fd is None:
            self.open()
        assert self.fd is not None
        b, e = self.offsets[info.name]
        done = self.progress.get(info.name, 0)
        at = start * info.dtype.itemsize
        n = piece.numel() * piece.element_size()
        if at != done or b + at + n > e:
            raise ValueError(
                f"{info.name}: bytes [{at}, {at + n}) given after {done} of {e - b}: ranges "
                "must come in order and stay inside the tensor"
            )
        if n:
            _pwrite_all(self.fd, _buffer(piece), self.data_start + b + at)
        self.progress[info.name] = at + n
        if at + n == e - b:
            self.missing.discard(info.name)
            del self.progress[info.name]

    def finish(self) -> None:
        """Every tensor is in: size, fsync, close."""
        if self.missing:
            raise ValueError(f"{self.path.name}: {sorted(self.missing)[0]} was never written")
        if self.fd is None:
            self.open()  # a file with no tensor
        assert self.fd is not None
        os.ftruncate(self.fd, self.data_start + sum(i.nbytes for i in self.infos))
        os.fsync(self.fd)
        self.close()
        self.finished = True

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _pwrite_all(fd: int, buf: memoryview, offset: int) -> None:
    done = 0
    while done < len(buf):
        done += os.pwrite(fd, buf[done:], offset + done)


class SafetensorsSink:
    def __init__(self, path: Any, options: dict[str, Any]) -> None:
        _little_endian()
        self.target = Path(path).absolute()
        self.shard_size = int(options.get("shard_size") or 5 * 1000**3)
        self._tmp: Path | None = None
        self._shards: list[list[TensorInfo]] = []
        self._shard_of: dict[str, int] = {}
        self._planned: dict[str, TensorInfo] = {}
        self._files: dict[int, _File] = {}
        self._aliases: dict[str, str] = {}
        self._values: dict[str, Value] = {}
        self._metadata: dict[str, str] = {}
        self._began = False

    keeps_tensors = False  # each write is done with the tensor's memory when it returns

    # -- planning ----------------------------------------------------------------------
    def begin(
        self,
        infos: list[TensorInfo],
        aliases: dict[str, str],
        metadata: dict[str, str] | None = None,
    ) -> None:
        """The tensors to come, in order, the aliases among them and the provenance
        ``commit`` will be given (the last file's header needs it before its first tensor;
        a different one at ``commit`` rewrites that header, copying the file)."""
        for info in infos:
            if info.dtype not in _NAMES:
                raise ValueError(f"{info.name}: safetensors has no dtype for {info.dtype}")
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
        self._planned = {i.name: i for i in infos}
        if len(self._shard_of) != len(infos):
            raise ValueError("a tensor name is given twice")
        self._aliases = dict(aliases)
        self._metadata = dict(metadata or {})
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

    def _meta(self, k: int) -> dict[str, str]:
        meta = {"format": "pt"}
        if k == len(self._shards) - 1:
            meta |= {
                (key if key.startswith("snapcore.") else f"snapcore.{key}"): str(v)
                for key, v in self._metadata.items()
            }
            if self._values:
                meta[VALUES_KEY] = json.dumps(self._values, separators=(",", ":"))
        names = {i.name for i in self._shards[k]}
        meta |= {a: t for a, t in sorted(self._aliases.items()) if t in names}
        return meta

    def _file(self, k: int) -> _File:
        if k not in self._files:
            assert self._tmp is not None
            self._files[k] = _File(self._tmp / self._name(k), self._shards[k], self._meta(k))
        return self._files[k]

    # -- writing -----------------------------------------------------------------------
    def write_values(self, values: dict[str, Value]) -> None:
        self._values = dict(values)

    def write(self, info: TensorInfo, tensor: torch.Tensor) -> None:
        whole = tuple(tensor.shape) == info.shape
        f = self._file_for(info, tensor, whole, "")
        if info.name in f.progress:
            raise ValueError(f"{info.name}: written twice")
        f.write(info, tensor)
        self._finish_full(f)

    def write_range(self, info: TensorInfo, start: int, piece: torch.Tensor) -> None:
        """Elements ``[start, start + piece.numel())`` of ``info`` (1-D, CPU,
        contiguous), written at their place in the file: a tensor larger than the
        converter's window is never whole in memory."""
        f = self._file_for(info, piece, piece.dim() == 1, "a range ")
        f.write_range(info, start, piece)
        self._finish_full(f)

    def _file_for(self, info: TensorInfo, t: torch.Tensor, shaped: bool, what: str) -> _File:
        """The file ``info`` was planned in, once ``t`` (the tensor, or ``what``: a range
        of it) is checked against the plan: its dtype, CPU, contiguous, and ``shaped``
        (the tensor's shape, or 1-D for a range); not yet written."""
        if not self._began:
            raise RuntimeError("safetensors sink: begin() was not called")
        k = self._shard_of.get(info.name)
        if k is None:
            raise ValueError(f"{info.name}: not a tensor given to begin()")
        planned = self._planned[info.name]
        if (
            planned != info
            or t.dtype != info.dtype
            or not shaped
            or t.device.type != "cpu"
            or not t.is_contiguous()
        ):
            shape = "1-D, " if what else ""
            raise ValueError(
                f"{info.name}: given {what}{t.dtype} {tuple(t.shape)} on {t.device}, "
                f"planned {planned.dtype} {planned.shape} ({shape}CPU, contiguous)"
            )
        f = self._file(k)
        if info.name not in f.missing:
            raise ValueError(f"{info.name}: written twice")
        return f

    def _finish_full(self, f: _File) -> None:
        """Finish ``f`` once its last tensor is in (the last file is finished by commit)."""
        if not f.missing and f is not self._files.get(len(self._shards) - 1):
            f.finish()

    def commit(self, metadata: dict[str, str]) -> None:
        if not self._began:
            self.begin([], {}, metadata)
        assert self._tmp is not None
        last = len(self._shards) - 1
        for k in range(last):
            if not self._file(k).finished:
                self._file(k).finish()  # raises: a tensor is missing
        self._metadata = dict(metadata)
        f = self._file(last)
        f.finish()
        if self._meta(last) != f.meta:  # values or provenance other than begin's
            _rewrite_header(f, self._meta(last))
        if len(self._shards) > 1:
            self._write_index()
        fsync_dir(self._tmp)
        if self.target.suffix == ".safetensors":
            os.replace(self._tmp / self._name(0), self.target)
            shutil.rmtree(self._tmp, ignore_errors=True)
        else:
            if self.target.is_dir():
                self.target.rmdir()  # empty, as convert checked
            os.replace(self._tmp, self.target)
        self._tmp = None
        fsync_dir(self.target.parent)

    def _write_index(self) -> None:
        assert self._tmp is not None
        total = sum(i.nbytes for s in self._shards for i in s)
        weight_map = {i.name: self._name(k) for k, s in enumerate(self._shards) for i in s}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        path = self._tmp / INDEX
        path.write_text(json.dumps(index, indent=2) + "\n")
        fsync_file(path)

    def abort(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None


def _rewrite_header(f: _File, meta: dict[str, str]) -> None:
    """Give a finished file another ``__metadata__``: a new file with the new header and
    the old one's tensor bytes (copied in the kernel where it can), renamed over it."""
    new = _File(f.path.with_name(f.path.name + ".new"), f.infos, meta)
    new.open()
    assert new.fd is not None
    length = sum(i.nbytes for i in f.infos)
    src = os.open(f.path, os.O_RDONLY)
    try:
        done = 0
        while done < length:
            a, b = f.data_start + done, new.data_start + done
            if hasattr(os, "copy_file_range"):
                n = os.copy_file_range(src, new.fd, min(length - done, 1 << 30), a, b)
            else:
                n = os.pwrite(new.fd, os.pread(src, min(length - done, 1 << 24), a), b)
            if n <= 0:
                raise OSError(f"{f.path}: ends before its tensors")
            done += n
        os.fsync(new.fd)
    finally:
        os.close(src)
        new.close()
    os.replace(new.path, f.path)
    f.meta, f.data_start = meta, new.data_start


FORMAT = register(Format("safetensors", detect, SafetensorsSource, SafetensorsSink))
