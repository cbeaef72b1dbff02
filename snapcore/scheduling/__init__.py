"""Scheduling: the cost model, failure-rate learning, the run journal, `snapcore plan`, and
the Checkpointer on top.

The model, the rate and the plan are pure Python with no dependency on torch or the
native extension, so that planning and simulation run anywhere; only the Checkpointer
(and the journal's store lookups) import the rest of snapcore.
"""

from __future__ import annotations

from snapcore.scheduling.model import (
    CostModel,
    FailureClass,
    Plan,
    Tier,
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
    "Tier",
    "Waste",
    "daly_interval",
    "estimate_from_history",
    "expected_waste",
    "optimise",
    "young_interval",
]
