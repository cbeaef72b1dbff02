"""Training throughput while snapshots are taken (issue 12, item 2).

Trains a small GPT (benchmarks/gpt.py: token and position embeddings, causal
self-attention through scaled_dot_product_attention, MLP, LayerNorm, a tied head; AdamW)
on a fixed random token stream, and takes a snapshot every ``--every`` steps in each
mode:

- ``none``: no snapshots (the baseline);
- ``snapcore``: ``snapcore.async_save`` (default mode) to a local store;
- ``snapcore_overlap``: ``snapcore.async_save(overlap=True)``;
- ``dcp``: ``torch.distributed.checkpoint.async_save`` of ``get_state_dict``'s state,
  thread mode, no process group (``no_dist=True``), one ``DefaultStager`` reused
  (async staging; pinned memory and non-blocking copies on CUDA only), the default
  ``FileSystemWriter``. The staging runs on DCP's thread, so the next step waits for it
  before the optimizer writes the weights, as snapcore's overlap mode does.

Before each snapshot the previous one must be durable (snapcore: ``handle.wait()``; DCP:
``upload_completion.result()``, as DCP's docs show); that wait counts in the stall.

Per mode: tokens/s over ``--steps`` timed steps (after ``--warmup`` untimed ones; one
snapshot per mode is taken before any timing, so the cold first one, which allocates
staging memory, is not timed), the step-time distribution (p50/p99) of all steps, of
the steps right after a snapshot call ("staging": the copies, or their wait, land there)
and of the other steps that start while the previous snapshot is not yet durable
("persist": hashing and disk writes compete with training), and the stall per snapshot
(the time the call kept the training loop, the wait for the previous snapshot included).

The machine is shared, so the modes are interleaved: ``--rounds`` rounds, each running
every mode once on the same model, which trains on throughout, the order rotated by one
mode each round, each segment started once the machine is quiet (common.settle). Ratios
to ``none`` are taken within a round (the adjacent baseline), then the median over rounds.

Correctness: in the last round, at the last snapshot of each snapshotting mode, a copy of
the model's and optimizer's state is kept (outside the timed region); after the segment
that snapshot is restored (``snapcore.restore``; ``dcp.load`` for DCP) into a fresh model
and optimizer and compared bit for bit with the copy. Training went on after the call,
so this also checks that the snapshot holds the state at the call.

    python benchmarks/bench_training.py                  # --size small on CPU, ~5 minutes
    python benchmarks/bench_training.py --size gpu       # several GB of state, on CUDA
    python benchmarks/bench_training.py --smoke          # a tiny run: does it work?
    python benchmarks/bench_training.py --json out.json --markdown out.md
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import shutil
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import common
import gpt
import torch
from common import Others, settle

MODES = ("none", "snapcore", "snapcore_overlap", "dcp")
Result = dict[str, Any]


def percentile(xs: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) of ``xs``, linearly interpolated; None if empty."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- the modes --------------------------------------------------------------------------------
class Mode:
    """How one mode snapshots; the base class takes none."""

    name = "none"

    def __init__(self) -> None:
        self.records: list[Result] = []  # one per snapshot taken in the timed region
        self.update_wait_s = 0.0  # the last step's wait before its optimizer step

    def snapshot(self, step: int) -> None:
        """Snapshot the state as ``step`` (after waiting for the previous snapshot)."""

    def busy(self) -> bool:
        """Whether the previous snapshot is not yet durable."""
        return False

    def before_update(self) -> None:
        """Called between the backward and the optimizer's step."""

    def finish(self) -> None:
        """Wait until every snapshot taken is durable (outside the timed region)."""

    def verify(self, fresh: Callable[[], tuple[Any, Any]], expected: Result) -> bool:
        """Restore the last snapshot into a fresh model and optimizer: bit-exact?"""
        raise NotImplementedError

    def close(self) -> None:
        pass


