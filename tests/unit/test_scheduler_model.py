"""Tests of the scheduler's cost model: formulas against hand-computed values."""

from __future__ import annotations

import itertools
import math

import pytest

from snapcore.scheduling.model import (
    CostModel,
    FailureClass,
    TierCost,
    daly_interval,
    expected_waste,
    optimise,
    young_interval,
)

ALL = frozenset({"host", "local", "remote"})
REMOTE = frozenset({"remote"})
MIN = 60.0
HOUR = 3600.0


def tiers() -> tuple[TierCost, ...]:
    return (
        TierCost("host", 2.0, 190.0),
        TierCost("local", 20.0, 210.0),
        TierCost("remote", 300.0, 300.0),
    )


def classes(mtbf_s: float, crash_share: float = 63 / 419) -> list[FailureClass]:
    lam = 1.0 / mtbf_s
    return [
        FailureClass("process", lam * crash_share, ALL),
        FailureClass("machine", lam * (1 - crash_share), REMOTE),
    ]


def test_young_hand_computed() -> None:
    # sqrt(2 * 5 min * 24 h) = sqrt(2 * 300 * 86400) = 7200 s exactly
    assert young_interval(5 * MIN, 24 * HOUR) == pytest.approx(7200.0)
    assert young_interval(0.0, HOUR) == 0.0


@pytest.mark.parametrize(
    ("mtbf_s", "published_min"),
    [(24 * HOUR, 117.0), (6 * HOUR, 57.0), (15 * MIN, 9.1)],
)
def test_daly_published_examples(mtbf_s: float, published_min: float) -> None:
    # Daly (2006) with d = 5 min: about 117 min at M = 24 h, 57 at 6 h, 9.1 at 15 min.
    got = daly_interval(5 * MIN, mtbf_s) / MIN
    assert got == pytest.approx(published_min, abs=0.5 if published_min > 10 else 0.05)


def test_daly_hand_computed_and_cutoff() -> None:
    # d = 5, M = 1440: sqrt(14400) = 120, x = 5/2880; 120 (1 + sqrt(x)/3 + x/9) - 5
    x = 5 / 2880
    assert daly_interval(5, 1440) == pytest.approx(120 * (1 + math.sqrt(x) / 3 + x / 9) - 5)
    # d >= 2M: the interval is M itself
    assert daly_interval(10, 5) == 5
    assert daly_interval(10, 4.9) == 4.9


@pytest.mark.parametrize(("cost", "mtbf"), [(-1.0, 10.0), (1.0, 0.0), (math.nan, 1.0)])
def test_young_daly_reject_bad_input(cost: float, mtbf: float) -> None:
    with pytest.raises(ValueError):
        young_interval(cost, mtbf)
    with pytest.raises(ValueError):
        daly_interval(cost, mtbf)


def test_no_failures_leaves_only_overhead() -> None:
    model = CostModel(tiers(), stall_s=2.0, slowdown=0.1)
    w = expected_waste(model, [], {"host": 100.0, "remote": 1000.0})
    # 2/100 stall + 0.1*2*(1/100 - 1/1000) host-only + 0.1*300/1000 remote
    assert w.total == pytest.approx(0.02 + 0.1 * 2 * 0.009 + 0.03)
    assert w.redone == 0 and w.restart == 0


def test_single_tier_matches_direct_series() -> None:
    # One class, one tier: waste = (E[R] + 1/lam - E[D] + O E[D]) / (1/lam + E[R]),
    # with E[D] summed term by term instead of the closed form.
    lam, t, p, r, stall = 1 / 5000, 600.0, 120.0, 200.0, 3.0
    model = CostModel((TierCost("remote", p, r),), stall_s=stall)
    w = expected_waste(model, [FailureClass("any", lam, REMOTE)], {"remote": t})
    e_d = sum(
        j * t * (math.exp(-lam * (j * t + p)) - math.exp(-lam * ((j + 1) * t + p)))
        for j in range(1, 20_000)
    )
    e_r = (math.exp(lam * r) - 1) / lam
    o = stall / t
    want = (e_r + 1 / lam - e_d + o * e_d) / (1 / lam + e_r)
    assert w.total == pytest.approx(want, rel=1e-9)
    assert w.overhead + w.redone + w.restart == pytest.approx(w.total)


