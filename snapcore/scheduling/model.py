"""The cost model behind snapcore's checkpoint schedule, and the interval optimiser.

Why a model of its own instead of Young's or Daly's formula: both assume one kind of
failure, one kind of checkpoint and a checkpoint that blocks training for its whole
cost. snapcore's snapshots are asynchronous and tiered, so the blocking cost (the stall)
and the work at risk (which includes the persist latency of the tier that survives a
failure) are different numbers, and different failures (a crashed process, a lost
machine) recover from different tiers. docs/scheduler.md derives the formulas used here.

All times are in seconds and all rates are failures per second of wall-clock time.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

# Upper bound on any interval: with no observed failures the optimum runs off to
# infinity, and a day is already longer than any sensible gap between snapshots.
DEFAULT_MAX_INTERVAL_S = 24 * 3600.0


@dataclass(frozen=True)
class TierCost:
    """One place a snapshot can be made durable, fastest first (host, local, remote).

    ``persist_s`` is the time from the end of the stall until the snapshot is durable in
    this tier; ``restore_s`` is restore + restart time when recovering from it.
    """

    name: str
    persist_s: float
    restore_s: float

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a tier needs a name")
        if not (self.persist_s >= 0 and math.isfinite(self.persist_s)):
            raise ValueError(f"tier {self.name!r}: persist_s must be >= 0, got {self.persist_s}")
        if not (self.restore_s >= 0 and math.isfinite(self.restore_s)):
            raise ValueError(f"tier {self.name!r}: restore_s must be >= 0, got {self.restore_s}")


@dataclass(frozen=True)
class FailureClass:
    """A kind of failure, its rate, and the tiers whose copy survives it.

    A crash of the training process leaves host memory (a shared-memory arena) intact; a
    lost machine takes its host memory and local disk with it, so only object storage
    survives it.
    """

    name: str
    rate_per_s: float
    survives: frozenset[str]

    def __post_init__(self) -> None:
        if not (self.rate_per_s >= 0 and math.isfinite(self.rate_per_s)):
            raise ValueError(f"failure class {self.name!r}: rate must be >= 0")


@dataclass(frozen=True)
class CostModel:
    """What one snapshot costs, and what recovering from each tier costs.

    ``stall_s`` blocks training once per snapshot, whatever its tiers; ``slowdown`` is the
    fraction by which training slows while a snapshot persists (PCIe, CPU and network
    contention), charged for the longest persist time of the tiers the snapshot goes to
    (that of the deepest one, unless a faster tier is slower to write).
    """

    tiers: tuple[TierCost, ...]
    stall_s: float
    slowdown: float = 0.0
    step_s: float = 0.0
    max_interval_s: float = DEFAULT_MAX_INTERVAL_S

    def __post_init__(self) -> None:
        if not self.tiers:
            raise ValueError("the cost model needs at least one tier")
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate tier names: {names}")
        if not (self.stall_s >= 0 and math.isfinite(self.stall_s)):
            raise ValueError(f"stall_s must be >= 0, got {self.stall_s}")
        if not 0 <= self.slowdown < 1:
            raise ValueError(f"slowdown must be in [0, 1), got {self.slowdown}")
        if not self.step_s >= 0:
            raise ValueError(f"step_s must be >= 0, got {self.step_s}")

    def tier(self, name: str) -> TierCost:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(name)


@dataclass(frozen=True)
class Waste:
    """Expected waste as fractions of wall-clock time; the parts add up to ``total``."""

    total: float
    overhead: float
    redone: float
    restart: float


@dataclass(frozen=True)
class Plan:
    """The scheduler's answer: how often to snapshot to each tier, and what it costs.

    ``intervals_s`` maps the tiers in use to their interval (nested: each is a whole
    multiple of the one before); a tier left out is not worth writing. ``shortfall`` is
    how far the predicted waste is above the target (0 when the target is met).
    """

    intervals_s: dict[str, float]
    waste: Waste
    target: float
    target_met: bool
    shortfall: float
    rates_per_s: dict[str, float] = field(default_factory=dict)
    recovers_from: dict[str, str] = field(default_factory=dict)

    @property
    def predicted_waste(self) -> float:
        return self.waste.total

    def steps(self, step_s: float) -> dict[str, int]:
        """Intervals expressed in training steps (at least one)."""
        if step_s <= 0:
            raise ValueError("step_s must be > 0")
        return {k: max(1, round(v / step_s)) for k, v in self.intervals_s.items()}


def young_interval(cost_s: float, mtbf_s: float) -> float:
    """Young (1974): T = sqrt(2 C M), first order in C/M."""
    _check_cost_mtbf(cost_s, mtbf_s)
    return math.sqrt(2.0 * cost_s * mtbf_s)


def daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Daly (2006), eq. 37: the higher-order optimum; M itself once d >= 2M.

    T = sqrt(2 d M) [1 + (1/3) sqrt(d/(2M)) + (1/9) (d/(2M))] - d for d < 2M, else M.
    """
    _check_cost_mtbf(cost_s, mtbf_s)
    if cost_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = cost_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * cost_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - cost_s


