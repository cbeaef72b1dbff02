"""The ``snapcore`` command: ls, inspect, verify, gc, plan, journal."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from collections.abc import Sequence
from typing import Any

from .api import committed
from .engine import close_all, engine_for
from .errors import CorruptSnapshot, SnapcoreError
from .store import LocalStore
from .tiers import Store, as_store


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _store(args: argparse.Namespace) -> Store:
    """The Store the command's arguments describe: STORE is a directory or a URL."""
    options = json.loads(args.storage_options) if args.storage_options else None
    base = as_store(args.store)
    return Store(
        local=base.local,
        remote=args.remote or base.remote,
        host=args.host,
        storage_options=options,
        retention=_parse_retention(getattr(args, "retention", None)),
    )


def _parse_retention(text: str | None) -> dict[str, str]:
    if not text:
        return {}
    out = {}
    for part in text.split(","):
        tier, _, value = part.partition("=")
        if not value:
            raise SystemExit(f"snapcore: --retention {text!r}: expected TIER=N or TIER=N+EVERY")
        out[tier.strip()] = value.strip()
    return out


def _cmd_ls(args: argparse.Namespace) -> int:
    store = _store(args)
    steps = committed(store)
    engine = engine_for(store)
    every = sorted({s for ss in steps.values() for s in ss})
    incomplete = []
    if store.local is not None:
        incomplete = [s.step for s in LocalStore(store.local).snapshots() if not s.committed]
    if not every and not incomplete:
        print(f"no snapshots in {store.describe()}")
        return 0
    rows = [("STEP", "TIME", "SIZE", "TENSORS", "TIERS", "STATUS")]
    for step in sorted(set(every) | set(incomplete)):
        tiers = [t for t, ss in steps.items() if step in ss]
        if not tiers:
            rows.append((str(step), "-", "-", "-", "-", "incomplete (interrupted or in progress)"))
            continue
        try:
            m = engine.tier(tiers[0]).read_manifest(step)
        except SnapcoreError as e:
            rows.append((str(step), "-", "-", "-", ",".join(tiers), f"damaged manifest: {e}"))
            continue
        when = dt.datetime.fromtimestamp(m.created_unix).strftime("%Y-%m-%d %H:%M:%S")
        rows.append(
            (
                str(m.step),
                when,
                human_bytes(m.nbytes),
                str(len(m.tensors)),
                ",".join(tiers),
                "committed",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1])
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    store = LocalStore(args.store)
    m = store.read_manifest(store.resolve_step(args.step))
    if args.json:
        json.dump(m.to_json(), sys.stdout, indent=1)
        print()
        return 0
    print(f"step {m.step}: {len(m.tensors)} tensors, {human_bytes(m.nbytes)} of tensor data")
    _print_tree(m.tree, m, "", 0)
    return 0


def _print_tree(node: dict[str, Any], m: Any, name: str, depth: int) -> None:
    (kind, value), *_ = node.items()
    pad = "  " * depth
    label = f"{pad}{name}" if name else f"{pad}<root>"
    if kind == "tensor":
        t = m.tensors[value]
        shape = "x".join(map(str, t.shape)) or "scalar"
        print(f"{label}: {t.dtype} [{shape}] {human_bytes(t.nbytes)}")
    elif kind == "dict":
        print(f"{label}/")
        for k, v in value:
            _print_tree(v, m, str(k), depth + 1)
    elif kind in ("list", "tuple"):
        print(f"{label}/ ({kind} of {len(value)})")
        for i, v in enumerate(value):
            _print_tree(v, m, str(i), depth + 1)
    elif kind == "stateful":
        print(f"{label}/ ({value['type']})")
        for k, v in value["state"].get("dict", []):
            _print_tree(v, m, str(k), depth + 1)
    else:
        print(f"{label} = {value!r}")


def _cmd_verify(args: argparse.Namespace) -> int:
    from .read import verify_snapshot
    from .tiers import LocalTier

    tier = LocalTier(args.store)
    step = tier.store.resolve_step(args.step)
    bar = _Progress(f"verify step {step}", enabled=not args.quiet and sys.stderr.isatty())
    try:
        damaged = verify_snapshot(tier, step, progress=bar.update)
    except CorruptSnapshot as e:  # missing or truncated file: nothing to read at all
        bar.close()
        print(f"DAMAGED: {e}", file=sys.stderr)
        return 1
    bar.close()
    if damaged:
        for e in damaged:
            print(f"DAMAGED: {e}", file=sys.stderr)
        print(f"step {step}: {len(damaged)} damaged chunk(s)", file=sys.stderr)
        return 1
    print(f"step {step}: intact")
    return 0


