"""The state types of values.py (NumPy, bytes, generators, enums, paths, dataclasses) and
RNGState: round trips through load and restore, refusals, and hostile manifests."""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import pathlib
import random
import sys
import textwrap
from typing import Any

import numpy as np
import pytest
import torch

import snapcore
from snapcore import values
from snapcore.directory import LocalDirectory

NP_DTYPES = list(values.NP_DTYPES)


class Color(enum.Enum):
    RED = 1
    BLUE = 2


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Mode(enum.StrEnum):
    TRAIN = "train"
    EVAL = "eval"


class Perm(enum.Flag):
    R = 1
    W = 2


class Outer:
    class Inner(enum.Enum):
        A = "a"


@dataclasses.dataclass
class Sampler:
    epoch: int
    order: np.ndarray
    weights: torch.Tensor
    mode: Mode = Mode.TRAIN


@dataclasses.dataclass(frozen=True)
class Frozen:
    lr: float
    name: str


def random_array(dtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Random bit patterns (NaNs and all) of ``dtype``: equality is checked bitwise."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    if dtype == "bool":
        return (raw % 2).astype(bool).reshape(shape)
    return raw.view(dtype).reshape(shape)


def same_array(a: Any, b: np.ndarray) -> bool:
    return (
        type(a) is np.ndarray
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.tobytes() == np.ascontiguousarray(b).tobytes()
    )


def manifest(root: Any, step: int = 1) -> dict[str, Any]:
    return json.loads(LocalDirectory(root).manifest_path(step).read_bytes())


def node_of(root: Any, key: str, step: int = 1) -> dict[str, Any]:
    return dict(manifest(root, step)["tree"]["dict"])[key]


# -- NumPy arrays -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", NP_DTYPES)
@pytest.mark.parametrize("shape", [(3, 5), (40, 50)], ids=["inline", "data-file"])
def test_numpy_array_round_trips_bit_exact(tmp_path, dtype, shape):
    a = random_array(dtype, shape, seed=len(dtype))
    snapcore.save({"a": a}, tmp_path, step=1)
    out = snapcore.load(tmp_path)["a"]
    assert same_array(out, a)
    data = node_of(tmp_path, "a")["ndarray"]["data"]
    assert ("b64" in data) == (a.nbytes <= values.INLINE_MAX_BYTES)


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.float32(3.5) * np.ones((), np.float32),  # 0-d
        lambda: np.zeros((0, 7), np.int16),
        lambda: np.arange(4000, dtype=np.int64).reshape(40, 100)[::3, 1::7],  # strided
        lambda: np.arange(600, dtype=">f8"),  # big-endian, larger than the inline limit
        lambda: np.arange(60, dtype=">u4"),  # big-endian, inline
        lambda: np.broadcast_to(np.arange(10.0), (300, 10)),  # read-only, zero strides
    ],
    ids=["0d", "empty", "strided", "big-endian", "big-endian-inline", "read-only"],
)
def test_numpy_array_layouts_round_trip(tmp_path, make):
    a = make()
    snapcore.save({"a": a}, tmp_path, step=1)
    out = snapcore.load(tmp_path)["a"]
    assert out.shape == a.shape and out.dtype.name == a.dtype.name
    assert out.dtype.isnative  # byte order is not kept: values are (docs/format.md)
    assert np.array_equal(out, a)


def test_async_save_has_staged_an_array_when_it_returns(tmp_path):
    # A large contiguous array is staged from its own memory, not copied first: the
    # snapshot must still hold the values it had when async_save returned.
    a = np.arange(100_000, dtype=np.float32)
    h = snapcore.async_save({"a": a}, tmp_path, step=1)
    a[:] = -1
    h.wait()
    assert np.array_equal(snapcore.load(tmp_path)["a"], np.arange(100_000, dtype=np.float32))


