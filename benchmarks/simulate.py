"""Discrete-event simulation of a training run under failures, for snapcore's scheduler.

Why: the cost model in snapcore/scheduler/model.py is exact only for exponential failures
and ignores a few second-order effects (queued persists, restarts that land between
tiers, a rate that is not known in advance). This simulator plays the same failure traces
(common random numbers) against several checkpoint policies and measures the waste each
one achieves, so the model's claims can be checked rather than trusted.

Policies compared: fixed intervals (every 30 min, every 1000 steps), Young and Daly
(single tier, remote, with the cost a user would plug in: the full time to durable),
snapcore learning the rate online from a prior 10x too optimistic, and an oracle that
runs snapcore's optimiser with the true rate; the last two on host+local+remote, and
again with a peer tier (host+peer+local+remote: each node's snapshot also in a partner
node's memory), with partners placed in other racks and, in a second table, sharing one.

    python benchmarks/simulate.py            # full run (about 4 CPU-minutes)
    python benchmarks/simulate.py --quick    # a few seconds, for the test
    python benchmarks/simulate.py --smoke    # --quick on one worker (test_benchmarks.py)
    python benchmarks/simulate.py --write-docs   # also update docs/scheduler.md + PNG

Standard library only, plus matplotlib for the plot (imported only when plotting).
"""

from __future__ import annotations

import argparse
import datetime
import math
import random
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from snapcore.scheduling.costs import PEER_TRANSFER_S
from snapcore.scheduling.model import (
    CostModel,
    FailureClass,
    TierCost,
    daly_interval,
    optimise,
    young_interval,
)
from snapcore.scheduling.rate import (
    CORRELATED,
    CORRELATED_ALLOWANCE,
    LLAMA3_CAUSES,
    LLAMA3_RATE_PER_DEVICE_HOUR,
    MACHINE,
    PROCESS,
    SURVIVES,
    SWITCH,
    FailureRateLearner,
    RatePrior,
    llama3_class_counts,
    merge_classes,
)

HOUR = 3600.0
DAY = 24 * HOUR
TIERS = ("host", "peer", "local", "remote")  # every tier, fastest first
BASE_TIERS = ("host", "local", "remote")  # the policies without a peer tier
TIER_INDEX = {n: i for i, n in enumerate(TIERS)}
DEVICES_PER_NODE = 8  # Llama 3's servers: eight GPUs each

# Costs per tier (the assumptions are stated in docs/scheduler.md). Restore times
# include the job restart (requeue, process-group init): 3 minutes.
STEP_S = 5.0
STALL_S = 1.0
SLOWDOWN = 0.05
# The peer tier: the host tier's cost plus the node's snapshot over the network, 40 GB at
# 25 GB/s (snapcore/scheduling/costs.py says where the figures come from): 1.6 s.
PERSIST_S = {"host": 2.0, "peer": 2.0 + PEER_TRANSFER_S, "local": 20.0, "remote": 300.0}
RESTART_S = 180.0
RESTORE_S = {
    "host": 10.0 + RESTART_S,
    "peer": 10.0 + PEER_TRANSFER_S + RESTART_S,
    "local": 30.0 + RESTART_S,
    "remote": 120.0 + RESTART_S,
}
TARGET = 0.02
WEIBULL_SHAPE = 0.7
PRIOR_FACTOR = 0.1  # snapcore's prior rate is 10x too optimistic
WARMUP_FAILURES = 5  # "after the first few failures"
REPLAN_S = HOUR


def cost_model(tiers: Sequence[str]) -> CostModel:
    return CostModel(
        tiers=tuple(TierCost(n, PERSIST_S[n], RESTORE_S[n]) for n in tiers),
        stall_s=STALL_S,
        slowdown=SLOWDOWN,
        step_s=STEP_S,
    )


MODELS = {BASE_TIERS: cost_model(BASE_TIERS), TIERS: cost_model(TIERS)}
MODEL = MODELS[BASE_TIERS]

