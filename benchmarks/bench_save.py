"""First benchmark of snapcore: save, async_save and restore against torch.save, safetensors
and DCP.

One run measures the machine (memcpy into pre-faulted memory, O_DIRECT and buffered
writes, cold sequential reads) and then each method on the same ~4.4 GB state (a stack
of ``nn.Linear`` layers plus Adam's state after one step), and checks issue 2's targets
as ratios of figures taken in that run. docs/benchmarks.md explains every figure.

This machine's memory and disk bandwidths drift by 2-3x within minutes (a shared virtual
machine), so each target is checked against a probe taken right next to what it judges:
memcpy in a probe arena just before each warm save, O_DIRECT writes of state-sized files
around the saves, cold reads of the snapshot's own data file around the restores, and
DCP's staging interleaved round by round with snapcore's. Targets compare the best run
with the best probe; the table shows medians too.

Each group of methods runs in a child process of its own that builds a fresh state, so
that one method's arena, staging cache or page cache does not change another's figures,
and so that peak RSS is the child's own: ``VmHWM`` is reset (``/proc/self/clear_refs``)
before each measured call and read after it; "peak extra" is that peak minus the RSS of
the state alone, measured right after the state was built. Every element of the state
changes before each save, as in training: snapcore stores a chunk it already holds once.

    python benchmarks/bench_save.py                    # ~4.4 GB state, 6-7 minutes
    python benchmarks/bench_save.py --size-gb 0.3      # a small run, about a minute
    python benchmarks/bench_save.py --smoke            # does it run? (test_benchmarks.py)
    python benchmarks/bench_save.py --json out.json --markdown out.md

The test suite runs only its --smoke run (tests/integration/test_benchmarks.py).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import gc
import glob
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import common
from common import CLK_TCK, Others, jiffies, settle, status_bytes
from common import fmt_gb as _gb
from common import fmt_s as _s

GB = 1e9
GIB = 1 << 30
PHASES = ("machine", "snapcore", "torch_save", "dcp", "restore")
PHASE_TIMEOUT_S = 420

Result = dict[str, Any]


# -- memory accounting ------------------------------------------------------------------------
class Peak:
    """Peak RSS above a baseline (the state alone) during a ``with`` block, and the CPU
    that other processes took meanwhile; it starts once the machine is quiet."""

    def __init__(self, baseline: int) -> None:
        self.baseline = baseline
        self.extra = 0
        self.others = 0.0
        self.reset_ok = False

    def __enter__(self) -> Peak:
        gc.collect()
        settle()
        self.reset_ok = common.reset_peak()
        self._others = Others().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._others.__exit__()
        self.others = self._others.cores
        self.extra = max(0, status_bytes("VmHWM") - self.baseline)


# -- the state --------------------------------------------------------------------------------
def build_state(size_gb: float) -> tuple[Any, Any, Result]:
    """A stack of Linear layers with Adam state after one step: bytes ~ 3 x parameters."""
    import torch
    from torch import nn

    t0 = time.perf_counter()
    param_bytes = size_gb * GB / 3
    width = 4096 if param_bytes >= 4 * 4096 * 4096 * 4 else 1024
    layers = max(1, round(param_bytes / ((width * width + width) * 4)))
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.02, 0.02, generator=gen)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    # One step for each parameter in turn (Adam skips parameters without a gradient), with
    # a gradient of its own in a buffer shared per shape: no parameter-sized copies, and
    # no two chunks of the state alike (snapcore stores identical chunks once, and a
    # constant or shared gradient would make Adam's moments identical across layers).
    buffers = {shape: torch.empty(shape) for shape in {tuple(p.shape) for p in model.parameters()}}
    for p in model.parameters():
        grad = buffers[tuple(p.shape)]
        torch.mul(p.detach(), 0.05, out=grad)
        p.grad = grad
        opt.step()
        p.grad = None
    del buffers
    gc.collect()
    tensors = state_tensors(model, opt)
    info = {
        "state_bytes": sum(t.numel() * t.element_size() for t in tensors),
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "tensors": len(tensors),
        "layers": layers,
        "width": width,
        "build_s": time.perf_counter() - t0,
        "baseline_rss": status_bytes("VmRSS"),
    }
    return model, opt, info


def _files_under(root: str | Path) -> list[str]:
    return sorted(p for p in glob.glob(f"{root}/**/*", recursive=True) if os.path.isfile(p))


def _fsync_path(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def state_tensors(model: Any, opt: Any) -> list[Any]:
    import torch

    return list(model.state_dict().values()) + [
        v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)
    ]


def probe_memcpy(address: int, size: int, reps: int = 2) -> float:
    """Best bandwidth of copy_host from the first half of pre-faulted memory to the second,
    with memcpy's stores and with streaming stores (the faster of the two, so that the
    staging target is judged against the best copy this machine can do)."""
    from snapcore import _native

    half = size // 2 // _native.page_size() * _native.page_size()
    best = 0.0
    for _ in range(reps):
        for nt in (False, True):
            best = max(best, common.copy_rate(address + half, address, half, nontemporal=nt))
    return best


def probe_odirect(path: Path, address: int, size: int, total: int) -> float:
    """Bandwidth of O_DIRECT writes of ``total`` bytes, ``size`` at a time from ``address``
    (the same buffer at successive offsets), fdatasync included."""
    pieces = [(offset, address, min(size, total - offset)) for offset in range(0, total, size)]
    rate, _ = common.write_rate(path, pieces, direct=True)
    path.unlink()
    return rate


def probe_cold_read(path: str, tensors: list[Any], streams: int) -> float:
    """Cold reads of ``path`` in 64 MiB pieces into these pre-faulted tensors.

    ``streams`` pieces are in flight at once (1: one sequential stream). Overwrites the
    tensors: only for a state that is restored afterwards.
    """
    piece = 64 << 20
    jobs: list[tuple[int, int, int]] = []  # (file offset, bytes, address)
    offset, size = 0, os.path.getsize(path)
    for t in tensors:
        n = min(t.numel() * t.element_size(), size - offset)
        jobs += [(offset + s, min(piece, n - s), t.data_ptr() + s) for s in range(0, n, piece)]
        offset += max(n, 0)
    return common.cold_read_rate(path, jobs, streams=streams)[0]


# -- phase: the machine -----------------------------------------------------------------------
def phase_machine(args: argparse.Namespace, work: Path) -> Result:
    """memcpy into pre-faulted memory, O_DIRECT / buffered writes, cold sequential reads."""
    import torch

    from snapcore import _native

    size = max(64 << 20, int(min(args.probe_gb, args.size_gb) * GB) // 2 // (2 << 20) * (2 << 20))
    out: Result = {"probe_bytes": 2 * size, "threads": _native.hardware_threads()}

    t = time.perf_counter()
    src = _native.Arena(size)
    dst = _native.Arena(size)
    out["prefault_Bps"] = 2 * size / (time.perf_counter() - t)
    out["huge_pages"] = src.huge_pages

    ctypes.memset(src.address, 0x5A, size)  # content, so that nothing reads zero pages
    memcpy = [common.copy_rate(dst.address, src.address, size) for _ in range(5)]
    streaming = [common.copy_rate(dst.address, src.address, size, True) for _ in range(5)]
    out["memcpy_runs_Bps"] = memcpy
    out["memcpy_nt_runs_Bps"] = streaming
    out["memcpy_Bps"] = max(memcpy + streaming)
    views = [
        torch.frombuffer((ctypes.c_char * size).from_address(arena.address), dtype=torch.uint8)
        for arena in (src, dst)
    ]
    torch_copy = [common.rate(lambda: views[1].copy_(views[0]), size) for _ in range(3)]
    out["torch_copy_Bps"] = max(torch_copy)
    views.clear()

    path = str(work / "probe.bin")

    def write(direct: bool) -> tuple[float, bool]:
        return common.write_rate(path, [(0, src.address, size), (size, dst.address, size)], direct)

    direct_runs = []
    for _ in range(2):
        rate, is_direct = write(True)
        direct_runs.append(rate)
    out["odirect_runs_Bps"] = direct_runs
    out["odirect_Bps"] = max(direct_runs)
    out["odirect_in_use"] = is_direct
    out["buffered_fsync_Bps"], _ = write(False)

    # Cold reads of the file just written, into pre-faulted memory.
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
        out["drop_caches_allowed"] = True
    except OSError as e:
        out["drop_caches_allowed"] = False
        out["drop_caches_error"] = str(e)
    for name, threads in (("cold_read_1t_Bps", 1), ("cold_read_parallel_Bps", 0)):
        rates = []
        for _ in range(2):
            reads = [(0, size, src.address), (size, size, dst.address)]
            rate, out["drop_page_cache_ok"] = common.cold_read_rate(path, reads, threads=threads)
            rates.append(rate)
        out[name] = max(rates)
    out["cold_read_Bps"] = max(out["cold_read_1t_Bps"], out["cold_read_parallel_Bps"])
    os.unlink(path)
    src.close()
    dst.close()
    return out


# -- phase: snapcore --------------------------------------------------------------------------
def _close_engine(store: Any) -> None:
    """Close the store's engine (frees its arena) and forget it."""
    from snapcore.write.engine import close_store

    with contextlib.suppress(Exception):
        close_store(store)


