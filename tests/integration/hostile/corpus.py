"""Hostile stores: each case damages a valid snapshot in one way a reader must survive.

Every case is built from a small valid snapshot (a generator rather than checked-in
files, since FIFOs and symlinks out of the store cannot be checked in), then one thing
is made hostile. ``expect`` is the snapcore error class restore, load and verify must
raise (``None``: they must succeed with step ``ok_step``), ``match`` a fragment of its
message. tests/integration/test_hostile.py runs every case through the API and the CLI.

Write the whole corpus to a directory (to try it on another reader, say):

    python tests/integration/hostile/corpus.py OUTDIR
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash

import snapcore
from snapcore.errors import CorruptSnapshot, InvalidManifest, SnapcoreError

STEP = 200
STEP_DIR = f"step-{STEP:012d}"


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[Path], None]  # makes the hostile store at the given (new) path
    expect: type[SnapcoreError] | None
    match: str = ""
    ok_step: int = STEP
    cli: bool = True  # whether `snapcore ls/inspect/verify` run on it too


def _state() -> dict[str, Any]:
    return {
        "w": torch.arange(12, dtype=torch.float32).view(3, 4),
        "b": torch.ones(5, dtype=torch.float64),
        "n": 3,
        "lr": 0.1,
    }


def _base(root: Path, codec: str = "none") -> dict[str, Any]:
    """Save the valid snapshot of step 200 and return its manifest as JSON."""
    snapcore.save(_state(), snapcore.Store(local=root, codec=codec), step=STEP)
    return json.loads(_manifest(root).read_bytes())


def _manifest(root: Path) -> Path:
    return root / STEP_DIR / "manifest.json"


def _write(root: Path, doc: dict[str, Any]) -> None:
    _manifest(root).write_bytes(json.dumps(doc).encode())


def _edit(mutate: Callable[[dict[str, Any]], None], codec: str = "none") -> Callable[[Path], None]:
    def build(root: Path) -> None:
        doc = _base(root, codec)
        mutate(doc)
        _write(root, doc)

    return build


def _raw(transform: Callable[[bytes], bytes]) -> Callable[[Path], None]:
    def build(root: Path) -> None:
        _base(root)
        path = _manifest(root)
        path.write_bytes(transform(path.read_bytes()))

    return build


def _data_file(root: Path, doc: dict[str, Any]) -> Path:
    return root / doc["files"][0]["name"]


# -- sizes claimed before they are checked ---------------------------------------------------
def _raw_length(value: int) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        blob = doc["blobs"][0]
        blob["chunks"][0]["raw_length"] = value
        blob["nbytes"] = sum(c["raw_length"] for c in blob["chunks"])

    return mutate


def _frame_lies(doc: dict[str, Any]) -> None:
    # raw_length within every bound (file size, ratio, chunk size) but not the frame's
    c = doc["blobs"][0]["chunks"][0]
    _raw_length(c["length"] * 1000)(doc)


# -- special files and links -----------------------------------------------------------------
def _fifo_zero_length_chunk(root: Path) -> None:
    """A FIFO data file and a compressed chunk of 0 stored bytes in it."""
    doc = _base(root, "zstd")
    fifo = f"{STEP_DIR}/data-fifo.bin"
    os.mkfifo(root / fifo)
    doc["files"].append({"name": fifo, "size": 0})
    doc["rank_files"][0].append(len(doc["files"]) - 1)
    blob = doc["blobs"][0]
    blob["chunks"].append(
        {**blob["chunks"][0], "file": len(doc["files"]) - 1, "offset": 0, "length": 0}
    )
    blob["chunks"][-1]["raw_length"] = 4
    blob["nbytes"] += 4
    _write(root, doc)


def _fifo_listed_file(root: Path) -> None:
    """A FIFO that the manifest lists as an empty data file (no chunk reads it)."""
    doc = _base(root)
    fifo = f"{STEP_DIR}/data-fifo.bin"
    os.mkfifo(root / fifo)
    doc["files"].append({"name": fifo, "size": 0})
    doc["rank_files"][0].append(len(doc["files"]) - 1)
    _write(root, doc)


def _fifo_data_file(root: Path) -> None:
    """The data file replaced by a FIFO, the manifest claiming its real size."""
    doc = _base(root)
    data = _data_file(root, doc)
    data.unlink()
    os.mkfifo(data)


def _directory_data_file(root: Path) -> None:
    doc = _base(root)
    data = _data_file(root, doc)
    data.unlink()
    data.mkdir()


def _fifo_manifest(root: Path) -> None:
    _base(root)
    _manifest(root).unlink()
    os.mkfifo(_manifest(root))


def _manifest_symlink(outside: bool) -> Callable[[Path], None]:
    def build(root: Path) -> None:
        _base(root)
        path = _manifest(root)
        target = (
            root.parent / f"{root.name}-outside.json" if outside else root / STEP_DIR / "m.json"
        )
        path.rename(target)
        path.symlink_to(target)

    return build


def _data_symlink(outside: bool) -> Callable[[Path], None]:
    def build(root: Path) -> None:
        doc = _base(root)
        data = _data_file(root, doc)
        target = root.parent / f"{root.name}-outside.bin" if outside else data.with_suffix(".real")
        data.rename(target)
        data.symlink_to(target)

    return build


def _data_dir_symlink(root: Path) -> None:
    """A data file named through a directory that is a symlink inside the store."""
    doc = _base(root)
    (root / "linked").symlink_to(root / STEP_DIR, target_is_directory=True)
    doc["files"][0]["name"] = "linked/" + doc["files"][0]["name"].rsplit("/", 1)[1]
    _write(root, doc)


# -- values Python itself would choke on -----------------------------------------------------
def _tree_float(text: str) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        doc["tree"]["dict"].append(["bad", {"float": text}])

    return mutate


def _shape_zero_overflow(doc: dict[str, Any]) -> None:
    t = doc["tensors"][0]
    t["shape"] = [0, 1 << 70]
    t["pieces"][0].update(offsets=[0, 0], shape=[0, 1 << 70], strides=[1 << 70, 1])


def _created(value: str) -> Callable[[bytes], bytes]:
    def transform(data: bytes) -> bytes:
        doc = json.loads(data)
        marker = "__CREATED__"
        doc["created_unix"] = marker
        return json.dumps(doc).replace(f'"{marker}"', value).encode()

    return transform


def _duplicate_key(data: bytes) -> bytes:
    # The first "step" is the directory's; a reader taking the last would see another.
    out = data.replace(b'"step":200', b'"step":200,"step":100', 1)
    assert out != data
    return out


# -- listing ---------------------------------------------------------------------------------
def _stray_step_dir(root: Path) -> None:
    _base(root)
    (root / "step-300").mkdir()


def _stray_step_dir_with_manifest(root: Path) -> None:
    doc = _base(root)
    (root / "step-300").mkdir()
    (root / "step-300" / "manifest.json").write_bytes(json.dumps({**doc, "step": 300}).encode())


def _store_is_a_file(root: Path) -> None:
    root.write_bytes(b"not a store")


CASES: list[Case] = [
    Case("raw-length-2^61", _edit(_raw_length(1 << 61), "zstd"), InvalidManifest, "raw_length"),
    Case("raw-length-2^61-shuffle", _edit(_raw_length(1 << 61), "shuffle-zstd"), InvalidManifest),
    Case("raw-length-over-ratio", _edit(_raw_length(1 << 24), "zstd"), InvalidManifest, "ratio"),
    Case("frame-size-mismatch", _edit(_frame_lies, "shuffle-zstd"), CorruptSnapshot, "decodes to"),
    Case("fifo-zero-length-chunk", _fifo_zero_length_chunk, InvalidManifest, "data-fifo.bin"),
    Case("fifo-listed-file", _fifo_listed_file, CorruptSnapshot, "not a regular file"),
    Case("fifo-data-file", _fifo_data_file, CorruptSnapshot, "not a regular file"),
    Case("directory-data-file", _directory_data_file, CorruptSnapshot, "not a regular file"),
    Case("fifo-manifest", _fifo_manifest, InvalidManifest, "not a regular file"),
    Case("manifest-symlink-out", _manifest_symlink(True), InvalidManifest, "symbolic link"),
    Case("manifest-symlink-in", _manifest_symlink(False), InvalidManifest, "symbolic link"),
    Case("data-symlink-out", _data_symlink(True), CorruptSnapshot, "symbolic link"),
    Case("data-symlink-in", _data_symlink(False), CorruptSnapshot, "symbolic link"),
    Case("data-dir-symlink-in", _data_dir_symlink, CorruptSnapshot, "through a symbolic link"),
    Case("float-0xp", _edit(_tree_float("0xp")), InvalidManifest, "float"),
    Case("float-overflow", _edit(_tree_float("0x1p99999")), InvalidManifest, "float"),
    Case("shape-zero-overflow", _edit(_shape_zero_overflow), InvalidManifest, "too large"),
    Case("created-1e300", _raw(_created("1e300")), InvalidManifest, "created_unix"),
    Case("created-1e400", _raw(_created("1e400")), InvalidManifest, ""),
    Case("created-400-digits", _raw(_created("9" * 400)), InvalidManifest, "created_unix"),
    Case("duplicate-json-key", _raw(_duplicate_key), InvalidManifest, "duplicate key"),
    Case("utf16-manifest", _raw(lambda d: d.decode().encode("utf-16")), InvalidManifest, "UTF-8"),
    Case("utf8-bom", _raw(lambda d: b"\xef\xbb\xbf" + d), InvalidManifest, "UTF-8"),
    Case("stray-step-dir", _stray_step_dir, None),
    Case("stray-step-dir-with-manifest", _stray_step_dir_with_manifest, None),
    Case("store-is-a-file", _store_is_a_file, SnapcoreError),  # api: SnapshotNotFound
]


# -- sharded snapshots (format 3): an index and one part per rank ---------------------------
PLAN = "ab" * 32  # the save plan's fingerprint (any 64 hex digits)
STRUCTURE = "cd" * 32


def _part_name(rank: int) -> str:
    return f"{STEP_DIR}/part-{rank:05d}-0123456789ab.json"


def _split(root: Path, doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Two parts made from the valid snapshot's manifest: rank 0 wrote rows 0-1 of the
    global tensor ``w``, rank 1 (into its own copy of the data file) row 2; each has its
    rank-local ``b`` (equal on both) and the scalars."""
    data = doc["files"][0]["name"]
    copy = data.replace("-r0.bin", "-r1.bin")
    (root / copy).write_bytes((root / data).read_bytes())
    parts = []
    for rank, (first, rows) in enumerate([(0, 2), (2, 1)]):
        part = json.loads(json.dumps(doc))
        part.update(format_version=3, kind="snapcore.part", world_size=2)
        part.update(rank=rank, plan=PLAN, structure=STRUCTURE, keys=["w", None])
        if rank:
            part["files"][0]["name"] = copy
        part["tensors"][0]["pieces"][0].update(
            offsets=[first, 0], shape=[rows, 4], byte_offset=first * 16
        )
        parts.append(part)
    return parts


