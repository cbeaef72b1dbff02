"""snapcore.planning.global_plan (issue 10 seam): DTensor shard boxes, the global save
plan and the resharding read plan. Multi-rank layouts are computed in one process with
the pure functions; real DTensors are checked on a 1-rank gloo group."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from snapcore import sharding
from snapcore.errors import StateMismatch, UnsupportedState
from snapcore.planning.global_plan import (
    LocalItem,
    SavedPiece,
    describe_local,
    describe_sharded,
    plan_copies,
    plan_read,
    plan_save,
    replica_ranks,
    shard_box,
    structure_fingerprint,
)
from snapcore.sharding import Box

# ---------------------------------------------------------------- shard boxes (pure)


def _oracle_box(shape: tuple[int, ...], mesh_shape, coordinate, placements) -> Box:
    """The box by brute force: split an index range per tensor dimension with
    torch.chunk, mesh dimension by mesh dimension (DTensor's Shard semantics)."""
    ranges = [torch.arange(n) for n in shape]
    for m, c, p in zip(mesh_shape, coordinate, placements, strict=True):
        if isinstance(p, Shard):
            chunks = torch.chunk(ranges[p.dim], m) if ranges[p.dim].numel() else ()
            ranges[p.dim] = chunks[c] if c < len(chunks) else ranges[p.dim][:0]
    offsets = []
    for r in ranges:
        if r.numel():
            assert torch.equal(r, torch.arange(int(r[0]), int(r[0]) + r.numel()))
        offsets.append(int(r[0]) if r.numel() else None)
    sizes = tuple(r.numel() for r in ranges)
    return Box(tuple(0 if o is None else o for o in offsets), sizes)


def _random_layout(rng: random.Random, world: int):
    shape = tuple(rng.randint(0, 7) for _ in range(rng.randint(0, 3)))
    factors = [m for m in range(1, world + 1) if world % m == 0]
    m0 = rng.choice(factors)
    mesh_shape = (m0, world // m0) if rng.random() < 0.5 else (world,)
    choices = [Replicate()] + [Shard(d) for d in range(len(shape))]
    placements = [rng.choice(choices) for _ in mesh_shape]
    return shape, mesh_shape, placements


def test_shard_box_matches_torch_chunk_on_random_layouts() -> None:
    rng = random.Random(10)
    for _ in range(400):
        world = rng.randint(1, 8)
        shape, mesh_shape, placements = _random_layout(rng, world)
        for coordinate in itertools.product(*(range(m) for m in mesh_shape)):
            got = shard_box(shape, mesh_shape, coordinate, placements)
            want = _oracle_box(shape, mesh_shape, coordinate, placements)
            assert got.shape == want.shape, (shape, mesh_shape, coordinate, placements)
            if not got.empty:
                assert got.offsets == want.offsets


def test_uneven_four_rank_row_shards() -> None:
    mesh = torch.arange(4)
    items = describe_sharded("w", "float32", (5, 3), mesh, [Shard(0)])
    assert [items[r].box for r in range(4)] == [
        Box((0, 0), (2, 3)),
        Box((2, 0), (2, 3)),
        Box((4, 0), (1, 3)),
        Box((5, 0), (0, 3)),
    ]
    assert all(items[r].holders == {r} and not items[r].replicated for r in range(4))


def test_hsdp_2x2_mesh_replicas_and_2d_sharding() -> None:
    mesh = torch.arange(4).reshape(2, 2)  # dim 0 replicate (DDP), dim 1 shard (FSDP)
    items = describe_sharded("w", "bfloat16", (6, 4), mesh, [Replicate(), Shard(0)])
    assert items[0].box == items[2].box == Box((0, 0), (3, 4))
    assert items[1].box == items[3].box == Box((3, 0), (3, 4))
    assert items[0].holders == items[2].holders == {0, 2}
    assert items[1].holders == items[3].holders == {1, 3}
    assert all(i.replicated for i in items.values())
    assert items[0].nbytes == 3 * 4 * 2
    # TP x FSDP on different dims: four distinct blocks, no replicas
    blocks = describe_sharded("w", "float32", (4, 6), mesh, [Shard(0), Shard(1)])
    assert blocks[3].box == Box((2, 3), (2, 3)) and blocks[3].holders == {3}
    # a mesh whose ranks are not in coordinate order
    odd = torch.tensor([[3, 1], [0, 2]])
    assert replica_ranks(odd, (0, 1), [Replicate(), Shard(0)]) == {1, 2}


def test_unsupported_placements_name_the_tensor() -> None:
    with pytest.raises(UnsupportedState, match="Partial") as e:
        shard_box((4,), (2,), (0,), [Partial()], path="layers.0.w")
    assert e.value.path == "layers.0.w"
    with pytest.raises(UnsupportedState, match="dimension 2"):
        shard_box((4, 4), (2,), (0,), [Shard(2)], path="x")


# ---------------------------------------------------------------- real DTensors, 1 rank


def test_describe_local_plain_and_dtensors(gloo_group: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh1 = init_device_mesh("cpu", (1,))
    mesh2 = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "fsdp"))
    full = torch.arange(15, dtype=torch.float32).reshape(5, 3)
    tensors = [
        torch.zeros(2, 2, dtype=torch.int64),
        distribute_tensor(full, mesh1, [Shard(0)]),
        distribute_tensor(full, mesh2, [Replicate(), Shard(1)]),
        torch.tensor(7),
    ]
    items = describe_local(tensors, ["a", "b", "c", "step"])
    assert items[0] == LocalItem("a", "int64", (2, 2), Box((0, 0), (2, 2)), True, None)
    assert items[1] == LocalItem("b", "float32", (5, 3), Box((0, 0), (5, 3)), False, {0})
    assert items[2].box == Box((0, 0), (5, 3)) and items[2].holders == {0}
    assert items[3].box == Box((), ()) and items[3].global_shape == ()
    for item, t in zip(items[1:3], tensors[1:3], strict=True):
        assert isinstance(t, DTensor)
        (chunk,) = t.__create_chunk_list__()
        assert (tuple(chunk.offsets), tuple(chunk.sizes)) == (item.box.offsets, item.box.shape)
    plan = plan_save([items], 1)
    assert [w.path for w in plan.writes[0]] == ["a", "b", "c", "step"]

    # a local tensor that is not the shard its placements give (e.g. padded) is refused
    short = DTensor.from_local(full[:3], mesh1, [Shard(0)], shape=(5, 3), stride=(3, 1))
    with pytest.raises(UnsupportedState, match=r"local shard of shape \(3, 3\)"):
        describe_local([short], ["short"])

    partial = DTensor.from_local(full, mesh1, [Partial()])
    with pytest.raises(UnsupportedState, match="Partial") as e:
        describe_local([partial], ["p"])
    assert e.value.path == "p"


# ---------------------------------------------------------------- plan_save


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(box.offsets, box.shape, strict=True))


