"""The pure planning functions of snapcore.sharding (issue 10): writer assignment, box
matching and byte ranges, each checked against a brute-force answer."""

from __future__ import annotations

import itertools
import random

import pytest

from snapcore import sharding
from snapcore.sharding import Box, BoxIndex, assign_writers, byte_ranges, intersect, overlaps

# ---------------------------------------------------------------- assign_writers


def _loads(items: list[sharding.WriteItem], plan: dict[str, int], world: int) -> list[int]:
    load = [0] * world
    for key, nbytes, _ in items:
        load[plan[key]] += nbytes
    return load


def _mixed_items(rng: random.Random, world: int, n: int) -> list[sharding.WriteItem]:
    items = []
    for i in range(n):
        k = rng.randint(1, world)
        holders = frozenset(rng.sample(range(world), k))
        items.append((f"t{i}", rng.randint(0, 10_000), holders))
    return items


def test_assign_writers_is_deterministic_and_order_free() -> None:
    rng = random.Random(1)
    items = _mixed_items(rng, 8, 300)
    items += [(f"tie{i}", 500, frozenset(range(8))) for i in range(20)]  # equal sizes
    plan = assign_writers(items, 8)
    for _ in range(5):
        shuffled = items[:]
        rng.shuffle(shuffled)
        shuffled = [(k, n, frozenset(sorted(h, reverse=True))) for k, n, h in shuffled]
        assert assign_writers(shuffled, 8) == plan


def test_assign_writers_picks_a_holder_and_single_holders_write_their_own() -> None:
    rng = random.Random(2)
    items = _mixed_items(rng, 6, 400)
    plan = assign_writers(items, 6)
    assert set(plan) == {k for k, _, _ in items}
    for key, _, holders in items:
        assert plan[key] in holders
        if len(holders) == 1:
            assert plan[key] == next(iter(holders))


def test_assign_writers_places_scarce_items_first() -> None:
    # "only0" can go to rank 0 alone; placed first, it makes rank 0 busy, so the
    # replicated item goes to rank 1 even though it is larger and sorts earlier by size.
    items = [("big", 100, frozenset({0, 1})), ("only0", 10, frozenset({0}))]
    assert assign_writers(items, 2) == {"only0": 0, "big": 1}
    # equal loads: the lowest rank wins
    assert assign_writers([("a", 5, frozenset({3, 1, 2}))], 4) == {"a": 1}


@pytest.mark.parametrize("world", [2, 3, 4, 8, 16])
def test_assign_writers_lpt_bound_on_replicated_items(world: int) -> None:
    rng = random.Random(world)
    for _ in range(50):
        n = rng.randint(1, 120)
        items = [
            (f"t{i}", rng.randint(0, 1 << rng.randint(0, 24)), frozenset(range(world)))
            for i in range(n)
        ]
        load = _loads(items, assign_writers(items, world), world)
        total = sum(n for _, n, _ in items)
        largest = max(n for _, n, _ in items)
        assert max(load) * world <= total + largest * world  # max <= avg + largest


def _transformer_items(rng: random.Random, world: int) -> list[sharding.WriteItem]:
    """200 tensors shaped like a Llama-style model (25 layers x 8 tensors), +-10% jitter."""
    h, ffn = 4096, 11008
    per_layer = [h * h] * 4 + [h * ffn] * 3 + [h]  # q k v o, gate up down, norm
    items = []
    for layer in range(25):
        for j, n in enumerate(per_layer):
            nbytes = int(n * 2 * rng.uniform(0.9, 1.1))  # bf16
            items.append((f"layers.{layer}.{j}", nbytes, frozenset(range(world))))
    return items


@pytest.mark.parametrize("world", [4, 8])
def test_assign_writers_busiest_rank_within_5_percent(world: int) -> None:
    rng = random.Random(10 + world)
    for _ in range(5):
        items = _transformer_items(rng, world)
        assert len(items) == 200
        load = _loads(items, assign_writers(items, world), world)
        assert max(load) <= 1.05 * sum(load) / world


