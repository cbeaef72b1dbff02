"""One command for every benchmark: ``python -m benchmarks`` (run from the repository root).

    python -m benchmarks list                               # the scenarios
    python -m benchmarks run --quick                        # every quick scenario, < 2 minutes
    python -m benchmarks run save scaling [--quick] [--out DIR]
    python -m benchmarks docs RESULTS_DIR [--doc docs/benchmarks.md]

A scenario runs one of the scripts of this folder (``benchmarks/NAME.py``) in a
subprocess, with its ``--json`` output: the scripts stay the one implementation of what
is measured, and the harness adds what a run needs around them. Each scenario run writes
one JSON file into ``--out`` (default ``benchmarks/results/<date>-<host>/``): the machine
(CPU, cores, memory, kernel, Python / torch / snapcore versions, git commit), the date,
the exact commands, the script's own figures (every run it made, so every spread it
reports) and a summary; and PNG plots where the scenario has some. ``docs`` rewrites the
regions of docs/benchmarks.md between ``<!-- bench:NAME:begin -->`` and
``<!-- bench:NAME:end -->`` from such a folder, and nothing else.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import re
import shlex
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DOC = REPO / "docs" / "benchmarks.md"
GB = 1e9
SCHEMA = "snapcore-bench/1"

Result = dict[str, Any]


# -- the machine ------------------------------------------------------------------------------
def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)
    except OSError:
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def machine() -> Result:
    """What a figure depends on besides the code: the machine and the versions."""
    cpu = "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    mem = 0
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        mem = next((int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemTotal")), 0)
    # The GPU machine's copy of the tree is told its commit by the caller: its .git can be
    # older than the tree it came with (seen there: the session's first commit, "dirty").
    given = os.environ.get("SNAPCORE_COMMIT", "")
    commit = given or _git("rev-parse", "HEAD")
    dirty = (
        None
        if given
        else bool(_git("status", "--porcelain", "-uno", "--", "snapcore", "csrc", "benchmarks"))
    )
    gpus = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        gpus = "; ".join(ln.split(" (UUID")[0] for ln in smi.stdout.splitlines() if ln.strip())
    return {
        "host": socket.gethostname(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_bytes": mem,
        "kernel": platform.release(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "snapcore": _version("snapcore"),
        "git_commit": commit,
        "git_dirty": dirty,
        "gpus": gpus,
    }


# -- figures ----------------------------------------------------------------------------------
def spread(values: Sequence[float]) -> Result | None:
    """A figure over several runs: its median, best (min), worst (max) and count."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def _warm(runs: list[Result]) -> list[Result]:
    return runs[1:] if len(runs) > 1 else runs


def save_peers(report: Result) -> Result:
    """bench_save's figures per peer: stall (time blocked in the call), staged and durable
    (seconds, over the warm runs), and the restore that reads that peer's checkpoint."""
    sc, ts, dc, rs = (report.get(k) or {} for k in ("snapcore", "torch_save", "dcp", "restore"))
    runs = {
        "snapcore.async_save": _warm(sc.get("async", [])),
        "snapcore.save": sc.get("save", []),
        "torch.save": ts.get("runs", []),
        "safetensors.save_file": (ts.get("safetensors") or {}).get("runs", []),
        "dcp.save": dc.get("save", []),
        "dcp.async_save thread": _warm(dc.get("async_thread", [])),
        "dcp.async_save process": _warm(dc.get("async_process", [])),
    }
    peers: Result = {}
    for name, rr in runs.items():
        if rr:
            peers[name] = {
                "stall_s": spread([x["blocked_s"] for x in rr]),
                "staged_s": spread([x.get("staged_s", x["blocked_s"]) for x in rr]),
                "durable_s": spread([x["durable_s"] for x in rr]),
            }
    restore: Result = {}
    if "snapcore_restore_runs" in rs:
        restore["snapcore.restore"] = spread([x["seconds"] for x in rs["snapcore_restore_runs"]])
    for key, name in (
        ("snapcore_restore_noverify", "snapcore.restore verify=False"),
        ("snapcore_load", "snapcore.load"),
        ("torch_load", "torch.load"),
        ("dcp_load", "dcp.load"),
        ("safetensors_load", "safetensors.load_file"),
    ):
        if key in rs:
            restore[name] = spread([rs[key]["seconds"]])
    state = next((x["state_bytes"] for x in (sc, ts, dc, rs) if "state_bytes" in x), None)
    errors = {
        k: report[k]["error"]
        for k in report
        if isinstance(report[k], dict) and "error" in report[k]
    }
    if "error" in (ts.get("safetensors") or {}):
        errors["safetensors"] = ts["safetensors"]["error"]
    return {"state_bytes": state, "peers": peers, "restore": restore, "errors": errors}