def _random_state(rng: random.Random, world: int) -> list[list[LocalItem]]:
    """Every rank's items for a few tensors laid out on random meshes and placements,
    plus plain tensors replicated by convention on every rank."""
    per_rank: list[list[LocalItem]] = [[] for _ in range(world)]
    for t in range(rng.randint(1, 6)):
        dtype = rng.choice(["float32", "bfloat16", "int64", "uint8"])
        if rng.random() < 0.25:
            shape = tuple(rng.randint(0, 5) for _ in range(rng.randint(0, 2)))
            for r in range(world):
                box = Box((0,) * len(shape), shape)
                per_rank[r].append(LocalItem(f"plain{t}", dtype, shape, box, True))
            continue
        shape, mesh_shape, placements = _random_layout(rng, world)
        ranks = list(range(world))
        rng.shuffle(ranks)
        mesh = torch.tensor(ranks).reshape(mesh_shape)
        for r, item in describe_sharded(f"t{t}", dtype, shape, mesh, placements).items():
            per_rank[r].append(item)
    for items in per_rank:
        rng.shuffle(items)
    return per_rank


def test_plan_save_writes_every_element_exactly_once() -> None:
    rng = random.Random(20)
    for _ in range(300):
        world = rng.randint(1, 8)
        per_rank = _random_state(rng, world)
        plan = plan_save(per_rank, world)
        for path, (_, shape) in plan.tensors.items():
            count = torch.zeros(shape, dtype=torch.int32)
            for rank, writes in enumerate(plan.writes):
                for w in (w for w in writes if w.path == path):
                    holders = {
                        r for r, items in enumerate(per_rank) if any(
                            i.path == path and i.box == w.box for i in items)
                    }  # fmt: skip
                    assert rank in holders  # a rank writes only what it holds
                    idx = _slices(w.box)
                    count[idx] += 1
            assert bool((count == 1).all()), path
        total = sum(plan.rank_bytes)
        assert total == sum(
            math.prod(s) * torch.empty(0, dtype=getattr(torch, d)).element_size()
            for d, s in plan.tensors.values()
        )


