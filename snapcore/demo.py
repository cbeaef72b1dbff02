"""``make demo``: train, SIGKILL the training process mid-run, resume, compare bit for bit.

Run as ``python -m snapcore.demo`` (``--help`` for the knobs). It shows snapcore's two
promises on a small transformer trained on CPU:

1. an uninterrupted run, without snapshots, gives the reference losses;
2. a second run takes an async snapshot every few steps and is killed with SIGKILL as
   soon as one snapshot has been staged, so the kill usually lands while that snapshot is
   still being written;
3. a new process restores the newest committed snapshot and trains to the end.

The losses of runs 2 and 3 must equal those of run 1 bit for bit (compared as
``float.hex``), and so must the final weights and optimizer state; the program prints
PASS or FAIL and exits non-zero on a mismatch. It then prints what each snapshot cost.

Each run is a child process forked from this one. Importing torch takes seconds on a
small machine, so the children inherit the parent's import instead of starting fresh
interpreters; the parent itself never runs a torch operation, so it has no thread pools
and locks that a fork could copy in a bad state. Children report through a pipe, one
small message per event, and a SIGKILL mid-message is impossible to confuse with data:
the parent just sees the end of the pipe.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import math
import multiprocessing as mp
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import snapcore
from snapcore.directory import LocalDirectory

# The task: next-token prediction on sequences drawn from a fixed random Markov chain in
# which each token has a few possible successors, so the loss falls from log(VOCAB)
# towards log(SUCCESSORS) and the curve is worth looking at.
VOCAB = 64
SUCCESSORS = 4
SEQ = 32
BATCH = 16
CORPUS = 512  # sequences; one epoch is CORPUS // BATCH steps
D_MODEL = 64
LAYERS = 2
DATA_SEED = 1234
INIT_SEED = 0


# -- the training program (runs in the children) -------------------------------------------
class TinyLM(nn.Module):
    """A causal transformer language model small enough to train in seconds on one core."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Embedding(SEQ, D_MODEL)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                D_MODEL, 4, 4 * D_MODEL, dropout=0.1, batch_first=True, norm_first=True
            )
            for _ in range(LAYERS)
        )
        self.norm = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB)
        mask = nn.Transformer.generate_square_subsequent_mask(SEQ)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos.weight[: x.shape[1]]
        for block in self.blocks:
            h = block(h, src_mask=self.mask, is_causal=True)
        return self.head(self.norm(h))


class Batches:
    """A data loader whose position is part of the snapshot (``state_dict`` = epoch, index).

    The corpus is generated from a fixed seed and each epoch is shuffled by a generator
    seeded with the epoch, so the position alone says which batch comes next: a resumed
    run sees exactly the batches the uninterrupted run saw.
    """

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(DATA_SEED)
        successors = torch.randint(0, VOCAB, (VOCAB, SUCCESSORS), generator=g)
        seqs = torch.empty(CORPUS, SEQ + 1, dtype=torch.long)
        seqs[:, 0] = torch.randint(0, VOCAB, (CORPUS,), generator=g)
        for t in range(SEQ):
            pick = torch.randint(0, SUCCESSORS, (CORPUS,), generator=g)
            seqs[:, t + 1] = successors[seqs[:, t], pick]
        self.corpus = seqs
        self.epoch = 0
        self.index = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.index + BATCH > CORPUS:
            self.epoch, self.index = self.epoch + 1, 0
        order = torch.randperm(CORPUS, generator=torch.Generator().manual_seed(self.epoch))
        rows = self.corpus[order[self.index : self.index + BATCH]]
        self.index += BATCH
        return rows[:, :-1], rows[:, 1:]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.epoch, self.index = sd["epoch"], sd["index"]


