"""Scheduling: the cost model, failure-rate learning, the run journal, `snapcore plan`, the
measured costs, the scheduling policy, SIGTERM handling, and the Checkpointer on top.

Everything below the Checkpointer (model, rate, plan, costs, policy, preemption) is pure
Python with no dependency on torch or the native extension, so that planning and
simulation run anywhere; only the Checkpointer (and the journal's store lookups) import
the rest of snapcore. This package imports the model and the rate only.
"""

from __future__ import annotations

from snapcore.scheduling.model import (
    CostModel,
    FailureClass,
    Plan,
    TierCost,
    Waste,
    daly_interval,
    expected_waste,
    optimise,
    young_interval,
)
from snapcore.scheduling.rate import (
    FailureRateLearner,
    RateEstimate,
    RatePrior,
    estimate_from_history,
)

__all__ = [
    "CostModel",
    "FailureClass",
    "FailureRateLearner",
    "Plan",
    "RateEstimate",
    "RatePrior",
    "TierCost",
    "Waste",
    "daly_interval",
    "estimate_from_history",
    "expected_waste",
    "optimise",
    "young_interval",
]
