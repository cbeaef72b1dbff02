"""A sharded snapshot (format 3) assembled from its index and parts into one manifest.

``manifest.json`` of a sharded step is an index naming one part per rank; each part is a
manifest of what its rank wrote: its files and blobs, and its tensors with their global
shapes and the pieces that rank wrote (docs/format.md, "Sharded snapshots"). ``merge``
turns them into one ``Manifest`` the reader uses like any other: the parts' files and
blobs one after another, a tensor of the job's state (a global key) one entry whose pieces
come from every part, a rank-local tensor one entry per rank. Each rank's tree is kept
(``rank_trees``, indices into the merged tensors); ``tree`` is rank 0's.

Pure: bytes in, a manifest out; the callers (the tiers) read the files.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable
from typing import Any

import xxhash

from . import manifest as mf
from .errors import InvalidManifest
from .tree import tensor_paths

__all__ = [
    "differing",
    "differing_paths",
    "drop_units",
    "global_keys",
    "layouts",
    "leaf_signatures",
    "merge",
    "merge_trees",
    "merged_view",
    "read_sharded",
    "without",
]


def read_sharded(
    index: mf.Index,
    read: Callable[[str, int], bytes | None],
    *,
    where: str,
    partial: bool = False,
) -> mf.Manifest:
    """Read and check every part the index names (``read(name, size)`` returns the
    file's bytes, at most ``size + 1``, or None when there is no such file), then merge
    them. ``partial``: a node-local tier holds the parts of its node's ranks only; a
    missing part is then left out (``missing_ranks``) instead of an error."""
    parts: list[mf.Manifest | None] = []
    for ref in index.parts:
        data = read(ref.name, ref.size)
        at = _part_at(where, ref)
        if data is None:
            if not partial:
                raise InvalidManifest(f"{at}: the part is missing")
            parts.append(None)
            continue
        if len(data) != ref.size:
            raise InvalidManifest(f"{at}: part of {len(data)} bytes, the index says {ref.size}")
        got = xxhash.xxh3_128_hexdigest(data)
        if got != ref.xxh3:
            raise InvalidManifest(f"{at}: part's xxh3 is {got}, the index says {ref.xxh3}")
        part = mf.parse_part(data, where=at)
        if part.step != index.step or part.part is None or part.part.rank != ref.rank:
            raise InvalidManifest(f"{at}: not rank {ref.rank}'s part of step {index.step}")
        if part.part.plan != index.plan or part.world_size != index.world_size:
            raise InvalidManifest(f"{at}: a part of another save plan or world size")
        parts.append(part)
    return merge(index, parts, where=where)


def _part_at(where: str, ref: mf.PartRef) -> str:
    """Where a part is, for messages: the index's ``where`` (``.../step-N/manifest.json``)
    with the part's store-relative name in place of the step's."""
    return f"{where.rsplit('/', 2)[0]}/{ref.name}"


def merge(index: mf.Index, parts: list[mf.Manifest | None], *, where: str) -> mf.Manifest:
    """One manifest of the whole sharded step (see the module docstring); ``None`` for a
    part this tier does not hold. Raises ``InvalidManifest`` when ranks disagree on a
    tensor's dtype or shape, or when the pieces of a tensor overlap or (all parts
    present) do not tile it exactly once."""
    files: list[mf.FileRef] = []
    blobs: list[mf.Blob] = []
    tensors: list[mf.TensorEntry] = []
    by_key: dict[str, int] = {}
    rank_files: list[list[int]] = []
    trees: list[dict[str, Any] | None] = []
    file_index: dict[str, int] = {}
    missing = [r for r, p in enumerate(parts) if p is None]
    for part in parts:
        if part is None:
            rank_files.append([])
            trees.append(None)
            continue
        assert part.part is not None
        at = _part_at(where, index.parts[part.part.rank])
        b0 = len(blobs)
        # Parts may name the same file: a chunk is shared by content with an earlier
        # snapshot's file, whichever rank wrote it.
        here = []
        for f in part.files:
            i = file_index.get(f.name)
            if i is None:
                i = file_index[f.name] = len(files)
                files.append(f)
            elif files[i].size != f.size:
                raise InvalidManifest(
                    f"{at}: rank {part.part.rank} says {f.name} has {f.size} bytes, "
                    f"another rank {files[i].size}"
                )
            here.append(i)
        rank_files.append(here)
        for b in part.blobs:
            chunks = [
                mf.Chunk(here[c.file], c.offset, c.length, c.xxh3, c.codec, c.raw_length)
                for c in b.chunks
            ]
            blobs.append(mf.Blob(b.nbytes, chunks, b.element_size))
        remap: list[int] = []
        named = [k for k in part.part.keys if k is not None]
        if len(set(named)) != len(named):
            raise InvalidManifest(f"{at}: a key names two tensors")
        for key, t in zip(part.part.keys, part.tensors, strict=True):
            pieces = [
                mf.Piece(p.offsets, p.shape, p.blob + b0, p.byte_offset, p.strides)
                for p in t.pieces
            ]
            i = by_key.get(key) if key is not None else None
            if i is None:
                i = len(tensors)
                tensors.append(mf.TensorEntry(t.dtype, t.shape, pieces))
                if key is not None:
                    by_key[key] = i
            else:
                e = tensors[i]
                if (e.dtype, e.shape) != (t.dtype, t.shape):
                    raise InvalidManifest(
                        f"{at}: {key}: rank {part.part.rank} saved {t.dtype}{list(t.shape)}, "
                        f"another rank {e.dtype}{list(e.shape)}"
                    )
                e.pieces.extend(pieces)
            remap.append(i)
        trees.append(_renumber(part.tree, remap))
    keyed = {i: key for key, i in by_key.items()}
    for i, t in enumerate(tensors):
        # A rank-local tensor is its part's alone: whole even when other parts are missing.
        _check_tiling(
            t, keyed.get(i, f"<rank-local tensor {i}>"), where, whole=not missing or i not in keyed
        )
    present = [t for t in trees if t is not None]
    if not present:
        raise InvalidManifest(f"{where}: none of the step's parts is in this tier")
    m = mf.Manifest(
        step=index.step,
        created_unix=index.created_unix,
        writer=index.writer,
        world_size=index.world_size,
        rank_files=rank_files,
        files=files,
        blobs=blobs,
        tensors=tensors,
        tree=present[0],
        rank_trees=trees,
        part_files=[ref.name for r, ref in enumerate(index.parts) if r not in missing],
        missing_ranks=missing,
        missing_parts=[_part_at(where, index.parts[r]) for r in missing],
        keys=[keyed.get(i) for i in range(len(tensors))],
    )
    return m


def _check_tiling(t: mf.TensorEntry, key: str, where: str, *, whole: bool = True) -> None:
    """The pieces of ``t`` do not overlap and (``whole``) cover it exactly once.

    By cells: each dimension is cut at every piece's boundaries, and each cell may be
    covered once. A grid of n pieces (what DTensor placements and the save plan make) has
    n cells, so the check is linear; a layout cut into more than ``16 n + 65536`` cells
    is refused instead of being checked at a cost its metadata does not bound (an
    overlap query per piece is quadratic for a hostile part: docs/format.md)."""
    numel = math.prod(t.shape)
    boxes = [(p.offsets, p.shape) for p in t.pieces if all(p.shape)]
    held = sum(math.prod(s) for _, s in boxes)
    if held > numel or (whole and held != numel):
        raise InvalidManifest(
            f"{where}: {key}: the parts' pieces hold {held} of the "
            f"{numel} elements of shape {list(t.shape)}"
        )
    if len(boxes) < 2:
        return
    cuts = [
        sorted({0, g}.union(*({o[d], o[d] + s[d]} for o, s in boxes)))
        for d, g in enumerate(t.shape)
    ]
    cells = math.prod(len(c) - 1 for c in cuts)
    if cells > 16 * len(boxes) + (1 << 16):
        raise InvalidManifest(
            f"{where}: {key}: {len(boxes)} pieces cut the tensor into {cells} cells "
            "(more than 16 per piece): not a grid of pieces"
        )
    at = [{v: i for i, v in enumerate(c)} for c in cuts]
    strides = [math.prod(len(c) - 1 for c in cuts[d + 1 :]) for d in range(len(cuts))]
    covered = bytearray(cells)
    for o, s in boxes:
        spans = [
            range(at[d][o[d]] * st, at[d][o[d] + s[d]] * st, st) for d, st in enumerate(strides)
        ]
        for cell in itertools.product(*spans):
            flat = sum(cell)
            if covered[flat]:
                raise InvalidManifest(f"{where}: {key}: two saved pieces overlap")
            covered[flat] = 1


def _renumber(tree: Any, remap: list[int]) -> Any:
    """A part's tree with tensor references (``{"tensor": i}``, also inside value nodes)
    pointing into the merged tensors. The tree was validated: every index is in range."""
    return _map_tensors(tree, lambda i: {"tensor": remap[i]})


def _map_tensors(tree: Any, fn: Callable[[int], Any]) -> Any:
    """A copy of ``tree`` with each tensor reference ``{"tensor": i}`` replaced by
    ``fn(i)``. Iterative: a tree nested as deep as JSON decoding allows must not exhaust
    the stack."""
    top: list[Any] = [None]
    stack: list[tuple[Any, Any, Any]] = [(tree, top, 0)]
    while stack:
        node, into, at = stack.pop()
        if isinstance(node, dict):
            if len(node) == 1 and type(node.get("tensor")) is int:
                into[at] = fn(node["tensor"])
                continue
            obj: dict[str, Any] = dict.fromkeys(node)  # the keys in their order
            into[at] = obj
            stack.extend((v, obj, k) for k, v in node.items())
        elif isinstance(node, list):
            items: list[Any] = [None] * len(node)
            into[at] = items
            stack.extend((v, items, i) for i, v in enumerate(node))
        else:
            into[at] = node
    return top[0]


def differing_paths(m: mf.Manifest, ranks: list[int] | None = None) -> list[str]:
    """The paths whose saved value differs between the ranks of a sharded snapshot (all of
    them, or ``ranks``): its rank-local values (``leaf_signatures``). A path one of the
    ranks lacks differs too."""
    if not m.rank_trees or len(m.rank_trees) < 2:
        return []
    chosen = range(len(m.rank_trees)) if ranks is None else ranks
    return differing([leaf_signatures(m, t) for r in chosen if (t := m.rank_trees[r]) is not None])


def differing(sigs: list[dict[str, str]]) -> list[str]:
    """The paths whose signature (``leaf_signatures``) differs between ranks' trees, each
    given by its signatures (compared by content: they may come from different tiers'
    assemblies of the step). A path one of them lacks differs too."""
    if len(sigs) < 2:
        return []
    keys = set().union(*sigs)
    return sorted(k for k in keys if any(s.get(k) != sigs[0].get(k) for s in sigs[1:]))


def layouts(m: mf.Manifest) -> dict[frozenset[str], list[int]]:
    """The ranks of a sharded snapshot grouped by the global tensors their trees hold
    (their keys), lowest rank first: one group when every rank saved the same tensors
    (FSDP2, TP, HSDP, DDP), one per stage for pipeline stages. Ranks whose part this
    tier lacks are left out."""
    out: dict[frozenset[str], list[int]] = {}
    if not m.rank_trees or m.keys is None:
        return out
    for r, t in enumerate(m.rank_trees):
        if t is not None:
            out.setdefault(global_keys(m, t), []).append(r)
    return out


def global_keys(m: mf.Manifest, tree: dict[str, Any]) -> frozenset[str]:
    """The global tensors (their keys) of a rank's ``tree`` of the sharded snapshot ``m``."""
    keys = m.keys or []
    return frozenset(k for i in tensor_paths(tree) if (k := keys[i]) is not None)