Hook = Callable[[Path, dict[str, Any], list[Any]], None]


def _sharded(
    parts_hook: Callable[[list[dict[str, Any]]], None] | None = None,
    index_hook: Callable[[dict[str, Any]], None] | None = None,
    after: Callable[[Path, dict[str, Any]], None] | None = None,
    raw_part: Callable[[int, bytes], bytes] | None = None,
    raw_index: Callable[[bytes], bytes] | None = None,
) -> Callable[[Path], None]:
    """A valid sharded step 200 (``_split``) made hostile: ``parts_hook`` edits the parts'
    JSON and ``raw_part(rank, bytes)`` their bytes before the index lists them (so that
    sizes and hashes match), ``index_hook`` and ``raw_index`` edit the index, ``after``
    the files once written."""

    def build(root: Path) -> None:
        doc = _base(root)
        parts = _split(root, doc)
        if parts_hook is not None:
            parts_hook(parts)
        refs = []
        for rank, part in enumerate(parts):
            data = json.dumps(part).encode()
            if raw_part is not None:
                data = raw_part(rank, data)
            (root / _part_name(rank)).write_bytes(data)
            refs.append(
                {
                    "rank": rank,
                    "name": _part_name(rank),
                    "size": len(data),
                    "xxh3": xxhash.xxh3_128_hexdigest(data),
                }
            )
        index = {
            "format_version": 3,
            "kind": "snapcore.snapshot",
            "step": STEP,
            "created_unix": doc["created_unix"],
            "writer": doc["writer"],
            "world_size": len(refs),
            "plan": PLAN,
            "parts": refs,
        }
        if index_hook is not None:
            index_hook(index)
        data = json.dumps(index).encode()
        _manifest(root).write_bytes(raw_index(data) if raw_index is not None else data)
        if after is not None:
            after(root, index)

    return build


