"""What the first sharded save's plan costs one rank, for simulated worlds of up to
16,384 ranks, in one process with no process group.

When every rank's state has the same global description (FSDP2, TP, HSDP, DDP), each
rank computes the save plan alone at the first save (docs/distributed.md). This times,
per mesh and world size, on a transformer-shaped state (24 layers of attention and MLP
weights, norms, and AdamW's exp_avg, exp_avg_sq and step counters: 576 tensors):

- **now**: what ``write/sharded.py`` does at the first save: ``planning.uniform``'s
  ``local_items`` (the rank's own boxes, checked against its live ones),
  ``plan_uniform`` (who writes each of its boxes and its node's) and ``uniform_copies``
  (its share of its node's copies for a node-local tier, 8 ranks a node), for rank 0
  and the last rank (the slower is reported);
- **before**: what it did until 2026-11-23: every rank's items (``describe_sharded``
  per DTensor and mesh coordinate) and ``global_plan.plan_save`` over all of them. Only
  up to ``--before-max`` ranks (it is O(ranks x tensors) in Python: minutes at 16,384);
  where both run, the two plans must give every box the same writer and every rank the
  same bytes (``same plan``), else the run fails.

Runs with one torch thread, as a rank under torchrun does (OMP_NUM_THREADS=1).

Meshes: FSDP2 (``Shard(0)`` over every rank), HSDP (``(ranks/8, 8)``: replicated across
nodes, sharded within), FSDP2 over TP (``(ranks/8, 8)``: column-parallel weights
``_StridedShard(0), Shard(0)``, row-parallel ``Shard(0), Shard(1)``, norms replicated
over TP), DDP (every tensor plain, held by every rank), and PP (4 pipeline stages, each
of ``ranks/4`` ranks holding a quarter of the layers under FSDP2 on its own ranks, and
its own ``step`` counters: the ranks' states differ, so "now" is one description per
stage, ``uniform.combine``, then the same three calls).

    python benchmarks/bench_plan.py                      # ~1-2 minutes on 2 cores
    python benchmarks/bench_plan.py --worlds 1024,16384 --json out.json --markdown out.md
    python benchmarks/bench_plan.py --smoke              # tiny worlds: does it run?

Prints figures only: nothing here passes or fails, except a plan that differs.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_model, fmt_s, write_figures

from snapcore.planning.global_plan import plan_copies, plan_save
from snapcore.planning.uniform import (
    GlobalTensor,
    combine,
    items_of,
    local_items,
    plan_uniform,
    uniform_copies,
)

MESHES = ("fsdp2", "hsdp", "fsdp2+tp", "ddp", "pp")
TP = 8
PP = 4  # pipeline stages
NODE = 8  # ranks per node: a node-local tier's home


Groups = list[tuple[list[int], list[GlobalTensor]]]


def state(mesh_kind: str, world: int, layers: int, d: int) -> Groups:
    """A transformer's parameters and AdamW state as global tensors on ``mesh_kind``,
    per group of ranks holding the same ones: one group, but for PP one per stage."""
    if mesh_kind != "pp":
        return [(list(range(world)), _layers(mesh_kind, world, range(layers), d, None))]
    per = world // PP
    return [
        (
            list(range(s * per, (s + 1) * per)),
            _layers(
                "fsdp2",
                per,
                range(s * layers // PP, (s + 1) * layers // PP),
                d,
                torch.arange(s * per, (s + 1) * per),
            ),
        )
        for s in range(PP)
    ]


def _layers(
    mesh_kind: str, world: int, which: range, d: int, ranks: torch.Tensor | None
) -> list[GlobalTensor]:
    if mesh_kind == "ddp":
        mesh = None
    elif mesh_kind == "fsdp2":
        mesh = torch.arange(world) if ranks is None else ranks
    else:
        mesh = torch.arange(world).reshape(world // TP, TP)
    shapes = {
        "attn_norm": (d,),
        "qkv": (3 * d, d),
        "o": (d, d),
        "mlp_norm": (d,),
        "up": (4 * d, d),
        "down": (d, 4 * d),
    }

    def placements(name: str) -> tuple[Any, ...]:
        if mesh_kind == "fsdp2":
            return (Shard(0),)
        if mesh_kind == "hsdp":
            return (Replicate(), Shard(0))
        if name in ("qkv", "up"):  # column parallel, FSDP2 over the rows TP split
            return (_StridedShard(0, split_factor=TP), Shard(0))
        if name in ("o", "down"):  # row parallel
            return (Shard(0), Shard(1))
        return (Shard(0), Replicate())  # norms: replicated over TP

    out: list[GlobalTensor] = []
    for i in which:
        for name, shape in shapes.items():
            for kind in ("", "exp_avg.", "exp_avg_sq."):
                path = f"layers.{i}.{kind}{name}"
                if mesh is None:
                    out.append(GlobalTensor(path, "float32", shape))
                else:
                    out.append(GlobalTensor(path, "float32", shape, mesh, placements(name)))
            out.append(GlobalTensor(f"layers.{i}.step.{name}", "float32", ()))
    return out


def home(rank: int, world: int) -> set[int]:
    """The ranks of ``rank``'s node (8 a node), whose node-local tier it shares."""
    first = rank // NODE * NODE
    return set(range(first, min(first + NODE, world)))