# -- plots ------------------------------------------------------------------------------------
def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _bars(ax: Any, names: list[str], figures: list[Result | None], label: str, pos: float) -> None:
    """Horizontal bars of the medians, with whiskers from the best to the worst run."""
    ys = [i + pos for i in range(len(names))]
    med = [f["median"] if f else 0.0 for f in figures]
    lo = [f["median"] - f["min"] if f else 0.0 for f in figures]
    hi = [f["max"] - f["median"] if f else 0.0 for f in figures]
    ax.barh(ys, med, height=0.38, xerr=[lo, hi], capsize=2, label=label)


def _subtitle(doc: Result) -> str:
    m = doc["machine"]
    gpus = f"{m['gpus']}, " if m.get("gpus") else ""
    return (
        f"{gpus}{m['cores']} cores ({m['cpu']}), {m['memory_bytes'] / 2**30:.0f} GiB; "
        f"torch {m['torch']}, snapcore {m['snapcore']} at {(m['git_commit'] or '?')[:9]}; "
        f"{doc['date']}"
    )


def _save_figure(
    plt: Any, fig: Any, doc: Result, out: Path, dpi: int = 110, title: str = ""
) -> list[Path]:
    """Title ``fig`` with ``title`` and the run's machine and date, write it as
    ``<out>/<scenario>.png`` and close it; returns [that path]."""
    fig.suptitle(title + _subtitle(doc), fontsize=8)
    fig.tight_layout()
    path = out / f"{doc['scenario']}.png"
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return [path]


def plot_save(doc: Result, out: Path) -> list[Path]:
    """Stall and time to durable per peer, and the restores (bars: median; whiskers:
    best to worst run)."""
    run = doc["runs"][0]
    if not run.get("result"):
        return []
    s = save_peers(run["result"])
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    names = list(s["peers"])
    _bars(a, names, [s["peers"][n]["stall_s"] for n in names], "stall (blocked in the call)", -0.2)
    _bars(a, names, [s["peers"][n]["durable_s"] for n in names], "time to durable", 0.2)
    a.set_yticks(range(len(names)), names)
    a.invert_yaxis()
    a.set_xscale("log")
    a.set_xlabel("seconds (log)")
    a.legend(loc="best", fontsize=8)
    gb = (s["state_bytes"] or 0) / GB
    a.set_title(f"save, {gb:.2f} GB state (warm runs)")
    rnames = list(s["restore"])
    _bars(b, rnames, [s["restore"][n] for n in rnames], "restore", 0.0)
    b.set_yticks(range(len(rnames)), rnames)
    b.invert_yaxis()
    b.set_xlabel("seconds")
    b.set_title("restore, page cache dropped")
    return _save_figure(plt, fig, doc, out)


SCALING_PANELS = (
    ("stall_s", "stall (blocked in the call)"),
    ("staged_s", "until the state may change (staged)"),
    ("durable_s", "time to durable"),
    ("restore_s", "restore (page cache dropped)"),
)


def plot_scaling(doc: Result, out: Path) -> list[Path]:
    """Cost against state size, log-log: stall, staged, time to durable and restore per
    peer (points: medians; bars: best to worst run)."""
    s = doc.get("summary") or {}
    if not s.get("sizes"):
        return []
    plt = _pyplot()
    from matplotlib.ticker import FuncFormatter, NullFormatter

    fig, axes = plt.subplots(1, len(SCALING_PANELS), figsize=(19, 5))
    for ax, (key, title) in zip(axes, SCALING_PANELS, strict=True):
        gbs: set[float] = set()
        for peer, series in s.get(key, {}).items():
            pts = [(x["state_gb"], x["figure"]) for x in series if x["figure"]]
            if not pts:
                continue
            xs = [p[0] for p in pts]
            gbs.update(xs)
            med = [p[1]["median"] for p in pts]
            err = [
                [p[1]["median"] - p[1]["min"] for p in pts],
                [p[1]["max"] - p[1]["median"] for p in pts],
            ]
            ax.errorbar(xs, med, yerr=err, marker="o", capsize=2, label=peer)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(sorted(gbs))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:.2g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("state size, GB (log)")
        ax.set_ylabel("seconds (log)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    return _save_figure(plt, fig, doc, out, dpi=100, title="bench_save across state sizes; ")


def plot_gpu(doc: Result, out: Path) -> list[Path]:
    """bench_gpu against state size: D2H staging and restore H2D (GB/s; best, with the
    median as a second point) beside the pinned copy probes, and overlap mode's stall."""
    r = doc["runs"][0].get("result") if doc["runs"] else None
    if not r or not r.get("sizes"):
        return []
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    gb = [x["state_bytes"] / 1e9 for x in r["sizes"]]
    f = [x["figures"] for x in r["sizes"]]
    for key, label, style in (
        ("d2h_probe_Bps", "pinned D2H (probe)", "k^--"),
        ("staging_Bps", "snapcore D2H staging", "o-"),
        ("h2d_probe_Bps", "pinned H2D (probe)", "kv:"),
        ("restore_Bps", "snapcore restore H2D", "s-"),
    ):
        a.plot(gb, [x[key] / 1e9 for x in f], style, label=label)
    a.set_xlabel("state size, GB")
    a.set_ylabel("GB/s (best run)")
    a.set_title("copies against the pinned-copy probes")
    a.legend(fontsize=7)
    a.grid(True, alpha=0.3)
    b.plot(gb, [x["blocked_s"] * 1e3 for x in f], "o-", label="overlap=True: blocked (best)")
    b.plot(gb, [x["copy_s"] * 1e3 * 0.05 for x in f], "k_--", label="5% of the D2H copy")
    b.set_xlabel("state size, GB")
    b.set_ylabel("ms")
    b.set_title("what async_save(overlap=True) blocks the training thread")
    b.legend(fontsize=7)
    b.grid(True, alpha=0.3)
    return _save_figure(plt, fig, doc, out, title="bench_gpu; ")


def plot_tiers(doc: Result, out: Path) -> list[Path]:
    """Time to durable per tier and restore per tier (bench_tiers)."""
    r = doc["runs"][0].get("result")
    if not r:
        return []
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.5))
    names = list(r["durable"])
    a.barh(names, [r["durable"][n] for n in names])
    a.invert_yaxis()
    a.set_xscale("log")
    a.set_xlabel("seconds (log)")
    a.set_title("async_save: stall, and time to durable per tier")
    rnames = list(r["restore"])
    b.barh(rnames, [r["restore"][n]["seconds"] for n in rnames])
    b.invert_yaxis()
    b.set_xscale("log")
    b.set_xlabel("seconds (log)")
    b.set_title("restore from each tier")
    return _save_figure(plt, fig, doc, out)


