"""``snapcore inspect``: the tree of a snapshot, its tensors and values."""

from __future__ import annotations

import argparse
import fnmatch
import json
import sys
from typing import Any

from .. import manifest as mf
from .. import values
from ..tree import decode_float, join_path
from .output import clean, human_bytes
from .stores import add_store_args, open_store

SHOWN = 4  # values shown of a long sequence of scalars
LONG = 8  # a sequence of more scalars than this is collapsed to one line
LONG_STR = 200  # a longer string shows its first SHOWN_STR characters and its length
SHOWN_STR = 60


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("inspect", help="show the tree of a snapshot: tensors and values")
    add_store_args(p)
    p.add_argument("--step", type=int, help="default: the newest committed step")
    p.add_argument("--tier", choices=("host", "local", "remote"), help="read this tier's copy")
    p.add_argument("--only", metavar="GLOB", help="only the leaves whose path matches")
    p.add_argument("--json", action="store_true", help="print the manifest as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    with open_store(args) as st:
        tier, m = st.manifest(args.step, args.tier)
    if args.json:
        json.dump(m.to_json(), sys.stdout, indent=1)
        print()
        return 0
    print(
        f"step {m.step} ({tier}): {len(m.tensors)} tensors, {human_bytes(m.nbytes)} of tensor data"
    )
    if args.only:
        for path, text in leaves(m.tree, m, ""):
            if fnmatch.fnmatchcase(path, args.only):
                print(clean(f"{path}{text}"))
        return 0
    for line in tree_lines(m.tree, m, "", 0):
        print(clean(line))
    return 0


def describe_leaf(kind: str, value: Any, m: mf.Manifest) -> str:
    """A leaf as ``: dtype [shape] size`` (tensors) or `` = value``."""
    if kind == "tensor":
        t = m.tensors[value]
        shape = "x".join(map(str, t.shape)) or "scalar"
        return f": {t.dtype} [{shape}] {human_bytes(t.nbytes)}"
    return f" = {scalar(kind, value)}"


def scalar(kind: str, value: Any) -> str:
    if kind == "float":
        try:
            return repr(decode_float(value))
        except (ValueError, OverflowError, TypeError):  # a manifest a reader would refuse
            return f"<float> {value!r:.60}"
    if kind == "none":
        return "None"
    if kind == "str" and isinstance(value, str) and len(value) > LONG_STR:
        return f"{value[:SHOWN_STR]!r}... ({len(value)} characters)"
    if kind in ("int", "bool", "str"):
        return repr(value)
    if kind in values.KINDS:
        try:
            return values.describe(kind, value)
        except (KeyError, TypeError, ValueError):  # a manifest a reader would refuse
            pass
    summary = json.dumps(value, separators=(",", ":"))  # a kind this printer does not know
    return f"<{kind}> {summary[:60]}{'...' if len(summary) > 60 else ''}"


def _scalars(value: list[dict[str, Any]]) -> bool:
    return all(next(iter(v)) in ("int", "float", "bool", "str", "none") for v in value)


def tree_lines(node: dict[str, Any], m: mf.Manifest, name: str, depth: int) -> list[str]:
    (kind, value), *_ = node.items()
    pad = "  " * depth
    label = f"{pad}{name}" if name else f"{pad}<root>"
    if kind == "dict":
        out = [f"{label}/"]
        for k, v in value:
            out += tree_lines(v, m, str(k), depth + 1)
        return out
    if kind in ("list", "tuple"):
        if len(value) > LONG and _scalars(value):
            kinds = sorted({next(iter(v)) for v in value})
            head = ", ".join(scalar(*next(iter(v.items()))) for v in value[:SHOWN])
            return [f"{label} = ({kind} of {len(value)} {'/'.join(kinds)}: {head}, ...)"]
        out = [f"{label}/ ({kind} of {len(value)})"]
        for i, v in enumerate(value):
            out += tree_lines(v, m, str(i), depth + 1)
        return out
    if kind == "dataclass":
        out = [f"{label}/ ({values.describe(kind, value)})"]
        for k, v in values.children(kind, value):
            out += tree_lines(v, m, str(k), depth + 1)
        return out
    if kind == "stateful":
        out = [f"{label}/ ({value['type']})"]
        (skind, svalue), *_ = value["state"].items()
        if skind == "dict":
            for k, v in svalue:
                out += tree_lines(v, m, str(k), depth + 1)
        else:
            out += tree_lines(value["state"], m, "<state>", depth + 1)
        return out
    return [f"{label}{describe_leaf(kind, value, m)}"]


def leaves(node: dict[str, Any], m: mf.Manifest, path: str) -> list[tuple[str, str]]:
    """(dotted path, description) of every leaf, for ``--only``."""
    (kind, value), *_ = node.items()
    if kind == "dict":
        return [x for k, v in value for x in leaves(v, m, join_path(path, k))]
    if kind in ("list", "tuple"):
        return [x for i, v in enumerate(value) for x in leaves(v, m, join_path(path, i))]
    if kind == "stateful":
        return leaves(value["state"], m, path)
    if kind == "dataclass":
        return [
            x for k, v in values.children(kind, value) for x in leaves(v, m, join_path(path, k))
        ]
    return [(path or "<root>", describe_leaf(kind, value, m))]
