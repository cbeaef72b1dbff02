"""The Checkpointer: restore, snapshots at the planned intervals, tiers, failures, SIGTERM."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import snapcore
from snapcore.errors import SnapshotFailed
from snapcore.scheduling import journal as jn
from snapcore.scheduling.policy import make_schedule
from snapcore.tiers import TIER_ORDER
from snapcore.write.engine import close_all


class FakeClock:
    """Seconds that move only when the test says so: schedules become deterministic."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(autouse=True)
def _clean_up():
    handler = signal.getsignal(signal.SIGTERM)
    yield
    close_all()
    signal.signal(signal.SIGTERM, handler)


def make_state(seed: int = 0) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 32, generator=g), "step": 0}


def run_steps(ckpt: snapcore.Checkpointer, clock: FakeClock, state, steps, dt: float = 1.0):
    """Train for ``steps`` (fake) seconds-long steps; each snapshot is let finish before the
    next step, so that no tier is ever busy (the real engine is faster than no time)."""
    for step in steps:
        clock.t += dt
        state["step"] = step
        before = ckpt.stats().snapshots
        ckpt.step(step, state)
        if ckpt.stats().snapshots != before:
            ckpt.wait()


def replay(intervals: dict[str, float], steps: range, t0: float = 0.0, dt: float = 1.0):
    """The documented rule: the first step snapshots every tier; then a tier is due once
    its interval has elapsed since its last snapshot began, and tiers due within half
    the fastest interval join it."""
    last = dict.fromkeys(intervals, t0)
    out = []
    now = t0
    for i, step in enumerate(steps):
        now += dt
        if i == 0:
            out.append((step, [t for t in TIER_ORDER if t in intervals]))
            last = dict.fromkeys(intervals, now)
        elif any(now >= last[t] + iv for t, iv in intervals.items()):
            slack = 0.5 * min(intervals.values())
            due = [
                t for t in TIER_ORDER if t in intervals and now + slack >= last[t] + intervals[t]
            ]
            out.append((step, due))
            for t in due:
                last[t] = now
    return out


def with_final(want: list[tuple[int, list[str]]], last: int, tiers: list[str]):
    """What close() adds: the last step, to the tiers that were not sent it."""
    sent = {t for s, ts in want if s == last for t in ts}
    missing = [t for t in tiers if t not in sent]
    return [*want, (last, missing)] if missing else want


def journal_snapshots(store) -> list[tuple[int, list[str]]]:
    c = jn.read_journal(jn.journal_path(store))
    return [(e.data["step"], e.data["tiers"]) for e in c.events if e.kind == "snapshot"]


def test_restore_returns_0_on_an_empty_store_then_the_next_step(tmp_path):
    clock = FakeClock()
    state = make_state(1)
    ckpt = snapcore.Checkpointer(tmp_path, clock=clock)
    assert ckpt.restore(state) == 0
    state["step"] = 7
    stats = ckpt.snapshot_now(state, 7)
    assert stats.step == 7 and "local" in stats.tiers
    ckpt.close()
    assert snapcore.committed(tmp_path)["local"] == [7]

    fresh = make_state(2)
    ckpt = snapcore.Checkpointer(tmp_path, clock=clock)
    assert ckpt.restore(fresh) == 8
    assert torch.equal(fresh["w"], state["w"]) and fresh["step"] == 7
    assert ckpt.stats().restored_step == 7 and ckpt.stats().restored_from == "local"
    assert "restore_s:local" in ckpt.plan().costs.measured
    ckpt.close()
    kinds = [
        (e.kind, e.data.get("clean")) for e in jn.read_journal(tmp_path / "journal.jsonl").events
    ]
    assert kinds == [
        ("start", None),
        ("snapshot", None),
        ("exit", True),
        ("start", None),
        ("restore", None),
        ("exit", True),
    ]
    assert jn.failure_history(tmp_path)[0] == 0


def test_snapshots_come_at_the_planned_interval(tmp_path):
    clock = FakeClock()
    state = make_state()
    # replan_s=inf: the first plan (default costs) stays, so the schedule is known
    store = snapcore.Store(local=tmp_path, retention={"local": 0})  # keep every step
    ckpt = snapcore.Checkpointer(store, devices=16384, replan_s=math.inf, clock=clock)
    assert ckpt.restore(state) == 0
    interval = ckpt.plan().intervals_s
    assert set(interval) == {"local"} and 60 < interval["local"] < 600
    run_steps(ckpt, clock, state, range(2000))
    ckpt.close()
    want = with_final(replay(interval, range(2000)), 1999, ["local"])
    assert len(want) >= 4
    assert journal_snapshots(tmp_path) == want
    assert ckpt.stats().snapshots == len(want)
    assert snapcore.committed(tmp_path)["local"] == [s for s, _ in want]