def _check_cost_mtbf(cost_s: float, mtbf_s: float) -> None:
    if not (cost_s >= 0 and math.isfinite(cost_s)):
        raise ValueError(f"cost must be >= 0 seconds, got {cost_s}")
    if not (mtbf_s > 0):
        raise ValueError(f"MTBF must be > 0 seconds, got {mtbf_s}")


def _expected_durable_progress(lam: float, interval: float, persist: float) -> float:
    """E[D]: progress of the newest copy durable in a tier when the next failure strikes.

    Failures arrive at total rate ``lam`` (exponential, X ~ Exp(lam) after a restart).
    Snapshots start at j*T (j >= 1) and become durable at j*T + p, the restart point
    counts as durable, so D = j*T on [j*T + p, (j+1)*T + p) and 0 before T + p:
    E[D] = sum_j j T e^{-lam (jT + p)} (1 - e^{-lam T}) = T e^{-lam (T + p)} / (1 - e^{-lam T}).
    """
    q = -math.expm1(-lam * interval)
    return interval * math.exp(-lam * (interval + persist)) / q


def _expected_restart(lam: float, restart: float) -> float:
    """Wall time to get through a restart of length R that any failure starts over."""
    return math.expm1(lam * restart) / lam


def _recovery_tiers(
    model: CostModel, classes: Sequence[FailureClass], used: Sequence[str]
) -> dict[str, str]:
    """For each failure class, the fastest used tier that survives it.

    The fastest surviving tier is also the one with the newest copy: intervals are nested,
    so it receives every snapshot a slower tier receives, and persists it sooner.
    """
    out: dict[str, str] = {}
    for c in classes:
        for t in model.tiers:
            if t.name in used and t.name in c.survives:
                out[c.name] = t.name
                break
        else:
            if c.rate_per_s > 0:
                raise ValueError(
                    f"no tier in use survives failure class {c.name!r} "
                    f"(it survives {sorted(c.survives)}); add a tier that does"
                )
    return out