class SnapcoreMode(Mode):
    def __init__(self, store: Any, model: Any, opt: Any, overlap: bool) -> None:
        super().__init__()
        self.name = "snapcore_overlap" if overlap else "snapcore"
        self.store, self.model, self.opt, self.overlap = store, model, opt, overlap
        self.handle: Any = None

    def snapshot(self, step: int) -> None:
        import snapcore

        t0 = time.perf_counter()
        if self.handle is not None:
            self.handle.wait()
        waited = time.perf_counter() - t0
        state = {"model": self.model, "optim": self.opt, "step": step}
        self.handle = snapcore.async_save(state, self.store, step=step, overlap=self.overlap)
        stall = time.perf_counter() - t0
        self.records.append(
            {"step": step, "stall_s": stall, "prev_wait_s": waited, "_handle": self.handle}
        )

    def before_update(self) -> None:
        # What snapcore's optimizer hook does in overlap mode, called here so that the
        # wait is timed (the hook then finds the copies done).
        if self.overlap and self.handle is not None:
            self.handle.staged()

    def busy(self) -> bool:
        return self.handle is not None and not self.handle.done()

    def finish(self) -> None:
        if self.handle is not None:
            self.handle.wait()

    def verify(self, fresh: Callable[[], tuple[Any, Any]], expected: Result) -> bool:
        import snapcore

        model, opt = fresh()
        state = {"model": model, "optim": opt, "step": -1}
        snapcore.restore(state, self.store, step=expected["step"])
        return state["step"] == expected["step"] and same_state(model, opt, expected)


class DCPMode(Mode):
    name = "dcp"

    def __init__(self, work: Path, model: Any, opt: Any, device: torch.device) -> None:
        super().__init__()
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        cuda = device.type == "cuda"
        # Pinned memory and non-blocking copies need an accelerator.
        self.options = StagingOptions(
            use_pinned_memory=cuda,
            use_shared_memory=False,
            use_async_staging=True,
            use_non_blocking_copy=cuda,
        )
        self.new_stager = lambda: DefaultStager(self.options)
        self.stager = self.new_stager()
        self.fresh_stagers = 0  # stagers made again because torch spent the last one
        self.work, self.model, self.opt = work, model, opt
        self.resp: Any = None
        self.staging: Any = None  # the staging future the next optimizer step waits for
        self.paths: list[Path] = []

    def path(self, step: int) -> Path:
        return self.work / f"dcp-{step}"

    def snapshot(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        t0 = time.perf_counter()
        if self.resp is not None:
            self.resp.upload_completion.result()
        waited = time.perf_counter() - t0
        t = time.perf_counter()
        self._prune(keep=1)  # the last durable checkpoint and the one now written
        t0 += time.perf_counter() - t  # the benchmark's disk keeping is not DCP's cost
        if self._spent():
            with contextlib.suppress(Exception):
                self.stager.close()  # its thread pool; torch already closed the rest
            self.stager = self.new_stager()
            self.fresh_stagers += 1
        msd, osd = get_state_dict(self.model, self.opt)
        path = self.path(step)
        self.paths.append(path)
        writer = dcp.FileSystemWriter(str(path), thread_count=1, sync_files=True)
        self.resp = dcp.async_save(
            {"model": msd, "optim": osd, "step": step},
            storage_writer=writer,
            async_stager=self.stager,
            async_checkpointer_type=AsyncCheckpointerType.THREAD,
            no_dist=True,
        )
        rec: Result = {"step": step, "stall_s": time.perf_counter() - t0, "prev_wait_s": waited}
        for key, fut in (
            ("staged_s", self.resp.staging_completion),
            ("durable_s", self.resp.upload_completion),
        ):
            fut.add_done_callback(
                lambda _f, key=key, rec=rec: rec.__setitem__(key, time.perf_counter() - t0)
            )
        self.records.append(rec)
        self.staging = self.resp.staging_completion

    def _spent(self) -> bool:
        """Whether the reused stager is spent: torch 2.11's ``DefaultStager`` closes its
        ``StateDictStager`` after each staging, emptying the table it copies with, and its
        next use fails with ``KeyError: <class 'type'>`` (pytorch/pytorch#183413; seen on
        the GPU machine's torch 2.11). Such a torch gets a fresh stager, and so fresh
        pinned buffers, per snapshot: what its async_save does; later ones keep theirs."""
        inner = getattr(self.stager, "_state_dict_stager", None)
        return inner is not None and not getattr(inner, "_deepcopy_dispatch", None)

    def before_update(self) -> None:
        if self.staging is not None:
            self.staging.result()  # DCP's copy must be done before the weights change
            self.staging = None

    def busy(self) -> bool:
        return self.resp is not None and not self.resp.upload_completion.done()

    def finish(self) -> None:
        if self.resp is not None:
            self.resp.upload_completion.result()
        self._prune(keep=1)

    def _prune(self, keep: int) -> None:
        """Delete all but the last ``keep`` checkpoints (the store keeps its last one)."""
        for p in self.paths[:-keep]:
            shutil.rmtree(p, ignore_errors=True)
        self.paths = self.paths[-keep:]

    def verify(self, fresh: Callable[[], tuple[Any, Any]], expected: Result) -> bool:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model, opt = fresh()
        msd, osd = get_state_dict(model, opt)  # initialises AdamW's state, as DCP needs
        sd = {"model": msd, "optim": osd, "step": -1}
        dcp.load(sd, checkpoint_id=str(self.path(expected["step"])), no_dist=True)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        return sd["step"] == expected["step"] and same_state(model, opt, expected)

    def close(self) -> None:
        self.stager.close()


# -- the bit-exact check ----------------------------------------------------------------------
def copy_state(model: Any, opt: Any, step: int) -> Result:
    """A copy of the model's and optimizer's state (on the CPU)."""
    return {
        "step": step,
        "model": {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()},
        "optim": copy.deepcopy(
            {
                "state": {
                    i: {
                        k: v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v
                        for k, v in s.items()
                    }
                    for i, s in opt.state_dict()["state"].items()
                },
                "param_groups": opt.state_dict()["param_groups"],
            }
        ),
    }


def same_state(model: Any, opt: Any, expected: Result) -> bool:
    """Whether the model's and optimizer's state equal ``expected``'s, bit for bit."""

    def same(a: Any, b: Any) -> bool:
        if torch.is_tensor(a) or torch.is_tensor(b):
            if not (torch.is_tensor(a) and torch.is_tensor(b)):
                return False
            a, b = a.detach().cpu(), b.detach().cpu()
            return (
                a.dtype == b.dtype
                and a.shape == b.shape
                and torch.equal(
                    a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8) if b.dim() else b
                )
            )
        if isinstance(a, dict):
            return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, list | tuple):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
        return a == b

    got = copy_state(model, opt, expected["step"])
    return same(got["model"], expected["model"]) and same(got["optim"], expected["optim"])


