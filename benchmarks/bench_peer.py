"""The peer tier (issue 13): a replaced node restores from its partner's memory, against
a loopback TCP probe measured in the same run.

Two "nodes" of one rank each (plain processes, env:// rendezvous on 127.0.0.1, gloo),
each with its own host-memory area. Phase 1: both save a state of ``--size-mb`` MiB per
rank (rank-local float32 tensors) to ``Store(host=..., peer=True)``; each rank's part is
copied into the other node's memory. Then node 1 is replaced: its processes have ended
and its host area is deleted. Phase 2, a new job: the probe, a plain TCP stream on
127.0.0.1 from rank 0 to rank 1 of as many bytes as rank 1's part (one stream, like the
fetch; sent from and received into buffers of that size faulted in beforehand), run
twice before the restore and twice after it (the re-send after the restore done); then
both ranks restore, rank 1's part coming back from rank 0's memory over the peer group
(gloo point-to-point). Node 1 is replaced once more without ``snapcore.prepare`` and
``--fetch-runs`` times with it (a job each). Figures of rank 1 (the replaced node):

- fetch: its part's bytes over the time of the round that brought them (``RestoreInfo
  .peer_s``: headers, the receiver's making room in /dev/shm, the data, the check of
  every chunk's XXH3-128, the commit), against the median of the probe's runs of its
  own job: the target is >= 0.8, judged on the median of the jobs after ``prepare``;
- the whole restore (``RestoreInfo.seconds``: the agreement, the fetch, the reads into
  the state; the re-send of the partner's copy runs in the background after it);
- bit-exactness: the restored tensors' sha256 against the saved ones.

Phase 3, the cost to training: a training-like loop on both ranks (``train``), without
snapshots, with host snapshots, with host and peer snapshots (unpaced, and paced to
``--pace-mbps``), rounds rotated; the step time's ratio to the loop without snapshots.
The loop runs twice: CPU-bound (the training and the transfers share the two cores),
then with each step sleeping ``--device-ms`` first (the training thread leaves its core
for most of a step, as one waiting on its GPU does).

    python benchmarks/bench_peer.py                 # 512 MiB per rank
    python benchmarks/bench_peer.py --size-mb 2048
    python benchmarks/bench_peer.py --smoke         # 8 MiB, does it run?
    python benchmarks/bench_peer.py --train-only --modes host,host+peer --train-rounds 8
    python benchmarks/bench_peer.py --json out.json --markdown out.md
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import socket
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from common import cpu_model, free_port, run_two_nodes, targets_table, work_dir, write_figures

TENSORS = 8  # the state: this many rank-local tensors per rank
TARGET = 0.8  # fetch rate >= TARGET x the loopback TCP probe's
PIECE = 16 << 20  # the probe's send and receive size
PROBE_RUNS = 2  # the probe's runs before the fetch, and as many after it


# -- the ranks ---------------------------------------------------------------------------
def state_of(size_mb: float, rank: int, seed: int) -> dict[str, Any]:
    import torch

    from snapcore.distributed import RankLocal

    n = max(1, int(size_mb * (1 << 20)) // 4 // TENSORS)
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    return {f"t{i}": RankLocal(torch.rand(n, generator=gen)) for i in range(TENSORS)}


def digest(state: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(state[k].value.numpy().tobytes())
    return h.hexdigest()


class Probe:
    """A TCP stream on 127.0.0.1 from rank 0 to rank 1, of as many bytes as the fetch
    brings, measured ``PROBE_RUNS`` times before the restore and as many after it
    (``run``; rank 1 keeps the rate, bytes/s, of each). Like the fetch, one stream, the
    same bytes: the sender sends them from a buffer of their size faulted in beforehand
    (the fetch's sender sends from its copy's memory), in pieces of ``PIECE``; the
    receiver receives into one buffer of that size faulted in beforehand and reused by
    every run (the fetch after ``prepare`` receives into memory faulted beforehand)."""

    def __init__(self, rank: int, port: int, nbytes: int) -> None:
        self.rank, self.nbytes = rank, nbytes
        self.runs: list[float] = []
        buf = bytearray(nbytes)
        for off in range(0, nbytes, 4096):  # fault it in first
            buf[off] = 1 + (off >> 12) % 251
        self.view = memoryview(buf)
        if rank == 0:
            self.sock = _connect(port)
        else:
            with socket.socket() as srv:
                srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                srv.bind(("127.0.0.1", port))
                srv.listen(1)
                self.sock, _ = srv.accept()

    def run(self) -> None:
        for _ in range(PROBE_RUNS):
            if self.rank == 0:
                self.sock.recv(1)  # the receiver is ready
                for off in range(0, self.nbytes, PIECE):
                    self.sock.sendall(self.view[off : off + PIECE])
                self.sock.recv(1)  # the receiver's end
                continue
            self.sock.sendall(b"r")
            t0 = time.perf_counter()
            got = 0
            while got < self.nbytes:
                n = self.sock.recv_into(self.view[got:], min(PIECE, self.nbytes - got))
                if n == 0:
                    raise ConnectionError("the probe's sender went away")
                got += n
            self.runs.append(self.nbytes / (time.perf_counter() - t0))
            self.sock.sendall(b"k")

    def close(self) -> None:
        self.sock.close()


def fresh_probe(rank: int, port: int, nbytes: int) -> float | None:
    """Like ``Probe``, once, but as a replaced node must receive: each piece into a
    reused buffer, then written into a new file in /dev/shm (fresh memory)."""
    if rank == 0:
        return _send_once(port, nbytes)
    path = Path("/dev/shm") / f"bench-peer-probe-{os.getpid()}.bin"
    buf = bytearray(PIECE)
    view = memoryview(buf)
    with socket.socket() as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", port))
        srv.listen(1)
        conn, _ = srv.accept()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with conn:
                conn.sendall(b"r")
                t0 = time.perf_counter()
                got = 0
                while got < nbytes:
                    want = min(PIECE, nbytes - got)
                    have = 0
                    while have < want:
                        n = conn.recv_into(view[have:want], want - have)
                        if n == 0:
                            raise ConnectionError("the probe's sender went away")
                        have += n
                    os.pwrite(fd, view[:want], got)
                    got += want
                rate = nbytes / (time.perf_counter() - t0)
                conn.sendall(b"k")
        finally:
            os.close(fd)
            path.unlink()
    return rate


def _connect(port: int) -> socket.socket:
    """A connection to the receiver on 127.0.0.1:``port``, retried while it is not yet
    listening (60 s at most)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port))
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _send_once(port: int, nbytes: int) -> None:
    chunk = memoryview(bytearray(os.urandom(1024)) * (PIECE // 1024))
    s = _connect(port)
    with s:
        s.recv(1)
        left = nbytes
        while left:
            n = min(left, PIECE)
            s.sendall(chunk[:n])
            left -= n
        s.recv(1)
    return None


MODES = ("none", "host", "host+peer", "host+peer paced")


def modes_of(args: argparse.Namespace) -> tuple[str, ...]:
    """The training loop's modes ``--modes`` names, ``none`` first (the reference)."""
    named = [m.strip() for m in args.modes.split(",") if m.strip()]
    if unknown := set(named) - set(MODES):
        raise SystemExit(f"--modes: unknown {sorted(unknown)}; the modes are {MODES}")
    return ("none", *[m for m in MODES[1:] if m in named])


def train(args: argparse.Namespace, rank: int, device_ms: float, step0: int) -> dict[str, Any]:
    """A training-like loop (a 384x384 matmul and an all_reduce of its corner per step,
    on both ranks; with ``device_ms``, each step first sleeps that long: the training
    thread leaves its core, as one waiting on its GPU does) of ``--train-steps`` steps,
    in four modes: ``none`` (no snapshots),
    ``host`` (an ``async_save`` of ``--train-mb`` MiB per rank every ``--every`` steps
    to a store with a host tier only), ``host+peer`` (the same with a peer tier, sent as
    fast as gloo goes) and ``host+peer paced`` (with ``max_bytes_per_s`` of
    ``--pace-mbps``).
    ``--train-rounds`` rounds (of the modes ``--modes`` names), each running every mode
    once, the order rotated by one mode each round (as benchmarks/bench_training.py
    does), after a round of warm-up; the loop's time per step for each, and its ratio
    to the adjacent ``none`` loop of the same round. A snapshot is taken at every
    ``--every``-th step that leaves ``--every`` steps after it in the loop (so each
    one's transfer overlaps the loop's training, none runs past its end uncounted). The
    loop does not wait for its snapshots (as training does not); a save that finds both
    of its slots still busy waits for one, and that wait is in the step times."""
    import torch
    import torch.distributed as dist

    import snapcore

    torch.manual_seed(rank)
    a, b = torch.rand(384, 384), torch.rand(384, 384)
    state = state_of(args.train_mb, rank, seed=3)
    area = os.environ["BENCH_AREA"]
    paced = snapcore.PeerSpec(max_bytes_per_s=args.pace_mbps * 1e6)
    stores: dict[str, Any] = {
        "none": None,
        "host": snapcore.Store(host=f"{area}-t"),
        "host+peer": snapcore.Store(host=f"{area}-p", peer=True),
        "host+peer paced": snapcore.Store(host=f"{area}-q", peer=paced),
    }
    modes = modes_of(args)
    times: dict[str, list[float]] = {k: [] for k in modes}
    ratios: dict[str, list[float]] = {k: [] for k in modes if k != "none"}
    failures: list[str] = []
    step = step0  # the steps of each loop kind apart: the stores are the same
    for r in range(args.train_rounds + 1):  # the first round warms up (arenas, peer group)
        order = modes[r % len(modes) :] + modes[: r % len(modes)]
        took: dict[str, float] = {}
        for label in order:
            store = stores[label]
            handles = []
            dist.barrier()
            t0 = time.perf_counter()
            for s in range(args.train_steps):
                if device_ms:
                    time.sleep(device_ms / 1000)
                c = a @ b
                t = c[:1, :1].clone()
                dist.all_reduce(t)
                if store is not None and s % args.every == 0 and s + args.every <= args.train_steps:
                    step += 1
                    handles.append(snapcore.async_save(state, store, step=step))
            took[label] = (time.perf_counter() - t0) / args.train_steps
            for h in handles:  # outside the loop's time: the next loop starts quiet
                try:
                    h.wait()
                except snapcore.SnapcoreError as e:
                    failures.append(f"{label}: {e}")
        if r:
            for label in modes:
                times[label].append(took[label])
                if label != "none":
                    ratios[label].append(took[label] / took["none"])
    return {"step_s": times, "ratio": ratios, "train_failures": failures}


def rank_main(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    import snapcore

    rank = int(os.environ["RANK"])
    out: dict[str, Any] = {"rank": rank}
    store = snapcore.Store(host=os.environ["BENCH_AREA"], peer=True)
    probe: Probe | None = None
    if args.role == "restore":
        nbytes = int(args.size_mb * (1 << 20))
        probe = Probe(rank, args.probe_port, nbytes)
        probe.run()  # before the restore (and after it, below)
        out["fresh_probe_bps"] = fresh_probe(rank, args.probe_port + 1, nbytes)
        if rank == 1:  # fresh memory's cost here: what the fetch's receiving file costs
            from snapcore.staging.arena import HostArena

            path = Path("/dev/shm") / f"bench-peer-fault-{os.getpid()}.bin"
            t0 = time.perf_counter()
            HostArena(nbytes, path, None).close()
            out["fault_bps"] = nbytes / (time.perf_counter() - t0)
            path.unlink()
    dist.init_process_group("gloo")
    if args.role == "train":
        out.update(train(args, rank, 0.0, 0))
        if args.device_ms:
            out["device_wait"] = train(args, rank, args.device_ms, 1 << 20)
        snapcore.close()
        Path(args.out).write_text(json.dumps(out))
        dist.barrier()
        dist.destroy_process_group()
        return
    state = state_of(args.size_mb, rank, seed=1 if args.role == "save" else 2)
    if args.role == "save":
        stats = snapcore.save(state, store, step=1)
        out.update(digest=digest(state), peer_s=stats.tiers.get("peer"), bytes=stats.file_bytes)
    else:
        if rank == 1 and os.environ.get("BENCH_PREPARE") == "1":
            # what a replaced node does while it builds its model: fault in the memory
            # its part will be fetched into (before the clock of the restore starts)
            t0 = time.perf_counter()
            snapcore.prepare(state, store).result()
            out["prepare_s"] = time.perf_counter() - t0
        info = snapcore.restore(state, store)
        out.update(
            digest=digest(state),
            step=info.step,
            seconds=info.seconds,
            peer_bytes=info.peer_bytes,
            peer_s=info.peer_s,
            tier_bytes=info.tier_bytes,
            damaged=info.damaged,
        )
        from snapcore.peer import restore as peer_restore

        out["fetch_stages"] = dict(peer_restore.last_fetch)  # where the fetch's time went
    snapcore.close()  # the re-send after the restore is done: the link is quiet again
    if probe is not None:
        probe.run()  # after the restore: the probe's runs surround the fetch
        probe.close()
        out["probe_runs_bps"] = probe.runs
        out["probe_bps"] = statistics.median(probe.runs) if probe.runs else None
    Path(args.out).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


# -- the parent ----------------------------------------------------------------------------
def run_job(
    role: str, args: argparse.Namespace, work: Path, areas: list[str], prepare: bool = False
) -> list[Any]:
    probe_port = free_port()
    tag = "-prepared" if prepare else ""
    cmd = [sys.executable, __file__, "--role", role, "--size-mb", str(args.size_mb)]
    cmd += ["--probe-port", str(probe_port), "--train-mb", str(args.train_mb)]
    cmd += ["--train-steps", str(args.train_steps), "--every", str(args.every)]
    cmd += ["--pace-mbps", str(args.pace_mbps), "--train-rounds", str(args.train_rounds)]
    cmd += ["--modes", args.modes]
    run_two_nodes(
        lambda rank: [*cmd, "--out", str(work / f"{role}{rank}{tag}.json")],
        lambda rank: {"BENCH_AREA": areas[rank], "BENCH_PREPARE": "1" if prepare else "0"},
        lambda rank: work / f"{role}{rank}{tag}.log",
        args.timeout_s,
        avoid=(probe_port, probe_port + 1),  # the probes' ports
        what=role,
    )
    return [json.loads((work / f"{role}{r}{tag}.json").read_text()) for r in range(2)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mb", type=float, default=512.0, help="state per rank (512 MiB)")
    p.add_argument("--smoke", action="store_true", help="8 MiB per rank: does it run?")
    p.add_argument("--json")
    p.add_argument("--markdown")
    p.add_argument("--dir", help="where the run's logs go (a temporary directory)")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--fetch-runs", type=int, default=3, help="restores after prepare (3)")
    p.add_argument("--train-mb", type=float, default=64.0, help="the loop's state per rank")
    p.add_argument("--train-steps", type=int, default=1000, help="steps per timed loop")
    p.add_argument("--every", type=int, default=250, help="a snapshot every N steps")
    p.add_argument("--pace-mbps", type=float, default=200.0, help="the paced mode's MB/s")
    p.add_argument("--train-rounds", type=int, default=3, help="rounds of the modes (3)")
    p.add_argument("--modes", default=",".join(MODES), help="the loop's modes, commas")
    p.add_argument(
        "--device-ms",
        type=float,
        default=4.0,
        help="the device-wait loop's sleep per step, ms (0: only the CPU-bound loop)",
    )
    p.add_argument("--train-only", action="store_true", help="only the training loop's modes")
    p.add_argument("--role", choices=["save", "restore", "train"], help=argparse.SUPPRESS)
    p.add_argument("--probe-port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role:
        rank_main(args)
        return 0
    if args.smoke:
        args.size_mb, args.train_mb, args.train_steps, args.every = 8.0, 4.0, 20, 10
        args.fetch_runs = 1
    areas = [f"bench-peer-{uuid.uuid4().hex[:8]}-n{n}" for n in range(2)]
    shm = [
        Path("/dev/shm") / f"snapcore-{a}{x}" for a in areas for x in ("", "-t", "-p", "-q", "-n")
    ]
    try:
        with work_dir(args.dir) as work:
            if args.train_only:
                trained = run_job("train", args, work, areas)
                return _train_only(args, trained)
            saved = run_job("save", args, work, areas)
            shutil.rmtree(Path("/dev/shm") / f"snapcore-{areas[1]}")  # node 1 is replaced
            restored = run_job("restore", args, work, areas)
            prepared = []
            for _ in range(args.fetch_runs):
                shutil.rmtree(Path("/dev/shm") / f"snapcore-{areas[1]}")  # replaced again
                prepared.append(run_job("restore", args, work, areas, prepare=True))
            trained = run_job("train", args, work, areas)
    finally:
        for path in shm:
            shutil.rmtree(path, ignore_errors=True)
    lost = restored[1]
    ready = [run[1] for run in prepared]

    def fetch_of(r: dict[str, Any]) -> float:
        return r["peer_bytes"] / r["peer_s"] if r["peer_s"] else 0.0

    def ratio_of(r: dict[str, Any]) -> float:
        return fetch_of(r) / r["probe_bps"]

    exact = all(
        r["digest"] == s["digest"]
        for run in (restored, *prepared)
        for r, s in zip(run, saved, strict=True)
    )
    # the run whose ratio is the median of the runs after prepare stands for them
    typical = sorted(ready, key=ratio_of)[(len(ready) - 1) // 2]
    figures, train_lines = _training(args, trained)

    def row(what: str, r: dict[str, Any], runs: list[dict[str, Any]]) -> dict[str, Any]:
        fetch, probe_ = fetch_of(r), r["probe_bps"]
        return {
            "target": what,
            "value": fetch,
            "limit": TARGET * probe_,
            "ratio": fetch / probe_,
            "status": "PASS" if fetch >= TARGET * probe_ and exact else "FAIL",
            "detail": (
                f"{r['peer_bytes'] / 1e6:.0f} MB in {r['peer_s']:.3f} s (RestoreInfo.peer_s) "
                f"against the median of the probe's {2 * PROBE_RUNS} runs around it, "
                f"{probe_ / 1e9:.2f} GB/s; the median of {len(runs)} run(s), each of its own "
                f"job: {', '.join(f'{ratio_of(x):.2f}' for x in runs)} x; bit-exact: {exact}; "
                f"tiers read: {r['tier_bytes']}"
            ),
        }

    targets = [
        row(
            "replaced node's fetch (after snapcore.prepare) >= 0.8 x loopback TCP",
            typical,
            ready,
        ),
        row(
            "replaced node's fetch (no prepare: faulted on the way) >= 0.8 x loopback TCP",
            lost,
            [lost],
        ),
    ]
    doc = {
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count()},
        "size_mb_per_rank": args.size_mb,
        "saved": saved,
        "restored": restored,
        "prepared": prepared,
        "probe_bps": lost["probe_bps"],
        "fetch_bps": fetch_of(lost),
        "restore_bps": lost["peer_bytes"] / lost["seconds"],
        "prepared_ratios": [ratio_of(r) for r in ready],
        "fault_bps": lost["fault_bps"],
        "fresh_probe_bps": lost["fresh_probe_bps"],
        "trained": trained,
        **figures,
        "targets": targets,
    }

    def gbs(x: float) -> str:
        return f"{x / 1e9:.2f}"

    def stages(r: dict[str, Any]) -> str:
        return ", ".join(f"{k} {v:.3f}" for k, v in r["fetch_stages"].items())

    lines = [
        f"# bench_peer: {args.size_mb:g} MiB per rank, 2 nodes x 1 rank on 127.0.0.1",
        "",
        "Restore of the replaced node, first without snapcore.prepare (its part received "
        "into fresh memory, faulted by a thread ahead of the wire), then, replaced again "
        f"{args.fetch_runs} time(s), with it (the part received into memory prepare "
        "faulted in beforehand). Each fetch against the median of a loopback TCP probe's "
        f"{2 * PROBE_RUNS} runs in its own job ({PROBE_RUNS} before the restore, "
        f"{PROBE_RUNS} after it; rank 0 -> rank 1, the same bytes, from and into buffers "
        "faulted beforehand):",
        "",
        "| job | probe runs (GB/s) | fetch (GB/s) | x probe | peer_s | whole restore (s) |",
        "| --- | --- | --- | --- | --- | --- |",
        *(
            f"| {name} | {' '.join(gbs(x) for x in r['probe_runs_bps'])} | "
            f"{gbs(fetch_of(r))} | {ratio_of(r):.2f} | {r['peer_s']:.3f} | {r['seconds']:.3f} |"
            for name, r in [("no prepare", lost)]
            + [(f"prepare {i + 1}", x) for i, x in enumerate(ready)]
        ),
        "",
        f"- loopback TCP into fresh /dev/shm memory (a reused buffer, then pwrite to a new "
        f"file): {gbs(lost['fresh_probe_bps'])} GB/s; the fetch without prepare is "
        f"{fetch_of(lost) / lost['fresh_probe_bps']:.2f} x that",
        f"- fresh /dev/shm memory on the replaced node (allocated and faulted, as the "
        f"fetch's receiving file is): {gbs(lost['fault_bps'])} GB/s",
        "- prepare took "
        + ", ".join(f"{r['prepare_s']:.3f}" for r in ready)
        + " s before the restore",
        "- the fetch's stages on the replaced node (s): without prepare: "
        + stages(lost)
        + "; with it: "
        + " / ".join(stages(r) for r in ready),
        f"- the save's peer tier durable after {saved[1]['peer_s']:.3f} s (rank 1)",
        "",
        *train_lines,
        "",
        *targets_table(targets, "memory"),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    write_figures(args.json, doc, args.markdown, text)
    return 0 if exact else 1


def _training(args: argparse.Namespace, trained: list[Any]) -> tuple[dict[str, Any], list[str]]:
    """Both loops' figures (the CPU-bound loop's at the top level, the device-wait
    loop's under ``device_wait``) and their tables."""
    figures, lines = _loop(args, trained, 0.0)
    if args.device_ms:
        wait, more = _loop(args, [t["device_wait"] for t in trained], args.device_ms)
        figures["device_wait"] = {"device_ms": args.device_ms, **wait}
        lines += ["", *more]
    return figures, lines


def _loop(
    args: argparse.Namespace, trained: list[Any], device_ms: float
) -> tuple[dict[str, Any], list[str]]:
    modes = modes_of(args)
    step_s = {k: statistics.median(x for t in trained for x in t["step_s"][k]) for k in modes}
    slowdown = {k: statistics.median(x for t in trained for x in t["ratio"][k]) for k in modes[1:]}
    # what each snapshot cost the loop, in training time: comparable across intervals
    snaps = sum(
        1
        for s in range(args.train_steps)
        if s % args.every == 0 and s + args.every <= args.train_steps
    )
    cost = {
        k: (slowdown[k] - 1) * step_s["none"] * args.train_steps / max(snaps, 1) for k in modes[1:]
    }
    kind = (
        f"The device-wait loop (each step sleeps {device_ms:g} ms first: the training "
        "thread leaves its core, as one waiting on its GPU does; the transfer has the "
        "cores the loop leaves idle)"
        if device_ms
        else "The CPU-bound loop (the training and the transfer share the two cores)"
    )
    lines = [
        f"{kind}: {args.train_steps} steps of a 384x384 matmul and an all_reduce per "
        f"loop, an async_save of {args.train_mb:g} MiB per rank every {args.every} steps "
        f"(none in mode none), {snaps} per loop, one every {args.every * step_s['none']:.2f} s "
        f"of training; {args.train_rounds} rounds of the modes, rotated; the ratio to the "
        "adjacent none loop of the same round, median over rounds and ranks; the training "
        "time each snapshot cost (the ratio's excess over the loop, per snapshot):",
        "",
        "| mode | ms per step (median) | x none | x none per round and rank "
        "| lost per snapshot (s) |",
        "| --- | --- | --- | --- | --- |",
        *(
            f"| {k} | {step_s[k] * 1e3:.2f} | {slowdown[k]:.2f} | "
            + " ".join(f"{x:.2f}" for t in trained for x in t["ratio"][k])
            + f" | {cost[k]:.3f} |"
            if k != "none"
            else f"| none | {step_s[k] * 1e3:.2f} | 1 | | |"
            for k in modes
        ),
        "",
        f"(paced: max_bytes_per_s = {args.pace_mbps:g} MB/s; failures: "
        f"{[f for t in trained for f in t['train_failures']]})",
    ]
    return {"step_s": step_s, "slowdown": slowdown, "lost_per_snapshot_s": cost}, lines


def _train_only(args: argparse.Namespace, trained: list[Any]) -> int:
    figures, lines = _training(args, trained)
    text = (
        "\n".join(["# bench_peer --train-only: 2 nodes x 1 rank on 127.0.0.1", "", *lines]) + "\n"
    )
    print(text)
    write_figures(args.json, {"trained": trained, **figures}, args.markdown, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
