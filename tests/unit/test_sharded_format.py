"""Format 3 without a store: parse_any on an index, parse_part on a part, read_sharded and
merge on parts in memory (the hostile stores are in tests/integration/hostile/corpus.py).
Every hostile input raises InvalidManifest naming the file."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import xxhash

from snapcore import manifest as mf
from snapcore.assemble import _check_tiling, merge_trees, read_sharded
from snapcore.errors import InvalidManifest
from snapcore.tiers import RemoteStoreTier

STEP = 7
STEP_DIR = f"step-{STEP:012d}"
WHERE = f"/s/{STEP_DIR}/manifest.json"
PLAN = "ab" * 32


def _name(rank: int) -> str:
    return f"{STEP_DIR}/part-{rank:05d}-0123456789ab.json"


def _part(rank: int, first: int, rows: int) -> dict[str, Any]:
    """Rank ``rank``'s part: rows [first, first + rows) of global w [3, 4] float32, and a
    rank-local b [2] float64."""
    return {
        "format_version": 3,
        "kind": "snapcore.part",
        "rank": rank,
        "plan": PLAN,
        "structure": "cd" * 32,
        "keys": ["w", None],
        "step": STEP,
        "created_unix": 1700000000.0,
        "writer": {},
        "world_size": 2,
        "rank_files": [[0]],
        "files": [{"name": f"{STEP_DIR}/data-r{rank}.bin", "size": 128}],
        "blobs": [
            {"nbytes": 16 * rows, "element_size": 4, "chunks": [_chunk(0, 16 * rows)]},
            {"nbytes": 16, "element_size": 8, "chunks": [_chunk(64, 16)]},
        ],
        "tensors": [
            {"dtype": "float32", "shape": [3, 4], "pieces": [_piece([first, 0], [rows, 4], 0)]},
            {"dtype": "float64", "shape": [2], "pieces": [_piece([0], [2], 1)]},
        ],
        "tree": {"dict": [["w", {"tensor": 0}], ["b", {"tensor": 1}], ["n", {"int": rank}]]},
    }


def _chunk(offset: int, n: int) -> dict[str, Any]:
    return {
        "file": 0,
        "offset": offset,
        "length": n,
        "raw_length": n,
        "codec": "none",
        "xxh3": "0" * 32,
    }


def _piece(offsets: list[int], shape: list[int], blob: int) -> dict[str, Any]:
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    return {"offsets": offsets, "shape": shape, "blob": blob, "byte_offset": 0, "strides": strides}


def _store(parts: list[dict[str, Any] | bytes]) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The index (JSON) of ``parts`` and the files by name."""
    files = {}
    refs = []
    for rank, p in enumerate(parts):
        data = p if isinstance(p, bytes) else json.dumps(p).encode()
        files[_name(rank)] = data
        refs.append({"rank": rank, "name": _name(rank), "size": len(data), "xxh3": _xxh3(data)})
    index = {
        "format_version": 3,
        "kind": "snapcore.snapshot",
        "step": STEP,
        "created_unix": 1700000000.0,
        "writer": {},
        "world_size": len(refs),
        "plan": PLAN,
        "parts": refs,
    }
    return index, files


def _xxh3(data: bytes) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def _valid() -> tuple[dict[str, Any], dict[str, bytes]]:
    return _store([_part(0, 0, 2), _part(1, 2, 1)])


def _read(
    index: dict[str, Any] | bytes, files: dict[str, bytes], partial: bool = False
) -> mf.Manifest:
    data = index if isinstance(index, bytes) else json.dumps(index).encode()
    doc = mf.parse_any(data, where=WHERE)
    assert isinstance(doc, mf.Index)
    return read_sharded(doc, lambda name, size: files.get(name), where=WHERE, partial=partial)


def test_the_valid_store_assembles():
    m = _read(*_valid())
    assert [t.shape for t in m.tensors] == [(3, 4), (2,), (2,)]  # w, then each rank's b
    assert [p.offsets for p in m.tensors[0].pieces] == [(0, 0), (2, 0)]
    assert m.rank_trees is not None and m.rank_trees[1] == {
        "dict": [["w", {"tensor": 0}], ["b", {"tensor": 2}], ["n", {"int": 1}]]
    }
    assert m.part_files == [_name(0), _name(1)] and not m.missing_ranks


# -- the index -------------------------------------------------------------------------------
def _index(**fields: Any) -> dict[str, Any]:
    index, _ = _valid()
    return {**index, **fields}