def test_plan_save_is_the_same_whatever_the_item_order() -> None:
    rng = random.Random(21)
    per_rank = _random_state(rng, 8)
    plan = plan_save(per_rank, 8)
    shuffled = [rng.sample(items, len(items)) for items in per_rank]
    again = plan_save(shuffled, 8)
    assert again.writes == plan.writes
    assert again.fingerprint == plan.fingerprint
    assert again.rank_fingerprints == plan.rank_fingerprints


def test_plan_save_balances_replicated_bytes() -> None:
    # DDP-like: 40 plain tensors of assorted sizes on 4 ranks
    sizes = [1 << (i % 7 + 10) for i in range(40)]
    per_rank = [
        [LocalItem(f"p{i}", "float32", (n,), Box((0,), (n,)), True) for i, n in enumerate(sizes)]
        for _ in range(4)
    ]
    plan = plan_save(per_rank, 4)
    avg = sum(plan.rank_bytes) / 4
    assert max(plan.rank_bytes) <= 1.05 * avg
    assert sum(len(w) for w in plan.writes) == 40


def test_plan_copies_give_each_home_every_box_its_ranks_hold_exactly_once() -> None:
    """A node-local tier holds its home's parts only: with the copies, every element a
    home's ranks hold is written into it exactly once, by a rank of that home holding it;
    object storage (one home: the whole job) gets no copy."""
    rng = random.Random(22)
    for _ in range(300):
        world = rng.randint(1, 8)
        per_rank = _random_state(rng, world)
        plan = plan_save(per_rank, world)
        homes = [rng.randint(0, 2) for _ in range(world)]
        copies = plan_copies(plan, homes)
        assert plan_copies(plan, ["one"] * world) == ((),) * world
        assert plan_copies(plan, homes) == copies  # deterministic
        for r in range(world):  # what a rank computes: its own home's copies only
            alone = plan_copies(plan, homes, only=r)
            assert alone[r] == copies[r]
            assert all(not alone[x] for x in range(world) if homes[x] != homes[r])
        for home in set(homes):
            ranks = [r for r in range(world) if homes[r] == home]
            for path, (_, shape) in plan.tensors.items():
                held = torch.zeros(shape, dtype=torch.int32)
                for r in ranks:
                    for i in (i for i in per_rank[r] if i.path == path):
                        held[_slices(i.box)] = 1
                count = torch.zeros(shape, dtype=torch.int32)
                for r in ranks:
                    for w in (w for w in plan.writes[r] + copies[r] if w.path == path):
                        assert any(i.path == path and i.box == w.box for i in per_rank[r])
                        count[_slices(w.box)] += 1
                assert torch.equal(count, held), (path, home)


