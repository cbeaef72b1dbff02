"""Manifests are parsed defensively: every hostile variant is refused with a clear error."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest
import torch

import snapcore
from snapcore import manifest as mf
from snapcore.directory import LocalDirectory


@pytest.fixture
def saved(tmp_path):
    state = {"w": torch.arange(12, dtype=torch.float32).view(3, 4), "b": torch.ones(5), "n": 3}
    snapcore.save(state, tmp_path, step=7)
    path = LocalDirectory(tmp_path).manifest_path(7)
    return tmp_path, path, json.loads(path.read_bytes())


def _set(doc: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    *head, last = dotted.split(".")
    obj: Any = doc
    for k in head:
        obj = obj[int(k)] if isinstance(obj, list) else obj[k]
    if isinstance(obj, list):
        obj[int(last)] = value
    else:
        obj[last] = value
    return doc


Mutation = Callable[[dict[str, Any]], bytes]

HOSTILE: dict[str, tuple[Mutation, str]] = {
    "truncated": (lambda d: json.dumps(d).encode()[:-20], "not valid JSON"),
    "not-json": (lambda d: b"\x00\xff garbage", "not valid JSON"),
    "array": (lambda d: b"[1, 2]", "must be a JSON object"),
    "nan-constant": (
        lambda d: json.dumps(d).replace('"created_unix": ', '"created_unix": NaN, "x":').encode(),
        "not valid JSON",
    ),
    "future-version": (
        lambda d: json.dumps(_set(d, "format_version", 4)).encode(),
        "format_version 4",
    ),
    "extra-field": (lambda d: json.dumps({**d, "exec": "rm -rf /"}).encode(), "schema violation"),
    "escaping-name": (
        lambda d: json.dumps(_set(d, "files.0.name", "../../etc/passwd")).encode(),
        "schema violation",
    ),
    "absolute-name": (
        lambda d: json.dumps(_set(d, "files.0.name", "/etc/passwd")).encode(),
        "schema violation",
    ),
    "chunk-outside-file": (
        lambda d: json.dumps(_set(d, "blobs.0.chunks.0.offset", 1 << 40)).encode(),
        "outside",
    ),
    "overlapping-chunks": (
        lambda d: json.dumps(
            _set(d, "blobs.1.chunks.0.offset", d["blobs"][0]["chunks"][0]["offset"])
        ).encode(),
        "overlapping",
    ),
    "blob-size-mismatch": (
        lambda d: json.dumps(_set(d, "blobs.0.nbytes", 4)).encode(),
        "chunks hold",
    ),
    "huge-shape": (
        lambda d: json.dumps(_set(d, "tensors.0.shape", [1 << 40, 1 << 40])).encode(),
        "too large",
    ),
    "piece-beyond-blob": (
        lambda d: json.dumps(_set(d, "tensors.0.pieces.0.byte_offset", 1 << 20)).encode(),
        "addresses byte",
    ),
    "bad-dtype": (lambda d: json.dumps(_set(d, "tensors.0.dtype", "object")).encode(), "schema"),
    "negative-step": (lambda d: json.dumps(_set(d, "step", -1)).encode(), "schema"),
    "tensor-index": (
        lambda d: json.dumps(_set(d, "tree", {"tensor": 99})).encode(),
        "references tensor 99",
    ),
    "bad-node": (
        lambda d: json.dumps(_set(d, "tree", {"pickle": "cos\nsystem"})).encode(),
        "schema",
    ),
    "duplicate-keys": (
        lambda d: json.dumps(
            _set(d, "tree", {"dict": [["a", {"int": 1}], ["a", {"int": 2}]]})
        ).encode(),
        "duplicate keys",
    ),
    "deep-tree": (
        lambda d: json.dumps(_set(d, "tree", "DEEP")).replace('"DEEP"', _deep(100_000)).encode(),
        "",
    ),
    "file-index": (
        lambda d: json.dumps(_set(d, "blobs.0.chunks.0.file", 5)).encode(),
        "names file",
    ),
    "bad-hash": (lambda d: json.dumps(_set(d, "blobs.0.chunks.0.xxh3", "zz")).encode(), "schema"),
    "too-big": (lambda d: b" " * (mf.MAX_MANIFEST_BYTES + 1), "64 MiB cap"),
    # JSON Schema's "integer" takes 0.0: an index that is a float must not get through
    "float-blob-index": (
        lambda d: json.dumps(_set(d, "tensors.0.pieces.0.blob", 0.0)).encode(),
        "schema violation at tensors[0].pieces[0]",
    ),
    "float-file-index": (
        lambda d: json.dumps(_set(d, "blobs.0.chunks.0.file", 0.0)).encode(),
        "schema violation at blobs[0].chunks[0]",
    ),
    "float-tensor-index": (
        lambda d: json.dumps(_set(d, "tree", {"tensor": 0.0})).encode(),
        "tensor node 0.0 is not an integer",
    ),
    "float-int-node": (
        lambda d: json.dumps(_set(d, "tree", {"int": 3.0})).encode(),
        "int node 3.0",
    ),
    "float-shape": (
        lambda d: json.dumps(_set(d, "tensors.0.shape", [3.0, 4])).encode(),
        "schema violation at tensors[0].shape",
    ),
    "float-step": (lambda d: json.dumps(_set(d, "step", 7.0)).encode(), "at step"),
}


def _deep(n: int) -> str:
    return '{"list": [' * n + '{"int": 0}' + "]}" * n


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_manifest_is_refused(saved, name):
    root, path, doc = saved
    mutate, message = HOSTILE[name]
    path.write_bytes(mutate(doc))
    with pytest.raises(snapcore.InvalidManifest) as e:
        snapcore.load(root)
    assert message in str(e.value)
    assert str(path) in str(e.value)  # the error names the file


def test_manifest_round_trip_is_stable(saved):
    _, path, _doc = saved
    m = mf.parse(path.read_bytes(), where="x")
    assert mf.parse(m.dumps(), where="x") == m


def test_damaged_chunk_is_reported_with_tensor_chunk_and_file(saved):
    root, _, doc = saved
    data = root / doc["files"][0]["name"]
    raw = bytearray(data.read_bytes())
    w_chunk = doc["blobs"][doc["tensors"][0]["pieces"][0]["blob"]]["chunks"][0]
    raw[w_chunk["offset"] + 3] ^= 0x40
    data.write_bytes(bytes(raw))
    with pytest.raises(snapcore.CorruptSnapshot) as e:
        snapcore.load(root)
    assert e.value.tensor == "w" and e.value.chunk == 0 and e.value.file == str(data)
    assert "w" in str(e.value) and str(data) in str(e.value)
    with pytest.raises(snapcore.CorruptSnapshot):
        snapcore.restore({"w": torch.zeros(3, 4), "b": torch.zeros(5), "n": 0}, root)
    # verify=False skips the hashes (and so returns the damaged bytes)
    out = snapcore.load(root, verify=False)
    assert not torch.equal(out["w"], torch.arange(12, dtype=torch.float32).view(3, 4))


def test_truncated_or_missing_data_file(saved):
    root, _, doc = saved
    data = root / doc["files"][0]["name"]
    data.write_bytes(data.read_bytes()[:10])
    with pytest.raises(snapcore.CorruptSnapshot, match="has 10 bytes"):
        snapcore.load(root)
    data.unlink()
    with pytest.raises(snapcore.CorruptSnapshot, match="missing"):
        snapcore.load(root)


def test_symlink_out_of_the_store_is_refused(saved, tmp_path_factory):
    root, _, doc = saved
    data = root / doc["files"][0]["name"]
    outside = tmp_path_factory.mktemp("outside") / "x.bin"
    outside.write_bytes(data.read_bytes())
    data.unlink()
    data.symlink_to(outside)
    # Data files are regular files: a symlink is refused wherever it points (format.md).
    with pytest.raises(snapcore.CorruptSnapshot, match="is a symbolic link"):
        snapcore.load(root)


def test_schema_in_docs_is_the_shipped_one():
    from pathlib import Path

    docs = Path(__file__).parents[2] / "docs" / "manifest.schema.json"
    shipped = Path(mf.__file__).with_name("manifest.schema.json")
    assert docs.resolve() == shipped.resolve()
