"""Manifest of a snapshot (format v2, docs/format.md): build, serialise, parse defensively.

Parsing never trusts the file: JSON size is capped before parsing, the schema is checked,
then every cross-reference, size and offset is checked before anything is read or
allocated.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any, NoReturn

import fastjsonschema
import torch

from .errors import InvalidManifest
from .tree import decode_float

FORMAT_VERSION = 2
KIND = "snapcore.snapshot"
MAX_MANIFEST_BYTES = 64 << 20
MAX_BYTES = 1 << 62
# A chunk decodes to at most this many bytes (writers make 64 MiB chunks by default,
# SNAPCORE_CHUNK_MB allows up to this): with the file sizes and ZSTD_MAX_RATIO it bounds
# every buffer a reader allocates (docs/format.md, "Allocation").
MAX_CHUNK_BYTES = 1 << 30
# A zstd frame cannot decode to more than 32768 times its size: a block holds at most
# 128 KiB and takes at least 4 bytes (an RLE block: 3 bytes of header, 1 of content).
ZSTD_MAX_RATIO = 32768
# Containers a manifest may hold, counted in its text before it is parsed (a `{` or `[`
# inside a string counts too). They bound what json.loads builds and what validation
# walks: the largest manifest of tensors that fits in 64 MiB holds about 1.4 million
# objects and 2.7 million arrays (benchmarks/bench_manifest.py).
MAX_JSON_OBJECTS = 1 << 21
MAX_JSON_ARRAYS = 1 << 22
_CONTAINER_CAPS = (("{", MAX_JSON_OBJECTS, "objects"), ("[", MAX_JSON_ARRAYS, "arrays"))

DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in [
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "float4_e2m1fn_x2",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "bool",
        "complex64",
        "complex128",
        "complex32",
    ]
    if hasattr(torch, name)
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
ITEMSIZES: dict[str, int] = {k: v.itemsize for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise TypeError(f"snapcore cannot save tensors of dtype {dtype}") from None


@dataclass(frozen=True, slots=True)
class FileRef:
    name: str
    size: int


CODECS = ("none", "zstd", "shuffle-zstd")


def max_stored_length(raw_length: int) -> int:
    """The most bytes a compressed chunk may take (zstd's worst case, with margin)."""
    return raw_length + raw_length // 128 + 1024


@dataclass(frozen=True, slots=True)
class Chunk:
    """``length`` stored bytes at ``offset`` in ``file``; they decode to ``raw_length``
    bytes whose XXH3-128 is ``xxh3`` (the chunk's content address)."""

    file: int
    offset: int
    length: int
    xxh3: str
    codec: str = "none"
    raw_length: int = -1

    def __post_init__(self) -> None:
        if self.raw_length < 0:
            object.__setattr__(self, "raw_length", self.length)


@dataclass(slots=True)
class Blob:
    nbytes: int
    chunks: list[Chunk] = field(default_factory=list)
    element_size: int = 1  # what byte-shuffle groups by


@dataclass(frozen=True, slots=True)
class Piece:
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    blob: int
    byte_offset: int
    strides: tuple[int, ...]


@dataclass(slots=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    pieces: list[Piece]

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.torch_dtype.itemsize


@dataclass(slots=True)
class Manifest:
    step: int
    created_unix: float
    writer: dict[str, Any]
    world_size: int
    rank_files: list[list[int]]
    files: list[FileRef]
    blobs: list[Blob]
    tensors: list[TensorEntry]
    tree: dict[str, Any]

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data (what a restore moves)."""
        return sum(b.nbytes for b in self.blobs)

    @property
    def stored_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "kind": KIND,
            "step": self.step,
            "created_unix": self.created_unix,
            "writer": self.writer,
            "world_size": self.world_size,
            "rank_files": self.rank_files,
            "files": [{"name": f.name, "size": f.size} for f in self.files],
            "blobs": [
                {
                    "nbytes": b.nbytes,
                    "element_size": b.element_size,
                    "chunks": [
                        {
                            "file": c.file,
                            "offset": c.offset,
                            "length": c.length,
                            "raw_length": c.raw_length,
                            "codec": c.codec,
                            "xxh3": c.xxh3,
                        }
                        for c in b.chunks
                    ],
                }
                for b in self.blobs
            ],
            "tensors": [
                {
                    "dtype": t.dtype,
                    "shape": list(t.shape),
                    "pieces": [
                        {
                            "offsets": list(p.offsets),
                            "shape": list(p.shape),
                            "blob": p.blob,
                            "byte_offset": p.byte_offset,
                            "strides": list(p.strides),
                        }
                        for p in t.pieces
                    ],
                }
                for t in self.tensors
            ],
            "tree": self.tree,
        }

    def dumps(self) -> bytes:
        return json.dumps(self.to_json(), separators=(",", ":"), allow_nan=False).encode()


@cache
def schema() -> dict[str, Any]:
    """The manifest's JSON schema (docs/manifest.schema.json), as a dict."""
    text = resources.files("snapcore").joinpath("manifest.schema.json").read_text()
    return dict(json.loads(text))


@cache
def _validator() -> Callable[[Any], Any]:
    # fastjsonschema compiles the schema to Python once: 12x faster than jsonschema on a
    # manifest of 3,000 tensors (0.39 s against 4.7 s), and every read validates.
    return fastjsonschema.compile(schema())


def _reject_constant(name: str) -> None:
    raise ValueError(f"invalid JSON number {name}")


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object with each key once: a duplicate key is refused, not resolved by
    taking the last (readers could otherwise disagree on what a manifest says)."""
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise ValueError(f"duplicate key {k[:100]!r} in an object")
            seen.add(k)
    return d


def _decode_text(data: bytes, where: str) -> str:
    """The manifest's text: UTF-8 without a byte order mark (docs/format.md); json.loads
    would otherwise accept UTF-16 and UTF-32 bytes too."""
    if data.startswith(b"\xef\xbb\xbf"):
        raise InvalidManifest(
            f"{where}: not valid JSON: a manifest is UTF-8 with no byte order mark"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidManifest(f"{where}: not valid JSON: not UTF-8 ({e})") from None


def parse(data: bytes, *, where: str) -> Manifest:
    """Parse and validate manifest bytes; ``where`` names the file in errors."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise InvalidManifest(f"{where}: manifest of {len(data)} bytes exceeds the 64 MiB cap")
    text = _decode_text(data, where)
    for bracket, cap, what in (
        ("{", MAX_JSON_OBJECTS, "objects"),
        ("[", MAX_JSON_ARRAYS, "arrays"),
    ):
        if text.count(bracket) > cap:
            raise InvalidManifest(
                f"{where}: more than {cap} JSON {what} ({bracket!r} counted): over the format's cap"
            )
    try:
        doc = json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_object)
    except (ValueError, RecursionError) as e:
        raise InvalidManifest(f"{where}: not valid JSON: {e}") from None
    del text
    if not isinstance(doc, dict):
        raise InvalidManifest(f"{where}: a manifest must be a JSON object")
    version = doc.get("format_version")
    if version != FORMAT_VERSION:
        raise InvalidManifest(
            f"{where}: format_version {version!r} is not supported (this snapcore reads "
            f"version {FORMAT_VERSION})"
        )
    # The three large arrays are checked by _Arrays (the same rules as the schema's, as
    # code: the compiled schema takes ~14 us per tensor), which builds the Manifest's
    # entries in their place; the schema checks everything else, the tree included.
    skeleton = {k: [] if k in _ARRAYS else v for k, v in doc.items()}
    try:
        _validator()(skeleton)
    except RecursionError:
        raise InvalidManifest(f"{where}: the tree is nested too deeply") from None
    except fastjsonschema.JsonSchemaValueException as e:
        loc = e.name.removeprefix("data").lstrip(".") or "<top>"
        raise InvalidManifest(f"{where}: schema violation at {loc}: {e.message[:300]}") from None
    # JSON Schema's "integer" takes 2.0 too; an index or a count must be an int here.
    for key in ("step", "world_size"):
        if type(doc[key]) is not int:
            _violation(where, key, "must be an integer written without a fraction")
    for r, idx in enumerate(doc["rank_files"]):
        if any(type(i) is not int for i in idx):
            _violation(where, f"rank_files[{r}]", "must hold integers")
    arrays = _Arrays(where)
    m = Manifest(
        step=doc["step"],
        created_unix=float(doc["created_unix"]),
        writer=doc["writer"],
        world_size=doc["world_size"],
        rank_files=doc["rank_files"],
        files=arrays.files(doc["files"]),
        blobs=arrays.blobs(doc["blobs"]),
        tensors=arrays.tensors(doc["tensors"]),
        tree=doc["tree"],
    )
    del doc, skeleton
    check(m, where=where)
    return m


_ARRAYS = ("files", "blobs", "tensors")
_FILE_KEYS = frozenset(("name", "size"))
_BLOB_KEYS = frozenset(("nbytes", "element_size", "chunks"))
_CHUNK_KEYS = frozenset(("file", "offset", "length", "raw_length", "codec", "xxh3"))
_TENSOR_KEYS = frozenset(("dtype", "shape", "pieces"))
_PIECE_KEYS = frozenset(("offsets", "shape", "blob", "byte_offset", "strides"))


def _violation(where: str, loc: str, message: str) -> NoReturn:
    raise InvalidManifest(f"{where}: schema violation at {loc}: {message}")


def _uint(x: object) -> bool:
    return type(x) is int and x >= 0


class _Arrays:
    """Checks the entries of `files`, `blobs` and `tensors` against the schema's rules for
    them (its patterns and enums are read from the schema itself) and replaces each with
    its Manifest object as it goes, so that the JSON and the Manifest are never both
    whole in memory. Stricter than the schema library in two ways: integers are ints
    (2.0 is refused) and a pattern must match the whole string (no trailing newline).
    tests/test_manifest_fuzz.py checks that it refuses all the schema refuses."""

    def __init__(self, where: str) -> None:
        self.where = where
        s = schema()
        files = s["properties"]["files"]["items"]["properties"]
        blobs = s["properties"]["blobs"]["items"]["properties"]
        chunk = s["definitions"]["chunk"]["properties"]
        self.file_name = _pattern(files["name"]["pattern"])
        self.element_sizes = frozenset(blobs["element_size"]["enum"])
        self.codecs = frozenset(chunk["codec"]["enum"])
        self.xxh3 = _pattern(chunk["xxh3"]["pattern"])
        self.dtypes = frozenset(s["definitions"]["dtype"]["enum"])
        self.max_dims = s["definitions"]["dims"]["maxItems"]

    def _bad(self, loc: str, message: str) -> NoReturn:
        _violation(self.where, loc, message)

    def _keys(self, loc: str, obj: object, keys: frozenset[str]) -> None:
        if type(obj) is not dict:
            self._bad(loc, "must be an object")
        if obj.keys() != keys:
            extra = sorted(obj.keys() - keys)[:3]
            missing = sorted(keys - obj.keys())
            self._bad(loc, f"must have exactly {sorted(keys)} (extra {extra}, missing {missing})")

    def _list(self, loc: str, obj: object) -> list[Any]:
        if type(obj) is not list:
            self._bad(loc, "must be an array")
        return obj

    def _dims(self, loc: str, dims: object) -> tuple[int, ...]:
        if (
            type(dims) is not list
            or len(dims) > self.max_dims
            or not all(type(d) is int and d >= 0 for d in dims)
        ):
            self._bad(loc, f"must be an array of at most {self.max_dims} integers >= 0")
        return tuple(dims)

    def files(self, files: object) -> list[FileRef]:
        out = self._list("files", files)
        for i, f in enumerate(out):
            self._keys(f"files[{i}]", f, _FILE_KEYS)
            name, size = f["name"], f["size"]
            if type(name) is not str or not self.file_name(name):
                self._bad(f"files[{i}].name", "must match the pattern of file names")
            if not _uint(size):
                self._bad(f"files[{i}].size", "must be an integer >= 0")
            out[i] = FileRef(name, size)
        return out

    def blobs(self, blobs: object) -> list[Blob]:
        out = self._list("blobs", blobs)
        for i, b in enumerate(out):
            self._keys(f"blobs[{i}]", b, _BLOB_KEYS)
            nbytes, element_size = b["nbytes"], b["element_size"]
            if not _uint(nbytes):
                self._bad(f"blobs[{i}].nbytes", "must be an integer >= 0")
            if type(element_size) is not int or element_size not in self.element_sizes:
                self._bad(
                    f"blobs[{i}].element_size", f"must be one of {sorted(self.element_sizes)}"
                )
            chunks = self._list(f"blobs[{i}].chunks", b["chunks"])
            for j, c in enumerate(chunks):
                chunks[j] = self._chunk(f"blobs[{i}].chunks[{j}]", c)
            out[i] = Blob(nbytes, chunks, element_size)
        return out

    def _chunk(self, loc: str, c: Any) -> Chunk:
        self._keys(loc, c, _CHUNK_KEYS)
        file, offset, length, raw_length = c["file"], c["offset"], c["length"], c["raw_length"]
        if not (_uint(file) and _uint(offset) and _uint(length) and _uint(raw_length)):
            self._bad(loc, "file, offset, length and raw_length must be integers >= 0")
        codec, xxh3 = c["codec"], c["xxh3"]
        if type(codec) is not str or codec not in self.codecs:
            self._bad(f"{loc}.codec", f"must be one of {sorted(self.codecs)}")
        if type(xxh3) is not str or not self.xxh3(xxh3):
            self._bad(f"{loc}.xxh3", "must be 32 lowercase hex digits")
        return Chunk(file, offset, length, xxh3, codec, raw_length)

    def tensors(self, tensors: object) -> list[TensorEntry]:
        out = self._list("tensors", tensors)
        for i, t in enumerate(out):
            loc = f"tensors[{i}]"
            self._keys(loc, t, _TENSOR_KEYS)
            dtype = t["dtype"]
            if type(dtype) is not str or dtype not in self.dtypes:
                self._bad(f"{loc}.dtype", f"{str(dtype)[:40]!r} is not a dtype of the schema")
            shape = self._dims(f"{loc}.shape", t["shape"])
            pieces = self._list(f"{loc}.pieces", t["pieces"])
            if not pieces:
                self._bad(f"{loc}.pieces", "must hold at least one piece")
            for j, p in enumerate(pieces):
                pieces[j] = self._piece(f"{loc}.pieces[{j}]", p)
            out[i] = TensorEntry(dtype, shape, pieces)
        return out

    def _piece(self, loc: str, p: Any) -> Piece:
        self._keys(loc, p, _PIECE_KEYS)
        blob, byte_offset = p["blob"], p["byte_offset"]
        if not (_uint(blob) and _uint(byte_offset)):
            self._bad(loc, "blob and byte_offset must be integers >= 0")
        return Piece(
            self._dims(f"{loc}.offsets", p["offsets"]),
            self._dims(f"{loc}.shape", p["shape"]),
            blob,
            byte_offset,
            self._dims(f"{loc}.strides", p["strides"]),
        )


def _pattern(pattern: str) -> Callable[[str], object]:
    """A schema pattern (anchored with ^ and $) as a whole-string match."""
    return re.compile(pattern).fullmatch


def check(m: Manifest, *, where: str) -> None:
    """Cross-reference checks the schema cannot express (docs/format.md, 'MUST check')."""
    names = [f.name for f in m.files]
    if len(set(names)) != len(names):
        raise InvalidManifest(f"{where}: duplicate file names")
    for f in m.files:
        if any(part in ("", ".", "..") for part in f.name.split("/")):
            raise InvalidManifest(f"{where}: file name {f.name!r} escapes the store")
        if f.size > MAX_BYTES:
            raise InvalidManifest(f"{where}: file {f.name} claims {f.size} bytes")
    for r, idx in enumerate(m.rank_files):
        if any(i >= len(m.files) for i in idx):
            raise InvalidManifest(f"{where}: rank {r} names a file index out of range")
    # Identical chunks may share one stored range (content addressing); others must not overlap.
    spans: dict[int, set[tuple[int, int]]] = {}
    for b_i, b in enumerate(m.blobs):
        total = 0
        for c_i, c in enumerate(b.chunks):
            problem = _chunk_problem(c, m.files)
            if problem:
                raise InvalidManifest(f"{where}: blob {b_i} chunk {c_i}{problem}")
            total += c.raw_length
            if c.length:
                spans.setdefault(c.file, set()).add((c.offset, c.offset + c.length))
        if total != b.nbytes:
            raise InvalidManifest(
                f"{where}: blob {b_i} has {b.nbytes} bytes but its chunks hold {total}"
            )
    for file, ranges in spans.items():
        for (_, end), (start, _) in itertools.pairwise(sorted(ranges)):
            if start < end:
                raise InvalidManifest(f"{where}: overlapping chunks in {m.files[file].name}")
    for t_i, t in enumerate(m.tensors):
        problem = _tensor_problem(t, m.blobs)
        if problem:
            raise InvalidManifest(f"{where}: tensor {t_i}{problem}")
    _check_tree(m.tree, len(m.tensors), where)


def _chunk_problem(c: Chunk, files: list[FileRef]) -> str | None:
    """What is wrong with chunk ``c`` (the rest of a message), or None."""
    if c.file >= len(files):
        return f" names file {c.file}"
    f = files[c.file]
    if c.offset + c.length > f.size:
        return f" [{c.offset}, {c.offset + c.length}) lies outside {f.name} ({f.size} bytes)"
    if c.raw_length > MAX_CHUNK_BYTES:
        return f": raw_length {c.raw_length} exceeds the {MAX_CHUNK_BYTES >> 20} MiB chunk cap"
    if c.codec == "none" and c.length != c.raw_length:
        return ": an uncompressed chunk must store raw_length bytes"
    if c.length > max_stored_length(c.raw_length):
        return f": {c.length} stored bytes for {c.raw_length}"
    if c.raw_length > c.length * ZSTD_MAX_RATIO:
        return (
            f" in {f.name}: {c.length} stored bytes cannot decode to raw_length "
            f"{c.raw_length} (zstd's ratio is at most {ZSTD_MAX_RATIO})"
        )
    return None


def _tensor_problem(t: TensorEntry, blobs: list[Blob]) -> str | None:
    """What is wrong with tensor entry ``t`` (the rest of a message), or None."""
    itemsize = ITEMSIZES.get(t.dtype)
    if itemsize is None:
        return f": dtype {t.dtype} is not available in this torch"
    # Each dimension on its own too: [0, 2**70] holds no element, yet no int64 holds it.
    if (
        math.prod(d for d in t.shape if d) * itemsize > MAX_BYTES
        or max(t.shape, default=0) > MAX_BYTES
    ):
        return f": shape {_short(t.shape)} is too large"
    if len(t.pieces) != 1 or any(t.pieces[0].offsets) or t.pieces[0].shape != t.shape:
        # This version's readers accept exactly one piece covering the tensor (format.md).
        return ": pieces must cover the tensor exactly once"
    for p in t.pieces:
        if not (len(p.offsets) == len(p.shape) == len(p.strides) == len(t.shape)):
            return ": piece rank does not match the tensor"
        if max(p.strides, default=0) > MAX_BYTES or p.byte_offset > MAX_BYTES:
            return f": piece strides {_short(p.strides)} are too large"
        if any(o + s > g for o, s, g in zip(p.offsets, p.shape, t.shape, strict=True)):
            return ": piece lies outside the tensor"
        if p.blob >= len(blobs):
            return f": piece names blob {p.blob}"
        if math.prod(p.shape):
            last = sum((s - 1) * st for s, st in zip(p.shape, p.strides, strict=True))
            end = p.byte_offset + (last + 1) * itemsize
            if end > blobs[p.blob].nbytes:
                return (
                    f": piece addresses byte {end} of blob {p.blob} ({blobs[p.blob].nbytes} bytes)"
                )
        if p.byte_offset % itemsize:
            return ": byte_offset is not a multiple of the item size"
    return None


def _short(dims: tuple[int, ...]) -> str:
    text = str(list(dims))
    return text if len(text) <= 120 else text[:117] + "..."


def _check_tree(node: dict[str, Any], n_tensors: int, where: str) -> None:
    stack = [node]
    while stack:
        (kind, value), *_ = stack.pop().items()
        # JSON Schema's "integer" takes 2.0: an index, an int or a key must be an int here
        if kind == "tensor" and (type(value) is not int or value >= n_tensors):
            raise InvalidManifest(f"{where}: tree references tensor {value!r} of {n_tensors}")
        if kind == "int" and type(value) is not int:
            raise InvalidManifest(f"{where}: int node {value!r} is not an integer")
        if kind == "float":
            try:
                decode_float(value)
            except (ValueError, OverflowError):
                raise InvalidManifest(
                    f"{where}: float node {value[:40]!r} is not a float"
                ) from None
        if kind == "dict":
            keys = [k for k, _ in value]
            if any(type(k) is float for k in keys):
                raise InvalidManifest(f"{where}: a dict node has a key that is not an integer")
            if len(set(map(repr, keys))) != len(keys):
                raise InvalidManifest(f"{where}: duplicate keys in a dict node")
            stack.extend(v for _, v in value)
        elif kind in ("list", "tuple"):
            stack.extend(value)
        elif kind == "stateful":
            stack.append(value["state"])