def test_first_order_limit() -> None:
    # Rare failures: waste ~ C/T + lam (T/2 + p + R), the textbook first-order form.
    lam, t, p, r, c = 1e-7, 600.0, 60.0, 100.0, 1.0
    model = CostModel((TierCost("remote", p, r),), stall_s=c)
    w = expected_waste(model, [FailureClass("any", lam, REMOTE)], {"remote": t})
    assert w.total == pytest.approx(c / t + lam * (t / 2 + p + r), rel=1e-4)


def test_optimum_single_tier_near_young_for_rare_failures() -> None:
    # With stall C, no persist latency and rare failures the optimum is Young's.
    m = 1e7
    model = CostModel((TierCost("remote", 0.0, 0.0),), stall_s=10.0)
    plan = optimise(model, [FailureClass("any", 1 / m, REMOTE)])
    assert plan.intervals_s["remote"] == pytest.approx(young_interval(10.0, m), rel=0.01)


def test_optimum_single_tier_near_daly() -> None:
    # Daly's model: a checkpoint blocks for d and failures restart from the last one.
    # Ours with a blocking stall d is the same model to second order, so the two optima
    # agree closely even at M = 6 h with d = 5 min.
    d, m = 5 * MIN, 6 * HOUR
    model = CostModel((TierCost("remote", 0.0, 0.0),), stall_s=d)
    plan = optimise(model, [FailureClass("any", 1 / m, REMOTE)])
    assert plan.intervals_s["remote"] == pytest.approx(daly_interval(d, m) + d, rel=0.05)


def test_tiered_plan_shape_and_async_gain() -> None:
    model = CostModel(tiers(), stall_s=1.0, slowdown=0.05, step_s=5.0)
    cls = classes(3.09 * HOUR)
    plan = optimise(model, cls, target=0.02)
    iv = plan.intervals_s
    assert "remote" in iv  # the only tier that survives a lost machine
    names = list(iv)
    for a, b in itertools.pairwise(names):  # nested, fastest most often
        assert iv[b] % iv[a] == 0 and iv[b] >= iv[a]
    for v in iv.values():
        assert v % 5.0 == 0  # whole steps
    assert plan.recovers_from["machine"] == "remote"
    w = plan.waste
    assert w.total == pytest.approx(w.overhead + w.redone + w.restart)
    # The optimiser beats single-tier Young with the full time to durable as cost.
    y = young_interval(301.0, 3.09 * HOUR)
    assert plan.waste.total < expected_waste(model, cls, {"remote": y}).total
    # And no nearby interval does better (it is a minimum).
    for f in (0.8, 1.25):
        near = {k: v * f for k, v in iv.items()}
        assert expected_waste(model, cls, near).total >= plan.waste.total - 1e-9


def test_target_unreachable_says_by_how_much() -> None:
    model = CostModel(tiers(), stall_s=1.0, slowdown=0.05)
    plan = optimise(model, classes(0.5 * HOUR), target=0.02)
    assert not plan.target_met
    assert plan.shortfall == pytest.approx(plan.predicted_waste - 0.02)
    easy = optimise(model, classes(500 * HOUR), target=0.02)
    assert easy.target_met and easy.shortfall == 0.0


def test_crash_only_failures_use_host_memory_only() -> None:
    model = CostModel(tiers(), stall_s=1.0, slowdown=0.05)
    plan = optimise(model, classes(HOUR, crash_share=1.0))
    assert set(plan.intervals_s) == {"host"}
    assert plan.recovers_from == {"process": "host"}


def test_no_surviving_tier_is_an_error() -> None:
    model = CostModel((TierCost("host", 1.0, 10.0),), stall_s=1.0)
    with pytest.raises(ValueError, match="machine"):
        optimise(model, classes(HOUR))


