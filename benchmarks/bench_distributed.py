"""Sharded saves on 4 ranks: snapcore against torch.distributed.checkpoint (issue 10).

Every peer saves the same FSDP2 state: a stack of ``nn.Linear`` layers under
``fully_shard`` (per layer and at the root) on a CPU device mesh of 4 ranks (torchrun on
127.0.0.1, gloo), and AdamW's state after one step, as ``{"app": AppState(model,
optim)}`` (``torch.distributed.checkpoint.state_dict.get_state_dict``: DTensor shards,
FQN keys). Peers, one save each per round, the order rotated from round to round:

- ``snapcore.async_save`` to ``Store(local=...)``, then ``handle.wait()``;
- ``snapcore.async_save(..., overlap=True)`` to a store of its own, then at once an
  AdamW step (gradients from a forward/backward made before the call), which waits in its
  pre-hook for the deferred copies, then ``handle.wait()``. After each such save the
  state is restored from it and checked, bit for bit, against a copy taken before the
  call (the step must have changed the state): the restore also puts the state back as
  it was, for the peers after it;
- ``dcp.async_save`` with DCP's default staging (``StagingOptions(False, False, False,
  False)``, what ``dcp.async_save`` makes when given no stager: the copy is made in the
  call), one reused ``DefaultStager``, ``AsyncCheckpointerType.THREAD``: the counterpart
  of snapcore's default mode;
- ``dcp.async_save`` with one reused ``DefaultStager`` each staging on a thread (async
  staging, no pinned memory: CPU only), ``AsyncCheckpointerType.THREAD`` and ``PROCESS``
  (shared memory): the counterparts of overlap=True;
- ``dcp.save``.

Per save and rank: the time the call blocked the training thread, the time until the
state may change again (staged; in overlap mode when the deferred copies are done), and
the time until durable (each rank from its own
call; the job's figure is the slowest rank's); bytes written are the sizes of the files
the save added to its checkpoint directory. A first round (it allocates staging memory)
comes before the timed ones, and every element of the state changes between rounds.

Then restores, each after dropping the checkpoints' pages from the page cache:
``snapcore.restore`` and ``dcp.load`` into the same 4-rank state, and into an FSDP2 state
on 2 ranks (4 -> 2 resharding), with the bytes each rank read (snapcore's
``RestoreInfo.bytes``) against the bytes of its own shards. Each restore is checked
against per-tensor sums of the saved state. Last, snapcore in ONE process (no process
group) saves a plain state of the same tensors, whole, for the N-ranks-vs-1 ratio; it
runs before and after the ranks.

    python benchmarks/bench_distributed.py                   # ~1.5 GB state, ~5 minutes
    python benchmarks/bench_distributed.py --size-gb 0.3     # a small run
    python benchmarks/bench_distributed.py --smoke           # ~4 MB, does it run?
    python benchmarks/bench_distributed.py --json out.json --markdown out.md --dir /mnt/x

The test suite runs only its --smoke run (tests/integration/test_benchmarks.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import common

GB = 1e9
PEERS = ("snapcore", "snapcore_overlap", "dcp_sync", "dcp_thread", "dcp_process", "dcp_save")
PEER_NAMES = {
    "snapcore": "snapcore.async_save",
    "snapcore_overlap": "snapcore.async_save, overlap=True",
    "dcp_sync": "dcp.async_save, default staging (in the call), thread",
    "dcp_thread": "dcp.async_save, thread",
    "dcp_process": "dcp.async_save, process",
    "dcp_save": "dcp.save",
}
# DCP's async_save modes that stage on a thread and return before the copy is done (the
# counterparts of overlap=True), and the one that copies before returning, as snapcore's
# default mode does (DCP's own default: async_save with no stager).
DCP_ASYNC_STAGING = ("dcp_thread", "dcp_process")
DCP_ASYNC = ("dcp_sync", *DCP_ASYNC_STAGING)
ENV_RUN = "SNAPCORE_BENCH_RUN"  # marks every process of one torchrun, to kill leftovers

Result = dict[str, Any]


# -- the state --------------------------------------------------------------------------------
def shape_of(size_gb: float) -> tuple[int, int]:
    """(width, layers) of the Linear stack: state bytes ~ 3 x parameters."""
    param_bytes = size_gb * GB / 3
    width = 2048 if param_bytes >= 8 * 2048 * 2048 * 4 else 256
    layers = max(2, round(param_bytes / ((width * width + width) * 4)))
    return width, layers


def build_model(width: int, layers: int, fsdp: bool) -> tuple[Any, Any]:
    """The Linear stack (FSDP2 over every rank of the job where ``fsdp``) and AdamW after
    one real step. Built on the meta device and materialised shard by shard: each rank
    holds only its shards. Values differ per rank and element (snapcore stores identical
    chunks once, so a constant state would flatter it)."""
    import torch
    from torch import nn

    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    if fsdp:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        seed = dist.get_rank()
    else:
        seed = 0
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.uniform_(-0.02, 0.02, generator=gen)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(4, width, generator=gen)
    model(x).pow(2).mean().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return model, optim


def local_tensors(model: Any, optim: Any) -> tuple[list[Any], list[Any]]:
    """(floating-point local tensors: parameters, exp_avg, exp_avg_sq; step counters)."""
    import torch

    floats, steps = [], []
    for p in model.parameters():
        floats.append(_local(p))
        for k, v in optim.state[p].items():
            if isinstance(v, torch.Tensor):
                (steps if k == "step" else floats).append(_local(v))
    return floats, steps


def all_local(model: Any, optim: Any) -> list[Any]:
    floats, steps = local_tensors(model, optim)
    return floats + steps


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


def perturb(model: Any, optim: Any) -> None:
    """Change every element, as a training step does (a product keeps distinct values
    distinct), and count the steps on."""
    import torch

    floats, steps = local_tensors(model, optim)
    with torch.no_grad():
        torch._foreach_mul_(floats, 1.0 + 2.0**-10)
        torch._foreach_add_(steps, 1.0)


def walk(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    import torch

    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from walk(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(tree, list | tuple):
        for i, v in enumerate(tree):
            yield from walk(v, f"{prefix}.{i}" if prefix else str(i))


def state_sizes(state: dict[str, Any]) -> tuple[int, int, int]:
    """(unique bytes of the job's state: every global tensor once; bytes of this rank's
    own shards and of the replicated tensors: what a restore into this rank needs;
    tensors)."""
    unique = needed = n = 0
    for _, t in walk(state["app"].state_dict()):
        local = _local(t)
        unique += t.numel() * t.element_size()
        needed += local.numel() * local.element_size()
        n += 1
    return unique, needed, n


def checksums(state: dict[str, Any]) -> dict[str, float]:
    """Per tensor of the state, the float64 sum of its global value (one all_reduce):
    equal across shardings up to rounding, so a restore can be checked against a save
    made with another world size."""
    import torch
    import torch.distributed as dist

    names, sums = [], []
    for path, t in walk(state["app"].state_dict()):
        names.append(path)
        sharded = hasattr(t, "to_local")
        own = sharded or dist.get_rank() == 0  # a replicated tensor counts once
        sums.append(float(_local(t).double().sum()) if own else 0.0)
    vec = torch.tensor(sums, dtype=torch.float64)
    dist.all_reduce(vec)
    return dict(zip(names, vec.tolist(), strict=True))


def same_sums(a: dict[str, float], b: dict[str, float]) -> bool:
    return a.keys() == b.keys() and all(
        math.isclose(a[k], b[k], rel_tol=1e-9, abs_tol=1e-9) for k in a
    )


# -- helpers on the ranks ---------------------------------------------------------------------
def dir_bytes(root: Path) -> dict[str, int]:
    """Every file under ``root`` with its size, but the spare data files (``SPARE_DIR``):
    files retention freed, moved there by a rename, not written (docs/format.md)."""
    from snapcore.directory import SPARE_DIR

    out = {}
    for p in root.rglob("*"):
        if p.relative_to(root).parts[0] == SPARE_DIR:
            continue
        with contextlib.suppress(FileNotFoundError):
            if p.is_file():
                out[str(p)] = p.stat().st_size
    return out


def files_under(*roots: Path) -> list[str]:
    return [f for r in roots if r.exists() for f in dir_bytes(r)]


def quiet_start(rank: int) -> None:
    """Rank 0 waits for a quiet machine (the others wait in the barrier), then all start."""
    import torch.distributed as dist

    if rank == 0:
        common.settle()
    dist.barrier()


def gather(values: dict[str, float]) -> dict[str, list[float]]:
    """Each key's value on every rank, in rank order (one all_gather)."""
    import torch
    import torch.distributed as dist

    keys = sorted(values)
    mine = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return {k: [float(e[i]) for e in every] for i, k in enumerate(keys)}