def test_step_measures_costs_and_replans(tmp_path, monkeypatch):
    # The costs a snapshot reports are set here (a 10 ms stall, durable 30 ms after the
    # call), so that what the Checkpointer measures does not depend on the machine's speed
    real = snapcore.api.async_save

    def save(*args: Any, **kwargs: Any) -> Any:
        h = real(*args, **kwargs)
        h.wait()
        h.stats.stall_s = 0.01
        h.stats.tiers = dict.fromkeys(h.stats.tiers, 0.03)
        return h

    monkeypatch.setattr(snapcore.api, "async_save", save)
    clock = FakeClock()
    state = make_state()
    ckpt = snapcore.Checkpointer(tmp_path, devices=16384, replan_s=5.0, clock=clock)
    first = ckpt.plan()
    assert first.costs.measured == frozenset() and first.intervals_steps is None
    assert ckpt.stats().costs.stall_s == 1.0  # the default, until measured
    run_steps(ckpt, clock, state, range(300), dt=0.5)
    ckpt.close()
    p = ckpt.plan()
    assert {"step_s", "stall_s", "persist_s:local"} <= p.costs.measured
    assert p.costs.step_s == pytest.approx(0.5, rel=0.05)
    assert p.costs.stall_s == pytest.approx(0.01)  # measured, in place of the default 1 s
    assert p.costs.persist_s["local"] == pytest.approx(0.02)  # durable less the stall
    assert p.intervals_steps == {"local": round(p.intervals_s["local"] / p.costs.step_s)}
    # cheaper snapshots than the defaults assumed: more often, and less waste predicted
    assert p.intervals_s["local"] < first.intervals_s["local"]
    assert p.predicted_waste < first.predicted_waste
    assert ckpt.stats().replans >= 2


def _persisting_for(
    seconds: float, clock: FakeClock, monkeypatch: Any, stall: float = 0.0
) -> list[float]:
    """Make every snapshot block training for ``stall`` seconds of the fake clock, then
    persist for ``seconds`` (its handle says done only then, and durable then); returns
    the list the clock at each snapshot's call goes into."""
    windows: list[float] = []
    real = snapcore.api.async_save

    def save(*args: Any, **kwargs: Any) -> Any:
        h = real(*args, **kwargs)
        h.wait()
        since = clock.t
        clock.t += stall
        windows.append(since)
        h.stats.stall_s = stall
        h.stats.tiers = dict.fromkeys(h.stats.tiers, stall + seconds)
        h.done = lambda tier=None: clock.t >= since + stall + seconds
        return h

    monkeypatch.setattr(snapcore.api, "async_save", save)
    return windows


def test_step_measures_the_slowdown_while_snapshots_persist(tmp_path, monkeypatch):
    # Each snapshot persists for 30 s of the fake clock (its handle says done only then,
    # and durable 30 s after the call); training's steps take 1.25 s meanwhile, 1 s
    # otherwise. The Checkpointer measures a slowdown of 0.25 and plans with it.
    clock = FakeClock()
    windows = _persisting_for(30.0, clock, monkeypatch)
    state = make_state()
    ckpt = snapcore.Checkpointer(tmp_path, devices=16384, replan_s=5.0, clock=clock)
    assert ckpt.plan().costs.slowdown == 0.05  # the given one, until measured
    for step in range(3000):
        persisting = bool(windows) and clock.t < windows[-1] + 30.0
        clock.t += 1.25 if persisting else 1.0
        ckpt.step(step, state)
        if ckpt.stats().snapshots >= 6:
            break
    p = ckpt.plan()
    clock.t += 30.0  # the last snapshot done: close() waits for it
    ckpt.close()
    assert len(windows) >= 6
    assert "slowdown" in p.costs.measured
    assert p.costs.slowdown == pytest.approx(0.25, abs=0.02)
    assert p.costs.persist_s["local"] == pytest.approx(30.0)
    # the same costs with the given slowdown: snapshots would come more often
    given = dataclasses.replace(p.costs, slowdown=0.05, measured=p.costs.measured - {"slowdown"})
    other = make_schedule(given, p.rate, ("local",), target=p.target, max_interval_s=3600.0)
    assert p.intervals_s["local"] > other.intervals_s["local"]


