"""The peer tier (issue 13): a replaced node restores from its partner's memory, against
a loopback TCP probe measured in the same run.

Two "nodes" of one rank each (plain processes, env:// rendezvous on 127.0.0.1, gloo),
each with its own host-memory area. Phase 1: both save a state of ``--size-mb`` MiB per
rank (rank-local float32 tensors) to ``Store(host=..., peer=True)``; each rank's part is
copied into the other node's memory. Then node 1 is replaced: its processes have ended
and its host area is deleted. Phase 2, a new job: first the probe, a plain TCP stream
on 127.0.0.1 from rank 0 to rank 1 of as many bytes as rank 1's part (the best of 3,
into a buffer faulted in beforehand: the link's best); then both ranks restore, rank 1's
part coming back from rank 0's memory over the peer group (gloo point-to-point). Figures
of rank 1 (the replaced node):

- fetch: its part's bytes over the time of the round that brought them (``RestoreInfo
  .peer_s``: headers, the receiver's allocation of the file in /dev/shm, the data, the
  check of every chunk's XXH3-128, the commit), against the probe: the target is >= 0.8;
- the whole restore (``RestoreInfo.seconds``: the agreement, the fetch, the reads into
  the state; the re-send of the partner's copy runs in the background after it),
  against the probe, for information;
- bit-exactness: the restored tensors' sha256 against the saved ones.

    python benchmarks/bench_peer.py                 # 512 MiB per rank
    python benchmarks/bench_peer.py --size-mb 2048
    python benchmarks/bench_peer.py --smoke         # 8 MiB, does it run?
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
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from common import cpu_model, free_port, targets_table, work_dir, write_figures

TENSORS = 8  # the state: this many rank-local tensors per rank
TARGET = 0.8  # fetch rate >= TARGET x the loopback TCP probe's
TRAIN_ROUNDS = 3  # alternations of the training loop with and without the peer tier
PIECE = 16 << 20  # the probe's send and receive size
PROBE_RUNS = 3  # the probe's best of


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


def probe(rank: int, port: int, nbytes: int) -> list[float] | None:
    """Rank 0 streams ``nbytes`` to rank 1 over TCP on 127.0.0.1, ``PROBE_RUNS`` times;
    rank 1 returns the rate (bytes/s) of each run (the best and the median are reported),
    received into one buffer of that size faulted in before the clock starts and
    reused by every run: the link's best, not the allocation's."""
    if rank == 0:
        chunk = memoryview(bytearray(os.urandom(1024)) * (PIECE // 1024))
        s = _connect(port)
        with s:
            for _ in range(PROBE_RUNS):
                s.recv(1)  # the receiver is ready
                left = nbytes
                while left:
                    n = min(left, PIECE)
                    s.sendall(chunk[:n])
                    left -= n
            s.recv(1)  # the receiver's end
        return None
    buf = bytearray(nbytes)
    view = memoryview(buf)
    for off in range(0, nbytes, 4096):  # fault it in first
        buf[off] = 1
    runs: list[float] = []
    with socket.socket() as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", port))
        srv.listen(1)
        conn, _ = srv.accept()
        with conn:
            for _ in range(PROBE_RUNS):
                conn.sendall(b"r")
                t0 = time.perf_counter()
                got = 0
                while got < nbytes:
                    n = conn.recv_into(view[got:], min(PIECE, nbytes - got))
                    if n == 0:
                        raise ConnectionError("the probe's sender went away")
                    got += n
                runs.append(nbytes / (time.perf_counter() - t0))
            conn.sendall(b"k")
    return runs


def fresh_probe(rank: int, port: int, nbytes: int) -> float | None:
    """Like ``probe``, once, but as a replaced node must receive: each piece into a
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


def train(args: argparse.Namespace, rank: int) -> dict[str, Any]:
    """A training loop (a matmul and an all_reduce per step) that snapshots every
    ``--every`` steps with ``async_save`` and goes on at once, to a store with a host tier
    only and to one with a host and a peer tier, alternated ``TRAIN_ROUNDS`` times; the
    loop's time per step for each."""
    import torch
    import torch.distributed as dist

    import snapcore

    torch.manual_seed(rank)
    a, b = torch.rand(384, 384), torch.rand(384, 384)
    state = state_of(args.train_mb, rank, seed=3)
    area = os.environ["BENCH_AREA"]
    stores = {
        "host": snapcore.Store(host=f"{area}-t"),
        "host+peer": snapcore.Store(host=f"{area}-p", peer=True),
    }
    times: dict[str, list[float]] = {k: [] for k in stores}
    failures: list[str] = []
    step = 0
    for r in range(TRAIN_ROUNDS + 1):  # the first round warms up (arenas, the plan)
        for label, store in stores.items():
            handles = []
            dist.barrier()
            t0 = time.perf_counter()
            for s in range(args.train_steps):
                c = a @ b
                t = c[:1, :1].clone()
                dist.all_reduce(t)
                if s % args.every == 0:
                    step += 1
                    handles.append(snapcore.async_save(state, store, step=step))
            seconds = time.perf_counter() - t0
            for h in handles:
                try:
                    h.wait()
                except snapcore.SnapcoreError as e:
                    failures.append(f"{label}: {e}")
            if r:
                times[label].append(seconds / args.train_steps)
    return {"step_s": times, "train_failures": failures}


