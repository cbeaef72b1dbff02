"""``snapcore journal``: the run journal's events, failures and the rate they give."""

from __future__ import annotations

import argparse
import json
import os

from ..errors import SnapshotNotFound
from ..scheduling.journal import history_json, history_text, journal_path, read_history, run_facts
from ..scheduling.rate import LLAMA3_RATE_PER_DEVICE_HOUR, RatePrior
from ..tiers import Store
from .output import clean
from .stores import add_store_args, check_exists, store_from


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("journal", help="the run journal: starts, restores, exits, failure rate")
    add_store_args(p)
    p.add_argument(
        "--devices", type=int, help="prior: this many devices (default: what the runs recorded)"
    )
    p.add_argument("--rate-per-device-hour", type=float, help="prior (default: Llama 3's)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    store: Store | str
    if args.store is not None and args.store.endswith(".jsonl"):
        store = args.store
        if not os.path.isfile(store):
            raise SnapshotNotFound(f"no journal at {store}")
    else:
        store = store_from(args)
        check_exists(store)  # a store with no journal yet has no events, one missing is an error
    if journal_path(store) is None:
        raise ValueError(f"{args.store}: a store with object storage only keeps no journal")
    history = read_history(store)
    devices = args.devices if args.devices is not None else run_facts(store)[0]
    prior = None
    if devices is not None:
        rate = args.rate_per_device_hour or LLAMA3_RATE_PER_DEVICE_HOUR
        prior = RatePrior.from_devices(devices, rate)
    estimate = history.estimate(prior) if prior or history.exposure_hours > 0 else None
    if args.json:
        print(json.dumps(history_json(history, estimate)))
    else:
        for line in history_text(history, estimate):
            print(clean(line))
    return 0
