"""The Checkpointer's pieces below it, alone: the cost meter, the scheduling policy (pure
functions: no store, no clock, no torch) and the SIGTERM guard; and that all of
scheduling below the Checkpointer imports without torch."""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from snapcore.scheduling import costs as cm
from snapcore.scheduling.costs import CostMeter, Costs, ewma
from snapcore.scheduling.policy import (
    MATERIAL_CHANGE,
    RateInfo,
    make_schedule,
    moved,
    plan_inputs,
    rate_info,
)
from snapcore.scheduling.preemption import SigtermGuard
from snapcore.scheduling.rate import (
    CORRELATED,
    DEFAULT_QUANTILE,
    LLAMA3_RATE_PER_DEVICE_HOUR,
    MACHINE,
    PROCESS,
    RatePrior,
    estimate_from_history,
    llama3_class_counts,
)

PRIOR = RatePrior.from_devices(16384, LLAMA3_RATE_PER_DEVICE_HOUR)
NO_PAST = {PROCESS: 0, MACHINE: 0, "unknown": 0}
NO_OWN = {PROCESS: 0, MACHINE: 0}


def costs(tiers: dict[str, float], restore: dict[str, float] | None = None, **kw) -> Costs:
    args = dict(step_s=2.0, stall_s=0.05, restart_s=180.0, slowdown=0.05)
    args.update(kw)
    return Costs(persist_s=dict(tiers), restore_s=dict(restore or tiers), **args)


def process_only(per_s: float = 1e-4) -> RateInfo:
    """A rate with no lost machines: host memory alone recovers every failure."""
    return RateInfo(
        failures=0,
        by_class={},
        exposure_hours=0.0,
        prior_per_hour=1.0,
        mean_per_hour=1.0,
        conservative_per_hour=1.0,
        quantile=0.9,
        rates_per_s={PROCESS: per_s, MACHINE: 0.0},
    )


# -- costs -----------------------------------------------------------------------------------
def test_ewma_starts_at_the_first_measurement_then_moves_by_its_weight():
    assert ewma(None, 4.0) == 4.0
    assert ewma(4.0, 14.0) == pytest.approx(4.0 + cm.EWMA_WEIGHT * 10.0)
    assert ewma(4.0, 14.0, weight=0.5) == 9.0


def test_meter_gives_the_defaults_until_measured():
    c = CostMeter(("host", "local"), restart_s=7.0, slowdown=0.1).costs()
    assert c.step_s is None and c.stall_s == cm.DEFAULT_STALL_S
    assert c.persist_s == {t: cm.DEFAULT_PERSIST_S[t] for t in ("host", "local")}
    assert c.restore_s == {t: cm.DEFAULT_RESTORE_S[t] for t in ("host", "local")}
    assert (c.restart_s, c.slowdown, c.measured) == (7.0, 0.1, frozenset())


def test_meter_restore_is_the_persist_time_until_a_restore_is_measured():
    m = CostMeter(("host", "local"), restart_s=0.0, slowdown=0.0)
    m.persisted("local", 8.0)
    c = m.costs()
    assert c.persist_s["local"] == 8.0 and c.restore_s["local"] == 8.0
    assert c.restore_s["host"] == cm.DEFAULT_RESTORE_S["host"]
    assert c.measured == {"persist_s:local"}
    m.restored("local", 3.0)
    c = m.costs()
    assert c.restore_s["local"] == 3.0 and c.measured == {"persist_s:local", "restore_s:local"}


def test_meter_step_time_leaves_out_the_stalls_of_snapshots():
    m = CostMeter(("local",), restart_s=0.0, slowdown=0.0)
    m.steps(0, 100.0)  # the first call only marks
    assert m.costs().step_s is None
    m.stalled(2.0)  # a snapshot blocked training 2 s of the next 12
    m.steps(10, 112.0)
    c = m.costs()
    assert c.step_s == pytest.approx(1.0) and c.stall_s == 2.0
    assert c.measured == {"step_s", "stall_s"}
    m.steps(10, 150.0)  # no step since: nothing to measure
    assert m.costs().step_s == pytest.approx(1.0)
    m.steps(20, 170.0)  # 2 s a step, weighted 0.5 (10 steps)
    assert m.costs().step_s == pytest.approx(1.5)


