"""A fuzzer over the manifest parser: mutations of a valid manifest, of its JSON structure
and of its bytes, either parse to a Manifest (whose tree then builds) or raise
InvalidManifest; never another exception. Brief and deterministic (derandomize) so that
`make test` runs it every time without flaking; raise max_examples locally to hunt."""

from __future__ import annotations

import json
from typing import Any

import fastjsonschema
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from snapcore import manifest as mf
from snapcore.errors import InvalidManifest
from snapcore.tree import build

FUZZ = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _chunk(file: int, offset: int, n: int, codec: str = "none", raw: int | None = None) -> dict:
    return {
        "file": file,
        "offset": offset,
        "length": n,
        "raw_length": n if raw is None else raw,
        "codec": codec,
        "xxh3": "0" * 32,
    }


VALID: dict[str, Any] = {
    "format_version": 2,
    "kind": "snapcore.snapshot",
    "step": 7,
    "created_unix": 1700000000.5,
    "writer": {"snapcore": "0.1", "torch": "2", "host": "h", "pid": 1},
    "world_size": 1,
    "rank_files": [[0]],
    "files": [{"name": "step-000000000007/data-ab-r0.bin", "size": 256}],
    "blobs": [
        {"nbytes": 48, "element_size": 4, "chunks": [_chunk(0, 0, 48)]},
        {"nbytes": 64, "element_size": 8, "chunks": [_chunk(0, 64, 40, "zstd", 64)]},
    ],
    "tensors": [
        {
            "dtype": "float32",
            "shape": [3, 4],
            "pieces": [
                {"offsets": [0, 0], "shape": [3, 4], "blob": 0, "byte_offset": 0, "strides": [4, 1]}
            ],
        },
        {
            "dtype": "float64",
            "shape": [8],
            "pieces": [{"offsets": [0], "shape": [8], "blob": 1, "byte_offset": 0, "strides": [1]}],
        },
    ],
    "tree": {
        "dict": [
            ["w", {"tensor": 0}],
            ["m", {"stateful": {"type": "x.Opt", "state": {"dict": [["v", {"tensor": 1}]]}}}],
            ["lr", {"float": "0x1.999999999999ap-4"}],
            ["n", {"int": 3}],
            ["s", {"list": [{"str": "a"}, {"bool": True}, {"none": None}]}],
            [5, {"tuple": [{"float": "inf"}]}],
        ]
    },
}
VALID_BYTES = json.dumps(VALID).encode()

# JSON values a hostile writer might put anywhere: huge, negative, wrong-typed, nested.
HOSTILE = [0, 1, -1, 1 << 61, 1 << 63, 1 << 70, 10**400, 2**62 + 1, 1e300, -0.0, 0.5]
HOSTILE += ["0xp", "0x1p99999", "-0x1p-1080", "nan", "inf", "float32", "zstd", "../x", ""]
SCALARS = st.one_of(
    st.sampled_from(HOSTILE),
    st.none(),
    st.booleans(),
    st.integers(min_value=-(1 << 70), max_value=1 << 70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(
            st.sampled_from(["dict", "list", "tensor", "float", "int", "x"]) | st.text(max_size=6),
            inner,
            max_size=3,
        ),
    ),
    max_leaves=8,
)