def plot_checkpointer(doc: Result, out: Path) -> list[Path]:
    """What Checkpointer.step() costs per call: median and worst (bench_checkpointer)."""
    r = doc["runs"][0].get("result")
    if not r:
        return []
    plt = _pyplot()
    rows = r["rows"]
    fig, ax = plt.subplots(figsize=(9, 3.2))
    names = [x["name"] for x in rows]
    ax.barh(names, [max(x["median_ns"], 1) for x in rows], label="median")
    ax.scatter([max(x["max_ns"], 1) for x in rows], names, marker="|", color="k", label="max")
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("ns per call (log)")
    ax.legend(fontsize=8)
    ax.set_title("Checkpointer.step()")
    return _save_figure(plt, fig, doc, out)


def plot_training(doc: Result, out: Path) -> list[Path]:
    """Step time over the run, per mode (bench_training): every timed step of every
    round, in the order the rounds ran them, one line per mode; staging steps (the step
    after a snapshot call) and persist steps (a snapshot not yet durable) marked."""
    r = doc["runs"][0].get("result")
    if not r or not r.get("segments"):
        return []
    plt = _pyplot()
    modes = list(dict.fromkeys(seg["mode"] for seg in r["segments"]))
    fig, axes = plt.subplots(len(modes), 1, figsize=(9, 1.6 * len(modes) + 0.6), sharex=True)
    axes = list(axes) if len(modes) > 1 else [axes]
    top = max(x["s"] for seg in r["segments"] for x in seg["steps"]) * 1e3 * 1.05
    for ax, mode in zip(axes, modes, strict=True):
        steps = [x for seg in r["segments"] if seg["mode"] == mode for x in seg["steps"]]
        ms = [x["s"] * 1e3 for x in steps]
        ax.plot(range(len(ms)), ms, lw=0.8, label=mode)
        for kind, marker in (("staging", "v"), ("persist", ".")):
            at = [i for i, x in enumerate(steps) if x.get("kind") == kind]
            if at:
                ax.scatter(at, [ms[i] for i in at], marker=marker, s=12, label=kind, zorder=3)
        ax.set_ylim(0, top)
        ax.set_ylabel("ms")
        ax.legend(fontsize=7, loc="upper right", ncol=3)
    axes[-1].set_xlabel("timed step (the rounds one after another)")
    return _save_figure(plt, fig, doc, out, title="step time over the run, per mode; ")


# -- scenarios --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Scenario:
    """One named benchmark: a script of this folder and the options of its runs."""

    name: str
    script: str  # a file of benchmarks/
    help: str
    full: tuple[str, ...] = ()  # options of a full run
    quick: tuple[str, ...] = ("--smoke",)  # options of a --quick run
    json: bool = True  # the script writes its figures with --json PATH
    markdown: bool = False  # ... and its report with --markdown PATH
    in_quick: bool = True  # part of `run --quick` without names
    timeout_s: float = 3600.0
    sweep: Callable[[bool], list[tuple[str, list[str]]]] | None = None  # several runs
    summarise: Callable[[Result], Result | None] | None = None
    plot: Callable[[Result, Path], list[Path]] | None = None

    @property
    def path(self) -> Path:
        return HERE / self.script

    def invocations(self, quick: bool) -> list[tuple[str, list[str]]]:
        if self.sweep:
            return self.sweep(quick)
        return [("", list(self.quick if quick else self.full))]