def snapcore_store(work: Path) -> Any:
    """The local store every phase uses: the last 2 snapshots kept, as a run would."""
    import snapcore

    return snapcore.Store(local=work / "snapcore-store", retention={"local": 2})


def perturb(tensors: list[Any]) -> None:
    """Change every element, as a training step does, so that no chunk of the next
    snapshot equals one already stored (snapcore stores identical chunks once). A product
    keeps distinct values distinct, where a sum could round tiny ones to one value."""
    import torch

    with torch.no_grad():
        torch._foreach_mul_(tensors, 1.0 + 2.0**-10)


def fingerprint(tensors: list[Any]) -> list[float]:
    """Sums of two tensors past the first 4-byte step tensor (where the read probes of the
    restore phase land shifted)."""
    return [float(t.double().sum()) for t in (tensors[len(tensors) // 2], tensors[-1])]


def phase_snapcore(args: argparse.Namespace, work: Path) -> Result:
    """async_save (first = cold arena, then warm) and the blocking save, to one store.

    Around the warm saves, with a probe arena of its own (up to 2 GiB, allocated before
    the baseline RSS is taken): memcpy inside it, a bare copy_host of the state's tensors
    into it (what staging costs without snapcore's bookkeeping) and O_DIRECT writes of
    state-sized files from it, so that each target has a probe taken next to it.
    """
    import snapcore
    from snapcore import _native

    model, opt, info = build_state(args.size_gb)
    state = {"model": model, "optim": opt}
    tensors = state_tensors(model, opt)
    page = _native.page_size()
    probe_arena = _native.Arena(max(page, min(2 * GIB, info["state_bytes"]) // page * page))
    ctypes.memset(probe_arena.address, 0x5A, probe_arena.size)
    gc.collect()
    info["baseline_rss"] = status_bytes("VmRSS")  # the state and the probe arena
    store = snapcore_store(work)
    probe_file = work / "odirect-probe.bin"
    runs: list[Result] = []
    odirect: list[float] = []
    step = 0

    def bare_copy() -> float:
        copies, offset = [], 0
        for t in tensors:
            n = t.numel() * t.element_size()
            if offset + n > probe_arena.size:
                offset = 0  # wrap around: the arena is larger than any cache
            copies.append((probe_arena.address + offset, t.data_ptr(), min(n, probe_arena.size)))
            offset += -(-n // 64) * 64
        # the stores snapcore stages with
        return common.timed(lambda: _native.copy_host(copies, 0, nontemporal=True)).wall_s

    def odirect_probe() -> None:
        odirect.append(
            probe_odirect(probe_file, probe_arena.address, probe_arena.size, info["state_bytes"])
        )

    for i in range(1 + args.repeats):
        step += 1
        probe: Result = {}
        if i > 0:
            probe["memcpy_Bps"] = probe_memcpy(probe_arena.address, probe_arena.size)
        if i == 1:  # around the warm saves
            odirect_probe()
        perturb(tensors)
        # The previous snapshot's housekeeping (retention deletes its oldest file on the
        # persist thread after the commit, ~0.6 s for 4.4 GB here) must not be timed as this
        # save's staging: with minutes between saves it is long done in a training run.
        t0 = time.perf_counter()
        snapcore.wait_all(store)
        probe["housekeeping_wait_s"] = time.perf_counter() - t0
        with Peak(info["baseline_rss"]) as peak:
            t0 = time.perf_counter()
            h = snapcore.async_save(state, store, step=step)
            blocked = time.perf_counter() - t0
            stats = h.wait()
            durable = time.perf_counter() - t0
        if i > 0:
            probe["bare_copy_s"] = bare_copy()
        if i == args.repeats:
            odirect_probe()
        runs.append(
            {
                "step": step,
                "blocked_s": blocked,
                "staged_s": stats.staged_s,
                "durable_s": durable,
                "write_s": durable - stats.staged_s,
                "peak_extra": peak.extra,
                "others": peak.others,
                "o_direct": stats.o_direct,
                "written": stats.written.get("local"),
                "reused": stats.reused.get("local"),
                **probe,
            }
        )
    blocking: list[Result] = []
    for _ in range(2):
        step += 1
        perturb(tensors)
        snapcore.wait_all(store)
        with Peak(info["baseline_rss"]) as peak:
            t0 = time.perf_counter()
            stats = snapcore.save(state, store, step=step)
            durable = time.perf_counter() - t0
        blocking.append(
            {
                "step": step,
                "blocked_s": durable,
                "staged_s": stats.staged_s,
                "durable_s": durable,
                "peak_extra": peak.extra,
                "others": peak.others,
            }
        )

    # Staging, interleaved: snapcore's async_save, DCP's DefaultStager as async_save uses
    # it (staging thread, cache reused) and a bare copy_host, round after round, so that
    # all three see the same memory bandwidth; who goes first alternates. Peak RSS is not
    # taken here: DCP's cache is alive too.
    duel: list[Result] = []
    if args.duel_rounds:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        stager = DefaultStager(StagingOptions(False, False, True, False))

        def dcp_stage() -> None:
            staged = stager.stage({"model": model.state_dict(), "optim": opt.state_dict()})
            assert isinstance(staged, Future)  # use_async_staging=True
            staged.result()

        dcp_stage()  # allocates its copy

        def timed_dcp_stage() -> float:
            return common.timed(dcp_stage).wall_s

        for i in range(args.duel_rounds):
            step += 1
            perturb(tensors)
            dcp_s = timed_dcp_stage() if i % 2 else 0.0
            snapcore.wait_all(store)  # the previous snapshot's retention, as above
            settle()
            snap = snapcore.async_save(state, store, step=step).wait().staged_s
            dcp_s = dcp_s or timed_dcp_stage()
            duel.append({"snapcore_s": snap, "dcp_s": dcp_s, "bare_copy_s": bare_copy()})
        stager.close()
        del stager
        gc.collect()
    _close_engine(store)
    probe_arena.close()
    return {
        **info,
        "async": runs,
        "save": blocking,
        "duel": duel,
        "odirect_Bps": odirect,
        "kept_step": step,
        "kept_fingerprint": fingerprint(tensors),  # what the restore phase must get back
    }


# -- phase: torch.save ------------------------------------------------------------------------
def phase_torch_save(args: argparse.Namespace, work: Path) -> Result:
    import torch

    model, opt, info = build_state(args.size_gb)
    tensors = state_tensors(model, opt)
    path = work / "torch-save.pt"

    def save() -> None:
        with open(path, "wb") as f:
            torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())

    runs = _blocking_runs(save, path, tensors, info)
    out = {**info, "runs": runs, "file": str(path), "file_bytes": path.stat().st_size}
    out["safetensors"] = _safetensors_runs(model, opt, tensors, info, work)
    return out


def flat_tensors(model: Any, opt: Any) -> dict[str, Any]:
    """The state as safetensors takes it: one flat dict of tensors, no shared storage
    (the model's parameters and Adam's per-parameter state, by name)."""
    import torch

    out = {f"model.{k}": v for k, v in model.state_dict().items()}
    for i, st in enumerate(opt.state.values()):
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"optim.{i}.{k}"] = v
    return out


def _safetensors_runs(model: Any, opt: Any, tensors: list[Any], info: Result, work: Path) -> Result:
    """safetensors.torch.save_file of the same state in the same process, made durable as
    torch.save is (fsync of the file before the clock stops); twice. A missing library is
    reported, not fatal: the other peers' figures stand."""
    try:
        from safetensors.torch import save_file
    except ImportError as e:
        return {"error": f"safetensors is not installed ({e})"}
    path = work / "state.safetensors"

    def save() -> None:
        save_file(flat_tensors(model, opt), str(path))
        _fsync_path(path)

    runs = _blocking_runs(save, path, tensors, info)
    return {"runs": runs, "file": str(path), "file_bytes": path.stat().st_size}


def _blocking_runs(
    save: Callable[[], None], path: Path, tensors: list[Any], info: Result
) -> list[Result]:
    """Two timed runs of a peer whose call returns once its file is durable (``save``
    writes and fsyncs ``path``): the state changed before each, the old file removed
    first and its pages dropped after (no cached pages left for the next measurement)."""
    runs: list[Result] = []
    for i in range(2):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        perturb(tensors)
        with Peak(info["baseline_rss"]) as peak:
            t0 = time.perf_counter()
            save()
            durable = time.perf_counter() - t0
        runs.append(
            {
                "run": i,
                "blocked_s": durable,
                "durable_s": durable,
                "peak_extra": peak.extra,
                "others": peak.others,
            }
        )
        common.drop_page_cache([str(path)])
    return runs


# -- phase: DCP -------------------------------------------------------------------------------
def _dcp_state(model: Any, opt: Any) -> dict[str, Any]:
    return {"model": model, "optim": opt}  # Stateful: DCP calls state_dict() in the call


def phase_dcp(args: argparse.Namespace, work: Path) -> Result:
    """dcp.save, then async_save with a reused DefaultStager in thread and process modes."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    warnings.filterwarnings("ignore", module="torch.distributed")
    model, opt, info = build_state(args.size_gb)
    state = _dcp_state(model, opt)
    out: Result = dict(info)

    def writer(path: Path) -> Any:
        return dcp.FileSystemWriter(str(path), thread_count=args.dcp_io_threads)

    # The blocking save; its checkpoint is kept for the restore phase.
    path = work / "dcp-ckpt"
    with Peak(info["baseline_rss"]) as peak:
        t0 = time.perf_counter()
        dcp.save(state, storage_writer=writer(path), no_dist=True)
        durable = time.perf_counter() - t0
    out["save"] = [
        {
            "blocked_s": durable,
            "durable_s": durable,
            "peak_extra": peak.extra,
            "others": peak.others,
        }
    ]
    common.drop_page_cache(_files_under(path))

    def async_runs(kind: Any, options: Any, extra: dict[str, Any]) -> list[Result]:
        # CPU only: pinned memory and non-blocking copies need an accelerator.
        stager = DefaultStager(options)
        results = []
        try:
            for i in range(1 + args.dcp_repeats):
                path = work / f"dcp-async-{i}"
                with Peak(info["baseline_rss"]) as peak:
                    t0 = time.perf_counter()
                    resp = dcp.async_save(
                        state,
                        storage_writer=writer(path),
                        async_stager=stager,
                        async_checkpointer_type=kind,
                        **extra,
                    )
                    blocked = time.perf_counter() - t0
                    resp.staging_completion.result()
                    staged = time.perf_counter() - t0
                    resp.upload_completion.result()
                    durable = time.perf_counter() - t0
                results.append(
                    {
                        "run": i,
                        "blocked_s": blocked,
                        "staged_s": staged,
                        "durable_s": durable,
                        "peak_extra": peak.extra,
                        "others": peak.others,
                    }
                )
                common.drop_page_cache(_files_under(path))
                shutil.rmtree(path, ignore_errors=True)
        finally:
            stager.close()
            del stager
            gc.collect()
        return results

    out["async_thread"] = async_runs(
        AsyncCheckpointerType.THREAD,
        StagingOptions(
            use_pinned_memory=False,
            use_shared_memory=False,
            use_async_staging=True,
            use_non_blocking_copy=False,
        ),
        {"no_dist": True},
    )
    # Process mode needs a process group (it forwards the rendezvous to its daemon):
    # a one-rank gloo group. Shared memory lets the daemon map the staged copy, where
    # private memory would be copied into shared memory on every save.
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{common.free_port()}", rank=0, world_size=1
        )
        out["async_process"] = async_runs(
            AsyncCheckpointerType.PROCESS,
            StagingOptions(
                use_pinned_memory=False,
                use_shared_memory=True,
                use_async_staging=True,
                use_non_blocking_copy=False,
            ),
            {},
        )
        out["async_process_daemon_hwm"] = _daemon_hwm()
    except Exception as e:  # the table says why instead of losing the other figures
        out["async_process_error"] = f"{type(e).__name__}: {e}"
    return out


def _daemon_hwm() -> int | None:
    from torch.distributed.checkpoint import _async_process_executor as ape

    proc = ape._CHECKPOINT_PROCESS
    if proc is None:
        return None
    try:
        return status_bytes("VmHWM", proc._save_process.pid)
    except (OSError, RuntimeError):
        return None


# -- phase: restore ---------------------------------------------------------------------------
def phase_restore(args: argparse.Namespace, work: Path) -> Result:
    """snapcore.restore / load, torch.load and dcp.load, each from a cold page cache.

    The restores are judged against cold reads of the snapshot's own data file into the
    state's tensors, before, between and after them: the virtual disk's cache on the host
    makes a file that was just written or read faster than an old one, so the probes read
    the very file the restores read, in the same conditions.
    """
    import torch
    import torch.distributed.checkpoint as dcp

    import snapcore

    warnings.filterwarnings("ignore", module="torch.distributed")
    model, opt, info = build_state(args.size_gb)
    state = {"model": model, "optim": opt}
    tensors = state_tensors(model, opt)
    store = snapcore_store(work)
    root = Path(store.local)
    torch_file = work / "torch-save.pt"
    dcp_dir = work / "dcp-ckpt"
    saved = work / "snapcore.json"
    # Phases run alone (--phases restore) write what they need first.
    if saved.exists() and snapcore.committed(store).get("local"):
        expected = json.loads(saved.read_text())["kept_fingerprint"]
    else:
        snapcore.save(state, store, step=1)
        _close_engine(store)
        expected = fingerprint(tensors)
    if not torch_file.exists():
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, torch_file)
        _fsync_path(torch_file)
    if not (dcp_dir / ".metadata").exists():
        dcp.save(_dcp_state(model, opt), checkpoint_id=str(dcp_dir), no_dist=True)
    st_file = work / "state.safetensors"
    try:
        from safetensors.torch import load_file, save_file
    except ImportError:
        load_file = None
    if load_file is not None and not st_file.exists():
        save_file(flat_tensors(model, opt), str(st_file))
        _fsync_path(st_file)
    out: Result = dict(info)

    def measure(name: str, files: list[str], fn: Callable[[], object]) -> None:
        dropped = common.drop_page_cache(files)
        with Peak(info["baseline_rss"]) as peak:
            t0 = time.perf_counter()
            result = fn()
            seconds = time.perf_counter() - t0
        del result
        gc.collect()
        out[name] = {
            "seconds": seconds,
            "Bps": info["state_bytes"] / seconds,
            "peak_extra": peak.extra,
            "others": peak.others,
            "page_cache_dropped": dropped,
        }

    # Every data file is dropped from the page cache; the newest one is read by the probes.
    sc_files = sorted(glob.glob(f"{root}/**/*.bin", recursive=True))
    newest = max(sc_files, key=os.path.getmtime)
    # Restores alternate with probes of the same file: the disk's cache on the host side
    # speeds up a file that was just read, so each restore has a probe on either side.
    cold: list[Result] = []
    restores: list[Result] = []
    for streams in (1, 4, 1):
        cold.append({"streams": streams, "Bps": probe_cold_read(newest, tensors, streams)})
        measure("snapcore_restore", sc_files, lambda: snapcore.restore(state, store))
        restores.append(out["snapcore_restore"])
        restores[-1]["state_matches"] = fingerprint(tensors) == expected
    cold.append({"streams": 4, "Bps": probe_cold_read(newest, tensors, 4)})
    out["cold_read"] = cold
    out["snapcore_restore_runs"] = restores
    out["snapcore_restore"] = min(restores, key=lambda x: x["seconds"])
    out["snapcore_restore"]["state_matches"] = all(x["state_matches"] for x in restores)
    measure(
        "snapcore_restore_noverify", sc_files, lambda: snapcore.restore(state, store, verify=False)
    )
    measure("snapcore_load", sc_files, lambda: snapcore.load(store))
    measure(
        "torch_load",
        [str(torch_file)],
        lambda: torch.load(torch_file, mmap=False, weights_only=True),
    )

    def dcp_load() -> None:
        # The state dicts' tensors share storage with the live ones: loading in place
        # fills the model and the optimizer, as snapcore.restore does.
        sd = {"model": model.state_dict(), "optim": opt.state_dict()}
        dcp.load(sd, checkpoint_id=str(dcp_dir), no_dist=True)

    measure("dcp_load", _files_under(dcp_dir), dcp_load)
    if load_file is not None:  # new tensors, as torch.load
        measure("safetensors_load", [str(st_file)], lambda: load_file(str(st_file)))
    else:
        out["safetensors_load_error"] = "safetensors is not installed"
    return out


PHASE_FUNCS: dict[str, Callable[[argparse.Namespace, Path], Result]] = {
    "machine": phase_machine,
    "snapcore": phase_snapcore,
    "torch_save": phase_torch_save,
    "dcp": phase_dcp,
    "restore": phase_restore,
}


# -- the parent: runs the phases, checks the targets, writes the report -------------------------
def run_phases(names: list[str], args: argparse.Namespace, work: Path) -> dict[str, Result]:
    """Each phase in a fresh child process; with --smoke, all of them in one child (a
    process's start, torch's import, costs more than a smoke phase), whose wall time and
    others' CPU every phase then reports."""
    if not args.smoke:
        return {name: run_phase(name, args, work) for name in names}
    done = run_phase(",".join(names), args, work)
    if "error" in done:
        return {name: done for name in names}
    out = {name: json.loads((work / f"{name}.json").read_text()) for name in names}
    for res in out.values():
        res["wall_s"], res["others_cores"] = done["wall_s"], done["others_cores"]
    return out


def run_phase(name: str, args: argparse.Namespace, work: Path) -> Result:
    """Run phase ``name`` (or the phases "a,b,...", one after another) in a child."""
    tag = name.replace(",", "+")
    out_file = work / f"{name.split(',')[-1]}.json"
    log_file = work / f"{tag}.log"
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--phase",
        name,
        "--dir",
        str(work),
        "--size-gb",
        str(args.size_gb),
        "--probe-gb",
        str(args.probe_gb),
        "--repeats",
        str(args.repeats),
        "--dcp-io-threads",
        str(args.dcp_io_threads),
        "--dcp-repeats",
        str(args.dcp_repeats),
        "--duel-rounds",
        str(args.duel_rounds),
        "--quiet-cores",
        str(args.quiet_cores),
        "--quiet-wait",
        str(args.quiet_wait),
    ]
    t0 = time.perf_counter()
    print(f"[{tag}] running ...", flush=True)
    busy0, children0 = jiffies()[0], _children_cpu()
    with open(log_file, "w") as log:
        try:
            rc = subprocess.run(
                cmd, stdout=log, stderr=subprocess.STDOUT, timeout=PHASE_TIMEOUT_S
            ).returncode
        except subprocess.TimeoutExpired:
            rc = -1
    wall = time.perf_counter() - t0
    busy = (jiffies()[0] - busy0) / CLK_TCK
    others = max(0.0, busy - (_children_cpu() - children0)) / wall
    if rc != 0 or not out_file.exists():
        tail = log_file.read_text(errors="replace")[-2000:]
        print(f"[{tag}] FAILED (rc={rc}) after {wall:.1f}s:\n{tail}", flush=True)
        return {"error": f"phase exited with {rc}", "log_tail": tail, "wall_s": wall}
    result = json.loads(out_file.read_text())
    result["wall_s"] = wall
    result["others_cores"] = others
    print(f"[{tag}] done in {wall:.1f}s", flush=True)
    return result


def _children_cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _median(runs: list[Result], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _best(runs: list[Result], key: str) -> float:
    return min(r[key] for r in runs)


def _warm(runs: list[Result]) -> list[Result]:
    return runs[1:] if len(runs) > 1 else runs


def adjacent(r: Result) -> Result:
    """The probes taken next to the measurements, with the machine phase as a fallback."""
    m, sc, rs = r.get("machine", {}), r.get("snapcore", {}), r.get("restore", {})
    warm = _warm(sc.get("async", []))
    memcpy = [x["memcpy_Bps"] for x in warm if "memcpy_Bps" in x]
    return {
        "memcpy_Bps": max(memcpy) if memcpy else m.get("memcpy_Bps"),
        "odirect_Bps": max(sc["odirect_Bps"]) if sc.get("odirect_Bps") else m.get("odirect_Bps"),
        "cold_read_Bps": max(x["Bps"] for x in rs["cold_read"])
        if rs.get("cold_read")
        else m.get("cold_read_Bps"),
    }


def check_targets(r: Result) -> list[Result]:
    """Issue 2's targets as ratios of figures from this run.

    Best of the runs on both sides (the shortest time, the highest probe bandwidth): on
    this machine bandwidth drifts by 3x between consecutive seconds, and the best run is
    the one that other tenants disturbed least. Medians are in the table.
    """
    m, sc, ts, dc, rs = (r.get(k, {}) for k in PHASES)
    near = adjacent(r)
    targets: list[Result] = []

    def add(name: str, value: float | None, limit: float | None, text: str, le: bool) -> None:
        if value is None or limit is None:
            targets.append({"target": name, "status": "N/A", "detail": text or "missing figures"})
            return
        ok = value <= limit if le else value >= limit
        targets.append(
            {
                "target": name,
                "status": "PASS" if ok else "FAIL",
                "value": value,
                "limit": limit,
                "ratio": value / limit if limit else float("inf"),
                "detail": text,
            }
        )

    state = sc.get("state_bytes")
    warm = _warm(sc.get("async", []))
    duel = sc.get("duel", [])
    staging = [x["staged_s"] for x in warm] + [x["snapcore_s"] for x in duel]
    staged = min(staging) if staging else None
    durable = _best(warm, "durable_s") if warm else None

    memcpy = near["memcpy_Bps"]
    ideal = state / memcpy if state and memcpy else None
    add(
        "staging <= 1.2 x state/memcpy",
        staged,
        1.2 * ideal if ideal else None,
        f"best warm staging {_s(staged)} s (async_save runs and interleaved rounds); "
        f"state/memcpy = {_s(ideal)} s at {_gb(memcpy)} GB/s, the best copy inside the "
        "probe arena just before a warm save (memcpy or streaming stores)"
        + (
            f" (machine phase: {_gb(m['memcpy_Bps'])} GB/s)"
            if m.get("memcpy_Bps") and ideal
            else ""
        ),
        le=True,
    )
    dcp_staged = [
        _best(_warm(dc[k]), "staged_s") for k in ("async_thread", "async_process") if k in dc
    ]
    phase_text = (
        f"; in the DCP phase (another time, so other bandwidth) its best warm staging took "
        f"{_s(min(dcp_staged))} s"
        if dcp_staged
        else ""
    )
    if duel:  # interleaved with snapcore's: the fair comparison
        add(
            "staging <= DCP staging",
            min(x["snapcore_s"] for x in duel),
            min(x["dcp_s"] for x in duel),
            f"best of {len(duel)} interleaved rounds of snapcore's staging and DCP's "
            f"DefaultStager{phase_text}",
            le=True,
        )
    else:
        add(
            "staging <= DCP staging",
            staged,
            min(dcp_staged) if dcp_staged else None,
            "DCP's best warm staging (either mode)" if dcp_staged else "",
            le=True,
        )
    odirect = near["odirect_Bps"]
    add(
        "durable >= 0.8 x O_DIRECT",
        state / durable if state and durable else None,
        0.8 * odirect if odirect else None,
        f"best warm save {_s(durable)} s; the best O_DIRECT write of a state-sized file next "
        f"to the saves: {_gb(odirect)} GB/s"
        + (f" (machine phase: {_gb(m['odirect_Bps'])} GB/s)" if m.get("odirect_Bps") else ""),
        le=False,
    )
    torch_durable = min(x["durable_s"] for x in ts["runs"]) if "runs" in ts else None
    add(
        "durable 2x faster than torch.save+fsync",
        durable,
        torch_durable / 2 if torch_durable else None,
        f"torch.save+fsync's best run: {torch_durable:.2f} s" if torch_durable else "",
        le=True,
    )
    dcp_durable = [
        _best(_warm(dc[k]), "durable_s") for k in ("async_thread", "async_process") if k in dc
    ]
    best_dcp = min(dcp_durable) if dcp_durable else None
    add(
        "durable 2x faster than DCP async_save",
        durable,
        best_dcp / 2 if best_dcp else None,
        f"DCP async_save's best warm run (either mode): {best_dcp:.2f} s" if best_dcp else "",
        le=True,
    )
    restore = rs.get("snapcore_restore")
    cold = near["cold_read_Bps"]
    add(
        "restore >= 0.8 x cold read",
        restore["Bps"] if restore else None,
        0.8 * cold if cold else None,
        f"best restore {_s(restore['seconds'] if restore else None)} s; the best cold read of "
        f"the same data file: {_gb(cold)} GB/s"
        + (f" (machine phase: {_gb(m['cold_read_Bps'])} GB/s)" if m.get("cold_read_Bps") else ""),
        le=False,
    )
    peaks = [x["peak_extra"] for x in sc.get("async", []) + sc.get("save", [])]
    add(
        "peak extra memory <= 1.1 x state",
        max(peaks) if peaks else None,
        1.1 * state if state else None,
        "the largest over all snapcore saves" if peaks else "",
        le=True,
    )
    return targets


def machine_info(work: Path) -> Result:
    def run(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return ""

    cpu = common.cpu_model("")
    mem = 0
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        mem = next((int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemTotal")), 0)
    df = run(["df", "-T", str(work)]).splitlines()
    fs = df[1].split()[1] if len(df) > 1 else "?"
    import torch

    import snapcore

    # The commit of the snapcore that is measured (wherever it is imported from), and
    # whether its sources differ from that commit.
    src = str(Path(snapcore.__file__).resolve().parent.parent)
    commit = run(["git", "-C", src, "rev-parse", "--short", "HEAD"]).strip()
    changed = ["git", "-C", src, "status", "--porcelain", "-uno", "--", "snapcore", "csrc"]
    if commit and run(changed).strip():
        commit += " with uncommitted changes"

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ram_bytes": mem,
        "kernel": platform.release(),
        "fs": fs,
        "dir": str(work),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "commit": commit,
        "snapcore_dir": src,
        "date": datetime.date.today().isoformat(),
    }


def render(r: Result) -> str:
    info, m = r["info"], r.get("machine", {})
    sc, ts, dc, rs = (r.get(k, {}) for k in PHASES[1:])
    built = next((x for x in (sc, ts, dc, rs) if "state_bytes" in x), {})
    state = built.get("state_bytes", 0)
    lines = [
        f"Command: `{r['command']}` ({r['total_s']:.0f} s in all)",
        "",
        f"Machine: {info['cores']} cores ({info['cpu']}), {info['ram_bytes'] / GIB:.1f} GiB RAM, "
        f"Linux {info['kernel']}, store on {info['fs']} (`{info['dir']}`); Python "
        f"{info['python']}, torch {info['torch']}, snapcore at {info['commit'] or '?'}; "
        f"{info['date']}.",
        "",
        "Other processes' CPU during each phase (average cores of 2): "
        + ", ".join(
            f"{name} {r[name]['others_cores']:.2f}"
            for name in PHASES
            if "others_cores" in r.get(name, {})
        )
        + ".",
        "",
    ]
    if state:
        lines += [
            f"State: {state / GB:.2f} GB in {built['tensors']} tensors: {built['layers']} x "
            f"Linear({built['width']}, {built['width']}) = {built['param_bytes'] / GB:.2f} GB "
            f"of fp32 parameters, and Adam's exp_avg, exp_avg_sq and step after one step.",
            "",
        ]
    if m and "error" not in m:
        lines += [
            "| machine phase | GB/s |",
            "| --- | --- |",
            f"| memcpy into pre-faulted memory (copy_host, {m['probe_bytes'] / 2 / GB:.1f} GB, "
            f"best of 5) | {_gb(max(m['memcpy_runs_Bps']))} |",
            "| the same with streaming stores (copy_host(nontemporal=True), best of 5) | "
            f"{_gb(max(m.get('memcpy_nt_runs_Bps') or [0.0]))} |",
            f"| torch `copy_` between the same buffers | {_gb(m['torch_copy_Bps'])} |",
            f"| memory touched for the first time (arena prefault) | {_gb(m['prefault_Bps'])} |",
            f"| O_DIRECT write + fdatasync ({m['probe_bytes'] / GB:.1f} GB, best of 2) | "
            f"{_gb(m['odirect_Bps'])} |",
            f"| buffered write + fdatasync | {_gb(m['buffered_fsync_Bps'])} |",
            f"| cold sequential read, 1 thread | {_gb(m['cold_read_1t_Bps'])} |",
            f"| cold sequential read, {m['threads']} threads | "
            f"{_gb(m['cold_read_parallel_Bps'])} |",
            "",
            f"Page cache: per-file `drop_page_cache` "
            f"{'worked' if m.get('drop_page_cache_ok') else 'FAILED'}; "
            f"`echo 1 > /proc/sys/vm/drop_caches` is "
            f"{'allowed' if m.get('drop_caches_allowed') else 'refused'} here.",
            "",
        ]
    elif m:
        lines += [f"Machine phase failed: {m['error']}", ""]
    lines += [
        "Times are the median of the runs, with the best in parentheses; GB/s to durable is "
        "state bytes over the best time to durable; others' CPU is the most CPU (in cores) "
        "that other processes on this shared machine took during one of the runs, each of "
        "which waited up to a few seconds for a quiet machine first.",
        "",
        "| save | blocked s | staged s | durable s | GB/s to durable | peak extra RSS GB "
        "(x state) | others' CPU |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]

    def cell(runs: list[Result], key: str) -> str:
        if len(runs) == 1:
            return _s(runs[0][key])
        return f"{_s(_median(runs, key))} ({_s(_best(runs, key))})"

    def row(name: str, runs: list[Result] | None, note: str = "") -> None:
        if not runs:
            lines.append(f"| {name} | {note or 'not run'} | | | | | |")
            return
        staged = cell(runs, "staged_s" if "staged_s" in runs[0] else "blocked_s")
        peak = max(x["peak_extra"] for x in runs)
        rate = _gb(state / _best(runs, "durable_s")) if state else "—"
        mem = f"{peak / GB:.2f} ({peak / state:.2f})" if state else "—"
        others = max(x.get("others", 0.0) for x in runs)
        lines.append(
            f"| {name} | {cell(runs, 'blocked_s')} | {staged} | {cell(runs, 'durable_s')} | "
            f"{rate} | {mem} | {others:.2f} |"
        )

    if "async" in sc:
        warm = _warm(sc["async"])
        row("snapcore.async_save, first (allocates and faults the arena)", sc["async"][:1])
        row(f"snapcore.async_save, warm ({len(warm)} runs)", warm)
        row(f"snapcore.save, warm ({len(sc['save'])} runs)", sc["save"])
    else:
        row("snapcore", None, sc.get("error", ""))
    if "runs" in ts:
        row(f"torch.save + fsync ({len(ts['runs'])} runs)", ts["runs"])
    else:
        row("torch.save + fsync", None, ts.get("error", ""))
    st = ts.get("safetensors") or {}
    if "runs" in st:
        row(f"safetensors save_file + fsync ({len(st['runs'])} runs)", st["runs"])
    elif ts:
        row("safetensors save_file + fsync", None, st.get("error", ts.get("error", "")))
    if "save" in dc:
        row("dcp.save", dc["save"])
        for key, label in (("async_thread", "thread"), ("async_process", "process")):
            if key in dc:
                row(f"dcp.async_save, {label}, first", dc[key][:1])
                row(f"dcp.async_save, {label}, warm ({len(_warm(dc[key]))} runs)", _warm(dc[key]))
            else:
                row(f"dcp.async_save, {label}", None, dc.get(f"{key}_error", ""))
    else:
        row("dcp", None, dc.get("error", ""))
    lines.append("")
    near = adjacent(r)
    if "async" in sc:
        warm = _warm(sc["async"])
        bare = [x["bare_copy_s"] for x in warm if "bare_copy_s" in x]
        write = _best(warm, "write_s")
        lines += [
            "Next to snapcore's warm saves: memcpy inside a pre-faulted probe arena (the "
            "faster of memcpy's and streaming stores) "
            + ", ".join(_gb(x["memcpy_Bps"]) for x in warm if "memcpy_Bps" in x)
            + f" GB/s (best {_gb(near['memcpy_Bps'])}), so state/memcpy = "
            f"{_s(state / near['memcpy_Bps'] if near['memcpy_Bps'] else None)} s; one bare "
            "`copy_host` of the state's tensors into the probe arena takes "
            + ", ".join(_s(x) for x in bare)
            + " s (staging without snapcore's bookkeeping); O_DIRECT writes of state-sized "
            "files from it "
            + ", ".join(f"{_gb(x)}" for x in sc.get("odirect_Bps", []))
            + " GB/s; the write after staging (durable - staged) takes "
            + ", ".join(_s(x["write_s"]) for x in warm)
            + f" s ({_gb(state / write if write else None)} GB/s at best). Each warm save "
            "wrote "
            + ", ".join(_gb(x["written"]) for x in warm if x.get("written") is not None)
            + " GB to its data file (the state changes between saves, so nothing is "
            "shared with an earlier snapshot).",
            "",
        ]
    if sc.get("duel"):
        duel = sc["duel"]
        lines += [
            f"Staging, interleaved ({len(duel)} rounds in the snapcore phase, same bandwidth for "
            "all three): snapcore.async_save "
            + ", ".join(_s(x["snapcore_s"]) for x in duel)
            + " s; DCP's DefaultStager (staging thread, cache reused) "
            + ", ".join(_s(x["dcp_s"]) for x in duel)
            + " s; a bare copy_host of the same tensors "
            + ", ".join(_s(x["bare_copy_s"]) for x in duel)
            + " s.",
            "",
        ]
    if dc.get("async_process_daemon_hwm"):
        lines += [
            "DCP's process mode also keeps a daemon process whose peak RSS was "
            f"{dc['async_process_daemon_hwm'] / GB:.2f} GB (mostly the shared staging copy "
            "it maps; not counted above).",
            "",
        ]
    if rs and "error" not in rs:
        lines += [
            "| restore (page cache dropped first) | seconds | GB/s | peak extra RSS GB | "
            "others' CPU |",
            "| --- | --- | --- | --- | --- |",
        ]
        for key, label in (
            ("snapcore_restore", "snapcore.restore into the state (hashes verified), best of 3"),
            ("snapcore_restore_noverify", "snapcore.restore, verify=False"),
            ("snapcore_load", "snapcore.load (new tensors)"),
            ("torch_load", "torch.load(mmap=False) (new tensors)"),
            ("dcp_load", "dcp.load into the state"),
            ("safetensors_load", "safetensors load_file (new tensors)"),
        ):
            if key not in rs:  # safetensors absent, or a run from before it was measured
                continue
            x = rs[key]
            lines.append(
                f"| {label} | {_s(x['seconds'])} | {_gb(x['Bps'])} | {x['peak_extra'] / GB:.2f} | "
                f"{x.get('others', 0.0):.2f} |"
            )
        lines += [
            "",
            "Around the restores, cold reads of snapcore's data file into the state, in 64 MiB "
            "pieces (streams = pieces in flight), in order: "
            + ", ".join(
                f"{_gb(x['Bps'])} GB/s ({x['streams']} stream{'s' if x['streams'] > 1 else ''})"
                for x in rs["cold_read"]
            )
            + "; the restores took "
            + ", ".join(f"{_s(x['seconds'])} s" for x in rs["snapcore_restore_runs"])
            + ". After each restore the state "
            + ("matched" if rs["snapcore_restore"].get("state_matches") else "did NOT match")
            + " the saved one.",
            "",
        ]
    elif rs:
        lines += [f"Restore phase failed: {rs['error']}", ""]
    lines += common.targets_table(r["targets"], "memory")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size-gb", type=float, default=4.4, help="state size (default 4.4)")
    p.add_argument(
        "--dir", default=None, help="where to write (a fresh subdirectory; default under /tmp)"
    )
    p.add_argument("--json", default=None, help="write the raw figures here")
    p.add_argument("--markdown", default=None, help="write the report (markdown) here")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {PHASES}")
    p.add_argument("--repeats", type=int, default=5, help="snapcore's warm saves after the first")
    p.add_argument("--dcp-repeats", type=int, default=2, help="DCP's warm saves after the first")
    p.add_argument(
        "--duel-rounds",
        type=int,
        default=4,
        help="rounds of interleaved staging: snapcore, DCP's stager, a bare copy",
    )
    p.add_argument(
        "--probe-gb", type=float, default=2.0, help="bytes for the machine phase's probes"
    )
    p.add_argument(
        "--dcp-io-threads", type=int, default=1, help="FileSystemWriter thread_count for DCP"
    )
    p.add_argument(
        "--quiet-cores",
        type=float,
        default=0.25,
        help="before each timing, wait until other processes take less CPU than this",
    )
    p.add_argument(
        "--quiet-wait", type=float, default=2.0, help="... but for at most this many seconds"
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="a tiny run that only checks the benchmark works (~12 MB state, one warm run, "
        "no waiting for a quiet machine, every phase in one child process); its figures "
        "mean nothing",
    )
    p.add_argument("--phase", default=None, help=argparse.SUPPRESS)  # child process mode
    args = p.parse_args(argv)
    if args.smoke:
        args.size_gb, args.probe_gb, args.quiet_wait = 0.01, 0.01, 0.0
        args.repeats, args.dcp_repeats, args.duel_rounds = 1, 0, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    common.set_quiet(args.quiet_cores, args.quiet_wait)
    if args.phase:
        work = Path(args.dir)
        for name in args.phase.split(","):  # several with --smoke
            result = PHASE_FUNCS[name](args, work)
            (work / f"{name}.json").write_text(json.dumps(result, indent=1))
        return 0
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = set(phases) - set(PHASES)
    if unknown:
        raise SystemExit(f"unknown phases {sorted(unknown)}; choose from {PHASES}")
    command = "python benchmarks/bench_save.py " + " ".join(sys.argv[1:] if argv is None else argv)
    t0 = time.perf_counter()
    with common.work_dir(args.dir) as work:
        report: Result = {"command": command.strip(), "info": machine_info(work)}
        report.update(run_phases([name for name in PHASES if name in phases], args, work))
        report["targets"] = check_targets(report)
    report["total_s"] = time.perf_counter() - t0
    text = render(report)
    print()
    print(text)
    for t in report["targets"]:
        print(f"{t['status']:4}  {t['target']}: {t['detail']}")
    print(f"total {report['total_s']:.0f}s")
    common.write_figures(args.json, report, args.markdown, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