def _slots(node: Any, out: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """Every (container, key or index) of the document, leaves and containers alike."""
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for k, v in items:
        out.append((node, k))
        if isinstance(v, dict | list):
            _slots(v, out)
    return out


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


@st.composite
def structural(draw: st.DrawFn) -> bytes:
    """Replace, delete or add one value somewhere in the document (a few times)."""
    doc = json.loads(VALID_BYTES)
    for _ in range(draw(st.integers(1, 2))):
        slots = _slots(doc, [])
        target, key = slots[draw(st.integers(0, len(slots) - 1))]
        action = draw(st.sampled_from(["retype"] * 4 + ["replace", "delete", "add"]))
        if action == "retype":  # a hostile value of the same JSON type: gets past the schema
            old = target[key]
            kind = str if isinstance(old, str) else (int, float) if _number(old) else object
            same = [v for v in HOSTILE if isinstance(v, kind) and not isinstance(v, bool)]
            target[key] = draw(st.sampled_from(same)) if same else draw(JSON)
        elif action == "replace":
            target[key] = draw(JSON)
        elif action == "delete":
            del target[key]
        elif isinstance(target, dict):
            target[draw(st.text(max_size=8))] = draw(JSON)
        else:
            target.insert(key, draw(JSON))
    return json.dumps(doc).encode()


@st.composite
def bytewise(draw: st.DrawFn) -> bytes:
    """Overwrite, insert or delete a few bytes of the serialised manifest."""
    data = bytearray(VALID_BYTES)
    for _ in range(draw(st.integers(1, 4))):
        pos = draw(st.integers(0, len(data)))
        action = draw(st.sampled_from(["set", "insert", "delete", "truncate"]))
        if action == "set" and pos < len(data):
            data[pos] = draw(st.integers(0, 255))
        elif action == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=4))
        elif action == "delete":
            del data[pos : pos + draw(st.integers(1, 8))]
        else:
            del data[pos:]
    return bytes(data)


def _parse_or_refuse(data: bytes) -> None:
    try:
        m = mf.parse(data, where="fuzz")
    except InvalidManifest:
        return
    build(m.tree, lambda i, path: i)  # what load() does with the tree: no bad value left


def test_the_seed_manifest_is_valid():
    m = mf.parse(VALID_BYTES, where="seed")
    assert build(m.tree, lambda i, path: i)["lr"] == 0.1


def _with(**fields: Any) -> bytes:
    return json.dumps({**VALID, **fields}).encode()


# Seeds: values that once raised Python's own errors (issue 8); the random search is
# too short to be sure of meeting each of them again.
@FUZZ
@given(structural())
@example(_with(created_unix=10**400))
@example(_with(tree={"float": "0xp"}))
@example(_with(tree={"float": "0x1p99999"}))
def test_structural_mutations_parse_or_raise_invalid_manifest(data):
    _parse_or_refuse(data)


@FUZZ
@given(bytewise())
def test_byte_mutations_parse_or_raise_invalid_manifest(data):
    _parse_or_refuse(data)


# parse() checks the files, blobs, tensors arrays and the tree by hand, not through the
# compiled schema (speed: docs/benchmarks.md); the schema file stays the contract. The
# hand-written checks must never be laxer than the schema: whatever parse() accepts, the
# whole schema accepts too.
@FUZZ
@given(structural())
def test_what_parse_accepts_the_whole_schema_accepts(data):
    try:
        mf.parse(data, where="fuzz")
    except InvalidManifest:
        return
    mf._validator()(json.loads(data))  # raises JsonSchemaValueException if laxer


def _mutated(path: str, value: Any) -> dict[str, Any]:
    doc = json.loads(VALID_BYTES)
    *head, last = path.split(".")
    obj: Any = doc
    for k in head:
        obj = obj[int(k)] if isinstance(obj, list) else obj[k]
    if value is _DELETE:
        del obj[int(last) if isinstance(obj, list) else last]
    elif isinstance(obj, list):
        obj[int(last)] = value
    else:
        obj[last] = value
    return doc


