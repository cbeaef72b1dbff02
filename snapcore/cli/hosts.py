"""``snapcore hosts`` and ``snapcore rm --host``: the host-memory areas, and freeing one."""

from __future__ import annotations

import argparse

from ..api import free_host, host_areas
from .output import clean, human_bytes


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("hosts", help="list the host-memory areas (/dev/shm/snapcore-*)")
    p.add_argument("--root", default="/dev/shm", help=argparse.SUPPRESS)
    p.set_defaults(func=run_hosts)
    rm = sub.add_parser("rm", help="free a host-memory area (its snapshots are deleted)")
    rm.add_argument("--host", metavar="NAME", required=True, help="the area to free")
    rm.add_argument("--root", default="/dev/shm", help=argparse.SUPPRESS)
    rm.set_defaults(func=run_rm)


def run_hosts(args: argparse.Namespace) -> int:
    areas = host_areas(args.root)
    if not areas:
        print(f"no host-memory areas in {args.root}")
        return 0
    rows = [("NAME", "SIZE", "STEPS", "WRITER", "STORE")]
    for a in areas:
        steps = ",".join(map(str, a.steps[-4:])) or "-"
        writer = f"pid {a.writer.get('pid')}" if a.writer else "-"
        store = ", ".join(f"{k}={v}" for k, v in (a.store or {}).items() if v) or "-"
        rows.append((a.name, human_bytes(a.bytes), steps, writer, store))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print(clean("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1]))
    return 0


def run_rm(args: argparse.Namespace) -> int:
    freed = free_host(args.host, root=args.root)
    print(f"freed host-memory area {args.host} ({human_bytes(freed)})")
    return 0