def test_assign_writers_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="twice"):
        assign_writers([("a", 1, frozenset({0})), ("a", 2, frozenset({0}))], 1)
    with pytest.raises(ValueError, match="no rank"):
        assign_writers([("a", 1, frozenset())], 2)
    with pytest.raises(ValueError, match="outside"):
        assign_writers([("a", 1, frozenset({2}))], 2)
    with pytest.raises(ValueError, match="negative"):
        assign_writers([("a", -1, frozenset({0}))], 2)


# ---------------------------------------------------------------- boxes


def _cells(b: Box) -> set[tuple[int, ...]]:
    return set(
        itertools.product(*(range(o, o + s) for o, s in zip(b.offsets, b.shape, strict=True)))
    )


def _random_box(rng: random.Random, nd: int, size: int = 8) -> Box:
    offsets = tuple(rng.randint(0, size - 1) for _ in range(nd))
    shape = tuple(rng.randint(0, size - o) for o in offsets)
    return Box(offsets, shape)


def test_intersect_matches_brute_force() -> None:
    rng = random.Random(3)
    for _ in range(2000):
        nd = rng.randint(0, 4)
        a, b = _random_box(rng, nd, 6), _random_box(rng, nd, 6)
        common = intersect(a, b)
        both = _cells(a) & _cells(b)
        if common is None:
            assert not both
        else:
            assert _cells(common) == both and both


def test_overlaps_matches_brute_force() -> None:
    rng = random.Random(4)
    for _ in range(300):
        nd = rng.randint(0, 4)
        saved = [_random_box(rng, nd) for _ in range(rng.randint(0, 25))]
        index = BoxIndex(saved)
        for _ in range(5):
            wanted = _random_box(rng, nd)
            brute = [(i, c) for i, s in enumerate(saved) if (c := intersect(s, wanted))]
            assert index.overlaps(wanted) == brute
            assert overlaps(saved, wanted) == brute


def _grid(rows: int, cols: int, bh: int, bw: int) -> list[Box]:
    return [Box((r * bh, c * bw), (bh, bw)) for r in range(rows) for c in range(cols)]


class _Counter:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, a: Box, b: Box) -> Box | None:
        self.calls += 1
        return intersect(a, b)