# -- role: the 4-rank job ---------------------------------------------------------------------
def role_ranks(args: argparse.Namespace, work: Path) -> Result:
    """The saves of every peer, round after round, then the restores into the same ranks."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    import snapcore
    from snapcore.distributed import AppState

    warnings.filterwarnings("ignore", module="torch.distributed")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t0 = time.perf_counter()
    model, optim = build_model(args.width, args.layers, fsdp=True)
    state = {"app": AppState(model, optim)}
    unique, needed, ntensors = state_sizes(state)
    out: Result = {
        "rank": rank,
        "world": world,
        "unique_bytes": unique,
        "needed_bytes": needed,
        "tensors": ntensors,
        "build_s": time.perf_counter() - t0,
        "snapcore_threads": os.environ.get("SNAPCORE_THREADS"),
    }
    store_dir = work / "snapcore-4"
    store = snapcore.Store(local=store_dir, retention={"local": 2})
    overlap_dir = work / "snapcore-4-overlap"
    overlap_store = snapcore.Store(local=overlap_dir, retention={"local": 2})
    batches = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    dcp_root = work / "dcp-4"
    stagers = {
        # dcp.async_save's own default (no stager given) is this one, made at each call and
        # closed once that save is done; reused here, as DCP allows for a stager passed in
        "dcp_sync": DefaultStager(StagingOptions(False, False, False, False)),
        "dcp_thread": DefaultStager(StagingOptions(False, False, True, False)),
        "dcp_process": DefaultStager(StagingOptions(False, True, True, False)),
    }
    kinds = {
        "dcp_sync": AsyncCheckpointerType.THREAD,
        "dcp_thread": AsyncCheckpointerType.THREAD,
        "dcp_process": AsyncCheckpointerType.PROCESS,
    }
    kept: dict[str, Path] = {}

    def before_after(root: Path, fn: Callable[[], Result]) -> Result:
        """Run ``fn`` on every rank from a quiet start; rank 0 measures what the save
        added under ``root`` once every rank is done."""
        files0 = dir_bytes(root) if rank == 0 and root.exists() else {}
        quiet_start(rank)
        res = fn()
        dist.barrier()
        if rank == 0:
            files1 = dir_bytes(root)
            res["bytes_written"] = sum(
                n for f, n in files1.items() if files0.get(f) != n or f not in files0
            )
        return res

    def save_snapcore(step: int) -> Result:
        snapcore.wait_all(store)  # the previous save's retention, as minutes of training would

        def go() -> Result:
            t = time.perf_counter()
            h = snapcore.async_save(state, store, step=step)
            blocked = time.perf_counter() - t
            stats = h.wait()
            durable = time.perf_counter() - t
            return {
                "blocked_s": blocked,
                "staged_s": stats.staged_s,
                "durable_s": durable,
                "rank_written": stats.written.get("local", 0),
            }

        return before_after(store_dir, go)

    def save_overlap(step: int) -> Result:
        """overlap=True, and the optimizer step that training would make right after the
        call; then the snapshot is restored and checked against the state at the call."""
        snapcore.wait_all(overlap_store)
        model(torch.randn(4, args.width, generator=batches)).pow(2).mean().backward()
        at_call = [t.clone() for t in all_local(model, optim)]
        sums = checksums(state)

        def go() -> Result:
            t = time.perf_counter()
            h = snapcore.async_save(state, overlap_store, step=step, overlap=True)
            blocked = time.perf_counter() - t
            optim.step()  # its pre-hook waits for the copies of what it writes
            stepped = time.perf_counter() - t
            stats = h.wait()
            return {
                "blocked_s": blocked,
                "staged_s": stats.staged_s,  # the deferred copies are done
                "step_returned_s": stepped,
                "durable_s": stats.durable_s,  # from the call, whenever wait() was called
                "deferred": h.deferred,
                "rank_written": stats.written.get("local", 0),
            }

        res = before_after(overlap_dir, go)
        optim.zero_grad(set_to_none=True)
        now = all_local(model, optim)
        changed = any(not torch.equal(a, b) for a, b in zip(at_call, now, strict=True))
        snapcore.restore(state, overlap_store, step=step)
        now = all_local(model, optim)
        exact = len(now) == len(at_call) and all(
            torch.equal(a, b) for a, b in zip(at_call, now, strict=False)
        )
        exact = exact and same_sums(checksums(state), sums)
        every = gather({"changed": float(changed), "exact": float(exact)})
        res["step_changed_state"] = all(every["changed"])
        res["restore_exact"] = all(every["exact"])
        res["deferred"] = all(gather({"d": float(res["deferred"])})["d"])
        return res

    def save_dcp(peer: str, step: int) -> Result:
        path = dcp_root / f"{peer}-{step}"

        def go() -> Result:
            writer = dcp.FileSystemWriter(str(path), thread_count=1)
            t = time.perf_counter()
            if peer == "dcp_save":
                dcp.save(state, storage_writer=writer)
                blocked = staged = durable = time.perf_counter() - t
            else:
                resp = dcp.async_save(
                    state,
                    storage_writer=writer,
                    async_stager=stagers[peer],
                    async_checkpointer_type=kinds[peer],
                )
                blocked = time.perf_counter() - t
                if isinstance(resp, Future):  # staged in the call: the upload's future
                    staged = blocked
                    resp.result()
                else:
                    resp.staging_completion.result()
                    staged = time.perf_counter() - t
                    resp.upload_completion.result()
                durable = time.perf_counter() - t
            return {"blocked_s": blocked, "staged_s": staged, "durable_s": durable}

        res = before_after(path, go)
        kept[peer] = path
        return res

    runs: dict[str, list[Result]] = {p: [] for p in PEERS}
    errors: dict[str, str] = {}
    for rnd in range(1 + args.rounds):
        step = rnd + 1
        if rnd:
            perturb(model, optim)  # round 0 saves the state as built
        order = PEERS[rnd % len(PEERS) :] + PEERS[: rnd % len(PEERS)]
        for peer in order:
            if peer in errors:
                continue
            try:
                if peer == "snapcore":
                    res = save_snapcore(step)
                elif peer == "snapcore_overlap":
                    res = save_overlap(step)
                else:
                    res = save_dcp(peer, step)
            except Exception as e:  # DCP's process mode may not run here: say why
                if peer.startswith("snapcore"):
                    raise
                errors[peer] = f"{type(e).__name__}: {e}"
                continue
            res.update({"round": rnd, "first": rnd == 0})
            res["per_rank"] = gather(
                {k: v for k, v in res.items() if k.endswith("_s") or k == "rank_written"}
            )
            runs[peer].append(res)
            if not peer.startswith("snapcore") and rnd < args.rounds:  # keep only the last round's
                dist.barrier()
                if rank == 0:
                    common.drop_page_cache(files_under(kept[peer]))
                    shutil.rmtree(kept[peer], ignore_errors=True)
    for stager in stagers.values():
        stager.close()
    out["runs"] = runs
    out["errors"] = errors
    saved = checksums(state)
    out["saved_checksums"] = saved
    snapcore.wait_all(store)
    snapcore.wait_all(overlap_store)
    out["kept"] = {"snapcore": str(store_dir), **{k: str(v) for k, v in kept.items()}}

    # Restores into the same ranks: the state is changed first, the pages dropped.
    dcp_dir = kept.get("dcp_save") or kept.get("dcp_thread")
    out["restore"] = restores(args, rank, state, model, optim, store_dir, dcp_dir, saved)
    snapcore.close()
    return out


def restores(
    args: argparse.Namespace,
    rank: int,
    state: dict[str, Any],
    model: Any,
    optim: Any,
    store_dir: Path,
    dcp_dir: Path | None,
    saved: dict[str, float],
) -> Result:
    """snapcore.restore and dcp.load into ``state``, alternating, each from a cold page
    cache and into a state changed since the save; checked against the saved sums."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import snapcore

    out: Result = {"snapcore": [], "dcp": []}
    roots = [store_dir] + ([dcp_dir] if dcp_dir else [])
    for i in range(args.restore_rounds):
        order = ["snapcore", "dcp"] if i % 2 == 0 else ["dcp", "snapcore"]
        for who in order:
            if who == "dcp" and dcp_dir is None:
                continue
            perturb(model, optim)
            dist.barrier()
            if rank == 0:
                common.drop_page_cache(files_under(*roots))
            quiet_start(rank)
            t = time.perf_counter()
            nbytes = 0
            if who == "snapcore":
                info = snapcore.restore(state, snapcore.Store(local=store_dir))
                nbytes = info.bytes
            else:
                dcp.load(state, checkpoint_id=str(dcp_dir))
            seconds = time.perf_counter() - t
            ok = same_sums(checksums(state), saved)
            per = gather({"seconds": seconds, "bytes_read": float(nbytes)})
            out[who].append({"seconds": max(per["seconds"]), "per_rank": per, "matches": ok})
    return out


