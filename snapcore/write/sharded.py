"""What one rank writes of a sharded save, from the agreed global plan.

Under torch.distributed (``snapcore.distributed.job.current()``) the engine asks the
``Sharder`` of its store for a ``PartSpec`` at each save: the tensors this rank stages
(its DTensor shards, the replicated tensors the plan gives it, its node copies, its
rank-local tensors), and the tensor table of its part (every tensor of its state with
its global shape and the piece it writes, if any), with what each tier's part leaves
out (object storage: the node copies). The plan is agreed once, with one exchange on snapcore's gloo
group, and cached: a later save compares a cheap signature of the state's structure with
the cached one and makes no collective. A rank whose structure changed writes every byte
it holds under the old plan's name and marks its part; the coordinator then fails that
step's commit and every rank re-plans at its next save (docs/distributed.md).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import manifest as mf
from ..distributed.job import Job, all_gather_bytes
from ..manifest import dtype_name
from ..planning.global_plan import (
    GlobalPlan,
    LocalItem,
    describe_local,
    describe_sharded,
    plan_copies,
    plan_save,
)
from ..planning.global_plan import structure_fingerprint as fingerprint
from ..planning.layout import Layout, plan
from ..sharding import Box
from ..tree import Flattened, is_dtensor

__all__ = ["PartSpec", "Sharder"]


@dataclass
class PartSpec:
    """One rank's share of one sharded save."""

    seq: int  # the save's number in this engine, the same on every rank
    rank: int
    world_size: int
    plan: str  # the global plan's fingerprint
    structure: str  # this rank's structure fingerprint
    replan: bool  # this rank's structure is not the plan's: the step cannot commit
    layout: Layout  # what it stages; ``entries`` is the part's tensor table
    keys: tuple[str | None, ...]  # per tensor of the state: its global key, or None
    # Per tier: the tensors (indices into ``layout.entries``) whose pieces that tier's part
    # leaves out: the node copies in object storage, and a node-local tier's those of
    # the other node-local tier when the two are shared by different ranks.
    drop: dict[str, frozenset[int]] = field(default_factory=dict)

    def info(self) -> mf.PartInfo:
        return mf.PartInfo(self.rank, self.plan, self.structure, self.keys, self.world_size)


@dataclass
class _Cached:
    signature: tuple[Any, ...]
    items: list[LocalItem]
    plan: GlobalPlan
    # per node-local tier ("local", "host"): the boxes this rank writes there as its
    # home's copy (``plan_copies``)
    copies: dict[str, frozenset[tuple[str, Box]]] = field(default_factory=dict)


