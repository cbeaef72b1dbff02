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
import sys
import threading
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import manifest as mf
from ..distributed.job import Job, all_gather_bytes, broadcast_bytes
from ..errors import SnapcoreError, SnapshotFailed, StateMismatch, UnsupportedState
from ..manifest import dtype_name
from ..planning.global_plan import GlobalPlan, LocalItem, describe_local, plan_copies, plan_save
from ..planning.global_plan import structure_fingerprint as fingerprint
from ..planning.layout import BlobPlan, Layout, plan
from ..planning.uniform import (
    GlobalTensor,
    NotCombinable,
    UniformPlan,
    combine,
    decode_description,
    encode_placement,
    local_items,
    plan_uniform,
    uniform_copies,
)
from ..sharding import Box
from ..tree import Flattened, is_dtensor, local_shard

__all__ = ["PartSpec", "Sharder"]

# Up to this many groups of ranks with different descriptions (pipeline stages) plan from
# one description per group, each broadcast by its lowest rank; more groups than this
# (states that differ rank by rank) exchange every rank's items in one all-gather.
MAX_GROUPS = 128


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
    """The agreed plan and what this rank derived from it, kept while its structure's
    signature is unchanged so that a steady-state save recomputes none of it."""

    signature: tuple[Any, ...]
    items: list[LocalItem]
    plan: GlobalPlan | UniformPlan
    structure: str  # structure_fingerprint(items)
    writes: list[bool]  # per item: whether this rank writes its box under the plan
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
    # how the last plan was made: "uniform" (one description), "grouped" (one per group
    # of ranks, ``uniform.combine``) or "items" (every rank's items, ``plan_save``)
    exchange: str = ""
    exchange_why: str = ""  # why the descriptions did not combine ("items")
    with_rank0: dict[str, bool] = field(default_factory=dict)
    # The last save's part (a structure the plan knows) and the tensors it was made from:
    # a save of the same tensors reuses it (``_Last``).
    last: _Last | None = None
    reused: int = 0  # saves whose part was the last one's (tests, docs)

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

    def part(self, flat: Flattened | None, early: Exception | None = None) -> PartSpec:
        """This rank's share of the next save (training thread). Makes the one exchange
        when the plan must be agreed: at the first save, and at the save after one whose
        verdict said that a rank's structure had changed or that a rank failed before its
        background work.

        ``early``: this rank failed before its save could begin (its writer lock, its
        state's walk, the peer tier's link: ``flat`` may be None). It takes the save's
        number all the same, and raises ``early``: in the plan's exchange when the ranks
        agree one, carrying it there so that every rank raises at once (the others an
        error naming this rank), else at once (the engine tells the coordinator, whose
        verdict fails the others' save at once)."""
        job = self.job
        self.seq += 1
        seq = self.seq
        must_agree = self.cached is None
        if not must_agree:
            # Normally known long before; a rank that cannot learn it re-plans (and the
            # exchange then fails on snapcore's group timeout if the others do not).
            event, box = self.verdict_slot(seq - 1)
            must_agree = not event.wait(job.timeout_s) or box[0] != "ok"
        last, self.last = self.last, None
        if early is not None:
            if must_agree:  # the others are in the exchange: every rank raises there
                self._agree(None, [], (), early)
            raise early
        assert flat is not None
        if not must_agree and last is not None:
            again = last.reuse(flat, seq)
            if again is not None:
                self.last, spec = again
                self.reused += 1
                return spec
        glob = [i for i, local in enumerate(flat.local) if not local]
        signature = _signature(flat, glob)
        if must_agree:
            self.cached = self._agree(flat, glob, signature)
        assert self.cached is not None
        cached = self.cached
        replan = signature != cached.signature
        items, structure, writes = cached.items, cached.structure, cached.writes
        if replan:  # every box it holds (module docstring)
            items = describe_local([flat.tensors[i] for i in glob], [flat.paths[i] for i in glob])
            structure = fingerprint(items, job.world_size)
            writes = [not item.box.empty for item in items]
        spec = self._spec(flat, glob, items, writes, cached, seq, structure, replan)
        if not replan:
            self.last = _Last.of(flat, spec)
        return spec

    def _agree(
        self,
        flat: Flattened | None,
        glob: list[int],
        signature: tuple[Any, ...],
        early: Exception | None = None,
    ) -> _Cached:
        """The exchange. First a small one: each rank's home and a hash of its state's
        global description (paths, dtypes, shapes, and each DTensor's mesh and
        placements), about 200 bytes a rank. When every rank has the same description,
        which is the case of FSDP2, TP, HSDP and DDP, the plan follows from it, and each
        rank computes what it needs of it alone (``planning.uniform``: its writes and its
        home's copies, never every rank's boxes). When the descriptions differ, the
        lowest rank of each group of ranks that sent the same hash broadcasts its
        description (a pipeline's stages, or FSDP2 over TP's TP ranks: one per group),
        and the plan follows from them when they combine (``uniform.combine``: a tensor
        several groups list is the same there). Only when they do not are the items
        themselves exchanged, and ``plan_save`` run on every rank's.

        A rank that cannot take part (its state cannot be saved, or ``early``: it failed
        before the save began) sends its error instead of its description: every rank
        raises once the exchange is made, that rank its own error, the others one naming
        it (``_raise_refusal``)."""
        job = self.job
        error: Exception | None = early
        items: list[LocalItem] = []
        description: dict[str, Any] = {}
        tensors: list[GlobalTensor] = []
        if flat is not None and early is None:
            try:  # a state this rank cannot save is told to the others: all raise together
                items = describe_local(
                    [flat.tensors[i] for i in glob], [flat.paths[i] for i in glob]
                )
                description, tensors = _description(flat, glob)
            except SnapcoreError as e:
                items, description, tensors, error = [], {}, [], e
        text = json.dumps(description).encode()
        mine = {
            "g": hashlib.sha256(text).hexdigest(),
            "n": len(text),
            "host": job.host,
            "local": os.path.realpath(self.local_dir) if self.local_dir else None,
            "area": self.host_area,
            "error": None
            if error is None
            else [
                type(error).__name__,
                str(error),
                getattr(error, "path", None),
                "state" if early is None else "early",
            ],
        }
        every = [json.loads(b) for b in all_gather_bytes(job, json.dumps(mine).encode())]
        if error is not None:
            raise error
        _raise_refusal(every)
        hashes = [d["g"] for d in every]
        # A rank's home in a node-local tier: its host and directory (or host-memory area).
        # Ranks of one home share it; each home gets its own copy of the boxes its ranks
        # hold that the plan has a rank of another home write.
        homes: dict[str, list[tuple[Any, Any]]] = {}
        for tier, field_name in (("local", "local"), ("host", "area")):
            homes[tier] = [(d["host"], d[field_name]) for d in every]
            self.leaders[tier] = homes[tier].index(homes[tier][job.rank]) == job.rank
            self.with_rank0[tier] = homes[tier][job.rank] == homes[tier][0]
        tiers = [t for t, f in (("local", "local"), ("host", "area")) if mine[f] is not None]
        combined: list[GlobalTensor] | None = tensors
        digest = mine["g"]
        self.exchange, self.exchange_why = "uniform", ""
        if len(set(hashes)) > 1:
            combined, self.exchange = None, "items"
            leads = sorted({g: r for r, g in reversed(list(enumerate(hashes)))}.values())
            if len(leads) <= MAX_GROUPS:
                # each group's description from its lowest rank, to every rank: one
                # broadcast per group, of its bytes alone (their sizes came with the hashes)
                groups = [
                    (
                        [q for q, g in enumerate(hashes) if g == hashes[r]],
                        json.loads(broadcast_bytes(job, text, r, every[r]["n"])),
                    )
                    for r in leads
                ]
                try:  # the same answer on every rank: from the same bytes
                    combined = combine([(ranks, decode_description(d)) for ranks, d in groups])
                    digest = hashlib.sha256(json.dumps(hashes).encode()).hexdigest()
                    self.exchange = "grouped"
                except NotCombinable as e:
                    self.exchange_why = str(e)
        self.small_exchange = self.exchange != "items"
        copies: dict[str, frozenset[tuple[str, Box]]] = {}
        gplan: GlobalPlan | UniformPlan
        if combined is not None:
            if local_items(tensors, job.rank) != items:
                raise AssertionError("the boxes derived from the mesh differ from this rank's")
            members = {
                t: {r for r, h in enumerate(homes[t]) if h == homes[t][job.rank]} for t in tiers
            }
            near = set().union({job.rank}, *members.values())  # whose writers it needs
            gplan = plan_uniform(combined, job.world_size, digest, ranks=near)
            writes = [gplan.writer(item) == job.rank for item in items]
            for tier in tiers:
                copies[tier] = uniform_copies(combined, gplan, members[tier], job.rank)
        else:
            mine_items = json.dumps([_item_json(i) for i in items]).encode()
            per_rank = [
                [_item_from(x) for x in json.loads(b)] for b in all_gather_bytes(job, mine_items)
            ]
            full = plan_save(per_rank, job.world_size)
            writes = [
                not item.box.empty and full.writers.get((item.path, item.box)) == job.rank
                for item in items
            ]
            for tier in tiers:
                extra = plan_copies(full, homes[tier], only=job.rank)[job.rank]
                copies[tier] = frozenset((w.path, w.box) for w in extra)
            # The holders of every box (every rank, for each plain tensor) are needed only
            # for the copies: not kept for the job's life.
            gplan = dataclasses.replace(full, holders={})
        structure = fingerprint(items, job.world_size)
        return _Cached(signature, items, gplan, structure, writes, copies)

    def _spec(
        self,
        flat: Flattened,
        glob: list[int],
        items: list[LocalItem],
        writes: list[bool],
        cached: _Cached,
        seq: int,
        structure: str,
        replan: bool,
    ) -> PartSpec:
        rank = self.job.rank
        gplan = cached.plan
        n = len(flat.tensors)
        at = [-1] * n  # state tensor -> its item (a global tensor), or -1 (rank-local)
        for k, i in enumerate(glob):
            at[i] = k
        written: list[torch.Tensor] = []
        where = [-1] * n  # state tensor -> index among the written, or -1
        # Each tier's part lists the rank's own writes of the plan (every tier) and its
        # home's copies (that node-local tier only); the rank stages both.
        drop: dict[str, set[int]] = {t: set() for t in ("host", "local", "remote")}
        for i, t in enumerate(flat.tensors):
            k = at[i]
            if k >= 0 and not writes[k]:
                item = items[k]
                if item.box.empty:
                    continue
                key = (item.path, item.box)
                outside = {x for x in drop if key not in cached.copies.get(x, ())}
                if len(outside) == len(drop):
                    continue
                for tier in outside:
                    drop[tier].add(i)
            where[i] = len(written)
            written.append(local_shard(t))
        layout = plan(written)
        entries: list[mf.TensorEntry] = []
        keys: list[str | None] = []
        for i in range(n):
            k, w = at[i], where[i]
            if k < 0:
                keys.append(None)
                entries.append(layout.entries[w])
                continue
            item = items[k]
            keys.append(item.path)
            pieces = []
            if w >= 0:
                p = layout.entries[w].pieces[0]
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


