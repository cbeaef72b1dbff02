"""snapcore's checkpoint scheduler: the cost model, failure-rate learning, `snapcore plan`.

Pure Python with no dependency on torch or the native extension, so that planning and
simulation run anywhere, including before the extension is built.
"""

from __future__ import annotations

from snapcore.scheduler.model import (
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
from snapcore.scheduler.rate import (
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