# -- the run ----------------------------------------------------------------------------------
def run_segment(
    mode: Mode,
    model: Any,
    opt: Any,
    data: gpt.Tokens,
    args: argparse.Namespace,
    counter: list[int],
    keep_copy: bool,
) -> tuple[Result, Result | None]:
    """``args.warmup`` untimed steps, then ``args.steps`` timed ones with a snapshot after
    every ``args.every``-th (the first right after the first step, so that every snapshot
    persists while training goes on). Returns the segment's figures and, where
    ``keep_copy``, a copy of the state at the last snapshot."""
    device = data.stream.device
    cfg = model.config
    for _ in range(args.warmup):
        gpt.train_step(model, opt, *data.batch(counter[0]))
        counter[0] += 1
    sync(device)
    settle()
    steps: list[Result] = []
    mode.records = []
    expected = None
    excluded = 0.0
    last_snap = (args.steps - 1) // args.every * args.every
    snapped = False
    waits: list[float] = []  # the wait before the optimizer step, of the step under way

    def before_update() -> None:
        t = time.perf_counter()
        mode.before_update()
        waits.append(time.perf_counter() - t)

    with Others() as others:
        t_start = time.perf_counter()
        for i in range(args.steps):
            busy = mode.busy()
            waits.clear()
            t0 = time.perf_counter()
            gpt.train_step(model, opt, *data.batch(counter[0]), before_update=before_update)
            sync(device)
            t1 = time.perf_counter()
            kind = "staging" if snapped else "persist" if busy else "clean"
            steps.append({"s": t1 - t0, "update_wait_s": waits[0], "kind": kind})
            snapped = False
            if i % args.every == 0:
                if keep_copy and i == last_snap and mode.name != "none":
                    expected = copy_state(model, opt, counter[0])
                    excluded += time.perf_counter() - t1
                mode.snapshot(counter[0])
                snapped = True
            counter[0] += 1
        wall = time.perf_counter() - t_start - excluded
    mode.finish()
    for rec in mode.records:  # snapcore's handles say when each copy was staged, durable
        h = rec.pop("_handle", None)
        if h is not None:
            rec["staged_s"], rec["durable_s"] = h.stats.staged_s, h.stats.durable_s
    tokens = args.steps * cfg.batch * cfg.context
    seg = {
        "mode": mode.name,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "others": others.cores,
        "steps": steps,
        "snapshots": list(mode.records),
    }
    return seg, expected