def _each_part(mutate: Callable[[dict[str, Any]], None], rank: int = 1) -> Callable[..., None]:
    def hook(parts: list[dict[str, Any]]) -> None:
        mutate(parts[rank])

    return hook


def _ref(rank: int, **fields: Any) -> Callable[[dict[str, Any]], None]:
    def hook(index: dict[str, Any]) -> None:
        index["parts"][rank].update(fields)

    return hook


def _replace_part(make: Callable[[Path, Path], None], rank: int = 1) -> Callable[..., None]:
    """``make(path, root)`` puts something else where the part was (the index unchanged)."""

    def after(root: Path, index: dict[str, Any]) -> None:
        path = root / index["parts"][rank]["name"]
        make(path, root)

    return after


def _link_part(outside: bool) -> Callable[[Path, Path], None]:
    def make(path: Path, root: Path) -> None:
        target = root.parent / f"{root.name}-part.json" if outside else path.with_suffix(".real")
        path.rename(target)
        path.symlink_to(target)

    return make


def _fifo_part(path: Path, root: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _dir_part(path: Path, root: Path) -> None:
    path.unlink()
    path.mkdir()


def _linked_dir_part(root: Path, index: dict[str, Any]) -> None:
    """The part reached through a directory that is a symlink out of the store."""
    outside = root.parent / f"{root.name}-outside"
    outside.mkdir()
    (root / _part_name(1)).rename(outside / _part_name(1).rsplit("/", 1)[1])
    (root / STEP_DIR / "linked").symlink_to(outside, target_is_directory=True)


def _huge_part(path: Path, root: Path) -> None:
    """The part grown (sparse) past the 64 MiB cap; the index keeps its real size."""
    with path.open("r+b") as f:
        f.truncate((64 << 20) + 1)


def _many_parts(n: int) -> Callable[[dict[str, Any]], None]:
    def hook(index: dict[str, Any]) -> None:
        ref = index["parts"][1]
        index["parts"] += [
            {**ref, "rank": r, "name": f"{STEP_DIR}/part-{r:05d}-0123456789ab.json"}
            for r in range(2, n)
        ]
        index["world_size"] = n

    return hook


def _rows(rank: int, first: int, rows: int) -> Callable[[list[dict[str, Any]]], None]:
    def hook(parts: list[dict[str, Any]]) -> None:
        parts[rank]["tensors"][0]["pieces"][0].update(
            offsets=[first, 0], shape=[rows, 4], byte_offset=first * 16
        )

    return hook


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """Set ``doc[a][b]...`` (``path`` "a.b...", integers index lists)."""

    def mutate(doc: dict[str, Any]) -> None:
        *head, last = path.split(".")
        obj: Any = doc
        for k in head:
            obj = obj[int(k)] if isinstance(obj, list) else obj[k]
        obj[int(last) if isinstance(obj, list) else last] = value

    return mutate


def _part_as_manifest(root: Path, index: dict[str, Any]) -> None:
    """manifest.json replaced by rank 0's part."""
    _manifest(root).write_bytes((root / index["parts"][0]["name"]).read_bytes())


def _no_piece(parts: list[dict[str, Any]]) -> None:
    parts[1]["tensors"][1]["pieces"] = []  # rank 1's rank-local b


def _duplicate_index_key(data: bytes) -> bytes:
    out = data.replace(b'"world_size": 2', b'"world_size": 2, "world_size": 1', 1)
    assert out != data
    return out


INDEX = f"{STEP_DIR}/manifest.json"
PART0 = f"{STEP_DIR}/part-00000-"
PART1 = f"{STEP_DIR}/part-00001-"
SHARDED: list[Case] = [
    Case("sharded-valid", _sharded(), None),
    # the index: where its parts are, how many, in which order
    Case(
        "sharded-part-in-other-step",
        _sharded(index_hook=_ref(1, name=f"step-{STEP - 1:012d}/part-00001-0123456789ab.json")),
        InvalidManifest,
        f"{INDEX}: schema violation at parts[1].name",
    ),
    Case(
        "sharded-part-dotdot",
        _sharded(index_hook=_ref(1, name=f"{STEP_DIR}/../{STEP_DIR}/part-00001-x.json")),
        InvalidManifest,
        f"{INDEX}: schema violation at parts[1].name",
    ),
    Case(
        "sharded-part-at-store-root",
        _sharded(index_hook=_ref(1, name="part-00001-x.json")),
        InvalidManifest,
        f"{INDEX}: schema violation at parts[1].name",
    ),
    Case(
        "sharded-world-size-3-two-parts",
        _sharded(index_hook=_set("world_size", 3)),
        InvalidManifest,
        f"{INDEX}: schema violation at parts: must list one part per rank",
    ),
    Case(
        "sharded-world-size-2^40",
        _sharded(index_hook=_set("world_size", 1 << 40)),
        InvalidManifest,
        f"{INDEX}: schema violation at world_size",
    ),
    Case(
        "sharded-world-size-0",
        _sharded(index_hook=lambda i: i.update(world_size=0, parts=[])),
        InvalidManifest,
        f"{INDEX}: schema violation at world_size",
    ),
    Case(
        "sharded-100000-parts-missing",
        _sharded(index_hook=_many_parts(100_000)),
        InvalidManifest,
        f"{PART0}",
    ),
    Case(
        "sharded-parts-out-of-order",
        _sharded(index_hook=lambda i: i["parts"].reverse()),
        InvalidManifest,
        f"{INDEX}: schema violation at parts[0].rank",
    ),
    Case(
        "sharded-two-refs-one-file",
        _sharded(index_hook=_ref(1, name=_part_name(0))),
        InvalidManifest,
        f"{INDEX}: two parts name the same file",
    ),
    Case(
        "sharded-duplicate-json-key",
        _sharded(raw_index=_duplicate_index_key),
        InvalidManifest,
        f"{INDEX}: not valid JSON: duplicate key",
    ),
    Case(
        "sharded-index-kind-part",
        _sharded(index_hook=_set("kind", "snapcore.part")),
        InvalidManifest,
        f"{INDEX}: kind 'snapcore.part' is a part of a sharded snapshot",
    ),
    Case(
        "sharded-part-as-manifest",
        _sharded(after=_part_as_manifest),
        InvalidManifest,
        f"{INDEX}: kind 'snapcore.part' is a part",
    ),
    Case(
        "sharded-index-step-99",
        _sharded(index_hook=_set("step", 99)),
        InvalidManifest,
        f"{INDEX}: schema violation at parts[0].name",
    ),
    Case(
        "sharded-part-size-2^40",
        _sharded(index_hook=_ref(1, size=1 << 40)),
        InvalidManifest,
        f"{INDEX}: schema violation at parts[1].size",
    ),
    # the part file: present, regular, in the store, the bytes the index names
    Case(
        "sharded-part-size-differs",
        _sharded(index_hook=lambda i: i["parts"][1].update(size=i["parts"][1]["size"] - 1)),
        InvalidManifest,
        f"{PART1}",
    ),
    Case(
        "sharded-part-xxh3-differs",
        _sharded(index_hook=_ref(1, xxh3="0" * 32)),
        InvalidManifest,
        f"{PART1}",
    ),
    Case(
        "sharded-part-symlink-out",
        _sharded(after=_replace_part(_link_part(True))),
        InvalidManifest,
        f"{PART1}",
    ),
    Case(
        "sharded-part-symlink-in",
        _sharded(after=_replace_part(_link_part(False))),
        InvalidManifest,
        f"{PART1}",
    ),
    Case(
        "sharded-part-through-linked-dir",
        _sharded(
            index_hook=_ref(1, name=f"{STEP_DIR}/linked/{_part_name(1).rsplit('/', 1)[1]}"),
            after=_linked_dir_part,
        ),
        InvalidManifest,
        f"{STEP_DIR}/linked/part-00001-",
    ),
    Case("sharded-part-fifo", _sharded(after=_replace_part(_fifo_part)), InvalidManifest, PART1),
    Case("sharded-part-dir", _sharded(after=_replace_part(_dir_part)), InvalidManifest, PART1),
    Case(
        "sharded-part-64MiB",
        _sharded(after=_replace_part(_huge_part)),
        InvalidManifest,
        f"{PART1}",
    ),
    # the part's own claims against the index's
    Case(
        "sharded-part-world-size-3",
        _sharded(_each_part(_set("world_size", 3))),
        InvalidManifest,
        f"{PART1}",
    ),
    Case(
        "sharded-part-other-plan",
        _sharded(_each_part(_set("plan", "ef" * 32))),
        InvalidManifest,
        f"{PART1}",
    ),
    Case(
        "sharded-part-says-rank-0",
        _sharded(_each_part(_set("rank", 0))),
        InvalidManifest,
        f"{PART1}",
    ),
    Case(
        "sharded-part-other-step",
        _sharded(_each_part(_set("step", STEP + 1))),
        InvalidManifest,
        f"{PART1}",
    ),
    Case(
        "sharded-part-kind-snapshot",
        _sharded(_each_part(_set("kind", "snapcore.snapshot"))),
        InvalidManifest,
        f"{PART1}",
    ),
    Case(
        "sharded-part-duplicate-json-key",
        _sharded(
            raw_part=lambda r, d: d.replace(b'"rank": 1', b'"rank": 1, "rank": 0') if r else d
        ),
        InvalidManifest,
        f"{PART1}",
    ),
    Case(
        "sharded-part-not-json",
        _sharded(raw_part=lambda r, d: d[:-1] if r else d),
        InvalidManifest,
        f"{PART1}",
    ),
    # what the parts say of the tensors
    Case(
        "sharded-dtype-disagrees",
        _sharded(_each_part(_set("tensors.0.dtype", "int32"))),
        InvalidManifest,
        PART1,
    ),
    Case(
        "sharded-shape-disagrees",
        _sharded(_each_part(_set("tensors.0.shape", [4, 4]))),
        InvalidManifest,
        PART1,
    ),
    Case("sharded-pieces-overlap", _sharded(_rows(1, 1, 1)), InvalidManifest, f"{INDEX}: w: "),
    Case("sharded-pieces-gap", _sharded(_rows(0, 0, 1)), InvalidManifest, f"{INDEX}: w: "),
    Case(
        "sharded-pieces-overlap-and-gap",
        _sharded(_rows(1, 1, 2)),
        InvalidManifest,
        f"{INDEX}: w: the parts' pieces hold 16 of the 12",
    ),
    Case(
        "sharded-piece-outside",
        _sharded(_rows(1, 3, 1)),
        InvalidManifest,
        f"{PART1}",
    ),
    Case(
        "sharded-keys-too-few",
        _sharded(_each_part(_set("keys", ["w"]))),
        InvalidManifest,
        f"{PART1}",
    ),
    Case(
        "sharded-keys-not-strings",
        _sharded(_each_part(_set("keys", [1, None]))),
        InvalidManifest,
        f"{PART1}",
    ),
    Case("sharded-rank-local-no-piece", _sharded(_no_piece), InvalidManifest, f"{INDEX}: "),
    Case(
        "sharded-tree-tensor-out-of-range",
        _sharded(_each_part(_set("tree.dict.0.1.tensor", 2))),
        InvalidManifest,
        f"{PART1}",
    ),
    Case(
        "sharded-files-disagree-on-size",
        _sharded(
            _each_part(
                lambda p: p["files"][0].update(
                    name=p["files"][0]["name"].replace("-r1", "-r0"), size=200
                )
            )
        ),
        InvalidManifest,
        PART1,
    ),
]


def _deep(parts: list[dict[str, Any]]) -> None:
    """A value nested 300 lists deep in every part: read without exhausting the stack."""
    node: dict[str, Any] = {"int": 0}
    for _ in range(300):
        node = {"list": [node]}
    for p in parts:
        p["tree"]["dict"].append(["deep", node])


SHARDED.append(Case("sharded-deep-tree", _sharded(_deep), None))
CASES += SHARDED
# A local directory may hold some ranks' parts only (a node's): not an error until a
# piece of a missing part is needed (tests/integration/test_hostile.py).
PART_MISSING = Case(
    "sharded-part-missing",
    _sharded(after=lambda root, i: (root / i["parts"][1]["name"]).unlink()),
    CorruptSnapshot,
    PART1,
)


def write_corpus(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for case in CASES:
        case.build(out / case.name)
    print(f"wrote {len(CASES)} hostile stores to {out}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/integration/hostile/corpus.py OUTDIR")
    write_corpus(Path(sys.argv[1]))
