"""`snapcore plan`: a what-if for the checkpoint schedule, from the command line.

It answers "how often should this run snapshot, to which tier, and what will it lose?"
from a failure rate (an MTBF, or devices times a per-device rate, or a store's journal)
and the costs of a snapshot, and prints the answer beside Young's and Daly's intervals so
a user can see what the tiered, asynchronous model changes. snapcore/cli/main.py calls
``plan_main``; it may print, the library modules do not.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from snapcore.scheduling.costs import DEFAULT_PERSIST_S, DEFAULT_RESTORE_S, PEER_TRANSFER_S
from snapcore.scheduling.model import (
    CostModel,
    FailureClass,
    Plan,
    TierCost,
    daly_interval,
    expected_waste,
    optimise,
    young_interval,
)
from snapcore.scheduling.rate import (
    CORRELATED,
    LLAMA3_CLASS_COUNTS,
    LLAMA3_RATE_PER_DEVICE_HOUR,
    MACHINE,
    PROCESS,
    SURVIVES,
    RatePrior,
    estimate_from_history,
    llama3_class_counts,
    merge_classes,
)

TIER_ORDER = ("host", "peer", "local", "remote")
DEFAULT_PERSIST = dict(DEFAULT_PERSIST_S)  # host 2 s, peer 3.6 s, local 20 s, remote 5 min
DEFAULT_PERSIST_ARG = "local=20s,remote=5m"
DEFAULT_RESTART_S = 180.0
DEFAULT_RESTART = {t: DEFAULT_RESTART_S + v for t, v in DEFAULT_RESTORE_S.items()}
LLAMA3_CRASH_FRACTION = LLAMA3_CLASS_COUNTS[PROCESS] / sum(LLAMA3_CLASS_COUNTS.values())


def llama3_correlated_fraction(partners_across_racks: bool) -> float:
    """Share of Llama 3's interruptions that take a machine and its partner."""
    counts = llama3_class_counts(partners_across_racks=partners_across_racks)
    return counts[CORRELATED] / sum(counts.values())


CLASS_WORDS = {
    PROCESS: "process crashes",
    MACHINE: "lost machines",
    CORRELATED: "machines lost with their partner",
}

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)([smh])")


def parse_duration(text: str) -> float:
    """Seconds in "90", "90s", "5m", "1.5h" or "1h30m"; raises ValueError otherwise."""
    s = text.strip().lower()
    if not s:
        raise ValueError("empty duration")
    try:
        value = float(s)
    except ValueError:
        pos = 0
        value = 0.0
        for m in _PART.finditer(s):
            if m.start() != pos:
                break
            value += float(m.group(1)) * _UNITS[m.group(2)]
            pos = m.end()
        if pos != len(s) or pos == 0:
            raise ValueError(
                f"bad duration {text!r}: use a number with s, m or h (e.g. 20s, 5m, 1h30m)"
            ) from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"bad duration {text!r}: must be a finite number >= 0")
    return value


def format_duration(seconds: float) -> str:
    """Short human form: 45s, 5m25s, 2h05m."""
    if not math.isfinite(seconds):
        return "never"
    s = round(seconds)
    if s < 60:
        return f"{seconds:.3g}s" if seconds < 10 else f"{s}s"
    if s < 3600:
        m, r = divmod(s, 60)
        return f"{m}m{r:02d}s" if r else f"{m}m"
    h, r = divmod(s, 3600)
    return f"{h}h{r // 60:02d}m"


