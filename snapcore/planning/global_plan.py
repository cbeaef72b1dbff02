"""The global save plan and the resharding read plan for sharded snapshots (issue 10).

The planning of issue 10's sharded saves and restores. Everything here is a
pure function of metadata (paths, dtypes, shapes, boxes, ranks): no process group is
entered, no tensor data is read and no file is touched, so the plan can be tested for
any world size in one process. The layers, bottom up:

- ``shard_box`` / ``replica_ranks`` / ``describe_sharded``: the box of a tensor that a
  mesh coordinate holds under DTensor placements (``Shard(dim)``, ``Replicate()``,
  uneven shards, 2-D meshes such as HSDP) and the ranks that hold an identical copy;
- ``describe_local``: what one rank holds (``LocalItem`` per tensor), from its state's
  tensors, plain or DTensor;
- ``plan_save``: from every rank's items (exchanged once), the one rank that writes each
  ``(path, box)`` (replicas balanced by ``snapcore.sharding.assign_writers``), the
  per-rank write lists and the plan's fingerprint; it checks that the boxes of each
  tensor tile it exactly;
- ``plan_copies``: the node copies of a node-local tier, so that each node's tier holds
  every box its ranks hold although the job writes each box once;
- ``plan_read``: for each box a rank wants, the saved pieces it overlaps, the common
  boxes and the byte runs to read (``sharding.BoxIndex`` and ``sharding.byte_ranges``).

How the engine is to use the fingerprint (so that a steady-state ``async_save`` makes no
collective): the first save of a structure exchanges every rank's items once (one small
all-gather on snapcore's own gloo group), every rank runs ``plan_save`` on the same list
and caches the ``GlobalPlan``. At each later save a rank computes
``structure_fingerprint(describe_local(...), world_size)`` alone and compares it with
``plan.rank_fingerprints[rank]``: equal, the cached plan is used with no collective. Each
rank's part manifest carries ``plan.fingerprint`` and its own structure fingerprint; the
commit of a step checks that every part names the same plan and that each rank's
structure fingerprint is the one that plan was made from. A rank whose structure changed
(new optimizer state, a frozen layer) therefore fails that step's commit instead of
entering a collective alone (which would hang the job); every rank learns of the failed
commit and runs the exchange again at its next save, so all ranks re-plan at the same
save.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import sharding
from ..errors import StateMismatch, UnsupportedState
from ..manifest import DTYPES, dtype_name
from ..sharding import Box, BoxIndex

__all__ = [
    "GlobalPlan",
    "LocalItem",
    "PlannedWrite",
    "ReadCopy",
    "SavedPiece",
    "describe_local",
    "describe_sharded",
    "plan_copies",
    "plan_read",
    "plan_save",
    "replica_ranks",
    "shard_box",
    "structure_fingerprint",
]


@dataclass(frozen=True)
class LocalItem:
    """One tensor as one rank holds it.

    ``box`` is where the rank's data lies in the global tensor of shape ``global_shape``.
    ``holders`` are the ranks that hold an identical copy of that box (this rank
    included), as the rank's device mesh and placements say; ``None`` for a plain tensor,
    replicated by convention (DDP, optimizer ``step`` counters): which ranks hold it is
    learnt from the exchanged items. ``replicated`` says whether other ranks may hold the
    same box (always true of a plain tensor).
    """

    path: str
    dtype: str
    global_shape: tuple[int, ...]
    box: Box
    replicated: bool
    holders: frozenset[int] | None = None

    @property
    def nbytes(self) -> int:
        return self.box.numel() * DTYPES[self.dtype].itemsize


def is_strided(p: Any) -> bool:
    """FSDP2 over a tensor-parallel dimension shards a dimension TP already split:
    DTensor calls that ``_StridedShard`` (a Shard whose chunks interleave)."""
    return type(p).__name__ == "_StridedShard" and hasattr(p, "split_factor")


def is_sharding(p: Any) -> bool:
    from torch.distributed.tensor import Shard

    return type(p) is Shard or is_strided(p)


def check_placements(placements: Sequence[Any], ndim: int, path: str) -> None:
    from torch.distributed.tensor import Replicate

    for p in placements:
        if type(p) is Replicate:
            continue
        if is_sharding(p):
            if not 0 <= p.dim < ndim:
                raise UnsupportedState(
                    f"{path}: placement {p} shards dimension {p.dim} of a {ndim}-d tensor",
                    path=path,
                )
            continue
        raise UnsupportedState(
            f"{path}: DTensor placement {p!r} is not supported (only Shard(dim), "
            "_StridedShard and Replicate(); a Partial tensor must be reduced before it "
            "is saved)",
            path=path,
        )


def shard_box(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Any],
    *,
    path: str = "<tensor>",
) -> Box:
    """The box of a ``global_shape`` tensor held at ``coordinate`` of a mesh of shape
    ``mesh_shape`` under ``placements`` (one per mesh dimension).

    Pure: no process group. Uses torch's own computation of a DTensor's local shape and
    global offset (the one DCP uses), so uneven shards (``torch.chunk``'s split: the
    last shards may be shorter or empty) and several mesh dimensions sharding one tensor
    dimension follow DTensor exactly. Raises ``UnsupportedState`` for a placement other
    than ``Shard(dim)`` and ``Replicate()``.
    """
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    shape = tuple(int(s) for s in global_shape)
    if not len(mesh_shape) == len(coordinate) == len(placements):
        raise ValueError(
            f"{path}: mesh shape {tuple(mesh_shape)}, coordinate {tuple(coordinate)} and "
            f"placements {tuple(placements)} differ in length"
        )
    if any(not 0 <= c < m for c, m in zip(coordinate, mesh_shape, strict=True)):
        raise ValueError(f"{path}: coordinate {tuple(coordinate)} outside mesh {tuple(mesh_shape)}")
    check_placements(placements, len(shape), path)
    if any(is_strided(p) for p in placements):
        return _strided_box(shape, mesh_shape, coordinate, placements, path)
    local_shape, offsets = _compute_local_shape_and_global_offset(
        shape, tuple(mesh_shape), list(coordinate), list(placements)
    )
    return Box(tuple(int(o) for o in offsets), tuple(int(s) for s in local_shape))


def _strided_box(
    shape: tuple[int, ...],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Any],
    path: str,
) -> Box:
    """The box of a shard some of whose placements are ``_StridedShard``: each tensor
    dimension's global indices are followed through the placements, left to right, as
    DTensor does; the shard must be one contiguous range per dimension (FSDP2 over
    tensor parallel gives that), else ``UnsupportedState``."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShardOffsetMode

    index = [list(range(n)) for n in shape]
    for p, n, c in zip(placements, mesh_shape, coordinate, strict=True):
        if not is_sharding(p):
            continue
        rows = index[p.dim]
        if is_strided(p):
            mode = _StridedShardOffsetMode.ALL
            size, at = p.local_shard_size_and_offset(len(rows), n, c, mode)
            index[p.dim] = [rows[i] for i in (at or [])][:size]
        else:
            size, start = Shard.local_shard_size_and_offset(len(rows), n, c)
            index[p.dim] = rows[start : start + size]
    offsets = []
    for d, rows in enumerate(index):
        if rows and rows != list(range(rows[0], rows[0] + len(rows))):
            raise UnsupportedState(
                f"{path}: placements {tuple(placements)} give this rank rows that are not "
                f"one range of dimension {d}: not supported",
                path=path,
            )
        offsets.append(rows[0] if rows else shape[d])
    return Box(tuple(offsets), tuple(len(rows) for rows in index))