def _ref(at: int, /, **fields: Any) -> dict[str, Any]:
    index, _ = _valid()
    index["parts"][at].update(fields)
    return index


INDEX_REFUSED = [
    ("other-step-dir", _ref(1, name=f"step-{STEP + 1:012d}/part-00001-x.json"), "parts[1].name"),
    ("dotdot", _ref(1, name=f"{STEP_DIR}/../{STEP_DIR}/part-00001-x.json"), "parts[1].name"),
    ("dot", _ref(1, name=f"{STEP_DIR}/./part-00001-x.json"), "parts[1].name"),
    ("absolute", _ref(1, name=f"/{STEP_DIR}/part-00001-x.json"), "parts[1].name"),
    ("store-root", _ref(1, name="part-00001-x.json"), "parts[1].name"),
    ("step-dir-prefix", _ref(1, name=f"{STEP_DIR}0/part-00001-x.json"), "parts[1].name"),
    ("name-not-str", _ref(1, name=5), "parts[1].name"),
    ("size-64MiB+1", _ref(1, size=(64 << 20) + 1), "parts[1].size"),
    ("size-negative", _ref(1, size=-1), "parts[1].size"),
    ("size-float", _ref(1, size=10.0), "parts[1].size"),
    ("xxh3-upper", _ref(1, xxh3="A" * 32), "parts[1].xxh3"),
    ("xxh3-short", _ref(1, xxh3="0" * 31), "parts[1].xxh3"),
    ("rank-bool", _ref(0, rank=False), "parts[0].rank"),
    ("rank-order", _ref(0, rank=1), "parts[0].rank"),
    ("extra-key", _ref(0, extra=1), "parts[0]"),
    ("world-size-3", _index(world_size=3), "parts: must list one part per rank"),
    ("world-size-1", _index(world_size=1), "parts: must list one part per rank"),
    ("world-size-0", _index(world_size=0, parts=[]), "world_size"),
    ("world-size-2^40", _index(world_size=1 << 40), "world_size"),
    ("world-size-true", _index(world_size=True), "world_size"),
    ("plan", _index(plan="x"), "plan"),
    ("parts-object", _index(parts={}), "parts"),
    ("created-nan-string", _index(created_unix="nan"), "created_unix"),
    ("writer-list", _index(writer=[]), "writer"),
    ("extra-top-key", _index(extra=1), "must not contain"),
]


@pytest.mark.parametrize(("case", "index", "message"), INDEX_REFUSED, ids=lambda v: str(v)[:30])
def test_index_refused(case, index, message):
    with pytest.raises(InvalidManifest, match=f"^{WHERE}: ") as e:
        mf.parse_any(json.dumps(index).encode(), where=WHERE)
    assert message in str(e.value)


def test_index_parts_out_of_rank_order():
    index, _ = _valid()
    index["parts"].reverse()
    with pytest.raises(InvalidManifest, match=r"parts\[0\]\.rank: must be 0"):
        mf.parse_any(json.dumps(index).encode(), where=WHERE)


def test_index_two_parts_name_one_file():
    index = _ref(1, name=_name(0))
    with pytest.raises(InvalidManifest, match=f"{WHERE}: two parts name the same file"):
        mf.parse_any(json.dumps(index).encode(), where=WHERE)


def test_index_duplicate_json_key():
    data = json.dumps(_index()).encode().replace(b'"step": 7', b'"step": 7, "step": 8', 1)
    with pytest.raises(InvalidManifest, match=f"{WHERE}: not valid JSON: duplicate key"):
        mf.parse_any(data, where=WHERE)


def test_index_of_a_million_parts_is_refused_by_its_size_or_quickly():
    """1M parts (MAX_PARTS) do not fit in the 64 MiB cap; 2^20 + 1 are refused by count."""
    index = _index(world_size=mf.MAX_PARTS + 1)
    index["parts"] = [index["parts"][0]] * 3
    with pytest.raises(InvalidManifest, match="world_size: must be 1 to"):
        mf.parse_any(json.dumps(index).encode(), where=WHERE)
    ref = _valid()[0]["parts"][0]
    big = _index(world_size=mf.MAX_PARTS)
    big["parts"] = [{**ref, "rank": r, "name": _name(r)} for r in range(mf.MAX_PARTS)]
    data = json.dumps(big).encode()
    assert len(data) > mf.MAX_MANIFEST_BYTES
    t0 = time.monotonic()
    with pytest.raises(InvalidManifest, match="exceeds the 64 MiB cap"):
        mf.parse_any(data, where=WHERE)
    assert time.monotonic() - t0 < 1