def test_bad_model_inputs() -> None:
    with pytest.raises(ValueError):
        CostModel((), stall_s=1.0)
    with pytest.raises(ValueError):
        CostModel(tiers(), stall_s=-1.0)
    with pytest.raises(ValueError):
        CostModel(tiers(), stall_s=1.0, slowdown=1.0)
    with pytest.raises(ValueError):
        TierCost("x", -1.0, 0.0)
    with pytest.raises(ValueError):
        optimise(CostModel(tiers(), stall_s=1.0), classes(HOUR), target=2.0)
    with pytest.raises(ValueError):
        expected_waste(CostModel(tiers(), stall_s=1.0), classes(HOUR), {"tape": 1.0})


def test_plan_steps() -> None:
    model = CostModel(tiers(), stall_s=1.0, step_s=5.0)
    plan = optimise(model, classes(3 * HOUR))
    steps = plan.steps(5.0)
    assert all(steps[k] * 5.0 == v for k, v in plan.intervals_s.items())


@pytest.mark.parametrize("step_s", [0.0, 3.0])
@pytest.mark.parametrize("tmax", [10.0, 100.0, 1000.0])
def test_max_interval_is_a_hard_bound(step_s: float, tmax: float) -> None:
    # persist times above the bound (local 20 s, remote 300 s) used to win over it
    model = CostModel(tiers(), stall_s=1.0, slowdown=0.05, step_s=step_s, max_interval_s=tmax)
    for mtbf in (10 * MIN, 24 * HOUR, 1e6 * HOUR):
        plan = optimise(model, classes(mtbf))
        assert plan.intervals_s
        assert all(iv <= tmax * (1 + 1e-9) for iv in plan.intervals_s.values()), plan


# -- the peer tier ---------------------------------------------------------------------------
def peer_model(persist: float = 3.6, restore: float = 191.6) -> CostModel:
    t = tiers()
    return CostModel(
        (t[0], TierCost("peer", persist, restore), *t[1:]), stall_s=1.0, slowdown=0.05, step_s=5.0
    )


def peer_classes(mtbf_s: float, correlated: float = 38 / 419) -> list[FailureClass]:
    lam = 1.0 / mtbf_s
    crash = 63 / 419
    return [
        FailureClass("process", lam * crash, frozenset({"host", "peer", "local", "remote"})),
        FailureClass("machine", lam * (1 - crash - correlated), frozenset({"peer", "remote"})),
        FailureClass("correlated", lam * correlated, REMOTE),
    ]


def test_peer_tier_recovers_single_machine_losses_only():
    plan = optimise(peer_model(), peer_classes(1296 / 419 * HOUR))
    assert plan.recovers_from == {"process": "host", "machine": "peer", "correlated": "remote"}
    without = optimise(CostModel(tiers(), 1.0, 0.05, 5.0), classes(1296 / 419 * HOUR))
    assert plan.predicted_waste < 0.6 * without.predicted_waste


def test_peer_intervals_respond_to_peer_costs():
    mtbf = 1296 / 419 * HOUR
    base = optimise(peer_model(), peer_classes(mtbf))
    slow_network = optimise(peer_model(persist=120.0), peer_classes(mtbf))
    assert slow_network.intervals_s["peer"] > 1.5 * base.intervals_s["peer"]
    assert slow_network.predicted_waste > base.predicted_waste
    # a peer restore as slow as object storage's: still used (its copy is newer), at a cost
    slow_restore = optimise(peer_model(restore=300.0), peer_classes(mtbf))
    assert slow_restore.recovers_from["machine"] == "peer"
    assert slow_restore.waste.restart > base.waste.restart


def test_more_correlated_failures_make_remote_more_frequent():
    mtbf = 1296 / 419 * HOUR
    rare = optimise(peer_model(), peer_classes(mtbf, correlated=3 / 419))
    often = optimise(peer_model(), peer_classes(mtbf, correlated=38 / 419))
    assert often.intervals_s["remote"] < 0.5 * rare.intervals_s["remote"]
    assert rare.predicted_waste < 0.04 < often.predicted_waste