SCALING_SIZES_GB = (0.25, 0.5, 1.0, 2.0, 4.0)
SCALING_QUICK_GB = (0.01, 0.04)
# bench_save's options for each size: no machine phase (its probes do not depend on the
# state), no interleaved staging rounds; the peers and the restores as bench_save has them.
SCALING_FULL = (
    "--phases",
    "snapcore,torch_save,dcp,restore",
    "--repeats",
    "3",
    "--dcp-repeats",
    "2",
    "--duel-rounds",
    "0",
    "--quiet-wait",
    "1",
)
SCALING_QUICK = (
    "--phases",
    "snapcore,torch_save,dcp,restore",
    "--repeats",
    "1",
    "--dcp-repeats",
    "1",
    "--duel-rounds",
    "0",
    "--quiet-wait",
    "0",
)


def scaling_sweep(quick: bool) -> list[tuple[str, list[str]]]:
    sizes, opts = (SCALING_QUICK_GB, SCALING_QUICK) if quick else (SCALING_SIZES_GB, SCALING_FULL)
    return [(f"{gb:g} GB", ["--size-gb", f"{gb:g}", *opts]) for gb in sizes]


def summarise_save(doc: Result) -> Result | None:
    r = doc["runs"][0].get("result")
    return save_peers(r) if r else None


def summarise_scaling(doc: Result) -> Result:
    """Per peer, its figure at each size: stall, durable and restore (seconds)."""
    restore_of = {  # which restore reads each peer's checkpoint
        "snapcore.async_save": "snapcore.restore",
        "torch.save": "torch.load",
        "dcp.async_save thread": "dcp.load",
        "safetensors.save_file": "safetensors.load_file",
    }
    sizes: list[Result] = []
    out: Result = {"sizes": sizes, "stall_s": {}, "staged_s": {}, "durable_s": {}, "restore_s": {}}
    for run in doc["runs"]:
        if not run.get("result"):
            continue
        s = save_peers(run["result"])
        gb = (s["state_bytes"] or 0) / GB
        sizes.append(
            {"label": run["label"], "state_bytes": s["state_bytes"], "errors": s["errors"]}
        )
        for peer, fig in s["peers"].items():
            for key in ("stall_s", "staged_s", "durable_s"):
                out[key].setdefault(peer, []).append({"state_gb": gb, "figure": fig[key]})
        for name, fig in s["restore"].items():
            out["restore_s"].setdefault(name, []).append({"state_gb": gb, "figure": fig})
    out["restore_of"] = restore_of
    return out


SCENARIOS: list[Scenario] = [
    Scenario(
        "save",
        "bench_save.py",
        "save / async_save / restore against torch.save, safetensors and DCP (one size), "
        "with machine probes",
        markdown=True,
        summarise=summarise_save,
        plot=plot_save,
    ),
    Scenario(
        "scaling",
        "bench_save.py",
        f"bench_save at {', '.join(f'{x:g}' for x in SCALING_SIZES_GB)} GB: stall, durable and "
        "restore per peer against state size",
        sweep=scaling_sweep,
        summarise=summarise_scaling,
        plot=plot_scaling,
    ),
    Scenario(
        "tiers",
        "bench_tiers.py",
        "time to durable and restore per tier, codec, incremental",
        plot=plot_tiers,
    ),
    Scenario("codec", "bench_codec.py", "the chunk codecs' ratio and speed", markdown=True),
    Scenario(
        "checkpointer",
        "bench_checkpointer.py",
        "what Checkpointer.step() costs a step",
        plot=plot_checkpointer,
    ),
    Scenario(
        "distributed",
        "bench_distributed.py",
        "sharded saves and restores on 4 ranks (FSDP2) against DCP, 4 -> 2 resharding",
        markdown=True,
        in_quick=False,
    ),
    Scenario(
        "manifest",
        "bench_manifest.py",
        "parsing the largest manifest the format allows",
        in_quick=False,
    ),
    Scenario(
        "plan",
        "bench_plan.py",
        "the first sharded save's plan for simulated worlds of up to 16,384 ranks",
        markdown=True,
        in_quick=False,
    ),
    Scenario("simulate", "simulate.py", "the scheduler's waste under failure traces", json=False),
    # Written alongside this harness; listed once their scripts exist (both take --smoke,
    # --json and --markdown). Not in the quick set: their --smoke runs' length is theirs.
    Scenario(
        "training",
        "bench_training.py",
        "training throughput (tokens/s, step times) while snapshots are taken, per peer",
        markdown=True,
        in_quick=False,
        plot=plot_training,
    ),
    Scenario(
        "convert",
        "bench_convert.py",
        "snapcore convert between formats",
        markdown=True,
        in_quick=False,
    ),
    Scenario(
        "gpu",
        "bench_gpu.py",
        "the CUDA path: D2H staging, overlap mode's stall and restore H2D against pinned "
        "cudaMemcpy probes, at 4 and 16 GB; the ABI check (needs a CUDA device)",
        quick=("--sizes-gb", "1", "--repeats", "2"),
        markdown=True,
        in_quick=False,
        plot=plot_gpu,
    ),
    Scenario(
        "peer",
        "bench_peer.py",
        "the peer tier: a replaced node's fetch from its partner's memory against a "
        "loopback TCP probe, and what peer snapshots cost a training loop",
        markdown=True,
        in_quick=False,
    ),
    Scenario(
        "slowdown",
        "bench_slowdown.py",
        "the slowdown of training the Checkpointer measures while snapshots persist, "
        "against the training loop's own",
        markdown=True,
        in_quick=False,
    ),
]


