"""Which tier's assembly of a sharded step a Reader takes as its reference, and which
rank's tree it reads values from, when node-local tiers hold some ranks' parts only.

A sharded step of 4 ranks (two nodes of 2) is written by hand into node 1's tiers (a
host-memory area and a local directory, both plain directories here): DDP-like, ``w`` is
replicated, and node 1's copy of it is in rank 2's part (the node copy); each rank has a
rank-local tensor ``rng`` and a position ``pos`` of its own, and every rank saved the
same ``epoch``. One process, no process group: the Reader is given the tiers' manifests
as the restore gives them.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

from snapcore.errors import CorruptSnapshot, StateMismatch
from snapcore.read import Reader
from snapcore.tiers import LocalTier

STEP = 2
STEP_DIR = f"step-{STEP:012d}"
PLAN = "ab" * 32
W = torch.arange(12, dtype=torch.float32).reshape(4, 3)


class HostLike(LocalTier):
    """A directory standing for a node's host-memory area (the fastest tier)."""

    name = "host"


class PeerLike(LocalTier):
    """A directory standing for the copies a node holds of other nodes' parts (the peer
    tier, snapcore/peer)."""

    name = "peer"


def _rng(rank: int) -> torch.Tensor:
    return torch.full((2,), float(rank), dtype=torch.float64)


def _chunk(offset: int, data: bytes) -> dict[str, Any]:
    return {
        "file": 0,
        "offset": offset,
        "length": len(data),
        "raw_length": len(data),
        "codec": "none",
        "xxh3": xxhash.xxh3_128_hexdigest(data),
    }


def _part(rank: int, world: int, holds_w: bool, alike: bool) -> tuple[bytes, bytes]:
    """Rank ``rank``'s part (JSON) and data file: ``w`` whole when ``holds_w`` (else
    listed with no piece: another rank of its node wrote the node's copy), its ``rng``
    and ``pos`` (rank 0's values on every rank when ``alike``)."""
    own = 0 if alike else rank
    blobs, tensors, data = [], [], b""
    pieces = []
    if holds_w:
        raw = W.numpy().tobytes()
        blobs.append({"nbytes": len(raw), "element_size": 4, "chunks": [_chunk(0, raw)]})
        pieces = [
            {"offsets": [0, 0], "shape": [4, 3], "blob": 0, "byte_offset": 0, "strides": [3, 1]}
        ]
        data += raw
    tensors.append({"dtype": "float32", "shape": [4, 3], "pieces": pieces})
    raw = _rng(own).numpy().tobytes()
    blobs.append({"nbytes": len(raw), "element_size": 8, "chunks": [_chunk(len(data), raw)]})
    rng = {"offsets": [0], "shape": [2], "blob": len(blobs) - 1, "byte_offset": 0, "strides": [1]}
    tensors.append({"dtype": "float64", "shape": [2], "pieces": [rng]})
    data += raw
    part = {
        "format_version": 3,
        "kind": "snapcore.part",
        "rank": rank,
        "plan": PLAN,
        "structure": "cd" * 32,
        "keys": ["w", None],
        "step": STEP,
        "created_unix": 1700000000.0,
        "writer": {},
        "world_size": world,
        "rank_files": [[0]],
        "files": [{"name": f"{STEP_DIR}/data-r{rank}.bin", "size": len(data)}],
        "blobs": blobs,
        "tensors": tensors,
        "tree": {
            "dict": [
                ["w", {"tensor": 0}],
                ["rng", {"tensor": 1}],
                ["pos", {"int": 100 * own + 7}],
                ["epoch", {"int": 3}],
            ]
        },
    }
    return json.dumps(part).encode(), data


