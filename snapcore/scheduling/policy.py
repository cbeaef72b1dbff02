"""The Checkpointer's policy: costs and a failure rate in, a ``Schedule`` out.

Pure functions of their arguments (no clock, no store, no torch): ``rate_info`` reads the
failure rate from the failures and exposure seen, ``make_schedule`` asks the model
(model.py) for intervals and adds the tiers a store always gets (the forced rules of
docs/scheduler.md), and ``moved`` tells whether inputs changed enough to plan again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .costs import Costs
from .model import CostModel, FailureClass, TierCost, Waste, optimise
from .rate import (
    CORRELATED,
    MACHINE,
    PROCESS,
    SURVIVES,
    FailureRateLearner,
    RatePrior,
    estimate_from_history,
    merge_classes,
)

MATERIAL_CHANGE = 0.2  # relative change of an input that is worth a new plan


@dataclass(frozen=True)
class RateInfo:
    """The failure rate: what was observed and the two reads of the posterior."""

    failures: int  # past runs' unclean ends and rollbacks, plus this run's rollbacks
    by_class: dict[str, int]
    exposure_hours: float  # past runs plus this one so far
    prior_per_hour: float
    mean_per_hour: float
    conservative_per_hour: float  # the upper quantile the plan is made with
    quantile: float
    rates_per_s: dict[str, float]  # conservative rate split by class: the model's input


@dataclass(frozen=True)
class Schedule:
    """What ``Checkpointer.plan()`` returns: the intervals in use and why.

    ``intervals_s`` are the tiers written and how often (start to start); ``planned_s``
    is the optimiser's answer, which ``intervals_s`` extends with ``forced`` tiers (see
    docs/scheduler.md). ``uncovered`` lists failure classes no tier of the store
    survives; they are charged to the store's most durable tier.
    """

    intervals_s: dict[str, float]
    intervals_steps: dict[str, int] | None  # None until the step time is measured
    planned_s: dict[str, float]
    forced: dict[str, str]  # tier -> why it is written though the optimiser left it out
    waste: Waste
    target: float
    target_met: bool
    shortfall: float  # points (fraction) above the target; 0 when met
    recovers_from: dict[str, str]
    uncovered: tuple[str, ...]
    rate: RateInfo
    costs: Costs

    @property
    def predicted_waste(self) -> float:
        return self.waste.total


def rate_info(
    prior: RatePrior,
    quantile: float,
    past: Mapping[str, int],
    past_hours: float,
    own: Mapping[str, int],
    own_hours: float,
    class_prior: Mapping[str, float] | None = None,
) -> RateInfo:
    """The failure rate from past runs' failures per class (``past``, which names every
    class counted, an unknown one too) over ``past_hours``, and this run's own
    (``own``) over ``own_hours``: the Gamma posterior's conservative read, split between
    classes by Llama 3's shares (``class_prior``, default ``LLAMA3_CLASS_COUNTS``) as
    moved by the failures whose class is known."""
    by_class = {k: past.get(k, 0) + own.get(k, 0) for k in {**past, **own}}
    failures = sum(by_class.values())
    hours = past_hours + own_hours
    est = estimate_from_history(failures, hours, prior, quantile=quantile)
    learner = FailureRateLearner(prior, class_prior, quantile=quantile)
    for cls in (PROCESS, MACHINE, CORRELATED):
        learner.failures[cls] += by_class.get(cls, 0)
    shares = learner.shares()
    per_s = est.conservative_per_hour / 3600.0
    return RateInfo(
        failures=failures,
        by_class=by_class,
        exposure_hours=hours,
        prior_per_hour=prior.rate_per_hour,
        mean_per_hour=est.mean_per_hour,
        conservative_per_hour=est.conservative_per_hour,
        quantile=quantile,
        rates_per_s={cls: per_s * share for cls, share in shares.items()},
    )


# A measured slowdown under this is taken as this in the plan's inputs: noise about 0
# (0.0002 then 0.0008) is not a material change, and would re-plan at every check.
SLOWDOWN_FLOOR = 0.01


def plan_inputs(costs: Costs, rate: RateInfo, tiers: Sequence[str]) -> tuple[float, ...]:
    """The numbers a schedule depends on, in a fixed order (for ``moved``)."""
    return (
        costs.step_s or 0.0,
        costs.stall_s,
        *(costs.persist_s[t] for t in tiers),
        *(costs.restore_s[t] for t in tiers),
        rate.conservative_per_hour,
        *(rate.rates_per_s[c] for c in sorted(rate.rates_per_s)),
        max(costs.slowdown, SLOWDOWN_FLOOR),
    )


def moved(old: tuple[float, ...], new: tuple[float, ...]) -> bool:
    """Whether any input changed by more than MATERIAL_CHANGE (relative), or their number."""
    if len(old) != len(new):
        return True
    for a, b in zip(old, new, strict=True):
        if abs(a - b) > MATERIAL_CHANGE * max(abs(a), abs(b), 1e-12):
            return True
    return False


def make_schedule(
    costs: Costs,
    rate: RateInfo,
    tiers: Sequence[str],
    *,
    target: float,
    max_interval_s: float,
) -> Schedule:
    """The schedule for a store of ``tiers`` (fastest first, as ``Store.tiers`` gives
    them): the optimiser's intervals, the tiers the store always gets added (forced),
    every interval at most ``max_interval_s``. Raises ValueError if the model does."""
    tiers = tuple(tiers)
    have = set(tiers)
    deepest = tiers[-1]
    model = CostModel(
        tiers=tuple(
            TierCost(t, costs.persist_s[t], costs.restart_s + costs.restore_s[t]) for t in tiers
        ),
        stall_s=costs.stall_s,
        slowdown=costs.slowdown,
        step_s=costs.step_s or 0.0,
        max_interval_s=max_interval_s,
    )
    classes = []
    uncovered = []
    # without a peer tier, a machine lost with its partner is a lost machine like any other
    for cls, rate_per_s in merge_classes(rate.rates_per_s, tiers).items():
        mine = SURVIVES[cls] & have
        if not mine:  # e.g. a lost machine with no remote tier: the best there is
            uncovered.append(cls)
            mine = frozenset({deepest})
        classes.append(FailureClass(cls, rate_per_s, mine))
    plan = optimise(model, classes, target=target)
    intervals = dict(plan.intervals_s)
    forced: dict[str, str] = {}
    persistent = [t for t in tiers if t not in ("host", "peer")]
    if persistent and not any(t in intervals for t in persistent):
        # Host memory does not outlive the machine or a reboot: a store that has a
        # disk or a bucket always gets copies there, at the slowest planned interval.
        intervals[persistent[-1]] = max(intervals.values())
        forced[persistent[-1]] = "the only copy that outlives the machine"
    if "remote" in intervals and "local" in have and "local" not in intervals:
        intervals["local"] = intervals["remote"]
        forced["local"] = "uploads to remote are read from the local copy"
    if "peer" in have and "peer" not in intervals:
        # Asked for, so used: with every snapshot that goes to a slower tier (the
        # optimiser leaves it out only when no failure it would cover is expected).
        slower = [intervals[t] for t in tiers[tiers.index("peer") + 1 :] if t in intervals]
        intervals["peer"] = min(slower) if slower else max(intervals.values())
        forced["peer"] = "asked for: every snapshot to a slower tier also goes to the partner"
    if "host" in have and "host" not in intervals:
        # Asked for, so used: a host copy of a snapshot that is staged anyway costs no
        # stall of its own (the arena is the host tier's memory).
        intervals["host"] = min(intervals.values())
        forced["host"] = "asked for: every snapshot also goes to host memory"
    # The upper bound is hard, whatever the costs assumed or measured.
    intervals = {t: min(intervals[t], max_interval_s) for t in tiers if t in intervals}
    steps = None
    if costs.step_s:
        steps = {t: max(1, round(iv / costs.step_s)) for t, iv in intervals.items()}
    return Schedule(
        intervals_s=intervals,
        intervals_steps=steps,
        planned_s=dict(plan.intervals_s),
        forced=forced,
        waste=plan.waste,
        target=plan.target,
        target_met=plan.target_met,
        shortfall=plan.shortfall,
        recovers_from=dict(plan.recovers_from),
        uncovered=tuple(uncovered),
        rate=rate,
        costs=costs,
    )


__all__ = [
    "MATERIAL_CHANGE",
    "SLOWDOWN_FLOOR",
    "RateInfo",
    "Schedule",
    "make_schedule",
    "moved",
    "plan_inputs",
    "rate_info",
]
