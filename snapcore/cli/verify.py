"""``snapcore verify``: read every chunk of a snapshot and check its hash."""

from __future__ import annotations

import argparse
import sys

from ..errors import CorruptSnapshot
from ..read import verify_snapshot
from .output import add_progress_args, clean, progress, progress_enabled
from .stores import add_store_args, open_store


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "verify", help="check every chunk's hash in each tier holding a step (exit 1 if damaged)"
    )
    add_store_args(p)
    p.add_argument("--step", type=int, help="default: the newest committed step")
    p.add_argument("--tier", choices=("host", "local", "remote"), help="only this tier's copy")
    add_progress_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    bad = 0
    show = progress_enabled(args)
    with open_store(args) as st:
        step, holders = st.resolve(args.step)
        if args.tier is not None:
            if args.tier not in holders:
                print(f"step {step} is not committed in the {args.tier} tier", file=sys.stderr)
                return 1
            holders = [args.tier]
        for name in holders:
            damaged: list[CorruptSnapshot] | None = None
            error: CorruptSnapshot | None = None
            with progress(None, f"verify step {step} ({name})", show) as advance:
                seen = [0]

                def update(done: int, total: int, advance=advance, seen=seen) -> None:
                    advance(done - seen[0], total=total)  # called under verify's lock
                    seen[0] = done

                try:
                    damaged = verify_snapshot(st.tiers[name], step, progress=update)
                except CorruptSnapshot as e:  # a damaged manifest, a missing or truncated
                    error = e  # file: nothing was read, so one line says it all
            if damaged is None:
                assert error is not None
                print(clean(f"DAMAGED ({name}): {error}"), file=sys.stderr)
                bad += 1
                continue
            for e in damaged:
                print(clean(f"DAMAGED ({name}): {e}"), file=sys.stderr)
            if damaged:
                bad += 1
                print(f"step {step}: {len(damaged)} damaged chunk(s) in {name}", file=sys.stderr)
            else:
                print(f"step {step}: intact in {name}")
    return 1 if bad else 0