def _write(
    root: Path, world: int, ranks: list[int], w_by: dict[int, int], alike: bool = False
) -> LocalTier:
    """A node's tier at ``root`` holding the parts of ``ranks`` (of ``world``) and the
    step's index; ``w_by``: which rank wrote ``w`` for each rank's node (its node copy)."""
    step = root / STEP_DIR
    step.mkdir(parents=True)
    refs = []
    for r in range(world):
        part, data = _part(r, world, w_by[r] == r, alike)
        name = f"{STEP_DIR}/part-{r:05d}-0123456789ab.json"
        refs.append(
            {"rank": r, "name": name, "size": len(part), "xxh3": xxhash.xxh3_128_hexdigest(part)}
        )
        if r in ranks:
            (root / name).write_bytes(part)
            (step / f"data-r{r}.bin").write_bytes(data)
    index = {
        "format_version": 3,
        "kind": "snapcore.snapshot",
        "step": STEP,
        "created_unix": 1700000000.0,
        "writer": {},
        "world_size": world,
        "plan": PLAN,
        "parts": refs,
    }
    (step / "manifest.json").write_text(json.dumps(index))
    return {"host": HostLike, "peer": PeerLike}.get(root.name, LocalTier)(root)


NODE1 = {0: 0, 1: 0, 2: 2, 3: 2}  # two nodes of 2 ranks: ranks 0 and 2 wrote their node's w


def _node1(tmp_path: Path, host: list[int], local: list[int]) -> Reader:
    """A reader of node 1's host area and directory (holding the parts of ``host`` and
    ``local``), fastest first, as restore opens it."""
    tiers = [_write(tmp_path / "host", 4, host, NODE1), _write(tmp_path / "local", 4, local, NODE1)]
    return Reader([(t, t.read_manifest(STEP)) for t in tiers])


def _values(tree: Any) -> dict[str, Any]:
    return {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in tree.items()}


def _own(rank: int) -> dict[str, Any]:
    return {"w": W.tolist(), "rng": _rng(rank).tolist(), "pos": 100 * rank + 7, "epoch": 3}


# -- D1: a part missing from the fastest tier -----------------------------------------------
@pytest.mark.parametrize("rank", [2, 3])
def test_a_part_missing_from_the_host_area_is_read_from_the_directory(
    tmp_path: Path, rank: int
) -> None:
    """Node 1's host area lost rank 3's part, its directory holds both: each of its ranks
    restores its own tree (rank 3's from the directory), the replicated w still read
    from host memory where it is there."""
    reader = _node1(tmp_path, host=[2], local=[2, 3])
    reader.select(rank, 4)
    assert _values(reader.load_tree()) == _own(rank)
    assert reader.tier == ("host+local" if rank == 3 else "host"), reader.tier


def test_the_reference_is_the_copy_holding_the_most_parts(tmp_path: Path) -> None:
    """The host area lost rank 2's part, which holds the node's copy of w: rank 3's part
    is there, but w's pieces are only in the directory's copy, which both ranks read as
    their reference (rank 3's rng still comes from host memory)."""
    for rank in (2, 3):
        reader = _node1(tmp_path / str(rank), host=[3], local=[2, 3])
        reader.select(rank, 4)
        assert _values(reader.load_tree()) == _own(rank)
        assert reader.tier == ("host+local" if rank == 3 else "local"), reader.tier


def test_two_tiers_that_lost_different_parts_say_where_each_part_is(tmp_path: Path) -> None:
    """The host area lost rank 3's part and the directory rank 2's (with w): rank 2 reads
    all it needs from host memory; rank 3 needs both parts, which no tier holds
    together, and the error says which part is where."""
    reader = _node1(tmp_path / "2", host=[2], local=[3])
    reader.select(2, 4)
    assert _values(reader.load_tree()) == _own(2)
    reader = _node1(tmp_path / "3", host=[2], local=[3])
    reader.select(3, 4)
    with pytest.raises(CorruptSnapshot) as e:
        reader.load_tree()
    assert "the part of rank(s) 0, 1 (" in str(e.value), e.value
    assert "rank(s) 2 is only in other tiers than the local tier's copy" in str(e.value), e.value
    reader = _node1(tmp_path / "none", host=[2], local=[2])
    with pytest.raises(CorruptSnapshot, match="rank 3's part is in none of the tiers read here"):
        reader.select(3, 4)


def test_load_of_a_rank_reads_its_tree_from_the_tier_that_holds_it(tmp_path: Path) -> None:
    reader = _node1(tmp_path, host=[2], local=[2, 3])
    reader.select_rank_tree(3)
    assert _values(reader.load_tree()) == _own(3)