def test_plan_copies_balance_the_bytes_of_each_home() -> None:
    """DDP on two nodes of 4 ranks: each node writes the whole model into its own tier,
    its ranks about alike (the job's writes and the node's copies together)."""
    sizes = [1 << (i % 7 + 10) for i in range(40)]
    per_rank = [
        [LocalItem(f"p{i}", "float32", (n,), Box((0,), (n,)), True) for i, n in enumerate(sizes)]
        for _ in range(8)
    ]
    plan = plan_save(per_rank, 8)
    copies = plan_copies(plan, [r // 4 for r in range(8)])
    total = 4 * sum(sizes)
    for node in range(2):
        ranks = range(4 * node, 4 * node + 4)
        load = [plan.rank_bytes[r] + sum(w.nbytes for w in copies[r]) for r in ranks]
        assert sum(load) == total
        assert max(load) <= 1.05 * total / 4, load
    with pytest.raises(ValueError, match="homes"):
        plan_copies(plan, [0, 1])


def test_fingerprint_tracks_structure() -> None:
    mesh = torch.arange(2)
    base = describe_sharded("w", "float32", (4, 4), mesh, [Shard(0)])
    per_rank = [[base[0]], [base[1]]]
    plan = plan_save(per_rank, 2)
    assert plan.rank_fingerprints[1] == structure_fingerprint([base[1]], 2)
    # a rank checks its cached plan alone: a new optimizer entry changes its fingerprint
    extra = LocalItem("exp_avg", "float32", (4,), Box((0,), (4,)), True)
    assert structure_fingerprint([base[1], extra], 2) != plan.rank_fingerprints[1]
    # dtype, shape, box and world size all count
    changed = [
        describe_sharded("w", "bfloat16", (4, 4), mesh, [Shard(0)]),
        describe_sharded("w", "float32", (4, 5), mesh, [Shard(0)]),
        describe_sharded("w", "float32", (4, 4), mesh, [Shard(1)]),
    ]
    for other in changed:
        assert plan_save([[other[0]], [other[1]]], 2).fingerprint != plan.fingerprint
    assert structure_fingerprint([base[0]], 3) != structure_fingerprint([base[0]], 2)
    # stable across processes: a fixed value, not Python's seeded hash
    one = LocalItem("w", "float32", (4,), Box((0,), (2,)), False, frozenset({0}))
    pinned = "35d69bfac207eba36f4979d7249ba18fb3e8af032b6c12e8f654958ff9be6a86"
    assert structure_fingerprint([one], 2) == pinned
    assert len(plan.fingerprint) == 64


def test_plan_save_rejects_overlapping_boxes() -> None:
    a = LocalItem("w", "float32", (4,), Box((0,), (3,)), False, frozenset({0}))
    b = LocalItem("w", "float32", (4,), Box((2,), (2,)), False, frozenset({1}))
    with pytest.raises(StateMismatch, match=r"w: box .*overlaps"):
        plan_save([[a], [b]], 2)


def test_plan_save_names_the_missing_region() -> None:
    a = LocalItem("layer.w", "float32", (4, 6), Box((0, 0), (2, 6)), False, frozenset({0}))
    b = LocalItem("layer.w", "float32", (4, 6), Box((2, 0), (2, 3)), False, frozenset({1}))
    with pytest.raises(StateMismatch) as e:
        plan_save([[a], [b]], 2)
    msg = str(e.value)
    assert "layer.w" in msg and "18 of 24" in msg
    assert "offsets=(2, 3), shape=(2, 3)" in msg


def test_plan_save_rejects_disagreeing_ranks() -> None:
    a = LocalItem("w", "float32", (4,), Box((0,), (4,)), True)
    with pytest.raises(StateMismatch, match="dtype"):
        plan_save([[a], [LocalItem("w", "int32", (4,), Box((0,), (4,)), True)]], 2)
    with pytest.raises(StateMismatch, match="outside"):
        plan_save([[LocalItem("w", "float32", (4,), Box((2,), (3,)), True)]], 1)
    with pytest.raises(StateMismatch, match="twice"):
        plan_save([[a, a]], 1)
    # rank 0's mesh says rank 1 holds a replica, but rank 1 reported another box
    r0 = LocalItem("v", "float32", (4,), Box((0,), (4,)), True, frozenset({0, 1}))
    r1 = LocalItem("v", "float32", (4,), Box((0,), (2,)), False, frozenset({1}))
    with pytest.raises(StateMismatch, match="according to their meshes"):
        plan_save([[r0], [r1]], 2)


# ---------------------------------------------------------------- plan_read


def _save_bytes(full: torch.Tensor, path: str, plan) -> tuple[list[SavedPiece], list[bytes]]:
    """Split ``full`` by the plan's writes into row-major byte strings (what ranks write)."""
    pieces, data = [], []
    for rank, writes in enumerate(plan.writes):
        for w in writes:
            if w.path != path:
                continue
            idx = _slices(w.box)
            raw = full[idx].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            pieces.append(SavedPiece(path, w.box, full.element_size(), location=(rank, w.box)))
            data.append(raw)
    return pieces, data


def _assemble(full: torch.Tensor, want: Box, copies, pieces, data) -> torch.Tensor:
    out = torch.empty(want.shape, dtype=full.dtype)
    for c in copies:
        raw = b"".join(data[c.piece][o : o + n] for o, n in c.runs)
        src = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        block = src.view(full.dtype).reshape(c.box.shape)
        rel = tuple(
            slice(o - w, o - w + s)
            for o, w, s in zip(c.box.offsets, want.offsets, c.box.shape, strict=True)
        )
        out[rel] = block
        assert pieces[c.piece].location[1] == pieces[c.piece].box
    return out


def test_plan_read_reassembles_any_resharding_bit_exact() -> None:
    rng = random.Random(30)
    gen = torch.Generator().manual_seed(30)
    for _ in range(200):
        shape = tuple(rng.randint(1, 7) for _ in range(rng.randint(0, 3)))
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.int64, torch.uint8])
        full = torch.randint(0, 250, shape, generator=gen).to(dtype)
        if dtype.is_floating_point:
            full = torch.randn(shape, generator=gen).to(dtype)
        name = str(dtype).removeprefix("torch.")
        # save on one random mesh
        world = rng.randint(1, 8)
        _, mesh_shape, _ = _random_layout(rng, world)
        choices = [Replicate()] + [Shard(d) for d in range(len(shape))]
        placements = [rng.choice(choices) for _ in mesh_shape]
        mesh = torch.arange(world).reshape(mesh_shape)
        saved_items = describe_sharded("t", name, shape, mesh, placements)
        plan = plan_save([[saved_items[r]] for r in range(world)], world)
        pieces, data = _save_bytes(full, "t", plan)
        # read on another
        world2 = rng.randint(1, 8)
        _, mesh_shape2, _ = _random_layout(rng, world2)
        placements2 = [rng.choice(choices) for _ in mesh_shape2]
        mesh2 = torch.arange(world2).reshape(mesh_shape2)
        wanted = [
            ("t", item.box)
            for item in describe_sharded("t", name, shape, mesh2, placements2).values()
        ]
        for (_, want), copies in zip(wanted, plan_read(pieces, wanted), strict=True):
            idx = _slices(want)
            got = _assemble(full, want, copies, pieces, data)
            expect = full[idx]
            assert torch.equal(
                got.reshape(-1).view(torch.uint8), expect.contiguous().reshape(-1).view(torch.uint8)
            )