def expected_waste(
    model: CostModel, classes: Sequence[FailureClass], intervals_s: Mapping[str, float]
) -> Waste:
    """Expected fraction of wall-clock time that does not advance training.

    Renewal argument over cycles (restart end to restart end), exact for exponential
    failures when the restart point is durable in every tier (derivation in
    docs/scheduler.md):
        waste = (E[restart] + (1/lam - E[D]) + O * E[D]) / (1/lam + E[restart])
    where O is the snapshot overhead per unit of run time.
    """
    used = [t.name for t in model.tiers if t.name in intervals_s]
    unknown = set(intervals_s) - {t.name for t in model.tiers}
    if unknown:
        raise ValueError(f"intervals given for unknown tiers: {sorted(unknown)}")
    if not used:
        raise ValueError("no tier has an interval")
    for name in used:
        if not intervals_s[name] > 0:
            raise ValueError(f"interval of tier {name!r} must be > 0")

    # Overhead: a stall per snapshot (the fastest tier's clock), plus interference while
    # the snapshot persists: a snapshot whose deepest tier is k persists to tiers up to k
    # at once, for the longest of their persist times (that of k itself unless a faster
    # tier is slower to write, as a partner's memory over a slow network can be).
    ts = [intervals_s[n] for n in used]
    overhead = model.stall_s / min(ts)
    longest = 0.0
    for i, name in enumerate(used):
        longest = max(longest, model.tier(name).persist_s)
        nxt = 1.0 / ts[i + 1] if i + 1 < len(ts) else 0.0
        overhead += model.slowdown * longest * max(0.0, 1.0 / ts[i] - nxt)
    if overhead >= 1.0:
        # Snapshots alone take all the time; returned as is (>= 1) so that a search
        # over intervals still sees which way is better.
        return Waste(total=overhead, overhead=overhead, redone=0.0, restart=0.0)

    lam = sum(c.rate_per_s for c in classes)
    if lam <= 0.0:
        return Waste(total=overhead, overhead=overhead, redone=0.0, restart=0.0)

    recovery = _recovery_tiers(model, classes, used)
    e_d = 0.0
    e_restart = 0.0
    for c in classes:
        if c.rate_per_s <= 0:
            continue
        tier = model.tier(recovery[c.name])
        share = c.rate_per_s / lam
        e_d += share * _expected_durable_progress(lam, intervals_s[tier.name], tier.persist_s)
        e_restart += share * _expected_restart(lam, tier.restore_s)
    cycle = 1.0 / lam + e_restart
    redone = (1.0 / lam - e_d) / cycle
    restart = e_restart / cycle
    over = overhead * e_d / cycle
    return Waste(total=redone + restart + over, overhead=over, redone=redone, restart=restart)


def _golden_min(f: Callable[[float], float], lo: float, hi: float, iters: int = 34) -> float:
    """Minimise a unimodal function on [lo, hi] (here: waste against log interval)."""
    g = (math.sqrt(5.0) - 1.0) / 2.0
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(iters):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(d)
    return (a + b) / 2.0


def _optimise_subset(
    model: CostModel, classes: Sequence[FailureClass], used: Sequence[str]
) -> tuple[dict[str, float], Waste]:
    """Coordinate descent on log intervals, keeping them ordered fastest to slowest."""
    lam = sum(c.rate_per_s for c in classes)
    floor = max(model.step_s, model.stall_s, 1e-3)
    tmax = model.max_interval_s
    # A tier is not written more often than it persists, nor more rarely than tmax: the
    # upper bound wins (a snapshot then waits for the one before it).
    lows = {n: min(tmax, max(floor, model.tier(n).persist_s)) for n in used}
    # Start from Young's interval with the stall as cost: a good guess for every tier.
    guess = young_interval(max(model.stall_s, 1e-3), 1.0 / lam) if lam > 0 else tmax
    logs = {n: math.log(min(tmax, max(lows[n], guess))) for n in used}

    def waste_of(ls: Mapping[str, float]) -> float:
        return expected_waste(model, classes, {n: math.exp(v) for n, v in ls.items()}).total

    for _ in range(6):
        before = dict(logs)
        for i, n in enumerate(used):
            lo = max([math.log(lows[n])] + [logs[m] for m in used[:i]])
            hi = min([math.log(tmax)] + [logs[m] for m in used[i + 1 :]])
            hi = max(hi, lo)
            if hi - lo < 1e-9:
                logs[n] = lo
                continue

            def f(v: float, n: str = n) -> float:
                trial = dict(logs)
                trial[n] = v
                return waste_of(trial)

            logs[n] = _golden_min(f, lo, hi)
        if max(abs(logs[n] - before[n]) for n in used) < 1e-4:
            break
    return _round_nested(model, classes, used, {n: math.exp(v) for n, v in logs.items()}, lows)