# -- role: the 4 -> 2 resharding restore -------------------------------------------------------
def role_reshard(args: argparse.Namespace, work: Path) -> Result:
    """An FSDP2 state on fewer ranks restores the 4-rank checkpoints of the ranks role."""
    import torch.distributed as dist

    from snapcore.distributed import AppState

    warnings.filterwarnings("ignore", module="torch.distributed")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, optim = build_model(args.width, args.layers, fsdp=True)
    state = {"app": AppState(model, optim)}
    unique, needed, _ = state_sizes(state)
    ranks = json.loads((work / "kept.json").read_text())  # the parent's, from the ranks role
    kept = ranks["kept"]
    dcp_dir = kept.get("dcp_save") or kept.get("dcp_thread")
    out = restores(
        args,
        rank,
        state,
        model,
        optim,
        Path(kept["snapcore"]),
        Path(dcp_dir) if dcp_dir else None,
        ranks["saved_checksums"],
    )
    import snapcore

    snapcore.close()
    return {
        "rank": rank,
        "world": dist.get_world_size(),
        "unique_bytes": unique,
        "needed_bytes": needed,
        "needed_per_rank": gather({"needed": float(needed)})["needed"],
        "restore": out,
    }


# -- role: one process, the same bytes ---------------------------------------------------------
def role_single(args: argparse.Namespace, work: Path) -> Result:
    """snapcore.async_save of the same tensors, unsharded, in one process."""
    import snapcore

    model, optim = build_model(args.width, args.layers, fsdp=False)
    state = {"model": model, "optim": optim}
    floats, steps = local_tensors(model, optim)
    nbytes = sum(t.numel() * t.element_size() for t in floats + steps)
    store_dir = work / f"snapcore-1-{uuid.uuid4().hex[:6]}"
    store = snapcore.Store(local=store_dir, retention={"local": 2})
    runs = []
    for rnd in range(1 + args.rounds):
        if rnd:
            perturb(model, optim)
        snapcore.wait_all(store)
        common.settle()
        t = time.perf_counter()
        h = snapcore.async_save(state, store, step=rnd + 1)
        blocked = time.perf_counter() - t
        stats = h.wait()
        durable = time.perf_counter() - t
        runs.append(
            {
                "round": rnd,
                "first": rnd == 0,
                "blocked_s": blocked,
                "staged_s": stats.staged_s,
                "durable_s": durable,
                "bytes_written": stats.written.get("local", 0),
            }
        )
    snapcore.close()
    common.drop_page_cache(files_under(store_dir))
    shutil.rmtree(store_dir, ignore_errors=True)
    return {
        "state_bytes": nbytes,
        "runs": runs,
        "snapcore_threads": os.environ.get("SNAPCORE_THREADS"),
    }


