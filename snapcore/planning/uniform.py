"""The save plan when every rank's state has the same global description (FSDP2, TP,
HSDP, DDP), computed without enumerating every rank's boxes.

``global_plan.plan_save`` takes every rank's items: at 16,384 ranks and 1,000 tensors
that is 16 million boxes built and checked in Python at the first save. When every rank
sent the same description (per global tensor: path, dtype, global shape, and for a
DTensor its mesh of global ranks and placements; ``write/sharded.py``'s first
exchange), the plan follows from the description alone, and ``plan_uniform`` computes
what a rank needs of it, the same answer as ``plan_save`` on the derived items
(``tests/unit/test_uniform_plan.py`` checks it on many meshes):

- the boxes of a DTensor for every mesh coordinate at once (``shard_table``), as tensors
  of offsets and sizes, once per distinct (global shape, mesh shape, placements):
  a transformer's tensors fall into a few such classes;
- a box held by one rank is written by it: these only add to that rank's load, so each
  DTensor adds its table of bytes to the ranks' loads with one ``index_add_``;
- the boxes held by several ranks (HSDP's replica groups, a TP-replicated bias, plain
  tensors held by every rank) run through ``sharding.assign_writers``'s greedy pass in
  its order (fewer holders first, larger first, then key), each to the least-loaded
  holder (ties: the lowest rank). Their number is per tensor the product of the
  sharding mesh dimensions (1 for a plain tensor, 0 for a fully sharded one); a run of
  consecutive boxes of one tensor has disjoint holders and takes its writers in one
  tensor operation; the items every rank holds come last and take a heap.

The cost is tensor work over each DTensor's mesh plus a few Python operations per box
that several ranks hold (its key, for the order), where ``plan_save`` is O(ranks x
tensors) in Python;
``benchmarks/bench_plan.py`` times both for simulated worlds of up to 16,384 ranks.
Nothing here enters a process group: pure functions of metadata.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import json
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import sharding
from ..errors import UnsupportedState
from ..manifest import DTYPES
from ..sharding import Box
from .global_plan import LocalItem, check_placements, describe_sharded, is_sharding, is_strided

__all__ = [
    "GlobalTensor",
    "NotCombinable",
    "UniformPlan",
    "combine",
    "decode_description",
    "encode_placement",
    "items_of",
    "local_items",
    "plan_uniform",
    "shard_table",
    "uniform_copies",
]


@dataclass(frozen=True)
class GlobalTensor:
    """One global tensor of the description every rank shares. ``mesh`` is a DTensor's
    mesh of global ranks (``DeviceMesh.mesh``), ``None`` for a plain tensor (held whole
    by every rank, replicated by convention; by the ranks ``holders`` only, when the
    ranks' states differ: ``combine``)."""

    path: str
    dtype: str
    global_shape: tuple[int, ...]
    mesh: torch.Tensor | None = None
    placements: tuple[Any, ...] = ()
    holders: tuple[int, ...] | None = None  # a plain tensor's ranks (sorted); None: every rank


def shard_table(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Any],
    *,
    path: str = "<tensor>",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(offsets, sizes)``: int64 tensors of shape ``(*mesh_shape, ndim)``, the box that
    ``global_plan.shard_box`` gives at every coordinate of the mesh, computed per tensor
    dimension for all coordinates at once (an empty shard's offset is the dimension's
    size, as DTensor says)."""
    shape = tuple(int(s) for s in global_shape)
    mesh_shape = tuple(int(m) for m in mesh_shape)
    if len(mesh_shape) != len(placements):
        raise ValueError(f"{path}: mesh shape {mesh_shape} and placements {placements} differ")
    check_placements(placements, len(shape), path)
    ndim = len(shape)
    offsets = torch.zeros((*mesh_shape, ndim), dtype=torch.int64)
    sizes = torch.zeros((*mesh_shape, ndim), dtype=torch.int64)
    for d, n in enumerate(shape):
        dims = [i for i, p in enumerate(placements) if is_sharding(p) and p.dim == d]
        if any(is_strided(placements[i]) for i in dims):
            off, size = _strided_dim(n, mesh_shape, placements, dims, path, d)
        else:
            off, size = _chunk_dim(n, mesh_shape, dims)
        offsets[..., d] = off
        sizes[..., d] = size
    return offsets, sizes


def _coordinate(mesh_shape: tuple[int, ...], i: int) -> torch.Tensor:
    """Mesh dimension ``i``'s coordinate, shaped to broadcast over the mesh."""
    view = [1] * len(mesh_shape)
    view[i] = mesh_shape[i]
    return torch.arange(mesh_shape[i], dtype=torch.int64).reshape(view)


def _chunk_dim(
    n: int, mesh_shape: tuple[int, ...], dims: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One tensor dimension under ``Shard`` placements on mesh dimensions ``dims``, left
    to right: ``torch.chunk``'s split of the current size (DTensor's
    ``Shard.local_shard_size_and_offset``), offsets composed; empty: offset ``n``."""
    off = torch.zeros((), dtype=torch.int64)
    size = torch.full((), n, dtype=torch.int64)
    for i in dims:
        m = mesh_shape[i]
        c = _coordinate(mesh_shape, i)
        full = (size + m - 1) // m  # equals size // m when it divides
        start = torch.minimum(size, full * c)
        new = torch.clamp(torch.minimum(size, full * c + full) - start, min=0)
        off = torch.where(new == 0, torch.full_like(off, n), off + start)
        size = new
    return off, size


def _strided_dim(
    n: int,
    mesh_shape: tuple[int, ...],
    placements: Sequence[Any],
    dims: list[int],
    path: str,
    d: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One tensor dimension that a ``_StridedShard`` shards (FSDP2 over TP), followed
    through the placements left to right as ``global_plan._strided_box`` does, but for
    every global index at once: which combination of the sharding coordinates holds it
    (``k``) and where in that combination's rows (``pos``). ``Shard`` splits a
    combination's rows into ``torch.chunk`` pieces; ``_StridedShard(split_factor=sf)``
    splits them into ``sf`` chunks, each chunk into pieces, and coordinate c takes piece c
    of every chunk, in chunk order (DTensor's ``_StridedShard.local_shard_size_and_offset``).
    Each combination's rows must be one range: the offset is its first row (``n`` when
    empty)."""
    idx = torch.arange(n, dtype=torch.int64)
    k = torch.zeros(n, dtype=torch.int64)
    pos = idx.clone()
    lengths = torch.tensor([n], dtype=torch.int64)  # per combination
    for i in dims:
        p, m = placements[i], mesh_shape[i]
        cc = torch.arange(m, dtype=torch.int64)
        if is_strided(p):
            sf = int(p.split_factor)
            jj = torch.arange(sf, dtype=torch.int64)
            chunk = (lengths + sf - 1) // sf  # (K,)
            c_start = torch.minimum(chunk[:, None] * jj, lengths[:, None])
            c_len = torch.clamp(
                torch.minimum(chunk[:, None] * (jj + 1), lengths[:, None]) - c_start, min=0
            )
            piece = (c_len + m - 1) // m  # (K, sf)
            p_start = torch.minimum(piece[..., None] * cc, c_len[..., None])
            p_size = torch.clamp(
                torch.minimum(piece[..., None] * (cc + 1), c_len[..., None]) - p_start, min=0
            )
            before = torch.cumsum(p_size, dim=1) - p_size  # (K, sf, m): earlier chunks' piece c
            j = pos // chunk[k].clamp(min=1)
            q = pos - j * chunk[k]
            ps = piece[k, j].clamp(min=1)
            c = q // ps
            pos = before[k, j, c] + q - c * ps
            lengths_new = p_size.sum(dim=1)  # (K, m)
        else:
            chunk = (lengths + m - 1) // m  # torch.chunk: equals size // m when it divides
            step = chunk[k].clamp(min=1)
            c = pos // step
            pos = pos - c * step
            start = torch.minimum(chunk[:, None] * cc, lengths[:, None])
            lengths_new = torch.clamp(
                torch.minimum(chunk[:, None] * (cc + 1), lengths[:, None]) - start, min=0
            )
        k = k * m + c
        lengths = lengths_new.reshape(-1)
    first = torch.full(lengths.shape, n, dtype=torch.int64)
    at0 = pos == 0
    first[k[at0]] = idx[at0]
    if n and not bool((idx - first[k] == pos).all()):
        raise UnsupportedState(
            f"{path}: placements {tuple(placements)} give a rank rows that are not one "
            f"range of dimension {d}: not supported",
            path=path,
        )
    # combinations are in row-major order of the coordinates of ``dims``: spread them
    sub = [mesh_shape[i] for i in dims]
    view = [mesh_shape[i] if i in dims else 1 for i in range(len(mesh_shape))]
    return first.reshape(sub).reshape(view), lengths.reshape(sub).reshape(view)


Tables = dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _table(tables: Tables, t: GlobalTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``shard_table`` of ``t`` and each box's element count, once per (global shape,
    mesh shape, placements)."""
    assert t.mesh is not None
    cls = (t.global_shape, tuple(t.mesh.shape), tuple(t.placements))
    table = tables.get(cls)
    if table is None:
        offsets, sizes = shard_table(t.global_shape, tuple(t.mesh.shape), t.placements, path=t.path)
        numel = torch.ones(sizes.shape[:-1], dtype=torch.int64)
        for d in range(sizes.shape[-1]):  # not prod(dim=-1): slow on int64 here
            numel *= sizes[..., d]
        table = tables[cls] = (offsets, sizes, numel)
    return table


def _key(path: str, offsets: Sequence[int], shape: Sequence[int], quoted: str = "") -> str:
    """The item key ``plan_save`` gives ``assign_writers`` (its ties are broken on it):
    ``json.dumps([path, offsets, shape])``, written out (``quoted``: the path's JSON)."""
    o, s = ", ".join(map(str, offsets)), ", ".join(map(str, shape))
    return f"[{quoted or json.dumps(path)}, [{o}], [{s}]]"


@dataclass(frozen=True)
class UniformPlan:
    """What one rank needs of the save plan of a uniform description.

    ``replicated`` maps the key of each box several ranks hold (those that ``rank``
    holds, or every one when ``rank`` was ``None``) to its one writer; a box one rank
    holds is written by that rank. ``rank_bytes[r]`` is what rank r writes, as in
    ``GlobalPlan``. ``fingerprint`` identifies the plan: a hash of the world size and the
    description's digest, equal on every rank that agreed the description.
    """

    world_size: int
    fingerprint: str
    replicated: dict[str, int]
    rank_bytes: tuple[int, ...] = field(default=())

    def writer(self, item: LocalItem) -> int | None:
        """The rank that writes ``item``'s box (None for an empty box). A box its own
        mesh gives one holder may still have replicas elsewhere (``combine``: the same
        DTensor on other groups' meshes): the plan's answer comes first."""
        if item.box.empty:
            return None
        key = _key(item.path, item.box.offsets, item.box.shape)
        if key in self.replicated or item.holders is None or len(item.holders) != 1:
            return self.replicated[key]
        return next(iter(item.holders))


def plan_uniform(
    tensors: Sequence[GlobalTensor],
    world_size: int,
    digest: str,
    *,
    ranks: Collection[int] | None = None,
) -> UniformPlan:
    """The plan ``global_plan.plan_save`` makes from the items every rank derives from
    ``tensors`` (each DTensor's mesh ranks within ``range(world_size)``, plain tensors
    held by every rank), with the writers of the replicated boxes that ``ranks`` hold
    (a rank's own, or its node's for ``uniform_copies``; ``None``: every box, for
    tests). ``digest`` is the description's hash that every rank sent."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    wanted = None if ranks is None else torch.tensor(sorted(set(ranks)), dtype=torch.int64)
    load_t = torch.zeros(world_size, dtype=torch.int64)
    tables: Tables = {}
    # (holder count, -bytes, key, tensor, row): assign_writers' order, then where the
    # box's holders are: row ``row`` of ``holders[tensor]`` (sorted ranks)
    shared: list[tuple[int, int, str, int, int]] = []
    holders: list[torch.Tensor] = []
    for t in tensors:
        if t.dtype not in DTYPES:
            raise UnsupportedState(f"{t.path}: dtype {t.dtype} is not supported", path=t.path)
        itemsize = DTYPES[t.dtype].itemsize
        if t.mesh is None:
            nbytes = math.prod(t.global_shape) * itemsize
            if 0 in t.global_shape:  # an empty tensor: written by nobody
                continue
            key = _key(t.path, (0,) * len(t.global_shape), t.global_shape)
            if t.holders is None or len(t.holders) == world_size:
                shared.append((world_size, -nbytes, key, -1, 0))
            else:  # some ranks only (``combine``): a box of its own holders
                holders.append(torch.tensor([sorted(t.holders)], dtype=torch.int64))
                shared.append((len(t.holders), -nbytes, key, len(holders) - 1, 0))
            continue
        mesh = t.mesh.to(torch.int64)
        mesh_shape = tuple(mesh.shape)
        offsets, sizes, numel = _table(tables, t)
        nbytes_t = numel * itemsize
        sharding = [i for i, p in enumerate(t.placements) if is_sharding(p)]
        replicas = math.prod(m for i, m in enumerate(mesh_shape) if i not in sharding)
        if replicas == 1:  # one holder per box: its own rank writes it
            load_t.index_add_(0, mesh.reshape(-1), nbytes_t.reshape(-1))
            continue
        # One box per coordinate of the sharding dimensions (the replicas' coordinate 0
        # stands for them); its holders are the mesh's ranks at that coordinate.
        first = tuple(slice(None) if i in sharding else 0 for i in range(len(mesh_shape)))
        nbs = nbytes_t[first].reshape(-1)
        count, ndim = nbs.numel(), len(t.global_shape)
        flat_o = offsets[first].reshape(count, ndim).tolist()
        flat_s = sizes[first].reshape(count, ndim).tolist()
        moved = mesh.movedim(sharding, list(range(len(sharding)))) if sharding else mesh
        tid = len(holders)
        holders.append(moved.reshape(count, -1).sort(dim=1).values)
        quoted = json.dumps(t.path)
        for row, (o, s, nb) in enumerate(zip(flat_o, flat_s, nbs.tolist(), strict=True)):
            if 0 in s:
                continue  # an empty box: written by nobody
            shared.append((replicas, -nb, _key(t.path, o, s, quoted), tid, row))
    shared.sort(key=lambda x: x[:3])  # keys are unique: a total order
    replicated: dict[str, int] = {}
    k = 0
    while k < len(shared) and shared[k][0] < world_size:
        # A run of consecutive boxes of one tensor: each rank holds one box of a tensor,
        # so their holders are disjoint and no choice in the run moves another's loads:
        # the run takes its writers at once, as one after the other.
        tid, e = shared[k][3], k + 1
        while e < len(shared) and shared[e][3] == tid and shared[e][0] < world_size:
            e += 1
        run = shared[k:e]
        rows = holders[tid][torch.tensor([x[4] for x in run])]  # (boxes, holders)
        least = load_t[rows].argmin(dim=1, keepdim=True)  # first minimum: lowest rank
        best = rows.gather(1, least).squeeze(1)
        load_t.index_add_(0, best, torch.tensor([-x[1] for x in run], dtype=torch.int64))
        writers = best.tolist()
        if wanted is None:
            replicated.update((x[2], w) for x, w in zip(run, writers, strict=True))
        else:
            for i in torch.isin(rows, wanted).any(dim=1).nonzero().reshape(-1).tolist():
                replicated[run[i][2]] = writers[i]
        k = e
    load = load_t.tolist()
    if k < len(shared):  # every rank holds the rest: only they move the loads now
        heap = [(load[r], r) for r in range(world_size)]
        heapq.heapify(heap)
        for _, neg, key, _, _ in shared[k:]:
            got, best_rank = heapq.heappop(heap)
            load[best_rank] = got - neg
            heapq.heappush(heap, (load[best_rank], best_rank))
            replicated[key] = best_rank
    fingerprint = hashlib.sha256(
        json.dumps(["uniform", world_size, digest], separators=(",", ":")).encode()
    ).hexdigest()
    return UniformPlan(world_size, fingerprint, replicated, tuple(load))


def local_items(tensors: Sequence[GlobalTensor], rank: int) -> list[LocalItem]:
    """The items ``rank`` holds under the description (what ``describe_local`` gives
    on that rank), from the same tables as ``plan_uniform``."""
    out: list[LocalItem] = []
    tables: Tables = {}
    for t in tensors:
        shape = t.global_shape
        if t.mesh is None:
            out.append(LocalItem(t.path, t.dtype, shape, Box((0,) * len(shape), shape), True))
            continue
        mesh = t.mesh.to(torch.int64)
        at = (mesh == rank).nonzero()
        if at.shape[0] != 1:
            raise UnsupportedState(
                f"{t.path}: rank {rank} is not in the DTensor's mesh", path=t.path
            )
        coordinate = tuple(at[0].tolist())
        offsets, sizes, _ = _table(tables, t)
        index = tuple(
            c if is_sharding(p) else slice(None)
            for c, p in zip(coordinate, t.placements, strict=True)
        )
        holders = frozenset(mesh[index].reshape(-1).tolist())
        box = Box(tuple(offsets[coordinate].tolist()), tuple(sizes[coordinate].tolist()))
        out.append(LocalItem(t.path, t.dtype, shape, box, len(holders) > 1, holders))
    return out


def items_of(
    groups: Sequence[tuple[Sequence[int], Sequence[GlobalTensor]]], world_size: int
) -> list[list[LocalItem]]:
    """Every rank's items as ``global_plan.plan_save`` takes them, derived from the
    groups' descriptions with torch's own computation (``describe_sharded`` per DTensor,
    a plain tensor held by every rank of each group that lists it): the reference the
    plans above are checked against (``tests/unit/test_uniform_plan.py``,
    ``benchmarks/bench_plan.py``). O(ranks x tensors)."""
    per_rank: list[list[LocalItem]] = [[] for _ in range(world_size)]
    for ranks, tensors in groups:
        members = set(ranks)
        for t in tensors:
            if t.mesh is None:
                box = Box((0,) * len(t.global_shape), t.global_shape)
                for r in ranks:
                    per_rank[r].append(LocalItem(t.path, t.dtype, t.global_shape, box, True))
                continue
            described = describe_sharded(t.path, t.dtype, t.global_shape, t.mesh, t.placements)
            for r, item in described.items():
                if r in members:  # each rank reports its own (other groups may list it)
                    per_rank[r].append(item)
    return per_rank


def uniform_copies(
    tensors: Sequence[GlobalTensor], plan: UniformPlan, home: Collection[int], rank: int
) -> frozenset[tuple[str, Box]]:
    """The boxes ``rank`` writes into a node-local tier as its home's copy: what
    ``global_plan.plan_copies(plan_save(...), homes, only=rank)[rank]`` gives, from the
    description. ``home`` is the ranks sharing ``rank``'s home in the tier; ``plan`` must
    hold the writers of the boxes they hold (``plan_uniform(..., ranks=home)``). A box a
    home rank holds and a rank of another home writes gets a copy, written by one of the
    home's holders, balanced as ``plan_copies`` does (``sharding.assign_writers`` over the
    plan's bytes per rank). O(tensors x ranks of the home)."""
    members = frozenset(home)
    items: list[tuple[str, int, frozenset[int]]] = []
    boxes: dict[str, tuple[str, Box]] = {}
    tables: Tables = {}
    coordinates: dict[int, dict[int, tuple[int, ...]]] = {}  # id(mesh) -> rank -> coordinate
    for t in tensors:
        itemsize = DTYPES[t.dtype].itemsize
        shape = t.global_shape
        if t.mesh is None:
            held = members if t.holders is None else members & frozenset(t.holders)
            if 0 in shape or not held:
                continue
            key = _key(t.path, (0,) * len(shape), shape)
            if plan.replicated[key] not in members:
                boxes[key] = (t.path, Box((0,) * len(shape), shape))
                items.append((key, math.prod(shape) * itemsize, held))
            continue
        mesh = t.mesh.to(torch.int64)
        where = coordinates.get(id(t.mesh))
        if where is None:
            where = coordinates[id(t.mesh)] = {}
            for r in members:
                at = (mesh == r).nonzero()
                if at.shape[0] == 1:
                    where[r] = tuple(at[0].tolist())
        offsets, sizes, numel = _table(tables, t)
        seen: set[tuple[int, ...]] = set()
        for r in sorted(members):
            c = where.get(r)
            if c is None:
                continue
            index = tuple(
                x if is_sharding(p) else slice(None) for x, p in zip(c, t.placements, strict=True)
            )
            shard = tuple(x for x, p in zip(c, t.placements, strict=True) if is_sharding(p))
            if shard in seen:  # another home rank holds the same box
                continue
            seen.add(shard)
            size = tuple(sizes[c].tolist())
            holders = mesh[index].reshape(-1)
            if 0 in size or holders.numel() == 1:  # empty, or written by its own holder
                continue
            box = Box(tuple(offsets[c].tolist()), size)
            key = _key(t.path, box.offsets, box.shape)
            if plan.replicated[key] in members:
                continue
            boxes[key] = (t.path, box)
            mine = members & frozenset(holders.tolist())
            items.append((key, int(numel[c]) * itemsize, mine))
    assigned = sharding.assign_writers(items, plan.world_size, plan.rank_bytes)
    return frozenset(boxes[key] for key, r in assigned.items() if r == rank)


def encode_placement(p: Any) -> Any:
    """A DTensor placement as JSON that ``decode_description`` turns back into it:
    ``"R"``, ``["S", dim]``, ``["SS", dim, split_factor]`` (``_StridedShard``); any other
    placement as ``["?", repr]``, which no plan is made from (``decode_description``
    refuses it; ``write/sharded.py`` refuses such a state before, in
    ``describe_local``)."""
    from torch.distributed.tensor import Replicate

    if type(p) is Replicate:
        return "R"
    if is_strided(p):
        return ["SS", int(p.dim), int(p.split_factor)]
    if is_sharding(p):
        return ["S", int(p.dim)]
    return ["?", repr(p)]


class NotCombinable(ValueError):
    """The descriptions of the ranks' groups do not make one plan without every rank's
    items (``combine`` says why)."""


def decode_description(description: Any) -> list[GlobalTensor]:
    """The tensors of a description as ``write/sharded.py`` builds it (``{"meshes":
    [global ranks of each mesh], "tensors": [[path, dtype, shape] or [path, dtype,
    shape, mesh, [placement, ...]]]}``, placements from ``encode_placement``). Raises
    ``NotCombinable`` for a placement it does not know."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    meshes = [torch.tensor(m, dtype=torch.int64) for m in description["meshes"]]
    out: list[GlobalTensor] = []
    for record in description["tensors"]:
        path, dtype, shape = record[0], record[1], tuple(int(s) for s in record[2])
        if len(record) == 3:
            out.append(GlobalTensor(path, dtype, shape))
            continue
        placements: list[Any] = []
        for x in record[4]:
            if x == "R":
                placements.append(Replicate())
            elif isinstance(x, list) and x[0] == "S":
                placements.append(Shard(int(x[1])))
            elif isinstance(x, list) and x[0] == "SS":
                placements.append(_StridedShard(int(x[1]), split_factor=int(x[2])))
            else:
                raise NotCombinable(f"{path}: placement {x} cannot be planned from a description")
        out.append(GlobalTensor(path, dtype, shape, meshes[record[3]], tuple(placements)))
    return out


def combine(groups: Sequence[tuple[Sequence[int], Sequence[GlobalTensor]]]) -> list[GlobalTensor]:
    """One description for a job whose ranks' states differ, such as pipeline stages:
    ``groups`` lists each group of ranks that sent the same description, with it.

    The plan then follows from the descriptions as in a uniform job (``plan_uniform``,
    ``uniform_copies``), and is ``plan_save``'s on every rank's items, when every
    tensor that several groups list is the same there (dtype, shape, placements, mesh
    shape) and:

    - a plain tensor (held whole) is held by the ranks of every group that lists it
      (its ``holders``);
    - a DTensor on one mesh in every group that lists it needs that mesh's ranks to be
      in those groups (a 2-D mesh of FSDP2 over tensor parallel, when the groups differ
      by another tensor);
    - a DTensor on a mesh of each group's own ranks (FSDP2 over tensor parallel: a
      parameter TP does not split is a DTensor on each TP rank's own data-parallel
      mesh, the copies replicas of each other, as ``plan_save`` takes equal boxes)
      becomes one DTensor on the groups' meshes stacked along a new first dimension,
      ``Replicate()`` there.

    Raises ``NotCombinable`` naming the first tensor that breaks this (a mesh that
    reaches into a group that does not list the tensor; a tensor whose dtype, shape,
    placements or mesh shape differ between groups, or that is plain in one and a
    DTensor in another): its plan needs every rank's items (``plan_save``)."""
    from torch.distributed.tensor import Replicate

    members = [set(ranks) for ranks, _ in groups]
    every = set().union(*members) if members else set()
    listed: dict[str, list[tuple[int, GlobalTensor]]] = {}  # path -> its groups' copies
    for g, (_, tensors) in enumerate(groups):
        for t in tensors:
            listed.setdefault(t.path, []).append((g, t))
    ranks_of: dict[int, set[int]] = {}  # id(mesh) -> its ranks
    same: dict[tuple[int, int], bool] = {}  # (id(mesh), id(mesh)) -> equal
    stacked: dict[tuple[int, ...], torch.Tensor] = {}  # the same meshes: one tensor

    def mesh_ranks(m: torch.Tensor) -> set[int]:
        got = ranks_of.get(id(m))
        if got is None:
            got = ranks_of[id(m)] = set(m.reshape(-1).tolist())
        return got

    def equal(a: torch.Tensor, b: torch.Tensor) -> bool:
        key = (id(a), id(b))
        if key not in same:
            same[key] = a is b or torch.equal(a, b)
        return same[key]

    out: list[GlobalTensor] = []
    for path, copies in listed.items():
        first = copies[0][1]
        holders = set().union(*(members[g] for g, _ in copies))
        if first.mesh is None:
            for _, t in copies:
                if t.mesh is not None:
                    raise NotCombinable(f"{path}: a DTensor on some ranks, plain on others")
                if (first.dtype, first.global_shape) != (t.dtype, t.global_shape):
                    raise NotCombinable(
                        f"{path}: {first.dtype}{list(first.global_shape)} on some ranks, "
                        f"{t.dtype}{list(t.global_shape)} on others"
                    )
            held = None if holders == every else tuple(sorted(holders))
            out.append(first if held is None else dataclasses.replace(first, holders=held))
            continue
        spec = (first.dtype, first.global_shape, first.placements, tuple(first.mesh.shape))
        for _, t in copies:
            if t.mesh is None:
                raise NotCombinable(f"{path}: a DTensor on some ranks, plain on others")
            if (t.dtype, t.global_shape, t.placements, tuple(t.mesh.shape)) != spec:
                raise NotCombinable(
                    f"{path}: a DTensor of another dtype, shape, placement or mesh shape "
                    "on some ranks"
                )
        if all(equal(first.mesh, t.mesh) for _, t in copies):  # one mesh: one DTensor
            outside = mesh_ranks(first.mesh) - holders
            if outside:
                raise NotCombinable(
                    f"{path}: its mesh holds ranks {sorted(outside)[:8]}, whose description differs"
                )
            out.append(first)
            continue
        for g, t in copies:  # each group's own mesh: replicas of each other
            assert t.mesh is not None
            outside = mesh_ranks(t.mesh) - members[g]
            if outside:
                raise NotCombinable(
                    f"{path}: its mesh holds ranks {sorted(outside)[:8]}, whose description differs"
                )
        meshes = [t.mesh.to(torch.int64) for _, t in copies if t.mesh is not None]
        ids = tuple(id(t.mesh) for _, t in copies)
        mesh = stacked.get(ids)
        if mesh is None:
            mesh = stacked[ids] = torch.stack(meshes)
        placements = (Replicate(), *first.placements)
        out.append(dataclasses.replace(first, mesh=mesh, placements=placements))
    return out