# Failures are drawn by cause class: Llama 3's 419 (rate.LLAMA3_CAUSES) with switch and
# cable failures kept apart, and CORRELATED_ALLOWANCE of the lost machines taking their
# partner too (none was seen; the plan allows for them, and so does this world).
CAUSE_COUNTS: dict[str, int] = {PROCESS: 0, MACHINE: -CORRELATED_ALLOWANCE, SWITCH: 0}
for _cause, _n, _cls in LLAMA3_CAUSES:
    CAUSE_COUNTS[_cls] += _n
CAUSE_COUNTS[CORRELATED] = CORRELATED_ALLOWANCE
CAUSE_SHARES = {k: v / sum(CAUSE_COUNTS.values()) for k, v in CAUSE_COUNTS.items()}

# Where partners sit: in other racks, a switch or cable failure (at most one rack) is a
# lost machine whose partner is up; in the same rack, it takes the partner too.
OTHER_RACK = "other rack"
SAME_RACK = "same rack"
SWITCH_IS = {OTHER_RACK: MACHINE, SAME_RACK: CORRELATED}

POLICIES = (
    "every 30 min",
    "every 1000 steps",
    "Young",
    "Daly",
    "snapcore",
    "oracle",
    "snapcore + peer",
    "oracle + peer",
)
SAME_RACK_POLICIES = ("snapcore + peer, same rack", "oracle + peer, same rack")
ALL_POLICIES = POLICIES + SAME_RACK_POLICIES


def class_counts(placement: str) -> dict[str, int]:
    return llama3_class_counts(partners_across_racks=placement == OTHER_RACK)


def true_classes(
    rate_per_s: float, tiers: Sequence[str] = BASE_TIERS, placement: str = OTHER_RACK
) -> list[FailureClass]:
    counts = class_counts(placement)
    total = sum(counts.values())
    rates = merge_classes({c: rate_per_s * n / total for c, n in counts.items()}, tiers)
    return [FailureClass(c, r, SURVIVES[c] & set(tiers)) for c, r in rates.items()]