@dataclass
class Sharder:
    """The save plan of one store under one job, and the verdicts of past saves."""

    job: Job
    local_dir: str | None
    host_area: str | None = None
    cached: _Cached | None = None
    seq: int = 0
    # From the first exchange, per node-local tier ("local", "host"): whether this rank is
    # the lowest of those sharing its directory or area (its node's leader: it writes the
    # index there and keeps it tidy), and whether it shares rank 0's (where the
    # coordinator writes the index).
    leaders: dict[str, bool] = field(default_factory=dict)
    small_exchange: bool = False  # whether the last exchange needed no items (_agree)
    with_rank0: dict[str, bool] = field(default_factory=dict)

    def leads(self, tier: str) -> bool:
        """Whether this rank does the housekeeping of ``tier`` (object storage: rank 0)."""
        return self.job.rank == 0 if tier == "remote" else self.leaders.get(tier, False)

    # save number -> Event set once that save's plan verdict is known ("ok"/"replan")
    verdicts: dict[int, tuple[threading.Event, list[str]]] = field(default_factory=dict)

    def verdict_slot(self, seq: int) -> tuple[threading.Event, list[str]]:
        return self.verdicts.setdefault(seq, (threading.Event(), []))

    def set_verdict(self, seq: int, verdict: str) -> None:
        event, box = self.verdict_slot(seq)
        box[:] = [verdict]
        event.set()
        for old in [s for s in self.verdicts if s < seq - 4]:
            del self.verdicts[old]

    def part(self, flat: Flattened) -> PartSpec:
        """This rank's share of the next save (training thread). Makes the one exchange
        when the plan must be agreed: at the first save, and at the save after one whose
        verdict said that a rank's structure had changed."""
        job = self.job
        self.seq += 1
        seq = self.seq
        must_agree = self.cached is None
        if not must_agree:
            # Normally known long before; a rank that cannot learn it re-plans (and the
            # exchange then fails on snapcore's group timeout if the others do not).
            event, box = self.verdict_slot(seq - 1)
            must_agree = not event.wait(job.timeout_s) or box[0] != "ok"
        glob = [i for i, local in enumerate(flat.local) if not local]
        signature = _signature(flat, glob)
        if must_agree:
            items = describe_local([flat.tensors[i] for i in glob], [flat.paths[i] for i in glob])
            self.cached = self._agree(flat, glob, items, signature)
        assert self.cached is not None
        cached = self.cached
        replan = signature != cached.signature
        items = cached.items
        if replan:
            items = describe_local([flat.tensors[i] for i in glob], [flat.paths[i] for i in glob])
        structure = fingerprint(items, job.world_size)
        return self._spec(flat, glob, items, cached, seq, structure, replan)

    def _agree(
        self,
        flat: Flattened,
        glob: list[int],
        items: list[LocalItem],
        signature: tuple[Any, ...],
    ) -> _Cached:
        """The exchange. First a small one: each rank's home and a hash of its state's
        global description (paths, dtypes, shapes, and each DTensor's mesh and
        placements), about 200 bytes a rank. When every rank has the same description,
        which is the case of FSDP2, TP, HSDP and DDP, every rank's boxes follow from it,
        and each rank derives them all alone (``describe_sharded``). Only when the ranks'
        states differ are the items themselves exchanged."""
        job = self.job
        description = _description(flat, glob)
        mine = {
            "g": hashlib.sha256(json.dumps(description).encode()).hexdigest(),
            "host": job.host,
            "local": os.path.realpath(self.local_dir) if self.local_dir else None,
            "area": self.host_area,
        }
        every = [json.loads(b) for b in all_gather_bytes(job, json.dumps(mine).encode())]
        self.small_exchange = len({d["g"] for d in every}) == 1
        if self.small_exchange:
            per_rank = _derive(flat, glob, job.world_size)
            if per_rank[job.rank] != items:
                raise AssertionError("the boxes derived from the mesh differ from this rank's")
        else:
            mine_items = json.dumps([_item_json(i) for i in items]).encode()
            per_rank = [
                [_item_from(x) for x in json.loads(b)] for b in all_gather_bytes(job, mine_items)
            ]
        gplan = plan_save(per_rank, job.world_size)
        # A rank's home in a node-local tier: its host and directory (or host-memory area).
        # Ranks of one home share it; each home gets its own copy of the boxes its ranks
        # hold that the plan has a rank of another home write.
        copies: dict[str, frozenset[tuple[str, Box]]] = {}
        for tier, field_name in (("local", "local"), ("host", "area")):
            homes = [(d["host"], d[field_name]) for d in every]
            self.leaders[tier] = homes.index(homes[job.rank]) == job.rank
            self.with_rank0[tier] = homes[job.rank] == homes[0]
            if mine[field_name] is not None:
                extra = plan_copies(gplan, homes, only=job.rank)[job.rank]
                copies[tier] = frozenset((w.path, w.box) for w in extra)
        # The holders of every box (every rank, for each plain tensor) are needed only
        # for the copies: not kept for the job's life.
        gplan = dataclasses.replace(gplan, holders={})
        return _Cached(signature, per_rank[job.rank], gplan, copies)

    def _spec(
        self,
        flat: Flattened,
        glob: list[int],
        items: list[LocalItem],
        cached: _Cached,
        seq: int,
        structure: str,
        replan: bool,
    ) -> PartSpec:
        rank = self.job.rank
        gplan = cached.plan
        item_of = dict(zip(glob, items, strict=True))
        written: list[torch.Tensor] = []
        where: dict[int, int] = {}  # state tensor -> index among the written
        # Each tier's part lists the rank's own writes of the plan (every tier) and its
        # home's copies (that node-local tier only); the rank stages both.
        drop: dict[str, set[int]] = {t: set() for t in ("host", "local", "remote")}
        for i, t in enumerate(flat.tensors):
            item = item_of.get(i)
            if item is not None:
                if item.box.empty:
                    continue
                key = (item.path, item.box)
                if not replan and gplan.writers.get(key) != rank:
                    outside = {x for x in drop if key not in cached.copies.get(x, ())}
                    if len(outside) == len(drop):
                        continue
                    for tier in outside:
                        drop[tier].add(i)
            where[i] = len(written)
            written.append(_local(t))
        layout = plan(written)
        entries: list[mf.TensorEntry] = []
        keys: list[str | None] = []
        for i in range(len(flat.tensors)):
            item = item_of.get(i)
            keys.append(item.path if item is not None else None)
            if item is None:
                entries.append(layout.entries[where[i]])
                continue
            pieces = []
            if i in where:
                p = layout.entries[where[i]].pieces[0]
                pieces = [mf.Piece(item.box.offsets, p.shape, p.blob, p.byte_offset, p.strides)]
            entries.append(mf.TensorEntry(item.dtype, item.global_shape, pieces))
        return PartSpec(
            seq,
            rank,
            self.job.world_size,
            gplan.fingerprint,
            structure,
            replan,
            Layout(layout.blobs, entries, layout.total),
            tuple(keys),
            {tier: frozenset(d) for tier, d in drop.items() if d},
        )