def test_plan_read_coalesces_and_uses_the_index(monkeypatch: pytest.MonkeyPatch) -> None:
    # 1000 saved row shards; a rank wants 3 rows in the middle: 3 intersections, not 1000
    pieces = [SavedPiece("w", Box((i, 0), (1, 8)), 4) for i in range(1000)]
    calls = 0
    real = sharding.intersect

    def counting(a: Box, b: Box) -> Box | None:
        nonlocal calls
        calls += 1
        return real(a, b)

    monkeypatch.setattr(sharding, "intersect", counting)
    (copies,) = plan_read(pieces, [("w", Box((500, 2), (3, 4)))])
    assert [c.piece for c in copies] == [500, 501, 502]
    assert calls == 3
    assert copies[0].runs == ((8, 16),)  # columns 2..5 of one row: one run
    # a full-width slab of one big piece is one coalesced run
    (slab,) = plan_read([SavedPiece("w", Box((0, 0), (10, 8)), 4)], [("w", Box((2, 0), (5, 8)))])
    assert slab[0].runs == ((64, 160),)


def test_plan_read_errors_name_path_and_gap() -> None:
    pieces = [SavedPiece("w", Box((0,), (4,)), 4), SavedPiece("w", Box((6,), (4,)), 4)]
    with pytest.raises(StateMismatch, match=r"w: .*8 of the 10 .*offsets=\(4,\), shape=\(2,\)"):
        plan_read(pieces, [("w", Box((0,), (10,)))])
    with pytest.raises(StateMismatch, match=r"missing\.w: not in the snapshot"):
        plan_read(pieces, [("missing.w", Box((0,), (1,)))])
    dup = [SavedPiece("w", Box((0,), (4,)), 4), SavedPiece("w", Box((2,), (2,)), 4)]
    with pytest.raises(StateMismatch, match="overlap each other"):
        plan_read(dup, [("w", Box((0,), (4,)))])


def test_strided_shards_of_fsdp_over_tensor_parallel_are_boxes() -> None:
    """FSDP2 over TP shards a dimension TP already split (_StridedShard on the data-
    parallel mesh dimension): each rank's rows are one range, as torch computes them."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    for rows in (8, 13, 3):
        placements = [_StridedShard(0, split_factor=2), Shard(0)]
        seen = []
        for coord in [(0, 0), (0, 1), (1, 0), (1, 1)]:
            box = shard_box((rows, 5), (2, 2), coord, placements)
            shape, offsets = _compute_local_shape_and_global_offset(
                (rows, 5), (2, 2), list(coord), placements
            )
            assert box.shape == tuple(shape)
            if box.numel():
                assert box.offsets == tuple(offsets)
                seen.extend(range(box.offsets[0], box.ends[0]))
        assert sorted(seen) == list(range(rows))  # the ranks tile the tensor


def test_strided_shards_that_interleave_are_refused() -> None:
    from torch.distributed.tensor.placement_types import _StridedShard

    # torch's own example: Shard(0) then _StridedShard(0, 2) gives rank (0, 0) rows 0, 2
    with pytest.raises(UnsupportedState, match="not one range") as e:
        shard_box((8,), (2, 2), (0, 0), [Shard(0), _StridedShard(0, split_factor=2)], path="w")
    assert e.value.path == "w"