def _tier_list(text: str, option: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in text.split(","):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise ValueError(f"{option}: expected tier=duration pairs, got {item!r}")
        if name not in TIER_ORDER:
            raise ValueError(f"{option}: unknown tier {name!r}; tiers are {', '.join(TIER_ORDER)}")
        out[name] = parse_duration(value)
    return out


def _fraction(text: str) -> float:
    v = float(text)
    if not 0 <= v <= 1:
        raise ValueError(f"{text!r} is not a fraction between 0 and 1")
    return v


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="snapcore plan",
        description="How often to snapshot to each tier, and the waste to expect, "
        "beside Young's (1974) and Daly's (2006) intervals.",
    )
    rate = p.add_argument_group("failure rate (one of --mtbf, --devices, --journal)")
    rate.add_argument("--mtbf", help="mean time between failures of the whole job (e.g. 3h)")
    rate.add_argument("--devices", type=int, help="number of devices (GPUs) in the job")
    rate.add_argument(
        "--rate-per-device-hour",
        type=float,
        default=LLAMA3_RATE_PER_DEVICE_HOUR,
        help="failures per device-hour (default: Llama 3, 419 in 54 days on 16,384 GPUs)",
    )
    rate.add_argument(
        "--journal",
        metavar="STORE",
        help="learn the rate from a store's journal (its runs' devices are the prior unless "
        "--mtbf or --devices is given) and plan for the tiers that store has",
    )
    rate.add_argument(
        "--crash-fraction",
        type=float,
        default=LLAMA3_CRASH_FRACTION,
        help="share of failures that leave the machines up, so host memory survives "
        f"(default: Llama 3's {LLAMA3_CRASH_FRACTION:.3f})",
    )
    rate.add_argument(
        "--correlated-fraction",
        type=float,
        default=None,
        help="share of failures that take a machine and its partner node, so the peer "
        "tier's copy is lost too (default: Llama 3's, "
        f"{llama3_correlated_fraction(False):.3f}: switch and cable failures count, or "
        f"{llama3_correlated_fraction(True):.3f} with --partners-across-racks)",
    )
    rate.add_argument(
        "--partners-across-racks",
        action="store_true",
        help="the peer tier's partners sit behind other rack switches: a switch or cable "
        "failure then takes no machine's partner",
    )
    cost = p.add_argument_group("costs")
    cost.add_argument("--cost", default="1s", help="blocking cost (stall) of one snapshot")
    cost.add_argument("--step-time", help="time of one training step (intervals in steps)")
    cost.add_argument(
        "--persist",
        default=None,
        help=f"time to durable per tier after the stall (default {DEFAULT_PERSIST_ARG}; host "
        "is always used, 2s unless given; peer=... adds the peer tier; with --journal, the "
        "store's tiers only)",
    )
    cost.add_argument(
        "--peer",
        action="store_true",
        help="add the peer tier (each node's snapshot also in a partner node's memory) at "
        f"{DEFAULT_PERSIST['peer']:g}s to persist (host's 2s + {PEER_TRANSFER_S:g}s: 40 GB "
        "over 25 GB/s) unless --persist gives it",
    )
    cost.add_argument(
        "--restart",
        default="host=190s,peer=191.6s,local=210s,remote=5m",
        help="restore + restart time: one duration, or per tier",
    )
    cost.add_argument(
        "--slowdown",
        type=float,
        default=0.05,
        help="fraction training slows while a snapshot persists (default 0.05)",
    )
    p.add_argument("--target", type=float, default=0.02, help="target waste fraction")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


class _UsageError(ValueError):
    pass


def _mtbf_from_journal(store: str, prior: RatePrior | None) -> float:
    """Conservative MTBF in seconds from a store's run journal."""
    from snapcore.scheduling.journal import failure_history

    failures, exposure_hours = failure_history(store)
    est = estimate_from_history(int(failures), float(exposure_hours), prior)
    return 3600.0 * est.conservative_mtbf_hours


def _journal_facts(store: str) -> tuple[int | None, tuple[str, ...]]:
    """The devices and tiers the store's newest runs journaled; a store whose runs did
    not say has the tiers its path names (a directory: local disk)."""
    import os

    from snapcore.scheduling.journal import run_facts
    from snapcore.tiers import as_store

    devices, tiers = run_facts(store)
    if tiers is None:
        where = os.path.dirname(store) if store.endswith(".jsonl") else store
        tiers = as_store(where).tiers
    return devices, tiers


@dataclass
class _Setup:
    model: CostModel
    classes: list[FailureClass]
    mtbf: float
    stall: float
    store_tiers: tuple[str, ...] | None = None  # --journal: the tiers the store has
    uncovered: tuple[str, ...] = ()  # classes no tier of the store survives


