"""The sharded save's part reuse (``write/sharded.py``: ``_Last``), checked against the
part planned afresh: for every change a training loop can make to its state between two
saves, the reused part is either refused (None: planned again) or the very part a fresh
plan gives (same blobs with the same sources and addresses, same tensor table, same
structure fingerprint), so that it stages the state's bytes as they are now.

No process group: the tensors are plain (world of one) or rank-local, whose part needs
no exchange; the DTensor cases run under tests/multiproc/test_sharded.py."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import pytest
import torch

from snapcore.planning.global_plan import describe_local
from snapcore.planning.global_plan import structure_fingerprint as fingerprint
from snapcore.tree import Flattened, flatten
from snapcore.write.sharded import PartSpec, Sharder, _Cached, _Last, _signature


def _fresh(flat: Flattened, seq: int) -> PartSpec:
    """The part ``Sharder.part`` plans for ``flat`` without reuse (one rank, every box its
    own to write, no node-local copies)."""
    job = types.SimpleNamespace(rank=0, world_size=1)
    sharder = Sharder(job, None)  # type: ignore[arg-type]
    glob = [i for i, local in enumerate(flat.local) if not local]
    items = describe_local([flat.tensors[i] for i in glob], [flat.paths[i] for i in glob])
    structure = fingerprint(items, 1)
    writes = [not item.box.empty for item in items]
    plan = types.SimpleNamespace(fingerprint="plan")
    cached = _Cached(_signature(flat, glob), items, plan, structure, writes)  # type: ignore[arg-type]
    return sharder._spec(flat, glob, items, writes, cached, seq, structure, False)


def _same(a: PartSpec, b: PartSpec) -> None:
    assert (a.seq, a.structure, a.keys, a.drop, a.replan) == (
        b.seq,
        b.structure,
        b.keys,
        b.drop,
        b.replan,
    )
    assert a.layout.entries == b.layout.entries and a.layout.total == b.layout.total
    assert len(a.layout.blobs) == len(b.layout.blobs)
    for x, y in zip(a.layout.blobs, b.layout.blobs, strict=True):
        assert x.source is y.source
        assert (x.offset, x.nbytes, x.raw, x.src_ptr, x.tensors, x.element_size) == (
            y.offset,
            y.nbytes,
            y.raw,
            y.src_ptr,
            y.tensors,
            y.element_size,
        )


def _base() -> dict[str, Any]:
    flat = torch.arange(64, dtype=torch.float32)
    return {
        "w": torch.nn.Parameter(torch.randn(8, 4)),
        "b": torch.randn(4),
        "c": torch.randn(4),
        "views": {"lo": flat[:32], "hi": flat[32:]},  # one blob spanning both
        "t": torch.randn(3, 5).t(),  # strided: a gathered blob
        "rng": torch.get_rng_state(),  # a new tensor at every save
        "n": 3,
    }


def _swap(s: dict[str, Any]) -> None:
    s["b"], s["c"] = s["c"], s["b"]


def _p_data(s: dict[str, Any]) -> None:
    s["w"].data = torch.randn(8, 4)


def _new_param(s: dict[str, Any]) -> None:
    s["w"] = torch.nn.Parameter(torch.randn(8, 4))


def _freed_and_again(s: dict[str, Any]) -> None:
    # A new object over the same memory, as when a freed tensor's address is allocated
    # again to one of the same size (the weak reference is dead, the id may be the same).
    s["b"] = s["b"].view_as(s["b"])


def _alias_whole(s: dict[str, Any]) -> None:
    s["c"] = s["b"].view(4)  # a new object over b's memory: b and c are one tensor now


def _alias_part(s: dict[str, Any]) -> None:
    s["c"] = s["w"].detach().view(-1)[4:8]


def _view_of_new_storage(s: dict[str, Any]) -> None:
    big = torch.randn(8)
    s["b"] = big[:4]  # alike, but not alone on its storage


def _replace_a_view(s: dict[str, Any]) -> None:
    s["views"]["hi"] = torch.randn(32)


def _new_strided(s: dict[str, Any]) -> None:
    s["t"] = torch.randn(3, 5).t()


def _contiguous_for_strided(s: dict[str, Any]) -> None:
    s["t"] = torch.randn(5, 3)


def _noncontiguous_for_contiguous(s: dict[str, Any]) -> None:
    s["b"] = torch.randn(4, 2)[:, 0]


def _resize(s: dict[str, Any]) -> None:
    s["b"] = torch.randn(5)


def _half(s: dict[str, Any]) -> None:
    s["b"] = s["b"].half()


def _tie(s: dict[str, Any]) -> None:
    s["c"] = s["b"]


def _new_key(s: dict[str, Any]) -> None:
    s["d"] = torch.randn(2)


def _set_storage(s: dict[str, Any]) -> None:
    s["b"].set_(torch.randn(4))  # the same object over other memory


def _in_place(s: dict[str, Any]) -> None:
    s["b"].add_(1)
    s["w"].data.mul_(2)


def _all_new(s: dict[str, Any]) -> None:
    for k in ("b", "c"):
        s[k] = torch.randn(4)


CHANGES: dict[str, Callable[[dict[str, Any]], None]] = {
    "in_place": _in_place,
    "swap": _swap,
    "p_data": _p_data,
    "new_param": _new_param,
    "freed_and_again": _freed_and_again,
    "alias_whole": _alias_whole,
    "alias_part": _alias_part,
    "view_of_new_storage": _view_of_new_storage,
    "replace_a_view": _replace_a_view,
    "new_strided": _new_strided,
    "contiguous_for_strided": _contiguous_for_strided,
    "noncontiguous_for_contiguous": _noncontiguous_for_contiguous,
    "resize": _resize,
    "half": _half,
    "tie": _tie,
    "new_key": _new_key,
    "set_storage": _set_storage,
    "all_new": _all_new,
}


@pytest.mark.parametrize("local", [False, True], ids=["global", "rank_local"])
@pytest.mark.parametrize("name", sorted(CHANGES))
def test_a_reused_part_is_refused_or_the_fresh_plan(name: str, local: bool) -> None:
    state = _base()
    kept: list[Any] = []

    def flat_of() -> Flattened:
        f = flatten(state)
        if local:
            f.local = [True] * len(f.tensors)
        kept.append(f)
        return f

    first = flat_of()
    last = _Last.of(first, _fresh(first, 1))
    assert last is not None
    again = last.reuse(flat_of(), 2)  # nothing changed: reused as it is
    assert again is not None
    _same(again[1], _fresh(kept[-1], 2))
    last = again[0]
    state["rng"] = torch.get_rng_state()
    CHANGES[name](state)
    flat = flat_of()
    reused = last.reuse(flat, 3)
    if name in ("in_place", "p_data", "new_param", "freed_and_again", "all_new"):
        assert reused is not None, name  # the steady state's cases stay cheap
    if reused is not None:
        _same(reused[1], _fresh(flat, 3))
        # and the part after it, of the same tensors, is still the fresh plan's
        after = reused[0].reuse(flat_of(), 4)
        assert after is not None
        _same(after[1], _fresh(kept[-1], 4))


@pytest.mark.parametrize("seed", range(4))
def test_a_chain_of_saves_reuses_only_what_a_fresh_plan_would_give(seed: int) -> None:
    """Saves in a row with random changes between them, each part reused from the last
    (or planned afresh when refused, as ``Sharder.part`` does): every part is the fresh
    plan's, whatever the changes before it left behind."""
    gen = torch.Generator().manual_seed(seed)
    state = _base()
    names = sorted(CHANGES) + ["none"] * 6
    flat = flatten(state)
    last = _Last.of(flat, _fresh(flat, 1))
    reused = 0
    for seq in range(2, 80):
        name = names[int(torch.randint(len(names), (1,), generator=gen))]
        if name in ("resize", "half", "tie", "new_key"):
            state = _base()  # another structure: start again, as a replan would
        elif name != "none":
            CHANGES[name](state)
        state["rng"] = torch.get_rng_state() if seq % 3 else state["rng"]
        flat = flatten(state)
        fresh = _fresh(flat, seq)
        again = last.reuse(flat, seq) if last is not None else None
        if again is not None:
            _same(again[1], fresh)
            last = again[0]
            reused += 1
        else:
            last = _Last.of(flat, fresh)
    assert reused > 20  # the chain did exercise reuse
