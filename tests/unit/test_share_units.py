"""Which rank of a node reads each unit a restore shares (read.assign_units): the same
answer on every rank, a reader among the ranks that need the unit, balanced by bytes.
(Nothing is shared across nodes: a node's ranks exchange their units on the node's
group only, tests/multiproc/test_sharded.py.)"""

from __future__ import annotations

from snapcore.read import _unit_name, assign_units
from snapcore.sharding import Box


def test_a_unit_some_ranks_of_a_node_need_is_read_by_one_of_them() -> None:
    # HSDP on a 2x2 mesh in one node: shard a is held by ranks 0 and 2, b by 1 and 3;
    # the step counter "s" by all four; rank 3 alone holds "own"
    needs = {
        0: {"a": 400, "s": 8},
        1: {"b": 400, "s": 8},
        2: {"a": 400, "s": 8},
        3: {"b": 400, "s": 8, "own": 1000},
    }
    share = assign_units(needs)
    assert assign_units(dict(reversed(needs.items()))) == share  # in any order: the same
    assert "own" not in share  # one rank needs it: not shared
    assert share["a"] == (0, [0, 2]) and share["b"] == (1, [1, 3])
    assert share["s"][1] == [0, 1, 2, 3] and share["s"][0] == 2  # the least loaded


def test_readers_are_balanced_by_bytes_largest_first() -> None:
    need = {"big": 1000, "mid": 600, "small": 500, "tiny": 100}
    share = assign_units({4: need, 5: need})  # ranks 4 and 5: a second node's
    readers = {n: r for n, (r, _) in share.items()}
    assert readers == {"big": 4, "mid": 5, "small": 5, "tiny": 4}


def test_nothing_in_common_shares_nothing() -> None:
    assert assign_units({0: {"x": 64}, 1: {"y": 64}}) == {}
    assert assign_units({0: {"x": 64}}) == {}


def test_a_box_is_named_by_its_offsets_and_shape() -> None:
    assert _unit_name("kapp.w", Box((4, 0), (4, 24))) == "kapp.w@4,0+4,24"
    assert _unit_name("kapp.w", Box((0, 0), (4, 24))) != _unit_name("kapp.w", Box((4, 0), (4, 24)))