def test_a_short_persist_is_measured_over_all_of_it(tmp_path, monkeypatch):
    # Each snapshot persists for 0.8 s: training's steps take 30 ms in its first 0.1 s
    # (the host copy's work), 12 ms in the rest, 10 ms when none persists. Over the steps
    # in flight that is a slowdown of 0.32. Looking every POLL_S (0.5 s) and counting only
    # stretches 90% covered, the Checkpointer measured only the first stretch of each
    # (the second is 60% covered): 0.40. Once the persist time is measured it looks every
    # 0.2 s, and the stretch that a persist ends in counts for its covered part.
    clock = FakeClock()
    windows = _persisting_for(0.8, clock, monkeypatch)
    state = make_state()
    ckpt = snapcore.Checkpointer(
        tmp_path, devices=16384, max_interval_s=2.0, replan_s=5.0, clock=clock
    )
    looks: list[float] = []  # how long after a snapshot's call its first look came
    tick = ckpt._tick

    def spy(*args: Any) -> Any:
        if windows and len(looks) < len(windows):
            looks.append(clock.t - windows[-1])
        return tick(*args)

    monkeypatch.setattr(ckpt, "_tick", spy)
    for step in range(20000):
        age = clock.t - windows[-1] if windows else math.inf
        clock.t += 0.03 if age < 0.1 else 0.012 if age < 0.8 else 0.01
        ckpt.step(step, state)
        if ckpt.stats().snapshots >= 20:
            break
    costs = ckpt.stats().costs
    clock.t += 1.0
    ckpt.close()
    assert looks[0] == pytest.approx(0.5, abs=0.03)  # the persist time not known yet
    assert looks[-1] == pytest.approx(0.2, abs=0.03)  # a quarter of the measured 0.8 s
    assert "slowdown" in costs.measured
    # the loop's own: 4 steps of 30 ms and 57 of 12 ms in each 0.8 s persist, 0.32
    assert costs.slowdown == pytest.approx(0.32, abs=0.015)


class _RankZeroDecisions:
    """Rank 0's agreement under torch.distributed, without a job: what it publishes comes
    back to it in order (as the real one's queue does)."""

    def __init__(self) -> None:
        self.queue: list[Any] = []
        self.last_step = -1
        self.final_requested = False

    def publish(self, step: int, tiers: tuple[str, ...], *, final: bool = False) -> None:
        from snapcore.scheduling.decisions import Decision

        self.queue.append(Decision(step, tuple(tiers), final))
        self.last_step = max(self.last_step, step)

    def next(self) -> Any:
        return self.queue.pop(0) if self.queue else None

    def request_final(self) -> None:
        pass

    def close(self, join_s: float | None = None) -> None:
        pass


@pytest.mark.parametrize("agreed", [False, True], ids=["one process", "rank 0"])
def test_a_stall_is_not_measured_as_a_slowdown(tmp_path, monkeypatch, agreed):
    # Steps of 6 s whether a snapshot persists or not; each snapshot stalls 2 s and
    # persists 30 s. Rank 0 makes its agreed saves before the slow call of the same
    # step(), whose stretch once ended before the stall: the stall was taken off the
    # quiet stretch before it and left in the busy one after (a slowdown of 0.085).
    clock = FakeClock()
    _persisting_for(30.0, clock, monkeypatch, stall=2.0)
    state = make_state()
    ckpt = snapcore.Checkpointer(
        tmp_path, devices=16384, max_interval_s=120.0, clock=clock, journal=False
    )
    for step in range(600):
        clock.t += 6.0
        ckpt.step(step, state)
        if step == 0 and agreed:
            ckpt._decisions = _RankZeroDecisions()  # type: ignore[assignment]
            ckpt._rank = 0
    costs = ckpt.stats().costs
    snapshots = ckpt.stats().snapshots
    clock.t += 60.0
    ckpt._decisions = None
    ckpt.close(final=False)
    assert snapshots >= 25 and "slowdown" in costs.measured
    assert costs.slowdown == pytest.approx(0.0, abs=1e-9)


def test_several_tiers_share_one_staged_copy(tmp_path, host_name):
    clock = FakeClock()
    state = make_state()
    store = snapcore.Store(
        host=host_name,
        local=tmp_path / "local",
        remote=(tmp_path / "remote").as_uri(),
        retention={"local": 0, "remote": 0},  # keep every step
    )
    ckpt = snapcore.Checkpointer(store, devices=16384, replan_s=math.inf, clock=clock)
    assert ckpt.restore(state) == 0
    p = ckpt.plan()
    # crashes recover from host memory, lost machines from remote; local is written with
    # every remote snapshot, since uploads read the local copy
    assert p.recovers_from == {"process": "host", "machine": "remote"}
    assert set(p.intervals_s) == {"host", "local", "remote"} and "local" in p.forced
    assert p.intervals_s["host"] < p.intervals_s["remote"] == p.intervals_s["local"]
    run_steps(ckpt, clock, state, range(2500))
    ckpt.close()
    want = with_final(replay(p.intervals_s, range(2500)), 2499, ["host", "local", "remote"])
    assert journal_snapshots(store) == want
    assert any(tiers == ["host"] for _, tiers in want)
    assert any(tiers == ["host", "local", "remote"] for _, tiers in want)
    committed = snapcore.committed(store)
    assert committed["remote"] == [s for s, t in want if "remote" in t]
    assert committed["host"][-1] == want[-1][0] if "host" in want[-1][1] else True
    assert ckpt.stats().per_tier["host"] == sum("host" in t for _, t in want)