def merged_view(m: mf.Manifest, groups: dict[frozenset[str], list[int]]) -> tuple[Any, list[str]]:
    """For a snapshot whose ranks saved different tensors (``layouts``: several groups,
    such as pipeline stages): the trees of the lowest rank of each group merged
    (``merge_trees``: every group's tensors, the lowest rank's values first), and the
    paths whose values differ between ranks (within a group, or between groups that
    both saved the path). Ranks this tier lacks are left out; ``load`` refuses them."""
    assert m.rank_trees is not None
    leaders = sorted(g[0] for g in groups.values())
    trees = [t for r in leaders if (t := m.rank_trees[r]) is not None]
    differ = set().union(*(differing_paths(m, g) for g in groups.values()))
    sigs = [leaf_signatures(m, t) for t in trees]
    for k in set().union(*sigs):  # a value several groups saved, not alike
        if len({s[k] for s in sigs if k in s}) > 1:
            differ.add(k)
    return merge_trees(trees), sorted(differ)


def merge_trees(trees: list[dict[str, Any]]) -> dict[str, Any]:
    """The union of saved trees: the first tree, with the dict entries (and the entries of
    objects saved through ``state_dict()``) that it lacks added from the next ones, in
    order, recursively. Where two trees hold different values at one path, the first's
    is kept. Pipeline stages' trees hold different entries of one ``state_dict()``
    (``AppState``'s model and optimizer): the union holds every stage's."""
    out = trees[0]
    for t in trees[1:]:
        out = _merge(out, t)
    return out


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    (ka, va), *_ = a.items()
    (kb, vb), *_ = b.items()
    if ka == kb == "dict":
        at = {json.dumps(k): n for n, (k, _) in enumerate(va)}
        items = [list(x) for x in va]
        for key, child in vb:
            n = at.get(json.dumps(key))
            if n is None:
                items.append([key, child])
            else:
                items[n][1] = _merge(items[n][1], child)
        return {"dict": items}
    if ka == kb == "stateful" and va.get("type") == vb.get("type"):
        return {"stateful": {**va, "state": _merge(va["state"], vb["state"])}}
    return a