def partner_loss_probability(devices: int) -> float:
    """The chance that a machine lost while the peer tier is still repairing the last one
    (before the replaced node's partner copies are rewritten) is one of the two machines
    that matter: the one holding the replaced node's copy, or the one whose copy the
    replaced node held. Partners: one each, in a ring."""
    nodes = max(2, devices // DEVICES_PER_NODE)
    return min(1.0, 2.0 / (nodes - 1))


# --- failure traces ------------------------------------------------------------------


def failure_trace(
    rng: random.Random, mtbf_s: float, shape: float | None, horizon_s: float
) -> list[tuple[float, str, float]]:
    """Failure times of the whole job (a renewal process), their cause classes (process,
    machine, switch, correlated) and a uniform number (whether a lost machine is the
    partner of one lost before, see ``run``).

    ``shape`` None gives exponential gaps; otherwise Weibull gaps with that shape, scaled
    so the mean gap is ``mtbf_s`` (shape < 1: failures cluster, many short gaps).
    """
    scale = mtbf_s if shape is None else mtbf_s / math.gamma(1.0 + 1.0 / shape)
    causes = list(CAUSE_SHARES)
    weights = [CAUSE_SHARES[c] for c in causes]
    out: list[tuple[float, str, float]] = []
    t = 0.0
    while True:
        gap = rng.expovariate(1.0 / mtbf_s) if shape is None else rng.weibullvariate(scale, shape)
        t += gap
        if t >= horizon_s:
            return out
        out.append((t, rng.choices(causes, weights)[0], rng.random()))


# --- policies --------------------------------------------------------------------------


class FixedPolicy:
    """Intervals that never change, for a store of ``tiers``."""

    replan_s = math.inf

    def __init__(self, intervals: dict[str, float], tiers: tuple[str, ...] = BASE_TIERS) -> None:
        self.intervals = intervals
        self.tiers = tiers

    def on_failure(self, t: float, cls: str) -> None:
        pass

    def on_tick(self, t: float) -> None:
        pass


_PLAN_CACHE: dict[tuple[tuple[str, ...], int, int, int], dict[str, float]] = {}


def _cached_plan(
    tiers: tuple[str, ...], rate_per_s: float, shares: dict[str, float]
) -> dict[str, float]:
    # Rates are bucketed (5% in rate, 1 point in the crash share, 10% in the correlated
    # share; waste is flat near the optimum) so that a long run re-plans from a cache
    # instead of re-optimising at every failure.
    key = (
        tiers,
        round(math.log(rate_per_s) * 20),
        round(shares.get(PROCESS, 0.0) * 100),
        round(math.log(max(shares.get(CORRELATED, 0.0), 1e-4)) * 10),
    )
    plan = _PLAN_CACHE.get(key)
    if plan is None:
        lam = math.exp(key[1] / 20)
        crash = key[2] / 100
        corr = min(1.0 - crash, math.exp(key[3] / 10))
        rates = {PROCESS: lam * crash, MACHINE: lam * (1 - crash - corr), CORRELATED: lam * corr}
        rates = merge_classes(rates, tiers)
        classes = [FailureClass(c, r, SURVIVES[c] & set(tiers)) for c, r in rates.items()]
        plan = optimise(MODELS[tiers], classes, TARGET).intervals_s
        _PLAN_CACHE[key] = plan
    return plan


class LearnedPolicy:
    """snapcore's policy: a Gamma-Poisson estimate, re-planned at failures and hourly."""

    replan_s = REPLAN_S

    def __init__(
        self,
        prior: RatePrior,
        tiers: tuple[str, ...] = BASE_TIERS,
        class_prior: dict[str, int] | None = None,
    ) -> None:
        self.tiers = tiers
        self.learner = FailureRateLearner(prior, class_prior)
        self.t = 0.0
        self.intervals = self._replan()

    def _replan(self) -> dict[str, float]:
        rates = self.learner.rates_per_s()
        total = sum(rates.values())
        return _cached_plan(self.tiers, total, {c: r / total for c, r in rates.items()})

    def _advance(self, t: float) -> None:
        self.learner.add_exposure(max(0.0, t - self.t) / HOUR)
        self.t = max(self.t, t)

    def on_failure(self, t: float, cls: str) -> None:
        self._advance(t)
        self.learner.observe_failure(cls)
        self.intervals = self._replan()

    def on_tick(self, t: float) -> None:
        self._advance(t)
        self.intervals = self._replan()


Policy = FixedPolicy | LearnedPolicy


# --- the run ---------------------------------------------------------------------------

# The copies each class of failure destroys (besides those not yet durable).
LOSES = {PROCESS: (), MACHINE: ("host", "local"), CORRELATED: ("host", "peer", "local")}


@dataclass
class RunResult:
    waste: float
    waste_after_warmup: float
    failures: int
    from_tier: dict[str, int] = field(default_factory=dict)  # restores per source tier


def run(
    trace: Sequence[tuple[float, str] | tuple[float, str, float]],
    policy: Policy,
    horizon_s: float,
    *,
    switch_is: str = CORRELATED,
    partner_loss: float = 0.0,
) -> RunResult:
    """Play one failure trace against one policy; return the waste it achieved.

    Progress is training work in seconds. A snapshot blocks training for the stall plus
    the interference of its slowest tier's persist (slowdown x persist time), captures
    the progress at its start, and becomes durable in each tier once that tier's writer
    (one snapshot at a time) has persisted it. A failure loses every copy not yet
    durable; a lost machine also loses host memory and local disk (its partner's copy of
    its snapshot, the peer tier, survives); a correlated failure (the machine and its
    partner, ``switch_is`` for a switch or cable failure) loses the peer copy too. So does
    a lost machine that strikes while the peer tier is repairing the last one (from that
    failure until the first peer snapshot after its restore is durable) with probability
    ``partner_loss``: it is the partner, or the node whose copy the replaced one held.
    The run restores from the newest surviving copy; a failure during a restart starts
    the restart over. After the restart, tiers slower than the one restored from get a
    snapshot at once, as the Checkpointer's first step after a restore takes one to
    every tier.
    """
    t = 0.0
    prog = 0.0
    durable = dict.fromkeys(TIERS, 0.0)  # progress of the newest durable copy per tier
    base = dict.fromkeys(TIERS, 0.0)  # progress at the last snapshot to each tier
    free = dict.fromkeys(TIERS, 0.0)  # when each tier's writer is next idle
    inflight: list[tuple[float, str, float]] = []
    fi, nf, failures = 0, len(trace), 0
    next_tick = policy.replan_s
    warm: tuple[float, float] | None = None
    repairing = False  # a machine was lost and the peer tier has not rewritten its copies
    repaired_at = math.inf  # when the first peer snapshot since then is durable
    from_tier: dict[str, int] = {}
    have = set(policy.tiers)  # the store's tiers: a restore reads one of them
    peer = "peer" in have

    while True:
        intervals = policy.intervals
        f_t = trace[fi][0] if fi < nf else math.inf
        t_snap = t + max(0.0, min(base[n] + iv for n, iv in intervals.items()) - prog)
        if f_t <= t_snap and f_t <= next_tick and f_t < horizon_s:
            prog += f_t - t
            t = f_t
        elif next_tick < t_snap and next_tick < horizon_s:
            prog += next_tick - t
            t = next_tick
            next_tick += policy.replan_s
            policy.on_tick(t)
            continue
        elif t_snap >= horizon_s:
            prog += horizon_s - t
            break
        else:
            prog += t_snap - t
            t = t_snap
            slack = 0.25 * min(intervals.values())  # coalesce tiers due at about now
            due = [n for n in TIERS if n in intervals and prog + slack >= base[n] + intervals[n]]
            block = STALL_S + SLOWDOWN * max(PERSIST_S[n] for n in due)
            if not (f_t < t + block):
                if inflight:
                    keep = []
                    for item in inflight:
                        if item[0] <= t:
                            durable[item[1]] = max(durable[item[1]], item[2])
                        else:
                            keep.append(item)
                    inflight = keep
                for n in due:
                    d_at = max(t + STALL_S, free[n]) + PERSIST_S[n]
                    free[n] = d_at
                    inflight.append((d_at, n, prog))
                    base[n] = prog
                    if n == "peer" and repairing:
                        repaired_at = min(repaired_at, d_at)
                t += block
                continue
            t = f_t  # the failure strikes during the stall: no snapshot, no progress

        # --- a failure at t (and any that strike during the restart) ---
        for d_at, n, cap in inflight:
            if d_at <= t:
                durable[n] = max(durable[n], cap)
        inflight = []
        while True:
            _, cls, *rest = trace[fi]
            fi += 1
            failures += 1
            if cls == SWITCH:
                cls = switch_is
            if repairing and t >= repaired_at:
                repairing, repaired_at = False, math.inf
            if cls == MACHINE and repairing and rest and rest[0] < partner_loss and peer:
                cls = CORRELATED  # the machine that held the copy (or needed it) is gone
            if cls != PROCESS:
                repairing, repaired_at = True, math.inf
            for n in LOSES[cls]:
                durable[n] = -math.inf
            policy.on_failure(t, cls)
            src = max(SURVIVES[cls] & have, key=lambda n: (durable[n], -TIER_INDEX[n]))
            nxt = trace[fi][0] if fi < nf else math.inf
            if nxt < t + RESTORE_S[src] and nxt < horizon_s:
                t = nxt
                continue
            break
        from_tier[src] = from_tier.get(src, 0) + 1
        prog = durable[src]
        t = min(t + RESTORE_S[src], horizon_s)
        for n in TIERS:
            # The Checkpointer's first step after a restore snapshots every tier: those
            # up to the one restored from hold the restart point already, the slower
            # ones are due at once (and durable once written, not before).
            base[n] = prog if TIER_INDEX[n] <= TIER_INDEX[src] else -math.inf
            free[n] = t
        if warm is None and failures >= WARMUP_FAILURES:
            warm = (t, prog)
        if t >= horizon_s:
            break

    after = math.nan
    if warm is not None and horizon_s - warm[0] > 0:
        after = 1.0 - (prog - warm[1]) / (horizon_s - warm[0])
    return RunResult(
        waste=1.0 - prog / horizon_s,
        waste_after_warmup=after,
        failures=failures,
        from_tier=from_tier,
    )


# --- experiments -----------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    devices: int
    process: str  # "exponential" or "weibull"
    seed: int
    horizon_s: float


@dataclass
class CaseResult:
    case: Case
    results: dict[str, RunResult] = field(default_factory=dict)


def policies_for(devices: int) -> dict[str, tuple[Policy, str]]:
    """Each policy, and where its store's partners sit (which decides whether a switch or
    cable failure takes the partner's copy; no matter without a peer tier)."""
    rate = LLAMA3_RATE_PER_DEVICE_HOUR * devices / HOUR
    mtbf = 1.0 / rate
    durable_cost = STALL_S + PERSIST_S["remote"]  # what a user would plug into Young/Daly
    floor = PERSIST_S["remote"]  # the remote tier cannot take snapshots faster
    prior = RatePrior(rate * HOUR * PRIOR_FACTOR)

    def oracle(tiers: tuple[str, ...], placement: str) -> FixedPolicy:
        plan = optimise(MODELS[tiers], true_classes(rate, tiers, placement), TARGET)
        return FixedPolicy(plan.intervals_s, tiers)

    # snapcore's class prior is Llama 3's split for the placement, as the Checkpointer's
    # partners_across_racks gives it; it learns the rest.
    return {
        "every 30 min": (FixedPolicy({"remote": 1800.0}), OTHER_RACK),
        "every 1000 steps": (FixedPolicy({"remote": 1000 * STEP_S}), OTHER_RACK),
        "Young": (
            FixedPolicy({"remote": max(floor, young_interval(durable_cost, mtbf))}),
            OTHER_RACK,
        ),
        "Daly": (
            FixedPolicy({"remote": max(floor, daly_interval(durable_cost, mtbf))}),
            OTHER_RACK,
        ),
        "snapcore": (LearnedPolicy(prior), OTHER_RACK),
        "oracle": (oracle(BASE_TIERS, OTHER_RACK), OTHER_RACK),
        "snapcore + peer": (LearnedPolicy(prior, TIERS, class_counts(OTHER_RACK)), OTHER_RACK),
        "oracle + peer": (oracle(TIERS, OTHER_RACK), OTHER_RACK),
        "snapcore + peer, same rack": (
            LearnedPolicy(prior, TIERS, class_counts(SAME_RACK)),
            SAME_RACK,
        ),
        "oracle + peer, same rack": (oracle(TIERS, SAME_RACK), SAME_RACK),
    }


def run_case(case: Case, only: Sequence[str] | None = None) -> CaseResult:
    """Every policy (or those named in ``only``) on the case's failure trace."""
    rate = LLAMA3_RATE_PER_DEVICE_HOUR * case.devices / HOUR
    shape = None if case.process == "exponential" else WEIBULL_SHAPE
    rng = random.Random(f"{case.devices}-{case.process}-{case.seed}")
    trace = failure_trace(rng, 1.0 / rate, shape, case.horizon_s)
    loss = partner_loss_probability(case.devices)
    out = CaseResult(case)
    for name, (policy, placement) in policies_for(case.devices).items():
        if only is not None and name not in only:
            continue
        out.results[name] = run(
            trace, policy, case.horizon_s, switch_is=SWITCH_IS[placement], partner_loss=loss
        )
    return out


@dataclass
class Summary:
    devices: int
    process: str
    runs: int
    failures: float
    waste: dict[str, float]
    after: dict[str, float]
    predicted: float  # the model's waste for the oracle's plan, host+local+remote
    predicted_met: bool
    oracle_intervals: dict[str, float]
    predicted_peer: dict[str, float]  # the same with the peer tier, per placement
    peer_intervals: dict[str, dict[str, float]]
    from_tier: dict[str, dict[str, int]]  # restores per source tier, per policy


def summarise(results: Sequence[CaseResult]) -> list[Summary]:
    groups: dict[tuple[int, str], list[CaseResult]] = {}
    for r in results:
        groups.setdefault((r.case.devices, r.case.process), []).append(r)
    out = []
    for (devices, process), rs in sorted(groups.items()):
        rate = LLAMA3_RATE_PER_DEVICE_HOUR * devices / HOUR
        plan = optimise(MODEL, true_classes(rate), TARGET)
        peer_plans = {
            pl: optimise(MODELS[TIERS], true_classes(rate, TIERS, pl), TARGET)
            for pl in (OTHER_RACK, SAME_RACK)
        }

        def mean(xs: list[float]) -> float:
            xs = [x for x in xs if not math.isnan(x)]
            return sum(xs) / len(xs) if xs else math.nan

        from_tier: dict[str, dict[str, int]] = {}
        for p in ALL_POLICIES:
            counts: dict[str, int] = {}
            for r in rs:
                for tier, n in r.results[p].from_tier.items():
                    counts[tier] = counts.get(tier, 0) + n
            from_tier[p] = counts
        out.append(
            Summary(
                devices=devices,
                process=process,
                runs=len(rs),
                failures=mean([r.results["oracle"].failures for r in rs]),
                waste={p: mean([r.results[p].waste for r in rs]) for p in ALL_POLICIES},
                after={
                    p: mean([r.results[p].waste_after_warmup for r in rs]) for p in ALL_POLICIES
                },
                predicted=plan.predicted_waste,
                predicted_met=plan.target_met,
                oracle_intervals=plan.intervals_s,
                predicted_peer={pl: p.predicted_waste for pl, p in peer_plans.items()},
                peer_intervals={pl: p.intervals_s for pl, p in peer_plans.items()},
                from_tier=from_tier,
            )
        )
    return out


PEER_TARGET = 0.04  # issue 13: at 16,384 devices, with the peer tier
ORACLE_GAP = 0.10  # snapcore within 10% of the oracle


def checks(summaries: Sequence[Summary], judge_peer: bool = True) -> list[str]:
    """The issues' targets, each stated with the figures behind it. ``judge_peer``: say
    PASS or FAIL for issue 13's targets (a 4% line and 10% of the oracle, which a week's
    trace is too short to judge: see below)."""
    lines = []
    for s in summaries:
        tag = f"{s.devices:>6} devices, {s.process}"
        snap, orc = s.waste["snapcore"], s.waste["oracle"]
        if s.predicted_met:
            ok = snap <= TARGET
            lines.append(
                f"{tag}: model says target {TARGET:.0%} reachable (predicts {s.predicted:.2%}); "
                f"snapcore achieved {snap:.2%}: {'PASS' if ok else 'FAIL'}"
            )
        else:
            lines.append(
                f"{tag}: model says target {TARGET:.0%} out of reach (best {s.predicted:.2%}); "
                f"snapcore achieved {snap:.2%}, oracle {orc:.2%}"
            )
        for who in ("snapcore", "snapcore + peer"):
            oracle = who.replace("snapcore", "oracle")
            a_s, a_o = s.after[who], s.after[oracle]
            rel = a_s / a_o - 1 if a_o > 0 else math.nan
            verdict = "PASS" if rel <= ORACLE_GAP else "FAIL"
            if who != "snapcore" and not judge_peer:
                # one machine lost with its partner costs up to a remote interval (2 h
                # here), which a week's trace has once or not at all
                verdict = "not judged on a quick run"
            lines.append(
                f"{tag}: after {WARMUP_FAILURES} failures {who} {a_s:.2%} vs {oracle} "
                f"{a_o:.2%} ({rel:+.1%}): {verdict}"
            )
        if s.devices >= 16_000:
            others = {p: s.waste[p] for p in POLICIES if "snapcore" not in p and "oracle" not in p}
            worst = min(others, key=lambda p: others[p])
            ok = snap < others[worst]
            lines.append(
                f"{tag}: snapcore {snap:.2%} vs best baseline {worst} {others[worst]:.2%}: "
                f"{'PASS' if ok else 'FAIL'}"
            )
        if s.devices == 16_384:
            peer, orc_p = s.waste["snapcore + peer"], s.waste["oracle + peer"]
            rel = peer / orc_p - 1
            ok = peer <= PEER_TARGET and rel <= ORACLE_GAP
            verdict = ("PASS" if ok else "FAIL") if judge_peer else "not judged on a quick run"
            lines.append(
                f"{tag}: with the peer tier (partners in other racks) snapcore {peer:.2%} "
                f"(target {PEER_TARGET:.0%}; {snap:.2%} without), oracle {orc_p:.2%} "
                f"({rel:+.1%}): {verdict}"
            )
            same = s.waste["snapcore + peer, same rack"]
            verdict = "within" if same <= PEER_TARGET else "NOT within"
            lines.append(
                f"{tag}: partners sharing a rack (switch failures take them too): snapcore "
                f"{same:.2%}, {verdict} the {PEER_TARGET:.0%} target"
            )
    return lines


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def table(summaries: Sequence[Summary]) -> str:
    cols = [
        "devices",
        "failures per run",
        "process",
        *POLICIES,
        "model (oracle plan)",
        "model (oracle + peer plan)",
    ]
    head = "| " + " | ".join(cols) + " |"
    sep = "|" + "---|" * len(cols)
    rows = [head, sep]
    for s in summaries:
        cells = " | ".join(_pct(s.waste[p]) for p in POLICIES)
        model = f"{_pct(s.predicted)} | {_pct(s.predicted_peer[OTHER_RACK])}"
        rows.append(f"| {s.devices:,} | {s.failures:.0f} | {s.process} | {cells} | {model} |")
    return "\n".join(rows)


def same_rack_table(summaries: Sequence[Summary]) -> str:
    rows = [
        "| devices | process | snapcore + peer | oracle + peer | model (oracle + peer plan) "
        "| restores from host / peer / remote (snapcore + peer) |",
        "|---|---|---|---|---|---|",
    ]
    for s in summaries:
        p = "snapcore + peer, same rack"
        n = s.from_tier[p]
        rows.append(
            f"| {s.devices:,} | {s.process} | {_pct(s.waste[p])} "
            f"| {_pct(s.waste['oracle + peer, same rack'])} "
            f"| {_pct(s.predicted_peer[SAME_RACK])} "
            f"| {n.get('host', 0)} / {n.get('peer', 0)} / {n.get('remote', 0)} |"
        )
    return "\n".join(rows)


def intervals_table(summaries: Sequence[Summary]) -> str:
    def fmt(iv: dict[str, float]) -> str:
        return ", ".join(f"{t} {v:.0f} s" for t, v in iv.items())

    rows = [
        "| devices | oracle | oracle + peer (other racks) | oracle + peer (same rack) "
        "| restores from host / peer / remote (snapcore + peer, other racks) |",
        "|---|---|---|---|---|",
    ]
    for s in summaries:
        if s.process != "exponential":
            continue
        n = s.from_tier["snapcore + peer"]
        rows.append(
            f"| {s.devices:,} | {fmt(s.oracle_intervals)} | {fmt(s.peer_intervals[OTHER_RACK])} "
            f"| {fmt(s.peer_intervals[SAME_RACK])} "
            f"| {n.get('host', 0)} / {n.get('peer', 0)} / {n.get('remote', 0)} |"
        )
    return "\n".join(rows)


def after_table(summaries: Sequence[Summary]) -> str:
    rows = [
        f"| devices | process | snapcore after {WARMUP_FAILURES} failures | oracle | difference "
        "| snapcore + peer | oracle + peer | difference |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        cells = []
        for who in ("snapcore", "snapcore + peer"):
            a_s, a_o = s.after[who], s.after[who.replace("snapcore", "oracle")]
            cells.append(f"{_pct(a_s)} | {_pct(a_o)} | {100 * (a_s / a_o - 1):+.1f}%")
        rows.append(f"| {s.devices:,} | {s.process} | {' | '.join(cells)} |")
    return "\n".join(rows)


def plot(summaries: Sequence[Summary], path: Path) -> None:
    import matplotlib  # only the plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    procs = sorted({s.process for s in summaries})
    fig, axes = plt.subplots(1, len(procs), figsize=(6 * len(procs), 4.5), sharey=True)
    axes = [axes] if len(procs) == 1 else list(axes)
    for ax, proc in zip(axes, procs, strict=True):
        ss = [s for s in summaries if s.process == proc]
        xs = [s.devices for s in ss]
        for p in POLICIES:
            style = {
                "snapcore": "-o",
                "oracle": "k:x",
                "snapcore + peer": "-s",
                "oracle + peer": "k-.+",
            }.get(p, "--.")
            ax.plot(xs, [100 * s.waste[p] for s in ss], style, label=p)
        ax.axhline(100 * TARGET, color="grey", lw=0.8, ls=":", label=f"target {TARGET:.0%}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("devices (Llama 3 failure rate per device)")
        ax.set_title(f"{proc} failures")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("waste, % of wall-clock time")
    axes[-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


BEGIN = "<!-- simulate:begin -->"
END = "<!-- simulate:end -->"


def write_docs(doc: Path, block: str) -> None:
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{doc} has no {BEGIN} ... {END} block to fill")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{BEGIN}\n{block}\n{END}{tail}")


def cases(quick: bool) -> list[Case]:
    if quick:
        return [Case(16_384, p, 0, 7 * DAY) for p in ("exponential", "weibull")]
    # More seeds where failures are rare, so every scale sees a few hundred failures.
    seeds = {100_000: 2, 16_384: 4, 1024: 16}  # slowest first, to balance the workers
    return [
        Case(d, p, s, 54 * DAY)
        for d, n in seeds.items()
        for p in ("exponential", "weibull")
        for s in range(n)
    ]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small run of a few seconds")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="--quick on one worker")
    ap.add_argument("--write-docs", action="store_true", help="update docs/scheduler.md + PNG")
    ap.add_argument("--docs", default=str(Path(__file__).resolve().parent.parent / "docs"))
    args = ap.parse_args(argv)
    if args.smoke:
        args.quick, args.workers = True, 1

    t0 = time.perf_counter()
    todo = cases(args.quick)
    if args.workers > 1:
        with ProcessPoolExecutor(args.workers) as ex:
            results = list(ex.map(run_case, todo))
    else:
        results = [run_case(c) for c in todo]
    summaries = summarise(results)
    elapsed = time.perf_counter() - t0

    body = "\n".join(
        [
            table(summaries),
            "",
            "Intervals of the oracle's plans (exponential failures), and where snapcore + peer "
            "restored from (all seeds):",
            "",
            intervals_table(summaries),
            "",
            "With the peer tier, partners sharing a rack (a switch or cable failure takes a "
            "machine and its partner):",
            "",
            same_rack_table(summaries),
            "",
            after_table(summaries),
            "",
            "Checks against the issue's targets:",
            "",
            *[f"- {line}" for line in checks(summaries, judge_peer=not args.quick)],
        ]
    )
    print(body)
    print(f"\n{len(todo)} traces x {len(ALL_POLICIES)} policies in {elapsed:.1f} s")
    if args.write_docs:
        docs = Path(args.docs)
        plot(summaries, docs / "scheduler_waste.png")
        cmd = "python benchmarks/simulate.py --write-docs" + (" --quick" if args.quick else "")
        write_docs(
            docs / "scheduler.md",
            f"Produced by `{cmd}` on {datetime.date.today().isoformat()} in {elapsed:.0f} s "
            f"on a 2-core x86-64 machine (Python {sys.version.split()[0]}).\n\n{body}\n\n"
            "![waste fraction vs scale](scheduler_waste.png)",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