def summarize(segments: list[Result], rounds: int) -> Result:
    """Per mode: tokens/s, ratios to the same round's baseline, step-time percentiles."""
    out: Result = {}
    base = {s["round"]: s["tokens_per_s"] for s in segments if s["mode"] == "none"}
    for mode in MODES:
        segs = [s for s in segments if s["mode"] == mode]
        if not segs:
            continue
        steps = [x for s in segs for x in s["steps"]]
        by = {k: [x["s"] for x in steps if x["kind"] == k] for k in ("clean", "staging", "persist")}
        snaps = [r for s in segs for r in s["snapshots"]]
        stalls = [r["stall_s"] for r in snaps]
        ratios = [s["tokens_per_s"] / base[s["round"]] for s in segs if s["round"] in base]
        m: Result = {
            "tokens_per_s": [s["tokens_per_s"] for s in segs],
            "tokens_per_s_median": statistics.median(s["tokens_per_s"] for s in segs),
            "ratio_vs_none": ratios,
            "ratio_vs_none_median": statistics.median(ratios) if ratios else None,
            "others_max": max(s["others"] for s in segs),
            "steps": len(steps),
            "step_p50_s": percentile([x["s"] for x in steps], 50),
            "step_p99_s": percentile([x["s"] for x in steps], 99),
            "update_wait_max_s": max(x["update_wait_s"] for x in steps),
        }
        for k, xs in by.items():
            m[f"{k}_steps"] = len(xs)
            m[f"{k}_p50_s"], m[f"{k}_p99_s"] = percentile(xs, 50), percentile(xs, 99)
        if snaps:
            m["snapshots"] = len(snaps)
            m["stall_p50_s"], m["stall_max_s"] = percentile(stalls, 50), max(stalls)
            m["prev_wait_max_s"] = max(r["prev_wait_s"] for r in snaps)
            for key in ("staged_s", "durable_s"):
                xs = [r[key] for r in snaps if r.get(key) is not None]
                m[f"{key[:-2]}_p50_s"] = percentile(xs, 50)
        out[mode] = m
    # snapcore against DCP, round by round
    sc = {s["round"]: s["tokens_per_s"] for s in segments if s["mode"] == "snapcore"}
    dc = {s["round"]: s["tokens_per_s"] for s in segments if s["mode"] == "dcp"}
    pairs = [sc[r] / dc[r] for r in sc if r in dc]
    out["snapcore_vs_dcp"] = pairs
    out["snapcore_vs_dcp_median"] = statistics.median(pairs) if pairs else None
    return out


def check_targets(summary: Result, on_gpu: bool) -> list[Result]:
    """Issue 12's targets, judged on a GPU; on a CPU they are reported as they are."""
    targets = []
    where = "GPU" if on_gpu else "CPU (the targets are judged on the GPU)"
    for mode in ("snapcore", "snapcore_overlap"):
        r = summary.get(mode, {}).get("ratio_vs_none_median")
        if r is not None:
            targets.append(
                {
                    "target": f"{mode}: tokens/s >= 0.97 x no snapshots",
                    "ratio": r,
                    "limit": 0.97,
                    "status": "PASS" if r >= 0.97 else "FAIL",
                    "where": where,
                }
            )
    r = summary.get("snapcore_vs_dcp_median")
    if r is not None:
        targets.append(
            {
                "target": "snapcore: tokens/s > DCP async_save's",
                "ratio": r,
                "limit": 1.0,
                "status": "PASS" if r > 1.0 else "FAIL",
                "where": where,
            }
        )
    return targets


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{x * 1e3:.0f}" if x >= 0.1 else f"{x * 1e3:.1f}"


