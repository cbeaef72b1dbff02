"""``snapcore diff``: what differs between two snapshots (two stores, or two steps of
one): tensors added, removed and changed (max abs diff, relative L2), values changed.
Tensors are read one pair at a time, and a pair whose chunk hashes match is not read."""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import math
import sys
from typing import Any

from .. import manifest as mf
from ..read import Reader
from . import stats
from .inspect import describe_leaf, leaf_json, leaf_nodes
from .output import add_progress_args, clean, human_bytes, progress, progress_enabled
from .stores import UsageError, add_store_args, open_store


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "diff",
        help="compare two snapshots: two stores, or two steps of one (exit 0 equal, 1 different)",
    )
    add_store_args(p)
    p.add_argument(
        "store_b",
        nargs="?",
        metavar="STORE_B",
        help="the second store, a directory or URL (default: STORE, then --step-b is needed)",
    )
    p.add_argument("--step", type=int, help="STORE's step (default: its newest)")
    p.add_argument(
        "--step-b",
        type=int,
        help="STORE_B's step (default: --step if given, else STORE_B's newest)",
    )
    p.add_argument("--only", metavar="GLOB", help="only the leaves whose dotted path matches")
    p.add_argument("--json", action="store_true", help="print the differences as JSON")
    add_progress_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.store_b is None and args.step_b is None:
        raise UsageError("give a second STORE, or --step-b to compare two steps of one store")
    b_args = argparse.Namespace(**vars(args))
    if args.store_b is not None:  # --remote and --host are STORE's
        b_args.store, b_args.remote, b_args.host = args.store_b, None, None
    step_b = args.step_b if args.step_b is not None else args.step
    with contextlib.ExitStack() as stack:
        a = stack.enter_context(open_store(args))
        b = stack.enter_context(open_store(b_args)) if args.store_b is not None else a
        ra, rb = a.reader(args.step), b.reader(step_b)
        sides = [
            {"store": args.store or a.store.describe(), "step": ra.m.step, "tier": ra.tier},
            {
                "store": args.store_b or args.store or b.store.describe(),
                "step": rb.m.step,
                "tier": rb.tier,
            },
        ]
        result = compare(ra, rb, args.only, progress_enabled(args))
    for side, r in zip(sides, (ra, rb), strict=True):
        side["tier"] = r.tier
    result = {"a": sides[0], "b": sides[1], **result}
    if args.json:
        json.dump(_public(result), sys.stdout, indent=1, allow_nan=False)
        print()
    else:
        for line in text_lines(result):
            print(clean(line))
    return 0 if result["equal"] else 1


def _content(m: mf.Manifest, i: int) -> Any:
    """What decides tensor ``i``'s bytes: dtype, shape, and each piece's place, layout
    and chunk hashes. Two tensors with equal contents are equal, unread."""
    t = m.tensors[i]
    pieces = sorted(t.pieces, key=lambda p: p.offsets)
    return [
        t.dtype,
        list(t.shape),
        [
            [
                list(p.offsets),
                list(p.shape),
                p.byte_offset,
                list(p.strides),
                [[c.xxh3, c.raw_length] for c in m.blobs[p.blob].chunks],
            ]
            for p in pieces
        ],
    ]


def _signature(m: mf.Manifest, node: Any) -> str:
    """A value node with every tensor it refers to replaced by its content."""

    def sub(x: Any) -> Any:
        if isinstance(x, dict):
            if len(x) == 1 and isinstance(x.get("tensor"), int):
                return {"tensor": _content(m, x["tensor"])}
            return {k: sub(v) for k, v in x.items()}
        if isinstance(x, list):
            return [sub(v) for v in x]
        return x

    return json.dumps(sub(node), sort_keys=True)


def _leaf(path: str, kind: str, value: Any, m: mf.Manifest) -> dict[str, Any]:
    doc = leaf_json(path, kind, value, m)
    text = describe_leaf(kind, value, m)  # ": dtype [shape] size" or " = value"
    doc[TEXT] = text[2:] if text.startswith(": ") else text[3:]
    return doc


TEXT = "_text"  # a leaf's printed form, for the text output (left out of --json)