def replica_ranks(
    mesh_ranks: torch.Tensor, coordinate: Sequence[int], placements: Sequence[Any]
) -> frozenset[int]:
    """The global ranks holding the same box as ``coordinate``: those whose coordinate
    equals it on every mesh dimension the tensor is sharded over (``mesh_ranks`` is the
    mesh's tensor of global ranks, ``DeviceMesh.mesh``)."""

    if mesh_ranks.dim() != len(coordinate) or len(coordinate) != len(placements):
        raise ValueError(
            f"mesh of {mesh_ranks.dim()} dimensions, coordinate {tuple(coordinate)} and "
            f"placements {tuple(placements)} differ in length"
        )
    index = tuple(
        int(c) if is_sharding(p) else slice(None)
        for c, p in zip(coordinate, placements, strict=True)
    )
    return frozenset(int(r) for r in mesh_ranks[index].reshape(-1).tolist())


def describe_sharded(
    path: str,
    dtype: str,
    global_shape: Sequence[int],
    mesh_ranks: torch.Tensor,
    placements: Sequence[Any],
) -> dict[int, LocalItem]:
    """The ``LocalItem`` every rank of a mesh holds for one DTensor, by global rank.

    Pure: what ``describe_local`` returns on each rank, computed for all of them in one
    process (for tests of 4-rank or 2x2-mesh layouts, and for a planner that knows the
    placements)."""
    if dtype not in DTYPES:
        raise UnsupportedState(f"{path}: dtype {dtype} is not supported", path=path)
    shape = tuple(int(s) for s in global_shape)
    mesh_shape = tuple(mesh_ranks.shape)
    out: dict[int, LocalItem] = {}
    for coordinate in itertools.product(*(range(m) for m in mesh_shape)):
        rank = int(mesh_ranks[coordinate])
        holders = replica_ranks(mesh_ranks, coordinate, placements)
        out[rank] = LocalItem(
            path=path,
            dtype=dtype,
            global_shape=shape,
            box=shard_box(shape, mesh_shape, coordinate, placements, path=path),
            replicated=len(holders) > 1,
            holders=holders,
        )
    return out


