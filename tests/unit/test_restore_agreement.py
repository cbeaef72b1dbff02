"""What the ranks of a restore agree on: the same save of a step, not only its number
(a re-saved step whose newer save reached some nodes only is never read as a mix of two
saves), and the same call (restore(step=None) on one rank and step=N on another raise
OutOfStep on both). In one process: the other rank is played by a fake all_gather that
answers each of this rank's messages (``api._read_agreed``, ``read.exchange_save``).
The multi-process runs are in tests/multiproc/test_sharded.py."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import snapcore
from snapcore import api, read
from snapcore import manifest as mf
from snapcore.errors import CorruptSnapshot
from snapcore.read import OutOfStep, Reader, exchange_save, save_of
from snapcore.tiers import LocalTier
from snapcore.write.commit import ShardedSave
from snapcore.write.manifest_builder import build_index

JOB = SimpleNamespace(rank=0, world_size=2, host="here")


@pytest.fixture(autouse=True)
def _closed() -> Iterator[None]:
    yield
    snapcore.close()


def _save(root: Path, step: int, value: float, save: str | None) -> None:
    """Step ``step`` of {"w": [value] * 4} in ``root``, its manifest naming ``save``
    (as a sharded step's index does: writer.save)."""
    snapcore.save({"w": torch.full((4,), value)}, root, step=step)
    path = root / f"step-{step:012d}" / "manifest.json"
    doc = json.loads(path.read_bytes())
    if save is not None:
        doc["writer"]["save"] = save
    path.write_text(json.dumps(doc))


def _other_rank(monkeypatch: pytest.MonkeyPatch, answer: Callable[[dict[str, Any]], Any]) -> list:
    """Rank 1 answers each of rank 0's messages with ``answer(message)``; returns the
    messages rank 0 sent."""
    sent: list[dict[str, Any]] = []

    def gather(job: Any, data: bytes, group: Any = None) -> list[bytes]:
        mine = json.loads(data)
        sent.append(mine)
        return [data, json.dumps(answer(mine)).encode()]

    monkeypatch.setattr(api, "all_gather_bytes", gather)
    monkeypatch.setattr(read, "all_gather_bytes", gather)
    return sent


def _agreed(root: Path, step: int | None = None) -> tuple[Any, Reader, list[str]]:
    engine = api.engine_for(root)

    def use(reader: Reader) -> Any:
        reader.select(None, 1)
        return reader.load_tree()

    return api._read_agreed(engine, api.committed(root), JOB, True, use, step)  # type: ignore[arg-type]


def _holding(save: str, t: float = 1.0e9, whole: bool = True) -> dict[str, Any]:
    return {save: {"t": t, "tiers": ["local"], "whole": whole}}


def test_ranks_holding_different_saves_of_a_step_skip_it_together(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """This rank holds save "b" of step 2, the other rank only save "a" (its node kept
    the first save): neither restores step 2 (a mix of two saves), both take step 1."""
    _save(tmp_path, 1, 1.0, "s1")
    _save(tmp_path, 2, 2.0, "b")

    def answer(mine: Any) -> Any:
        if isinstance(mine, dict) and mine["kind"] == "save" and mine["step"] == 2:
            return {**mine, "saves": _holding("a")}
        return mine

    sent = _other_rank(monkeypatch, answer)
    tree, reader, skipped = _agreed(tmp_path)
    assert reader.m.step == 1 and torch.equal(tree["w"], torch.full((4,), 1.0))
    assert len(skipped) == 1 and skipped[0].startswith("step 2: the ranks hold different saves")
    assert "rank 0: the save b of " in skipped[0] and "rank 1: the save a of " in skipped[0]
    # what this rank told: its save of each step tried, before reading anything of it
    saves = [m for m in sent if m["kind"] == "save"]
    assert [(m["step"], list(m["saves"])) for m in saves] == [(2, ["b"]), (1, ["s1"])]
    assert saves[0]["saves"]["b"]["tiers"] == ["local"] and saves[0]["saves"]["b"]["whole"]

    # asked for by name, step 2 raises on every rank alike, naming why
    with pytest.raises(CorruptSnapshot, match="step 2: the ranks hold different saves"):
        _agreed(tmp_path, step=2)


def test_the_same_save_on_every_rank_is_restored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _save(tmp_path, 2, 2.0, "b")
    _other_rank(monkeypatch, lambda mine: mine)
    tree, reader, skipped = _agreed(tmp_path)
    assert reader.m.step == 2 and skipped == [] and reader.damaged == []
    assert torch.equal(tree["w"], torch.full((4,), 2.0))


def test_a_rank_that_asks_for_another_step_makes_every_rank_raise_out_of_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """restore(step=None) here, restore(step=1) on the other rank: this rank raises
    OutOfStep, as the other does (it used to take the other's message for a list of
    steps, find no step in common and raise "nothing to restore")."""
    _save(tmp_path, 1, 1.0, None)
    _other_rank(monkeypatch, lambda mine: {"kind": "steps", "step": 1, "steps": [1]})
    with pytest.raises(OutOfStep, match=r"rank 0: restore\(step=None\), rank 1: restore\(step=1\)"):
        _agreed(tmp_path)
    _other_rank(monkeypatch, lambda mine: {"kind": "steps", "step": None, "steps": [1]})
    with pytest.raises(OutOfStep, match=r"rank 0: restore\(step=1\), rank 1: restore\(step=None\)"):
        _agreed(tmp_path, step=1)


def _sources(tmp_path: Path, saves: dict[str, float]) -> list[tuple[LocalTier, mf.Manifest]]:
    """Step 2 in one directory per save (their order: the tiers' order), save "a" the
    older; each directory's manifest names its save."""
    out = []
    for i, (save, value) in enumerate(saves.items()):
        root = tmp_path / f"tier{i}"
        _save(root, 2, value, save)
        tier = LocalTier(root)
        m = tier.read_manifest(2)
        m.created_unix = 1.0e9 + value  # "b" newer than "a"
        out.append((tier, m))
    return out


def test_exchange_save_takes_the_newest_save_every_rank_reaches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sources = _sources(tmp_path, {"b": 2.0, "a": 1.0})  # this rank holds both
    cases = [
        ({"failed": False, "saves": {**_holding("a"), **_holding("b")}}, ("b", None)),
        ({"failed": False, "saves": _holding("a")}, ("a", None)),
        # the other rank's part is not in its copy of "b": "a", which it reaches whole
        ({"failed": False, "saves": {**_holding("a"), **_holding("b", whole=False)}}, ("a", None)),
        # no save it reaches whole: the newest it reaches (its read then says what is missing)
        ({"failed": False, "saves": _holding("b", whole=False)}, ("b", None)),
        # a rank that cannot open the step says so in its own way: the others take theirs
        ({"failed": True, "saves": {}}, ("b", None)),
    ]
    for theirs, expected in cases:
        _other_rank(monkeypatch, lambda mine, theirs=theirs: {**mine, **theirs})
        assert exchange_save(JOB, 2, sources, False) == expected, theirs  # type: ignore[arg-type]
    _other_rank(monkeypatch, lambda mine: {**mine, "saves": _holding("c")})
    save, why = exchange_save(JOB, 2, sources, False)  # type: ignore[arg-type]
    assert save is None and why is not None and why.startswith("step 2: the ranks hold different")
    # the other rank's step 3 is not this rank's step 2: no pairing of the two
    _other_rank(monkeypatch, lambda mine: {**mine, "step": 3})
    with pytest.raises(OutOfStep, match="rank 0: save of step 2, rank 1: save of step 3"):
        exchange_save(JOB, 2, sources, False)  # type: ignore[arg-type]


def test_a_reader_never_reads_another_save_than_its_reference(tmp_path: Path) -> None:
    """Two tiers holding different saves of a step: the first is the reference and the
    other is not read (it used to serve the chunks it holds); with ``save``, the
    reference is a source of that save."""
    sources = _sources(tmp_path, {"b": 2.0, "a": 1.0})
    reader = Reader(sources)  # type: ignore[arg-type]
    assert [t for t, _ in reader.sources] == [sources[0][0]]
    (note,) = reader.damaged
    assert note.startswith("local: holds the save a of ") and "not the save b of " in note
    assert torch.equal(reader.load_tree()["w"], torch.full((4,), 2.0))

    reader = Reader(sources, save="a")  # type: ignore[arg-type]
    assert [t for t, _ in reader.sources] == [sources[1][0]] and save_of(reader.m) == "a"
    assert torch.equal(reader.load_tree()["w"], torch.full((4,), 1.0))
    with pytest.raises(CorruptSnapshot, match="no tier read here holds the save c"):
        Reader(sources, save="c")  # type: ignore[arg-type]


def test_every_tier_s_index_of_a_save_names_it_and_an_older_index_names_none() -> None:
    parts = [mf.PartRef(0, "step-000000000004/part-00000-0123456789ab.json", 10, "0" * 32)]
    index = build_index(4, "ab" * 32, parts, save="0123456789abcdef")
    parsed = mf.parse_any(index.dumps(), where="index")
    assert isinstance(parsed, mf.Index) and save_of(parsed) == "0123456789abcdef"
    assert parsed.writer["pid"] > 0  # the writer's other fields are there as before
    older = mf.parse_any(build_index(4, "ab" * 32, parts).dumps(), where="index")
    assert "save" not in older.writer and save_of(older) == ""  # type: ignore[union-attr]
    # each save of a job is a save of its own
    job = SimpleNamespace(rank=0, world_size=1)
    saves = {ShardedSave.failed_seq(job, None, 1, seq).save for seq in range(8)}  # type: ignore[arg-type]
    assert len(saves) == 8