def _meter_run(busy_s: float, quiet_s: float, snapshots: int, meter: CostMeter | None = None):
    """Ten-step stretches between slow calls: ``quiet_s`` a step, then a snapshot that
    persists for two stretches at ``busy_s`` a step, ``snapshots`` times."""
    m = meter or CostMeter(("local",), restart_s=0.0, slowdown=0.05)
    t, step = 1000.0, 0
    m.steps(step, t)
    for k in range(snapshots):
        for _ in range(3):
            t, step = t + 10 * quiet_s, step + 10
            m.steps(step, t)
        m.persisting(k, t)
        start = t
        for _ in range(2):
            t, step = t + 10 * busy_s, step + 10
            m.steps(step, t)
        m.persisting(k, start, t)
    return m


def test_meter_measures_the_slowdown_while_snapshots_persist():
    m = _meter_run(busy_s=1.2, quiet_s=1.0, snapshots=2)  # 40 steps persisting: too few
    c = m.costs()
    assert c.slowdown == 0.05 and "slowdown" not in c.measured  # the given one, until then
    m = _meter_run(busy_s=1.2, quiet_s=1.0, snapshots=3, meter=m)
    c = m.costs()
    assert "slowdown" in c.measured and c.slowdown == pytest.approx(0.2)
    assert c.step_s is not None and 1.0 < c.step_s < 1.2  # the step time mixes both
    # a training that a snapshot does not slow (or that ran faster meanwhile): 0
    assert _meter_run(busy_s=0.9, quiet_s=1.0, snapshots=4).costs().slowdown == 0.0
    # the model takes a slowdown below 1
    assert _meter_run(busy_s=5.0, quiet_s=1.0, snapshots=4).costs().slowdown == cm.MAX_SLOWDOWN


def test_meter_leaves_out_stretches_a_snapshot_covered_in_part():
    m = CostMeter(("local",), restart_s=0.0, slowdown=0.05)
    t, step = 0.0, 0
    m.steps(step, t)
    for k in range(20):
        t, step = t + 10.0, step + 10  # quiet: 1 s a step
        m.steps(step, t)
        m.persisting(k, t + 5.0, t + 10.0)  # half of the next stretch: left out
        t, step = t + 30.0, step + 10  # 3 s a step: would be a slowdown of 2
        m.steps(step, t)
    assert m.slowdown() is None and m.costs().slowdown == 0.05
    # a snapshot still in flight covers the stretch up to the call
    m.persisting("open", t)
    for _ in range(6):
        t, step = t + 12.0, step + 10
        m.steps(step, t)
    assert m.costs().slowdown == pytest.approx(0.2)


def test_meter_measures_a_short_persist_whole():
    # Each snapshot persists 21 s: 2 steps of 3 s (the host copy's work), then 10 of 1.5 s;
    # 1 s a step otherwise. The slow calls come 15 s apart while it persists: the first
    # stretch (15 s, 8 steps) is covered whole, the next (10 s, 8 steps) for its first
    # 6 s. Over the steps in flight: 21 s / 12 steps = 1.75 s, a slowdown of 0.75. The
    # first stretch alone would say 15 / 8 = 1.875 (0.875).
    m = CostMeter(("host", "peer"), restart_s=0.0, slowdown=0.05)
    t, step = 0.0, 0
    m.steps(step, t)
    for k in range(6):
        m.persisting(k, t)
        t, step = t + 15.0, step + 8
        m.steps(step, t)
        m.persisting(k, t - 15.0, t + 6.0)  # seen done at the next call
        t, step = t + 10.0, step + 8
        m.steps(step, t)
        t, step = t + 20.0, step + 20  # quiet
        m.steps(step, t)
    assert m.costs().slowdown == pytest.approx(0.75)