def scenarios() -> dict[str, Scenario]:
    """The scenarios whose script is present."""
    return {s.name: s for s in SCENARIOS if s.path.exists()}


# -- running ----------------------------------------------------------------------------------
def _tail(text: str, n: int = 4000, head: int = 4000) -> str:
    """The end of a script's stderr, and its start where that is cut: a failure's
    traceback comes last, the progress lines (the GPU machine's only log) first."""
    if len(text) <= n + head:
        return text
    return text[:head] + "\n[...]\n" + text[-n:]


def run_scenario(
    sc: Scenario, quick: bool, out: Path, command: str, info: Result, opts: Sequence[str] = ()
) -> Result:
    """Run every invocation of ``sc`` (with ``opts`` after its own options); write
    OUT/NAME.json and its plots; return the doc."""
    started = datetime.datetime.now(datetime.UTC)
    doc: Result = {
        "schema": SCHEMA,
        "scenario": sc.name,
        "script": f"benchmarks/{sc.script}",
        "quick": quick,
        "command": command,
        "date": started.date().isoformat(),
        "started": started.isoformat(timespec="seconds"),
        "machine": info,
        "runs": [],
    }
    tmp = out / f".{sc.name}.tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    for i, (label, own) in enumerate(sc.invocations(quick)):
        args = [*own, *opts]
        raw, md = tmp / f"{i}.json", tmp / f"{i}.md"
        extra: list[str] = []
        if sc.json:
            extra += ["--json", str(raw)]
        if sc.markdown:
            extra += ["--markdown", str(md)]
        argv = [sys.executable, str(sc.path), *args, *extra]
        shown = shlex.join(["python", f"benchmarks/{sc.script}", *args])
        print(f"[{sc.name}{' ' + label if label else ''}] {shown}", flush=True)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(
                argv, cwd=REPO, capture_output=True, text=True, timeout=sc.timeout_s
            )
            rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as e:
            rc = 124
            stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
            stderr = e.stderr.decode() if isinstance(e.stderr, bytes) else e.stderr or ""
        wall = time.perf_counter() - t0
        run: Result = {"label": label, "command": shown, "returncode": rc, "wall_s": wall}
        if raw.exists():
            run["result"] = json.loads(raw.read_text())
            raw.unlink()
        else:
            run["result"] = None
            run["stdout"] = _tail(stdout, 200_000)  # no JSON: its report holds its figures
        if md.exists():
            run["markdown"] = md.read_text()
            md.unlink()
        if rc != 0:
            run["stderr_tail"] = _tail(stderr)
            print(f"[{sc.name}] FAILED rc={rc}:\n{_tail(stderr, 1500)}", flush=True)
        else:
            print(f"[{sc.name}{' ' + label if label else ''}] done in {wall:.1f} s", flush=True)
        doc["runs"].append(run)
    with contextlib.suppress(OSError):
        tmp.rmdir()
    doc["wall_s"] = time.perf_counter() - t_all
    doc["ok"] = all(r["returncode"] == 0 for r in doc["runs"])
    if sc.summarise:
        try:
            doc["summary"] = sc.summarise(doc)
        except Exception as e:  # a partial result still gets written
            doc["summary_error"] = f"{type(e).__name__}: {e}"
    doc["plots"] = []
    if sc.plot:
        try:
            doc["plots"] = [p.name for p in sc.plot(doc, out)]
        except Exception as e:
            doc["plot_error"] = f"{type(e).__name__}: {e}"
            print(f"[{sc.name}] no plot: {doc['plot_error']}", flush=True)
    (out / f"{sc.name}.json").write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def default_out() -> Path:
    day = datetime.date.today().isoformat()
    return HERE / "results" / f"{day}-{socket.gethostname()}"


# -- docs -------------------------------------------------------------------------------------
MARKER = re.compile(r"<!-- bench:([\w.-]+):begin -->\n(.*?)<!-- bench:\1:end -->", re.DOTALL)


