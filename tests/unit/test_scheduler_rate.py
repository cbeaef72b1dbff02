"""Tests of failure-rate learning: Gamma-Poisson posterior and its conservative read."""

from __future__ import annotations

import math

import pytest

from snapcore.scheduling.rate import (
    CORRELATED,
    LLAMA3_CAUSES,
    LLAMA3_CLASS_COUNTS,
    LLAMA3_RATE_PER_DEVICE_HOUR,
    MACHINE,
    PROCESS,
    SURVIVES,
    FailureRateLearner,
    RatePrior,
    estimate_from_history,
    gamma_cdf,
    gamma_quantile,
    llama3_class_counts,
    merge_classes,
)


def test_llama3_default_rate() -> None:
    assert sum(LLAMA3_CLASS_COUNTS.values()) == 419
    assert pytest.approx(419 / (54 * 24 * 16384)) == LLAMA3_RATE_PER_DEVICE_HOUR
    prior = RatePrior.from_devices(16384)
    # 419 failures in 1296 hours: an MTBF of about 3.09 hours on the full machine
    assert 1 / prior.rate_per_hour == pytest.approx(1296 / 419)


def test_gamma_quantile_exact_cases() -> None:
    # shape 1 is the exponential: quantile -ln(1-q) / rate
    assert gamma_quantile(1.0, 2.0, 0.9) == pytest.approx(math.log(10) / 2, rel=1e-9)
    # shape 2: P(x) = 1 - e^{-x}(1 + x); check the inverse round-trips
    x = gamma_quantile(2.0, 1.0, 0.75)
    assert 1 - math.exp(-x) * (1 + x) == pytest.approx(0.75, abs=1e-10)
    for shape in (0.3, 0.5, 3.0, 40.0, 500.0):
        for q in (0.05, 0.5, 0.9, 0.99):
            assert gamma_cdf(shape, 3.0, gamma_quantile(shape, 3.0, q)) == pytest.approx(q)


def test_gamma_median_large_shape_near_mean() -> None:
    # Gamma(n) approaches normal: the median is about n - 1/3
    assert gamma_quantile(1000.0, 1.0, 0.5) == pytest.approx(1000 - 1 / 3, abs=0.01)


def test_posterior_update_hand_computed() -> None:
    prior = RatePrior(rate_per_hour=0.5, weight=2.0)  # Gamma(2, 4 h)
    est = estimate_from_history(6, 12.0, prior)
    assert est.shape == 8 and est.rate_hours == 16.0
    assert est.mean_per_hour == pytest.approx(0.5)
    assert est.conservative_per_hour > est.mean_per_hour  # an upper quantile


def test_conservative_tightens_with_data() -> None:
    prior = RatePrior(rate_per_hour=0.1)
    few = estimate_from_history(3, 10.0, prior)
    many = estimate_from_history(300, 1000.0, prior)
    assert few.conservative_per_hour / few.mean_per_hour > 1.5
    assert many.conservative_per_hour / many.mean_per_hour < 1.1
    assert many.mean_per_hour == pytest.approx(301 / 1010)


def test_no_prior_is_jeffreys() -> None:
    est = estimate_from_history(0, 100.0)
    assert est.shape == 0.5 and est.rate_hours == 100.0
    with pytest.raises(ValueError, match="nothing to estimate"):
        estimate_from_history(0, 0.0)


@pytest.mark.parametrize(
    ("failures", "hours", "q"), [(-1, 1.0, 0.9), (1, -1.0, 0.9), (1, 1.0, 1.0), (1, math.inf, 0.5)]
)
def test_bad_history(failures: int, hours: float, q: float) -> None:
    with pytest.raises(ValueError):
        estimate_from_history(failures, hours, quantile=q)


def test_bad_prior() -> None:
    with pytest.raises(ValueError):
        RatePrior(0.0)
    with pytest.raises(ValueError):
        RatePrior.from_devices(0)
    with pytest.raises(ValueError):
        RatePrior(1.0, weight=0.0)


def test_learner_converges_from_a_wrong_prior() -> None:
    true_rate = 2.0  # per hour
    learner = FailureRateLearner(RatePrior(true_rate / 10))  # 10x too optimistic
    learner.add_exposure(200.0)
    for _ in range(300):
        learner.observe_failure("machine")
    for _ in range(100):
        learner.observe_failure("process")
    est = learner.total()
    assert est.mean_per_hour == pytest.approx(401 / 205, rel=1e-9)
    shares = learner.shares()
    assert shares["process"] == pytest.approx((10 * 63 / 419 + 100) / 410)
    rates = learner.rates_per_s(conservative=False)
    assert sum(rates.values()) * 3600 == pytest.approx(est.mean_per_hour)
    assert sum(learner.rates_per_s().values()) > sum(rates.values())


def test_learner_rejects_unknown_class() -> None:
    learner = FailureRateLearner(RatePrior(1.0))
    with pytest.raises(KeyError):
        learner.observe_failure("meteor")
    with pytest.raises(ValueError):
        learner.add_exposure(-1.0)


def test_llama3_causes_map_to_three_classes() -> None:
    assert sum(n for _, n, _ in LLAMA3_CAUSES) == 419
    same = llama3_class_counts()
    across = llama3_class_counts(partners_across_racks=True)
    assert same == LLAMA3_CLASS_COUNTS == {PROCESS: 63, MACHINE: 318, CORRELATED: 38}
    assert across == {PROCESS: 63, MACHINE: 353, CORRELATED: 3}
    # the split of crashes against lost machines is the one the data gives, either way
    assert same[MACHINE] + same[CORRELATED] == across[MACHINE] + across[CORRELATED] == 356
    assert SURVIVES[MACHINE] == {"peer", "remote"} and SURVIVES[CORRELATED] == {"remote"}


def test_without_a_peer_tier_correlated_failures_are_lost_machines() -> None:
    rates = {PROCESS: 1.0, MACHINE: 5.0, CORRELATED: 0.5}
    assert merge_classes(rates, ("host", "local", "remote")) == {PROCESS: 1.0, MACHINE: 5.5}
    assert merge_classes(rates, ("host", "peer", "remote")) == rates