def describe_local(flat_tensors: Sequence[torch.Tensor], paths: Sequence[str]) -> list[LocalItem]:
    """What this rank holds: one ``LocalItem`` per tensor of its state, in order.

    A plain tensor is the whole tensor, replicated by convention. A DTensor is its local
    shard: global offsets and shape from its device mesh and placements (``shard_box``
    at the mesh's coordinate of this rank) and the ranks holding an identical copy
    (``replica_ranks``). Needs an initialised process group only for DTensors (their
    mesh knows this rank's coordinate). Raises ``UnsupportedState`` naming the path for
    a placement other than ``Shard``/``Replicate``, a dtype snapcore cannot save, or a
    DTensor whose mesh does not include this rank.
    """
    if len(flat_tensors) != len(paths):
        raise ValueError(f"{len(flat_tensors)} tensors but {len(paths)} paths")
    from torch.distributed.tensor import DTensor

    out: list[LocalItem] = []
    for tensor, path in zip(flat_tensors, paths, strict=True):
        try:
            dtype = dtype_name(tensor.dtype)
        except TypeError as e:
            raise UnsupportedState(f"{path}: {e}", path=path) from None
        shape = tuple(int(s) for s in tensor.shape)
        if not isinstance(tensor, DTensor):
            out.append(LocalItem(path, dtype, shape, Box((0,) * len(shape), shape), True))
            continue
        mesh = tensor.device_mesh
        coordinate = mesh.get_coordinate()
        if coordinate is None:
            raise UnsupportedState(f"{path}: this rank is not in the DTensor's mesh", path=path)
        placements = tuple(tensor.placements)
        box = shard_box(shape, tuple(mesh.shape), coordinate, placements, path=path)
        local = tuple(int(s) for s in tensor.to_local().shape)
        if local != box.shape:
            raise UnsupportedState(
                f"{path}: local shard of shape {local} where placements {placements} give "
                f"{box.shape} (a padded shard?)",
                path=path,
            )
        holders = replica_ranks(mesh.mesh, coordinate, placements)
        out.append(LocalItem(path, dtype, shape, box, len(holders) > 1, holders))
    return out


def _item_record(item: LocalItem) -> list[Any]:
    holders = None if item.holders is None else sorted(item.holders)
    return [item.path, item.dtype, list(item.global_shape), list(item.box.offsets),
            list(item.box.shape), holders]  # fmt: skip