def replace_marked(text: str, name: str, body: str) -> str:
    """``text`` with what lies between the markers of ``name`` replaced by ``body``, and
    every other byte unchanged. Raises ValueError where the markers are missing, unpaired
    or repeated."""
    begin, end = f"<!-- bench:{name}:begin -->", f"<!-- bench:{name}:end -->"
    if text.count(begin) != 1 or text.count(end) != 1:
        raise ValueError(f"markers of {name!r}: {text.count(begin)} begin, {text.count(end)} end")
    i, j = text.index(begin) + len(begin), text.index(end)
    if j < i:
        raise ValueError(f"markers of {name!r}: end before begin")
    return text[:i] + "\n\n" + body.strip("\n") + "\n\n" + text[j:]


def marked_names(text: str) -> list[str]:
    return [m.group(1) for m in MARKER.finditer(text)]


def _fmt(f: Result | None) -> str:
    if not f:
        return "—"
    med = f["median"]
    if f["n"] == 1:
        return f"{med:.3f}"
    return f"{med:.3f} ({f['min']:.3f}-{f['max']:.3f})"


def _row(cells: Iterable[str]) -> str:
    """A row of a Markdown table: "| a | b |" (an empty cell: "| |")."""
    return "|" + "".join(f" {c} |" if c else " |" for c in cells)


def _table(
    head: Sequence[str], rows: Iterable[Sequence[str]], align: str | Sequence[str] = "---"
) -> list[str]:
    """The lines of a Markdown table: ``head``, the alignment row (``align``: one for
    every column, or each column's), ``rows``."""
    aligns = [align] * len(head) if isinstance(align, str) else align
    return [_row(head), _row(aligns), *(_row(r) for r in rows)]


def _made_by(doc: Result) -> str:
    m = doc["machine"]
    return (
        f"Made by `{doc['command']}`, {doc['date']}; machine: {m['cores']} cores ({m['cpu']}), "
        f"{m['memory_bytes'] / 2**30:.1f} GiB RAM, Linux {m['kernel']}; Python {m['python']}, "
        f"torch {m['torch']}, snapcore {m['snapcore']} at {(m['git_commit'] or '?')[:9]}"
        + (" (with uncommitted changes)" if m.get("git_dirty") else "")
        + "."
    )


def table_save_report(doc: Result) -> str:
    """bench_save's own report, rendered by bench_save from the JSON of the run."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    import bench_save  # the script's renderer: the same text its --markdown writes

    run = doc["runs"][0]
    return bench_save.render({**run["result"], "command": run["command"]})


def table_scaling(doc: Result) -> str:
    s = doc["summary"]
    lines = [
        _made_by(doc),
        "",
        "Seconds: the median of the warm runs, best-worst in parentheses (one run: no "
        "parentheses). Stall: time blocked in the call; staged: until the state may change "
        "again; durable: until fsynced and committed; restore: from a dropped page cache.",
        "",
    ]
    for key, title in (
        ("stall_s", "stall"),
        ("staged_s", "staged"),
        ("durable_s", "durable"),
        ("restore_s", "restore"),
    ):
        peers = list(s.get(key, {}))
        if not peers:
            continue
        gbs = sorted({x["state_gb"] for p in peers for x in s[key][p]})
        rows = [
            [f"{gb:.2f}"]
            + [
                _fmt(next((x["figure"] for x in s[key][p] if x["state_gb"] == gb), None))
                for p in peers
            ]
            for gb in gbs
        ]
        lines += [*_table([f"{title}: state GB", *peers], rows, align="---:"), ""]
    return "\n".join(lines)


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def table_tiers(doc: Result) -> str:
    """bench_tiers' figures: time to durable per tier, restore per tier, the remote
    codec, the incremental snapshot."""
    r = doc["runs"][0]["result"]
    n, d, w = r["state_bytes"], r["durable"], r["written"]
    lines = [
        _made_by(doc),
        "",
        f"State: {_mb(n)} (Linear layers + Adam); a warm `async_save` (the second, both host "
        "slots faulted) to `Store(host=..., local=..., remote=s3://...)`:",
        "",
        *_table(
            ["tier", "time to durable", "written"],
            [["(stall of async_save)", f"{d['stall']:.3f} s", ""]]
            + [[t, f"{d[t]:.3f} s", _mb(w[t])] for t in ("host", "local", "remote")],
        ),
        "",
        "Restore into the live state, from each tier alone (`Store(host=...)`, "
        '`Store(local=...)`, `Store(remote=...)`; "cold" after dropping the data file\'s pages):',
        "",
        *_table(
            ["restore from", "seconds", "GB/s"],
            [
                [name, f"{x['seconds']:.3f}", f"{n / x['seconds'] / GB:.2f}"]
                for name, x in r["restore"].items()
            ],
        ),
    ]
    c = r["remote_codec"]
    lines += [
        "",
        "The remote codec, same state (local tier uncompressed):",
        "",
        *_table(
            ["remote codec", "bytes uploaded", "ratio", "time to durable (remote)"],
            [
                ["none", _mb(c["written_none"]), "1.00", f"{c['durable_remote_none']:.2f} s"],
                [
                    "shuffle-zstd",
                    _mb(c["written_shuffle_zstd"]),
                    f"{c['written_none'] / c['written_shuffle_zstd']:.2f}",
                    f"{c['durable_remote_shuffle_zstd']:.2f} s",
                ],
            ],
        ),
    ]
    i = r["incremental"]
    lines += [
        "",
        f"Incremental snapshots: the same model with 90% of its layers frozen (state "
        f"{_mb(i['state_bytes'])}; no gradient, no optimizer state), one training step "
        "between two snapshots:",
        "",
        *_table(
            ["tier", "first snapshot writes", "next snapshot writes", "shared, not rewritten"],
            [
                [t, _mb(i["full"][t]), _mb(i["incremental"][t]), _mb(i["reused"].get(t, 0))]
                for t in ("local", "remote")
            ],
        ),
    ]
    return "\n".join(lines)


def _us(ns: float) -> str:
    return f"{ns / 1000:.2f} µs" if ns < 1_000_000 else f"{ns / 1e6:.2f} ms"


def table_checkpointer(doc: Result) -> str:
    """bench_checkpointer's rows: the cost of each kind of Checkpointer.step() call."""
    rows = doc["runs"][0]["result"]["rows"]
    keys = ("median_ns", "p99_ns", "p999_ns", "max_ns")
    lines = [
        _made_by(doc),
        "",
        *_table(
            ["call", "calls", "median", "p99", "p99.9", "max"],
            [[x["name"], f"{x['calls']:,}", *(_us(x[k]) for k in keys)] for x in rows],
            align=["---", *["---:"] * 5],
        ),
    ]
    hot = next((x for x in rows if x["name"] == "step(), nothing due"), None)
    if hot:
        ok = hot["median_ns"] < 20_000 and hot["p99_ns"] < 20_000
        lines += [
            "",
            "Target: `step()` with nothing due under 20 µs (median and p99): "
            f"**{'PASS' if ok else 'FAIL'}** (median {_us(hot['median_ns'])}, "
            f"p99 {_us(hot['p99_ns'])}).",
        ]
    return "\n".join(lines)