def test_meter_takes_a_stretchs_stall_out_of_its_coverage():
    # a 4 s stall, then 0.3 s of persisting, in a 5 s stretch of 2 steps: 0.3 of its 1 s
    # of training was covered, not 4.3 of 5 s (the stall is not training time)
    m = CostMeter(("local",), restart_s=0.0, slowdown=0.05)
    m.steps(0, 0.0)
    m.persisting("a", 0.0)
    m.stalled(4.0)
    m.persisting("a", 0.0, 4.3)
    m.steps(2, 5.0)
    assert list(m._busy) == [] and list(m._quiet) == []  # 30% covered: neither side
    m.persisting("b", 5.0)
    m.stalled(4.0)
    m.persisting("b", 5.0, 9.8)
    m.steps(4, 10.0)  # 0.8 of its 1 s: busy, with 0.8 s covered
    assert list(m._busy) == [(pytest.approx(1.0), 2, pytest.approx(0.8))]


def test_meter_leaves_out_one_off_slow_stretches():
    # the run's first snapshot makes the job's groups: a stretch of one 1.5 s step, while
    # it persists; then ten-step stretches of 12 ms while snapshots persist, 10 ms not
    m = CostMeter(("host", "peer"), restart_s=0.0, slowdown=0.05)
    t, step = 0.0, 0
    m.steps(step, t)
    for k in range(8):
        m.persisting(k, t)
        if k == 0:
            t, step = t + 1.5, step + 1
            m.steps(step, t)
        for _ in range(2):
            t, step = t + 0.12, step + 10
            m.steps(step, t)
        m.persisting(k, t - 0.24, t)
        for _ in range(2):
            t, step = t + 0.10, step + 10
            m.steps(step, t)
    assert m.costs().slowdown == pytest.approx(0.2)


def test_meter_counts_overlapping_snapshots_once():
    m = CostMeter(("local",), restart_s=0.0, slowdown=0.0)
    m.steps(0, 0.0)  # the first call marks
    m.persisting("a", 0.0, 6.0)
    m.persisting("b", 4.0, 9.0)  # overlaps a: 0-9 persisting, not 11 s
    m.persisting("c", 20.0)  # still persisting
    assert m._persisting(0.0, 10.0) == pytest.approx(9.0)
    assert m._persisting(5.0, 25.0) == pytest.approx(4.0 + 5.0)
    # nothing is kept of a snapshot over before the stretch being measured (a rank that
    # measures no steps keeps nothing at all)
    m.steps(0, 30.0)
    m.persisting("c", 20.0, 25.0)
    assert set(m._windows) == set()
    m.persisting("d", 28.0, 31.0)
    assert set(m._windows) == {"d"}
    idle = CostMeter(("local",), restart_s=0.0, slowdown=0.0)
    for k in range(100):
        idle.persisting(k, float(k))
        idle.persisting(k, float(k), k + 0.5)
    assert idle._windows == {}


# -- the rate --------------------------------------------------------------------------------
def test_rate_info_adds_past_and_own_failures_and_exposure():
    r = rate_info(
        PRIOR,
        DEFAULT_QUANTILE,
        {**NO_PAST, MACHINE: 2, "unknown": 1},
        10.0,
        {PROCESS: 1, MACHINE: 0},
        2.0,
    )
    assert r.by_class == {PROCESS: 1, MACHINE: 2, "unknown": 1} and r.failures == 4
    assert r.exposure_hours == 12.0 and r.prior_per_hour == PRIOR.rate_per_hour
    est = estimate_from_history(4, 12.0, PRIOR, quantile=DEFAULT_QUANTILE)
    assert r.conservative_per_hour == est.conservative_per_hour > r.mean_per_hour
    assert sum(r.rates_per_s.values()) == pytest.approx(est.conservative_per_hour / 3600)