_DELETE = object()
_FILE = "files.0"
_CHUNK = "blobs.1.chunks.0"
_PIECE = "tensors.1.pieces.0"
# (path, value): one value the hand-written checks refuse, in each array and the tree.
REFUSED = [
    (f"{_FILE}.size", True),
    (f"{_FILE}.size", -1),
    (f"{_FILE}.size", "256"),
    (f"{_FILE}.name", 5),
    (f"{_FILE}.name", "a/../b"),
    (f"{_FILE}.name", "x\n"),
    (f"{_FILE}.extra", 1),
    (f"{_FILE}.size", _DELETE),
    (_FILE, [1, 2]),
    ("files", {"name": "x"}),
    ("blobs.0.nbytes", False),
    ("blobs.0.element_size", True),
    ("blobs.0.element_size", 3),
    ("blobs.0.chunks", {}),
    ("blobs.0.extra", None),
    ("blobs.0.chunks", _DELETE),
    (f"{_CHUNK}.offset", -1),
    (f"{_CHUNK}.file", True),
    (f"{_CHUNK}.length", "40"),
    (f"{_CHUNK}.codec", "gzip"),
    (f"{_CHUNK}.codec", None),
    (f"{_CHUNK}.xxh3", "0" * 31),
    (f"{_CHUNK}.xxh3", "0" * 32 + "\n"),
    (f"{_CHUNK}.xxh3", "A" * 32),
    (f"{_CHUNK}.raw_length", _DELETE),
    (f"{_CHUNK}.extra", 0),
    ("tensors.0.dtype", "object"),
    ("tensors.0.dtype", 1),
    ("tensors.0.shape", [3, -4]),
    ("tensors.0.shape", [3, True]),
    ("tensors.0.shape", "34"),
    ("tensors.0.shape", [1] * 65),
    ("tensors.0.pieces", []),
    ("tensors.0.pieces", None),
    ("tensors.0.extra", []),
    ("tensors.0.shape", _DELETE),
    (f"{_PIECE}.blob", -1),
    (f"{_PIECE}.byte_offset", False),
    (f"{_PIECE}.strides", [1, 2, "x"]),
    (f"{_PIECE}.offsets", None),
    (f"{_PIECE}.extra", 1),
    (f"{_PIECE}.strides", _DELETE),
    ("tree", {"int": True}),
    ("tree", {"int": "1"}),
    ("tree", {"tensor": -1}),
    ("tree", {"str": 1}),
    ("tree", {"bool": 0}),
    ("tree", {"none": 0}),
    ("tree", {"float": 0.5}),
    ("tree", {"float": "0x1p1\n"}),
    ("tree", {"list": {}}),
    ("tree", {"dict": [["a"]]}),
    ("tree", {"dict": [[True, {"none": None}]]}),
    ("tree", {"dict": [[1.5, {"none": None}]]}),
    ("tree", {"stateful": {"type": "x", "state": {"none": None}, "extra": 1}}),
    ("tree", {"stateful": {"type": "x" * 257, "state": {"none": None}}}),
    ("tree", {"int": 1, "str": "a"}),
    ("tree", {}),
    ("tree", {"pickle": "x"}),
    ("tree", {"size": [1, 2.5]}),
    ("tree", {"bytes": {"b64": "!!"}}),
    ("tree", {"list": [{"list": [{"random": {"version": 2}}]}]}),
    ("step", True),
    ("world_size", "1"),
    ("rank_files", [[-1]]),
]
# The schema's "integer" takes a float with no fraction (1.0): these parsed before, and
# some then raised TypeError (a blob index of 0.0); parse() refuses them, type-exact.
FLOAT_FOR_INT = [
    (f"{_FILE}.size", 256.0),
    ("blobs.0.nbytes", 48.0),
    ("blobs.0.element_size", 4.0),
    (f"{_CHUNK}.offset", 64.0),
    ("tensors.0.shape", [3.0, 4]),
    (f"{_PIECE}.blob", 1.0),
    (f"{_PIECE}.strides", [1.0]),
    ("tree", {"tensor": 0.0}),
    ("tree", {"int": 1.0}),
    ("tree", {"dict": [[1.0, {"none": None}]]}),
    ("step", 7.0),
    ("world_size", 1.0),
    ("rank_files", [[0.0]]),
]


@pytest.mark.parametrize(
    ("path", "value", "schema_refuses"),
    [(p, v, True) for p, v in REFUSED] + [(p, v, False) for p, v in FLOAT_FOR_INT],
)
def test_hand_written_checks_refuse_what_they_must(path, value, schema_refuses):
    doc = _mutated(path, value)
    with pytest.raises(InvalidManifest, match="fuzz: "):
        mf.parse(json.dumps(doc).encode(), where="fuzz")
    if schema_refuses:  # the schema refuses it too: the two agree
        with pytest.raises(fastjsonschema.JsonSchemaValueException):
            mf._validator()(doc)
    else:  # the schema alone would take it
        mf._validator()(doc)