def _raise_refusal(every: list[dict[str, Any]]) -> None:
    """Raise the first refusal another rank sent in the plan's exchange: its state cannot
    be saved, as its own kind when it is ``UnsupportedState`` or ``StateMismatch``,
    naming that rank; or it failed otherwise before its save began (a second writer
    holds its node's lock, the peer tier's link), as ``SnapshotFailed`` naming the rank
    and its error."""
    failed = [(r, d["error"]) for r, d in enumerate(every) if d.get("error")]
    if not failed:
        return
    r, (kind, why, path, *when) = failed[0]
    more = f" (and ranks {[q for q, _ in failed[1:]]})" if len(failed) > 1 else ""
    if when == ["early"] and kind not in ("UnsupportedState", "StateMismatch"):
        raise SnapshotFailed(f"rank {r}{more} failed before its save could begin: {kind}: {why}")
    message = f"rank {r}{more} cannot save its state: {why}"
    if kind == "UnsupportedState":
        raise UnsupportedState(message, path=path or "")
    raise StateMismatch(message) if kind == "StateMismatch" else SnapshotFailed(message)


def _description(flat: Flattened, glob: list[int]) -> tuple[dict[str, Any], list[GlobalTensor]]:
    """What every rank can know of the state's global tensors: per tensor its path,
    dtype and global shape, and for a DTensor its mesh (global ranks, listed once per
    mesh: not once per tensor) and placements; and the same as ``GlobalTensor``s."""
    meshes: dict[int, tuple[int, torch.Tensor]] = {}  # id(DeviceMesh) -> (index, ranks)
    records: list[Any] = []
    tensors: list[GlobalTensor] = []
    for i in glob:
        t, path = flat.tensors[i], flat.paths[i]
        shape = tuple(int(s) for s in t.shape)
        record: list[Any] = [path, dtype_name(t.dtype), list(shape)]
        if is_dtensor(t):
            mesh = t.device_mesh  # type: ignore[attr-defined]
            known = meshes.get(id(mesh))
            if known is None:
                known = meshes[id(mesh)] = (len(meshes), mesh.mesh)
            placements = tuple(t.placements)  # type: ignore[attr-defined]
            record += [known[0], [encode_placement(p) for p in placements]]
            tensors.append(GlobalTensor(path, dtype_name(t.dtype), shape, known[1], placements))
        else:
            tensors.append(GlobalTensor(path, dtype_name(t.dtype), shape))
        records.append(record)
    ranks = [m.tolist() for _, m in sorted(meshes.values(), key=lambda x: x[0])]
    return {"meshes": ranks, "tensors": records}, tensors


