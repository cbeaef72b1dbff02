"""snapcore.planning.uniform: the plan of a description every rank shares, computed
without enumerating every rank's boxes, must be the plan ``global_plan.plan_save``
makes from every rank's derived items: the same writer for every box, the same bytes
per rank, on random meshes (1-D, 2-D HSDP-like, uneven and empty shards, FSDP2 over
TP's strided shards) and plain tensors held by every rank."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from snapcore.errors import UnsupportedState
from snapcore.planning.global_plan import (
    plan_copies,
    plan_save,
    shard_box,
)
from snapcore.planning.uniform import (
    GlobalTensor,
    NotCombinable,
    _key,
    combine,
    decode_description,
    encode_placement,
    items_of,
    local_items,
    plan_uniform,
    shard_table,
    uniform_copies,
)


def _random_tensor(rng: random.Random, t: int, world: int) -> GlobalTensor:
    dtype = rng.choice(["float32", "bfloat16", "int64", "uint8"])
    if rng.random() < 0.3:  # a plain tensor, held by every rank (DDP, step counters)
        shape = tuple(rng.choice([0, 1, 3, 4, 4, 4]) for _ in range(rng.randint(0, 2)))
        return GlobalTensor(f"p{t}", dtype, shape)
    shape = tuple(rng.randint(0, 9) for _ in range(rng.randint(1, 3)))
    factors = [m for m in range(1, world + 1) if world % m == 0]
    m0 = rng.choice(factors)
    mesh_shape = (m0, world // m0) if rng.random() < 0.6 else (world,)
    if len(mesh_shape) == 2 and rng.random() < 0.25:
        # FSDP2 over TP: the data-parallel dimension shards rows TP splits too
        placements = [_StridedShard(0, split_factor=mesh_shape[1]), Shard(0)]
        if rng.random() < 0.3:  # the other order interleaves rows: refused
            placements = [Shard(0), _StridedShard(0, split_factor=rng.randint(1, 3))]
        shape = (rng.randint(0, 3 * world), *shape[1:])  # uneven ones may be refused
    else:
        choices = [Replicate()] + [Shard(d) for d in range(len(shape))]
        placements = [rng.choice(choices) for _ in mesh_shape]
    ranks = list(range(world))
    rng.shuffle(ranks)
    return GlobalTensor(
        f"t{t}", dtype, shape, torch.tensor(ranks).reshape(mesh_shape), tuple(placements)
    )


def _plannable(rng: random.Random, t: int, world: int) -> GlobalTensor:
    """A random tensor whose placements are supported (not interleaving rows)."""
    while True:
        g = _random_tensor(rng, t, world)
        if g.mesh is None:
            return g
        try:
            shard_table(g.global_shape, tuple(g.mesh.shape), g.placements)
            return g
        except UnsupportedState:
            continue


Groups = list[tuple[list[int], list[GlobalTensor]]]


def _assert_same_plan(tensors: list[GlobalTensor], world: int, node: int = 2) -> None:
    _assert_same_grouped_plan([(list(range(world)), tensors)], world, node)


def _assert_same_grouped_plan(groups: Groups, world: int, node: int) -> None:
    """``plan_uniform`` and ``uniform_copies`` on the groups' description (combined when
    there are several) against ``plan_save`` and ``plan_copies`` on every rank's items:
    the same writer for every box, bytes per rank, and node copies (homes of ``node``
    ranks each, which may span groups)."""
    per_rank = items_of(groups, world)
    old = plan_save(per_rank, world)
    tensors = groups[0][1] if len(groups) == 1 else combine(groups)
    new = plan_uniform(tensors, world, "digest")
    assert new.rank_bytes == old.rank_bytes
    nodes = [r // node for r in range(world)]
    for ranks, own in groups:
        for r in ranks:
            assert local_items(own, r) == per_rank[r], r
            home = {q for q in range(world) if nodes[q] == nodes[r]}
            near = plan_uniform(tensors, world, "d", ranks=home)
            want = frozenset((w.path, w.box) for w in plan_copies(old, nodes, only=r)[r])
            assert uniform_copies(tensors, near, home, r) == want, (r, home)
            mine = plan_uniform(tensors, world, "digest", ranks={r})
            for item in per_rank[r]:
                w = None if item.box.empty else old.writers[(item.path, item.box)]
                assert new.writer(item) == w, (r, item)
                assert mine.writer(item) == w, (r, item)


def test_shard_table_is_shard_box_at_every_coordinate() -> None:
    rng = random.Random(7)
    refused = 0
    for _ in range(400):
        world = rng.randint(1, 8)
        t = _random_tensor(rng, 0, world)
        if t.mesh is None:
            continue
        mesh_shape = tuple(t.mesh.shape)
        coordinates = list(itertools.product(*(range(m) for m in mesh_shape)))
        try:
            boxes = [shard_box(t.global_shape, mesh_shape, c, t.placements) for c in coordinates]
        except UnsupportedState:  # strided shards whose rows interleave: refused alike
            with pytest.raises(UnsupportedState, match="not one range"):
                shard_table(t.global_shape, mesh_shape, t.placements)
            refused += 1
            continue
        offsets, sizes = shard_table(t.global_shape, mesh_shape, t.placements)
        for c, box in zip(coordinates, boxes, strict=True):
            assert tuple(sizes[c].tolist()) == box.shape, (t, c)
            assert tuple(offsets[c].tolist()) == box.offsets, (t, c)
    assert 0 < refused < 100  # both kinds were tried


def test_the_uniform_plan_is_plan_save_on_random_meshes() -> None:
    rng = random.Random(11)
    for _ in range(150):
        world = rng.choice([1, 2, 3, 4, 6, 8])
        tensors = [_plannable(rng, t, world) for t in range(rng.randint(1, 8))]
        _assert_same_plan(tensors, world, node=rng.choice([1, 2, 3, world]))


def _layers(n: int, mesh: torch.Tensor, weight: list, bias: list) -> list[GlobalTensor]:
    out = []
    for i in range(n):
        for kind in ("w", "exp_avg.w", "exp_avg_sq.w"):
            out.append(GlobalTensor(f"{i}.{kind}", "float32", (64, 32), mesh, tuple(weight)))
        for kind in ("b", "exp_avg.b", "exp_avg_sq.b"):
            out.append(GlobalTensor(f"{i}.{kind}", "float32", (64,), mesh, tuple(bias)))
        out += [GlobalTensor(f"{i}.step.{k}", "float32", ()) for k in "wb"]
    return out


@pytest.mark.parametrize(
    ("name", "mesh_shape", "weight", "bias"),
    [
        ("fsdp2", (8,), [Shard(0)], [Shard(0)]),
        ("ddp", (8,), [Replicate()], [Replicate()]),
        ("hsdp 2x4", (2, 4), [Replicate(), Shard(0)], [Replicate(), Shard(0)]),
        ("tp 4x2, replicated bias", (4, 2), [Shard(0), Shard(1)], [Shard(0), Replicate()]),
        (
            "fsdp2 over tp 4x2",
            (4, 2),
            [_StridedShard(0, split_factor=2), Shard(0)],
            [_StridedShard(0, split_factor=2), Shard(0)],
        ),
    ],
)
def test_the_uniform_plan_is_plan_save_on_training_meshes(name, mesh_shape, weight, bias) -> None:
    mesh = torch.arange(8).reshape(mesh_shape)
    _assert_same_plan(_layers(6, mesh, weight, bias), 8)


def test_equal_replicated_items_tie_on_the_key_and_the_lowest_rank() -> None:
    # 24 step counters of one size on 5 ranks: only the keys and ranks order them
    tensors = [GlobalTensor(f"s{i}", "float32", ()) for i in range(24)]
    _assert_same_plan(tensors, 5)
    plan = plan_uniform(tensors, 5, "d")
    assert sorted(plan.rank_bytes) == [16, 20, 20, 20, 20]


def test_the_fingerprint_is_the_digest_and_world_size() -> None:
    tensors = [GlobalTensor("s", "float32", ())]
    a = plan_uniform(tensors, 2, "abc")
    assert a.fingerprint == plan_uniform(tensors, 2, "abc", ranks={1}).fingerprint
    assert a.fingerprint != plan_uniform(tensors, 2, "abd").fingerprint
    assert a.fingerprint != plan_uniform(tensors, 3, "abc").fingerprint
    assert len(a.fingerprint) == 64


def test_interleaving_strided_shards_and_bad_placements_are_refused() -> None:
    with pytest.raises(UnsupportedState, match="not one range"):
        shard_table((8,), (2, 2), [Shard(0), _StridedShard(0, split_factor=2)], path="w")
    with pytest.raises(UnsupportedState, match="shards dimension 2"):
        shard_table((8, 8), (2,), [Shard(2)], path="w")
    mesh = torch.arange(2)
    with pytest.raises(UnsupportedState, match="dtype"):
        plan_uniform([GlobalTensor("w", "no-such-dtype", (2,), mesh, (Shard(0),))], 2, "d")


def test_boxes_with_hundreds_of_holders_take_the_same_writers() -> None:
    # HSDP with 256 replicas of a 2-way shard: the least-loaded holder among 256 is found
    # with tensor ops, a run of one tensor's boxes at once, with the same ties
    rng = random.Random(5)
    mesh = torch.tensor(rng.sample(range(512), 512)).reshape(256, 2)
    tensors = [
        GlobalTensor(f"w{i}", "float32", (rng.randint(1, 9), 3), mesh, (Replicate(), Shard(0)))
        for i in range(12)
    ] + [GlobalTensor(f"s{i}", "float32", ()) for i in range(4)]
    _assert_same_plan(tensors, 512)


def _group_tensor(rng: random.Random, t: int, ranks: list[int]) -> GlobalTensor:
    """A random tensor of a group of ranks (a pipeline stage): a DTensor on a mesh of
    the group's ranks, or a plain tensor, some of them (``shared*``) in every group."""
    g = _plannable(rng, t, len(ranks))
    if g.mesh is None:
        if rng.random() < 0.5:  # also in the other groups, alike
            return GlobalTensor(f"shared{t % 3}", "float32", (t % 3 + 1, 2))
        return dataclasses.replace(g, path=f"{g.path}@{ranks[0]}")
    mesh = torch.tensor([ranks[r] for r in g.mesh.reshape(-1).tolist()]).reshape(g.mesh.shape)
    return GlobalTensor(f"{g.path}@{ranks[0]}", g.dtype, g.global_shape, mesh, g.placements)