def structure_fingerprint(items: Sequence[LocalItem], world_size: int) -> str:
    """A stable hash of one rank's structure: its items' paths, dtypes, global shapes,
    boxes and holders, and the world size. Independent of the items' order and of the
    process (SHA-256 of canonical JSON, never Python's seeded ``hash``)."""
    records = sorted(_item_record(i) for i in items)
    text = json.dumps([world_size, records], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class PlannedWrite:
    """A box of a tensor that one rank writes."""

    path: str
    box: Box
    nbytes: int


@dataclass(frozen=True)
class GlobalPlan:
    """Who writes what, the same on every rank that computed it from the same items.

    ``writes[r]`` is rank r's list, sorted by path then box offsets; ``writers`` maps
    ``(path, box)`` to its one writer; ``tensors`` maps a path to ``(dtype, global
    shape)``. ``rank_fingerprints[r]`` is ``structure_fingerprint`` of rank r's items and
    ``fingerprint`` a hash of those and the world size (see the module docstring for how
    the engine uses them).
    """

    world_size: int
    tensors: dict[str, tuple[str, tuple[int, ...]]]
    writers: dict[tuple[str, Box], int]
    writes: tuple[tuple[PlannedWrite, ...], ...]
    rank_fingerprints: tuple[str, ...]
    fingerprint: str
    rank_bytes: tuple[int, ...] = field(default=())
    # (path, box) -> the ranks that hold it (reported it): where its node copies may come from
    holders: dict[tuple[str, Box], frozenset[int]] = field(default_factory=dict)


def _first_gap(region: Box, boxes: Sequence[Box]) -> Box | None:
    """The first cell of ``region`` (in the grid cut by every box edge) that no box
    covers, or ``None``. Only for error messages: the grid may be large."""
    inside = [c for b in boxes if (c := sharding.intersect(region, b)) is not None]
    cuts = []
    for d in range(region.ndim):
        lo, hi = region.offsets[d], region.ends[d]
        edges = {lo, hi}
        for b in inside:
            edges.update((b.offsets[d], b.ends[d]))
        cuts.append(sorted(edges))
    index = BoxIndex(inside)
    for cell in itertools.product(*(itertools.pairwise(c) for c in cuts)):
        box = Box(tuple(lo for lo, _ in cell), tuple(hi - lo for lo, hi in cell))
        if not box.empty and not index.overlaps(box):
            return box
    return None


def plan_save(per_rank: Sequence[Sequence[LocalItem]], world_size: int) -> GlobalPlan:
    """The global save plan from every rank's items (``per_rank[r]`` is rank r's).

    Every rank runs it on the same exchanged list and gets the same plan. Each distinct
    ``(path, box)`` is written once: by its rank if one rank holds it, else by one of the
    ranks that reported it, chosen by ``sharding.assign_writers`` (scarce and large
    items first, each to the least-loaded holder), so bytes are balanced. Empty boxes
    (uneven shards) are not written.

    Raises ``StateMismatch`` when ranks disagree on a tensor's dtype or global shape,
    when one rank lists a path twice, when a box lies outside its tensor, when a rank's
    mesh names replica holders that did not report the same box, when two different
    boxes of a tensor overlap, or when the boxes do not cover the tensor (the message
    names the path and a missing region): the union of a tensor's boxes must tile it
    exactly.
    """
    if world_size < 1 or len(per_rank) != world_size:
        raise ValueError(f"{len(per_rank)} ranks' items for a world of {world_size}")
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    reported: dict[tuple[str, Box], set[int]] = {}
    claims: dict[tuple[str, Box], set[int]] = {}
    for rank, items in enumerate(per_rank):
        seen: set[str] = set()
        for item in items:
            if item.path in seen:
                raise StateMismatch(f"{item.path}: rank {rank} lists it twice")
            seen.add(item.path)
            spec = (item.dtype, item.global_shape)
            first = tensors.setdefault(item.path, spec)
            if first != spec:
                raise StateMismatch(
                    f"{item.path}: rank {rank} has dtype {item.dtype} shape "
                    f"{item.global_shape}, another rank dtype {first[0]} shape {first[1]}"
                )
            box = item.box
            if box.ndim != len(item.global_shape) or any(
                e > s for e, s in zip(box.ends, item.global_shape, strict=True)
            ):
                raise StateMismatch(
                    f"{item.path}: rank {rank}'s box {box} lies outside shape {item.global_shape}"
                )
            if box.empty:
                continue
            reported.setdefault((item.path, box), set()).add(rank)
            if item.holders is not None:
                claims.setdefault((item.path, box), set()).update(item.holders)
    for key, holders in claims.items():
        if holders != reported[key]:
            raise StateMismatch(
                f"{key[0]}: box {key[1]} is held by ranks {sorted(holders)} according to "
                f"their meshes, but reported by ranks {sorted(reported[key])}"
            )

    by_path: dict[str, list[Box]] = {}
    for path, box in reported:
        by_path.setdefault(path, []).append(box)
    for path, (_, shape) in tensors.items():
        boxes = sorted(by_path.get(path, []), key=lambda b: (b.offsets, b.shape))
        index = BoxIndex(boxes)
        for i, box in enumerate(boxes):
            for j, common in index.overlaps(box):
                if j != i:
                    raise StateMismatch(
                        f"{path}: box {box} (ranks {sorted(reported[path, box])}) overlaps "
                        f"box {boxes[j]} (ranks {sorted(reported[path, boxes[j]])}) in "
                        f"{common}, and they are not the same replica"
                    )
        covered = sum(b.numel() for b in boxes)
        whole = Box((0,) * len(shape), shape)
        if covered != whole.numel():
            gap = _first_gap(whole, boxes)
            raise StateMismatch(
                f"{path}: the ranks' boxes cover {covered} of {whole.numel()} elements of "
                f"shape {shape}; {gap} is held by no rank"
            )

    keys = {(path, box): json.dumps([path, box.offsets, box.shape]) for path, box in reported}
    items_to_assign = [
        (keys[k], k[1].numel() * DTYPES[tensors[k[0]][0]].itemsize, frozenset(r))
        for k, r in reported.items()
    ]
    by_key = {keys[k]: k for k in reported}
    assigned = sharding.assign_writers(items_to_assign, world_size)
    writers = {by_key[key]: rank for key, rank in assigned.items()}
    lists: list[list[PlannedWrite]] = [[] for _ in range(world_size)]
    for (path, box), rank in writers.items():
        nbytes = box.numel() * DTYPES[tensors[path][0]].itemsize
        lists[rank].append(PlannedWrite(path, box, nbytes))
    for lst in lists:
        lst.sort(key=lambda w: (w.path, w.box.offsets))
    rank_fps = tuple(structure_fingerprint(items, world_size) for items in per_rank)
    fingerprint = hashlib.sha256(
        json.dumps([world_size, list(rank_fps)], separators=(",", ":")).encode()
    ).hexdigest()
    return GlobalPlan(
        world_size=world_size,
        tensors=tensors,
        writers=writers,
        writes=tuple(tuple(lst) for lst in lists),
        rank_fingerprints=rank_fps,
        fingerprint=fingerprint,
        rank_bytes=tuple(sum(w.nbytes for w in lst) for lst in lists),
        holders={k: frozenset(r) for k, r in reported.items()},
    )


def plan_copies(
    plan: GlobalPlan, homes: Sequence[object], only: int | None = None
) -> tuple[tuple[PlannedWrite, ...], ...]:
    """The node copies of a node-local tier: per rank, the boxes it writes into that
    tier besides its own writes of ``plan``.

    ``homes[r]`` is rank r's home in the tier (its host and directory, or host-memory
    area): the ranks of one home share the tier, and a home holds only its ranks' parts.
    ``plan`` writes each box once in the job, so a home whose ranks hold a box that a
    rank elsewhere writes would lack it; it gets a copy of its own, written by one of its
    ranks that holds the box. Each home thus holds every box its ranks hold exactly once
    (the job's writer's where that writer is in the home, else the copy). The copies of
    a home are balanced as ``plan`` is (``sharding.assign_writers``: scarce and large
    first, each to the least-loaded holder of the home), counting each rank's bytes of
    ``plan``, so that a home's ranks write about the same bytes into it. Pure and
    deterministic: every rank computes the same answer from the same plan and homes.
    With one home (every rank shares the tier) there are no copies.

    ``only``: compute the copies of that rank's home alone (the others' lists are
    empty), which is all a rank needs: O(boxes x ranks of the home), not of the job.
    """
    if len(homes) != plan.world_size:
        raise ValueError(f"{len(homes)} homes for a world of {plan.world_size}")
    members: dict[object, set[int]] = {}
    for r, h in enumerate(homes):
        members.setdefault(h, set()).add(r)
    wanted = list(members.values()) if only is None else [members[homes[only]]]
    loads = plan.rank_bytes or (0,) * plan.world_size
    lists: list[list[PlannedWrite]] = [[] for _ in range(plan.world_size)]
    for home in wanted:
        items: list[tuple[str, int, frozenset[int]]] = []
        keys: dict[str, tuple[str, Box]] = {}
        for key, holders in plan.holders.items():
            if plan.writers[key] in home:
                continue
            ranks = home & holders if len(home) < len(holders) else holders & home
            if ranks:
                name = json.dumps([key[0], key[1].offsets, key[1].shape])
                keys[name] = key
                items.append((name, _nbytes(plan, key), frozenset(ranks)))
        for name, rank in sharding.assign_writers(items, plan.world_size, loads).items():
            key = keys[name]
            lists[rank].append(PlannedWrite(key[0], key[1], _nbytes(plan, key)))
    for lst in lists:
        lst.sort(key=lambda w: (w.path, w.box.offsets))
    return tuple(tuple(lst) for lst in lists)


def _nbytes(plan: GlobalPlan, key: tuple[str, Box]) -> int:
    return key[1].numel() * DTYPES[plan.tensors[key[0]][0]].itemsize


@dataclass(frozen=True)
class SavedPiece:
    """A saved piece of a tensor: ``box`` in the global tensor, stored row-major with
    elements of ``itemsize`` bytes. ``location`` (which tier, file, blob and offset) is
    opaque to planning and handed back through the ``ReadCopy``'s ``piece`` index."""

    path: str
    box: Box
    itemsize: int
    location: object = None

    @property
    def strides(self) -> tuple[int, ...]:
        out = [1] * self.box.ndim
        for d in range(self.box.ndim - 2, -1, -1):
            out[d] = out[d + 1] * self.box.shape[d + 1]
        return tuple(out)


@dataclass(frozen=True)
class ReadCopy:
    """Copy ``box`` (global coordinates) from saved piece ``piece`` (index into the
    saved list): its bytes are ``runs`` (``(offset, length)`` from the piece's first
    byte, sorted, coalesced), which hold the box's elements in row-major order."""

    piece: int
    box: Box
    runs: tuple[tuple[int, int], ...]


def plan_read(
    saved: Sequence[SavedPiece], wanted: Sequence[tuple[str, Box]]
) -> list[tuple[ReadCopy, ...]]:
    """For each wanted ``(path, box)``, the copies that fill it from the saved pieces.

    The saved pieces of each path are indexed once (``sharding.BoxIndex``), so matching
    costs about O(log n + hits) per wanted box on grid layouts rather than a scan of
    every saved piece; the byte runs come from ``sharding.byte_ranges``. Copies are in
    the order of the saved pieces. Raises ``StateMismatch`` when a wanted path was not
    saved, when saved pieces of a path overlap, or when they leave part of a wanted box
    uncovered (the message names the path and a missing region).
    """
    indices: dict[str, list[int]] = {}
    for i, piece in enumerate(saved):
        indices.setdefault(piece.path, []).append(i)
    index_of: dict[str, BoxIndex] = {}
    out: list[tuple[ReadCopy, ...]] = []
    for path, box in wanted:
        if path not in indices:
            raise StateMismatch(f"{path}: not in the snapshot")
        index = index_of.get(path)
        if index is None:
            try:
                index = index_of[path] = BoxIndex([saved[i].box for i in indices[path]])
            except ValueError as e:
                raise StateMismatch(f"{path}: {e}") from None
        try:
            hits = index.overlaps(box)
        except ValueError as e:
            raise StateMismatch(f"{path}: {e}") from None
        copies = []
        for j, common in hits:
            piece = saved[indices[path][j]]
            runs = sharding.byte_ranges(piece.box, piece.strides, piece.itemsize, common)
            copies.append(ReadCopy(indices[path][j], common, tuple(runs)))
        covered = sum(c.box.numel() for c in copies)
        if covered > box.numel():
            raise StateMismatch(f"{path}: saved pieces overlapping {box} overlap each other")
        if covered < box.numel():
            gap = _first_gap(box, [c.box for c in copies])
            raise StateMismatch(
                f"{path}: the saved pieces hold {covered} of the {box.numel()} elements of "
                f"{box}; {gap} is missing"
            )
        out.append(tuple(copies))
    return out