def table_script_report(doc: Result) -> str:
    """A script's own report (its --markdown), after the harness's line on the run (its
    command, machine and date); a title the report gives itself (``# ...``) becomes a
    bold line, so that it does not break the headings of the document it goes into."""
    text = re.sub(r"^# (.+)$", r"**\1**", doc["runs"][0]["markdown"].strip("\n"), flags=re.M)
    return _made_by(doc) + "\n\n" + text


def table_manifest(doc: Result) -> str:
    """bench_manifest's runs (it prints figures only, no report of its own): the
    median and the range of each phase over the runs, each run in a fresh process."""
    r = doc["runs"][0]["result"]
    runs = r["runs"]
    figures = [
        ("manifest.parse, s", "parse_s", "{:.2f}"),
        ("json.loads with parse's duplicate-key hook, s", "json_s", "{:.2f}"),
        ("the whole compiled schema (parse no longer runs it), s", "schema_s", "{:.2f}"),
        ("peak RSS of parse over the process before it, MiB", "peak_rss_mib", "{:.0f}"),
        ("the process's peak RSS, MiB", "peak_rss_total_mib", "{:.0f}"),
    ]
    rows = []
    for name, key, fmt in figures:
        xs = [x[key] for x in runs if key in x]
        if xs:
            rows.append([name, *(fmt.format(v) for v in (statistics.median(xs), min(xs), max(xs)))])
    return "\n".join(
        [
            _made_by(doc),
            "",
            f"A manifest of {r['bytes'] / 2**20:.1f} MiB with {runs[0]['tensors']:,} tensors; "
            f"{len(runs)} runs, each phase in a fresh process:",
            "",
            *_table(["figure", "median", "min", "max"], rows, align=["---", *["---:"] * 3]),
        ]
    )


# marker name -> (scenario whose JSON it is made from, renderer)
TABLES: dict[str, tuple[str, Callable[[Result], str]]] = {
    "save-report": ("save", table_save_report),
    "scaling": ("scaling", table_scaling),
    "tiers": ("tiers", table_tiers),
    "checkpointer": ("checkpointer", table_checkpointer),
    "codec-report": ("codec", table_script_report),
    "distributed-report": ("distributed", table_script_report),
    "convert-report": ("convert", table_script_report),
    "peer-report": ("peer", table_script_report),
    "training-report": ("training", table_script_report),
    "plan-report": ("plan", table_script_report),
    "slowdown-report": ("slowdown", table_script_report),
    "gpu-report": ("gpu", table_script_report),
    "manifest-report": ("manifest", table_manifest),
}


