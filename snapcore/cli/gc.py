"""``snapcore gc``: apply retention, and remove unreferenced data and leftovers."""

from __future__ import annotations

import argparse

from ..tiers import Retention
from .output import add_progress_args, progress, progress_enabled
from .stores import add_store_args, open_store


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "gc", help="remove unreferenced data and leftovers per tier (and apply --retention)"
    )
    add_store_args(p)
    p.add_argument(
        "--retention",
        metavar="TIER=N[+EVERY],...",
        help="also delete old steps: e.g. local=3,remote=2+10 keeps the last N, plus every "
        "EVERY-th step (without it, no committed step is deleted)",
    )
    p.add_argument("--dry-run", action="store_true", help="print what would be deleted")
    add_progress_args(p)
    p.set_defaults(func=run)


def parse_retention(text: str | None) -> dict[str, Retention]:
    if not text:
        return {}
    out = {}
    for part in text.split(","):
        tier, _, value = part.partition("=")
        if not value:
            raise ValueError(f"--retention {text!r}: expected TIER=N or TIER=N+EVERY")
        out[tier.strip()] = Retention.parse(value.strip())
    return out


def run(args: argparse.Namespace) -> int:
    retention = parse_retention(args.retention)
    verb = "would delete" if args.dry_run else "deleted"
    total = 0
    with open_store(args, retention=retention) as st:
        # Only the retention asked for here: gc never deletes a committed step by a
        # default the user did not name on this command line.
        plan = {
            name: retention[name].doomed(tier.committed_steps()) if name in retention else []
            for name, tier in st.tiers.items()
        }
        work = sum(len(d) + 1 for d in plan.values())  # each step, and each tier's sweep
        with progress(work, "gc", progress_enabled(args), unit="items") as advance:
            for name, tier in st.tiers.items():
                doomed = plan[name]
                for step in doomed:
                    print(f"{name}: {verb} step {step} (retention)")
                    if not args.dry_run:
                        tier.uncommit(step)
                    advance(1)
                if args.dry_run and doomed:
                    print(f"{name}: (data of deleted steps is counted once they are deleted)")
                removed = tier.collect(dry_run=args.dry_run)
                advance(1)
                for path in removed:
                    print(f"{name}: {verb} {path}")
                total += len(removed)
    done = "would be deleted (dry run)" if args.dry_run else "deleted"
    print(f"{total} unreferenced or leftover file(s) {done}")
    return 0