def _lr_factor(total: int) -> Any:
    warmup = max(1, total // 10)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

    return factor


def _digest(tensors: Iterator[torch.Tensor]) -> str:
    """sha256 of the tensors' bytes: equal digests mean bit-identical training states."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().contiguous()
        h.update((ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr()))
    return h.hexdigest()


class _Reporter:
    """Sends events to the parent; the snapshot waiter threads share it with training."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.lock = threading.Lock()

    def __call__(self, event: str, **fields: Any) -> None:
        with self.lock:
            self.conn.send({"event": event, **fields})


def _train(conn: Connection, store: str | None, steps: int, every: int, resume: bool) -> None:
    """One training process: optionally resume from ``store``, snapshot to it every ``every``."""
    send = _Reporter(conn)
    torch.set_num_threads(1)  # one thread: the same float summation order in every run
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(INIT_SEED)
    model = TinyLM()
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, _lr_factor(steps))
    data = Batches()
    # The training state: everything a bit-exact continuation depends on, dropout's RNG
    # and the data position included.
    state: dict[str, Any] = {
        "model": model,
        "optim": optim,
        "sched": sched,
        "data": data,
        "rng": torch.get_rng_state(),
        "step": 0,
    }
    send("setup", params=sum(p.numel() for p in model.parameters()))
    start = 0
    if resume:
        assert store is not None
        snaps = LocalDirectory(store).snapshots()
        send(
            "store",
            committed=[s.step for s in snaps if s.committed],
            partial=[s.step for s in snaps if not s.committed],
        )
        info = snapcore.restore(state, store)
        torch.set_rng_state(state["rng"])
        start = info.step
        send("restored", step=info.step, seconds=info.seconds, bytes=info.bytes)
    waiters: list[threading.Thread] = []
    for step in range(start + 1, steps + 1):
        model.train()
        x, y = data.next()
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        sched.step()
        send("loss", step=step, loss=loss.item().hex())
        if store is not None and step % every == 0:
            state["rng"] = torch.get_rng_state()
            state["step"] = step
            handle = snapcore.async_save(state, store, step=step)
            send("staged", step=step)
            waiter = threading.Thread(target=_report_durable, args=(handle, send), daemon=True)
            waiter.start()
            waiters.append(waiter)
    for waiter in waiters:
        waiter.join()
    tensors = [*model.state_dict().values()]
    for st in optim.state_dict()["state"].values():
        tensors.extend(v for v in st.values() if isinstance(v, torch.Tensor))
    send("done", digest=_digest(iter(tensors)))


def _report_durable(handle: snapcore.SaveHandle, send: _Reporter) -> None:
    stats = handle.wait()
    send(
        "durable",
        step=stats.step,
        stall_s=stats.stall_s,
        durable_s=stats.durable_s,
        bytes=stats.bytes,
    )


# -- the parent: runs the three children and compares ------------------------------------
@dataclass
class Run:
    """What one child reported."""

    name: str
    losses: dict[int, str] = field(default_factory=dict)  # step -> float.hex
    snapshots: dict[int, dict[str, Any]] = field(default_factory=dict)  # step -> durable event
    staged: list[int] = field(default_factory=list)
    events: dict[str, dict[str, Any]] = field(default_factory=dict)  # last event of each kind
    exitcode: int | None = None
    seconds: float = 0.0
    digest: str | None = None


class DemoError(Exception):
    """A child failed in a way that says nothing about snapcore's guarantees."""


def _run_child(
    name: str,
    store: str | None,
    steps: int,
    every: int,
    *,
    resume: bool = False,
    kill_after_staged: int | None = None,
) -> Run:
    """Run one training child to its end, or SIGKILL it once snapshot ``kill_after_staged``
    is staged (its data is then usually still being written)."""
    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_train, args=(send, store, steps, every, resume), name=name)
    run = Run(name)
    t0 = time.perf_counter()
    proc.start()
    send.close()  # the child holds the only write end: its death ends the stream
    try:
        while True:
            try:
                msg = recv.recv()
            except EOFError:
                break
            kind = msg["event"]
            run.events[kind] = msg
            if kind == "loss":
                run.losses[msg["step"]] = msg["loss"]
            elif kind == "durable":
                run.snapshots[msg["step"]] = msg
            elif kind == "done":
                run.digest = msg["digest"]
            elif kind == "staged":
                run.staged.append(msg["step"])
                if msg["step"] == kill_after_staged:
                    proc.kill()  # SIGKILL
    finally:
        proc.join()
        recv.close()
    run.seconds = time.perf_counter() - t0
    run.exitcode = proc.exitcode
    expected = -signal.SIGKILL if kill_after_staged is not None else 0
    if run.exitcode != expected:
        how = "was not killed (it ended first)" if run.exitcode == 0 else "failed"
        raise DemoError(f"the {name} run {how}: exit code {run.exitcode}")
    return run


