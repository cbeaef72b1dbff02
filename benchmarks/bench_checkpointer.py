"""What ``Checkpointer.step()`` costs the training loop, and what its rare slow calls cost.

The target (issue 4): ``ckpt.step()`` when no snapshot is due costs under 20 us. Each
call is timed on its own with ``time.perf_counter_ns`` over many calls; the table gives
the median, p99, p99.9 and the maximum, and the same loop around an empty function
shows what the timing itself costs (it is included in every figure, not subtracted).

Rows:
- ``step(), nothing due``: the hot path (a clock read and one comparison).
- ``step(), housekeeping``: a slow call with nothing due, as happens every ``replan_s``
  (10 s) or every 0.5 s while a snapshot is in flight: polls the snapshots in flight,
  measures the step time, refreshes the failure rate, no re-plan. Forced here by
  setting the Checkpointer's next check time into the past before each call.
- ``re-plan, N tier(s)``: ``scheduler.model.optimise`` for the store's tiers, run at
  most every ``replan_s`` and only when an input moved by 20%.
- ``step(), snapshot due``: a slow call that starts ``async_save`` of a small state
  (64 KiB) to a local directory: mostly the engine's stall.

    python benchmarks/bench_checkpointer.py               # ~10 s
    python benchmarks/bench_checkpointer.py --calls 200000 --json out.json
    python benchmarks/bench_checkpointer.py --smoke   # does it run? (test_benchmarks.py)

The test suite runs only its --smoke run (tests/integration/test_benchmarks.py).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import common
import torch

import snapcore
from snapcore.tiers import HostTier
from snapcore.write.engine import close_all

TARGET_NS = 20_000


def machine() -> str:
    cpu = common.cpu_model(platform.processor() or platform.machine())
    return (
        f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}, torch {torch.__version__}"
    )


def timed(fn: Callable[[int], None], calls: int) -> list[int]:
    out = [0] * calls
    clock = time.perf_counter_ns
    for i in range(calls):
        t0 = clock()
        fn(i)
        out[i] = clock() - t0
    return out


def summary(name: str, ns: list[int]) -> tuple[str, dict[str, int]]:
    s = sorted(ns)
    n = len(s)

    def q(p: float) -> int:
        return s[min(n - 1, math.ceil(p * n) - 1)]

    return name, {
        "calls": n,
        "median_ns": q(0.5),
        "p99_ns": q(0.99),
        "p999_ns": q(0.999),
        "max_ns": s[-1],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=1_000_000, help="timed hot-path calls")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="a tiny run that only checks the benchmark works (few calls; the target's "
        "verdict is printed but does not set the exit status)",
    )
    args = p.parse_args(argv)
    # timed calls: housekeeping, re-plans per store, snapshots
    housekeeping_calls, replan_calls, snapshots = 20_000, 100, 200
    if args.smoke:
        args.calls, housekeeping_calls, replan_calls, snapshots = 1000, 100, 5, 3

    state = {"w": torch.randn(128, 128), "step": 0}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:

        def noop(i: int) -> None:
            pass

        rows.append(summary("empty timed call (timing overhead)", timed(noop, args.calls)))

        # the hot path: 1 device, so the snapshot after the first is an hour away
        ckpt = snapcore.Checkpointer(Path(tmp) / "hot", devices=1, handle_sigterm=False)
        ckpt.restore(state)
        ckpt.step(0, state)  # the first call begins the run and snapshots (a slow call)
        ckpt.wait()
        assert ckpt.plan().intervals_s["local"] > 600

        def hot(i: int) -> None:
            ckpt.step(i + 1, state)

        rows.append(summary("step(), nothing due", timed(hot, args.calls)))
        assert ckpt.stats().snapshots == 1

        def housekeeping(i: int) -> None:
            ckpt._next_check = -math.inf  # white box: force a slow call
            ckpt.step(args.calls + i + 1, state)

        rows.append(summary("step(), housekeeping", timed(housekeeping, housekeeping_calls)))
        assert ckpt.stats().snapshots == 1
        ckpt.close(final=False)

        host = f"bench-{uuid.uuid4().hex[:8]}"
        stores = {
            1: Path(tmp) / "one",
            3: snapcore.Store(
                host=host, local=Path(tmp) / "three", remote=(Path(tmp) / "remote").as_uri()
            ),
        }
        for n, store in stores.items():
            c = snapcore.Checkpointer(store, devices=16384, handle_sigterm=False)

            def replan(i: int, c: snapcore.Checkpointer = c) -> None:
                c._replan(c._clock(), force=True)

            rows.append(summary(f"re-plan, {n} tier(s)", timed(replan, replan_calls)))
            c.close()
        HostTier(host).release()

        # slow calls that snapshot: interval forced to ~0 so every call is due
        due = snapcore.Checkpointer(Path(tmp) / "due", devices=16384, handle_sigterm=False)
        due.restore(state)

        stalls: list[int] = []

        def snap_stall(i: int) -> None:
            due._last_begin["local"] = -math.inf
            due._next_check = -math.inf
            t0 = time.perf_counter_ns()
            due.step(i, state)
            stalls.append(time.perf_counter_ns() - t0)
            due.wait()

        for i in range(snapshots):
            snap_stall(i)
        rows.append(summary("step(), snapshot due (64 KiB state)", stalls))
        due.close()
        close_all()

    print(f"machine: {machine()}")
    print(f"command: python {' '.join(sys.argv)}")
    print()
    cols = ("median_ns", "p99_ns", "p999_ns", "max_ns")
    heads = " | ".join(f"{h:>11}" for h in ("median", "p99", "p99.9", "max"))
    print(f"| {'call':<38} | {'calls':>9} | {heads} |")
    print(f"|{'-' * 40}|{'-' * 11}|" + f"{'-' * 13}|" * len(cols))
    for name, r in rows:
        cells = " | ".join(f"{r[k] / 1000:>8.2f} us" for k in cols)
        print(f"| {name:<38} | {r['calls']:>9,} | {cells} |")
    hot = dict(rows)["step(), nothing due"]
    ok = hot["median_ns"] < TARGET_NS and hot["p99_ns"] < TARGET_NS
    print()
    print(
        f"target: step() with nothing due under 20 us (median and p99): "
        f"{'PASS' if ok else 'FAIL'} (median {hot['median_ns'] / 1000:.2f} us, "
        f"p99 {hot['p99_ns'] / 1000:.2f} us)"
    )
    doc = {"machine": machine(), "rows": [{"name": n, **r} for n, r in rows]}
    common.write_figures(args.json, doc)
    return 0 if ok or args.smoke else 1


if __name__ == "__main__":
    sys.exit(main())