def _round_trip(tensors: list[GlobalTensor]) -> list[GlobalTensor]:
    """Through the JSON description a group's lowest rank sends (write/sharded.py)."""
    meshes: list[torch.Tensor] = []
    records: list[list] = []
    for t in tensors:
        record: list = [t.path, t.dtype, list(t.global_shape)]
        if t.mesh is not None:
            meshes.append(t.mesh)
            record += [len(meshes) - 1, [encode_placement(p) for p in t.placements]]
        records.append(record)
    text = json.dumps({"meshes": [m.tolist() for m in meshes], "tensors": records})
    return decode_description(json.loads(text))


def test_grouped_descriptions_plan_as_plan_save_on_random_stages() -> None:
    """Pipeline-like jobs: the ranks fall into groups (stages), each with its own tensors
    on meshes of its own ranks, plain tensors shared by some groups; the combined
    description gives every box the writer ``plan_save`` gives it, the same bytes per
    rank, and the same node copies with homes that span groups."""
    rng = random.Random(23)
    for _ in range(120):
        world = rng.choice([2, 3, 4, 6, 8])
        ranks = list(range(world))
        rng.shuffle(ranks)
        cuts = sorted(rng.sample(range(1, world), rng.randint(1, min(3, world - 1))))
        parts = [ranks[a:b] for a, b in zip([0, *cuts], [*cuts, world], strict=True)]
        groups = []
        # a DTensor every group of one size holds on its own mesh (FSDP2 over TP's
        # parameters TP does not split): replicas across the groups
        size = rng.choice([len(p) for p in parts])
        common = _plannable(rng, 99, size) if rng.random() < 0.5 else None
        # and a DTensor on a mesh of every rank, which every group lists (FSDP2 over TP's
        # 2-D weights, when the groups differ by another tensor)
        wide = _plannable(rng, 98, world) if rng.random() < 0.5 else None
        for members in parts:
            tensors = [_group_tensor(rng, t, members) for t in range(rng.randint(0, 6))]
            if common is not None and common.mesh is not None and len(members) == size:
                own = [members[r] for r in common.mesh.reshape(-1).tolist()]
                mesh = torch.tensor(own).reshape(common.mesh.shape)
                tensors.append(dataclasses.replace(common, path="common", mesh=mesh))
            if wide is not None:
                tensors.append(dataclasses.replace(wide, path="wide"))
            unique = {t.path: t for t in tensors}  # a path once per state
            groups.append((sorted(members), _round_trip(list(unique.values()))))
        _assert_same_grouped_plan(groups, world, node=rng.choice([1, 2, 3]))