def _steps(steps: Sequence[int]) -> str:
    """1, 2, 3, 5 -> '1-3, 5'."""
    parts: list[list[int]] = []
    for s in sorted(steps):
        if parts and parts[-1][1] == s - 1:
            parts[-1][1] = s
        else:
            parts.append([s, s])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in parts) or "none"


def _compare(reference: Run, run: Run) -> tuple[int, list[int]]:
    """(steps compared, steps whose loss differs from the reference bit for bit)."""
    steps = sorted(run.losses)
    return len(steps), [s for s in steps if run.losses[s] != reference.losses.get(s)]


def _stray_files(store: LocalDirectory) -> list[str]:
    """Files in the store that no committed manifest references (none once saves ended)."""
    stray = []
    for snap in store.snapshots():
        keep = {"manifest.json"}
        if snap.committed:
            keep |= {Path(f.name).name for f in store.read_manifest(snap.step).files}
        stray += [str(p) for p in sorted(snap.path.iterdir()) if p.name not in keep]
        if not snap.committed:
            stray.append(str(snap.path))
    return stray


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.1f}"


def _print_costs(killed: Run, resumed: Run, partial: set[int]) -> None:
    print()
    print("what each snapshot cost (stall: training blocked in async_save; durable: committed)")
    print(f"  {'run':8} {'step':>5} {'stall ms':>9} {'durable ms':>11} {'size MB':>8}")
    stalls, durables = [], []
    for run in (killed, resumed):
        for step in sorted({*run.snapshots, *run.staged}):
            s = run.snapshots.get(step)
            if s is None:
                fate = "partial on disk, ignored" if step in partial else "committed, unreported"
                print(f"  {run.name:8} {step:5} {'':9} {'killed':>11}  ({fate})")
                continue
            stalls.append(s["stall_s"])
            durables.append(s["durable_s"])
            print(
                f"  {run.name:8} {step:5} {_ms(s['stall_s']):>9} {_ms(s['durable_s']):>11} "
                f"{s['bytes'] / 1e6:8.2f}"
            )
    if stalls:
        print(
            f"  {'median':8} {'':5} {_ms(statistics.median(stalls)):>9} "
            f"{_ms(statistics.median(durables)):>11}"
        )