def rank_main(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    import snapcore

    rank = int(os.environ["RANK"])
    out: dict[str, Any] = {"rank": rank}
    store = snapcore.Store(host=os.environ["BENCH_AREA"], peer=True)
    if args.role == "restore":
        nbytes = int(args.size_mb * (1 << 20))
        runs = probe(rank, args.probe_port, nbytes)
        out["probe_runs_bps"] = runs
        out["probe_bps"] = max(runs) if runs else None
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
        out.update(train(args, rank))
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
    snapcore.close()
    Path(args.out).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


# -- the parent ----------------------------------------------------------------------------
def run_job(
    role: str, args: argparse.Namespace, work: Path, areas: list[str], prepare: bool = False
) -> list[Any]:
    port, probe_port = free_port(), free_port()
    while probe_port + 1 == port:  # the second probe uses the next port
        probe_port = free_port()
    procs = []
    tag = "-prepared" if prepare else ""
    for rank in range(2):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "2",
            "GLOO_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1",
            "BENCH_AREA": areas[rank],
            "BENCH_PREPARE": "1" if prepare else "0",
        }
        cmd = [
            sys.executable,
            __file__,
            "--role",
            role,
            "--size-mb",
            str(args.size_mb),
            "--probe-port",
            str(probe_port),
            "--train-mb",
            str(args.train_mb),
            "--train-steps",
            str(args.train_steps),
            "--every",
            str(args.every),
            "--out",
            str(work / f"{role}{rank}{tag}.json"),
        ]
        log = open(work / f"{role}{rank}{tag}.log", "wb")  # noqa: SIM115 (the child keeps it)
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + args.timeout_s
    for p in procs:
        p.wait(timeout=max(1.0, deadline - time.monotonic()))
    for rank, p in enumerate(procs):
        if p.returncode != 0:
            tail = (work / f"{role}{rank}{tag}.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{role}: rank {rank} exited {p.returncode}:\n{tail}")
    return [json.loads((work / f"{role}{r}{tag}.json").read_text()) for r in range(2)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mb", type=float, default=512.0, help="state per rank (512 MiB)")
    p.add_argument("--smoke", action="store_true", help="8 MiB per rank: does it run?")
    p.add_argument("--json")
    p.add_argument("--markdown")
    p.add_argument("--dir", help="where the run's logs go (a temporary directory)")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--train-mb", type=float, default=128.0, help="the loop's state per rank")
    p.add_argument("--train-steps", type=int, default=60, help="steps per timed loop")
    p.add_argument("--every", type=int, default=10, help="a snapshot every N steps")
    p.add_argument("--role", choices=["save", "restore", "train"], help=argparse.SUPPRESS)
    p.add_argument("--probe-port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role:
        rank_main(args)
        return 0
    if args.smoke:
        args.size_mb, args.train_mb, args.train_steps = 8.0, 4.0, 10
    areas = [f"bench-peer-{uuid.uuid4().hex[:8]}-n{n}" for n in range(2)]
    shm = [Path("/dev/shm") / f"snapcore-{a}{x}" for a in areas for x in ("", "-t", "-p")]
    try:
        with work_dir(args.dir) as work:
            saved = run_job("save", args, work, areas)
            shutil.rmtree(Path("/dev/shm") / f"snapcore-{areas[1]}")  # node 1 is replaced
            restored = run_job("restore", args, work, areas)
            shutil.rmtree(Path("/dev/shm") / f"snapcore-{areas[1]}")  # replaced again
            prepared = run_job("restore", args, work, areas, prepare=True)
            trained = run_job("train", args, work, areas)
    finally:
        for path in shm:
            shutil.rmtree(path, ignore_errors=True)
    lost, ready = restored[1], prepared[1]

    def rates(r: dict[str, Any]) -> tuple[float, float, float]:
        fetch = r["peer_bytes"] / r["peer_s"] if r["peer_s"] else 0.0
        whole = r["peer_bytes"] / r["seconds"] if r["seconds"] else 0.0
        return r["probe_bps"], fetch, whole

    def median(r: dict[str, Any]) -> float:
        return statistics.median(r["probe_runs_bps"])

    probe_bps, fetch_bps, restore_bps = rates(lost)
    probe2_bps, fetch2_bps, restore2_bps = rates(ready)
    exact = all(
        r["digest"] == s["digest"]
        for run in (restored, prepared)
        for r, s in zip(run, saved, strict=True)
    )
    step_s = {
        k: statistics.median(x for t in trained for x in t["step_s"][k])
        for k in trained[0]["step_s"]
    }
    slowdown = step_s["host+peer"] / step_s["host"]

    def row(what: str, r: dict[str, Any], fetch: float, probe_: float) -> dict[str, Any]:
        return {
            "target": what,
            "value": fetch,
            "limit": TARGET * probe_,
            "ratio": fetch / probe_,
            "status": "PASS" if fetch >= TARGET * probe_ and exact else "FAIL",
            "detail": (
                f"{r['peer_bytes'] / 1e6:.0f} MB in {r['peer_s']:.3f} s (RestoreInfo.peer_s) "
                f"against the probe's {probe_ / 1e9:.2f} GB/s in the same job; bit-exact: "
                f"{exact}; tiers read: {r['tier_bytes']}"
            ),
        }

    targets = [
        row(
            "replaced node's fetch (after snapcore.prepare) >= 0.8 x loopback TCP",
            ready,
            fetch2_bps,
            probe2_bps,
        ),
        row(
            "replaced node's fetch (no prepare: faulted on the way) >= 0.8 x loopback TCP",
            lost,
            fetch_bps,
            probe_bps,
        ),
    ]
    doc = {
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count()},
        "size_mb_per_rank": args.size_mb,
        "saved": saved,
        "restored": restored,
        "prepared": prepared,
        "probe_bps": probe_bps,
        "fetch_bps": fetch_bps,
        "restore_bps": restore_bps,
        "prepared_probe_bps": probe2_bps,
        "prepared_fetch_bps": fetch2_bps,
        "prepared_restore_bps": restore2_bps,
        "fault_bps": lost["fault_bps"],
        "fresh_probe_bps": lost["fresh_probe_bps"],
        "trained": trained,
        "step_s": step_s,
        "slowdown": slowdown,
        "targets": targets,
    }
    lines = [
        f"# bench_peer: {args.size_mb:g} MiB per rank, 2 nodes x 1 rank on 127.0.0.1",
        "",
        "Restore of the replaced node, first without snapcore.prepare (its part received "
        "into fresh memory, faulted by a thread ahead of the wire), then, replaced again, "
        "with it (the part received into memory prepare faulted in beforehand):",
        "",
        f"- loopback TCP probe (rank 0 -> rank 1, the same bytes into a reused buffer "
        f"faulted beforehand, best of {PROBE_RUNS}): {probe_bps / 1e9:.2f} GB/s "
        f"(median {median(lost) / 1e9:.2f}); {probe2_bps / 1e9:.2f} GB/s (median "
        f"{median(ready) / 1e9:.2f}) in the second job",
        f"- fetch without prepare: {fetch_bps / 1e9:.2f} GB/s ({fetch_bps / probe_bps:.2f} x "
        f"the probe's best, {fetch_bps / median(lost):.2f} x its median)",
        f"- fetch after prepare ({ready['prepare_s']:.3f} s before the restore): "
        f"{fetch2_bps / 1e9:.2f} GB/s ({fetch2_bps / probe2_bps:.2f} x the probe's best, "
        f"{fetch2_bps / median(ready):.2f} x its median)",
        f"- whole restore of the replaced node (agreement, fetch, reads): "
        f"{restore_bps / 1e9:.2f} GB/s ({restore_bps / probe_bps:.2f} x the probe), "
        f"{lost['seconds']:.3f} s without prepare; {restore2_bps / 1e9:.2f} GB/s "
        f"({restore2_bps / probe2_bps:.2f} x), {ready['seconds']:.3f} s with it",
        f"- loopback TCP into fresh /dev/shm memory (a reused buffer, then pwrite to a new "
        f"file, as the fetch does): {lost['fresh_probe_bps'] / 1e9:.2f} GB/s; the fetch is "
        f"{fetch_bps / lost['fresh_probe_bps']:.2f} x that",
        f"- fresh /dev/shm memory on the replaced node (allocated and faulted, as the "
        f"fetch's receiving file is): {lost['fault_bps'] / 1e9:.2f} GB/s",
        "- the fetch's stages on the replaced node (s), without / with prepare: "
        + ", ".join(f"{k} {v:.3f}" for k, v in lost["fetch_stages"].items())
        + " / "
        + ", ".join(f"{k} {v:.3f}" for k, v in ready["fetch_stages"].items()),
        f"- training ({args.train_steps} steps of a 384x384 matmul and an all_reduce, an "
        f"async_save of {args.train_mb:g} MiB per rank every {args.every} steps; median of "
        f"{TRAIN_ROUNDS} alternated loops per rank): {step_s['host'] * 1e3:.1f} ms a step "
        f"with a host tier, {step_s['host+peer'] * 1e3:.1f} ms with host and peer tiers: "
        f"{slowdown:.2f} x; failures: {[f for t in trained for f in t['train_failures']]}",
        f"- the save's peer tier durable after {saved[1]['peer_s']:.3f} s (rank 1)",
        "",
        *targets_table(targets, "memory"),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    write_figures(args.json, doc, args.markdown, text)
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