def compare(ra: Reader, rb: Reader, only: str | None, show: bool) -> dict[str, Any]:
    """The differences between the trees the readers read (docs/cli.md, ``diff --json``)."""
    ma, mb = ra.m, rb.m
    la = {p: (k, v) for p, k, v in leaf_nodes(ra.tree) if not only or fnmatch.fnmatchcase(p, only)}
    lb = {p: (k, v) for p, k, v in leaf_nodes(rb.tree) if not only or fnmatch.fnmatchcase(p, only)}
    added = [_leaf(p, *lb[p], mb) for p in lb if p not in la]
    removed = [_leaf(p, *la[p], ma) for p in la if p not in lb]
    changed: list[dict[str, Any]] = []
    unchanged = 0
    to_read: list[tuple[str, int, int]] = []
    for path, (ka, va) in la.items():
        if path not in lb:
            continue
        kb, vb = lb[path]
        if ka == kb == "tensor":
            if _content(ma, va) == _content(mb, vb):
                unchanged += 1
            else:
                to_read.append((path, va, vb))
        elif ka != kb or _signature(ma, {ka: va}) != _signature(mb, {kb: vb}):
            changed.append(
                {"path": path, "a": _leaf(path, ka, va, ma), "b": _leaf(path, kb, vb, mb)}
            )
        else:
            unchanged += 1
    total = sum(ma.tensors[i].nbytes + mb.tensors[j].nbytes for _, i, j in to_read)
    with progress(total, "diff", show) as advance:
        for path, i, j in to_read:
            ta, tb = ma.tensors[i], mb.tensors[j]
            entry: dict[str, Any] = {
                "path": path,
                "a": _leaf(path, "tensor", i, ma),
                "b": _leaf(path, "tensor", j, mb),
            }
            if ta.shape == tb.shape:
                x, y = ra.tensor(i), rb.tensor(j)
                if stats.bitwise_equal(x, y):  # other chunking, same bytes
                    entry = {}
                else:
                    entry.update(stats.compare(x, y))
                ra.release()
                rb.release()
            advance(ta.nbytes + tb.nbytes)
            if entry:
                changed.append(entry)
            else:
                unchanged += 1
    order = {p: n for n, p in enumerate(la)}
    changed.sort(key=lambda e: order[e["path"]])
    for e in changed:
        for key in ("max_abs_diff", "rel_l2"):
            if key in e:
                e[key] = stats.num(e[key])
    return {
        "equal": not (added or removed or changed),
        "changed": changed,
        "added": added,
        "removed": removed,
        "unchanged": unchanged,
        "bytes_read": ra.bytes_read + rb.bytes_read,
    }


def _public(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _public(v) for k, v in x.items() if k != TEXT}
    if isinstance(x, list):
        return [_public(v) for v in x]
    return x


def text_lines(result: dict[str, Any]) -> list[str]:
    a, b = result["a"], result["b"]
    out = [
        f"a: {a['store']} step {a['step']} ({a['tier']})",
        f"b: {b['store']} step {b['step']} ({b['tier']})",
    ]
    for e in result["changed"]:
        ta, tb = e["a"][TEXT], e["b"][TEXT]
        line = f"changed {e['path']}: {ta}" if ta == tb else f"changed {e['path']}: {ta} -> {tb}"
        if "max_abs_diff" in e:
            line += (
                f": max abs diff {_g(e['max_abs_diff'])}, rel L2 {_g(e['rel_l2'])}"
                f" ({e['elements_changed']} of {_numel(e['a'])} elements differ)"
            )
        elif e["a"]["kind"] == e["b"]["kind"] == "tensor":
            line += " (shape differs: not compared)"
        out.append(line)
    out += [f"added   {e['path']}: {e[TEXT]}" for e in result["added"]]
    out += [f"removed {e['path']}: {e[TEXT]}" for e in result["removed"]]
    out.append(
        f"{len(result['changed'])} changed, {len(result['added'])} added, "
        f"{len(result['removed'])} removed, {result['unchanged']} unchanged; "
        f"{human_bytes(result['bytes_read'])} of tensor data read"
    )
    return out


def _numel(leaf: dict[str, Any]) -> int:
    return math.prod(leaf["shape"])


def _g(x: float | str) -> str:
    return stats.fmt(x) if isinstance(x, float) else x
