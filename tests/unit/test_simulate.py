"""A small, fast run of the scheduler's simulator (benchmarks/simulate.py)."""

from __future__ import annotations

import importlib.util
import itertools
import math
import random
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "simulate.py"


@pytest.fixture(scope="module")
def sim() -> Iterator[types.ModuleType]:
    spec = importlib.util.spec_from_file_location("snapcore_bench_simulate", PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_traces_have_the_asked_mean(sim: types.ModuleType) -> None:
    for shape in (None, 0.7):
        trace = sim.failure_trace(random.Random(1), 100.0, shape, 400_000.0)
        gaps = [b[0] - a[0] for a, b in itertools.pairwise(trace)]
        assert sum(gaps) / len(gaps) == pytest.approx(100.0, rel=0.1)
        crash = sum(1 for _, c in trace if c == "process") / len(trace)
        assert crash == pytest.approx(63 / 419, abs=0.03)


def test_no_failures_costs_only_snapshots(sim: types.ModuleType) -> None:
    horizon = 10 * 3600.0
    res = sim.run([], sim.FixedPolicy({"remote": 1800.0}), horizon)
    # 19 snapshots started before the end, each stall 1 s + 5% of a 300 s persist
    assert res.waste == pytest.approx(19 * (1 + 0.05 * 300) / horizon)
    assert res.failures == 0 and math.isnan(res.waste_after_warmup)


def test_one_failure_hand_computed(sim: types.ModuleType) -> None:
    # Snapshots every 1000 s of work to remote (block 16 s each, durable 301 s after
    # start): the first starts at t = 1000 s (work 1000), durable at 1301 s; the second
    # at t = 2016 s (work 2000), durable at 2317 s. A lost machine at t = 2200 s: restore
    # work 1000 after 300 s of restore, then run to the end.
    horizon = 10_000.0
    res = sim.run([(2200.0, "machine")], sim.FixedPolicy({"remote": 1000.0}), horizon)
    t, prog, base = 2500.0, 1000.0, 1000.0
    while True:
        nxt = t + (base + 1000.0 - prog)
        if nxt >= horizon:
            prog += horizon - t
            break
        prog, base, t = base + 1000.0, base + 1000.0, nxt + 16.0
    assert res.waste == pytest.approx(1 - prog / horizon)


def test_quick_run_meets_the_targets(
    sim: types.ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    assert sim.main(["--quick", "--workers", "1"]) == 0
    out = capsys.readouterr().out
    assert "| 16,384 |" in out and "FAIL" not in out
