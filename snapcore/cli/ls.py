"""``snapcore ls``: the snapshots of a store and the tiers holding each."""

from __future__ import annotations

import argparse

from ..directory import LocalDirectory
from ..errors import SnapcoreError
from .output import clean, human_bytes, when
from .stores import add_store_args, open_store


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("ls", help="list the snapshots of a store, and the tiers holding them")
    add_store_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    with open_store(args) as st:
        steps = st.committed()
        every = sorted({s for ss in steps.values() for s in ss})
        incomplete = []
        if st.store.local is not None:
            snaps = LocalDirectory(st.store.local).snapshots()
            incomplete = [s.step for s in snaps if not s.committed]
        if not every and not incomplete:
            print(f"no snapshots in {clean(st.store.describe())}")
            return 0
        rows = [("STEP", "TIME", "SIZE", "TENSORS", "TIERS", "STATUS")]
        for step in sorted(set(every) | set(incomplete)):
            tiers = [t for t, ss in steps.items() if step in ss]
            if not tiers:
                rows.append(
                    (str(step), "-", "-", "-", "-", "incomplete (interrupted or in progress)")
                )
                continue
            try:
                m = st.tiers[tiers[0]].read_manifest(step)
            except SnapcoreError as e:
                rows.append((str(step), "-", "-", "-", ",".join(tiers), f"damaged manifest: {e}"))
                continue
            rows.append(
                (
                    str(m.step),
                    when(m.created_unix),
                    human_bytes(m.nbytes),
                    str(len(m.tensors)),
                    ",".join(tiers),
                    "committed",
                )
            )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        line = "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1]
        print(clean(line))
    return 0
