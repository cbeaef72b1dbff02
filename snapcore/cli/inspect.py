"""``snapcore inspect``: the tree of a snapshot, its tensors and values."""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import math
import sys
from typing import Any

from .. import manifest as mf
from .. import values
from ..assemble import differing_paths, layouts, merged_view
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
    p.add_argument(
        "--only", metavar="GLOB", help="only the leaves whose dotted path matches ('model.*')"
    )
    p.add_argument(
        "--json", action="store_true", help="print the step, its leaves and subtree sizes as JSON"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    with open_store(args) as st:
        tier, m = st.manifest(args.step, args.tier)
    m, differ, stages = view(m)
    if args.json:
        doc = inspect_json(m, tier, differ, args.only)
        json.dump(doc, sys.stdout, indent=1, allow_nan=False)
        print()
        return 0
    print(clean(header(m, tier, differ, stages)))
    if args.only:
        for path, text in leaves(m.tree, m, ""):
            if fnmatch.fnmatchcase(path, args.only):
                print(clean(f"{path}{text}"))
        return 0
    for line in tree_lines(m.tree, m, "", 0):
        print(clean(line))
    return 0


def view(m: mf.Manifest) -> tuple[mf.Manifest, list[str], bool]:
    """``m`` with the tree ``snapcore.load`` reads (rank 0's, or for ranks that saved
    different tensors, as pipeline stages do, every group's merged:
    ``assemble.merged_view``), the paths whose values differ between the ranks of a
    sharded step, and whether its ranks saved different tensors."""
    if m.rank_trees is None:
        return m, [], False
    groups = layouts(m)
    if len(groups) < 2:
        return m, differing_paths(m), False
    tree, differ = merged_view(m, groups)
    return dataclasses.replace(m, tree=tree), differ, True


def header(m: mf.Manifest, tier: str, differ: list[str], stages: bool) -> str:
    """``step N (tier): T tensors, S of tensor data``, and for a sharded step its world
    size, the ranks this tier lacks and the values that differ between ranks."""
    text = (
        f"step {m.step} ({tier}): {len(m.tensors)} tensors, {human_bytes(m.nbytes)} of tensor data"
    )
    if m.rank_trees is None:
        return text
    text += f"; sharded, saved by {m.world_size} ranks"
    if m.missing_ranks:
        text += f" (this tier holds the parts of {m.world_size - len(m.missing_ranks)})"
    if stages:
        text += "; its ranks saved different tensors (pipeline stages?): every rank's shown"
    if differ:
        shown = ", ".join(differ[:4]) + (f" and {len(differ) - 4} more" if len(differ) > 4 else "")
        rank = next(r for r, t in enumerate(m.rank_trees) if t is not None)
        whose = "the lowest rank's of each" if stages else f"rank {rank}'s"
        text += f"; rank-local values differ between ranks ({shown}): {whose} shown"
    return text


def inspect_json(
    m: mf.Manifest, tier: str, differ: list[str], only: str | None = None
) -> dict[str, Any]:
    """What ``inspect --json`` prints (docs/cli.md): the step, every leaf (or those
    ``only`` matches) and the tensor bytes of every subtree holding tensors."""
    sharded = m.rank_trees is not None
    doc: dict[str, Any] = {
        "step": m.step,
        "tier": tier,
        "created_unix": m.created_unix,
        "world_size": m.world_size,
        "sharded": sharded,
        "tensors": len(m.tensors),
        "tensor_bytes": m.nbytes,
        "stored_bytes": m.stored_bytes,
    }
    if sharded:
        doc["missing_ranks"] = list(m.missing_ranks)
        doc["rank_local"] = differ
    doc["leaves"] = [
        leaf_json(path, kind, value, m)
        for path, kind, value in leaf_nodes(m.tree)
        if not only or fnmatch.fnmatchcase(path, only)
    ]
    if not only:
        doc["subtrees"] = [
            {"path": path, "tensors": len(ids), "tensor_bytes": _bytes(ids, m)}
            for path, ids in subtree_tensors(m.tree)
            if ids
        ]
    return doc


def leaf_json(path: str, kind: str, value: Any, m: mf.Manifest) -> dict[str, Any]:
    """A leaf for scripts: ``{"path", "kind", "dtype", "shape", "nbytes"}`` for a tensor,
    ``{"path", "kind", "value"}`` for a plain value (a float that is not finite is the
    string ``"inf"``, ``"-inf"`` or ``"nan"``), ``{"path", "kind", "text"}`` (the printed
    form) for the others."""
    if kind == "tensor":
        t = m.tensors[value]
        return {
            "path": path,
            "kind": kind,
            "dtype": t.dtype,
            "shape": list(t.shape),
            "nbytes": t.nbytes,
        }
    if kind == "float":
        try:
            x = decode_float(value)
        except (ValueError, OverflowError, TypeError):
            return {"path": path, "kind": kind, "text": scalar(kind, value)}
        return {"path": path, "kind": kind, "value": x if math.isfinite(x) else str(x)}
    if kind in ("int", "bool", "str"):
        return {"path": path, "kind": kind, "value": value}
    if kind == "none":
        return {"path": path, "kind": kind, "value": None}
    return {"path": path, "kind": kind, "text": scalar(kind, value)}


def leaf_nodes(node: dict[str, Any], path: str = "") -> list[tuple[str, str, Any]]:
    """(dotted path, kind, value) of every leaf: what ``--only``, ``diff`` and ``cat``
    name. Dicts, lists, tuples, objects with a state dict and dataclasses are walked."""
    out: list[tuple[str, str, Any]] = []
    _walk(node, path, out)
    return out


def _walk(node: dict[str, Any], path: str, out: list[tuple[str, str, Any]]) -> None:
    (kind, value), *_ = node.items()
    if kind == "dict":
        for k, v in value:
            _walk(v, join_path(path, k), out)
    elif kind in ("list", "tuple"):
        for i, v in enumerate(value):
            _walk(v, join_path(path, i), out)
    elif kind == "stateful":
        _walk(value["state"], path, out)
    elif kind == "dataclass":
        for k, v in values.children(kind, value):
            _walk(v, join_path(path, k), out)
    else:
        out.append((path or "<root>", kind, value))


def subtree_tensors(node: dict[str, Any], path: str = "") -> list[tuple[str, set[int]]]:
    """(dotted path, tensor indices under it) of every inner node, the root first (its
    path ``""``); a tensor shared by two paths (tied weights) counts once per subtree."""
    out: list[tuple[str, set[int]]] = []
    _subtrees(node, path, out)
    return out


def _children(kind: str, value: Any, path: str) -> list[tuple[str, str, dict[str, Any]]] | None:
    """(key, dotted path, node) of an inner node's children; None for a leaf. An object
    saved through its state dict has the state dict's entries as children."""
    if kind == "dict":
        return [(str(k), join_path(path, k), v) for k, v in value]
    if kind in ("list", "tuple"):
        return [(str(i), join_path(path, i), v) for i, v in enumerate(value)]
    if kind == "dataclass":
        return [(str(k), join_path(path, k), v) for k, v in values.children(kind, value)]
    if kind == "stateful":
        (skind, svalue), *_ = value["state"].items()
        if skind == "dict":
            return [(str(k), join_path(path, k), v) for k, v in svalue]
        return [("<state>", path, value["state"])]
    return None


def _subtrees(node: dict[str, Any], path: str, out: list[tuple[str, set[int]]]) -> set[int]:
    (kind, value), *_ = node.items()
    children = _children(kind, value, path)
    if children is None:
        return tensor_ids(node)
    at = len(out)
    out.append((path, set()))
    ids: set[int] = set()
    for _, p, child in children:
        ids |= _subtrees(child, p, out)
    out[at] = (path, ids)
    return ids


def tensor_ids(node: Any) -> set[int]:
    """The tensors a node refers to, at any depth (an array's data, a generator's state)."""
    if isinstance(node, dict):
        if len(node) == 1 and isinstance(node.get("tensor"), int):
            return {node["tensor"]}
        return set().union(*(tensor_ids(v) for v in node.values())) if node else set()
    if isinstance(node, list):
        return set().union(*(tensor_ids(v) for v in node)) if node else set()
    return set()


def _bytes(ids: set[int], m: mf.Manifest | None) -> int:
    if m is None:
        return 0
    return sum(m.tensors[i].nbytes for i in ids if 0 <= i < len(m.tensors))


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
    """The tree, one line per node; an inner node holding tensors says their size."""
    return _tree(node, m, name, depth)[0]


def _size(ids: set[int], m: mf.Manifest | None) -> str:
    if not ids or m is None:
        return ""
    n = len(ids)
    return f"  {human_bytes(_bytes(ids, m))} in {n} tensor{'s' if n > 1 else ''}"


def _tree(
    node: dict[str, Any], m: mf.Manifest, name: str, depth: int
) -> tuple[list[str], set[int]]:
    (kind, value), *_ = node.items()
    pad = "  " * depth
    label = f"{pad}{name}" if name else f"{pad}<root>"
    if kind in ("list", "tuple") and len(value) > LONG and _scalars(value):
        kinds = sorted({next(iter(v)) for v in value})
        head = ", ".join(scalar(*next(iter(v.items()))) for v in value[:SHOWN])
        return [f"{label} = ({kind} of {len(value)} {'/'.join(kinds)}: {head}, ...)"], set()
    children = _children(kind, value, "")
    if children is None:
        return [f"{label}{describe_leaf(kind, value, m)}"], tensor_ids(node)
    if kind == "dict":
        title = f"{label}/"
    elif kind in ("list", "tuple"):
        title = f"{label}/ ({kind} of {len(value)})"
    elif kind == "dataclass":
        title = f"{label}/ ({values.describe(kind, value)})"
    else:
        title = f"{label}/ ({value['type']})"
    out: list[str] = [title]
    ids: set[int] = set()
    for key, _, child in children:
        lines, got = _tree(child, m, key, depth + 1)
        out += lines
        ids |= got
    out[0] += _size(ids, m)
    return out, ids


def leaves(node: dict[str, Any], m: mf.Manifest, path: str) -> list[tuple[str, str]]:
    """(dotted path, description) of every leaf, for ``--only``."""
    return [(p, describe_leaf(kind, value, m)) for p, kind, value in leaf_nodes(node, path)]