def _key(t: torch.Tensor, dtensor: type | None) -> tuple[Any, ...]:
    """What a part depends on of one tensor of the state: the object, its memory (address,
    storage offset, dtype, shape, strides, device) and, for a DTensor, its spec (mesh,
    placements, global shape: by identity and by hash, which DTensorSpec recomputes when
    a field is set) and its local shard's. Training in place (an optimizer step, FSDP2's
    sharded parameters) changes none of it; a tensor replaced, moved (``p.data = ...``),
    resized or resharded does."""
    if dtensor is not None and isinstance(t, dtensor):
        spec, loc = t._spec, local_shard(t)
        return (id(t), loc.data_ptr(), loc.storage_offset(), loc.dtype, loc.shape, loc.stride(),
                loc.device, id(spec), hash(spec), id(loc))  # fmt: skip
    return (id(t), t.data_ptr(), t.storage_offset(), t.dtype, t.shape, t.stride(), t.device)


@dataclass
class _Last:
    """The last save's part and what it was made from, to reuse it at the next save: the
    paths, which tensors are rank-local, each tensor's ``_key`` (checked against a weak
    reference to it: the id is the same object's only while that lives) and storage
    address, and the part with its blobs' fields but not their source tensors, so that
    nothing of the state is kept alive between saves (a ``state_dict()`` may build new
    tensors at every call).

    A save of the same tensors reuses the part, each blob's source taken from the state
    as it is now. A plain tensor that is a new object at each save (``snapcore.RNGState``'s
    generator states) is put in its predecessor's place when it is alike (dtype, shape,
    strides, device) and alone in memory that no other tensor of the state holds (its own
    whole storage, contiguous; its predecessor's address, freed since, allowed), its
    predecessor alone in its blob. Anything else is
    planned again (``Sharder.part``)."""

    paths: list[str]
    local: list[bool]
    keys: list[tuple[Any, ...]]
    refs: list[weakref.ref[Any]]  # the state's tensors and the DTensors' specs
    storages: list[int]
    # per blob: (offset, nbytes, the state tensor whose local shard is its source, raw,
    # src_ptr, tensors, element_size)
    blobs: list[tuple[int, int, int, bool, int, list[int], int]]
    spec: PartSpec  # its layout has no blobs (``blobs`` above)

    @staticmethod
    def of(flat: Flattened, spec: PartSpec) -> _Last | None:
        dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
        layout = spec.layout
        owner: dict[int, int] = {}  # blob -> the first state tensor staged from it
        for i, e in enumerate(layout.entries):
            if e.pieces:
                owner.setdefault(e.pieces[0].blob, i)
        if len(owner) != len(layout.blobs):
            return None  # a blob that no entry names: not a layout of this kind
        blobs = []
        for b_i, b in enumerate(layout.blobs):
            i = owner[b_i]
            if local_shard(flat.tensors[i]) is not b.source:
                return None
            blobs.append((b.offset, b.nbytes, i, b.raw, b.src_ptr, b.tensors, b.element_size))
        try:
            refs = [weakref.ref(t) for t in flat.tensors]
            refs += [
                weakref.ref(t._spec)
                for t in flat.tensors
                if dtensor is not None and isinstance(t, dtensor)
            ]
        except TypeError:  # not weakly referenceable: not reused
            return None
        return _Last(
            list(flat.paths),
            list(flat.local),
            [_key(t, dtensor) for t in flat.tensors],
            refs,
            [local_shard(t).untyped_storage().data_ptr() for t in flat.tensors],
            blobs,
            dataclasses.replace(spec, layout=Layout([], layout.entries, layout.total)),
        )

    def reuse(self, flat: Flattened, seq: int) -> tuple[_Last, PartSpec] | None:
        """This part for ``flat``, as save ``seq``, or None when it must be made again."""
        if flat.paths != self.paths or flat.local != self.local:
            return None
        dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
        tensors = flat.tensors
        keys = [_key(t, dtensor) for t in tensors]
        refs = self.refs
        n = len(tensors)
        specs = [t._spec for t in tensors if dtensor is not None and isinstance(t, dtensor)]
        if len(refs) != n + len(specs) or any(
            r() is not s for r, s in zip(refs[n:], specs, strict=True)
        ):
            return None  # a spec replaced (its id may be another's now)
        ptrs: dict[int, int] = {}  # blob -> the new source's address
        storages = self.storages
        changed = keys != self.keys
        if changed or any(r() is not t for r, t in zip(refs[:n], tensors, strict=True)):
            storages = list(storages)
            # The state's storages by address, with how many of its tensors use each; a
            # new tensor may take its predecessor's address (freed since), not another's.
            taken = Counter(storages)
            entries = self.spec.layout.entries
            for i, (new, old) in enumerate(zip(keys, self.keys, strict=True)):
                t = tensors[i]
                if new == old and refs[i]() is t:
                    continue
                if len(new) != 7 or len(old) != 7 or new[2:] != old[2:] or new[2] != 0:
                    return None  # a DTensor, or not alike: another layout
                store = t.untyped_storage()
                nbytes = t.numel() * t.element_size()
                ptr = store.data_ptr()
                taken[storages[i]] -= 1
                if store.nbytes() != nbytes or not t.is_contiguous() or taken[ptr] > 0:
                    return None  # shares memory with another tensor, or has a gap
                taken[ptr] += 1
                storages[i] = ptr
                if entries[i].pieces:  # this rank stages it
                    b = entries[i].pieces[0].blob
                    _, size, _, raw, _, members, _ = self.blobs[b]
                    if len(members) != 1 or not raw or size != nbytes:
                        return None
                    ptrs[b] = t.data_ptr()
        blobs = [
            BlobPlan(off, size, local_shard(tensors[i]), raw, ptrs.get(b, ptr), members, es)
            for b, (off, size, i, raw, ptr, members, es) in enumerate(self.blobs)
        ]
        layout = self.spec.layout
        spec = dataclasses.replace(
            self.spec, seq=seq, layout=Layout(blobs, layout.entries, layout.total)
        )
        if not changed and storages is self.storages:
            return self, spec
        new_refs = [weakref.ref(t) for t in tensors] + refs[n:]
        # The next save compares its tensors with these: its blobs' sources are at the
        # new addresses (keeping the old ones would copy a freed predecessor's memory).
        moved = [
            (off, size, i, raw, ptrs.get(b, ptr), members, es)
            for b, (off, size, i, raw, ptr, members, es) in enumerate(self.blobs)
        ]
        last = dataclasses.replace(self, keys=keys, refs=new_refs, storages=storages, blobs=moved)
        return last, spec