def test_rate_info_split_follows_the_classes_seen():
    base = rate_info(PRIOR, DEFAULT_QUANTILE, NO_PAST, 0.0, NO_OWN, 0.0)
    crashes = rate_info(PRIOR, DEFAULT_QUANTILE, {**NO_PAST, PROCESS: 20}, 0.0, NO_OWN, 0.0)

    def share(r: RateInfo) -> float:
        return r.rates_per_s[PROCESS] / sum(r.rates_per_s.values())

    assert share(crashes) > share(base)


# -- when to plan again ----------------------------------------------------------------------
def test_moved_only_beyond_the_material_change():
    a = (10.0, 1.0, 0.0)
    assert not moved(a, a)
    assert not moved(a, (10.0 * (1 + MATERIAL_CHANGE * 0.9), 1.0, 0.0))
    assert moved(a, (10.0 * (1 + MATERIAL_CHANGE * 2), 1.0, 0.0))
    assert moved(a, (10.0, 1.0, 1e-3))  # from zero: any change of size
    assert moved(a, a[:2])  # a tier more or less
    assert moved((), a)


def test_plan_inputs_cover_every_cost_and_rate():
    c = costs({"host": 0.5, "local": 60.0}, {"host": 0.7, "local": 90.0})
    r = rate_info(PRIOR, DEFAULT_QUANTILE, NO_PAST, 0.0, NO_OWN, 0.0)
    inputs = plan_inputs(c, r, ("host", "local"))
    assert inputs[:6] == (2.0, 0.05, 0.5, 60.0, 0.7, 90.0)
    assert inputs[6] == r.conservative_per_hour
    assert moved(inputs, plan_inputs(costs({"host": 0.5, "local": 90.0}), r, ("host", "local")))


def test_a_slowdown_about_zero_does_not_replan():
    # a measured slowdown's noise about 0 is no material change (it re-planned at every
    # check when it was); a real move still is
    r = rate_info(PRIOR, DEFAULT_QUANTILE, NO_PAST, 0.0, NO_OWN, 0.0)
    c = costs({"host": 0.5, "local": 60.0})

    def inputs(slowdown: float) -> tuple[float, ...]:
        return plan_inputs(dataclasses.replace(c, slowdown=slowdown), r, ("host", "local"))

    assert not moved(inputs(0.0002), inputs(0.0008)) and not moved(inputs(0.0), inputs(0.004))
    assert moved(inputs(0.05), inputs(0.03)) and moved(inputs(0.0), inputs(0.05))


# -- the schedule ----------------------------------------------------------------------------
def test_schedule_is_the_optimisers_when_it_uses_every_tier():
    r = rate_info(PRIOR, DEFAULT_QUANTILE, NO_PAST, 0.0, NO_OWN, 0.0)
    c = costs({"host": 0.5, "local": 1e4})
    s = make_schedule(c, r, ("host", "local"), target=0.02, max_interval_s=3600.0)
    assert s.intervals_s == s.planned_s and not s.forced
    assert s.intervals_s["host"] < s.intervals_s["local"] <= 3600.0
    assert s.uncovered == (MACHINE,)  # no remote tier: a lost machine loses the host copy
    assert s.intervals_steps == {t: max(1, round(iv / 2.0)) for t, iv in s.intervals_s.items()}
    assert s.rate is r and s.costs is c and s.target == 0.02
    assert s.predicted_waste == s.waste.total


def test_a_host_tier_left_out_is_forced_at_the_fastest_interval():
    r = rate_info(PRIOR, DEFAULT_QUANTILE, NO_PAST, 0.0, NO_OWN, 0.0)
    c = costs({"host": 50.0, "local": 20.0}, {"host": 1e3, "local": 30.0})
    s = make_schedule(c, r, ("host", "local"), target=0.02, max_interval_s=3600.0)
    assert "host" not in s.planned_s and "host" in s.forced
    assert s.intervals_s["host"] == min(s.planned_s.values())
    assert list(s.intervals_s) == ["host", "local"]  # fastest tier first