def test_host_and_local_only_writes_local_for_lost_machines(tmp_path, host_name):
    clock = FakeClock()
    ckpt = snapcore.Checkpointer(
        snapcore.Store(host=host_name, local=tmp_path), devices=16384, replan_s=60, clock=clock
    )
    p = ckpt.plan()
    assert p.uncovered == ("machine",)  # no tier survives a lost machine: local is the best
    assert "local" in p.intervals_s and p.recovers_from["machine"] == "local"
    state = make_state()
    ckpt.restore(state)
    run_steps(ckpt, clock, state, range(400))
    ckpt.close()
    assert snapcore.committed(snapcore.Store(local=tmp_path))["local"]


def test_plan_says_when_the_target_is_out_of_reach(tmp_path):
    far = snapcore.Checkpointer(tmp_path, devices=100_000, target_waste=0.02)
    p = far.plan()
    assert not p.target_met
    assert p.shortfall == pytest.approx(p.predicted_waste - 0.02)
    assert p.waste.total == pytest.approx(p.waste.overhead + p.waste.redone + p.waste.restart)
    assert (
        p.rate.conservative_per_hour
        > p.rate.mean_per_hour
        == pytest.approx(100_000 * 419 / (54 * 24 * 16384))
    )
    far.close()
    near = snapcore.Checkpointer(tmp_path, devices=8, target_waste=0.02)
    assert near.plan().target_met and near.plan().shortfall == 0.0
    near.close()


def write_history(path: Path, runs: int, failures: int, hours_each: float, tier: str) -> None:
    """``runs`` runs of ``hours_each``; the first ``failures`` end uncleanly, each followed
    by a run that restored from ``tier``."""
    t = 0.0
    for i in range(runs):
        w = jn.JournalWriter(path)
        w.start(devices=1024, at=t)
        if i > 0:
            w.restore(i, tier if i <= failures else "local", at=t + 1)
        w.snapshot(i, ["local"], at=t + hours_each * 3600)
        if i >= failures:
            w.exit(clean=True, at=t + hours_each * 3600)
        w.close()
        t += hours_each * 3600 + 60


def test_failures_in_the_journal_shorten_the_intervals(tmp_path):
    calm, rough = tmp_path / "calm", tmp_path / "rough"
    write_history(calm / "journal.jsonl", runs=11, failures=0, hours_each=10, tier="remote")
    write_history(rough / "journal.jsonl", runs=11, failures=10, hours_each=10, tier="remote")
    a = snapcore.Checkpointer(calm, devices=1024)
    b = snapcore.Checkpointer(rough, devices=1024)
    assert a.plan().rate.failures == 0 and a.plan().rate.exposure_hours == pytest.approx(110)
    assert b.plan().rate.failures == 10 and b.plan().rate.by_class["machine"] == 10
    assert b.plan().rate.conservative_per_hour > 2 * a.plan().rate.conservative_per_hour
    assert b.plan().intervals_s["local"] < 0.7 * a.plan().intervals_s["local"]
    assert b.plan().predicted_waste > a.plan().predicted_waste
    a.close()
    b.close()


def test_a_dead_run_is_classed_by_this_runs_restore_and_a_rollback_counts(
    tmp_path, host_name, monkeypatch
):
    monkeypatch.setattr(jn, "MIN_RUN_S", 0.0)  # these runs last milliseconds (see test_journal)
    clock = FakeClock()
    store = snapcore.Store(host=host_name, local=tmp_path)
    state = make_state()
    first = snapcore.Checkpointer(store, clock=clock, handle_sigterm=False)
    first.restore(state)
    first.snapshot_now(state, 3)
    first._shutdown()  # dies without a clean exit (the journal's lock goes with it)

    second = snapcore.Checkpointer(store, clock=clock, handle_sigterm=False)
    assert second.plan().rate.by_class == {
        "process": 0,
        "machine": 0,
        "correlated": 0,
        "unknown": 1,
    }
    assert second.restore(state) == 4  # from host memory: the process crashed, not the machine
    assert second.plan().rate.by_class == {
        "process": 1,
        "machine": 0,
        "correlated": 0,
        "unknown": 0,
    }
    run_steps(second, clock, state, range(4, 10))
    # a rollback in the middle of the run, to the first step after the restore (which
    # was snapshotted)
    assert second.restore(state) == 5
    assert second.plan().rate.failures == 2
    second.close()
    h = jn.read_history(store)
    assert h.failures == 2 and h.by_class["process"] == 2