@pytest.mark.parametrize(
    ("saved", "wanted"),
    [
        # 64 x 64 grid of 16 x 16 blocks, 8 x 8 wanted blocks off the grid's lines
        (
            _grid(64, 64, 16, 16),
            [Box((r * 120 + 5, c * 120 + 7), (120, 120)) for r in range(8) for c in range(8)],
        ),
        # 4096 row shards, 64 wanted row slabs (resharding a row-sharded tensor)
        (_grid(4096, 1, 1, 64), [Box((r * 64, 0), (64, 64)) for r in range(64)]),
        # 4096 column shards, 64 wanted column slabs
        (_grid(1, 4096, 32, 1), [Box((0, c * 64 + 3), (32, 61)) for c in range(64)]),
    ],
    ids=["block-grid", "rows", "columns"],
)
def test_overlaps_compares_only_hits_on_a_grid(
    saved: list[Box], wanted: list[Box], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert len(saved) == 4096 and len(wanted) == 64
    index = BoxIndex(saved)
    counter = _Counter()
    monkeypatch.setattr(sharding, "intersect", counter)
    results = [index.overlaps(w) for w in wanted]
    hits = sum(len(r) for r in results)
    assert hits > 0
    assert counter.calls == hits  # every comparison made is a hit
    assert counter.calls * 16 < len(saved) * len(wanted)  # far from all pairs
    monkeypatch.undo()
    for w, r in zip(wanted, results, strict=True):
        assert r == [(i, c) for i, s in enumerate(saved) if (c := intersect(s, w))]


def test_boxes_refuse_bad_input() -> None:
    with pytest.raises(ValueError):
        Box((0,), (1, 2))
    with pytest.raises(ValueError):
        Box((-1,), (2,))
    with pytest.raises(ValueError):
        intersect(Box((0,), (1,)), Box((0, 0), (1, 1)))
    with pytest.raises(ValueError):
        BoxIndex([Box((0,), (1,)), Box((0, 0), (1, 1))])


# ---------------------------------------------------------------- byte_ranges


def _row_major(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, n = [], 1
    for s in reversed(shape):
        strides.append(n)
        n *= s
    return tuple(reversed(strides))


def _brute_bytes(piece: Box, strides: tuple[int, ...], itemsize: int, sub: Box) -> set[int]:
    out = set()
    for cell in _cells(sub):
        e = sum((c - o) * s for c, o, s in zip(cell, piece.offsets, strides, strict=True))
        out.update(range(e * itemsize, (e + 1) * itemsize))
    return out


def test_byte_ranges_match_brute_force() -> None:
    rng = random.Random(5)
    for _ in range(1500):
        nd = rng.randint(0, 4)
        piece = Box(
            tuple(rng.randint(0, 5) for _ in range(nd)), tuple(rng.randint(1, 5) for _ in range(nd))
        )
        strides = _row_major(piece.shape)
        if nd > 1 and rng.random() < 0.3:  # a permuted dense layout (e.g. a transposed piece)
            perm = list(range(nd))
            rng.shuffle(perm)
            permuted = _row_major(tuple(piece.shape[p] for p in perm))
            strides = tuple(permuted[perm.index(d)] for d in range(nd))
        offsets = tuple(
            rng.randint(o, o + s - 1) for o, s in zip(piece.offsets, piece.shape, strict=True)
        )
        shape = tuple(
            rng.randint(0, po + ps - o)
            for o, po, ps in zip(offsets, piece.offsets, piece.shape, strict=True)
        )
        sub = Box(offsets, shape)
        itemsize = rng.choice([1, 2, 4, 8])
        runs = byte_ranges(piece, strides, itemsize, sub)
        covered: set[int] = set()
        for k, (off, n) in enumerate(runs):
            assert n > 0
            if k:
                prev_end = runs[k - 1][0] + runs[k - 1][1]
                assert off > prev_end  # sorted, disjoint, and not adjacent (coalesced)
            covered.update(range(off, off + n))
        assert covered == _brute_bytes(piece, strides, itemsize, sub)


def test_byte_ranges_coalesce_row_slabs_and_split_column_slabs() -> None:
    piece = Box((100, 0), (10, 6))  # rows 100..109 of a 6-wide tensor, float32
    strides = (6, 1)
    assert byte_ranges(piece, strides, 4, Box((102, 0), (3, 6))) == [(2 * 24, 3 * 24)]
    assert byte_ranges(piece, strides, 4, piece) == [(0, 240)]
    cols = byte_ranges(piece, strides, 4, Box((100, 2), (10, 3)))
    assert cols == [(r * 24 + 8, 12) for r in range(10)]
    # a 3-d piece: a slab full in the two inner dimensions is one run
    piece3 = Box((0, 0, 0), (4, 3, 5))
    assert byte_ranges(piece3, (15, 5, 1), 2, Box((1, 0, 0), (2, 3, 5))) == [(30, 60)]
    assert byte_ranges(Box((), ()), (), 8, Box((), ())) == [(0, 8)]
    assert byte_ranges(piece, strides, 4, Box((100, 0), (0, 6))) == []


def test_byte_ranges_refuse_a_box_outside_the_piece() -> None:
    with pytest.raises(ValueError, match="not inside"):
        byte_ranges(Box((4,), (4,)), (1,), 4, Box((2,), (4,)))
    with pytest.raises(ValueError, match="rank"):
        byte_ranges(Box((0,), (4,)), (1, 1), 4, Box((0,), (1,)))