def demo(steps: int, every: int, kill_at: int, root: Path) -> bool:
    """Run the three processes and print the comparison; True when everything matches."""
    store = str(root / "store")
    print("snapcore demo: train, SIGKILL, resume, compare bit for bit")
    print(
        f"  model  causal transformer, {LAYERS} layers, d={D_MODEL}, AdamW, "
        "warmup + cosine LR, dropout 0.1"
    )
    print(
        f"  run    {steps} steps of {BATCH}x{SEQ} tokens on CPU, async snapshot every {every} steps"
    )
    print(f"  store  {store}")
    print()

    base = _run_child("baseline", None, steps, every)
    first, last = float.fromhex(base.losses[1]), float.fromhex(base.losses[steps])
    print(
        f"[1/3] uninterrupted run, no snapshots: {base.events['setup']['params']:,} "
        f"parameters, {steps} steps in {base.seconds:.1f} s, loss {first:.3f} -> {last:.3f}"
    )

    killed = _run_child("killed", store, steps, every, kill_after_staged=kill_at)
    reached = max(killed.losses)
    durable = sorted(killed.snapshots)
    print(
        f"[2/3] run with snapshots: SIGKILL right after snapshot {kill_at} was staged; "
        f"it died at step {reached}, {killed.seconds:.1f} s in"
    )
    print(f"      durable before the kill: steps {_steps(durable)}")

    resumed = _run_child("resumed", store, steps, every, resume=True)
    on_disk = resumed.events["store"]
    partial = set(on_disk["partial"])
    restored = resumed.events["restored"]
    print(
        f"      on disk after the kill: committed {_steps(on_disk['committed'])}; "
        f"partial (uncommitted) {_steps(sorted(partial))}"
    )
    mb, ms = restored["bytes"] / 1e6, restored["seconds"] * 1e3
    print(
        f"[3/3] new process restored step {restored['step']} ({mb:.2f} MB, hashes verified) "
        f"in {ms:.1f} ms and trained steps {restored['step'] + 1}-{steps} "
        f"in {resumed.seconds:.1f} s"
    )

    print()
    ok = True
    newest = max(on_disk["committed"])
    if restored["step"] != newest:
        ok = False
        print(f"MISMATCH: restored step {restored['step']}, newest committed is {newest}")
    print("loss of each step, compared as float.hex with the uninterrupted run:")
    for run in (killed, resumed):
        n, bad = _compare(base, run)
        ok = ok and not bad
        span = f"steps {min(run.losses)}-{max(run.losses)}"
        verdict = "all equal" if not bad else f"DIFFERENT at steps {_steps(bad)}"
        print(f"  {run.name:8} {span:14} {n - len(bad):4}/{n} equal  {verdict}")
    r = restored["step"]
    print(f"  around the resume point (steps {r - 1}-{r + 3}):")
    print(f"  {'step':>6}  {'uninterrupted':24} {'killed':24} resumed")
    for s in range(max(1, r - 1), min(steps, r + 3) + 1):
        cells = [run.losses.get(s, "-") for run in (base, killed, resumed)]
        print(f"  {s:6}  " + " ".join(f"{c:24}" for c in cells).rstrip())
    same = base.digest is not None and base.digest == resumed.digest
    ok = ok and same
    print(
        "  final weights and optimizer state: "
        + ("sha256 equal" if same else f"DIFFERENT ({base.digest} vs {resumed.digest})")
    )
    stray = _stray_files(LocalDirectory(store))
    ok = ok and not stray
    print(
        "  leftovers of the killed snapshot: "
        + ("removed by the next save" if not stray else f"STILL THERE: {stray}")
    )
    print()
    if ok:
        print("PASS: the resumed run matches the uninterrupted run bit for bit")
    else:
        print("FAIL: the resumed run differs from the uninterrupted run")
    _print_costs(killed, resumed, partial)
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m snapcore.demo",
        description="Train a small model, SIGKILL it mid-run, resume from the newest "
        "snapshot and check that the losses match an uninterrupted run bit for bit.",
    )
    p.add_argument("--steps", type=int, default=120, help="training steps (default 120)")
    p.add_argument("--every", type=int, default=10, help="steps between snapshots (default 10)")
    p.add_argument(
        "--kill-at",
        type=int,
        help="SIGKILL once this step's snapshot is staged (a multiple of --every; default: "
        "chosen at random in the middle third of the run)",
    )
    p.add_argument("--seed", type=int, help="seed of the random choice of --kill-at")
    p.add_argument("--keep", action="store_true", help="keep the store directory")
    args = p.parse_args(argv)
    if args.every < 1 or args.steps < 3 * args.every:
        p.error("--steps must be at least 3 x --every, and --every at least 1")
    if args.kill_at is None:
        candidates = list(range(args.every, args.steps, args.every))
        middle = [k for k in candidates if args.steps / 3 <= k <= 2 * args.steps / 3]
        args.kill_at = random.Random(args.seed).choice(middle or candidates)
    if args.kill_at % args.every or not 0 < args.kill_at < args.steps:
        p.error("--kill-at must be a multiple of --every, below --steps")

    root = Path(tempfile.mkdtemp(prefix="snapcore-demo-"))
    try:
        ok = demo(args.steps, args.every, args.kill_at, root)
    except DemoError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        sys.stdout.flush()
        if args.keep:
            print(f"\nkept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
            print(f"\nremoved {root} (--keep keeps it)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