def leaf_signatures(m: mf.Manifest, tree: dict[str, Any]) -> dict[str, str]:
    """Each leaf of ``tree`` (a dict entry that is not itself a dict or stateful object)
    by path, with a signature that is equal when two ranks saved the same value: the
    node itself, with every tensor reference replaced by the tensor's dtype, shape and
    the hashes of its chunks (rank-local tensors of equal content compare equal)."""
    out: dict[str, str] = {}

    def content(i: int) -> Any:
        t = m.tensors[i]
        hashes = [c.xxh3 for p in t.pieces for c in m.blobs[p.blob].chunks]
        return {"tensor": [t.dtype, list(t.shape), hashes]}

    stack: list[tuple[dict[str, Any], str]] = [(tree, "")]
    while stack:
        node, path = stack.pop()
        (kind, value), *_ = node.items()
        if kind == "dict":
            stack.extend((child, f"{path}.{key}" if path else str(key)) for key, child in value)
        elif kind == "stateful":
            stack.append((value["state"], path))
        else:
            try:
                out[path] = json.dumps(_map_tensors(node, content), sort_keys=True)
            except RecursionError:
                raise InvalidManifest(
                    f"step {m.step}: the value at {path[:200]!r} is nested too deeply"
                ) from None
    return out


def without(tree: dict[str, Any], paths: set[str], path: str = "") -> dict[str, Any]:
    """``tree`` with the dict entries at ``paths`` left out."""
    (kind, value), *_ = tree.items()
    if kind == "dict":
        items = []
        for key, child in value:
            p = f"{path}.{key}" if path else str(key)
            if p not in paths:
                items.append([key, without(child, paths, p)])
        return {"dict": items}
    if kind == "stateful":
        return {"stateful": {**value, "state": without(value["state"], paths, path)}}
    return tree


def drop_units(tree: dict[str, Any], paths: list[str]) -> set[str]:
    """The entries to leave out of ``tree`` so that ``paths`` are not restored: each path
    itself, or its innermost enclosing object saved through ``state_dict()`` (whose
    ``load_state_dict`` cannot take part of its state: the object then keeps its own)."""
    wanted = set(paths)
    out: set[str] = set()

    def walk(node: dict[str, Any], path: str, owner: str | None) -> None:
        (kind, value), *_ = node.items()
        if path in wanted:
            out.add(owner if owner is not None else path)
        if kind == "dict":
            for key, child in value:
                walk(child, f"{path}.{key}" if path else str(key), owner)
        elif kind == "stateful" and path:
            walk(value["state"], path, path)
        elif kind == "stateful":
            walk(value["state"], path, owner)

    walk(tree, "", None)
    return out