def _build(args: argparse.Namespace) -> _Setup:
    if args.mtbf is not None and args.devices is not None:
        raise _UsageError("give --mtbf or --devices, not both")
    if not args.rate_per_device_hour > 0:
        raise _UsageError("--rate-per-device-hour must be > 0")
    if args.devices is not None and args.devices < 1:
        raise _UsageError("--devices must be >= 1")
    prior: RatePrior | None = None
    if args.mtbf is not None:
        mtbf = parse_duration(args.mtbf)
        if mtbf <= 0:
            raise _UsageError("--mtbf must be > 0")
        prior = RatePrior(3600.0 / mtbf)
    elif args.devices is not None:
        prior = RatePrior.from_devices(args.devices, args.rate_per_device_hour)
        mtbf = 3600.0 / prior.rate_per_hour
    elif args.journal is None:
        raise _UsageError("give the failure rate: --mtbf, --devices or --journal")
    store_tiers: tuple[str, ...] | None = None
    if args.journal is not None:
        devices, store_tiers = _journal_facts(args.journal)
        if prior is None and devices is not None and devices >= 1:
            # the prior the Checkpointer of those runs planned with: a few short runs
            # alone would otherwise make the rate (and the waste) absurd
            prior = RatePrior.from_devices(devices, args.rate_per_device_hour)
        mtbf = _mtbf_from_journal(args.journal, prior)
    if not 0 <= args.crash_fraction <= 1:
        raise _UsageError("--crash-fraction must be between 0 and 1")
    if args.correlated_fraction is not None and not (
        0 <= args.correlated_fraction <= 1 - args.crash_fraction
    ):
        raise _UsageError(
            "--correlated-fraction must be between 0 and 1 - --crash-fraction "
            f"({1 - args.crash_fraction:.3g})"
        )
    if not 0 < args.target < 1:
        raise _UsageError("--target must be a fraction between 0 and 1, e.g. 0.02")
    if not 0 <= args.slowdown < 1:
        raise _UsageError("--slowdown must be a fraction in [0, 1)")

    given = _tier_list(args.persist or DEFAULT_PERSIST_ARG, "--persist")
    persist = {"host": DEFAULT_PERSIST["host"], **given}
    if args.peer:
        persist.setdefault("peer", DEFAULT_PERSIST["peer"])
    if store_tiers is not None:
        bad = sorted(set(given) - set(store_tiers)) if args.persist else []
        if bad:
            raise _UsageError(
                f"--persist names {', '.join(bad)}, which {args.journal} does not have "
                f"(its tiers: {', '.join(store_tiers)})"
            )
        persist = {t: persist.get(t, DEFAULT_PERSIST[t]) for t in store_tiers}
    if "=" in args.restart:
        restart = dict(DEFAULT_RESTART)
        restart.update(_tier_list(args.restart, "--restart"))
    else:
        restart = dict.fromkeys(TIER_ORDER, parse_duration(args.restart))
    tiers = tuple(TierCost(n, persist[n], restart[n]) for n in TIER_ORDER if n in persist)
    step = parse_duration(args.step_time) if args.step_time is not None else 0.0
    stall = parse_duration(args.cost)
    model = CostModel(tiers, stall_s=stall, slowdown=args.slowdown, step_s=step)
    lam = 1.0 / mtbf
    crash = args.crash_fraction
    corr = args.correlated_fraction
    if corr is None:  # Llama 3's lost machines, split as the partners' placement gives
        corr = (
            (1 - crash)
            * llama3_correlated_fraction(args.partners_across_racks)
            / (1 - LLAMA3_CRASH_FRACTION)
        )
    shares = {PROCESS: crash, MACHINE: max(0.0, 1 - crash - corr), CORRELATED: corr}
    names = [t.name for t in tiers]
    uncovered: list[str] = []
    classes = []
    # without a peer tier, a machine lost with its partner is a lost machine like any other
    for cls, share in merge_classes(shares, names).items():
        survives = SURVIVES[cls] & set(names)
        if not survives and share > 0:
            if store_tiers is None:
                raise _UsageError(_uncovered_message(cls))
            # as the Checkpointer does: charged to the store's most durable tier
            uncovered.append(cls)
            survives = frozenset({tiers[-1].name})
        classes.append(FailureClass(cls, lam * share, survives))
    return _Setup(model, classes, mtbf, stall, store_tiers, tuple(uncovered))


def _uncovered_message(cls: str) -> str:
    if cls == MACHINE:
        return (
            "a lost machine takes host memory and local disk with it: add a remote tier "
            "to --persist (e.g. remote=5m) or the peer tier (--peer), or --crash-fraction 1"
        )
    return (
        "a machine lost with its partner takes the peer tier's copy too: add a remote tier "
        "to --persist (e.g. remote=5m), or --correlated-fraction 0"
    )


def plan_main(argv: Sequence[str]) -> int:
    """Run `snapcore plan` with ``argv`` (without the program name); returns the exit code.

    Exit code 0 on success (whether or not the target is met: the answer is the plan),
    2 on bad input, with the reason on stderr.
    """
    parser = _parser()
    try:
        args = parser.parse_args(list(argv))
    except SystemExit as e:  # argparse has already printed usage and the error
        return int(e.code or 0)
    try:
        setup = _build(args)
        model, classes, mtbf, stall = setup.model, setup.classes, setup.mtbf, setup.stall
        plan = optimise(model, classes, target=args.target)
    except ValueError as e:
        print(f"snapcore plan: error: {e}", file=sys.stderr)
        return 2

    slowest = model.tiers[-1].name
    young = young_interval(stall, mtbf)
    daly = daly_interval(stall, mtbf)
    # A tier cannot take snapshots faster than it persists them, so the baselines are
    # priced at no less than that (the text output says when this happened).
    floor = max(model.tiers[-1].persist_s, stall, 1e-3)
    young_w = expected_waste(model, classes, {slowest: max(young, floor)}).total
    daly_w = expected_waste(model, classes, {slowest: max(daly, floor)}).total
    if args.json:
        out = _as_json(plan, model, mtbf, slowest, young, daly, young_w, daly_w)
        if setup.store_tiers is not None:
            out["store_tiers"] = list(setup.store_tiers)
            out["uncovered"] = list(setup.uncovered)
        print(json.dumps(out))
    else:
        text = _as_text(plan, model, mtbf, stall, slowest, young, daly, young_w, daly_w)
        if setup.store_tiers is not None:
            text = _store_lines(args.journal, setup) + text
        print(text)
    return 0


