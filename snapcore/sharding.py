"""Pure planning functions for sharded saves and resharding reads (issue 10).

This module holds the pure planning functions of issue 10 (sharded snapshots under
torch.distributed), which the save plan (``planning/global_plan``) and the restore use:
nothing here touches a process group, a tensor or a file. The small, deterministic
computations:

- ``assign_writers``: which rank writes each item (a shard or a replicated tensor) so
  that every byte is written once and the bytes are balanced over the ranks;
- ``Box``, ``intersect``, ``BoxIndex``/``overlaps``: N-d box geometry, to find which saved
  pieces overlap a piece a rank wants, without comparing every pair;
- ``byte_ranges``: the coalesced byte runs of a saved row-major piece that cover a box.
"""

from __future__ import annotations

import itertools
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "Box",
    "BoxIndex",
    "WriteItem",
    "assign_writers",
    "byte_ranges",
    "intersect",
    "overlaps",
]

WriteItem = tuple[str, int, frozenset[int]]
"""(key, nbytes, holders): an item to write and the ranks that hold an identical copy."""


def assign_writers(
    items: Iterable[WriteItem], world_size: int, loads: Sequence[int] | None = None
) -> dict[str, int]:
    """Choose the one rank that writes each item; return ``{key: rank}``.

    Each item is ``(key, nbytes, holders)``: ``holders`` are the ranks that hold an
    identical replica (one rank for a shard only it has, every rank for a replicated
    tensor). The answer depends only on the set of items, never on their order, on dict
    order or on the hash seed, so every rank computes the same plan without talking.

    The pass is greedy in the style of Megatron's fully parallel save: items are taken in
    the total order (fewer holders first, then larger first, then key), and each goes to
    the least-loaded of its holders (ties: the lowest rank). An item with one holder goes
    to that rank. Cost: O(n log n + sum of |holders|).

    Balance bound (greedy longest-processing-time list scheduling): if every item is
    held by every rank, the busiest rank's bytes are at most ``total / world_size + p``,
    where ``p`` is the largest item that rank was given (so at most the largest item):
    when its last item was placed it was the least loaded, hence at most the average.
    Items held by some ranks only limit the choice and carry no such bound.

    ``loads``: the bytes each rank writes already (default none), which the pass starts
    from (the node copies of ``global_plan.plan_copies`` go to the ranks that write the
    least of the job's items).

    Raises ``ValueError`` for a duplicate key, a negative size, or holders that are empty
    or outside ``range(world_size)``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if loads is not None and len(loads) != world_size:
        raise ValueError(f"{len(loads)} loads for a world of {world_size}")
    order: list[tuple[int, int, str, tuple[int, ...]]] = []
    seen: set[str] = set()
    for key, nbytes, holders in items:
        if key in seen:
            raise ValueError(f"item {key!r} appears twice")
        seen.add(key)
        if nbytes < 0:
            raise ValueError(f"item {key!r}: negative size {nbytes}")
        ranks = tuple(sorted(holders))
        if not ranks:
            raise ValueError(f"item {key!r}: no rank holds it")
        if ranks[0] < 0 or ranks[-1] >= world_size:
            raise ValueError(f"item {key!r}: holders {ranks} outside 0..{world_size - 1}")
        order.append((len(ranks), -nbytes, key, ranks))
    order.sort(key=lambda o: o[:3])  # keys are unique: a total order
    load = [0] * world_size if loads is None else list(loads)
    out: dict[str, int] = {}
    for _, neg_nbytes, key, ranks in order:
        rank = min(ranks, key=lambda r: (load[r], r))
        load[rank] -= neg_nbytes
        out[key] = rank
    return out


@dataclass(frozen=True)
class Box:
    """A box of a tensor's index space: ``offsets`` (start per dimension) and ``shape``.

    A 0-d tensor is ``Box((), ())``, one element. A box with a zero in its shape is empty.
    """

    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.shape):
            raise ValueError(f"box offsets {self.offsets} and shape {self.shape} differ in rank")
        if any(o < 0 for o in self.offsets) or any(s < 0 for s in self.shape):
            raise ValueError(f"box offsets {self.offsets} / shape {self.shape} must be >= 0")

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.shape, strict=True))

    @property
    def empty(self) -> bool:
        return 0 in self.shape

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes of the same rank, or ``None`` when they share nothing."""
    if a.ndim != b.ndim:
        raise ValueError(f"boxes of rank {a.ndim} and {b.ndim} cannot intersect")
    lo = tuple(max(x, y) for x, y in zip(a.offsets, b.offsets, strict=True))
    hi = tuple(min(x, y) for x, y in zip(a.ends, b.ends, strict=True))
    if any(h <= low for low, h in zip(lo, hi, strict=True)):
        return None
    return Box(lo, tuple(h - low for low, h in zip(lo, hi, strict=True)))


@dataclass
class _Level:
    """Boxes grouped by their distinct interval in one dimension, sorted by start."""

    starts: list[int]
    ends: list[int]
    children: list[_Level | list[int]]
    longest: int  # the longest interval: a box starting at or before lo - longest ends by lo