def test_background_failure_is_raised_once(tmp_path, monkeypatch, caplog):
    from snapcore.write import local as persist

    clock = FakeClock()
    state = make_state()
    ckpt = snapcore.Checkpointer(tmp_path, devices=16384, replan_s=math.inf, clock=clock)
    ckpt.restore(state)
    interval = ckpt.plan().intervals_s["local"]

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device (injected)")

    monkeypatch.setattr(persist.LocalWriter, "write", broken)
    raised = []
    step = 0
    deadline = time.monotonic() + 20
    while clock.t < 3 * interval and time.monotonic() < deadline:
        clock.t += 1.0
        try:
            ckpt.step(step, state)
        except SnapshotFailed as e:
            raised.append(e)
            monkeypatch.undo()  # the disk is back
        if ckpt.stats().in_flight:
            time.sleep(0.001)  # let the failing snapshot fail (real time)
            clock.t -= 1.0  # ...without the fake clock running ahead meanwhile
            continue
        step += 1
    ckpt.close()
    assert len(raised) == 1
    e = raised[0]
    assert e.tier == "local" and "injected" in str(e) and isinstance(e.__cause__, OSError)
    assert "failed in tier local" in caplog.text
    assert ckpt.stats().failed == 1
    assert len(snapcore.committed(tmp_path)["local"]) >= 1  # later snapshots went through


def test_close_makes_the_last_snapshot_durable(tmp_path, host_name):
    clock = FakeClock()
    state = make_state()
    store = snapcore.Store(host=host_name, local=tmp_path)
    ckpt = snapcore.Checkpointer(store, devices=16384, replan_s=math.inf, clock=clock)
    ckpt.restore(state)
    step = 0
    while ckpt.stats().snapshots == 0:
        clock.t += 1.0
        ckpt.step(step, state)
        step += 1
    ckpt.close()  # no wait() before: close waits
    last = step - 1
    for tier in ("host", "local"):
        assert last in snapcore.committed(store)[tier]
    events = jn.read_journal(jn.journal_path(store)).events
    assert (events[-2].kind, events[-2].data["step"]) == ("snapshot", last)
    assert (events[-1].kind, events[-1].data["clean"]) == ("exit", True)
    assert ckpt.stats().durable_step == {"host": last, "local": last}
    ckpt.step(step, state)  # after close: nothing happens
    ckpt.close()


def test_a_short_run_gets_a_first_and_a_final_snapshot(tmp_path):
    # devices=1 (the default): the model's optimum is hours; before, 200 steps took none
    clock = FakeClock()
    ckpt = snapcore.Checkpointer(tmp_path, replan_s=math.inf, clock=clock)
    state = make_state()
    assert ckpt.restore(state) == 0
    assert ckpt.plan().intervals_s["local"] <= 3600.0  # the default upper bound
    for step in range(200):
        clock.t += 1.0
        state["w"] += 1.0
        state["step"] = step
        ckpt.step(step, state)
    ckpt.close()
    # the first step() snapshots (its costs measured); close() makes the last one durable
    assert journal_snapshots(tmp_path) == [(0, ["local"]), (199, ["local"])]
    # one heartbeat once the run lasted the 60 s a run must last to count as a failure
    events = jn.read_journal(tmp_path / "journal.jsonl").events
    assert [e.kind for e in events].count("alive") == 1
    assert events[0].data["tiers"] == ["local"] and events[0].data["devices"] == 1
    fresh = make_state(5)
    assert snapcore.restore(fresh, tmp_path).step == 199
    assert torch.equal(fresh["w"], state["w"]) and fresh["step"] == 199


def test_close_final_false_and_an_exception_take_no_final_snapshot(tmp_path):
    clock = FakeClock()
    state = make_state()
    ckpt = snapcore.Checkpointer(tmp_path / "a", replan_s=math.inf, clock=clock)
    run_steps(ckpt, clock, state, range(10))
    ckpt.close(final=False)
    assert snapcore.committed(tmp_path / "a")["local"] == [0]
    with pytest.raises(RuntimeError), snapcore.Checkpointer(tmp_path / "b", clock=clock) as c:
        run_steps(c, clock, state, range(10))
        raise RuntimeError("NaN loss")  # the state may be half-way through an update
    assert snapcore.committed(tmp_path / "b")["local"] == [0]
    # close() without a step() call has nothing to make durable
    snapcore.Checkpointer(tmp_path / "c", clock=clock).close()
    assert not snapcore.committed(tmp_path / "c").get("local")