def _cmd_gc(args: argparse.Namespace) -> int:
    store = _store(args)
    engine = engine_for(store)
    verb = "would delete" if args.dry_run else "deleted"
    total = 0
    for name in store.tiers:
        tier = engine.tier(name)
        doomed = store.retention_for(name).doomed(tier.committed_steps())
        for step in doomed:
            print(f"{name}: {verb} step {step} (retention)")
            if not args.dry_run:
                tier.uncommit(step)
        if args.dry_run and doomed:
            print(f"{name}: (data of deleted steps is counted once they are deleted)")
        removed = tier.collect(dry_run=args.dry_run)
        for path in removed:
            print(f"{name}: {verb} {path}")
        total += len(removed)
    done = "would be deleted (dry run)" if args.dry_run else "deleted"
    print(f"{total} unreferenced or leftover file(s) {done}")
    return 0


def _cmd_journal(args: argparse.Namespace) -> int:
    """The run journal's events, failures and the failure rate they give."""
    from .journal import history_json, history_text, journal_path, read_history
    from .scheduler.rate import LLAMA3_RATE_PER_DEVICE_HOUR, RatePrior

    store = args.store if args.store.endswith(".jsonl") else _store(args)
    if journal_path(store) is None:
        print(f"{args.store}: a store with object storage only keeps no journal", file=sys.stderr)
        return 1
    history = read_history(store)
    prior = None
    if args.devices is not None:
        rate = args.rate_per_device_hour or LLAMA3_RATE_PER_DEVICE_HOUR
        prior = RatePrior.from_devices(args.devices, rate)
    estimate = history.estimate(prior) if prior or history.exposure_hours > 0 else None
    if args.json:
        print(json.dumps(history_json(history, estimate)))
    else:
        print("\n".join(history_text(history, estimate)))
    return 0


class _Progress:
    def __init__(self, label: str, *, enabled: bool) -> None:
        self.label = label
        self.enabled = enabled

    def update(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        frac = done / total if total else 1.0
        bar = "#" * int(frac * 30)
        sys.stderr.write(
            f"\r{self.label} [{bar:<30}] {frac:6.1%} {human_bytes(done)}/{human_bytes(total)}"
        )
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="snapcore", description="Inspect and manage snapcore stores.")
    sub = p.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("ls", help="list the snapshots of a store, and the tiers holding them")
    _tier_args(ls)
    ls.set_defaults(func=_cmd_ls)
    ins = sub.add_parser("inspect", help="show the tensors of a snapshot")
    ins.add_argument("store")
    ins.add_argument("--step", type=int)
    ins.add_argument("--json", action="store_true", help="print the manifest")
    ins.set_defaults(func=_cmd_inspect)
    ver = sub.add_parser("verify", help="check every chunk's hash (exit 1 if damaged)")
    ver.add_argument("store")
    ver.add_argument("--step", type=int)
    ver.add_argument("--quiet", action="store_true", help="no progress bar")
    ver.set_defaults(func=_cmd_verify)
    gc = sub.add_parser(
        "gc", help="apply retention and remove unreferenced data and leftovers, per tier"
    )
    _tier_args(gc)
    gc.add_argument(
        "--retention",
        metavar="TIER=N[+EVERY],...",
        help="e.g. local=3,remote=2+10: keep the last N, plus every EVERY-th step",
    )
    gc.add_argument("--dry-run", action="store_true", help="print what would be deleted")
    gc.set_defaults(func=_cmd_gc)
    sub.add_parser("plan", help="what-if for the checkpoint interval (see snapcore plan -h)")
    jr = sub.add_parser("journal", help="the run journal: starts, restores, exits, failure rate")
    _tier_args(jr)
    jr.add_argument("--devices", type=int, help="prior: this many devices (default: no prior)")
    jr.add_argument("--rate-per-device-hour", type=float, help="prior (default: Llama 3's)")
    jr.add_argument("--json", action="store_true", help="print one JSON object")
    jr.set_defaults(func=_cmd_journal)
    return p


def _tier_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("store", help="a local directory, or an fsspec URL (s3://bucket/prefix)")
    p.add_argument("--remote", metavar="URL", help="the object-storage tier of this store")
    p.add_argument("--host", metavar="NAME", help="the host-memory tier (/dev/shm/snapcore-NAME)")
    p.add_argument("--storage-options", metavar="JSON", help="fsspec options for the remote")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plan"]:
        from .scheduler.plan import plan_main

        return plan_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (SnapcoreError, ValueError) as e:
        print(f"snapcore {args.cmd}: {e}", file=sys.stderr)
        return 1
    finally:
        close_all()
