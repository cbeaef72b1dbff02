"""The slowdown the Checkpointer measures (docs/scheduler.md, "Intervals at run time")
against the training loop's own, in one run: 2 nodes x 1 rank on 127.0.0.1.

Each rank runs the device-wait loop of benchmarks/bench_peer.py (each step sleeps
``--device-ms`` first, as a training thread waiting on its GPU does, then a 384x384
matmul and an all_reduce) for ``--seconds``, with a ``Checkpointer`` over a store of
its own that snapshots ``--size-mb`` MiB per rank at least every ``--every`` seconds
(``max_interval_s``), with a host tier, a host and a peer tier, and the same with the
peer tier paced to ``--pace-mbps`` (``PeerSpec.max_bytes_per_s``: a longer transfer
that slows training less while it runs, docs/peer.md). Rank
0 reports the Checkpointer's measured slowdown (``stats().costs.slowdown``) and the
loop's own: the mean step time of the steps that ended with a snapshot in flight over
that of the others, less one (the same definition, measured by the loop itself). The
step time excludes the ``step()`` call, where a snapshot's stall is.

    python benchmarks/bench_slowdown.py              # 512 MiB per rank, 60 s per store
    python benchmarks/bench_slowdown.py --smoke      # 8 MiB, 6 s: does it run?
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from common import cpu_model, run_two_nodes, work_dir, write_figures

# the stores, and their areas' suffixes; paced: the peer tier at --pace-mbps
STORES = {"host": "h", "host+peer": "p", "host+peer paced": "q"}
# The Checkpointer's figure is judged against the loop's: within this much, absolute,
# or this fraction of the loop's (whichever is larger); the Checkpointer caps at 0.9.
TOLERANCE_ABS = 0.05
TOLERANCE_REL = 0.25


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import snapcore

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    torch.manual_seed(rank)
    a, b = torch.rand(384, 384), torch.rand(384, 384)
    g = torch.Generator().manual_seed(rank)
    per = int(args.size_mb * (1 << 20)) // 16  # four float32 tensors
    state = {f"t{i}": torch.rand(per, generator=g) for i in range(4)}
    out: dict[str, Any] = {}
    for kind in STORES:
        area = f"{os.environ['BENCH_AREA']}-{STORES[kind]}"
        peer: Any = kind != "host"
        if kind.endswith("paced"):
            peer = snapcore.PeerSpec(max_bytes_per_s=args.pace_mbps * 1e6)
        store = snapcore.Store(host=area, peer=peer)
        ckpt = snapcore.Checkpointer(
            store,
            devices=16384,
            max_interval_s=args.every,
            handle_sigterm=False,
            journal=False,
        )
        busy: list[float] = []
        quiet: list[float] = []
        end = time.monotonic() + args.seconds
        step = 0
        while True:
            stop = torch.tensor([1.0 if time.monotonic() > end else 0.0])
            t0 = time.perf_counter()
            time.sleep(args.device_ms / 1000)
            c = a @ b
            t = c[:1, :1].clone()
            dist.all_reduce(t)
            dist.all_reduce(stop)  # every rank stops at the same step
            took = time.perf_counter() - t0
            if rank == 0:
                (busy if ckpt.stats().in_flight else quiet).append(took)
            ckpt.step(step, state)
            step += 1
            if stop.item() > 0:
                break
        s = ckpt.stats()
        ckpt.close(final=False)
        if rank == 0:
            out[kind] = {
                "steps": step,
                "snapshots": s.snapshots,
                "per_tier": s.per_tier,
                "measured": sorted(s.costs.measured),
                "slowdown": s.costs.slowdown if "slowdown" in s.costs.measured else None,
                "persist_s": s.costs.persist_s,
                "busy_steps": len(busy),
                "quiet_steps": len(quiet),
                "busy_step_s": statistics.fmean(busy) if busy else None,
                "quiet_step_s": statistics.fmean(quiet) if quiet else None,
            }
    snapcore.close()
    if rank == 0:
        Path(args.out).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def run_job(args: argparse.Namespace, work: Path, areas: list[str]) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--role", "rank", "--out", str(work / "out.json")]
    cmd += ["--size-mb", str(args.size_mb), "--seconds", str(args.seconds)]
    cmd += ["--every", str(args.every), "--device-ms", str(args.device_ms)]
    cmd += ["--pace-mbps", str(args.pace_mbps)]
    run_two_nodes(
        lambda rank: cmd,
        lambda rank: {"BENCH_AREA": areas[rank]},
        lambda rank: work / f"rank{rank}.log",
        args.timeout_s,
    )
    return dict(json.loads((work / "out.json").read_text()))


def judge(kind: str, r: dict[str, Any]) -> dict[str, Any]:
    """The Checkpointer's slowdown against the loop's own, for one store."""
    name = f"{kind}: the Checkpointer's slowdown matches the loop's own"
    if r["slowdown"] is None or not r["busy_step_s"] or not r["quiet_step_s"]:
        return {
            "target": name,
            "status": "N/A",
            "detail": f"not measured ({r['busy_steps']} steps with a snapshot in flight)",
        }
    loop = r["busy_step_s"] / r["quiet_step_s"] - 1.0
    limit = max(TOLERANCE_ABS, TOLERANCE_REL * abs(loop))
    off = abs(r["slowdown"] - min(loop, 0.9))
    return {
        "target": name,
        "value": off,
        "limit": limit,
        "ratio": off / limit,
        "status": "PASS" if off <= limit else "FAIL",
        "detail": (
            f"Checkpointer {r['slowdown']:.3f}, the loop {loop:.3f} (capped at 0.9 as the "
            f"Checkpointer is): {off:.3f} apart, allowed {limit:.3f}"
        ),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mb", type=float, default=512.0, help="state per rank (512 MiB)")
    p.add_argument("--seconds", type=float, default=60.0, help="training per store (60)")
    p.add_argument("--every", type=float, default=4.0, help="a snapshot at least every (4 s)")
    p.add_argument("--device-ms", type=float, default=4.0, help="sleep per step, ms (4)")
    p.add_argument("--pace-mbps", type=float, default=200.0, help="the paced store's MB/s")
    p.add_argument("--smoke", action="store_true", help="8 MiB per rank, 6 s: does it run?")
    p.add_argument("--json")
    p.add_argument("--markdown")
    p.add_argument("--dir", help="where the run's logs go (a temporary directory)")
    p.add_argument("--timeout-s", type=float, default=900.0)
    p.add_argument("--role", choices=["rank"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role:
        rank_main(args)
        return 0
    if args.smoke:
        args.size_mb, args.seconds, args.every = 8.0, 6.0, 1.0
    areas = [f"bench-slow-{uuid.uuid4().hex[:8]}-n{n}" for n in range(2)]
    try:
        with work_dir(args.dir) as work:
            res = run_job(args, work, areas)
    finally:
        for a in areas:
            for x in STORES.values():
                shutil.rmtree(Path("/dev/shm") / f"snapcore-{a}-{x}", ignore_errors=True)
    targets = [judge(kind, res[kind]) for kind in STORES]
    lines = [
        f"# bench_slowdown: {args.size_mb:g} MiB per rank, 2 nodes x 1 rank on 127.0.0.1",
        "",
        f"The device-wait loop ({args.device_ms:g} ms asleep, a 384x384 matmul and an "
        f"all_reduce per step) for {args.seconds:g} s per store, a Checkpointer snapshotting "
        f"at least every {args.every:g} s; machine: {os.cpu_count()} cores ({cpu_model()}).",
        "",
        "| store | steps | snapshots | persist (s) | steps in flight / not | ms per step "
        "in flight / not | the loop's slowdown | the Checkpointer's |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for kind in STORES:
        r = res[kind]
        busy, quiet = r["busy_step_s"], r["quiet_step_s"]
        loop = f"{busy / quiet - 1:.3f}" if busy and quiet else "-"
        mine = "not measured" if r["slowdown"] is None else f"{r['slowdown']:.3f}"
        persist = ", ".join(f"{t} {v:.2f}" for t, v in r["persist_s"].items())
        ms = f"{busy * 1e3:.2f} / {quiet * 1e3:.2f}" if busy and quiet else "-"
        lines.append(
            f"| {kind} | {r['steps']} | {r['snapshots']} | {persist} | "
            f"{r['busy_steps']} / {r['quiet_steps']} | {ms} | {loop} | {mine} |"
        )
    lines += ["", "| target | apart | allowed | result |", "| --- | --- | --- | --- |"]
    for t in targets:
        if t["status"] == "N/A":
            lines.append(f"| {t['target']} | | | N/A |")
        else:
            lines.append(f"| {t['target']} | {t['value']:.3f} | {t['limit']:.3f} | {t['status']} |")
    lines += ["", *(f"- {t['target']}: {t['detail']}" for t in targets)]
    text = "\n".join(lines) + "\n"
    print(text)
    doc = {
        "size_mb": args.size_mb,
        "seconds": args.seconds,
        "every_s": args.every,
        "device_ms": args.device_ms,
        "stores": res,
        "targets": targets,
    }
    write_figures(args.json, doc, args.markdown, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
