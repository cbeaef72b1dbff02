"""Which rank of a node reads each unit a restore shares (read.assign_units): the same
answer on every rank, a reader among the ranks that need the unit, balanced by bytes,
and nothing shared across nodes."""

from __future__ import annotations

from typing import Any

from snapcore.read import _unit_name, assign_units
from snapcore.sharding import Box


def said(node: str, need: dict[str, int]) -> dict[str, Any]:
    return {"node": [node, "/dir", None], "need": need}


def test_a_unit_some_ranks_of_a_node_need_is_read_by_one_of_them() -> None:
    # HSDP on a 2x2 mesh in one node: shard a is held by ranks 0 and 2, b by 1 and 3;
    # the step counter "s" by all four; rank 3 alone holds "own"
    every = [
        said("n0", {"a": 400, "s": 8}),
        said("n0", {"b": 400, "s": 8}),
        said("n0", {"a": 400, "s": 8}),
        said("n0", {"b": 400, "s": 8, "own": 1000}),
    ]
    answers = [assign_units(every, r) for r in range(4)]
    assert all(a == answers[0] for a in answers)  # every rank computes the same
    nodes, share = answers[0]
    assert nodes == [[0, 1, 2, 3]]
    assert share is not None and "own" not in share  # one rank needs it: not shared
    assert share["a"] == (0, [0, 2]) and share["b"] == (1, [1, 3])
    assert share["s"][1] == [0, 1, 2, 3] and share["s"][0] == 2  # the least loaded


def test_readers_are_balanced_by_bytes_largest_first() -> None:
    need = {"big": 1000, "mid": 600, "small": 500, "tiny": 100}
    every = [said("n0", need), said("n0", need)]
    _, share = assign_units(every, 0)
    assert share is not None
    readers = {n: r for n, (r, _) in share.items()}
    assert readers == {"big": 0, "mid": 1, "small": 1, "tiny": 0}


def test_nothing_is_shared_across_nodes() -> None:
    # two nodes of 2 ranks; "x" is needed by rank 0 and rank 2 only (different nodes)
    every = [
        said("n0", {"x": 64, "r": 8}),
        said("n0", {"r": 8}),
        said("n1", {"x": 64, "r": 8}),
        said("n1", {"r": 8}),
    ]
    nodes, share0 = assign_units(every, 0)
    _, share2 = assign_units(every, 2)
    assert nodes == [[0, 1], [2, 3]]
    assert share0 == {"r": (0, [0, 1])} and share2 == {"r": (2, [2, 3])}


def test_no_node_shares_anything() -> None:
    every = [said("n0", {"x": 64}), said("n1", {"x": 64})]  # a rank per node
    assert assign_units(every, 0) == ([[0], [1]], None)
    every = [said("n0", {"x": 64}), said("n0", {"y": 64})]  # nothing in common
    assert assign_units(every, 1) == ([[0, 1]], None)


def test_a_box_is_named_by_its_offsets_and_shape() -> None:
    assert _unit_name("kapp.w", Box((4, 0), (4, 24))) == "kapp.w@4,0+4,24"
    assert _unit_name("kapp.w", Box((0, 0), (4, 24))) != _unit_name("kapp.w", Box((4, 0), (4, 24)))
