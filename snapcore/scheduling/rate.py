"""Learning the failure rate of a run: a Gamma-Poisson posterior with a conservative read.

Why Bayesian: a run starts knowing nothing about its own cluster, and a handful of
failures is too few for a plain count over time to be trusted. A prior from
configuration (a per-device rate times the number of devices, by default the rate Llama 3
published) gives a sensible start; each observed failure and each hour of exposure
moves the posterior Gamma(shape + failures, rate + exposure). Decisions use an upper
quantile of that posterior, so that a run that has seen few failures does not bet its
work on a lucky streak.

Failure classes (a process crash, a lost machine, a machine lost with its partner)
differ in which tier survives them.
Their shares are learned separately, as a Dirichlet posterior over the classes seen, with
Llama 3's split as its prior; the conservative total rate is divided by those shares.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from statistics import NormalDist

logger = logging.getLogger(__name__)

# Llama 3 (Dubey et al. 2024, Table 5): 419 unexpected interruptions in 54 days of
# pre-training on 16,384 H100 GPUs.
LLAMA3_UNEXPECTED_INTERRUPTIONS = 419
LLAMA3_DAYS = 54
LLAMA3_GPUS = 16_384
LLAMA3_RATE_PER_DEVICE_HOUR = LLAMA3_UNEXPECTED_INTERRUPTIONS / (LLAMA3_DAYS * 24 * LLAMA3_GPUS)

# Failure classes differ in which copies survive them. A crash of the training process
# leaves the machines up: host memory (a shared-memory arena) survives. A lost machine
# takes its host memory and local disk with it; the copy a peer tier keeps in a partner
# node's memory survives it. A correlated failure takes a machine and its partner (a
# rack, a switch both sit behind, a second failure before the first is repaired, the
# whole job): only object storage survives it.
PROCESS = "process"
MACHINE = "machine"
CORRELATED = "correlated"

# Llama 3's 419 unexpected interruptions by cause (shared/data/llama3_interruptions.csv,
# from the paper's Table 5) and the class each is planned as (docs/scheduler.md, "Failure
# classes"). Software bugs, NCCL watchdog timeouts and dependencies keep the machines;
# every hardware cause takes one machine away. Network switch or cable failures are
# SWITCH: they take the machines behind one switch, so whether the partner goes too
# depends on where partners are placed (llama3_class_counts).
SWITCH = "switch"
LLAMA3_CAUSES: tuple[tuple[str, int, str], ...] = (
    ("Faulty GPU", 148, MACHINE),
    ("GPU HBM3 memory", 72, MACHINE),
    ("Software bug", 54, PROCESS),
    ("Network switch or cable", 35, SWITCH),
    ("Host maintenance", 32, MACHINE),
    ("GPU SRAM memory", 19, MACHINE),
    ("GPU system processor", 17, MACHINE),
    ("NIC", 7, MACHINE),
    ("NCCL watchdog timeout", 7, PROCESS),
    ("Silent data corruption", 6, MACHINE),
    ("GPU thermal interface and sensor", 6, MACHINE),
    ("SSD", 3, MACHINE),
    ("Power supply", 3, MACHINE),
    ("Server chassis", 2, MACHINE),
    ("IO expansion board", 2, MACHINE),
    ("Dependency", 2, PROCESS),
    ("CPU", 2, MACHINE),
    ("System memory", 2, MACHINE),
)
# None of the 419 took a partner node for certain, but none is not a rate: the plan
# counts 3 of them (of the lost machines) as correlated, the "rule of three" 95% upper
# bound on a rate of which zero were seen in 419, so that object storage keeps a
# sensible interval when partners are well placed.
CORRELATED_ALLOWANCE = 3


def llama3_class_counts(*, partners_across_racks: bool = False) -> dict[str, int]:
    """Llama 3's 419 interruptions counted by class.

    ``partners_across_racks``: every node's partner sits behind another rack switch, so a
    switch or cable failure (which takes at most the machines of one rack) leaves each
    lost machine's partner up. Otherwise (the default, and what a ring over node ranks
    gives, neighbours sharing a rack) those 35 are counted as taking the partner too.
    """
    counts = dict.fromkeys((PROCESS, MACHINE, CORRELATED), 0)
    for _, n, cls in LLAMA3_CAUSES:
        if cls == SWITCH:
            cls = MACHINE if partners_across_racks else CORRELATED
        counts[cls] += n
    counts[MACHINE] -= CORRELATED_ALLOWANCE
    counts[CORRELATED] += CORRELATED_ALLOWANCE
    return counts


# The default split: process 63, machine 318, correlated 38 (process 63, lost machines
# 356 in all, as the paper's causes give).
LLAMA3_CLASS_COUNTS: dict[str, int] = llama3_class_counts()

# Which tiers' copies survive each class (tier names as in snapcore's stores).
SURVIVES: dict[str, frozenset[str]] = {
    PROCESS: frozenset({"host", "peer", "local", "remote"}),
    MACHINE: frozenset({"peer", "remote"}),
    CORRELATED: frozenset({"remote"}),
}


def merge_classes(rates: Mapping[str, float], tiers: Iterable[str]) -> dict[str, float]:
    """Rates per class for a store of ``tiers``: without a peer tier a correlated failure
    is a lost machine like any other (the same copies survive both), so it is counted as
    one and the plan has the two classes it had before the peer tier existed."""
    out = dict(rates)
    if "peer" not in set(tiers) and CORRELATED in out:
        out[MACHINE] = out.get(MACHINE, 0.0) + out.pop(CORRELATED)
    return out


DEFAULT_QUANTILE = 0.9


@dataclass(frozen=True)
class RatePrior:
    """A Gamma prior on the run's failure rate (failures per hour of wall time).

    ``weight`` is how many observed failures the prior is worth (its Gamma shape): 1 by
    default, because a rate measured on someone else's cluster is a guess about this one.
    """

    rate_per_hour: float
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not (self.rate_per_hour > 0 and math.isfinite(self.rate_per_hour)):
            raise ValueError(f"prior rate must be > 0 per hour, got {self.rate_per_hour}")
        if not (self.weight > 0 and math.isfinite(self.weight)):
            raise ValueError(f"prior weight must be > 0, got {self.weight}")

    @classmethod
    def from_devices(
        cls,
        devices: int,
        rate_per_device_hour: float = LLAMA3_RATE_PER_DEVICE_HOUR,
        weight: float = 1.0,
    ) -> RatePrior:
        """Failures per device-hour times devices: a job fails when any device does."""
        if devices < 1:
            raise ValueError(f"devices must be >= 1, got {devices}")
        if not rate_per_device_hour > 0:
            raise ValueError(f"rate per device-hour must be > 0, got {rate_per_device_hour}")
        return cls(rate_per_hour=rate_per_device_hour * devices, weight=weight)

    @property
    def shape(self) -> float:
        return self.weight

    @property
    def exposure_hours(self) -> float:
        """The Gamma rate parameter: pseudo-hours of exposure the prior stands for."""
        return self.weight / self.rate_per_hour


@dataclass(frozen=True)
class RateEstimate:
    """The posterior Gamma(shape, exposure_hours) on the failure rate, and two reads of it."""

    failures: float
    exposure_hours: float
    shape: float
    rate_hours: float
    quantile: float

    @property
    def mean_per_hour(self) -> float:
        return self.shape / self.rate_hours

    @property
    def conservative_per_hour(self) -> float:
        """The ``quantile`` upper quantile: the rate decisions are made with."""
        return gamma_quantile(self.shape, self.rate_hours, self.quantile)

    @property
    def conservative_mtbf_hours(self) -> float:
        return 1.0 / self.conservative_per_hour


def estimate_from_history(
    failures: int,
    exposure_hours: float,
    prior: RatePrior | None = None,
    *,
    quantile: float = DEFAULT_QUANTILE,
) -> RateEstimate:
    """Posterior failure rate after ``failures`` unclean ends in ``exposure_hours`` of run.

    This is what the run journal's reader calls: it counts unclean ends (failures) and
    the wall time the run was up (exposure). Without a prior, Jeffreys' Gamma(1/2, 0) is
    used, which needs some exposure to give an answer.
    """
    if failures < 0:
        raise ValueError(f"failures must be >= 0, got {failures}")
    if not (exposure_hours >= 0 and math.isfinite(exposure_hours)):
        raise ValueError(f"exposure must be >= 0 hours, got {exposure_hours}")
    if not 0 < quantile < 1:
        raise ValueError(f"quantile must be in (0, 1), got {quantile}")
    shape0, rate0 = (0.5, 0.0) if prior is None else (prior.shape, prior.exposure_hours)
    if rate0 + exposure_hours <= 0:
        raise ValueError("no prior and no exposure: nothing to estimate a rate from")
    return RateEstimate(
        failures=failures,
        exposure_hours=exposure_hours,
        shape=shape0 + failures,
        rate_hours=rate0 + exposure_hours,
        quantile=quantile,
    )


class FailureRateLearner:
    """Online estimate of per-class failure rates for one run.

    Keeps the failure count per class and the exposure; ``rates_per_s()`` returns the
    conservative total rate split by the posterior mean share of each class.
    """

    def __init__(
        self,
        prior: RatePrior,
        class_prior: Mapping[str, float] | None = None,
        *,
        class_prior_weight: float = 10.0,
        quantile: float = DEFAULT_QUANTILE,
    ) -> None:
        counts = dict(LLAMA3_CLASS_COUNTS if class_prior is None else class_prior)
        total = sum(counts.values())
        if total <= 0 or any(v < 0 for v in counts.values()):
            raise ValueError("class prior needs non-negative shares with a positive sum")
        # Dirichlet pseudo-counts: Llama 3's split, worth class_prior_weight failures.
        self._class_alpha = {k: class_prior_weight * v / total for k, v in counts.items()}
        self.prior = prior
        self.quantile = quantile
        self.failures: dict[str, int] = dict.fromkeys(counts, 0)
        self.exposure_hours = 0.0

    def observe_failure(self, cls: str) -> None:
        if cls not in self.failures:
            raise KeyError(f"unknown failure class {cls!r}; known: {sorted(self.failures)}")
        self.failures[cls] += 1

    def add_exposure(self, hours: float) -> None:
        if hours < 0:
            raise ValueError("exposure cannot go backwards")
        self.exposure_hours += hours

    def total(self) -> RateEstimate:
        return estimate_from_history(
            sum(self.failures.values()), self.exposure_hours, self.prior, quantile=self.quantile
        )

    def shares(self) -> dict[str, float]:
        """Posterior mean share of each class."""
        post = {k: a + self.failures[k] for k, a in self._class_alpha.items()}
        s = sum(post.values())
        return {k: v / s for k, v in post.items()}

    def rates_per_s(self, conservative: bool = True) -> dict[str, float]:
        est = self.total()
        per_hour = est.conservative_per_hour if conservative else est.mean_per_hour
        return {k: per_hour * share / 3600.0 for k, share in self.shares().items()}


def llama3_shares() -> dict[str, float]:
    total = sum(LLAMA3_CLASS_COUNTS.values())
    return {k: v / total for k, v in LLAMA3_CLASS_COUNTS.items()}


# --- the regularised incomplete gamma function and its inverse (stdlib only) ---------


def gamma_cdf(shape: float, rate: float, x: float) -> float:
    """P(X <= x) for X ~ Gamma(shape, rate): the regularised lower incomplete gamma."""
    if shape <= 0 or rate <= 0:
        raise ValueError("shape and rate must be > 0")
    if x <= 0:
        return 0.0
    return _reg_lower_gamma(shape, rate * x)


def _reg_lower_gamma(a: float, x: float) -> float:
    # Series below a + 1, Lentz's continued fraction above (Numerical Recipes 6.2).
    log_pre = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1.0:
        term = 1.0 / a
        total = term
        n = a
        for _ in range(10_000):
            n += 1.0
            term *= x / n
            total += term
            if abs(term) < abs(total) * 1e-15:
                break
        return min(1.0, total * math.exp(log_pre))
    tiny = 1e-300
    b = x + 1.0 - a
    c = 1.0 / tiny
    d = 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return max(0.0, 1.0 - math.exp(log_pre) * h)


def gamma_quantile(shape: float, rate: float, q: float) -> float:
    """The q-quantile of Gamma(shape, rate).

    Newton's method from the Wilson-Hilferty guess, kept inside a bisection bracket so
    it cannot diverge: a few CDF evaluations instead of dozens, since the scheduler asks
    for this after every failure.
    """
    if shape <= 0 or rate <= 0:
        raise ValueError("shape and rate must be > 0")
    if not 0 < q < 1:
        raise ValueError(f"quantile must be in (0, 1), got {q}")
    z = NormalDist().inv_cdf(q)
    c = 1.0 / (9.0 * shape)
    x = shape * max(1e-3, 1.0 - c + z * math.sqrt(c)) ** 3
    lo, hi = 0.0, math.inf
    log_norm = math.lgamma(shape)
    for _ in range(200):
        f = _reg_lower_gamma(shape, x) - q
        if f < 0:
            lo = x
        else:
            hi = x
        pdf = math.exp((shape - 1.0) * math.log(x) - x - log_norm)
        nxt = x - f / pdf if pdf > 0 else math.nan
        if not (lo < nxt < hi):  # Newton left the bracket: bisect instead
            nxt = (lo + hi) / 2.0 if math.isfinite(hi) else 2.0 * x
        if abs(nxt - x) <= 1e-13 * x:
            x = nxt
            break
        x = nxt
    return x / rate


__all__ = [
    "CORRELATED",
    "CORRELATED_ALLOWANCE",
    "DEFAULT_QUANTILE",
    "LLAMA3_CAUSES",
    "LLAMA3_CLASS_COUNTS",
    "LLAMA3_RATE_PER_DEVICE_HOUR",
    "MACHINE",
    "PROCESS",
    "SURVIVES",
    "SWITCH",
    "FailureRateLearner",
    "RateEstimate",
    "RatePrior",
    "estimate_from_history",
    "gamma_cdf",
    "gamma_quantile",
    "llama3_class_counts",
    "llama3_shares",
    "merge_classes",
]