def test_float_for_int_names_where():
    doc = _mutated(f"{_PIECE}.blob", 0.0)
    with pytest.raises(InvalidManifest, match=r"tensors\[1\]\.pieces\[0\]\.blob: must be an int"):
        mf.parse(json.dumps(doc).encode(), where="fuzz")


@pytest.mark.parametrize(
    ("cap", "value", "message"),
    [
        ("MAX_FILES", 0, "1 files exceed the cap of 0"),
        ("MAX_BLOBS", 1, "2 blobs exceed the cap of 1"),
        ("MAX_TENSORS", 1, "2 tensors exceed the cap of 1"),
        ("MAX_CHUNKS", 1, "at most 1 chunks in all"),
        ("MAX_TREE_NODES", 5, "more than 5 nodes"),
    ],
)
def test_count_caps_are_enforced(monkeypatch, cap, value, message):
    monkeypatch.setattr(mf, cap, value)
    with pytest.raises(InvalidManifest, match=message):
        mf.parse(VALID_BYTES, where="fuzz")


# -- format 3: a sharded snapshot's index (parse_any) and parts (parse_part) --------------------
VALID_PART: dict[str, Any] = {
    **VALID,
    "format_version": 3,
    "kind": "snapcore.part",
    "rank": 1,
    "plan": "ab" * 32,
    "structure": "cd" * 32,
    "keys": ["w", None],
    "world_size": 2,
}
VALID_INDEX: dict[str, Any] = {
    "format_version": 3,
    "kind": "snapcore.snapshot",
    "step": 7,
    "created_unix": 1700000000.5,
    "writer": {},
    "world_size": 2,
    "plan": "ab" * 32,
    "parts": [
        {"rank": r, "name": f"step-000000000007/part-0000{r}-x.json", "size": 9, "xxh3": "0" * 32}
        for r in range(2)
    ],
}


@st.composite
def structural_of(draw: st.DrawFn, seed: dict[str, Any]) -> bytes:
    doc = json.loads(json.dumps(seed))
    for _ in range(draw(st.integers(1, 2))):
        slots = _slots(doc, [])
        target, key = slots[draw(st.integers(0, len(slots) - 1))]
        action = draw(st.sampled_from(["retype"] * 3 + ["replace", "delete"]))
        if action == "retype":
            old = target[key]
            kind = str if isinstance(old, str) else (int, float) if _number(old) else object
            same = [v for v in HOSTILE if isinstance(v, kind) and not isinstance(v, bool)]
            target[key] = draw(st.sampled_from(same)) if same else draw(JSON)
        elif action == "replace":
            target[key] = draw(JSON)
        else:
            del target[key]
    return json.dumps(doc).encode()


def test_the_format_3_seeds_are_valid():
    assert mf.parse_part(json.dumps(VALID_PART).encode(), where="seed").part is not None
    assert isinstance(mf.parse_any(json.dumps(VALID_INDEX).encode(), where="seed"), mf.Index)


@FUZZ
@given(structural_of(VALID_PART))
def test_part_mutations_parse_or_raise_invalid_manifest(data):
    try:
        m = mf.parse_part(data, where="fuzz")
    except InvalidManifest:
        return
    assert m.part is not None and len(m.part.keys) == len(m.tensors)
    build(m.tree, lambda i, path: i)


@FUZZ
@given(st.one_of(structural_of(VALID_INDEX), structural_of(VALID_PART), structural_of(VALID)))
def test_parse_any_mutations_parse_or_raise_invalid_manifest(data):
    try:
        doc = mf.parse_any(data, where="fuzz")
    except InvalidManifest:
        return
    if isinstance(doc, mf.Index):
        assert len(doc.parts) == doc.world_size >= 1
        assert all(
            r.rank == i and r.name.startswith("step-000000000007/") for i, r in enumerate(doc.parts)
        )
    else:
        build(doc.tree, lambda i, path: i)
