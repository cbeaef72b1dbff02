"""The slowdown the Checkpointer measures (docs/scheduler.md, "Intervals at run time")
against the training loop's own, in one run: 2 nodes x 1 rank on 127.0.0.1.

Each rank runs the device-wait loop of benchmarks/bench_peer.py (each step sleeps
``--device-ms`` first, as a training thread waiting on its GPU does, then a 384x384
matmul and an all_reduce) for ``--seconds``, with a ``Checkpointer`` over a store of
its own that snapshots ``--size-mb`` MiB per rank at least every ``--every`` seconds
(``max_interval_s``), with a host tier, a host and a peer tier, and the same with the
peer tier paced to each rate of ``--pace-mbps`` (``PeerSpec.max_bytes_per_s``, and
``piece_bytes`` where given: a longer transfer that slows training less while it runs,
docs/peer.md). Rank
0 reports the Checkpointer's measured slowdown (``stats().costs.slowdown``) and the
loop's own: the mean step time of the steps that ended with a snapshot in flight over
that of the others, less one (the same definition, measured by the loop itself). The
step time excludes the ``step()`` call, where a snapshot's stall is.

With ``--device cuda`` (a GPU machine: benchmarks/gpu_check.sh runs it) the state
lives on the GPU and each step runs about ``--device-ms`` of bf16 matrix products there
and waits for them instead of sleeping; both ranks share GPU 0. That is the case the
peer tier is built for: the training thread waits on its GPU and the transfer's CPU
work has cores of its own.

    python benchmarks/bench_slowdown.py              # 512 MiB per rank, 60 s per store
    python benchmarks/bench_slowdown.py --smoke      # 8 MiB, 6 s: does it run?
    python benchmarks/bench_slowdown.py --device cuda --seconds 30   # on a GPU
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


def stores(pace: str) -> dict[str, tuple[str, dict[str, Any] | None]]:
    """The stores a run trains with, by name: their areas' suffixes and their PeerSpec's
    arguments (None: no peer tier). ``pace``: the paced stores, ``MBPS[:PIECE_KIB]`` each,
    comma-separated; one without a piece size is "host+peer paced", as in the docs."""
    out: dict[str, tuple[str, dict[str, Any] | None]] = {"host": ("h", None)}
    out["host+peer"] = ("p", {})
    items = [x.strip() for x in pace.split(",") if x.strip()]
    for i, item in enumerate(items):
        rate, _, piece = item.partition(":")
        spec: dict[str, Any] = {"max_bytes_per_s": float(rate) * 1e6}
        name = "host+peer paced"
        if len(items) > 1 or piece:
            name += f" {float(rate):g} MB/s"
        if piece:
            spec["piece_bytes"] = int(float(piece) * 1024)
            name += f", {float(piece):g} KiB pieces"
        out[name] = (f"q{i}", spec)
    return out


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
    state = {f"t{i}": torch.rand(per, generator=g).to(args.device) for i in range(4)}
    device_wait = waiter(args.device, args.device_ms / 1000)
    out: dict[str, Any] = {}
    for kind, (suffix, spec) in stores(args.pace_mbps).items():
        area = f"{os.environ['BENCH_AREA']}-{suffix}"
        peer = None if spec is None else snapcore.PeerSpec(**spec)
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
            device_wait()
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


def waiter(device: str, seconds: float) -> Any:
    """What a step does before its matmul: sleep ``seconds`` (cpu), or run about that
    long of bf16 matrix products on the GPU and wait for them (cuda; how many, measured
    here once, while the other rank does the same on the same GPU)."""
    import torch

    if device == "cpu":
        return lambda: time.sleep(seconds)
    x = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        x @ x
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        x @ x
    torch.cuda.synchronize()
    reps = max(1, round(seconds / ((time.perf_counter() - t0) / 50)))

    def wait() -> None:
        for _ in range(reps):
            x @ x
        torch.cuda.synchronize()

    return wait


def run_job(args: argparse.Namespace, work: Path, areas: list[str]) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--role", "rank", "--out", str(work / "out.json")]
    cmd += ["--size-mb", str(args.size_mb), "--seconds", str(args.seconds)]
    cmd += ["--every", str(args.every), "--device-ms", str(args.device_ms)]
    cmd += ["--pace-mbps", str(args.pace_mbps), "--device", args.device]
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


def lost_per_snapshot(r: dict[str, Any]) -> float | None:
    """The training time one snapshot cost the loop: the steps in flight's excess over
    the others' mean step, over the snapshots."""
    if not r["busy_step_s"] or not r["quiet_step_s"] or not r["snapshots"]:
        return None
    return float((r["busy_step_s"] - r["quiet_step_s"]) * r["busy_steps"] / r["snapshots"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mb", type=float, default=512.0, help="state per rank (512 MiB)")
    p.add_argument("--seconds", type=float, default=60.0, help="training per store (60)")
    p.add_argument("--every", type=float, default=4.0, help="a snapshot at least every (4 s)")
    p.add_argument("--device-ms", type=float, default=4.0, help="sleep per step, ms (4)")
    p.add_argument(
        "--pace-mbps",
        default="200",
        help="the paced stores: MBPS[:PIECE_KIB], comma-separated (200: one store at 200 MB/s "
        "in pieces of PeerSpec's default size)",
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cpu: each step sleeps --device-ms (default); cuda: the state on GPU 0, each "
        "step about --device-ms of matrix products there, waited for",
    )
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
    try:
        stores(args.pace_mbps)
    except ValueError as e:
        p.error(f"--pace-mbps {args.pace_mbps!r}: {e}")
    gpu = ""
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("bench_slowdown --device cuda needs one: CUDA is not available", file=sys.stderr)
            return 2
        gpu = torch.cuda.get_device_name(0)
    areas = [f"bench-slow-{uuid.uuid4().hex[:8]}-n{n}" for n in range(2)]
    try:
        with work_dir(args.dir) as work:
            res = run_job(args, work, areas)
    finally:
        for a in areas:
            for x, _ in stores(args.pace_mbps).values():
                shutil.rmtree(Path("/dev/shm") / f"snapcore-{a}-{x}", ignore_errors=True)
    kinds = list(stores(args.pace_mbps))
    targets = [judge(kind, res[kind]) for kind in kinds]
    wait = f"{args.device_ms:g} ms asleep"
    on = ""
    if gpu:
        wait = f"about {args.device_ms:g} ms of bf16 matrix products on the GPU, waited for"
        on = f", the state on {gpu} (both ranks on GPU 0)"
    lines = [
        f"# bench_slowdown: {args.size_mb:g} MiB per rank, 2 nodes x 1 rank on 127.0.0.1",
        "",
        f"The device-wait loop ({wait}, a 384x384 matmul and an all_reduce per step) for "
        f"{args.seconds:g} s per store, a Checkpointer snapshotting at least every "
        f"{args.every:g} s; machine: {os.cpu_count()} cores ({cpu_model()}){on}.",
        "",
        "| store | steps | snapshots | persist (s) | steps in flight / not | ms per step "
        "in flight / not | the loop's slowdown | the Checkpointer's | training lost per "
        "snapshot (s) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for kind in kinds:
        r = res[kind]
        busy, quiet = r["busy_step_s"], r["quiet_step_s"]
        loop = f"{busy / quiet - 1:.3f}" if busy and quiet else "-"
        mine = "not measured" if r["slowdown"] is None else f"{r['slowdown']:.3f}"
        persist = ", ".join(f"{t} {v:.2f}" for t, v in r["persist_s"].items())
        ms = f"{busy * 1e3:.2f} / {quiet * 1e3:.2f}" if busy and quiet else "-"
        lost = lost_per_snapshot(r)
        lines.append(
            f"| {kind} | {r['steps']} | {r['snapshots']} | {persist} | "
            f"{r['busy_steps']} / {r['quiet_steps']} | {ms} | {loop} | {mine} | "
            f"{'-' if lost is None else f'{lost:.3f}'} |"
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
        "device": args.device,
        "gpu": gpu or None,
        "stores": res,
        "targets": targets,
    }
    write_figures(args.json, doc, args.markdown, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