def _signature(flat: Flattened, glob: list[int]) -> tuple[Any, ...]:
    """A cheap description of the state's global tensors: equal signatures give equal
    ``describe_local`` items (paths, dtypes, shapes, meshes, placements). Computed at
    every save on the training thread: a mesh's ranks are read once per mesh object for
    the process's life (``_mesh_key``; reading ``DeviceMesh.mesh`` builds a tensor), a
    shard's shape without ``to_local()``."""
    meshes: dict[int, tuple[Any, ...]] = {}  # id -> key; the meshes live through the call
    out: list[tuple[Any, ...]] = []
    tensors, paths = flat.tensors, flat.paths
    for i in glob:
        t = tensors[i]
        if is_dtensor(t):
            mesh = t.device_mesh  # type: ignore[attr-defined]
            key = meshes.get(id(mesh))
            if key is None:
                key = meshes[id(mesh)] = _mesh_key(mesh)
            placements = tuple(t.placements)  # type: ignore[attr-defined]
            out.append((paths[i], t.dtype, t.shape, placements, key, local_shard(t).shape))
        else:
            out.append((paths[i], t.dtype, t.shape))
    return tuple(out)


# id(DeviceMesh) -> (a weak reference to it, its key): a mesh's ranks and shape never
# change, and reading ``DeviceMesh.mesh`` builds a tensor (0.1-1 ms) at every save.
_MESH_KEYS: dict[int, tuple[weakref.ref[Any], tuple[Any, ...]]] = {}


def _mesh_key(mesh: Any) -> tuple[Any, ...]:
    known = _MESH_KEYS.get(id(mesh))
    if known is not None and known[0]() is mesh:
        return known[1]
    key = (tuple(mesh.mesh.reshape(-1).tolist()), tuple(mesh.shape))
    for k in [k for k, (ref, _) in _MESH_KEYS.items() if ref() is None]:
        del _MESH_KEYS[k]
    _MESH_KEYS[id(mesh)] = (weakref.ref(mesh), key)
    return key


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