def _round_nested(
    model: CostModel,
    classes: Sequence[FailureClass],
    used: Sequence[str],
    intervals: Mapping[str, float],
    lows: Mapping[str, float],
) -> tuple[dict[str, float], Waste]:
    """Make each interval a whole multiple of the one before, then re-fit the base.

    Nesting lets one staged copy serve several tiers at once: every k-th host snapshot
    also goes to local disk, every m-th of those to object storage. Rounding a ratio can
    move the optimum, so both neighbours of each ratio are tried and the fastest tier's
    interval is optimised again for each choice.
    """
    tmax = model.max_interval_s
    choices: list[list[int]] = [[1]]
    for prev, n in itertools.pairwise(used):
        r = intervals[n] / intervals[prev]
        opts = sorted({max(1, math.floor(r)), max(1, math.ceil(r))})
        choices = [[*c, o] for c in choices for o in opts]
    best: tuple[dict[str, float], Waste] | None = None
    # When every rounding puts the slowest tier above tmax, all tiers share one interval
    # (always within tmax: lows are at most tmax).
    fallback = [1] * len(used)
    for mults in [*choices, fallback]:
        if mults is fallback and best is not None:
            break
        factors = list(itertools.accumulate(mults, lambda a, b: a * b))
        lo = max(math.log(lows[n] / f) for n, f in zip(used, factors, strict=True))
        hi = min(math.log(tmax / f) for f in factors)
        if hi < lo - 1e-12:
            continue  # the slowest tier would exceed tmax: the upper bound is hard

        def at(base: float, factors: list[int] = factors) -> dict[str, float]:
            return {n: base * f for n, f in zip(used, factors, strict=True)}

        def f(v: float) -> float:
            return expected_waste(model, classes, at(math.exp(v))).total

        base = math.exp(_golden_min(f, lo, hi) if hi - lo > 1e-9 else lo)
        if model.step_s > 0:
            base = max(model.step_s, round(base / model.step_s) * model.step_s)
            if base * factors[-1] > tmax and base > model.step_s:  # whole steps, within tmax
                base = max(
                    model.step_s, math.floor(tmax / factors[-1] / model.step_s) * model.step_s
                )
        cand = at(base)
        waste = expected_waste(model, classes, cand)
        if best is None or waste.total < best[1].total:
            best = (cand, waste)
    assert best is not None
    return best


def optimise(model: CostModel, classes: Sequence[FailureClass], target: float = 0.02) -> Plan:
    """Choose the tiers to write and their intervals, minimising expected waste.

    Every subset of tiers that still leaves each failure class a surviving copy is
    tried, since writing a tier that no failure needs only adds overhead. The plan says
    whether the minimum meets ``target`` and, if not, by how much it misses.
    """
    if not 0 < target < 1:
        raise ValueError(f"target must be a fraction in (0, 1), got {target}")
    names = [t.name for t in model.tiers]
    best: tuple[dict[str, float], Waste, list[str]] | None = None
    for mask in range(1, 1 << len(names)):
        used = [n for i, n in enumerate(names) if mask >> i & 1]
        try:
            _recovery_tiers(model, classes, used)
        except ValueError:
            continue
        intervals, waste = _optimise_subset(model, classes, used)
        if best is None or waste.total < best[1].total - 1e-12:
            best = (intervals, waste, used)
    if best is None:
        _recovery_tiers(model, classes, names)  # raises, naming the uncovered class
        raise AssertionError("unreachable")
    intervals, waste, used = best
    shortfall = max(0.0, waste.total - target)
    plan = Plan(
        intervals_s=intervals,
        waste=waste,
        target=target,
        target_met=shortfall == 0.0,
        shortfall=shortfall,
        rates_per_s={c.name: c.rate_per_s for c in classes},
        recovers_from=_recovery_tiers(model, classes, used),
    )
    if not plan.target_met:
        logger.info(
            "target waste %.2f%% is out of reach: the best plan wastes %.2f%% (%.2f points over)",
            100 * target,
            100 * waste.total,
            100 * shortfall,
        )
    return plan


def single_tier_waste(
    model: CostModel, classes: Sequence[FailureClass], tier: str, interval_s: float
) -> Waste:
    """Waste of writing every snapshot to one tier only (how Young/Daly are used)."""
    return expected_waste(model, classes, {tier: interval_s})


__all__ = [
    "DEFAULT_MAX_INTERVAL_S",
    "CostModel",
    "FailureClass",
    "Plan",
    "TierCost",
    "Waste",
    "daly_interval",
    "expected_waste",
    "optimise",
    "single_tier_waste",
    "young_interval",
]