@pytest.mark.parametrize(
    ("tiers", "forced"),
    [
        (("host", "local"), {"local"}),
        (("host", "remote"), {"remote"}),
        (("host", "local", "remote"), {"remote", "local"}),  # uploads read the local copy
    ],
)
def test_a_store_with_a_disk_or_bucket_always_gets_a_copy_there(tiers, forced):
    all_costs = {"host": 0.5, "local": 60.0, "remote": 300.0}
    c = costs({t: all_costs[t] for t in tiers})
    s = make_schedule(c, process_only(), tiers, target=0.02, max_interval_s=3600.0)
    assert set(s.planned_s) == {"host"}  # host memory alone recovers a process crash
    assert set(s.forced) == forced
    assert s.intervals_s == dict.fromkeys(tiers, s.planned_s["host"])
    assert list(s.intervals_s) == list(tiers)


def test_every_interval_is_capped_by_the_upper_bound():
    c = costs({"local": 20.0}, step_s=None)
    s = make_schedule(c, process_only(1e-9), ("local",), target=0.5, max_interval_s=100.0)
    assert s.intervals_s == {"local": pytest.approx(100.0)}
    assert s.intervals_steps is None  # the step time is not measured


def test_a_model_that_cannot_plan_raises_value_error():
    c = costs({"local": -1.0})
    with pytest.raises(ValueError):
        make_schedule(c, process_only(), ("local",), target=0.02, max_interval_s=100.0)


# -- the SIGTERM guard -----------------------------------------------------------------------
def guard(calls: list[str], grace_s: float = 60.0) -> SigtermGuard:
    return SigtermGuard(
        grace_s,
        on_request=lambda: calls.append("request"),
        on_expired=lambda: calls.append("expired"),
        on_pass_on=lambda: calls.append("pass on"),
    )


@pytest.fixture
def _sigterm_back():
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


@pytest.mark.usefixtures("_sigterm_back")
def test_guard_records_a_sigterm_once_and_take_stops_the_timer():
    calls: list[str] = []
    prev = []
    signal.signal(signal.SIGTERM, lambda signum, frame: prev.append(signum))
    g = guard(calls)
    g.install()
    assert g.take() is None and not g.pending
    signal.raise_signal(signal.SIGTERM)
    signal.raise_signal(signal.SIGTERM)  # again: the first one is being handled
    assert calls == ["request"] and g.seen and g.pending and prev == []
    assert g.take() is not None and not g.pending and g.take() is None
    g.release()
    signal.raise_signal(signal.SIGTERM)  # the previous handler is back
    assert prev == [signal.SIGTERM] and calls == ["request"]


@pytest.mark.usefixtures("_sigterm_back")
def test_guard_hands_the_signal_on_when_nobody_takes_it():
    calls: list[str] = []
    prev: list[int] = []
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: (prev.append(signum), done.set()))
    g = guard(calls, grace_s=0.01)
    g.install()
    signal.raise_signal(signal.SIGTERM)
    for _ in range(1000):  # the main thread runs Python: handlers run in between
        if done.wait(0.01):
            break
    assert calls == ["request", "expired", "pass on"] and prev == [signal.SIGTERM]
    assert not g.pending and g.take() is None


@pytest.mark.usefixtures("_sigterm_back")
def test_guard_leaves_an_ignored_sigterm_alone():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    g = guard([])
    g.install()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    g.release()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN


# -- no torch below the Checkpointer ---------------------------------------------------------
LIGHT_IMPORT = textwrap.dedent(
    """
    import importlib.util, sys, types
    pkg = types.ModuleType("snapcore")
    pkg.__path__ = list(importlib.util.find_spec("snapcore").submodule_search_locations)
    sys.modules["snapcore"] = pkg
    sys.modules["torch"] = None  # any import of torch now raises ImportError
    """
)