@pytest.mark.parametrize(
    ("kind", "message"),
    [("snapcore.part", "is a part of a sharded snapshot"), ("x", "is not a snapshot")],
)
def test_index_of_another_kind(kind, message):
    with pytest.raises(InvalidManifest, match=f"{WHERE}: kind '{kind}' {message}"):
        mf.parse_any(json.dumps(_index(kind=kind)).encode(), where=WHERE)


def test_a_part_passed_as_manifest():
    _, files = _valid()
    with pytest.raises(InvalidManifest, match=f"{WHERE}: kind 'snapcore.part' is a part"):
        mf.parse_any(files[_name(0)], where=WHERE)
    with pytest.raises(InvalidManifest, match="format_version 3 is not supported here"):
        mf.parse(files[_name(0)], where=WHERE)


def test_an_index_passed_as_part():
    index, _ = _valid()
    with pytest.raises(InvalidManifest, match=r"p\.json: not a part of a sharded snapshot"):
        mf.parse_part(json.dumps(index).encode(), where="p.json")


# -- the part files against the index --------------------------------------------------------
PART1 = f"/s/{_name(1)}"


def test_a_part_whose_size_differs():
    index, files = _valid()
    files[_name(1)] += b" "
    with pytest.raises(InvalidManifest, match=f"^{PART1}: part of .* bytes, the index says"):
        _read(index, files)


def test_a_part_whose_xxh3_differs():
    index, files = _valid()
    files[_name(1)] = files[_name(1)].replace(b'"n"', b'"m"')
    with pytest.raises(InvalidManifest, match=f"^{PART1}: part's xxh3 is"):
        _read(index, files)


def test_a_missing_part():
    index, files = _valid()
    del files[_name(1)]
    with pytest.raises(InvalidManifest, match=f"^{PART1}: the part is missing"):
        _read(index, files)
    m = _read(index, files, partial=True)  # a node-local tier: its own ranks' parts only
    assert m.missing_ranks == [1] and m.missing_parts == [PART1]
    assert m.rank_trees is not None and m.rank_trees[1] is None


def test_every_part_missing_in_a_partial_tier():
    index, _ = _valid()
    with pytest.raises(InvalidManifest, match="none of the step's parts"):
        _read(index, {}, partial=True)


def test_remote_part_of_another_size_is_refused_before_it_is_read():
    class Remote:
        url = "s3://b/p"

        def size(self, name: str) -> int | None:
            return {_name(1): 1 << 40}.get(name)

        def read_bytes(self, name: str) -> bytes:
            raise AssertionError("read")

    tier = object.__new__(RemoteStoreTier)
    tier.rt = Remote()  # type: ignore[attr-defined]
    assert tier._read_part(_name(0), 10) is None
    with pytest.raises(InvalidManifest, match=f"s3://b/p/{_name(1)}: part of 1099511627776"):
        tier._read_part(_name(1), 10)


def _with_part(rank: int, part: dict[str, Any] | bytes) -> tuple[dict[str, Any], dict[str, bytes]]:
    parts: list[dict[str, Any] | bytes] = [_part(0, 0, 2), _part(1, 2, 1)]
    parts[rank] = part
    return _store(parts)


def _part1(path: str, value: Any) -> dict[str, Any]:
    part = _part(1, 2, 1)
    *head, last = path.split(".")
    obj: Any = part
    for k in head:
        obj = obj[int(k)] if isinstance(obj, list) else obj[k]
    obj[int(last) if isinstance(obj, list) else last] = value
    return part