def test_max_interval_s_bounds_every_tier_from_the_start(tmp_path, host_name):
    clock = FakeClock()
    store = snapcore.Store(host=host_name, local=tmp_path)
    ckpt = snapcore.Checkpointer(store, max_interval_s=5.0, replan_s=math.inf, clock=clock)
    p = ckpt.plan()
    assert p.costs.measured == frozenset()  # nothing measured yet: the defaults (local 20 s)
    assert set(p.intervals_s) == {"host", "local"}
    assert all(iv <= 5.0 for iv in p.intervals_s.values())
    state = make_state()
    ckpt.restore(state)
    run_steps(ckpt, clock, state, range(60))
    ckpt.close()
    for tier in ("host", "local"):
        steps = [s for s, ts in journal_snapshots(store) if tier in ts]
        assert steps[0] == 0 and steps[-1] == 59
        assert max(b - a for a, b in itertools.pairwise(steps)) <= 5  # 1 s steps


@pytest.fixture
def cheap_host(monkeypatch):
    """The costs assumed before measuring: a cheap host tier and a dear disk (what a
    large model measures), so that the first plan, kept by replan_s=inf, is known."""
    from snapcore.scheduling import costs as ck

    monkeypatch.setattr(ck, "DEFAULT_STALL_S", 0.05)
    monkeypatch.setattr(ck, "DEFAULT_PERSIST_S", {"host": 0.5, "local": 60.0, "remote": 300.0})
    monkeypatch.setattr(ck, "DEFAULT_RESTORE_S", {"host": 0.5, "local": 60.0, "remote": 120.0})


def test_each_tier_gets_the_interval_the_plan_gives_it(tmp_path, host_name, cheap_host):
    clock = FakeClock()
    store = snapcore.Store(host=host_name, local=tmp_path)
    ckpt = snapcore.Checkpointer(store, devices=16384, replan_s=math.inf, clock=clock)
    p = ckpt.plan()
    assert p.intervals_s["local"] >= 2 * p.intervals_s["host"]  # host far more often
    assert not p.forced
    state = make_state()
    ckpt.restore(state)
    run_steps(ckpt, clock, state, range(1000))
    ckpt.close()
    want = with_final(replay(p.intervals_s, range(1000)), 999, ["host", "local"])
    assert journal_snapshots(store) == want
    per_tier = ckpt.stats().per_tier
    assert per_tier["host"] >= 2 * per_tier["local"] > 0
    assert snapcore.committed(store)["host"][-1] == 999


def test_a_host_tier_asked_for_is_used_when_the_plan_leaves_it_out(
    tmp_path, host_name, monkeypatch
):
    from snapcore.scheduling import costs as ck

    # a host tier the model finds not worth writing (slow, and slow to restore from)
    monkeypatch.setattr(ck, "DEFAULT_PERSIST_S", {"host": 50.0, "local": 20.0, "remote": 300.0})
    monkeypatch.setattr(ck, "DEFAULT_RESTORE_S", {"host": 1e3, "local": 30.0, "remote": 120.0})
    clock = FakeClock()
    store = snapcore.Store(host=host_name, local=tmp_path)
    ckpt = snapcore.Checkpointer(store, devices=16384, replan_s=math.inf, clock=clock)
    p = ckpt.plan()
    assert "host" not in p.planned_s and "host" in p.forced
    assert p.intervals_s["host"] == p.intervals_s["local"]
    state = make_state()
    ckpt.restore(state)
    run_steps(ckpt, clock, state, range(400))
    ckpt.close()
    snaps = journal_snapshots(store)
    assert len(snaps) >= 3 and all(ts == ["host", "local"] for _, ts in snaps)
    assert snapcore.committed(store)["host"][-1] == 399


def test_a_checkpointer_only_asked_for_its_plan_leaves_no_trace(tmp_path):
    ckpt = snapcore.Checkpointer(tmp_path / "store", devices=64)
    assert ckpt.plan().intervals_s
    ckpt.close()
    assert not (tmp_path / "store" / "journal.jsonl").exists()


def test_context_manager_journals_an_exception_as_unclean(tmp_path, monkeypatch):
    monkeypatch.setattr(jn, "MIN_RUN_S", 0.0)  # this run lasts milliseconds (see test_journal)
    state = make_state()
    with pytest.raises(RuntimeError), snapcore.Checkpointer(tmp_path) as ckpt:
        ckpt.restore(state)
        raise RuntimeError("NaN loss")
    c = jn.read_journal(tmp_path / "journal.jsonl")
    assert c.events[-1].data == {**c.events[-1].data, "clean": False, "reason": "RuntimeError"}
    assert jn.failure_history(tmp_path)[0] == 1


def test_a_keyboard_interrupt_is_no_failure(tmp_path, monkeypatch):
    monkeypatch.setattr(jn, "MIN_RUN_S", 0.0)  # the interrupt rule alone, not the floor
    clock = FakeClock()
    state = make_state()
    with pytest.raises(KeyboardInterrupt), snapcore.Checkpointer(tmp_path, clock=clock) as ckpt:
        ckpt.restore(state)
        run_steps(ckpt, clock, state, range(3))
        raise KeyboardInterrupt  # Ctrl-C in the middle of a step
    last = jn.read_journal(tmp_path / "journal.jsonl").events[-1]
    assert last.data["clean"] is False and last.data["reason"] == "KeyboardInterrupt"
    assert snapcore.committed(tmp_path)["local"] == [0]  # no final snapshot mid-step
    h = jn.read_history(tmp_path)
    assert h.failures == 0 and "interrupted by the user" in (h.runs[-1].not_counted or "")
    ckpt = snapcore.Checkpointer(tmp_path, clock=clock)
    assert ckpt.plan().rate.failures == 0
    ckpt.close()