def load_results(results: Path) -> dict[str, Result]:
    docs: dict[str, Result] = {}
    for path in sorted(results.glob("*.json")):
        with contextlib.suppress(ValueError, OSError):
            doc = json.loads(path.read_text())
            if isinstance(doc, dict) and doc.get("schema") == SCHEMA:
                docs[doc["scenario"]] = doc
    return docs


def regenerate(
    text: str, docs: dict[str, Result], allow_quick: bool = False
) -> tuple[str, list[str], list[str]]:
    """(new text, names rewritten, names kept as they were). A region is kept where the
    results have no figures for it, and, unless ``allow_quick``, where they come from a
    --quick run (whose figures mean nothing)."""
    done, kept = [], []
    for name in marked_names(text):
        scenario, render = TABLES.get(name, (None, None))
        doc = docs.get(scenario) if scenario else None
        if render is None or doc is None or not doc["runs"] or not doc["runs"][0].get("result"):
            kept.append(name)
            continue
        if doc.get("quick") and not allow_quick:
            kept.append(f"{name} (a --quick run)")
            continue
        text = replace_marked(text, name, render(doc))
        done.append(name)
    return text, done, kept


# -- command line -----------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="the scenarios")
    r = sub.add_parser("run", help="run scenarios; one JSON (and plots) per scenario")
    r.add_argument(
        "names",
        nargs="*",
        help="scenarios ('all' for every one; with --quick, none: every quick scenario)",
    )
    r.add_argument("--quick", action="store_true", help="each scenario's tiny run (--smoke)")
    r.add_argument("--out", type=Path, default=None, help="default benchmarks/results/DATE-HOST/")
    r.add_argument(
        "--opts",
        action="append",
        default=[],
        metavar="NAME=OPTIONS",
        help="more options for one scenario's script, after its own (repeatable), e.g. "
        "training='--rounds 2 --steps 40'",
    )
    d = sub.add_parser("docs", help="rewrite the marked regions of the docs from a results folder")
    d.add_argument("results", type=Path)
    d.add_argument("--doc", type=Path, default=DOC)
    d.add_argument("--allow-quick", action="store_true", help="take --quick runs' figures too")
    g = sub.add_parser("plot", help="redraw the plots of a results folder from its JSON")
    g.add_argument("results", type=Path)
    args = p.parse_args(argv)
    known = scenarios()

    if args.cmd == "list":
        for s in known.values():
            quick = "quick" if s.in_quick else "     "
            print(f"{s.name:<13} {quick}  benchmarks/{s.script:<22} {s.help}")
        missing = [s.name for s in SCENARIOS if s.name not in known]
        if missing:
            print(f"(not present: {', '.join(missing)})")
        return 0

    if args.cmd == "docs":
        docs = load_results(args.results)
        text = args.doc.read_text()
        new, done, kept = regenerate(text, docs, args.allow_quick)
        if new != text:
            args.doc.write_text(new)
        print(f"{args.doc}: rewrote {done or 'nothing'}; kept {kept or 'nothing'}")
        return 0

    if args.cmd == "plot":
        for name, doc in load_results(args.results).items():
            sc = next((s for s in SCENARIOS if s.name == name), None)
            if sc and sc.summarise:  # from the runs: the summary of this version of the code
                doc["summary"] = sc.summarise(doc)
                (args.results / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")
            if sc and sc.plot:
                for path in sc.plot(doc, args.results):
                    print(path)
        return 0

    names = args.names or ([s.name for s in known.values() if s.in_quick] if args.quick else [])
    if names == ["all"]:
        names = list(known)
    if not names:
        p.error("name scenarios to run (see `list`), or 'all', or --quick")
    unknown = [n for n in names if n not in known]
    if unknown:
        p.error(f"unknown scenarios {unknown}; `python -m benchmarks list` shows them")
    extra: dict[str, list[str]] = {}
    for item in args.opts:
        name, sep, opts = item.partition("=")
        if not sep or name not in names:
            p.error(f"--opts {item!r}: give NAME=OPTIONS for a scenario of this run")
        extra.setdefault(name, []).extend(shlex.split(opts))
    out = args.out or default_out()
    out.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python", "-m", "benchmarks", *(sys.argv[1:] if argv is None else argv)])
    info = machine()
    failed = []
    t0 = time.perf_counter()
    for name in names:
        doc = run_scenario(known[name], args.quick, out, command, info, extra.get(name, []))
        if not doc["ok"]:
            failed.append(name)
    print(f"{len(names)} scenario(s) in {time.perf_counter() - t0:.0f} s; results in {out}")
    if failed:
        print(f"FAILED: {', '.join(failed)}")
    return 1 if failed else 0
