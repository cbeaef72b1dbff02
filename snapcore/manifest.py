"""Manifest of a snapshot (format v2, docs/format.md): build, serialise, parse defensively.

Parsing never trusts the file: JSON size is capped before parsing, the schema is checked,
then every cross-reference, size and offset is checked before anything is read or
allocated.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

import fastjsonschema
import torch

from . import values
from .errors import InvalidManifest
from .tree import decode_float

FORMAT_VERSION = 2  # what a single process writes
SHARDED_VERSION = 3  # a sharded snapshot: an index (manifest.json) and one part per rank
KIND = "snapcore.snapshot"
PART_KIND = "snapcore.part"
MAX_PARTS = 1 << 20  # ranks of one sharded snapshot
MAX_MANIFEST_BYTES = 64 << 20
MAX_BYTES = 1 << 62
# A chunk decodes to at most this many bytes (writers make 64 MiB chunks by default,
# SNAPCORE_CHUNK_MB allows up to this): with the file sizes and ZSTD_MAX_RATIO it bounds
# every buffer a reader allocates (docs/format.md, "Allocation").
MAX_CHUNK_BYTES = 1 << 30
# A zstd frame cannot decode to more than 32768 times its size: a block holds at most
# 128 KiB and takes at least 4 bytes (an RLE block: 3 bytes of header, 1 of content).
ZSTD_MAX_RATIO = 32768

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


@dataclass(frozen=True, slots=True)
class PartInfo:
    """What a part of a sharded snapshot says of itself: the rank that wrote it, the
    save plan it followed, that rank's structure fingerprint, and for each of its tensors
    the global key (a tensor of the job's state) or ``None`` (a rank-local tensor)."""

    rank: int
    plan: str
    structure: str
    keys: tuple[str | None, ...]
    world_size: int  # the job's (the part manifest's ``world_size``)


@dataclass(frozen=True, slots=True)
class PartRef:
    """A part named by a sharded snapshot's index: its file, exact size and xxh3."""

    rank: int
    name: str
    size: int
    xxh3: str


@dataclass(slots=True)
class Index:
    """``manifest.json`` of a sharded snapshot (format 3): which parts make the step."""

    step: int
    created_unix: float
    writer: dict[str, Any]
    world_size: int
    plan: str
    parts: list[PartRef]

    def dumps(self) -> bytes:
        doc = {
            "format_version": SHARDED_VERSION,
            "kind": KIND,
            "step": self.step,
            "created_unix": self.created_unix,
            "writer": self.writer,
            "world_size": self.world_size,
            "plan": self.plan,
            "parts": [
                {"rank": p.rank, "name": p.name, "size": p.size, "xxh3": p.xxh3} for p in self.parts
            ],
        }
        return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


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
    # A part of a sharded snapshot (format 3) carries these; see docs/format.md.
    part: PartInfo | None = None
    # A sharded snapshot assembled from its parts (snapcore.assemble): every rank's tree
    # (indices into ``tensors``) and the part files, which garbage collection must keep.
    rank_trees: list[dict[str, Any] | None] | None = None
    part_files: list[str] = field(default_factory=list)
    # Ranks whose parts a node-local tier does not hold (another node's): their trees are
    # None and their pieces absent; the chunks present are read from here.
    missing_ranks: list[int] = field(default_factory=list)
    missing_parts: list[str] = field(default_factory=list)  # where they are, for messages
    # An assembled sharded snapshot: each tensor's global key (None: rank-local), which
    # names it alike in every tier and on every node (its index may differ)
    keys: list[str | None] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data (what a restore moves)."""
        return sum(b.nbytes for b in self.blobs)

    @property
    def stored_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> dict[str, Any]:
        if self.rank_trees is not None:
            raise ValueError("an assembled sharded snapshot is not written as one manifest")
        head: dict[str, Any] = {"format_version": FORMAT_VERSION, "kind": KIND}
        if self.part is not None:
            head = {
                "format_version": SHARDED_VERSION,
                "kind": PART_KIND,
                "rank": self.part.rank,
                "plan": self.part.plan,
                "structure": self.part.structure,
                "keys": list(self.part.keys),
            }
        return {
            **head,
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
def _schema() -> dict[str, Any]:
    text = resources.files("snapcore").joinpath("manifest.schema.json").read_text()
    return json.loads(text)


@cache
def _validator() -> Callable[[Any], Any]:
    """The whole schema, compiled (tests compare the fast path below against it)."""
    # fastjsonschema compiles the schema to Python once: 12x faster than jsonschema on a
    # manifest of 3,000 tensors (0.39 s against 4.7 s).
    return fastjsonschema.compile(_schema())


# The arrays whose items parse() checks by hand (_build_files, _build_blobs,
# _build_tensors) instead of through the compiled schema: they hold all but a few of a
# large manifest's objects, and checking them while building the dataclasses takes one
# pass instead of two.
_BIG_ARRAYS = ("files", "blobs", "tensors")


@cache
def _top_validator() -> Callable[[Any], Any]:
    """The schema with the items of the big arrays left to the hand-written checks."""
    schema = copy.deepcopy(_schema())
    for name in _BIG_ARRAYS:
        schema["properties"][name] = {"type": "array"}
    schema["properties"]["tree"] = {"type": "object"}  # _check_tree
    return fastjsonschema.compile(schema)


def compile_validators() -> None:
    """Compile what parsing a manifest uses, ahead of the first parse (about 40 ms of
    pure Python, once per process): the peer tier does it on its thread when its link
    opens, so that a restore's fetch does not pay it on its critical path."""
    _top_validator()
    _item_rules()


@cache
def _item_rules() -> tuple[re.Pattern[str], re.Pattern[str], frozenset[str], frozenset[str]]:
    """What the schema says of the big arrays' strings: the file name and hash patterns,
    the codecs, the dtypes (taken from the schema file, which stays the contract)."""
    schema = _schema()
    defs = schema["definitions"]
    name = schema["properties"]["files"]["items"]["properties"]["name"]["pattern"]
    xxh3 = defs["chunk"]["properties"]["xxh3"]["pattern"]
    codecs = frozenset(defs["chunk"]["properties"]["codec"]["enum"])
    return re.compile(name), re.compile(xxh3), codecs, frozenset(defs["dtype"]["enum"])


# Caps on the counts (docs/format.md, "Caps"): checked right after JSON decoding, before
# anything is validated or built, so that the work of a parse is bounded by them.
MAX_FILES = 1 << 16
MAX_BLOBS = 1 << 19
MAX_CHUNKS = 1 << 20
MAX_TENSORS = 1 << 19
MAX_TREE_NODES = 1 << 22
MAX_DIMS = 64
_FILE_KEYS = frozenset(["name", "size"])
_BLOB_KEYS = frozenset(["nbytes", "element_size", "chunks"])
_CHUNK_KEYS = frozenset(["file", "offset", "length", "raw_length", "codec", "xxh3"])
_TENSOR_KEYS = frozenset(["dtype", "shape", "pieces"])
_PIECE_KEYS = frozenset(["offsets", "shape", "blob", "byte_offset", "strides"])
_ELEMENT_SIZES = frozenset([1, 2, 4, 8, 16])


class _Bad(Exception):
    """A value of a big array that the schema refuses: ``args`` = (location, message).
    The location is built only on failure (``_at``): formatting it for every item would
    cost more than the checks."""


def _at(prefix: str, e: _Bad) -> _Bad:
    loc, message = e.args
    return _Bad(f"{prefix}.{loc}" if loc else prefix, message)


def _keys(obj: Any, keys: frozenset[str]) -> None:
    if type(obj) is not dict:
        raise _Bad("", "must be object")
    if obj.keys() != keys:
        extra = sorted(obj.keys() - keys)
        if extra:
            raise _Bad("", f"must not contain {str(extra)[:100]} properties")
        raise _Bad("", f"must contain {sorted(keys)} properties")


def _uint(value: Any, field: str) -> int:
    # type-exact: the schema's "integer" takes 1.0 (and bool is refused there as here)
    if type(value) is not int or value < 0:
        raise _Bad(field, "must be an integer >= 0 (not a float or a boolean)")
    return value


def _dims(value: Any, field: str) -> tuple[int, ...]:
    if type(value) is not list or len(value) > MAX_DIMS:
        raise _Bad(field, f"must be an array of at most {MAX_DIMS} integers")
    for d in value:
        if type(d) is not int or d < 0:
            raise _Bad(field, "must be an array of integers >= 0")
    return tuple(value)


def _build_files(items: list[Any]) -> list[FileRef]:
    name_re = _item_rules()[0]
    out = []
    for i, f in enumerate(items):
        try:
            _keys(f, _FILE_KEYS)
            name = f["name"]
            if type(name) is not str or not name_re.fullmatch(name):
                raise _Bad("name", f"must match pattern {name_re.pattern}")
            out.append(FileRef(name, _uint(f["size"], "size")))
        except _Bad as e:
            raise _at(f"files[{i}]", e) from None
    return out


def _build_chunks(chunks: Any) -> list[Chunk]:
    _, xxh3_re, codecs, _ = _item_rules()
    if type(chunks) is not list:
        raise _Bad("chunks", "must be array")
    out = []
    for c_i, c in enumerate(chunks):
        try:
            _keys(c, _CHUNK_KEYS)
            codec, xxh3 = c["codec"], c["xxh3"]
            if type(codec) is not str or codec not in codecs:
                raise _Bad("codec", f"must be one of {sorted(codecs)}")
            if type(xxh3) is not str or not xxh3_re.fullmatch(xxh3):
                raise _Bad("xxh3", f"must match pattern {xxh3_re.pattern}")
            out.append(
                Chunk(
                    _uint(c["file"], "file"),
                    _uint(c["offset"], "offset"),
                    _uint(c["length"], "length"),
                    xxh3,
                    codec,
                    _uint(c["raw_length"], "raw_length"),
                )
            )
        except _Bad as e:
            raise _at(f"chunks[{c_i}]", e) from None
    return out


def _build_blobs(items: list[Any]) -> list[Blob]:
    out = []
    n_chunks = 0
    for b_i, b in enumerate(items):
        try:
            _keys(b, _BLOB_KEYS)
            element_size = b["element_size"]
            if type(element_size) is not int or element_size not in _ELEMENT_SIZES:
                raise _Bad("element_size", f"must be one of {sorted(_ELEMENT_SIZES)}")
            chunks = _build_chunks(b["chunks"])
            out.append(Blob(_uint(b["nbytes"], "nbytes"), chunks, element_size))
        except _Bad as e:
            raise _at(f"blobs[{b_i}]", e) from None
        n_chunks += len(chunks)
        if n_chunks > MAX_CHUNKS:
            raise _Bad("blobs", f"must hold at most {MAX_CHUNKS} chunks in all (docs/format.md)")
    return out


def _build_pieces(pieces: Any, partial: bool = False) -> list[Piece]:
    if type(pieces) is not list or not (pieces or partial):
        raise _Bad("pieces", "must be a non-empty array")
    out = []
    for p_i, p in enumerate(pieces):
        try:
            _keys(p, _PIECE_KEYS)
            out.append(
                Piece(
                    _dims(p["offsets"], "offsets"),
                    _dims(p["shape"], "shape"),
                    _uint(p["blob"], "blob"),
                    _uint(p["byte_offset"], "byte_offset"),
                    _dims(p["strides"], "strides"),
                )
            )
        except _Bad as e:
            raise _at(f"pieces[{p_i}]", e) from None
    return out


def _build_tensors(items: list[Any], partial: bool = False) -> list[TensorEntry]:
    dtypes = _item_rules()[3]
    out = []
    for t_i, t in enumerate(items):
        try:
            _keys(t, _TENSOR_KEYS)
            dtype = t["dtype"]
            if type(dtype) is not str or dtype not in dtypes:
                raise _Bad("dtype", "must be one of the schema's dtypes")
            out.append(
                TensorEntry(dtype, _dims(t["shape"], "shape"), _build_pieces(t["pieces"], partial))
            )
        except _Bad as e:
            raise _at(f"tensors[{t_i}]", e) from None
    return out


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


def _check_caps(doc: dict[str, Any], where: str) -> None:
    for name, cap in (("files", MAX_FILES), ("blobs", MAX_BLOBS), ("tensors", MAX_TENSORS)):
        items = doc.get(name)
        if type(items) is list and len(items) > cap:
            raise InvalidManifest(
                f"{where}: {len(items)} {name} exceed the cap of {cap} (docs/format.md)"
            )


def _load(data: bytes, where: str) -> dict[str, Any]:
    if len(data) > MAX_MANIFEST_BYTES:
        raise InvalidManifest(f"{where}: manifest of {len(data)} bytes exceeds the 64 MiB cap")
    text = _decode_text(data, where)
    try:
        doc = json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_object)
    except (ValueError, RecursionError) as e:
        raise InvalidManifest(f"{where}: not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise InvalidManifest(f"{where}: a manifest must be a JSON object")
    return doc


def parse(data: bytes, *, where: str) -> Manifest:
    """Parse and validate manifest bytes; ``where`` names the file in errors."""
    doc = _load(data, where)
    version = doc.get("format_version")
    if version != FORMAT_VERSION:
        raise InvalidManifest(
            f"{where}: format_version {version!r} is not supported here (a single "
            f"manifest is version {FORMAT_VERSION}; a sharded snapshot's index is read "
            "with parse_any)"
        )
    return _parse_doc(doc, where, None)


def parse_any(data: bytes, *, where: str) -> Manifest | Index:
    """A ``manifest.json``: a whole snapshot (version 2) or a sharded snapshot's index
    (version 3, whose parts are read with ``parse_part``)."""
    doc = _load(data, where)
    version = doc.get("format_version")
    if version == FORMAT_VERSION:
        return _parse_doc(doc, where, None)
    if version == SHARDED_VERSION:
        kind = doc.get("kind")
        if kind == KIND:
            return _parse_index(doc, where)
        what = "a part of a sharded snapshot" if kind == PART_KIND else "not a snapshot"
        raise InvalidManifest(
            f"{where}: kind {str(kind)[:40]!r} is {what}, not a snapshot's manifest or index "
            f"({KIND!r})"
        )
    raise InvalidManifest(
        f"{where}: format_version {version!r} is not supported (this snapcore reads "
        f"versions {FORMAT_VERSION} and {SHARDED_VERSION})"
    )


def parse_part(data: bytes, *, where: str) -> Manifest:
    """A part of a sharded snapshot (version 3, kind ``snapcore.part``): a manifest of
    the bytes one rank wrote, whose tensors hold global shapes and the pieces that rank
    wrote (possibly none), and a key per tensor."""
    doc = _load(data, where)
    if doc.get("format_version") != SHARDED_VERSION or doc.get("kind") != PART_KIND:
        raise InvalidManifest(f"{where}: not a part of a sharded snapshot (format 3)")
    extra = {}
    for name in ("rank", "plan", "structure", "keys"):
        if name not in doc:
            raise InvalidManifest(f"{where}: schema violation at <top>: {name} is missing")
        extra[name] = doc.pop(name)
    rank, keys = extra["rank"], extra["keys"]
    if type(rank) is not int or not 0 <= rank < MAX_PARTS:
        raise InvalidManifest(f"{where}: schema violation at rank: must be an integer")
    for name in ("plan", "structure"):
        if not isinstance(extra[name], str) or not _HEX64.fullmatch(extra[name]):
            raise InvalidManifest(f"{where}: schema violation at {name}: not a fingerprint")
    if type(keys) is not list or any(k is not None and type(k) is not str for k in keys):
        raise InvalidManifest(f"{where}: schema violation at keys: strings or nulls")
    if any(k is not None and len(k) > 4096 for k in keys):
        raise InvalidManifest(f"{where}: schema violation at keys: a key is too long")
    doc["format_version"], doc["kind"] = FORMAT_VERSION, KIND
    world = doc.get("world_size")
    info = PartInfo(rank, extra["plan"], extra["structure"], tuple(keys), world)
    m = _parse_doc(doc, where, info)
    if len(keys) != len(m.tensors):
        raise InvalidManifest(f"{where}: {len(keys)} keys for {len(m.tensors)} tensors")
    return m


_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX32 = re.compile(r"[0-9a-f]{32}")
_INDEX_KEYS = frozenset(
    ["format_version", "kind", "step", "created_unix", "writer", "world_size", "plan", "parts"]
)
_PART_REF_KEYS = frozenset(["rank", "name", "size", "xxh3"])


def _parse_index(doc: dict[str, Any], where: str) -> Index:
    try:
        _keys(doc, _INDEX_KEYS)
        step = _uint(doc["step"], "step")
        world = _uint(doc["world_size"], "world_size")
        if not 1 <= world <= MAX_PARTS:
            raise _Bad("world_size", f"must be 1 to {MAX_PARTS}")
        created = doc["created_unix"]
        if type(created) not in (int, float) or not 0 <= created <= 32503680000:
            raise _Bad("created_unix", "must be a number from 0 to 32503680000")
        if not isinstance(doc["writer"], dict):
            raise _Bad("writer", "must be an object")
        if not isinstance(doc["plan"], str) or not _HEX64.fullmatch(doc["plan"]):
            raise _Bad("plan", "not a fingerprint")
        parts = doc["parts"]
        if type(parts) is not list or len(parts) != world:
            raise _Bad("parts", f"must list one part per rank ({world})")
        refs = []
        for i, p in enumerate(parts):
            try:
                _keys(p, _PART_REF_KEYS)
                if _uint(p["rank"], "rank") != i:
                    raise _Bad("rank", f"must be {i} (parts are in rank order)")
                name = p["name"]
                if type(name) is not str or not _item_rules()[0].fullmatch(name):
                    raise _Bad("name", "not a file name of the store")
                if name.split("/")[0] != f"step-{step:012d}" or "/" not in name:
                    raise _Bad("name", "must lie in the step's directory")
                size = _uint(p["size"], "size")
                if size > MAX_MANIFEST_BYTES:
                    raise _Bad("size", "exceeds the 64 MiB cap of a manifest")
                if type(p["xxh3"]) is not str or not _HEX32.fullmatch(p["xxh3"]):
                    raise _Bad("xxh3", "must be 32 lowercase hex digits")
                refs.append(PartRef(i, name, size, p["xxh3"]))
            except _Bad as e:
                raise _at(f"parts[{i}]", e) from None
    except _Bad as e:
        loc, message = e.args
        raise InvalidManifest(f"{where}: schema violation at {loc}: {message}") from None
    if len({r.name for r in refs}) != len(refs):
        raise InvalidManifest(f"{where}: two parts name the same file")
    return Index(step, float(created), doc["writer"], world, doc["plan"], refs)


def _parse_doc(doc: dict[str, Any], where: str, part: PartInfo | None) -> Manifest:
    _check_caps(doc, where)
    try:
        _top_validator()(doc)
    except RecursionError:
        raise InvalidManifest(f"{where}: the tree is nested too deeply") from None
    except fastjsonschema.JsonSchemaValueException as e:
        loc = e.name.removeprefix("data").lstrip(".") or "<top>"
        raise InvalidManifest(f"{where}: schema violation at {loc}: {e.message[:300]}") from None
    for name in ("step", "world_size"):
        if type(doc[name]) is not int:
            raise InvalidManifest(f"{where}: schema violation at {name}: must be an integer")
    if any(type(i) is not int for idx in doc["rank_files"] for i in idx):
        raise InvalidManifest(f"{where}: schema violation at rank_files: must hold integers")
    try:
        files = _build_files(doc["files"])
        blobs = _build_blobs(doc["blobs"])
        tensors = _build_tensors(doc["tensors"], partial=part is not None)
    except _Bad as e:
        loc, message = e.args
        raise InvalidManifest(f"{where}: schema violation at {loc}: {message}") from None
    m = Manifest(
        step=doc["step"],
        created_unix=float(doc["created_unix"]),
        writer=doc["writer"],
        world_size=doc["world_size"],
        rank_files=doc["rank_files"],
        files=files,
        blobs=blobs,
        tensors=tensors,
        tree=doc["tree"],
        part=part,
    )
    check(m, where=where)
    return m


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
            what = f"{where}: blob {b_i} chunk {c_i}"
            if c.file >= len(m.files):
                raise InvalidManifest(f"{what} names file {c.file}")
            if c.offset + c.length > m.files[c.file].size:
                raise InvalidManifest(
                    f"{what} [{c.offset}, {c.offset + c.length}) lies "
                    f"outside {m.files[c.file].name} ({m.files[c.file].size} bytes)"
                )
            if c.raw_length > MAX_CHUNK_BYTES:
                raise InvalidManifest(
                    f"{what}: raw_length {c.raw_length} exceeds the {MAX_CHUNK_BYTES >> 20} MiB "
                    "chunk cap"
                )
            if c.codec == "none" and c.length != c.raw_length:
                raise InvalidManifest(f"{what}: an uncompressed chunk must store raw_length bytes")
            if c.length > max_stored_length(c.raw_length):
                raise InvalidManifest(f"{what}: {c.length} stored bytes for {c.raw_length}")
            if c.raw_length > c.length * ZSTD_MAX_RATIO:
                raise InvalidManifest(
                    f"{what} in {m.files[c.file].name}: {c.length} stored bytes cannot decode "
                    f"to raw_length {c.raw_length} (zstd's ratio is at most {ZSTD_MAX_RATIO})"
                )
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
        what = f"{where}: tensor {t_i}"
        if t.dtype not in DTYPES:
            raise InvalidManifest(f"{what}: dtype {t.dtype} is not available in this torch")
        itemsize = t.torch_dtype.itemsize
        # Each dimension on its own too: [0, 2**70] holds no element, yet no int64 holds it.
        if (
            math.prod(d for d in t.shape if d) * itemsize > MAX_BYTES
            or max(t.shape, default=0) > MAX_BYTES
        ):
            raise InvalidManifest(f"{what}: shape {_short(t.shape)} is too large")
        if m.part is None and (
            len(t.pieces) != 1 or any(t.pieces[0].offsets) or t.pieces[0].shape != t.shape
        ):
            # A whole snapshot's tensor is one piece covering it; a part holds the pieces
            # one rank wrote, and the assembled snapshot must cover each tensor exactly
            # once (snapcore.assemble checks).
            raise InvalidManifest(f"{what}: pieces must cover the tensor exactly once")
        for p in t.pieces:
            if not (len(p.offsets) == len(p.shape) == len(p.strides) == len(t.shape)):
                raise InvalidManifest(f"{what}: piece rank does not match the tensor")
            if max(p.strides, default=0) > MAX_BYTES or p.byte_offset > MAX_BYTES:
                raise InvalidManifest(f"{what}: piece strides {_short(p.strides)} are too large")
            if any(o + s > g for o, s, g in zip(p.offsets, p.shape, t.shape, strict=True)):
                raise InvalidManifest(f"{what}: piece lies outside the tensor")
            if p.blob >= len(m.blobs):
                raise InvalidManifest(f"{what}: piece names blob {p.blob}")
            if math.prod(p.shape):
                last = sum((s - 1) * st for s, st in zip(p.shape, p.strides, strict=True))
                end = p.byte_offset + (last + 1) * itemsize
                if end > m.blobs[p.blob].nbytes:
                    raise InvalidManifest(
                        f"{what}: piece addresses byte {end} of blob {p.blob} "
                        f"({m.blobs[p.blob].nbytes} bytes)"
                    )
            if p.byte_offset % itemsize:
                raise InvalidManifest(f"{what}: byte_offset is not a multiple of the item size")
    _check_tree(m.tree, m.tensors, where)


def _short(dims: tuple[int, ...]) -> str:
    text = str(list(dims))
    return text if len(text) <= 120 else text[:117] + "..."


@cache
def _kind_validator(kind: str) -> Callable[[Any], Any]:
    """The schema of one node kind's value (``ndarray``, ``random``...), compiled: the
    rare kinds are checked through the schema file, the common ones by _check_tree."""
    schema = _schema()
    defs = schema["definitions"]
    # The same $id as the whole schema: its "#/definitions/..." references resolve here
    # (without one, fastjsonschema would try to fetch the document by its URL).
    return fastjsonschema.compile(
        {
            "$schema": schema["$schema"],
            "$id": schema["$id"],
            "definitions": defs,
            **defs["node"]["properties"][kind],
        }
    )


@cache
def _float_re() -> re.Pattern[str]:
    return re.compile(_schema()["definitions"]["node"]["properties"]["float"]["pattern"])


def _check_tree(node: Any, tensors: list[TensorEntry], where: str) -> None:
    """One walk over the tree: the schema of its nodes, checked by hand (type-exact: a
    float is not an int) for the common kinds and through the schema for the value
    kinds of values.py; the node count cap; tensor indices, floats, duplicate keys."""
    n_tensors = len(tensors)
    float_re = _float_re()
    stack = [node]
    n_nodes = 0

    def bad(message: str) -> InvalidManifest:
        return InvalidManifest(f"{where}: schema violation at tree: {message}")

    while stack:
        n_nodes += 1
        if n_nodes > MAX_TREE_NODES:
            raise InvalidManifest(
                f"{where}: the tree has more than {MAX_TREE_NODES} nodes (docs/format.md)"
            )
        node = stack.pop()
        if type(node) is not dict or len(node) != 1:
            raise bad("a node must be an object with exactly one property")
        ((kind, value),) = node.items()
        if kind == "tensor" or kind == "int":
            if type(value) is not int:  # type-exact: the schema's "integer" takes 1.0
                raise bad(f"{kind} node {str(value)[:40]} is not an integer")
            if kind == "tensor" and not 0 <= value < n_tensors:
                raise InvalidManifest(f"{where}: tree references tensor {value} of {n_tensors}")
        elif kind == "dict":
            if type(value) is not list:
                raise bad("a dict node holds an array of [key, node] items")
            keys = []
            for item in value:
                if type(item) is not list or len(item) != 2 or type(item[0]) not in (str, int):
                    raise bad("a dict node's item must be [string or integer key, node]")
                keys.append(item[0])
                stack.append(item[1])
            if len(set(map(repr, keys))) != len(keys):
                raise InvalidManifest(f"{where}: duplicate keys in a dict node")
        elif kind == "list" or kind == "tuple":
            if type(value) is not list:
                raise bad(f"a {kind} node holds an array of nodes")
            stack.extend(value)
        elif kind == "float":
            if type(value) is not str or not float_re.fullmatch(value):
                raise bad(f"float node {str(value)[:40]!r} must match {float_re.pattern}")
            try:
                decode_float(value)
            except (ValueError, OverflowError):
                raise InvalidManifest(
                    f"{where}: float node {value[:40]!r} is not a float"
                ) from None
        elif kind == "str":
            if type(value) is not str:
                raise bad("a str node holds a string")
        elif kind == "bool":
            if type(value) is not bool:
                raise bad("a bool node holds true or false")
        elif kind == "none":
            if value is not None:
                raise bad("a none node holds null")
        elif kind == "stateful":
            if type(value) is not dict or value.keys() != {"type", "state"}:
                raise bad("a stateful node holds exactly {type, state}")
            if type(value["type"]) is not str or len(value["type"]) > 256:
                raise bad("a stateful node's type is a string of at most 256 characters")
            stack.append(value["state"])
        elif kind in values.KINDS:  # NumPy arrays, bytes, generators...: values.py
            try:
                _kind_validator(kind)(value)
            except fastjsonschema.JsonSchemaValueException as e:
                raise bad(f"{kind} node: {e.message[:300]}") from None
            except RecursionError:
                raise InvalidManifest(f"{where}: the tree is nested too deeply") from None
            values.check(kind, value, tensors, where, MAX_BYTES)
            stack.extend(child for _, child in values.children(kind, value))
        else:
            raise bad(f"unknown node kind {kind[:40]!r}")