ROLES: dict[str, Callable[[argparse.Namespace, Path], Result]] = {
    "ranks": role_ranks,
    "reshard": role_reshard,
    "single": role_single,
}


# -- the parent: runs the roles, checks the targets, writes the report -------------------------
def child_args(args: argparse.Namespace, role: str, work: Path) -> list[str]:
    return [
        os.path.abspath(__file__),
        "--role",
        role,
        "--dir",
        str(work),
        "--width",
        str(args.width),
        "--layers",
        str(args.layers),
        "--rounds",
        str(args.rounds),
        "--restore-rounds",
        str(args.restore_rounds),
        "--quiet-cores",
        str(args.quiet_cores),
        "--quiet-wait",
        str(args.quiet_wait),
    ]


def _children_cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_role(args: argparse.Namespace, role: str, work: Path, nproc: int, tag: str) -> Result:
    """Run a role: under torchrun with ``nproc`` ranks (0: one plain process). Returns
    rank 0's result (with every rank's in ``ranks``), or an error with the log's tail."""
    run_id = uuid.uuid4().hex
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONUNBUFFERED": "1",
        ENV_RUN: run_id,
        "SNAPCORE_BENCH_TAG": tag,
    }
    if nproc:
        env["SNAPCORE_THREADS"] = str(args.rank_threads)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nproc}",
            "--nnodes=1",
            "--master-addr=127.0.0.1",
            f"--master-port={common.free_port()}",
            "--rdzv-backend=static",
            "--max-restarts=0",
            *child_args(args, role, work),
        ]
    else:
        env.pop("SNAPCORE_THREADS", None)
        if args.single_threads:
            env["SNAPCORE_THREADS"] = str(args.single_threads)
        cmd = [sys.executable, *child_args(args, role, work)]
    log_file = work / f"{tag}.log"
    print(f"[{tag}] running ...", flush=True)
    t0 = time.perf_counter()
    busy0, children0 = common.jiffies()[0], _children_cpu()
    with open(log_file, "wb") as log:
        proc = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            rc = -1
        _kill_run(run_id, proc)
    wall = time.perf_counter() - t0
    busy = (common.jiffies()[0] - busy0) / common.CLK_TCK
    others = max(0.0, busy - (_children_cpu() - children0)) / wall
    files = [work / f"{tag}-rank{r}.json" for r in range(max(nproc, 1))]
    if rc != 0 or not all(f.exists() for f in files):
        tail = log_file.read_text(errors="replace")[-3000:]
        print(f"[{tag}] FAILED (rc={rc}) after {wall:.1f}s:\n{tail}", flush=True)
        return {"error": f"exited with {rc}", "log_tail": tail, "wall_s": wall}
    results = [json.loads(f.read_text()) for f in files]
    print(f"[{tag}] done in {wall:.1f}s", flush=True)
    return {**results[0], "ranks": results, "wall_s": wall, "others_cores": others}