def test_scheduling_below_the_checkpointer_imports_without_torch():
    code = LIGHT_IMPORT + textwrap.dedent(
        """
        import snapcore.scheduling
        from snapcore.scheduling import costs, model, policy, preemption, rate
        from snapcore.scheduling.policy import make_schedule, rate_info
        r = rate_info(rate.RatePrior.from_devices(8, rate.LLAMA3_RATE_PER_DEVICE_HOUR),
                      0.9, {"process": 0, "machine": 0}, 0.0, {}, 0.0)
        c = costs.CostMeter(("host", "local"), restart_s=0.0, slowdown=0.0).costs()
        s = make_schedule(c, r, ("host", "local"), target=0.02, max_interval_s=3600.0)
        assert s.intervals_s and sys.modules["torch"] is None
        print("ok", sorted(m for m in sys.modules if m.startswith("snapcore.")))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok")
    assert "snapcore.api" not in out.stdout and "snapcore.scheduling.checkpointer" not in out.stdout


def test_the_torch_block_of_that_test_bites():
    """The child's block is real: a module that needs torch fails to import under it."""
    code = LIGHT_IMPORT + "import snapcore.scheduling.checkpointer\n"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode != 0 and "torch" in out.stderr


# -- the peer tier ---------------------------------------------------------------------------
PEER_TIERS = ("host", "peer", "local", "remote")


def llama3_rate() -> RateInfo:
    return rate_info(PRIOR, DEFAULT_QUANTILE, NO_PAST, 0.0, NO_OWN, 0.0)


def test_the_peer_tier_restores_lost_machines_and_remote_correlated_ones():
    c = CostMeter(PEER_TIERS, restart_s=180.0, slowdown=0.05).costs()
    s = make_schedule(c, llama3_rate(), PEER_TIERS, target=0.02, max_interval_s=3600.0)
    assert s.recovers_from == {PROCESS: "host", MACHINE: "peer", CORRELATED: "remote"}
    assert s.intervals_s["host"] <= s.intervals_s["peer"] < s.intervals_s["remote"]
    assert not s.uncovered
    # the same store without a partner: lost machines, with or without it, go to remote
    base = tuple(t for t in PEER_TIERS if t != "peer")
    b = make_schedule(c, llama3_rate(), base, target=0.02, max_interval_s=3600.0)
    assert b.recovers_from == {PROCESS: "host", MACHINE: "remote"}
    assert s.predicted_waste < 0.6 * b.predicted_waste


def test_a_correlated_failure_with_no_remote_tier_is_charged_to_the_partner_copy():
    c = CostMeter(("host", "peer"), restart_s=180.0, slowdown=0.05).costs()
    s = make_schedule(c, llama3_rate(), ("host", "peer"), target=0.02, max_interval_s=3600.0)
    assert s.uncovered == (CORRELATED,)  # nothing outlives a machine and its partner
    assert s.recovers_from[MACHINE] == s.recovers_from[CORRELATED] == "peer"


def test_measured_peer_costs_are_used_and_move_its_interval():
    meter = CostMeter(PEER_TIERS, restart_s=180.0, slowdown=0.05)
    before = meter.costs()
    assert before.persist_s["peer"] == cm.DEFAULT_PERSIST_S["peer"]
    assert before.restore_s["peer"] == cm.DEFAULT_RESTORE_S["peer"]
    assert "persist_s:peer" not in before.measured
    fast = make_schedule(before, llama3_rate(), PEER_TIERS, target=0.02, max_interval_s=3600.0)
    for _ in range(20):  # a slow network: 60 s to the partner, 90 s to read it back
        meter.persisted("peer", 60.0)
        meter.restored("peer", 90.0)
    after = meter.costs()
    assert {"persist_s:peer", "restore_s:peer"} <= after.measured
    assert after.persist_s["peer"] == pytest.approx(60.0, rel=0.01)
    assert after.restore_s["peer"] == pytest.approx(90.0, rel=0.01)
    assert moved(
        plan_inputs(before, llama3_rate(), PEER_TIERS),
        plan_inputs(after, llama3_rate(), PEER_TIERS),
    )
    slow = make_schedule(after, llama3_rate(), PEER_TIERS, target=0.02, max_interval_s=3600.0)
    # a snapshot to the partner now costs more (interference for 60 s) and a lost machine
    # more (its restart): the peer interval grows, and so does the waste
    assert slow.intervals_s["peer"] > 1.1 * fast.intervals_s["peer"]
    assert slow.predicted_waste > fast.predicted_waste


def test_a_restore_that_read_a_partner_is_charged_to_the_peer_tier():
    assert cm.restore_tier("host") == "host"
    assert cm.restore_tier("local+remote") == "local"
    assert cm.restore_tier("host+peer") == "peer"  # the replaced node waited for the network
    assert cm.restore_tier("peer") == "peer"


def test_peer_default_costs_are_the_host_tiers_plus_the_transfer():
    assert pytest.approx(40e9 / 25e9) == cm.PEER_TRANSFER_S
    assert cm.DEFAULT_PERSIST_S["peer"] == cm.DEFAULT_PERSIST_S["host"] + cm.PEER_TRANSFER_S
    assert cm.DEFAULT_RESTORE_S["peer"] == cm.DEFAULT_RESTORE_S["host"] + cm.PEER_TRANSFER_S


def test_learned_correlated_failures_move_the_remote_interval():
    c = CostMeter(PEER_TIERS, restart_s=180.0, slowdown=0.05).costs()
    base = make_schedule(c, llama3_rate(), PEER_TIERS, target=0.02, max_interval_s=3600.0)
    # 30 machines lost with their partner in 100 h: object storage is needed more often
    r = rate_info(PRIOR, DEFAULT_QUANTILE, {**NO_PAST, CORRELATED: 30}, 100.0, NO_OWN, 0.0)
    assert r.by_class[CORRELATED] == 30
    s = make_schedule(c, r, PEER_TIERS, target=0.02, max_interval_s=3600.0)
    assert s.intervals_s["remote"] < base.intervals_s["remote"]


def test_a_peer_tier_left_out_is_written_with_the_slower_tiers():
    c = CostMeter(PEER_TIERS, restart_s=180.0, slowdown=0.05).costs()
    s = make_schedule(c, process_only(), PEER_TIERS, target=0.02, max_interval_s=3600.0)
    assert set(s.planned_s) == {"host"}  # crashes only: host memory recovers them all
    assert {"peer", "local", "remote"} <= set(s.forced)
    assert s.intervals_s["peer"] == s.intervals_s["remote"]
    assert list(s.intervals_s) == list(PEER_TIERS)


def test_partners_across_racks_lower_the_correlated_share():
    same = llama3_rate()
    across = rate_info(
        PRIOR,
        DEFAULT_QUANTILE,
        NO_PAST,
        0.0,
        NO_OWN,
        0.0,
        class_prior=llama3_class_counts(partners_across_racks=True),
    )
    for r, correlated in ((same, 38), (across, 3)):
        total = sum(r.rates_per_s.values())
        assert r.rates_per_s[CORRELATED] / total == pytest.approx(correlated / 419)
        assert r.rates_per_s[PROCESS] / total == pytest.approx(63 / 419)
    c = CostMeter(PEER_TIERS, restart_s=180.0, slowdown=0.05).costs()
    s = make_schedule(c, same, PEER_TIERS, target=0.02, max_interval_s=86400.0)
    a = make_schedule(c, across, PEER_TIERS, target=0.02, max_interval_s=86400.0)
    assert a.intervals_s["remote"] > 2 * s.intervals_s["remote"]
    assert a.predicted_waste < s.predicted_waste