PART_REFUSED = [
    ("world-size", _part1("world_size", 3), "another save plan or world size"),
    ("plan", _part1("plan", "ef" * 32), "another save plan or world size"),
    ("rank", _part1("rank", 0), "not rank 1's part of step 7"),
    ("rank-2^40", _part1("rank", 1 << 40), "rank: must be an integer"),
    ("rank-bool", _part1("rank", True), "rank: must be an integer"),
    ("step", _part1("step", 8), "not rank 1's part of step 7"),
    ("structure", _part1("structure", 5), "structure: not a fingerprint"),
    ("kind", _part1("kind", "snapcore.snapshot"), "not a part of a sharded snapshot"),
    ("version-2", _part1("format_version", 2), "not a part of a sharded snapshot"),
    ("keys-short", _part1("keys", ["w"]), "1 keys for 2 tensors"),
    ("keys-long", _part1("keys", ["w", None, "x"]), "3 keys for 2 tensors"),
    ("keys-int", _part1("keys", [1, None]), "keys: strings or nulls"),
    ("keys-nested", _part1("keys", [["w"], None]), "keys: strings or nulls"),
    ("keys-object", _part1("keys", {"w": None}), "keys: strings or nulls"),
    ("keys-huge", _part1("keys", ["w" * 5000, None]), "keys: a key is too long"),
    ("piece-outside", _part1("tensors.0.pieces.0.offsets", [3, 0]), "piece lies outside"),
    ("piece-rank", _part1("tensors.0.pieces.0.offsets", [2]), "piece rank does not match"),
    ("tree-tensor-2", _part1("tree.dict.0.1.tensor", 2), "tree references tensor 2 of 2"),
    ("tree-tensor-neg", _part1("tree.dict.0.1.tensor", -1), "tree references tensor -1"),
    ("no-pieces-key", _part1("tensors.1.pieces", None), "pieces: must be a non-empty array"),
]


@pytest.mark.parametrize(("case", "part", "message"), PART_REFUSED, ids=lambda v: str(v)[:20])
def test_part_refused(case, part, message):
    with pytest.raises(InvalidManifest, match=f"^{PART1}: ") as e:
        _read(*_with_part(1, part))
    assert message in str(e.value)


@pytest.mark.parametrize("field", ["rank", "plan", "structure", "keys"])
def test_part_without_its_fields(field):
    part = _part(1, 2, 1)
    del part[field]
    with pytest.raises(InvalidManifest, match=f"^{PART1}: .*{field} is missing"):
        _read(*_with_part(1, part))


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"[]",
        b"{",
        b"\xef\xbb\xbf{}",
        json.dumps(_part(1, 2, 1)).encode().replace(b'"rank": 1', b'"rank": 1, "rank": 0', 1),
    ],
)
def test_part_not_json_or_duplicate_key(data):
    with pytest.raises(InvalidManifest, match=f"^{PART1}: "):
        _read(*_with_part(1, data))


# -- merging: the parts must agree and tile each tensor ----------------------------------------
def test_parts_disagree_on_dtype_or_shape():
    for path, value in [("tensors.0.dtype", "int32"), ("tensors.0.shape", [4, 4])]:
        with pytest.raises(InvalidManifest, match=f"^{PART1}: w: rank 1 saved"):
            _read(*_with_part(1, _part1(path, value)))


def test_parts_disagree_on_a_shared_file_size():
    part = _part1("files.0", {"name": f"{STEP_DIR}/data-r0.bin", "size": 256})
    with pytest.raises(InvalidManifest, match=f"^{PART1}: rank 1 says .*data-r0.bin has 256"):
        _read(*_with_part(1, part))


@pytest.mark.parametrize(
    ("first", "rows", "message"),
    [
        (1, 1, "two saved pieces overlap"),  # 12 elements held, rows 1 twice, row 2 never
        (1, 2, "hold 16 of the 12 elements"),
        (2, 0, "hold 8 of the 12 elements"),
    ],
)
def test_pieces_overlap_or_leave_a_gap(first, rows, message):
    part = _part(1, first, rows)
    part["blobs"][0] = {"nbytes": 32, "element_size": 4, "chunks": [_chunk(0, 32)]}
    with pytest.raises(InvalidManifest, match=f"^{WHERE}: w: .*{message}"):
        _read(*_with_part(1, part))


def test_a_rank_local_tensor_without_a_piece():
    part = _part1("tensors.1.pieces", [])
    with pytest.raises(InvalidManifest, match=f"^{WHERE}: <rank-local tensor 2>: .* hold 0 of"):
        _read(*_with_part(1, part))
    # even when another rank's part is missing (a node-local tier)
    index, files = _store([_part(0, 0, 2), _part1("tensors.1.pieces", []), _part(1, 2, 1)])
    index["parts"][2]["name"] = f"{STEP_DIR}/part-00002-x.json"
    for p in (0, 1):
        files[_name(p)] = json.dumps({**json.loads(files[_name(p)]), "world_size": 3}).encode()
        index["parts"][p].update(size=len(files[_name(p)]), xxh3=_xxh3(files[_name(p)]))
    with pytest.raises(InvalidManifest, match=r"<rank-local tensor 2>: .* hold 0 of"):
        _read(index, files, partial=True)


