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


def write_corpus(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for case in CASES:
        case.build(out / case.name)
    print(f"wrote {len(CASES)} hostile stores to {out}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/integration/hostile/corpus.py OUTDIR")
    write_corpus(Path(sys.argv[1]))