def test_a_plain_tensor_of_some_groups_is_held_by_their_ranks_only() -> None:
    a = GlobalTensor("a.w", "float32", (8,), torch.tensor([0, 1]), (Shard(0),))
    b = GlobalTensor("b.w", "float32", (8,), torch.tensor([2, 3]), (Shard(0),))
    s0, s1 = GlobalTensor("a.step", "float32", ()), GlobalTensor("b.step", "float32", ())
    epoch = GlobalTensor("epoch", "int64", ())
    out = combine([([0, 1], [a, s0, epoch]), ([2, 3], [b, s1, epoch])])
    held = {t.path: t.holders for t in out}
    assert held == {"a.w": None, "a.step": (0, 1), "epoch": None, "b.w": None, "b.step": (2, 3)}
    plan = plan_uniform(out, 4, "d")
    # each stage's counter is written by one of its own ranks, the shared one once
    assert plan.replicated[_key("a.step", (), ())] in (0, 1)
    assert plan.replicated[_key("b.step", (), ())] in (2, 3)
    assert sum(plan.rank_bytes) == 2 * 32 + 4 + 4 + 8


def test_descriptions_that_need_every_ranks_items_are_not_combined() -> None:
    mesh_a = torch.tensor([0, 1])
    tied_a = GlobalTensor("emb", "float32", (8, 2), mesh_a, (Shard(0),))
    other = GlobalTensor("emb", "float32", (8, 2), torch.tensor([2, 3, 4]), (Shard(0),))
    with pytest.raises(NotCombinable, match="emb: a DTensor of another dtype, shape, place"):
        combine([([0, 1], [tied_a]), ([2, 3, 4], [other])])  # boxes that overlap
    wide = GlobalTensor("w", "float32", (8,), torch.tensor([0, 1, 2, 3]), (Shard(0),))
    with pytest.raises(NotCombinable, match=r"w: its mesh holds ranks \[2, 3\]"):
        combine([([0, 1], [wide]), ([2, 3], [])])
    p1, p2 = GlobalTensor("s", "float32", (2,)), GlobalTensor("s", "float32", (3,))
    with pytest.raises(NotCombinable, match=r"s: float32\[2\] on some ranks, float32\[3\]"):
        combine([([0], [p1]), ([1], [p2])])
    with pytest.raises(NotCombinable, match="a DTensor on some ranks, plain on others"):
        combine([([0, 1], [tied_a]), ([2, 3], [GlobalTensor("emb", "float32", (8, 2))])])
    odd = {"meshes": [[0, 1]], "tensors": [["x", "float32", [4], 0, [["?", "Partial(sum)"]]]]}
    with pytest.raises(NotCombinable, match=r"x: placement \['\?', 'Partial\(sum\)'\]"):
        decode_description(odd)


