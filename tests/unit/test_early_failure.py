"""A sharded save that fails on one rank before it takes its number (a second writer holds
the node's lock, the state's walk, the peer tier's link): the rank takes the number all
the same and raises with the others, in the plan's exchange when one is made, at once
otherwise (``Sharder.part``); the peer link's exchange carries a rank's failure to read
its settings the same way (``peer.link._make``). The exchanges are faked here; the
multi-process tests are in tests/multiproc/test_sharded.py ("before its save takes its
number")."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from snapcore.distributed.job import Job
from snapcore.errors import SnapcoreError, SnapshotFailed, StoreInUse, UnsupportedState
from snapcore.peer import link
from snapcore.tiers import Store
from snapcore.tree import flatten
from snapcore.write import sharded
from snapcore.write.sharded import Sharder


def job(rank: int) -> Job:
    return Job(rank, 2, None, None, "127.0.0.1", 0, "h", 5.0)


class Exchange:
    """``all_gather_bytes`` of a job of two ranks, on rank ``rank``: its bytes (kept in
    ``sent``), and the other rank's ``other``."""

    def __init__(self, rank: int, other: dict[str, Any]) -> None:
        self.rank, self.other, self.sent = rank, other, []  # type: list[dict[str, Any]]

    def __call__(self, job: Any, data: bytes, group: Any = None) -> list[bytes]:
        self.sent.append(json.loads(data))
        other = json.dumps(self.other).encode()
        return [data, other] if self.rank == 0 else [other, data]


def said(error: list[Any] | None) -> dict[str, Any]:
    return {"g": "0" * 64, "n": 2, "host": "h", "local": None, "area": None, "error": error}


def in_use() -> StoreInUse:
    return StoreInUse("ckpt/ is being saved to by another live process", path="ckpt/writer.lock")


def test_a_rank_that_failed_early_raises_its_error_in_the_exchange_with_its_number_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = Exchange(1, said(None))
    monkeypatch.setattr(sharded, "all_gather_bytes", fake)
    sh = Sharder(job(1), None)
    with pytest.raises(StoreInUse):
        sh.part(None, in_use())
    assert sh.seq == 1 and sh.cached is None  # the number used up; the next save agrees
    (mine,) = fake.sent
    assert mine["error"][0] == "StoreInUse" and mine["error"][3] == "early"


def test_the_other_ranks_raise_at_once_naming_the_rank_and_its_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    error = ["StoreInUse", str(in_use()), "ckpt/writer.lock", "early"]
    monkeypatch.setattr(sharded, "all_gather_bytes", Exchange(0, said(error)))
    sh = Sharder(job(0), None)
    with pytest.raises(SnapshotFailed) as e:
        sh.part(flatten({"w": torch.zeros(3)}))
    assert str(e.value) == (
        "rank 1 failed before its save could begin: StoreInUse: ckpt/ is being saved to by "
        "another live process"
    )
    assert e.value.tier is None and sh.seq == 1


def test_a_state_the_rank_cannot_walk_is_raised_as_its_own_kind_on_the_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    error = ["UnsupportedState", "bad: cannot save a value of type builtins.object", "bad"]
    monkeypatch.setattr(sharded, "all_gather_bytes", Exchange(0, said([*error, "early"])))
    with pytest.raises(UnsupportedState, match=r"^rank 1 cannot save its state: bad: ") as e:
        Sharder(job(0), None).part(flatten({"w": torch.zeros(3)}))
    assert e.value.path == "bad"
    # a refusal of three fields (its state's description) reads as before
    monkeypatch.setattr(sharded, "all_gather_bytes", Exchange(0, said(error)))
    with pytest.raises(UnsupportedState, match=r"^rank 1 cannot save its state: bad: "):
        Sharder(job(0), None).part(flatten({"w": torch.zeros(3)}))


def test_without_an_exchange_the_rank_raises_at_once_with_its_number_taken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A later save whose plan is agreed (the last verdict "ok"): no exchange, the error
    at once (the engine tells the coordinator, whose verdict fails the others' save)."""

    def no_exchange(*args: Any, **kw: Any) -> list[bytes]:
        raise AssertionError("no exchange in the steady state")

    monkeypatch.setattr(sharded, "all_gather_bytes", no_exchange)
    sh = Sharder(job(1), None)
    sh.cached, sh.seq = object(), 3  # type: ignore[assignment]
    sh.set_verdict(3, "ok")
    with pytest.raises(StoreInUse):
        sh.part(None, in_use())
    assert sh.seq == 4 and sh.last is None


def test_a_rank_that_cannot_read_its_peer_settings_says_so_in_the_links_exchange(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = Store(host="early-unit", peer=True)
    assert store.peer_spec is not None

    def bad() -> str | None:
        raise ValueError("SNAPCORE_FAILURE_DOMAIN: no")

    other = {"home": ["h", "early-unit", None], "error": None}
    fake = Exchange(1, other)
    monkeypatch.setattr(link, "all_gather_bytes", fake)
    monkeypatch.setattr(link.settings, "failure_domain", bad)
    with pytest.raises(ValueError, match="SNAPCORE_FAILURE_DOMAIN: no"):
        link._make(job(1), store, store.peer_spec)
    assert fake.sent == [{"home": None, "error": ["ValueError", "SNAPCORE_FAILURE_DOMAIN: no"]}]

    # the other rank: the same kind (a restore passes a ValueError over on every rank)
    monkeypatch.setattr(link, "all_gather_bytes", Exchange(0, fake.sent[0]))
    monkeypatch.setattr(link.settings, "failure_domain", lambda: None)
    with pytest.raises(ValueError, match=r": rank 1 cannot join the peer tier: ValueError: "):
        link._make(job(0), store, store.peer_spec)
    other = {"home": None, "error": ["RuntimeError", "no thread"]}
    monkeypatch.setattr(link, "all_gather_bytes", Exchange(0, other))
    with pytest.raises(SnapcoreError, match=r": rank 1 cannot join the peer tier: RuntimeError: "):
        link._make(job(0), store, store.peer_spec)
