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
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

from snapcore.errors import CorruptSnapshot
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