def flat(groups: Groups) -> list[GlobalTensor]:
    """The description the plan is made from: one group's, or the groups' combined."""
    return groups[0][1] if len(groups) == 1 else combine(groups)


def own(groups: Groups, rank: int) -> list[GlobalTensor]:
    return next(tensors for ranks, tensors in groups if rank in ranks)


def now(groups: Groups, world: int, rank: int) -> tuple[float, Any]:
    t0 = time.perf_counter()
    tensors = flat(groups)
    items = local_items(own(groups, rank), rank)
    node = home(rank, world)
    plan = plan_uniform(tensors, world, "digest", ranks=node | {rank})
    writes = [plan.writer(item) == rank for item in items]
    copies = uniform_copies(tensors, plan, node, rank)
    return time.perf_counter() - t0, (items, plan, writes, copies)


def before(groups: Groups, world: int) -> tuple[float, Any]:
    t0 = time.perf_counter()
    per_rank = items_of(groups, world)  # every rank's items, as before
    plan = plan_save(per_rank, world)
    plan_copies(plan, [r // NODE for r in range(world)], only=0)
    return time.perf_counter() - t0, (per_rank, plan)


def same_plan(groups: Groups, world: int, old: Any) -> bool:
    per_rank, plan = old
    tensors = flat(groups)
    new = plan_uniform(tensors, world, "digest")
    if new.rank_bytes != plan.rank_bytes:
        return False
    homes = [r // NODE for r in range(world)]
    for r in range(world):
        if local_items(own(groups, r), r) != per_rank[r]:
            return False
        want = frozenset((w.path, w.box) for w in plan_copies(plan, homes, only=r)[r])
        if uniform_copies(tensors, new, home(r, world), r) != want:
            return False
        for item in per_rank[r]:
            want = None if item.box.empty else plan.writers[(item.path, item.box)]
            if new.writer(item) != want:
                return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="64,256,1024,16384", help="ranks, comma-separated")
    ap.add_argument("--meshes", default=",".join(MESHES))
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--before-max", type=int, default=64, help="largest world for 'before'")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--markdown", type=Path)
    ap.add_argument("--smoke", action="store_true", help="worlds 8 and 16, 2 layers")
    args = ap.parse_args()
    # A rank of a job: torchrun sets OMP_NUM_THREADS=1 for each (and on a busy machine
    # tensor operations on two threads wait for each other: 3 ms an index here, not 50 us)
    torch.set_num_threads(1)
    if args.smoke:
        args.worlds, args.layers, args.width, args.before_max = "8,16", 2, 64, 16
    worlds = [int(w) for w in args.worlds.split(",")]
    rows: list[dict[str, Any]] = []
    for mesh_kind in args.meshes.split(","):
        for world in worlds:
            groups = state(mesh_kind, world, args.layers, args.width)
            count = sum(len(t) for _, t in groups)
            best = None
            for _ in range(2):  # the second run: the first pays imports and caches
                t = max(now(groups, world, r)[0] for r in (0, world - 1))
                best = t if best is None else min(best, t)
            row: dict[str, Any] = {
                "mesh": mesh_kind,
                "world": world,
                "tensors": count,
                "now_s": best,
                "before_s": None,
                "same_plan": None,
            }
            if world <= args.before_max:
                row["before_s"], old = before(groups, world)
                row["same_plan"] = same_plan(groups, world, old)
            rows.append(row)
            print(
                f"{mesh_kind:9} {world:6} ranks {count} tensors: now {fmt_s(row['now_s'])} s"
                + (
                    f", before {fmt_s(row['before_s'])} s, same plan {row['same_plan']}"
                    if row["before_s"] is not None
                    else ""
                ),
                flush=True,
            )
    doc = {
        "machine": {
            "cpu": cpu_model(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "date": date.today().isoformat(),
        "args": vars(args) | {"json": str(args.json), "markdown": str(args.markdown)},
        "rows": rows,
    }
    lines = [
        "| mesh | ranks | tensors | now: one rank's plan, s | before: every rank's boxes "
        "+ plan_save, s | same plan |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        same = "—" if r["same_plan"] is None else str(r["same_plan"])
        lines.append(
            f"| {r['mesh']} | {r['world']} | {r['tensors']} | {fmt_s(r['now_s'])} | "
            f"{fmt_s(r['before_s'])} | {same} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    write_figures(args.json, doc, args.markdown, text)
    if any(r["same_plan"] is False for r in rows):
        sys.exit("the plan differs from plan_save's")


if __name__ == "__main__":
    main()