def test_replicas_on_each_groups_own_mesh_combine_into_one_stacked_mesh() -> None:
    """FSDP2 over TP on a (dp=2, tp=2) mesh: a parameter TP does not split is a DTensor
    on each TP rank's own data-parallel mesh ([0, 2] and [1, 3]); the two groups' copies
    are replicas: one DTensor on the stacked meshes, Replicate() first, whose boxes are
    each held by a rank of each group and written once."""
    a = GlobalTensor("scale", "float32", (3,), torch.tensor([0, 2]), (Shard(0),))
    b = GlobalTensor("scale", "float32", (3,), torch.tensor([1, 3]), (Shard(0),))
    (out,) = combine([([0, 2], [a]), ([1, 3], [b])])
    assert out.mesh is not None and out.mesh.tolist() == [[0, 2], [1, 3]]
    assert out.placements == (Replicate(), Shard(0))
    _assert_same_grouped_plan([([0, 2], [a]), ([1, 3], [b])], 4, node=2)
    plan = plan_uniform([out], 4, "d")
    rows01 = plan.replicated[_key("scale", (0,), (2,))]
    assert rows01 in (0, 1) and plan.replicated[_key("scale", (2,), (1,))] in (2, 3)


def test_placements_survive_the_description() -> None:
    mesh = torch.arange(4).reshape(2, 2)
    t = GlobalTensor("w", "bfloat16", (9, 4), mesh, (_StridedShard(0, split_factor=2), Shard(0)))
    r = GlobalTensor("n", "float32", (4,), mesh, (Replicate(), Shard(0)))
    back = _round_trip([t, r, GlobalTensor("s", "int64", ())])
    assert [(x.path, x.dtype, x.global_shape, x.placements) for x in back] == [
        (y.path, y.dtype, y.global_shape, y.placements) for y in (t, r)
    ] + [("s", "int64", (), ())]
    assert back[0].mesh.tolist() == [[0, 1], [2, 3]] and back[2].mesh is None
    assert encode_placement(Shard(1)) == ["S", 1] and encode_placement(Replicate()) == "R"
