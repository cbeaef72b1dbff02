"""Chunks: a staged snapshot cut into chunks, their hashes, and the one index of where
each tier already stores a chunk's content (so unchanged chunks are referenced, not
written again)."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import xxhash

from .. import manifest as mf
from ..errors import SnapcoreError
from ..io_types import ChunkKey, Location, Progress, Window
from ..planning.layout import Layout
from ..staging.arena import HostArena

log = logging.getLogger(__name__)


@dataclass
class Staged:
    """A snapshot staged in an arena: what the persist and upload stages need."""

    step: int
    layout: Layout
    tree: dict[str, Any]
    arena: HostArena
    slot: int
    chunks: list[tuple[int, int, int, int]]  # (blob, chunk index, arena offset, length)
    digests: list[str] = field(default_factory=list)
    part: mf.PartInfo | None = None  # a rank's part of a sharded save
    # per tier: the tensors whose pieces its part leaves out (``PartSpec.drop``)
    drops: dict[str, frozenset[int]] = field(default_factory=dict)

    def blob_chunks(self) -> list[list[int]]:
        """Indices into ``chunks`` per blob."""
        out: list[list[int]] = [[] for _ in self.layout.blobs]
        for k, (b_i, _, _, _) in enumerate(self.chunks):
            out[b_i].append(k)
        return out


def chunk_list(layout: Layout, chunk_bytes: int) -> list[tuple[int, int, int, int]]:
    out = []
    for b_i, blob_chunks in enumerate(layout.chunks(chunk_bytes)):
        for j, (off, n) in enumerate(blob_chunks):
            out.append((b_i, j, off, n))
    return out


def hash_chunks(
    s: Staged,
    ready: list[threading.Event],
    then: Callable[[], None] | None,
    progress: Progress | None = None,
) -> None:
    """Hash every chunk in order, signalling each; run ``then`` once all are known. With
    ``progress`` (the pipelined whole mode), each chunk only once it is staged."""
    s.digests = [""] * len(s.chunks)
    for k, (_, _, off, n) in enumerate(s.chunks):
        if progress is not None:
            progress.wait_for(off + n)
        s.digests[k] = xxhash.xxh3_128_hexdigest(s.arena.view(off, n))
        ready[k].set()
    if then is not None:
        then()


def hash_window(
    w: Window,
    chunks: list[list[tuple[int, int]]],
    digests: list[list[str]],
    partial: dict[tuple[int, int], Any],
) -> None:
    for i, blob_chunks in enumerate(chunks):
        for j, (off, n) in enumerate(blob_chunks):
            s, e = max(off, w.start), min(off + n, w.end)
            if s >= e:
                continue
            view = w.arena.view(w.arena_offset + s - w.start, e - s)
            if s == off and e == off + n:
                digests[i][j] = xxhash.xxh3_128_hexdigest(view)
                continue
            hasher = partial.setdefault((i, j), xxhash.xxh3_128())
            hasher.update(view)
            if e == off + n:
                digests[i][j] = partial.pop((i, j)).hexdigest()


class ChunkIndex:
    """Where each tier already stores each chunk content, from its committed manifests.

    Rebuilt for a tier whenever its committed steps are not what this index last saw: a
    `snapcore gc`, retention, or another process may have removed snapshots (and their
    files). The rebuild reads only the manifests of steps it has not seen: each step's
    chunk locations are kept (a re-saved step is forgotten with ``invalidate``), so that
    retention's removal of a step costs the next save no manifest reads. A step still
    listed whose manifest file is not the one indexed (its identity: inode, mtime, size;
    another writer removed the step and committed the same step number again) is read
    again. ``tier_of(name)`` gives the
    tier object (``committed_steps``, ``read_manifest``).
    """

    def __init__(self, tier_of: Callable[[str], Any]) -> None:
        self._tier_of = tier_of
        self._index: dict[str, dict[ChunkKey, Location] | None] = {}
        self._steps: dict[str, frozenset[int]] = {}
        # per tier and committed step: its chunks' (key, location), in manifest order
        self._by_step: dict[str, dict[int, list[tuple[ChunkKey, Location]]]] = {}
        # per tier and step: the identity of the manifest those chunks were read from
        self._ids: dict[str, dict[int, tuple[int, ...] | None]] = {}

    @staticmethod
    def _identity(t: Any, step: int) -> tuple[int, ...] | None:
        """The identity of ``step``'s manifest file (device, inode, mtime, size) where the
        tier is a directory (its ``LocalDirectory``'s ``manifest_path``): a commit
        replaces the file (a new inode), so another writer's commit of the same step
        number, after it removed the step, is seen. None where the tier has no cheap
        identity (object storage)."""
        path = getattr(getattr(t, "store", None), "manifest_path", None)  # LocalTier's
        if path is None:
            return None
        try:
            st = os.stat(path(step))
        except OSError:
            return None
        return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)

    def get(self, tier: str) -> dict[ChunkKey, Location]:
        t = self._tier_of(tier)
        steps = frozenset(t.committed_steps())
        ids = {s: self._identity(t, s) for s in steps}
        known = self._by_step.setdefault(tier, {})
        seen = self._ids.setdefault(tier, {})
        # a step still listed whose manifest is not the one indexed: replaced by another
        # commit of that step number (another writer); its chunks are read again
        replaced = [s for s in known if s in steps and ids[s] != seen.get(s)]
        index = self._index.get(tier)
        if index is None or steps != self._steps.get(tier) or replaced:
            for gone in [s for s in known if s not in steps] + replaced:
                del known[gone]
                seen.pop(gone, None)
            index = {}
            self._steps[tier] = steps
            for step in sorted(steps):
                if step not in known:
                    try:  # its identity first: a replacement after it is seen next time
                        seen[step] = ids[step]
                        known[step] = self._entries(t.read_manifest(step))
                    except SnapcoreError as e:
                        log.warning("%s tier, step %d: not shared: %s", tier, step, e)
                        continue
                for key, loc in known[step]:
                    index.setdefault(key, loc)
            self._index[tier] = index
        return index

    def add(self, tier: str, m: mf.Manifest) -> None:
        """A commit of ``m`` in ``tier``: its chunks can be shared from now on."""
        entries = self._entries(m)
        self._by_step.setdefault(tier, {})[m.step] = entries
        self._ids.setdefault(tier, {})[m.step] = self._identity(self._tier_of(tier), m.step)
        index = self._index.get(tier)
        if index is not None:
            for key, loc in entries:
                index.setdefault(key, loc)
            self._steps[tier] = self._steps.get(tier, frozenset()) | {m.step}

    def invalidate(self, tier: str, steps: Iterable[int] | None = None) -> None:
        """Files of ``tier`` may have gone: rebuild on next use. ``steps``: only these
        steps were removed (retention), the others' chunks are where they were; None:
        anything may have changed (a re-saved step), every manifest is read again."""
        self._index[tier] = None
        if steps is None:
            self._by_step.pop(tier, None)
            self._ids.pop(tier, None)
        else:
            known = self._by_step.get(tier, {})
            seen = self._ids.get(tier, {})
            for s in steps:
                known.pop(s, None)
                seen.pop(s, None)

    @staticmethod
    def _entries(m: mf.Manifest) -> list[tuple[ChunkKey, Location]]:
        out = []
        for b in m.blobs:
            for c in b.chunks:
                f = m.files[c.file]
                out.append(
                    ((c.xxh3, c.raw_length, c.codec), Location(f.name, c.offset, c.length, f.size))
                )
        return out