def test_sigterm_in_process_snapshots_then_hands_the_signal_on(tmp_path):
    calls = []
    signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    state = make_state()
    ckpt = snapcore.Checkpointer(tmp_path, grace_s=30)
    assert ckpt.restore(state) == 0
    for step in range(3):
        ckpt.step(step, state)
    signal.raise_signal(signal.SIGTERM)  # our handler only records it
    assert calls == [] and ckpt.stats().sigterm
    state["step"] = 3
    ckpt.step(3, state)  # the final snapshot, then the signal goes to the old handler
    assert calls == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) is not None
    assert snapcore.committed(tmp_path)["local"][-1] == 3
    last = jn.read_journal(tmp_path / "journal.jsonl").events[-1]
    assert last.kind == "exit" and last.data["clean"] and last.data["reason"] == "sigterm"
    assert last.data["step"] == 3 and last.data["durable"]
    ckpt.step(4, state)  # closed: nothing more
    assert snapcore.committed(tmp_path)["local"][-1] == 3


def test_sigterm_during_close_is_handed_on_after_it(tmp_path):
    calls = []
    signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    state = make_state()
    ckpt = snapcore.Checkpointer(tmp_path)
    ckpt.restore(state)
    signal.raise_signal(signal.SIGTERM)
    ckpt.close()  # no step() came: close() is the end, and the signal goes on after it
    assert calls == [signal.SIGTERM]
    assert jn.read_journal(tmp_path / "journal.jsonl").events[-1].data["clean"]


def test_grace_expired_passes_the_signal_to_a_python_handler(tmp_path):
    calls = []
    signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    state = make_state()
    ckpt = snapcore.Checkpointer(tmp_path, grace_s=0.05)
    ckpt.restore(state)
    signal.raise_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while not calls and time.monotonic() < deadline:
        time.sleep(0.01)  # a step that hangs, in Python: handlers run in between
    assert calls == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) is not None and not ckpt.stats().in_flight
    last = jn.read_journal(tmp_path / "journal.jsonl").events[-1]
    assert last.kind == "exit" and not last.data["clean"]
    ckpt.step(1, state)  # closed: the state may be mid-update, nothing is taken
    assert "local" not in snapcore.committed(tmp_path) or not snapcore.committed(tmp_path)["local"]


def test_an_ignored_sigterm_stays_ignored(tmp_path):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ckpt = snapcore.Checkpointer(tmp_path)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    ckpt.close()


def test_no_handler_outside_the_main_thread(tmp_path, caplog):
    before = signal.getsignal(signal.SIGTERM)
    made = []
    with caplog.at_level(logging.WARNING, logger="snapcore.checkpointer"):
        t = threading.Thread(target=lambda: made.append(snapcore.Checkpointer(tmp_path)))
        t.start()
        t.join()
    assert "no SIGTERM handler installed" in caplog.text
    assert signal.getsignal(signal.SIGTERM) is before
    made[0].close()


TRAIN = textwrap.dedent(
    """
    import sys, time, torch, snapcore
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = {"model": model, "optim": opt, "step": 0}
    ckpt = snapcore.Checkpointer(sys.argv[1], grace_s=float(sys.argv[2]), devices=8)
    start = ckpt.restore(state)
    x = torch.randn(32, 16)
    for step in range(start, 1_000_000):
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        state["step"] = step
        w = float(model.weight.detach().sum())
        print(f"at {step} {w!r}", flush=True)
        if step == 20 and sys.argv[3] == "hang":
            time.sleep(60)  # a hung step: step() is never called again
        ckpt.step(step, state)
        time.sleep(0.002)
    """
)


def run_child(store: Path, grace: float, mode: str) -> tuple[subprocess.Popen, list[str], float]:
    with subprocess.Popen(
        [sys.executable, "-c", TRAIN, str(store), str(grace), mode],
        stdout=subprocess.PIPE,
        text=True,
    ) as child:
        assert child.stdout is not None
        lines = []
        for line in child.stdout:
            lines.append(line)
            if line.startswith("at 20 "):
                break
        t0 = time.monotonic()
        child.send_signal(signal.SIGTERM)
        lines += child.stdout.readlines()
        child.wait(timeout=60)
    return child, lines, time.monotonic() - t0