def _store_lines(store: str, setup: _Setup) -> str:
    lines = [f"store {store}: tiers {', '.join(setup.store_tiers or ())}"]
    for cls in setup.uncovered:
        what = CLASS_WORDS.get(cls, cls)
        lines.append(
            f"  no tier of it survives {what}: planned as if {setup.model.tiers[-1].name} "
            "did (the best copy there is)"
        )
    return "\n".join(lines) + "\n\n"


def _as_json(
    plan: Plan,
    model: CostModel,
    mtbf: float,
    slowest: str,
    young: float,
    daly: float,
    young_w: float,
    daly_w: float,
) -> dict[str, object]:
    out: dict[str, object] = {
        "young_s": young,
        "daly_s": daly,
        "interval_s": plan.intervals_s.get(slowest),
        "predicted_waste": plan.predicted_waste,
        "intervals_s": plan.intervals_s,
        "waste_parts": {
            "overhead": plan.waste.overhead,
            "redone": plan.waste.redone,
            "restart": plan.waste.restart,
        },
        "target": plan.target,
        "target_met": plan.target_met,
        "shortfall": plan.shortfall,
        "mtbf_s": mtbf,
        "recovers_from": plan.recovers_from,
        "young_waste": young_w,
        "daly_waste": daly_w,
    }
    if model.step_s > 0:
        out["interval_steps"] = plan.steps(model.step_s)
    return out


def _as_text(
    plan: Plan,
    model: CostModel,
    mtbf: float,
    stall: float,
    slowest: str,
    young: float,
    daly: float,
    young_w: float,
    daly_w: float,
) -> str:
    rates = plan.rates_per_s
    lam = sum(rates.values())
    shares = ", ".join(
        f"{100 * r / lam:.0f}% {CLASS_WORDS.get(c, c)}" for c, r in rates.items() if lam > 0
    )
    lines = [
        f"failure rate: MTBF {format_duration(mtbf)} ({shares})",
        "",
        f"  {'tier':<8}{'every':>10}{'steps':>9}   restores after",
    ]
    by_tier: dict[str, list[str]] = {}
    for cls, tier in plan.recovers_from.items():
        by_tier.setdefault(tier, []).append(CLASS_WORDS.get(cls, cls))
    for tier in model.tiers:
        name = tier.name
        if name not in plan.intervals_s:
            lines.append(f"  {name:<8}{'never':>10}{'-':>9}   (no failure needs it)")
            continue
        t = plan.intervals_s[name]
        steps = str(round(t / model.step_s)) if model.step_s > 0 else "-"
        used_for = ", ".join(by_tier.get(name, [])) or "(written on the way to a slower tier)"
        lines.append(f"  {name:<8}{format_duration(t):>10}{steps:>9}   {used_for}")
    w = plan.waste
    lines += [
        "",
        f"predicted waste {100 * w.total:.2f}% = snapshot overhead {100 * w.overhead:.2f}% "
        f"+ redone work {100 * w.redone:.2f}% + restarts {100 * w.restart:.2f}%",
    ]
    if plan.target_met:
        lines.append(f"target {100 * plan.target:.2f}%: met")
    else:
        lines.append(
            f"target {100 * plan.target:.2f}%: NOT met, {100 * plan.shortfall:.2f} points over "
            f"(restarts alone cost {100 * w.restart:.2f}%)"
        )
    lines += [
        "",
        f"for comparison, one tier ({slowest}) with cost C = {format_duration(stall)}:",
        f"  Young (1974)  every {format_duration(young):>8}   predicted waste {100 * young_w:.2f}%",
        f"  Daly (2006)   every {format_duration(daly):>8}   predicted waste {100 * daly_w:.2f}%",
    ]
    persist = model.tiers[-1].persist_s
    if min(young, daly) < persist:
        lines.append(
            f"  (priced at every {format_duration(persist)}: {slowest} cannot take snapshots "
            "faster than it persists them)"
        )
    return "\n".join(lines)


__all__ = ["format_duration", "parse_duration", "plan_main"]