def test_a_global_tensor_without_a_piece_on_some_rank_is_fine():
    part = _part1("tensors.0.pieces", [])
    p0 = _part(0, 0, 3)
    p0["blobs"][0] = {"nbytes": 48, "element_size": 4, "chunks": [_chunk(0, 48)]}
    m = _read(*_store([p0, part]))
    assert len(m.tensors[0].pieces) == 1


def test_a_key_shared_by_a_rank_local_tensor_index_is_not_confused():
    """A rank-local tensor (key null) of one rank and the global w stay apart."""
    m = _read(*_valid())
    assert m.tensors[1] is not m.tensors[2]


# -- cost: what a hostile part can make the reader do ------------------------------------------
def _tensor(shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]):
    return mf.TensorEntry("float32", shape, [mf.Piece(o, s, 0, 0, (0,) * len(s)) for o, s in boxes])


def test_tiling_check_is_linear_for_a_hostile_layout():
    """One huge piece and many tiny ones: an overlap query per piece scanned back over
    every piece (quadratic: hours for the 800k pieces a 64 MiB part holds)."""
    n, big = 200_000, 1 << 40
    t = _tensor((big + n,), [((0,), (big,))] + [((big + i,), (1,)) for i in range(n)])
    t0 = time.monotonic()
    _check_tiling(t, "k", "w")
    assert time.monotonic() - t0 < 5


def test_tiling_check_of_a_grid_and_of_an_irregular_layout():
    grid = [((i * 2, j * 3), (2, 3)) for i in range(100) for j in range(100)]
    _check_tiling(_tensor((200, 300), grid), "k", "w")
    overlapping = [*grid[:-1], ((198, 296), (2, 3))]  # overlaps its left neighbour
    with pytest.raises(InvalidManifest, match="w: k: two saved pieces overlap"):
        _check_tiling(_tensor((200, 300), overlapping), "k", "w", whole=False)
    bricks = [((r, c * 2 + r % 2), (1, 2)) for r in range(4) for c in range(50)]  # staggered
    _check_tiling(_tensor((4, 102), bricks), "k", "w", whole=False)
    # n pieces cutting a 2-D tensor into n^2 / 4 cells: refused, not checked at that cost
    n = 2000
    diag = [((i, i), (1, 1)) for i in range(n)]
    with pytest.raises(InvalidManifest, match=r"w: k: 2000 pieces cut the tensor into \d+ cells"):
        _check_tiling(_tensor((n, n), diag), "k", "w", whole=False)


@pytest.mark.parametrize("depth", [300, 480, 900, 3000])
def test_a_deep_tree_in_a_part_is_refused_or_read(depth):
    """JSON nesting near the recursion limit: parsed (the merge renumbers it) or refused
    as InvalidManifest, never RecursionError."""
    part = _part(1, 2, 1)
    part["tree"] = "TREE"
    tree = '{"list": [' * depth + '{"int": 0}' + "]}" * depth
    data = json.dumps(part).encode().replace(b'"TREE"', tree.encode())
    try:
        _read(*_with_part(1, data))
    except InvalidManifest as e:
        assert str(e).startswith(f"{PART1}: ")


def test_merged_trees_hold_every_stages_entries_and_the_first_value():
    """Pipeline stages' trees (assemble.merge_trees): the union of their dict entries and
    of the entries of one object saved through state_dict(), recursively; where two
    trees differ at one path, the first's value."""

    def d(*items: Any) -> dict[str, Any]:
        return {"dict": [list(x) for x in items]}

    def app(model: dict[str, Any]) -> dict[str, Any]:
        return {"stateful": {"type": "AppState", "state": d(["model", model])}}

    stage0 = d(["app", app(d(["s0.w", {"tensor": 0}]))], ["step", {"int": 5}])
    stage1 = d(["app", app(d(["s1.w", {"tensor": 1}]))], ["step", {"int": 6}], ["x", {"int": 1}])
    merged = merge_trees([stage0, stage1])
    assert merged == d(
        ["app", app(d(["s0.w", {"tensor": 0}], ["s1.w", {"tensor": 1}]))],
        ["step", {"int": 5}],
        ["x", {"int": 1}],
    )
    other = {"stateful": {"type": "Other", "state": d(["s1.w", {"tensor": 1}])}}
    assert merge_trees([stage0, d(["app", other])]) == stage0  # another kind: the first's
    assert merge_trees([stage1]) == stage1