@pytest.fixture(scope="module")
def children(tmp_path_factory):
    """Both SIGTERM children at once: most of their time is importing torch."""
    stores = {m: tmp_path_factory.mktemp(f"sigterm-{m}") for m in ("train", "hang")}
    grace = {"train": 30.0, "hang": 0.5}
    out: dict[str, object] = {}

    def go(mode: str) -> None:
        try:
            out[mode] = (stores[mode], *run_child(stores[mode], grace[mode], mode))
        except BaseException as e:
            out[mode] = e

    threads = [threading.Thread(target=go, args=(m,)) for m in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for v in out.values():
        if isinstance(v, BaseException):
            raise v
    return out


def test_sigterm_child_exits_after_a_final_snapshot_of_its_step(children):
    tmp_path, child, lines, _ = children["train"]
    assert child.returncode == -signal.SIGTERM  # ended as SIGTERM's default action would
    last_step, weight = lines[-1].split()[1:]
    assert snapcore.committed(tmp_path)["local"][-1] == int(last_step)
    model = torch.nn.Linear(16, 4)
    state = {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.01), "step": -1}
    info = snapcore.restore(state, tmp_path)
    assert info.step == state["step"] == int(last_step)
    assert float(model.weight.detach().sum()) == float(weight)
    last = jn.read_journal(tmp_path / "journal.jsonl").events[-1]
    assert last.data["reason"] == "sigterm" and last.data["durable"] and last.data["clean"]
    assert jn.failure_history(tmp_path)[0] == 0  # a preemption is no failure


def test_sigterm_hung_step_hands_on_after_grace_without_a_snapshot(children):
    tmp_path, child, lines, waited = children["hang"]
    assert child.returncode == -signal.SIGTERM
    assert waited > 0.4  # not before the grace period (0.5 s): a bound no machine speed moves
    assert lines[-1].startswith("at 20 ")
    assert 20 not in snapcore.committed(tmp_path).get("local", [])  # nothing taken mid-step
    last = jn.read_journal(tmp_path / "journal.jsonl").events[-1]
    assert last.kind == "exit" and not last.data["clean"]
    assert "no step() within grace" in last.data["reason"]


RESUME = textwrap.dedent(
    """
    import sys, time, torch, snapcore
    torch.manual_seed(1)
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = {"model": model, "optim": opt, "step": 0}
    ckpt = snapcore.Checkpointer(sys.argv[1], handle_sigterm=False)  # devices=1: hours
    start = ckpt.restore(state)
    x = torch.randn(32, 16)
    for step in range(start, start + 100_000):
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        state["step"] = step
        ckpt.step(step, state)
        durable = ckpt.stats().durable_step.get("local", -1)
        print(f"at {step} {float(model.weight.detach().sum())!r} {durable}", flush=True)
        time.sleep(0.002)
    """
)


def test_sigkill_early_in_a_resumed_run_keeps_its_first_step(tmp_path):
    # the previous run: five steps, closed cleanly (step 4 durable)
    model = torch.nn.Linear(16, 4)
    state = {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.01), "step": 0}
    with snapcore.Checkpointer(tmp_path, handle_sigterm=False) as ckpt:
        assert ckpt.restore(state) == 0
        for step in range(5):
            state["step"] = step
            ckpt.step(step, state)
    close_all()
    with subprocess.Popen(
        [sys.executable, "-c", RESUME, str(tmp_path)], stdout=subprocess.PIPE, text=True
    ) as child:
        assert child.stdout is not None
        seen: dict[int, str] = {}
        for n, line in enumerate(child.stdout):
            _, step, weight, durable = line.split()
            seen[int(step)] = weight
            # killed once the resumed run's first step is durable (or, before the bounded
            # first snapshot, after 1500 steps without one)
            if int(durable) >= 5 or n >= 1500:
                break
        child.kill()  # SIGKILL: no close(), no final snapshot
        child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL
    model = torch.nn.Linear(16, 4)
    state = {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.01), "step": -1}
    info = snapcore.restore(state, tmp_path)
    assert info.step == state["step"] == 5  # not 4: the resumed run's work is kept
    assert float(model.weight.detach().sum()) == float(seen[5])


def test_partners_across_racks_sets_the_class_prior(tmp_path):
    # The store's tiers decide whether the split matters (no peer tier here: lost
    # machines and machines lost with their partner are one class); the rate it is made
    # from carries the prior split either way.
    def shares(**kw):
        ckpt = snapcore.Checkpointer(tmp_path, devices=16384, handle_sigterm=False, **kw)
        rates = ckpt.plan().rate.rates_per_s
        ckpt.close()
        return {c: r / sum(rates.values()) for c, r in rates.items()}

    assert shares()["correlated"] == pytest.approx(38 / 419)
    assert shares(partners_across_racks=True)["correlated"] == pytest.approx(3 / 419)