def test_one_array_referenced_twice_loads_as_one_memory(tmp_path):
    a = np.arange(1000, dtype=np.float64)
    snapcore.save({"x": a, "y": [a]}, tmp_path, step=1)
    assert len(manifest(tmp_path)["tensors"]) == 1
    out = snapcore.load(tmp_path)
    assert np.shares_memory(out["x"], out["y"][0])


@pytest.mark.parametrize("big", [False, True], ids=["inline", "data-file"])
def test_restore_fills_a_live_array_in_place(tmp_path, big):
    n = 2000 if big else 10
    src = np.arange(n, dtype=np.float32)
    snapcore.save({"a": src, "nested": {"b": src.reshape(-1, 2)}}, tmp_path, step=1)
    a = np.zeros(n, np.float32)
    b_base = np.zeros((n // 2, 4), np.float32)
    b = b_base[:, ::2]  # a strided view: filled through a copy, still in place
    state = {"a": a, "nested": {"b": b}}
    snapcore.restore(state, tmp_path)
    assert state["a"] is a and state["nested"]["b"] is b
    assert np.array_equal(a, src) and np.array_equal(b_base[:, ::2], src.reshape(-1, 2))
    assert not b_base[:, 1::2].any()


def test_restore_array_of_another_shape_or_type_is_a_mismatch(tmp_path):
    snapcore.save({"a": np.arange(6, dtype=np.int32)}, tmp_path, step=1)
    for live, what in [
        (np.zeros(5, np.int32), "int32[6]"),
        (np.zeros(6, np.int64), "int32[6]"),
        (torch.zeros(6, dtype=torch.int32), "numpy.ndarray"),
    ]:
        with pytest.raises(snapcore.StateMismatch, match=r"^a: .*" + what.replace("[", r"\[")):
            snapcore.restore({"a": live}, tmp_path)


@pytest.mark.parametrize(
    ("value", "what"),
    [
        (np.array([object()], dtype=object), "dtype object"),
        (np.array(["a", "bc"]), "dtype <U2"),
        (np.zeros(2, dtype=[("x", "i4"), ("y", "f8")]), "dtype"),
        (np.array(["2024-01-01"], dtype="datetime64[D]"), "datetime64"),
        (np.zeros(2, dtype=np.longdouble), "float128"),
        (np.ma.masked_array([1, 2], mask=[0, 1]), "MaskedArray"),
        (np.datetime64("2024-01-01"), "scalar of dtype datetime64"),
        (np.void(b"ab"), "scalar of dtype"),
        (Perm.R | Perm.W, "combination of flags"),
        (random.SystemRandom(), "SystemRandom"),
        (bytearray(b"x"), "bytearray"),
    ],
    ids=[
        "object",
        "str",
        "structured",
        "datetime64",
        "longdouble",
        "masked",
        "datetime-scalar",
        "void-scalar",
        "flag-combination",
        "system-random",
        "bytearray",
    ],
)
def test_values_that_cannot_be_saved_are_refused_with_their_path(tmp_path, value, what):
    with pytest.raises(snapcore.UnsupportedState) as e:
        snapcore.save({"opt": {"x": value}}, tmp_path, step=1)
    assert e.value.path == "opt.x"
    assert str(e.value).startswith("opt.x: ") and what in str(e.value)
    assert LocalDirectory(tmp_path).committed_steps() == []


# -- NumPy scalars, bytes, sizes, paths, enums ----------------------------------------------


@pytest.mark.parametrize("dtype", NP_DTYPES)
def test_numpy_scalar_comes_back_as_the_same_numpy_type(tmp_path, dtype):
    x = random_array(dtype, (1,), seed=7)[0]
    snapcore.save({"x": x}, tmp_path, step=1)
    out = snapcore.load(tmp_path)["x"]
    assert type(out) is type(x)
    assert out.tobytes() == x.tobytes()


def test_plain_values_round_trip_with_their_types(tmp_path):
    state = {
        "f64": np.float64(0.1),  # a float subclass: must not come back as a plain float
        "nan32": np.frombuffer(b"\x01\x00\xc0\x7f", np.float32)[0],  # a NaN payload
        "empty": b"",
        "small": bytes(range(256)),
        "large": bytes(range(256)) * 40,
        "size": torch.Size([2, 0, 3]),
        "scalar_size": torch.Size([]),
        "posix": pathlib.PurePosixPath("/data/shard-3"),
        "windows": pathlib.PureWindowsPath(r"C:\data\x"),
        "concrete": pathlib.Path("relative/p"),
        "color": Color.BLUE,
        "level": Level.HIGH,  # an int subclass: must not come back as an int
        "mode": Mode.EVAL,  # a str subclass
        "inner": Outer.Inner.A,
        "flag": Perm.W,
    }
    snapcore.save(state, tmp_path, step=1)
    out = snapcore.load(tmp_path)
    for k, v in state.items():
        assert type(out[k]) is type(v), k
        if isinstance(v, np.generic):
            assert out[k].tobytes() == v.tobytes(), k
        else:
            assert out[k] == v, k
    assert out["color"] is Color.BLUE and out["level"] is Level.HIGH
    assert "b64" in node_of(tmp_path, "small")["bytes"]
    assert "tensor" in node_of(tmp_path, "large")["bytes"]


def test_restore_replaces_immutable_values_and_checks_their_type(tmp_path):
    state = {
        "x": np.int16(3),
        "b": b"abc",
        "s": torch.Size([4]),
        "p": pathlib.PurePosixPath("a"),
        "c": Color.BLUE,
    }
    snapcore.save(state, tmp_path, step=1)
    live = {
        "x": np.int16(0),
        "b": b"",
        "s": torch.Size([]),
        "p": pathlib.PurePosixPath("b"),
        "c": Color.RED,
    }
    snapcore.restore(live, tmp_path)
    assert live == state and type(live["x"]) is np.int16
    with pytest.raises(snapcore.StateMismatch, match=r"^x: .*numpy\.int16.*numpy\.int32"):
        snapcore.restore({**live, "x": np.int32(0)}, tmp_path)
    with pytest.raises(snapcore.StateMismatch, match=r"^c: .*Color.*Level"):
        snapcore.restore({**live, "c": Level.LOW}, tmp_path)


ENUM_MODULE = """
import enum
with open({marker!r}, "a") as f:
    f.write("imported\\n")

class Phase(enum.Enum):
    WARMUP = 1
    DECAY = 2
"""


@pytest.fixture
def phase_module(tmp_path, monkeypatch):
    """A module defining an enum, that notes each import of it in a marker file."""
    name = f"snapcore_test_phase_{tmp_path.name}"
    src = tmp_path / "mods"
    src.mkdir()
    marker = tmp_path / "imports.txt"
    (src / f"{name}.py").write_text(textwrap.dedent(ENUM_MODULE.format(marker=str(marker))))
    monkeypatch.syspath_prepend(str(src))
    module = __import__(name)
    yield module, marker
    sys.modules.pop(name, None)


def test_enum_of_a_module_not_imported_is_not_imported_by_load(tmp_path, phase_module):
    module, marker = phase_module
    store = tmp_path / "store"
    snapcore.save({"phase": module.Phase.DECAY}, store, step=1)
    assert snapcore.load(store)["phase"] is module.Phase.DECAY

    live = {"phase": module.Phase.WARMUP}
    del sys.modules[module.__name__]
    with pytest.raises(snapcore.StateMismatch, match="is not imported") as e:
        snapcore.load(store)
    assert f"{module.__name__}.Phase.DECAY" in str(e.value)
    assert module.__name__ not in sys.modules
    assert marker.read_text() == "imported\n"  # its code ran once, at the test's import
    # A live member of the enum resolves the name without any import.
    snapcore.restore(live, store)
    assert live["phase"] is module.Phase.DECAY


def test_enum_member_or_class_missing_is_a_clear_error(tmp_path):
    def local_enum() -> type[enum.Enum]:
        class Local(enum.Enum):
            A = 1

        return Local

    Local = local_enum()
    snapcore.save({"c": Color.RED, "local": Local.A}, tmp_path, step=1)
    path = LocalDirectory(tmp_path).manifest_path(1)
    doc = json.loads(path.read_bytes())
    doc["tree"]["dict"][0][1]["enum"]["name"] = "GREEN\x1b[2J"
    path.write_text(json.dumps(doc))
    with pytest.raises(snapcore.StateMismatch, match=r"has no member GREEN\\x1b\[2J"):
        snapcore.load(tmp_path)
    with pytest.raises(snapcore.StateMismatch, match="has no member GREEN"):
        snapcore.restore({"c": Color.BLUE, "local": Local.A}, tmp_path)
    doc["tree"]["dict"][0][1]["enum"] = {"module": "os", "qualname": "path", "name": "sep"}
    path.write_text(json.dumps(doc))
    with pytest.raises(snapcore.StateMismatch, match="is not an Enum class"):
        snapcore.load(tmp_path)
    # A class defined in a function resolves only from a live member of it.
    del doc["tree"]["dict"][0]
    path.write_text(json.dumps(doc))
    with pytest.raises(snapcore.StateMismatch, match="is not an Enum class"):
        snapcore.load(tmp_path)
    live = {"local": Local.A}
    snapcore.restore(live, tmp_path)
    assert live["local"] is Local.A


# -- generators ---------------------------------------------------------------------------


def test_generator_and_random_load_as_new_objects_with_the_state(tmp_path):
    g = torch.Generator().manual_seed(1234)
    torch.rand(7, generator=g)
    r = random.Random(99)
    r.random()
    r.gauss(0, 1)  # gauss_next is now set: it is part of the state
    snapcore.save({"g": g, "r": r}, tmp_path, step=1)
    out = snapcore.load(tmp_path)
    assert isinstance(out["g"], torch.Generator) and out["g"].device == torch.device("cpu")
    assert type(out["r"]) is random.Random
    assert torch.equal(torch.rand(5, generator=out["g"]), torch.rand(5, generator=g))
    assert [out["r"].gauss(0, 1) for _ in range(3)] == [r.gauss(0, 1) for _ in range(3)]
    assert node_of(tmp_path, "g")["generator"]["device"] == "cpu"


def test_restore_sets_live_generators_in_place(tmp_path):
    g = torch.Generator().manual_seed(5)
    r = random.Random(5)
    snapcore.save({"g": g, "r": r}, tmp_path, step=1)
    expected = torch.rand(4, generator=g), [r.random() for _ in range(4)]
    g2, r2 = torch.Generator().manual_seed(0), random.Random(0)
    state = {"g": g2, "r": r2}
    snapcore.restore(state, tmp_path)
    assert state["g"] is g2 and state["r"] is r2
    assert torch.equal(torch.rand(4, generator=g2), expected[0])
    assert [r2.random() for _ in range(4)] == expected[1]
    with pytest.raises(snapcore.StateMismatch, match=r"^g: .*torch\.Generator"):
        snapcore.restore({"g": torch.zeros(1), "r": r2}, tmp_path)


# -- dataclasses --------------------------------------------------------------------------


def test_dataclass_loads_as_a_dict_and_restores_field_by_field_in_place(tmp_path):
    s = Sampler(3, np.arange(5000), torch.arange(4.0), Mode.EVAL)
    snapcore.save({"sampler": s, "frozen": Frozen(0.5, "x")}, tmp_path, step=1)
    out = snapcore.load(tmp_path)
    assert set(out["sampler"]) == {"epoch", "order", "weights", "mode"}
    assert out["sampler"]["epoch"] == 3 and out["sampler"]["mode"] is Mode.EVAL
    assert np.array_equal(out["sampler"]["order"], s.order)
    assert out["frozen"] == {"lr": 0.5, "name": "x"}

    live = Sampler(0, np.zeros(5000, dtype=np.int64), torch.zeros(4))
    order, weights = live.order, live.weights
    frozen = Frozen(0.0, "y")
    state = {"sampler": live, "frozen": frozen}
    snapcore.restore(state, tmp_path)
    assert state["sampler"] is live and live.order is order and live.weights is weights
    assert live.epoch == 3 and live.mode is Mode.EVAL
    assert np.array_equal(order, s.order) and torch.equal(weights, s.weights)
    assert state["frozen"] == Frozen(0.5, "x") and frozen == Frozen(0.0, "y")


def test_dataclass_with_other_fields_is_a_mismatch(tmp_path):
    snapcore.save({"f": Frozen(0.5, "x")}, tmp_path, step=1)

    @dataclasses.dataclass
    class Other:
        lr: float
        other: int

    with pytest.raises(snapcore.StateMismatch, match=r"^f: .*lacks \(other\).*lacks \(name\)"):
        snapcore.restore({"f": Other(0.0, 1)}, tmp_path)
    with pytest.raises(snapcore.StateMismatch, match=r"^f: .*dataclass"):
        snapcore.restore({"f": {"lr": 0.0, "name": ""}}, tmp_path)


def test_dataclass_cycle_and_stateful_dataclass(tmp_path):
    @dataclasses.dataclass
    class Node:
        children: list[Any]

    n = Node([])
    n.children.append(n)
    with pytest.raises(snapcore.UnsupportedState, match="cycle") as e:
        snapcore.save({"n": n}, tmp_path, step=1)
    assert e.value.path == "n.children.0"

    @dataclasses.dataclass
    class Counter:
        n: int

        def state_dict(self) -> dict[str, Any]:
            return {"count": self.n}

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            self.n = sd["count"]

    snapcore.save({"c": Counter(4)}, tmp_path, step=1)
    assert "stateful" in node_of(tmp_path, "c")  # state_dict() wins over the fields
    assert snapcore.load(tmp_path) == {"c": {"count": 4}}


# -- RNGState -----------------------------------------------------------------------------


def draws() -> tuple[list[float], list[float], torch.Tensor]:
    return (
        [random.random() for _ in range(3)] + [random.gauss(0, 1) for _ in range(3)],
        np.random.rand(3).tolist() + np.random.randn(3).tolist(),
        torch.cat([torch.rand(3), torch.randn(3), torch.randint(0, 1 << 30, (3,)).float()]),
    )


def test_rng_state_resumes_bit_exact(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    draws()  # advance, and leave NumPy and Python with a cached gaussian
    random.gauss(0, 1)
    np.random.randn()
    snapcore.save({"rng": snapcore.RNGState(), "step": 7}, tmp_path, step=7)
    expected = draws()

    for reset in (0, 10):  # whatever happened in between, a restore puts it back
        random.seed(reset)
        np.random.seed(reset)
        torch.manual_seed(reset)
        draws()
        assert draws()[0] != expected[0]
        state = {"rng": snapcore.RNGState(), "step": 0}
        snapcore.restore(state, tmp_path)
        assert state["step"] == 7
        got = draws()
        assert got[0] == expected[0] and got[1] == expected[1]
        assert torch.equal(got[2], expected[2])

    # load() gives the state dict; load_state_dict takes it.
    sd = snapcore.load(tmp_path)["rng"]
    assert set(sd) == {"python", "numpy", "torch", "cuda"} and sd["cuda"] is None
    torch.manual_seed(0)
    snapcore.RNGState().load_state_dict(sd)
    got = draws()
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


def test_numpy_legacy_random_state_round_trips(tmp_path):
    np.random.seed(11)
    np.random.randn()  # a cached gaussian is part of the state
    snapcore.save({"np": np.random.get_state()}, tmp_path, step=1)
    expected = np.random.randn(4)
    np.random.seed(0)
    np.random.set_state(snapcore.load(tmp_path)["np"])
    assert np.random.randn(4).tobytes() == expected.tobytes()


def test_rng_state_saves_and_sets_every_cuda_device(monkeypatch, caplog):
    # No GPU here: the CUDA calls are replaced, to check which states go where.
    states = [torch.full((16,), i, dtype=torch.uint8) for i in range(3)]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: states)
    sd = snapcore.RNGState().state_dict()
    assert sd["cuda"] is states

    set_calls: list[tuple[int, torch.Tensor]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, d: set_calls.append((d, s)))
    with caplog.at_level(logging.WARNING, logger="snapcore.rng"):
        snapcore.RNGState().load_state_dict(sd)
    assert [(d, s[0].item()) for d, s in set_calls] == [(0, 0), (1, 1)]
    assert "3 CUDA devices and this process has 2" in caplog.text


def test_rng_state_without_cuda_records_none():
    if torch.cuda.is_initialized():
        pytest.skip("CUDA is initialised in this process")
    assert snapcore.RNGState().state_dict()["cuda"] is None


# -- hostile manifests --------------------------------------------------------------------


@pytest.fixture
def saved_values(tmp_path):
    state = {
        "small": np.arange(6, dtype=np.float32),
        "big": np.arange(1000, dtype=np.int64),
        "x": np.float32(1.5),
        "b": b"abc",
        "g": torch.Generator().manual_seed(0),
        "r": random.Random(0),
        "s": torch.Size([2, 3]),
        "d": Frozen(1.0, "x"),
    }
    snapcore.save(state, tmp_path, step=1)
    path = LocalDirectory(tmp_path).manifest_path(1)
    return tmp_path, path, json.loads(path.read_bytes())


def _with(key: str, node: dict[str, Any]) -> Any:
    def mutate(doc: dict[str, Any]) -> dict[str, Any]:
        items = dict(doc["tree"]["dict"])
        items[key] = node
        doc["tree"]["dict"] = [[k, v] for k, v in items.items()]
        return doc

    return mutate


def _b64(n: int) -> str:
    import base64

    return base64.b64encode(bytes(n)).decode()


HOSTILE_VALUES: dict[str, tuple[Any, str]] = {
    "object-dtype": (
        _with("small", {"ndarray": {"dtype": "object", "shape": [1], "data": {"b64": _b64(8)}}}),
        "schema",
    ),
    "inline-length": (
        _with("small", {"ndarray": {"dtype": "float32", "shape": [7], "data": {"b64": _b64(24)}}}),
        "base64 characters",
    ),
    "bad-base64": (
        _with("small", {"ndarray": {"dtype": "uint8", "shape": [3], "data": {"b64": "AB=C"}}}),
        "schema",
    ),
    "huge-shape": (
        _with(
            "small",
            {"ndarray": {"dtype": "int8", "shape": [1 << 40, 1 << 40], "data": {"b64": ""}}},
        ),
        "too large",
    ),
    "empty-but-huge-dim": (
        _with("small", {"ndarray": {"dtype": "int8", "shape": [0, 1 << 70], "data": {"b64": ""}}}),
        "too large",
    ),
    "tensor-shape": (
        _with("big", {"ndarray": {"dtype": "int64", "shape": [999], "data": {"tensor": 0}}}),
        "not int64[999]",
    ),
    "tensor-dtype": (
        _with("big", {"ndarray": {"dtype": "float64", "shape": [1000], "data": {"tensor": 0}}}),
        "not float64[1000]",
    ),
    "tensor-index": (
        _with("big", {"ndarray": {"dtype": "int64", "shape": [1000], "data": {"tensor": 50}}}),
        "references tensor 50",
    ),
    "scalar-length": (_with("x", {"npscalar": {"dtype": "float64", "b64": _b64(4)}}), "base64"),
    "bytes-tensor-dtype": (_with("b", {"bytes": {"tensor": 0}}), "not uint8"),
    "two-kinds-of-data": (_with("b", {"bytes": {"b64": "", "tensor": 0}}), "schema"),
    "generator-device": (
        _with("g", {"generator": {"device": "cuda:x", "data": {"b64": ""}}}),
        "invalid device",
    ),
    "random-short-key": (
        _with("r", {"random": {"version": 3, "key": [0] * 624, "gauss_next": {"none": None}}}),
        "schema",
    ),
    "random-position": (
        _with(
            "r", {"random": {"version": 3, "key": [0] * 624 + [700], "gauss_next": {"none": None}}}
        ),
        "position 700",
    ),
    "random-gauss-node": (
        _with("r", {"random": {"version": 3, "key": [0] * 625, "gauss_next": {"tensor": 0}}}),
        "gauss_next is a tensor node",
    ),
    "size-overflow": (_with("s", {"size": [1 << 70]}), "does not fit in int64"),
    "dataclass-duplicate": (
        _with("d", {"dataclass": {"type": "x", "fields": [["a", {"int": 1}], ["a", {"int": 2}]]}}),
        "duplicate field names",
    ),
    "path-type": (_with("d", {"path": {"type": "os.system", "str": "x"}}), "schema"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_VALUES))
def test_hostile_value_nodes_are_refused(saved_values, name):
    root, path, doc = saved_values
    mutate, message = HOSTILE_VALUES[name]
    path.write_text(json.dumps(mutate(doc)))
    for read in (lambda: snapcore.load(root), lambda: snapcore.restore({"x": None}, root)):
        with pytest.raises(snapcore.InvalidManifest) as e:
            read()
        assert message in str(e.value) and str(path) in str(e.value)


def test_hostile_generator_state_is_a_clear_error(saved_values):
    root, path, doc = saved_values
    path.write_text(
        json.dumps(_with("g", {"generator": {"device": "cpu", "data": {"b64": ""}}})(doc))
    )
    with pytest.raises(snapcore.StateMismatch, match=r"^g: torch refuses the saved state"):
        snapcore.load(root)


def test_damaged_array_chunk_names_the_array(saved_values):
    root, _, doc = saved_values
    i = dict(doc["tree"]["dict"])["big"]["ndarray"]["data"]["tensor"]
    chunk = doc["blobs"][doc["tensors"][i]["pieces"][0]["blob"]]["chunks"][0]
    data = root / doc["files"][chunk["file"]]["name"]
    raw = bytearray(data.read_bytes())
    raw[chunk["offset"]] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(snapcore.CorruptSnapshot) as e:
        snapcore.load(root)
    assert e.value.tensor == "big"


def test_describe_summarises_each_kind_on_one_line(saved_values):
    _, _, doc = saved_values
    tree = dict(doc["tree"]["dict"])
    lines = {k: values.describe(*next(iter(n.items()))) for k, n in tree.items()}
    assert lines["small"] == "numpy float32 [6] (inline)"
    assert lines["big"].startswith("numpy int64 [1000] (tensor ")
    assert lines["x"] == "numpy.float32(1.5)"
    assert lines["b"] == "bytes (3 B, inline)"
    assert lines["g"] == "torch.Generator on cpu"
    assert lines["s"] == "torch.Size([2, 3])"
    assert lines["d"].startswith("dataclass ") and lines["d"].endswith("test_values.Frozen")
    evil = {"module": "m", "qualname": "E\x1b[31m", "name": "A"}
    assert "\x1b" not in values.describe("enum", evil)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_generator_cannot_be_loaded_without_cuda(saved_values):
    root, path, doc = saved_values
    node = {"generator": {"device": "cuda:0", "data": {"b64": _b64(16)}}}
    path.write_text(json.dumps(_with("g", node)(doc)))
    with pytest.raises(snapcore.StateMismatch, match=r"^g: .*cuda:0 and this process has no"):
        snapcore.load(root)


def test_numpy_values_without_numpy_installed_are_a_clear_error(tmp_path, monkeypatch):
    snapcore.save({"x": np.float32(1.5)}, tmp_path, step=1)
    monkeypatch.setitem(sys.modules, "numpy", None)  # import numpy now raises ImportError
    with pytest.raises(snapcore.StateMismatch, match=r"^x: .*NumPy is not installed"):
        snapcore.load(tmp_path)
