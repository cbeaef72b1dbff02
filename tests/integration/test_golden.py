"""Snapshots written by the format-2 release stay readable, bit for bit (issue 10).

The stores under tests/integration/golden/ were written once by make_golden.py there and
are committed; next to each is what it must load as, in raw little-endian bytes + JSON (no
pickle, no snapcore), so these tests do not trust the reader they test. Each store is
copied to a temporary directory first: opening a store may write to it (writer lock,
housekeeping), and the committed files must stay as they are.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import snapcore
from snapcore.read import verify_snapshot
from snapcore.tiers import LocalTier

GOLDEN = Path(__file__).resolve().parent / "golden"


def _import_generator() -> Any:
    spec = importlib.util.spec_from_file_location("make_golden", GOLDEN / "make_golden.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = _import_generator()

STEPS = [(case, step) for case, (_, steps) in gen.CASES.items() for step, _ in steps]
IDS = [f"{case}-step{step}" for case, step in STEPS]


@pytest.fixture(autouse=True)
def _close_engines() -> Iterator[None]:
    yield
    snapcore.close()


def _store_copy(case: str, tmp_path: Path) -> Path:
    dst = tmp_path / case
    shutil.copytree(GOLDEN / case / "store", dst)
    return dst


def _expected(case: str, step: int) -> tuple[dict[str, Any], Path]:
    doc = json.loads((GOLDEN / case / "expected" / f"step-{step}.json").read_text("utf-8"))
    assert doc["step"] == step and doc["byteorder"] == "little"
    return doc["tree"], GOLDEN / case / "expected" / f"step-{step}"


def _builder(case: str, step: int) -> Any:
    return dict(gen.CASES[case][1])[step]


def mismatches(
    actual: Any, node: dict[str, Any], files: Path, path: str = "", extra_keys: bool = False
) -> list[str]:
    """Where ``actual`` differs from the expected ``node`` (empty: equal, bit for bit).

    ``extra_keys``: a dict may hold keys the expected one lacks (a live optimizer's
    state_dict gains the options a newer torch adds); the expected keys must all be there.
    """
    where = path or "<root>"
    kind = node["t"]
    if kind == "tensor":
        if not isinstance(actual, torch.Tensor):
            return [f"{where}: expected a tensor, got {type(actual).__name__}"]
        want_dtype = gen.DTYPES[node["dtype"]]
        if actual.dtype != want_dtype or list(actual.shape) != node["shape"]:
            return [
                f"{where}: expected {want_dtype} {node['shape']}, "
                f"got {actual.dtype} {list(actual.shape)}"
            ]
        data = (files / node["file"]).read_bytes()
        if hashlib.sha256(data).hexdigest() != node["sha256"]:
            return [f"{where}: expected file {node['file']} does not match its sha256"]
        return [] if gen.tensor_bytes(actual) == data else [f"{where}: tensor bytes differ"]
    if kind == "none":
        return [] if actual is None else [f"{where}: expected None, got {actual!r}"]
    if kind in ("bool", "int", "float", "str"):
        want = {
            "bool": lambda v: v,
            "int": int,
            "float": float.fromhex,
            "str": str,
        }[kind](node["v"])
        py_type = {"bool": bool, "int": int, "float": float, "str": str}[kind]
        same = type(actual) is py_type and (
            actual.hex() == want.hex() if kind == "float" else actual == want
        )
        return [] if same else [f"{where}: expected {want!r}, got {actual!r}"]
    if kind == "dict":
        if not isinstance(actual, dict):
            return [f"{where}: expected a dict, got {type(actual).__name__}"]
        keys = [int(k["v"]) if isinstance(k, dict) else k for k, _ in node["items"]]
        have = list(actual)
        if extra_keys:
            missing = [k for k in keys if k not in actual]
            if missing:
                return [f"{where}: missing keys {missing}"]
        elif have != keys:
            return [f"{where}: keys {have} != expected {keys}"]
        out: list[str] = []
        for k, (_, child) in zip(keys, node["items"], strict=True):
            sub = f"{path}.{k}" if path else str(k)
            out += mismatches(actual[k], child, files, sub, extra_keys)
        return out
    if kind in ("list", "tuple"):
        py_type = list if kind == "list" else tuple
        if type(actual) is not py_type or len(actual) != len(node["items"]):
            return [f"{where}: expected a {kind} of {len(node['items'])}, got {actual!r}"]
        out = []
        for i, (a, child) in enumerate(zip(actual, node["items"], strict=True)):
            out += mismatches(a, child, files, f"{path}.{i}" if path else str(i), extra_keys)
        return out
    raise AssertionError(f"{where}: unknown node kind {kind!r} in the expected file")


def test_golden_stores_are_format_2_and_small() -> None:
    total = 0
    for case in gen.CASES:
        manifests = sorted((GOLDEN / case / "store").glob("step-*/manifest.json"))
        assert len(manifests) == len(gen.CASES[case][1]), case
        for m in manifests:
            assert json.loads(m.read_text("utf-8"))["format_version"] == 2, m
        total += sum(f.stat().st_size for f in (GOLDEN / case).rglob("*") if f.is_file())
    assert total < 1 << 20


@pytest.mark.parametrize(("case", "step"), STEPS, ids=IDS)
def test_load_golden_bit_exact(case: str, step: int, tmp_path: Path) -> None:
    tree, files = _expected(case, step)
    loaded = snapcore.load(_store_copy(case, tmp_path), step=step)
    assert mismatches(loaded, tree, files) == []


@pytest.mark.parametrize(("case", "step"), STEPS, ids=IDS)
def test_restore_golden_bit_exact(case: str, step: int, tmp_path: Path) -> None:
    tree, files = _expected(case, step)
    live = _builder(case, step)(1)  # same structure, other values
    assert mismatches(gen.plain(live), tree, files, extra_keys=True), "fresh state must differ"
    info = snapcore.restore(live, _store_copy(case, tmp_path), step=step)
    assert info.step == step and info.damaged == []
    assert mismatches(gen.plain(live), tree, files, extra_keys=True) == []


@pytest.mark.parametrize(("case", "step"), STEPS, ids=IDS)
def test_verify_golden_reports_nothing_damaged(case: str, step: int, tmp_path: Path) -> None:
    tier = LocalTier(_store_copy(case, tmp_path))
    assert step in tier.committed_steps()
    assert verify_snapshot(tier, step) == []


def test_verify_golden_finds_a_flipped_byte(tmp_path: Path) -> None:
    """The verify check above can fail: one flipped byte in a golden store is reported."""
    store = _store_copy("tensors", tmp_path)
    (data,) = store.glob("step-*/data-*.bin")
    raw = bytearray(data.read_bytes())
    raw[0] ^= 0xFF
    data.write_bytes(bytes(raw))
    damaged = verify_snapshot(LocalTier(store), 1)
    assert len(damaged) == 1


def test_load_golden_keeps_shared_storage(tmp_path: Path) -> None:
    """format.md: tensors that shared storage when saved share it when loaded."""
    out = snapcore.load(_store_copy("tensors", tmp_path), step=1)
    assert out["tied_a"] is out["tied_b"]
    tied = out["tied_a"].untyped_storage().data_ptr()
    assert out["tied_rows"].untyped_storage().data_ptr() == tied
    base = out["base"].untyped_storage().data_ptr()
    assert out["strided"].untyped_storage().data_ptr() == base
    assert not out["strided"].is_contiguous()


def test_shared_chunk_golden_step_2_reads_step_1_file() -> None:
    """The shared-chunk case really shares: step 2's manifest names step 1's data file."""
    m = json.loads(
        (GOLDEN / "shared_chunk" / "store" / "step-000000000002" / "manifest.json").read_text()
    )
    assert any(f["name"].startswith("step-000000000001/") for f in m["files"])
