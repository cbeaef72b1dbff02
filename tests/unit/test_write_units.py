"""Unit tests of the write path's pure parts, with no engine, arena, thread or disk: the
blob layout (planning/layout.py), the one manifest builder, and the chunk index."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from snapcore import manifest as mf
from snapcore.errors import InvalidManifest
from snapcore.io_types import Location
from snapcore.planning.layout import ALIGN, contiguous_strides, plan
from snapcore.write.chunks import ChunkIndex, Staged, chunk_list
from snapcore.write.manifest_builder import (
    BlobRecord,
    ChunkRecord,
    build_manifest,
    restrict,
    staged_manifest,
)

# -- planning/layout.py ----------------------------------------------------------------------


def test_layout_places_blobs_aligned_and_shares_storage():
    base = torch.arange(100, dtype=torch.float32)
    a, b = base[:50], base[50:]  # two views of one storage: one blob spanning both
    c = torch.ones(3, dtype=torch.float16)
    strided = torch.arange(12, dtype=torch.int64).view(3, 4).t()  # alone: its own bytes
    layout = plan([a, b, c, strided])
    assert len(layout.blobs) == 3
    assert layout.blobs[0].tensors == [0, 1] and layout.blobs[0].nbytes == 400
    assert [e.pieces[0].byte_offset for e in layout.entries[:2]] == [0, 200]
    assert all(blob.offset % ALIGN == 0 for blob in layout.blobs)
    s = layout.blobs[2]
    assert not s.raw and s.nbytes == 96  # gathered: only its 12 elements
    assert layout.entries[3].pieces[0].strides == contiguous_strides((4, 3))
    assert layout.total == layout.blobs[-1].offset + layout.blobs[-1].nbytes


def test_layout_never_groups_empty_tensors():
    e1, e2 = torch.empty(0), torch.empty(0, 3)
    layout = plan([e1, e2])
    assert len(layout.blobs) == 2 and layout.data_bytes == 0


def test_layout_chunks_cut_each_blob():
    layout = plan([torch.zeros(1000, dtype=torch.uint8), torch.zeros(10, dtype=torch.uint8)])
    chunks = layout.chunks(256)
    assert [n for _, n in chunks[0]] == [256, 256, 256, 232]
    assert chunks[1] == [(layout.blobs[1].offset, 10)]
    assert chunk_list(layout, 256)[4] == (1, 0, layout.blobs[1].offset, 10)


# -- write/manifest_builder.py ----------------------------------------------------------------


def _tensor_entry(n: int) -> mf.TensorEntry:
    return mf.TensorEntry("uint8", (n,), [mf.Piece((0,), (n,), 0, 0, (1,))])


def test_build_manifest_orders_files_by_first_use_and_parses_back():
    old = Location("step-000000000001/data-a-r0.bin", 0, 100, 100)
    new = Location("step-000000000002/data-b-r0.bin", 0, 60, 160)
    blobs = [
        BlobRecord(
            200,
            1,
            [
                ChunkRecord(new, 60, "1" * 32, "zstd", 100),
                ChunkRecord(old, 100, "2" * 32, "none", 100),
            ],
        ),
    ]
    m = build_manifest(
        step=2,
        blobs=blobs,
        tensors=[_tensor_entry(200)],
        tree={"tensor": 0},
        created_unix=5.0,
        writer={"who": "test"},
    )
    assert [f.name for f in m.files] == [new.name, old.name]
    assert [c.file for c in m.blobs[0].chunks] == [0, 1]
    assert m.world_size == 1 and m.rank_files == [[0, 1]]
    assert (m.created_unix, m.writer) == (5.0, {"who": "test"})
    again = mf.parse(m.dumps(), where="test")  # a valid manifest, every check passed
    assert again.files == m.files and again.blobs == m.blobs


def test_build_manifest_output_is_checked_by_the_parser():
    # a chunk that lies outside its file: the builder writes what it is told, the parser
    # refuses it (the builder is not where validation happens, the reader is)
    loc = Location("step-000000000001/data-a-r0.bin", 50, 100, 100)
    m = build_manifest(
        step=1,
        blobs=[BlobRecord(100, 1, [ChunkRecord(loc, 100, "3" * 32, "none", 100)])],
        tensors=[_tensor_entry(100)],
        tree={"tensor": 0},
    )
    with pytest.raises(InvalidManifest, match="outside"):
        mf.parse(m.dumps(), where="test")


def test_staged_manifest_takes_each_chunk_location_codec_and_stored_length():
    layout = plan([torch.zeros(300, dtype=torch.uint8), torch.zeros(10, dtype=torch.uint8)])
    chunks = chunk_list(layout, 128)
    s = Staged(7, layout, {"tensor": 0}, arena=None, slot=0, chunks=chunks)  # type: ignore[arg-type]
    s.digests = [f"{k:032x}" for k in range(len(chunks))]
    locs = [Location("f.bin", off, n, layout.total) for _, _, off, n in chunks]
    m = staged_manifest(s, locs, ["none"] * len(chunks), [n for *_, n in chunks])
    assert [len(b.chunks) for b in m.blobs] == [3, 1]
    assert [c.raw_length for c in m.blobs[0].chunks] == [128, 128, 44]
    assert m.blobs[1].chunks[0].xxh3 == s.digests[3]
    assert m.tensors == layout.entries


def test_a_tier_part_leaves_out_the_dropped_pieces_and_the_blobs_only_they_name():
    """A rank's part without its node copies (object storage's): the dropped tensors keep
    their entry with no piece, the blobs only they name go, the others are renumbered;
    the part still parses, and naming its chunks needs no location for the dropped."""
    big = torch.zeros(300, dtype=torch.uint8)
    tensors = [torch.zeros(10, dtype=torch.uint8), big, big[:100], torch.ones(20)]
    layout = plan(tensors)
    assert len(layout.blobs) == 3  # big and its view share one
    chunks = chunk_list(layout, 128)
    info = mf.PartInfo(1, "a" * 64, "b" * 64, ("w", "x", "y", None), 2)
    s = Staged(7, layout, {"tensor": 0}, arena=None, slot=0, chunks=chunks, part=info)  # type: ignore[arg-type]
    s.digests = [f"{k:032x}" for k in range(len(chunks))]
    locs = [Location("step-000000000007/d.bin", off, n, layout.total) for _, _, off, n in chunks]
    stored = [n for *_, n in chunks]
    full = staged_manifest(s, locs, ["none"] * len(chunks), stored)
    assert restrict(full, set()) is full and restrict(full, {1}) is not full

    gone = restrict(full, {0})  # the first blob only tensor 0 names
    assert [b.nbytes for b in gone.blobs] == [b.nbytes for b in full.blobs[1:]]
    assert gone.tensors[0].pieces == []
    assert [p.blob for t in gone.tensors[1:] for p in t.pieces] == [0, 0, 1]
    mf.parse_part(gone.dumps(), where="test")  # a valid part
    shared = restrict(full, {1})  # big's blob stays: its view (tensor 2) names it
    assert len(shared.blobs) == 3 and shared.tensors[1].pieces == []

    blob0 = {k for k, c in enumerate(chunks) if c[0] == 0}
    no_loc = [None if k in blob0 else loc for k, loc in enumerate(locs)]
    direct = staged_manifest(s, no_loc, ["none"] * len(chunks), stored, {0})
    assert (direct.files, direct.blobs, direct.tensors) == (gone.files, gone.blobs, gone.tensors)
    with pytest.raises(AssertionError, match="no location"):
        staged_manifest(s, no_loc, ["none"] * len(chunks), stored)


def test_only_the_builder_makes_a_manifest():
    """Issue 9's rule: a grep for `world_size=` and `rank_files=` in the writers finds the
    one builder; and no module but it (and the readers: the parser, from the JSON it
    reads, and the assembler of a sharded snapshot's parts) makes a Manifest."""
    root = Path(__file__).resolve().parents[2] / "snapcore"
    setters = sorted(
        str(p.relative_to(root))
        for p in (root / "write").rglob("*.py")
        if re.search(r"\b(world_size|rank_files)=", p.read_text())
    )
    assert setters == ["write/manifest_builder.py"]
    makers = sorted(
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if re.search(r"\b(mf\.)?Manifest\(", p.read_text())
    )
    assert makers == ["assemble.py", "manifest.py", "write/manifest_builder.py"]
    assert len(re.findall(r"\bManifest\(", (root / "manifest.py").read_text())) == 1


# -- write/chunks.py: ChunkIndex ----------------------------------------------------------------


class FakeTier:
    def __init__(self) -> None:
        self.manifests: dict[int, mf.Manifest | Exception] = {}
        self.reads = 0

    def committed_steps(self) -> list[int]:
        return sorted(self.manifests)

    def read_manifest(self, step: int) -> mf.Manifest:
        self.reads += 1
        m = self.manifests[step]
        if isinstance(m, Exception):
            raise m
        return m


def _manifest(step: int, digest: str, name: str) -> mf.Manifest:
    loc = Location(name, 0, 10, 10)
    return build_manifest(
        step=step,
        blobs=[BlobRecord(10, 1, [ChunkRecord(loc, 10, digest, "none", 10)])],
        tensors=[_tensor_entry(10)],
        tree={"tensor": 0},
    )


def test_chunk_index_finds_chunks_of_committed_manifests():
    tier = FakeTier()
    tier.manifests[1] = _manifest(1, "a" * 32, "s1.bin")
    index = ChunkIndex(lambda name: tier)
    got = index.get("local")
    assert got == {("a" * 32, 10, "none"): Location("s1.bin", 0, 10, 10)}
    reads = tier.reads
    assert index.get("local") is got and tier.reads == reads  # cached while steps hold


def test_chunk_index_add_after_a_commit_and_rebuild_after_an_outside_change():
    tier = FakeTier()
    tier.manifests[1] = _manifest(1, "a" * 32, "s1.bin")
    index = ChunkIndex(lambda name: tier)
    index.get("local")
    m2 = _manifest(2, "b" * 32, "s2.bin")
    tier.manifests[2] = m2
    index.add("local", m2)  # our own commit: no re-read
    reads = tier.reads
    assert ("b" * 32, 10, "none") in index.get("local") and tier.reads == reads
    del tier.manifests[1]  # a `snapcore gc` in another process
    after = index.get("local")
    # The step's chunks are gone; step 2's manifest, unchanged, is not read again.
    assert ("a" * 32, 10, "none") not in after and ("b" * 32, 10, "none") in after
    assert tier.reads == reads
    tier.manifests[3] = _manifest(3, "c" * 32, "s3.bin")  # written by another process
    assert ("c" * 32, 10, "none") in index.get("local") and tier.reads == reads + 1
    index.invalidate("local")  # anything may have changed (a re-saved step): all re-read
    reads = tier.reads
    index.get("local")
    assert tier.reads == reads + 2


def test_chunk_index_after_retention_reads_no_manifest_and_keeps_shared_chunks():
    tier = FakeTier()
    index = ChunkIndex(lambda name: tier)
    index.get("local")
    # steps 1 and 2 share chunk "a" (stored in step 1's file); step 2 adds "b"
    for step, digests in ((1, ["a"]), (2, ["a", "b"])):
        loc = {d: Location("s1.bin" if d == "a" else f"s{step}.bin", 0, 10, 10) for d in digests}
        m = build_manifest(
            step=step,
            blobs=[
                BlobRecord(10, 1, [ChunkRecord(loc[d], 10, d * 32, "none", 10)]) for d in digests
            ],
            tensors=[
                mf.TensorEntry("uint8", (10,), [mf.Piece((0,), (10,), i, 0, (1,))])
                for i in range(len(digests))
            ],
            tree={f"t{i}": i for i in range(len(digests))},
        )
        tier.manifests[step] = m
        index.add("local", m)
    reads = tier.reads
    del tier.manifests[1]  # retention removes step 1; its file stays (step 2 names it)
    index.invalidate("local", [1])
    got = index.get("local")
    assert tier.reads == reads  # step 2's chunk locations were kept
    assert got == {
        ("a" * 32, 10, "none"): Location("s1.bin", 0, 10, 10),
        ("b" * 32, 10, "none"): Location("s2.bin", 0, 10, 10),
    }


def test_chunk_index_skips_a_damaged_manifest(caplog):
    tier = FakeTier()
    tier.manifests[1] = InvalidManifest("bad")
    tier.manifests[2] = _manifest(2, "c" * 32, "s2.bin")
    index = ChunkIndex(lambda name: tier)
    with caplog.at_level(logging.WARNING):
        got: dict[Any, Any] = index.get("remote")
    assert list(got) == [("c" * 32, 10, "none")]
    assert "step 1: not shared: bad" in caplog.text