class BoxIndex:
    """An index over saved boxes, to find those overlapping a wanted box.

    Boxes are grouped level by level: by their distinct interval in dimension 0 (sorted
    by start), then within each group by their interval in dimension 1, and so on. A query
    bisects each level for the intervals that can reach the wanted range and descends only
    into those that overlap it. For pieces on a grid (row-, column- or block-sharded, the
    layouts DTensor placements produce) every box reached at the last level overlaps, so a
    query costs O(d log n + hits) and ``intersect`` is called only for the hits, instead
    of once per saved box (the O(local x saved) matching of pytorch issue 169113).
    Irregular layouts stay correct; a level whose intervals differ a lot in length scans
    more candidates.
    """

    def __init__(self, saved: Sequence[Box]) -> None:
        self.saved = list(saved)
        ranks = {b.ndim for b in self.saved}
        if len(ranks) > 1:
            raise ValueError(f"saved boxes of different ranks {sorted(ranks)}")
        self.ndim = ranks.pop() if ranks else 0
        live = [i for i, b in enumerate(self.saved) if not b.empty]
        self._root = self._build(live, 0)

    def _build(self, indices: list[int], d: int) -> _Level | list[int]:
        if d == self.ndim:
            return indices
        groups: dict[tuple[int, int], list[int]] = {}
        for i in indices:
            b = self.saved[i]
            groups.setdefault((b.offsets[d], b.offsets[d] + b.shape[d]), []).append(i)
        keys = sorted(groups)
        return _Level(
            starts=[s for s, _ in keys],
            ends=[e for _, e in keys],
            children=[self._build(groups[k], d + 1) for k in keys],
            longest=max((e - s for s, e in keys), default=0),
        )

    def overlaps(self, wanted: Box) -> list[tuple[int, Box]]:
        """``(index into saved, common box)`` for every saved box overlapping ``wanted``,
        by index."""
        if wanted.ndim != self.ndim and self.saved:
            raise ValueError(f"wanted box of rank {wanted.ndim}, saved boxes of rank {self.ndim}")
        if wanted.empty:
            return []
        candidates: list[int] = []
        self._collect(self._root, wanted, 0, candidates)
        out: list[tuple[int, Box]] = []
        for i in sorted(candidates):
            common = intersect(self.saved[i], wanted)
            if common is not None:
                out.append((i, common))
        return out

    def _collect(self, node: _Level | list[int], wanted: Box, d: int, out: list[int]) -> None:
        if isinstance(node, list):
            out.extend(node)
            return
        lo = wanted.offsets[d]
        hi = lo + wanted.shape[d]
        first = bisect_right(node.starts, lo - node.longest)  # start > lo - longest
        last = bisect_left(node.starts, hi)  # start < hi
        for k in range(first, last):
            if node.ends[k] > lo:
                self._collect(node.children[k], wanted, d + 1, out)


def overlaps(saved: Sequence[Box], wanted: Box) -> list[tuple[int, Box]]:
    """The saved boxes overlapping ``wanted``: ``(index, common box)``, by index.

    Builds a ``BoxIndex`` for one query; to match many wanted boxes against the same saved
    pieces, build the ``BoxIndex`` once and query it.
    """
    return BoxIndex(saved).overlaps(wanted)


def byte_ranges(
    piece_box: Box, piece_strides: Sequence[int], itemsize: int, sub_box: Box
) -> list[tuple[int, int]]:
    """The byte runs ``(offset, length)`` of a saved piece that hold ``sub_box``.

    ``piece_box`` is where the piece lies in the global tensor and ``piece_strides`` its
    layout in elements (row-major: ``strides[-1] == 1`` and each stride the product of the
    shape after it); offsets are bytes from the piece's first element. ``sub_box`` (in
    global coordinates) must lie inside the piece. Runs are sorted and maximally
    coalesced: adjacent runs are merged, so a full-width row slab of a row-major piece is
    one run and a column slab one run per row.
    """
    nd = piece_box.ndim
    if len(piece_strides) != nd or sub_box.ndim != nd:
        raise ValueError(
            f"piece {piece_box}, strides {tuple(piece_strides)} and box {sub_box} differ in rank"
        )
    if itemsize < 1 or any(s < 0 for s in piece_strides):
        raise ValueError(f"itemsize {itemsize} / strides {tuple(piece_strides)} invalid")
    if sub_box.empty:
        return []
    rel = [s - p for s, p in zip(sub_box.offsets, piece_box.offsets, strict=True)]
    if any(r < 0 for r in rel) or any(
        r + n > p for r, n, p in zip(rel, sub_box.shape, piece_box.shape, strict=True)
    ):
        raise ValueError(f"box {sub_box} is not inside piece {piece_box}")
    # The innermost dimensions whose wanted elements are one contiguous run.
    run = 1
    d = nd
    while d > 0 and (piece_strides[d - 1] == run or piece_box.shape[d - 1] == 1):
        d -= 1
        if sub_box.shape[d] != piece_box.shape[d]:
            run *= sub_box.shape[d]
            break
        run *= piece_box.shape[d]
    inner = sum(rel[e] * piece_strides[e] for e in range(d, nd))
    starts = sorted(
        inner + sum(i * s for i, s in zip(idx, piece_strides, strict=False))
        for idx in itertools.product(*(range(rel[e], rel[e] + sub_box.shape[e]) for e in range(d)))
    )
    out: list[tuple[int, int]] = []
    length = run * itemsize
    for start in starts:
        offset = start * itemsize
        if out and out[-1][0] + out[-1][1] == offset:
            out[-1] = (out[-1][0], out[-1][1] + length)
        else:
            out.append((offset, length))
    return out