def _sec(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def render(r: Result) -> str:
    c, s = r["config"], r["summary"]
    lines = [
        f"Model: {c['model']['params'] / 1e6:.1f} M parameters ({c['state_bytes'] / 1e6:.0f} MB "
        f"of model and AdamW state), {c['model']['batch']} x {c['model']['context']} tokens per "
        f"step{' (activations recomputed)' if c['model'].get('recompute') else ''}, "
        f"device {c['device']}, {c['threads']} torch thread(s); {c['steps']} timed steps "
        f"per segment, a snapshot every {c['every']}, {c['rounds']} round(s), modes rotated."
        + (
            f" DCP's stager was made again {c['dcp_fresh_stagers']} times (torch spent it "
            "after each staging: pytorch/pytorch#183413)."
            if c.get("dcp_fresh_stagers")
            else ""
        ),
        "",
        "| mode | tokens/s | x no snapshots | step p50 / p99 ms | staging steps p50 / p99 ms "
        "| persist steps p50 / p99 ms (n) | stall p50 / max ms | durable s | restore bit-exact "
        "| others |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for mode in MODES:
        m = s.get(mode)
        if m is None:
            continue
        ratio = m["ratio_vs_none_median"]
        exact = r["restore_exact"].get(mode)
        lines.append(
            f"| {mode} | {m['tokens_per_s_median']:.0f} | "
            f"{'—' if ratio is None else f'{ratio:.3f}'} | "
            f"{_ms(m['step_p50_s'])} / {_ms(m['step_p99_s'])} | "
            f"{_ms(m['staging_p50_s'])} / {_ms(m['staging_p99_s'])} | "
            f"{_ms(m['persist_p50_s'])} / {_ms(m['persist_p99_s'])} ({m['persist_steps']}) | "
            + (
                f"{_ms(m['stall_p50_s'])} / {_ms(m['stall_max_s'])} | "
                f"{_sec(m.get('durable_p50_s'))} | "
                if "stall_p50_s" in m
                else "— | — | "
            )
            + f"{'—' if exact is None else 'yes' if exact else 'NO'} | {m['others_max']:.2f} |"
        )
    lines += [
        "",
        "tokens/s: median over rounds; x no snapshots: median over rounds of the ratio to the "
        "same round's baseline; staging steps: the step right after a snapshot call (for "
        "`none`, the same positions); persist steps: later steps that start before the "
        "previous snapshot is durable; stall: the snapshot call, the wait for the previous "
        "snapshot included; others: the most CPU (cores) other processes took in a segment.",
    ]
    base = s.get("none", {}).get("step_p50_s")
    if base:
        interval = base * c["every"]
        lines += [
            "",
            f"What a snapshot every {c['every']} steps asks: the interval is {interval:.2f} s "
            f"(the baseline's median step, {_ms(base)} ms), so the {c['state_bytes'] / 1e9:.2f}"
            f" GB state must become durable at {c['state_bytes'] / interval / 1e9:.2f} GB/s or "
            "more; a call that blocks for x s costs x / interval of the throughput.",
        ]
    lines += [
        "",
        "| target | measured | limit | status | where |",
        "| --- | ---: | ---: | --- | --- |",
    ]
    for t in r["targets"]:
        ratio, limit = f"{t['ratio']:.3f}", f"{t['limit']:.2f}"
        lines.append(f"| {t['target']} | {ratio} | {limit} | {t['status']} | {t['where']} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--size",
        choices=sorted(gpt.SIZES),
        default=None,
        help="model preset (default: gpu on CUDA, small otherwise)",
    )
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument(
        "--batch",
        type=int,
        default=None,
        help="sequences per step (default: the size's); longer steps, same state",
    )
    p.add_argument(
        "--recompute",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="recompute each block's activations in the backward (default: the size's; "
        "the gpu size does)",
    )
    p.add_argument("--steps", type=int, default=60, help="timed steps per segment")
    p.add_argument("--every", type=int, default=10, help="a snapshot every this many steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before each segment")
    p.add_argument("--rounds", type=int, default=4, help="rounds of every mode, order rotated")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {MODES}")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: the machine is shared; CPU only)",
    )
    p.add_argument("--dir", default=None, help="where to write (a fresh subdirectory)")
    p.add_argument("--json", default=None, help="write the raw figures here")
    p.add_argument("--markdown", default=None, help="write the report (markdown) here")
    p.add_argument(
        "--quiet-cores",
        type=float,
        default=0.25,
        help="before each segment, wait until other processes take less CPU",
    )
    p.add_argument("--quiet-wait", type=float, default=2.0, help="... for at most this long")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="a tiny model, 12 steps, one round, no waiting; its figures mean nothing",
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.size, args.steps, args.every, args.warmup, args.rounds = "smoke", 12, 4, 1, 1
        args.quiet_wait = 0.0
    if args.every < 1 or args.steps < 1 or (args.batch is not None and args.batch < 1):
        p.error("--steps, --every and --batch must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    common.set_quiet(args.quiet_cores, args.quiet_wait)
    warnings.filterwarnings("ignore", module="torch.distributed")
    warnings.filterwarnings("ignore", category=FutureWarning)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(modes) - set(MODES)
    if unknown:
        raise SystemExit(f"unknown modes {sorted(unknown)}; choose from {MODES}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    size = args.size or ("gpu" if device.type == "cuda" else "small")
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    cfg = gpt.SIZES[size]
    if args.batch is not None:
        cfg = dataclasses.replace(cfg, batch=args.batch)
    if args.recompute is not None:
        cfg = dataclasses.replace(cfg, recompute=args.recompute)
    command = "python benchmarks/bench_training.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )

    from bench_save import machine_info

    import snapcore

    t_total = time.perf_counter()
    with common.work_dir(args.dir, prefix="snapcore-bench-train-") as work:
        model, opt = gpt.build(cfg, device, seed=0)
        data = gpt.Tokens(cfg, device)
        counter = [0]
        gpt.train_step(model, opt, *data.batch(0))  # AdamW's state exists from here on
        counter[0] += 1
        state_bytes = sum(t.numel() * t.element_size() for t in model.parameters()) + sum(
            v.numel() * v.element_size()
            for s in opt.state.values()
            for v in s.values()
            if torch.is_tensor(v)
        )
        # At most two copies of the state per peer on disk (the last durable one and the
        # one being written): a GPU's state of 11 GB and 4 copies fill most of a 64 GB disk.
        copies = 2 * any(m.startswith("snapcore") for m in modes) + 2 * ("dcp" in modes)
        free = shutil.disk_usage(work).free
        if free < copies * state_bytes * 1.05:
            raise SystemExit(
                f"bench_training: {work} has {free / 1e9:.1f} GB free; {copies} copies of the "
                f"{state_bytes / 1e9:.1f} GB state need {copies * state_bytes * 1.05 / 1e9:.1f}"
                " GB (use --dir, --modes or a smaller --size)"
            )
        store = snapcore.Store(local=work / "snapcore", retention={"local": 1})
        impl: dict[str, Mode] = {"none": Mode()}
        impl["snapcore"] = SnapcoreMode(store, model, opt, overlap=False)
        impl["snapcore_overlap"] = SnapcoreMode(store, model, opt, overlap=True)
        impl["dcp"] = DCPMode(work, model, opt, device)

        # The first snapshot of each mode allocates its staging memory: taken untimed.
        for name in modes:
            if name != "none":
                impl[name].snapshot(counter[0])
                impl[name].finish()
                counter[0] += 1

        def fresh() -> tuple[Any, Any]:
            return gpt.build(cfg, device, seed=99)

        segments: list[Result] = []
        restore_exact: dict[str, bool] = {}
        for rnd in range(args.rounds):
            order = modes[rnd % len(modes) :] + modes[: rnd % len(modes)]
            for name in order:
                last = rnd == args.rounds - 1
                seg, expected = run_segment(
                    impl[name], model, opt, data, args, counter, keep_copy=last
                )
                seg["round"] = rnd
                segments.append(seg)
                if expected is not None:
                    restore_exact[name] = impl[name].verify(fresh, expected)
                print(
                    f"round {rnd} {name:17} {seg['tokens_per_s']:8.0f} tokens/s"
                    f"  others {seg['others']:.2f}",
                    file=sys.stderr,
                )
        for m in impl.values():
            m.close()
        snapcore.close()
        summary = summarize(segments, args.rounds)
        report: Result = {
            "command": command.strip(),
            "info": machine_info(work),
            "config": {
                "size": size,
                "model": cfg.describe(),
                "state_bytes": state_bytes,
                "device": str(device),
                "threads": torch.get_num_threads() if device.type == "cpu" else None,
                "steps": args.steps,
                "every": args.every,
                "warmup": args.warmup,
                "rounds": args.rounds,
                "modes": modes,
                "dcp_fresh_stagers": getattr(impl.get("dcp"), "fresh_stagers", 0),
            },
            "segments": segments,
            "summary": summary,
            "restore_exact": restore_exact,
            "targets": check_targets(summary, device.type == "cuda"),
        }
    report["total_s"] = time.perf_counter() - t_total
    text = render(report)
    print(text)
    print(f"total {report['total_s']:.0f}s")
    common.write_figures(args.json, report, args.markdown, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