def _description(flat: Flattened, glob: list[int]) -> list[Any]:
    """What every rank can know of the state's global tensors: per tensor its path,
    dtype and global shape, and for a DTensor its mesh (global ranks) and placements."""
    out: list[Any] = []
    for i in glob:
        t = flat.tensors[i]
        record: list[Any] = [flat.paths[i], str(t.dtype), list(t.shape)]
        if is_dtensor(t):
            mesh = t.device_mesh  # type: ignore[attr-defined]
            record += [mesh.mesh.tolist(), [repr(p) for p in t.placements]]  # type: ignore[attr-defined]
        out.append(record)
    return out


def _derive(flat: Flattened, glob: list[int], world_size: int) -> list[list[LocalItem]]:
    """Every rank's items, when every rank's state has this rank's global description."""
    per_rank: list[list[LocalItem]] = [[] for _ in range(world_size)]
    for i in glob:
        t, path = flat.tensors[i], flat.paths[i]
        if is_dtensor(t):
            mesh = t.device_mesh  # type: ignore[attr-defined]
            by_rank = describe_sharded(
                path,
                dtype_name(t.dtype),
                tuple(t.shape),
                mesh.mesh,
                t.placements,  # type: ignore[attr-defined]
            )
            for rank, item in by_rank.items():
                per_rank[rank].append(item)
        else:
            shape = tuple(int(s) for s in t.shape)
            item = LocalItem(path, dtype_name(t.dtype), shape, Box((0,) * len(shape), shape), True)
            for rank in range(world_size):
                per_rank[rank].append(item)
    return per_rank


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]


def _signature(flat: Flattened, glob: list[int]) -> tuple[Any, ...]:
    """A cheap description of the state's global tensors: equal signatures give equal
    ``describe_local`` items (paths, dtypes, shapes, meshes, placements)."""
    out = []
    for i in glob:
        t = flat.tensors[i]
        if is_dtensor(t):
            mesh = t.device_mesh  # type: ignore[attr-defined]
            out.append(
                (
                    flat.paths[i],
                    t.dtype,
                    tuple(t.shape),
                    tuple(t.placements),  # type: ignore[attr-defined]
                    tuple(mesh.mesh.reshape(-1).tolist()),
                    tuple(mesh.shape),
                    tuple(_local(t).shape),
                )
            )
        else:
            out.append((flat.paths[i], t.dtype, tuple(t.shape)))
    return tuple(out)


def _item_json(i: LocalItem) -> list[Any]:
    holders = None if i.holders is None else sorted(i.holders)
    return [i.path, i.dtype, list(i.global_shape), list(i.box.offsets), list(i.box.shape),
            i.replicated, holders]  # fmt: skip


def _item_from(x: list[Any]) -> LocalItem:
    path, dtype, shape, offsets, bshape, replicated, holders = x
    return LocalItem(
        path,
        dtype,
        tuple(shape),
        Box(tuple(offsets), tuple(bshape)),
        bool(replicated),
        None if holders is None else frozenset(holders),
    )
