"""``snapcore cat``: one leaf of a snapshot: a tensor's dtype, shape, statistics and first
values (only that tensor's chunks are read), or a value's content."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..errors import SnapshotNotFound
from . import stats
from .inspect import leaf_json, leaf_nodes, scalar
from .output import clean, human_bytes
from .stores import add_store_args, open_store

COUNT = 8  # values shown by default


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "cat", help="show one tensor (dtype, shape, stats, first values) or value of a snapshot"
    )
    add_store_args(p)
    p.add_argument("name", metavar="NAME", help="the leaf's dotted path, as inspect prints it")
    p.add_argument("--step", type=int, help="default: the newest committed step")
    p.add_argument("--tier", choices=("host", "local", "remote"), help="read this tier's copy")
    p.add_argument(
        "-n",
        "--count",
        type=int,
        default=COUNT,
        metavar="N",
        help=f"tensor elements shown (default {COUNT})",
    )
    p.add_argument("--json", action="store_true", help="print it as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    with open_store(args) as st:
        reader = st.reader(args.step, args.tier)
        m = reader.m
        nodes = leaf_nodes(reader.tree)
        found = [(k, v) for p, k, v in nodes if p == args.name]
        if not found:
            under = [p for p, _, _ in nodes if p.startswith(args.name + ".")]
            if under:
                shown = ", ".join(under[:4]) + (", ..." if len(under) > 4 else "")
                raise SnapshotNotFound(
                    f"{args.name!r} in step {m.step} is not a leaf: it holds {len(under)} "
                    f"({shown}); snapcore inspect --only '{args.name}.*' lists them"
                )
            raise SnapshotNotFound(f"step {m.step} has no leaf {args.name!r}")
        kind, value = found[0]
        doc: dict[str, Any] = {"step": m.step, **leaf_json(args.name, kind, value, m)}
        if kind == "tensor":
            t = reader.tensor(value)
            doc["stats"] = {
                k: stats.num(v) if isinstance(v, float) else v for k, v in stats.summary(t).items()
            }
            doc["values"] = stats.first_values(t, max(args.count, 0))
            reader.release()
        doc["tier"] = reader.tier
    if args.json:
        if kind == "tensor":
            doc["values"] = [_jsonable(x) for x in doc["values"]]
        json.dump(doc, sys.stdout, indent=1, allow_nan=False)
        print()
        return 0
    for line in text_lines(doc, kind, value):
        print(clean(line))
    return 0


def _jsonable(x: Any) -> Any:
    if isinstance(x, complex):
        return [stats.num(x.real), stats.num(x.imag)]
    if isinstance(x, float):
        return stats.num(x)
    return x


def text_lines(doc: dict[str, Any], kind: str, value: Any) -> list[str]:
    path, step, tier = doc["path"], doc["step"], doc["tier"]
    if kind != "tensor":
        if kind == "str":
            return [f"{path} = {value!r}"]  # whole, however long (escaped on output)
        return [f"{path} = {scalar(kind, value)}"]
    shape = "x".join(map(str, doc["shape"])) or "scalar"
    numel = 1
    for d in doc["shape"]:
        numel *= d
    out = [f"{path}: {doc['dtype']} [{shape}] {human_bytes(doc['nbytes'])} (step {step}, {tier})"]
    s = doc["stats"]
    if s["min"] is not None:
        out.append(
            "  ".join(
                f"{k} {stats.fmt(s[k]) if isinstance(s[k], float) else s[k]}"
                for k in ("min", "max", "mean", "std")
            )
            + ("  (of |x|)" if doc["dtype"].startswith("complex") else "")
        )
    if "nan" in s:
        out.append(f"nan {s['nan']}  inf {s['inf']}")
    shown = doc["values"]
    what = f"first {len(shown)} of {numel}" if len(shown) < numel else f"all {numel}"
    out.append(f"values ({what}): [{', '.join(stats.fmt(x) for x in shown)}]")
    return out
