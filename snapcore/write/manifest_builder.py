"""The one manifest builder: every tier's manifest of a snapshot is made here, and only
here are ``world_size`` and ``rank_files`` set (docs/format.md)."""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import manifest as mf
from ..io_types import Location
from .chunks import Staged


@dataclass(frozen=True)
class ChunkRecord:
    """One chunk as a tier stores it: ``stored`` bytes at ``location``, decoding (with
    ``codec``) to ``raw_length`` bytes whose xxh3 is ``xxh3``."""

    location: Location
    stored: int
    xxh3: str
    codec: str
    raw_length: int


@dataclass(frozen=True)
class BlobRecord:
    nbytes: int
    element_size: int
    chunks: Sequence[ChunkRecord]


def build_manifest(
    *,
    step: int,
    blobs: Sequence[BlobRecord],
    tensors: list[mf.TensorEntry],
    tree: dict[str, Any],
    created_unix: float | None = None,
    writer: dict[str, Any] | None = None,
    part: mf.PartInfo | None = None,
) -> mf.Manifest:
    """A tier's manifest of ``step``: files in the order chunks first name them. With
    ``part``, the part of a sharded snapshot that one rank wrote."""
    files: list[mf.FileRef] = []
    index: dict[str, int] = {}
    out = []
    for b in blobs:
        chunks = []
        for c in b.chunks:
            loc = c.location
            if loc.name not in index:
                index[loc.name] = len(files)
                files.append(mf.FileRef(loc.name, loc.file_size))
            chunks.append(
                mf.Chunk(index[loc.name], loc.offset, c.stored, c.xxh3, c.codec, c.raw_length)
            )
        out.append(mf.Blob(b.nbytes, chunks, b.element_size))
    return mf.Manifest(
        step=step,
        created_unix=time.time() if created_unix is None else created_unix,
        writer=writer_info() if writer is None else writer,
        # A whole snapshot is one process's; a part lists the files of its rank only.
        world_size=part.world_size if part is not None else 1,
        rank_files=[list(range(len(files)))],
        files=files,
        blobs=out,
        tensors=tensors,
        tree=tree,
        part=part,
    )


def staged_manifest(
    s: Staged,
    locations: Sequence[Location | None],
    codecs: list[str],
    stored: list[int],
    drop: Collection[int] = (),
) -> mf.Manifest:
    """The manifest of a staged snapshot whose chunk ``k`` is stored at ``locations[k]``.

    ``drop``: tensors whose pieces this tier's part leaves out (``PartSpec.drop``); the
    blobs no other piece names are left out too, and their chunks need no location."""
    keep, tensors = kept(s.layout.entries, len(s.layout.blobs), drop)
    records: list[list[ChunkRecord]] = [[] for _ in s.layout.blobs]
    for k, (b_i, _, _, raw) in enumerate(s.chunks):
        loc = locations[k]
        if b_i in keep:
            if loc is None:
                raise AssertionError(f"step {s.step}: chunk {k} has no location")
            records[b_i].append(ChunkRecord(loc, stored[k], s.digests[k], codecs[k], raw))
    blobs = [
        BlobRecord(b.nbytes, b.element_size, records[b_i])
        for b_i, b in enumerate(s.layout.blobs)
        if b_i in keep
    ]
    return build_manifest(step=s.step, blobs=blobs, tensors=tensors, tree=s.tree, part=s.part)


def kept(
    tensors: Sequence[mf.TensorEntry], nblobs: int, drop: Collection[int]
) -> tuple[dict[int, int], list[mf.TensorEntry]]:
    """The blobs that the pieces of ``tensors`` outside ``drop`` name (old index -> new,
    in order), and the tensor table with the pieces of ``drop`` left out and the others
    renumbered. No ``drop``: every blob, the table as it is."""
    if not drop:
        return {b: b for b in range(nblobs)}, list(tensors)
    named = sorted({p.blob for i, t in enumerate(tensors) if i not in drop for p in t.pieces})
    keep = {b: n for n, b in enumerate(named)}
    table = [
        mf.TensorEntry(
            t.dtype,
            t.shape,
            [] if i in drop else [dataclasses.replace(p, blob=keep[p.blob]) for p in t.pieces],
        )
        for i, t in enumerate(tensors)
    ]
    return keep, table


def restrict(m: mf.Manifest, drop: Collection[int]) -> mf.Manifest:
    """A part ``m`` as a tier that lacks the pieces of the tensors in ``drop`` records it
    (object storage: a rank's part without its node copies): those tensors keep their
    entry with no piece, the blobs no remaining piece names and the files no remaining
    chunk names are left out. ``m`` itself when that changes nothing."""
    if not any(m.tensors[i].pieces for i in drop):
        return m
    keep, tensors = kept(m.tensors, len(m.blobs), drop)
    blobs = [
        BlobRecord(
            b.nbytes,
            b.element_size,
            [
                ChunkRecord(
                    Location(m.files[c.file].name, c.offset, c.length, m.files[c.file].size),
                    c.length,
                    c.xxh3,
                    c.codec,
                    c.raw_length,
                )
                for c in b.chunks
            ],
        )
        for b_i, b in enumerate(m.blobs)
        if b_i in keep
    ]
    return build_manifest(
        step=m.step,
        blobs=blobs,
        tensors=tensors,
        tree=m.tree,
        created_unix=m.created_unix,
        writer=m.writer,
        part=m.part,
    )


def build_index(step: int, plan: str, parts: list[mf.PartRef], *, save: str = "") -> mf.Index:
    """The index (``manifest.json``) that commits a sharded step made of ``parts``, one
    per rank in rank order. ``save``: the save's identity, the same in every tier's index
    of one save (``writer.save``; docs/format.md), none when empty."""
    return mf.Index(
        step=step,
        created_unix=time.time(),
        writer={**writer_info(), "save": save} if save else writer_info(),
        world_size=len(parts),
        plan=plan,
        parts=parts,
    )


def writer_info() -> dict[str, Any]:
    """Who wrote a manifest (informational)."""
    return {
        "snapcore": _version(),
        "torch": torch.__version__,
        "host": socket.gethostname(),
        "pid": os.getpid(),
    }


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("snapcore")
    except PackageNotFoundError:
        return "unknown"