# -- D2: a world-size change, or a load, from a node that does not hold rank 0's part ------
def test_a_world_size_change_from_node_local_tiers_takes_the_lowest_rank_at_hand(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Restored by 2 ranks, node 1's new rank takes what ranks 2 and 3 saved alike (w and
    epoch) with rank_local="keep" and keeps its own rng and pos; a warning says that the
    values were compared among the ranks at hand only."""
    reader = _node1(tmp_path, host=[2, 3], local=[2, 3])
    with caplog.at_level(logging.WARNING, logger="snapcore.read"):
        reader.select(1, 2, "keep", lambda: frozenset({"w"}))
    assert _values(reader.load_tree()) == {"w": W.tolist(), "epoch": 3}
    assert reader.dropped == {"rng", "pos"}
    assert "ranks 0, 1" in caplog.text and "compared among ranks 2, 3" in caplog.text


def test_a_world_size_change_refuses_values_it_cannot_compare_unless_kept(tmp_path: Path) -> None:
    """Saved by two nodes of one rank each, restored by one rank from node 1's directory:
    rank 1's values cannot be compared with rank 0's, which is not at hand, so that without
    rank_local="keep" the step cannot be restored here (CorruptSnapshot, as for a missing
    piece: every rank skips it), saying why; with it, rank 1's values are taken (the
    only ones at hand)."""
    one_each = {0: 0, 1: 1}
    tier = _write(tmp_path / "local", 2, [1], one_each)
    reader = Reader([(tier, tier.read_manifest(STEP))])
    with pytest.raises(CorruptSnapshot, match=r"rank\(s\) 0 \(.*part-00000-.*rank_local='keep'"):
        reader.select(0, 1)
    reader = Reader([(tier, tier.read_manifest(STEP))])
    reader.select(0, 1, "keep")
    assert _values(reader.load_tree()) == _own(1)


def test_load_of_a_node_directory_without_rank_0_takes_its_lowest_rank(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """load() of node 1's directory alone: full tensors, and rank 2's values, said."""
    tier = _write(tmp_path / "local", 4, [2, 3], NODE1)
    reader = Reader([(tier, tier.read_manifest(STEP))])
    with caplog.at_level(logging.WARNING, logger="snapcore.read"):
        reader.select(None, 1)
    assert _values(reader.load_tree()) == _own(2)
    assert "loading rank 2's" in caplog.text


def test_a_world_size_change_with_every_part_at_hand_is_unchanged(tmp_path: Path) -> None:
    """With every rank's part (one directory shared by all), rank 0's tree is taken and
    the ranks' different values refuse, or are kept, as before."""
    everyone = {0: 0, 1: 0, 2: 0, 3: 0}
    tier = _write(tmp_path / "local", 4, [0, 1, 2, 3], everyone)
    with pytest.raises(StateMismatch, match=r"different values of pos, rng") as e:
        Reader([(tier, tier.read_manifest(STEP))]).select(0, 2)
    assert "not in" not in str(e.value)
    reader = Reader([(tier, tier.read_manifest(STEP))])
    reader.select(0, 2, "keep")
    assert _values(reader.load_tree()) == {"w": W.tolist(), "epoch": 3}


@pytest.mark.parametrize("alike", [True, False])
def test_a_world_size_change_compares_the_values_of_parts_in_any_tier(
    tmp_path: Path, alike: bool
) -> None:
    """Node 1's host area holds ranks 2 and 3, the peer tier its copies of ranks 0 and 1
    (their partners'): every rank's values are at hand, compared across the tiers. Saved
    alike, they restore without rank_local="keep"; rank 0's own differ, and are named."""
    tiers = [
        _write(tmp_path / "host", 4, [2, 3], NODE1, alike),
        _write(tmp_path / "peer", 4, [0, 1], NODE1, alike),
    ]
    reader = Reader([(t, t.read_manifest(STEP)) for t in tiers])
    if not alike:
        with pytest.raises(StateMismatch, match="different values of pos, rng"):
            reader.select(1, 2)
        return
    reader.select(1, 2)
    assert _values(reader.load_tree()) == _own(0)
    assert reader.tier == "host"
    # the host area alone: ranks 0 and 1 are not at hand to compare with
    reader = Reader([(tiers[0], tiers[0].read_manifest(STEP))])
    with pytest.raises(CorruptSnapshot, match=r"rank\(s\) 0, 1 \(.*\) is in none of the tiers"):
        reader.select(1, 2)
