"""The Checkpointer under torch.distributed, two ranks in one process: each rank's
Checkpointer over an in-memory key-value store, ``async_save`` replaced by a recorder.

The engine pairs the ranks' saves by a per-save number, so the property checked is that
every rank makes the same saves in the same order, whatever goes wrong (the steps may
differ only where a decision came late: that save then fails whole). The runs with real
ranks are in tests/multiproc/test_sharded.py."""

from __future__ import annotations

import datetime
import itertools
import math
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

import snapcore
from snapcore.errors import SnapshotFailed
from snapcore.scheduling import checkpointer as cmod
from snapcore.scheduling import decisions as dmod
from snapcore.scheduling.preemption import SigtermGuard


class FakeKV:
    """The key-value store's calls that decisions.py makes, in memory (a wait wakes on
    any set or add, as a TCPStore's does)."""

    def __init__(self) -> None:
        self._d: dict[str, bytes] = {}
        self._cv = threading.Condition()

    def set(self, key: str, value: str | bytes) -> None:
        with self._cv:
            self._d[key] = value.encode() if isinstance(value, str) else value
            self._cv.notify_all()

    def add(self, key: str, n: int) -> int:
        with self._cv:
            value = int(self._d.get(key, b"0")) + n
            self._d[key] = str(value).encode()
            self._cv.notify_all()
            return value

    def check(self, keys: list[str]) -> bool:
        with self._cv:
            return all(k in self._d for k in keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None:
        with self._cv:
            if not self._cv.wait_for(
                lambda: all(k in self._d for k in keys), timeout.total_seconds()
            ):
                raise RuntimeError("Wait timeout")

    def get(self, key: str) -> bytes:
        self.wait([key], datetime.timedelta(seconds=5))
        return self._d[key]


@dataclass
class FakeJob:
    rank: int
    kv: FakeKV
    timeout_s: float = 5.0
    world_size: int = 2

    def key(self, *parts: object) -> str:
        return "snapcore/" + "/".join(str(p) for p in parts)


class FakeHandle:
    """A snapshot that is done at once, durable or failed in its first tier."""

    def __init__(self, step: int, tiers: tuple[str, ...], fail: BaseException | None) -> None:
        self.step, self.tiers, self._fail = step, tiers, fail
        durable = {} if fail else dict.fromkeys(tiers, 0.01)
        self.stats = SimpleNamespace(stall_s=0.0, tiers=durable)

    def done(self, tier: str | None = None) -> bool:
        return True

    def take_failure(self) -> tuple[str, BaseException] | None:
        fail, self._fail = self._fail, None
        return None if fail is None else (self.tiers[0], fail)

    def wait(self, timeout: float | None = None, tier: str | None = None) -> Any:
        if self.stats.tiers == {}:
            raise SnapshotFailed(f"step {self.step} failed", step=self.step, tier=self.tiers[0])
        return self.stats


@dataclass
class Rank:
    ckpt: Any
    saves: list[tuple[int, tuple[str, ...]]] = field(default_factory=list)
    fail_nth: set[int] = field(default_factory=set)  # these saves fail in the background
    raise_nth: set[int] = field(default_factory=set)  # async_save raises an earlier failure
    errors: list[tuple[int, str]] = field(default_factory=list)
    calls: int = 0


class Clock:
    t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def job(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """make(**kw) -> [rank 0, rank 1]: each with its own store (saves are recorded per
    store), a shared fake clock and key-value store; run(ranks, steps) drives them."""
    kv = FakeKV()
    clock = Clock()
    by_store: dict[str, Rank] = {}
    made: list[Rank] = []

    def async_save(state: Any, store: Any, *, step: int, tiers: Any, **kw: Any) -> FakeHandle:
        r = by_store[str(store.local)]
        r.calls += 1
        if r.calls in r.raise_nth:
            r.raise_nth.discard(r.calls)
            r.calls -= 1
            raise SnapshotFailed("an earlier snapshot failed", step=0, tier="local")
        r.saves.append((step, tuple(tiers)))
        fail = OSError(28, "injected") if r.calls in r.fail_nth else None
        return FakeHandle(step, tuple(tiers), fail)

    monkeypatch.setattr(cmod.api, "async_save", async_save)
    monkeypatch.setattr(cmod.Checkpointer, "_save_number", lambda self: None, raising=False)
    monkeypatch.setattr(SigtermGuard, "resend", staticmethod(lambda: None))

    def make(**kw: Any) -> list[Rank]:
        ranks = []
        for rank in (0, 1):
            store = tmp_path / f"r{rank}"
            monkeypatch.setattr(cmod, "current_job", lambda rank=rank: FakeJob(rank, kv))
            monkeypatch.setattr(dmod, "_ids", itertools.count(1))  # the same Checkpointer
            args = {"max_interval_s": 5.0, "replan_s": 1e9, "lead_steps": 2, **kw}
            ckpt = snapcore.Checkpointer(
                store, journal=False, handle_sigterm=False, clock=clock, **args
            )
            ckpt._begin()
            r = Rank(ckpt)
            by_store[str(ckpt.store.local)] = r
            ranks.append(r)
        made.extend(ranks)
        return ranks

    yield make, clock
    for r in made:
        if r.ckpt._decisions is not None:
            r.ckpt._decisions.close(join_s=0.5)


def run(ranks: list[Rank], clock: Clock, steps: range, before: Any = None) -> None:
    """Each step: rank 0's step(), rank 1's (once it has heard every decision published),
    a second on the clock. ``before(step)`` runs first."""
    for step in steps:
        if before is not None:
            before(step)
        clock.t += 1.0
        for r in ranks:
            if r.ckpt._closed:
                continue
            if r.ckpt._decisions is not None and r.ckpt._rank != 0:
                _heard(ranks[0], r)
            try:
                r.ckpt.step(step, {"step": step})
            except SnapshotFailed as e:
                r.errors.append((step, str(e)))


def _heard(r0: Rank, r: Rank) -> None:
    if not hasattr(r.ckpt._decisions, "heard"):  # (the code before the fix)
        time.sleep(0.02)
        return
    deadline = time.monotonic() + 5
    published = r0.ckpt._decisions._sent - (1 if r0.ckpt._closed else 0)  # not the stop
    while r.ckpt._decisions.heard < published:
        assert time.monotonic() < deadline, "rank 1 did not hear rank 0's decisions"
        time.sleep(0.001)


def _term(r: Rank) -> None:
    r.ckpt._sigterm._term_at = time.monotonic()  # what the handler records
    r.ckpt._on_sigterm()


def test_both_ranks_make_the_same_saves(job: Any) -> None:
    make, clock = job
    ranks = make()
    run(ranks, clock, range(40))
    r0, r1 = ranks
    assert r0.saves == r1.saves and len(r0.saves) >= 6
    assert r0.saves[0] == (0, ("local",))


@pytest.mark.parametrize("how", ["background", "raised by async_save"])
def test_a_failure_rank_1_hears_of_at_an_agreed_step_does_not_skip_that_save(
    job: Any, how: str
) -> None:
    make, clock = job
    r0, r1 = make()
    (r1.fail_nth if how == "background" else r1.raise_nth).add(3)
    run([r0, r1], clock, range(40))
    assert r0.saves == r1.saves and len(r0.saves) >= 6
    assert len(r1.errors) == 1
    step = r1.errors[0][0]
    assert step in [s for s, _ in r1.saves]  # raised at an agreed step, after its save


def test_a_sigterm_on_rank_0_before_its_first_step_gives_the_first_then_the_final(
    job: Any,
) -> None:
    make, clock = job
    r0, r1 = make()
    _term(r0)
    run([r0, r1], clock, range(10))
    assert r0.saves == r1.saves == [(0, ("local",)), (2, ("local",))]
    assert r0.ckpt._closed and not r1.ckpt._closed


def test_a_sigterm_on_rank_1_before_its_first_step_is_decided_by_rank_0(job: Any) -> None:
    make, clock = job
    r0, r1 = make()
    _term(r1)
    run([r0, r1], clock, range(10), before=lambda s: time.sleep(0.05) if s == 1 else None)
    assert r0.saves == r1.saves
    assert r0.saves[0][0] == 0 and len(r0.saves) == 2
    assert r1.ckpt._closed and not r0.ckpt._closed
    assert r1.ckpt._decisions._sent == 0  # rank 1 published nothing


def test_a_sigterm_with_an_ordinary_snapshot_published_keeps_it(job: Any) -> None:
    make, clock = job
    r0, r1 = make(lead_steps=4)
    state = {"termed": False}

    def before(step: int) -> None:
        queued = [*r0.ckpt._decisions._queue, *filter(None, [r0.ckpt._planned])]
        if not state["termed"] and step > 6 and any(not d.final for d in queued):
            state["termed"] = True
            _term(r0)
            _term(r1)

    run([r0, r1], clock, range(40), before=before)
    assert state["termed"]
    assert r0.saves == r1.saves
    *_, (ordinary, _), (final, tiers) = r0.saves
    assert ordinary < final and tiers == ("local",)
    assert r0.ckpt._closed and r1.ckpt._closed


def test_a_decision_heard_late_is_saved_at_the_current_step(job: Any) -> None:
    make, clock = job
    r0, r1 = make()
    real_next = r1.ckpt._decisions.next
    held: dict[str, Any] = {"n": 0, "d": None, "calls": 0}

    def next_() -> Any:
        if held["d"] is not None:
            held["calls"] += 1
            if held["calls"] <= 3:
                return None
            d, held["d"] = held["d"], None
            return d
        d = real_next()
        if d is not None:
            held["n"] += 1
            if held["n"] == 2:
                held["d"] = d
                return None
        return d

    r1.ckpt._decisions.next = next_
    run([r0, r1], clock, range(40))
    assert len(r0.saves) == len(r1.saves) >= 6
    late = [i for i, (a, b) in enumerate(zip(r0.saves, r1.saves, strict=True)) if a != b]
    assert late == [2] and r1.saves[2][0] > r0.saves[2][0]


def test_close_sends_the_same_tiers_on_every_rank_whichever_saw_a_failure(job: Any) -> None:
    """The last step's snapshot failed, and rank 0 saw it before close() (its schedule
    polls between agreed steps) while rank 1 did not: close() sends it again on no rank
    rather than on rank 0 alone."""
    make, clock = job
    r0, r1 = make()
    r0.fail_nth.add(2)  # the first decided snapshot fails (seen at once on rank 0)
    step = 0
    while len(r0.saves) < 2:
        run([r0, r1], clock, range(step, step + 1))
        step += 1
    r0.ckpt._next_check = -math.inf  # its poll (every 0.5 s) falls at this step
    run([r0, r1], clock, range(step - 1, step))  # step() again with the same step
    assert r0.errors and not r1.errors  # rank 0 saw it at that step, rank 1 not yet
    r0.ckpt.close()
    r1.ckpt.close()
    assert r0.saves == r1.saves and len(r0.saves) == 2


def test_snapshot_now_is_made_on_every_rank_before_an_earlier_failure_is_raised(
    job: Any,
) -> None:
    make, clock = job
    r0, r1 = make()
    r1.fail_nth.add(1)  # the first snapshot fails on rank 1
    run([r0, r1], clock, range(2))
    r0.ckpt.snapshot_now({"step": 1}, 1)
    with pytest.raises(SnapshotFailed, match="step 0"):
        r1.ckpt.snapshot_now({"step": 1}, 1)
    assert r0.saves == r1.saves == [(0, ("local",)), (1, ("local",))]