def _kill_run(run_id: str, proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL whatever of this run is left (torchrun starts its workers in sessions of
    their own, and DCP's process mode starts daemons): the processes carrying its id."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    marker = f"{ENV_RUN}={run_id}".encode()
    for _ in range(100):
        left = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    if marker in (entry / "environ").read_bytes().split(b"\0"):
                        left.append(int(entry.name))
        if not left:
            return
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def job(run: Result, key: str) -> float:
    """The job's figure of one save: the slowest rank's."""
    return max(run["per_rank"][key])


def warm(runs: list[Result]) -> list[Result]:
    return [r for r in runs if not r["first"]] or runs


def best_dcp_async(
    r: Result, key: str, peers: tuple[str, ...] = DCP_ASYNC_STAGING
) -> tuple[float | None, str]:
    """The best warm figure of DCP's async modes among ``peers`` (by default those that
    stage on a thread), and the mode's name."""
    found = [
        (min(job(x, key) for x in warm(r["ranks4"]["runs"][p])), PEER_NAMES[p])
        for p in peers
        if r["ranks4"]["runs"].get(p)
    ]
    return min(found) if found else (None, "")


def check_targets(r: Result) -> list[Result]:
    """Issue 10's targets, as measured / limit (below 1 passes)."""
    targets: list[Result] = []

    def add(name: str, value: float | None, limit: float | None, unit: str, text: str) -> None:
        if value is None or not limit:
            targets.append({"target": name, "status": "n/a", "detail": text or "not measured"})
            return
        ratio = value / limit
        targets.append(
            {
                "target": name,
                "value": value,
                "limit": limit,
                "unit": unit,
                "ratio": ratio,
                "status": "PASS" if ratio <= 1 else "FAIL",
                "detail": text,
            }
        )

    rk = r.get("ranks4", {})
    if "error" in rk:
        return [{"target": "all", "status": "n/a", "detail": "the 4-rank job failed"}]
    sc = warm(rk["runs"]["snapcore"])
    unique = rk["unique_bytes"]
    written = max(x["bytes_written"] for x in sc)
    add(
        "bytes written <= 1.02 x unique bytes",
        written,
        1.02 * unique,
        "bytes",
        f"the largest warm snapcore save; the state's unique bytes (each global tensor once) "
        f"{unique / GB:.3f} GB",
    )
    stall = min(job(x, "blocked_s") for x in sc)
    sync_blocked, sync_mode = best_dcp_async(r, "blocked_s", ("dcp_sync",))
    add(
        "stall <= DCP's, default mode against DCP's default staging (time blocked in the call)",
        stall,
        sync_blocked,
        "s",
        f"best warm snapcore save (slowest rank) against DCP's best warm {sync_mode}: both "
        "copy the state before the call returns, and the state may change once it has",
    )
    dcp_blocked, mode = best_dcp_async(r, "blocked_s")
    add(
        "stall <= DCP's (time blocked in the call), default mode against DCP's async staging "
        "(information: not the matching mode)",
        stall,
        dcp_blocked,
        "s",
        f"best warm snapcore save (slowest rank) against DCP's best warm async_save ({mode}); "
        "DCP stages on a thread and returns before its copy is done, and the state must not "
        "change until it is: overlap=True's counterpart",
    )
    ov = warm(rk["runs"].get("snapcore_overlap") or [])
    if ov:
        add(
            "stall <= DCP's, overlap=True against DCP's async staging (time blocked in the call)",
            min(job(x, "blocked_s") for x in ov),
            dcp_blocked,
            "s",
            f"best warm snapcore save with overlap=True (slowest rank) against DCP's best warm "
            f"async_save ({mode}); the copies of what AdamW writes run after the call returns",
        )
    staged = min(job(x, "staged_s") for x in sc)
    dcp_staged, mode = best_dcp_async(r, "staged_s")
    add(
        "until the state may change <= DCP's",
        staged,
        dcp_staged,
        "s",
        f"snapcore: async_save's return (stats.staged_s); DCP ({mode}): until staging_completion "
        "resolves, before which the training must not change the state",
    )
    if ov:
        add(
            "until the state may change <= DCP's, overlap=True",
            min(job(x, "staged_s") for x in ov),
            dcp_staged,
            "s",
            f"snapcore with overlap=True: until the deferred copies are done (stats.staged_s; "
            f"the optimizer step right after the call waits for them); DCP ({mode}) as above",
        )
    durable = min(job(x, "durable_s") for x in sc)
    dcp_durable, mode = best_dcp_async(r, "durable_s", DCP_ASYNC)
    add(
        "time to durable <= 0.5 x DCP async",
        durable,
        dcp_durable / 2 if dcp_durable else None,
        "s",
        f"best warm snapcore save; DCP's best warm async_save: {mode}, "
        + (f"{dcp_durable:.3f} s" if dcp_durable else "none"),
    )
    rs = r.get("reshard2", {})
    reshard_name = (
        f"{rk['world']} -> {r['reshard_world']} restore reads <= 1.1 x the bytes each rank needs"
    )
    if "error" not in rs and rs.get("restore", {}).get("snapcore"):
        needed = rs["needed_per_rank"]
        read = [max(x["per_rank"]["bytes_read"][i] for x in rs["restore"]["snapcore"])
                for i in range(len(needed))]  # fmt: skip
        worst = max(range(len(needed)), key=lambda i: read[i] / needed[i])
        add(
            reshard_name,
            read[worst],
            1.1 * needed[worst],
            "bytes",
            "the rank with the largest read/needed (RestoreInfo.bytes against its own shards "
            "and the replicated tensors): "
            + ", ".join(
                f"rank {i} {read[i] / GB:.3f} / {needed[i] / GB:.3f} GB" for i in range(len(needed))
            ),
        )
    else:
        add(reshard_name, None, None, "", "")
    singles = [
        min(x["durable_s"] for x in warm(s["runs"]))
        for s in (r.get("single_before", {}), r.get("single_after", {}))
        if "runs" in s
    ]
    add(
        f"time to durable, {rk['world']} ranks <= 1.2 x one process",
        durable,
        1.2 * min(singles) if singles else None,
        "s",
        "best warm snapcore save of the ranks against the best warm save of one process "
        "(same tensors, unsharded, before and after the ranks): "
        + ", ".join(f"{x:.3f} s" for x in singles),
    )
    return targets


def _s(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}" if x < 10 else f"{x:.2f}"


def _gb(x: float | None) -> str:
    return "—" if x is None else f"{x / GB:.3f}"


def render(r: Result) -> str:
    info = r["info"]
    lines = [
        f"Command: `{r['command']}` ({r['total_s']:.0f} s in all)",
        "",
        f"Machine: {info['cores']} cores ({info['cpu'] or '?'}), "
        f"{info['ram_bytes'] / 2**30:.1f} GiB RAM, Linux {info['kernel']}, checkpoints on "
        f"{info['fs']} (`{info['dir']}`); Python "
        f"{info['python']}, torch {info['torch']}, snapcore at {info['commit']}; {info['date']}.",
        "",
    ]
    rk = r.get("ranks4", {})
    if "error" in rk:
        lines += [
            f"The {r['world']}-rank job failed: {rk['error']}",
            "",
            "```",
            rk["log_tail"],
            "```",
        ]
        return "\n".join(lines) + "\n"
    world = rk["world"]
    unique = rk["unique_bytes"]
    lines += [
        f"State: {unique / GB:.3f} GB in {rk['tensors']} tensors: {r['layers']} x "
        f"Linear({r['width']}, {r['width']}) under FSDP2 (`fully_shard` per layer and at the "
        f"root) on {world} ranks, and AdamW's exp_avg, exp_avg_sq and step after one step; "
        f"{', '.join(_gb(x['needed_bytes']) for x in rk['ranks'])} GB per rank. "
        f"Ranks: torchrun, gloo on 127.0.0.1, `OMP_NUM_THREADS=1`, "
        f"`SNAPCORE_THREADS={rk['snapcore_threads']}`; the single process: "
        f"`SNAPCORE_THREADS={r.get('single_threads') or 'unset (one per core)'}`.",
        "",
        "Other processes' CPU during each part (average cores): "
        + ", ".join(
            f"{k} {r[k]['others_cores']:.2f}"
            for k in ("single_before", "ranks4", "reshard2", "single_after")
            if "others_cores" in r.get(k, {})
        )
        + ".",
        "",
        "Times are the job's (the slowest rank's) per save: the median of the warm runs, the "
        "best in parentheses. Bytes written: what the save added to its checkpoint directory.",
        "",
        "| save | blocked s | staged s | durable s | GB/s to durable "
        "| bytes written GB (x unique) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]

    def cell(runs: list[Result], key: str, single: bool = False) -> str:
        xs = [x[key] if single else job(x, key) for x in runs]
        return _s(xs[0]) if len(xs) == 1 else f"{_s(_median(xs))} ({_s(min(xs))})"

    def row(name: str, runs: list[Result], nbytes: int, single: bool = False) -> None:
        durable = min(x["durable_s"] if single else job(x, "durable_s") for x in runs)
        written = max(x.get("bytes_written", 0) for x in runs)
        lines.append(
            f"| {name} | {cell(runs, 'blocked_s', single)} | {cell(runs, 'staged_s', single)} | "
            f"{cell(runs, 'durable_s', single)} | {nbytes / durable / GB:.2f} | "
            f"{_gb(written)} ({written / nbytes:.3f}) |"
        )

    for peer in PEERS:
        runs = rk["runs"].get(peer) or []
        if not runs:
            lines.append(f"| {PEER_NAMES[peer]} | — | — | — | — | {rk['errors'].get(peer, '')} |")
            continue
        row(f"{PEER_NAMES[peer]}, first", runs[:1], unique)
        row(f"{PEER_NAMES[peer]}, warm ({len(warm(runs))} runs)", warm(runs), unique)
    for key, when in (("single_before", "before"), ("single_after", "after")):
        s = r.get(key, {})
        if "runs" in s:
            row(f"snapcore.async_save, 1 process, warm ({when} the ranks)", warm(s["runs"]),
                s["state_bytes"], single=True)  # fmt: skip
    sc = warm(rk["runs"]["snapcore"])
    lines += [
        "",
        "Per rank, snapcore's warm saves (s, rank 0 first): durable "
        + "; ".join(", ".join(_s(v) for v in x["per_rank"]["durable_s"]) for x in sc)
        + "; bytes each rank wrote (GB): "
        + ", ".join(_gb(v) for v in sc[-1]["per_rank"]["rank_written"])
        + ".",
        "",
    ]
    disk = [x for x in r.get("disk_Bps") or [] if x]
    for why in r.get("disk_probe_errors") or []:
        lines += [f"The disk probe could not run: {why} (information only).", ""]
    if disk:
        best = min(job(x, "durable_s") for x in sc)
        lines += [
            f"The disk, before / after: O_DIRECT writes of {int(r['size_gb'] * GB) / GB:.3f} GB "
            f"from one pre-faulted buffer, fdatasync included: "
            f"{' / '.join(f'{x / GB:.2f}' for x in disk)} GB/s; snapcore's best warm save "
            f"reached durable at {unique / best / GB:.2f} GB/s from the call's start, "
            f"{unique / best / max(disk):.2f} x the faster probe (information, not a target).",
            "",
        ]
    ov = rk["runs"].get("snapcore_overlap") or []
    if ov:
        lines += [
            "overlap=True, every save (first included): the AdamW step made right after the "
            "call returned at (s, job) "
            + ", ".join(_s(job(x, "step_returned_s")) for x in ov)
            + "; copies deferred: "
            + str(all(x["deferred"] for x in ov))
            + "; the step changed the state: "
            + str(all(x["step_changed_state"] for x in ov))
            + "; restored state equal, bit for bit, to the state at the call: "
            + str(all(x["restore_exact"] for x in ov))
            + ".",
            "",
        ]
    lines += [
        "| restore (page cache dropped first) | ranks | seconds | GB/s | bytes read per rank GB | "
        "needed per rank GB | state matches |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    rs = r.get("reshard2", {})
    needed4 = [x["needed_bytes"] for x in rk["ranks"]]
    groups = [(world, rk["restore"], needed4)]
    if "restore" in rs:
        groups.append((rs["world"], rs["restore"], rs["needed_per_rank"]))
    for n, res, needed in groups:
        for who, name in (("snapcore", "snapcore.restore"), ("dcp", "dcp.load")):
            runs = res.get(who) or []
            if not runs:
                continue
            secs = [x["seconds"] for x in runs]
            t = f"{_s(_median(secs))} ({_s(min(secs))})" if len(secs) > 1 else _s(secs[0])
            read = (
                ", ".join(_gb(max(x["per_rank"]["bytes_read"][i] for x in runs)) for i in range(n))
                if who == "snapcore"
                else "—"
            )
            label = f"{name} ({world} -> {n})" if n != world else f"{name} (same {n} ranks)"
            lines.append(
                f"| {label} | {n} | {t} | {unique / min(secs) / GB:.2f} | {read} | "
                f"{', '.join(_gb(x) for x in needed)} | {all(x['matches'] for x in runs)} |"
            )
    if "error" in rs:
        lines += ["", f"The {r['reshard_world']}-rank restore failed: {rs['error']}"]
    lines += [
        "",
        "| target | measured | limit | ratio | result |",
        "| --- | --- | --- | --- | --- |",
    ]
    for t in r["targets"]:
        if "ratio" not in t:
            lines.append(f"| {t['target']} | — | — | — | {t['status']} |")
            continue
        fmt = _gb if t["unit"] == "bytes" else _s
        unit = "GB" if t["unit"] == "bytes" else "s"
        lines.append(
            f"| {t['target']} | {fmt(t['value'])} {unit} | {fmt(t['limit'])} {unit} | "
            f"{t['ratio']:.2f} | {t['status']} |"
        )
    lines.append("")
    lines += [f"- {t['target']}: {t['detail']}" for t in r["targets"]]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size-gb", type=float, default=1.5, help="whole state, all ranks (1.5)")
    p.add_argument("--world", type=int, default=4, help="ranks of the saving job (4)")
    p.add_argument("--reshard-world", type=int, default=2, help="ranks of the resharding restore")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds after the first (5)")
    p.add_argument("--restore-rounds", type=int, default=2, help="restores of each kind (2)")
    p.add_argument("--rank-threads", type=int, default=1, help="SNAPCORE_THREADS of each rank (1)")
    p.add_argument(
        "--single-threads",
        type=int,
        default=0,
        help="SNAPCORE_THREADS of the single process (0: unset, one per core)",
    )
    p.add_argument("--dir", default=None, help="where to write (a fresh subdirectory)")
    p.add_argument("--json", default=None, help="write the raw figures here")
    p.add_argument("--markdown", default=None, help="write the report (markdown) here")
    p.add_argument(
        "--timeout", type=float, default=900, help="seconds per part before it is killed"
    )
    p.add_argument("--quiet-cores", type=float, default=0.25)
    p.add_argument("--quiet-wait", type=float, default=2.0)
    p.add_argument(
        "--smoke",
        action="store_true",
        help="a tiny run (~4 MB state, one timed round, no waiting for a quiet machine) that "
        "only checks that the benchmark works; its figures mean nothing",
    )
    p.add_argument("--role", default=None, help=argparse.SUPPRESS)  # child process mode
    p.add_argument("--width", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--layers", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.size_gb, args.rounds, args.restore_rounds, args.quiet_wait = 0.004, 1, 1, 0.0
        args.timeout = min(args.timeout, 240)
    if not args.width:
        args.width, args.layers = shape_of(args.size_gb)
    return args


PROBE_BUFFER = 256 << 20  # the disk probe writes from one pre-faulted buffer this large


def probe_disk(work: Path, nbytes: int, errors: list[str]) -> float | None:
    """This disk's O_DIRECT write speed (bytes/s) for ``nbytes`` (the state's size),
    written from one pre-faulted buffer at successive offsets, fdatasync included: what
    a time to durable can be judged against (the ranks write it in 4 files at once).
    None, with the reason added to ``errors``, where the probe cannot run (a file system
    without O_DIRECT, such as tmpfs; a disk short of room): the probe is information,
    and the benchmark goes on without it."""
    import ctypes

    from bench_save import probe_odirect

    from snapcore import _native

    page = _native.page_size()
    path = work / "disk-probe.bin"
    arena = _native.Arena(max(page, min(PROBE_BUFFER, nbytes) // page * page))
    try:
        ctypes.memset(arena.address, 0x5A, arena.size)
        return probe_odirect(path, arena.address, arena.size, nbytes)
    except OSError as e:
        errors.append(f"O_DIRECT writes of {nbytes} bytes to {path}: {e}")
        return None
    finally:
        arena.close()
        path.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    common.set_quiet(args.quiet_cores, args.quiet_wait)
    if args.role:
        work = Path(args.dir)
        result = ROLES[args.role](args, work)
        tag = os.environ.get("SNAPCORE_BENCH_TAG", args.role)
        rank = int(os.environ.get("RANK", "0"))
        (work / f"{tag}-rank{rank}.json").write_text(json.dumps(result, indent=1))
        if args.role != "single":
            import torch.distributed as dist

            dist.destroy_process_group()
        # The figures are written: end without the interpreter's teardown, where torch's
        # C++ objects have been seen to abort now and then ("terminate called without an
        # active exception") and fail the run after its work is done.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    from bench_save import machine_info

    command = "python benchmarks/bench_distributed.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    t0 = time.perf_counter()
    with common.work_dir(args.dir, "snapcore-bench-dist-") as work:
        report: Result = {
            "command": command.strip(),
            "info": machine_info(work),
            "width": args.width,
            "layers": args.layers,
            "world": args.world,
            "size_gb": args.size_gb,
            "reshard_world": args.reshard_world,
            "rank_threads": args.rank_threads,
            "single_threads": args.single_threads,
        }
        state_bytes = int(args.size_gb * GB)
        report["disk_probe_errors"] = []
        report["disk_Bps"] = [probe_disk(work, state_bytes, report["disk_probe_errors"])]
        report["single_before"] = run_role(args, "single", work, 0, "single_before")
        report["ranks4"] = run_role(args, "ranks", work, args.world, "ranks4")
        if "error" not in report["ranks4"]:
            rk = report["ranks4"]
            (work / "kept.json").write_text(
                json.dumps({"kept": rk["kept"], "saved_checksums": rk["saved_checksums"]})
            )
            report["reshard2"] = run_role(args, "reshard", work, args.reshard_world, "reshard2")
        report["single_after"] = run_role(args, "single", work, 0, "single_after")
        report["disk_Bps"].append(probe_disk(work, state_bytes, report["disk_probe_errors"]))
        report["targets"] = check_targets(report)
        report["total_s"] = time.perf_counter() - t0
    text = render(report)
    print()
    print(text)
    for t in report["targets"]:
        print(f"{t['status']:4}  {t['target']}: {t['detail']}")
    common.write_figures(args.json, report, args.markdown, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
