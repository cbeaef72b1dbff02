"""The CUDA path on a GPU, against the machine's own limits measured in the same run
(issue 12, item 4; item 3's scaling curve on the GPU).

For each state size (a stack of ``nn.Linear`` layers on the GPU, fp32, with Adam's state
after one step: about 3 x the parameters' bytes):

- **D2H staging**: ``snapcore.save`` to a host-memory store, default mode (the call
  returns once every copy has run): the state's bytes over ``stats.staged_s``, the best
  and the median of the warm saves, against a pinned ``cudaMemcpy`` D2H (torch ``copy_``
  from the device into a ``pin_memory=True`` buffer, of min(state, 2 GiB)) measured
  before and after them. Target: >= 0.9 x the probe.
- **Overlap mode's stall**: what ``async_save(..., overlap=True)`` blocks the training
  thread: the call itself, plus what the next ``optimizer.step()`` takes on the host
  beyond its median without a snapshot in flight (the step waits on the GPU, through the
  stream, for the copies of what it writes). A forward and backward pass runs between the
  two, as in training. Against the D2H copy time of the state at the probe's bandwidth.
  Target: < 5% of it.
- **Restore H2D**: ``snapcore.restore`` into the CUDA state from the host tier: the
  state's bytes over the restore's wall time (to ``torch.cuda.synchronize()``), against
  a pinned H2D copy. Target: >= 0.9 x, judged on the best restore as the library does
  it by default (each restore makes its pinned ring: snapcore/staging/h2d.py); restores
  with the ring kept between them (``SNAPCORE_RESTORE_RING_KEEP``) are reported beside.
  Each restore is checked: a perturbed tensor comes back with its saved values.
- **The ABI check** (benchmarks/abi.py): the native module links nothing of torch's C++
  ABI or the CUDA runtime.

    python benchmarks/bench_gpu.py                        # a CUDA machine: 4 and 16 GB
    python benchmarks/bench_gpu.py --sizes-gb 4,8,16,32   # the scaling curve (32 GB needs
                                                          # ~100 GB of host memory)
    python benchmarks/bench_gpu.py --smoke --device cpu   # the plumbing (test_benchmarks.py)

On a CPU (``--device cpu``, for the smoke test only) the probes are plain copies and no
target is judged. benchmarks/gpu_check.sh runs this on the GPU machine.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import abi
import common
import torch
from common import fmt_s as _s

import snapcore
from snapcore import _native
from snapcore.staging import h2d as restore_ring
from snapcore.write.engine import close_all

GB = 1e9
GIB = 1 << 30
Result = dict[str, Any]

D2H_TARGET = 0.9  # staging >= 0.9 x pinned cudaMemcpy D2H
STALL_TARGET = 0.05  # overlap mode blocks < 5% of the D2H copy time
H2D_TARGET = 0.9  # restore >= 0.9 x pinned H2D


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- the machine ------------------------------------------------------------------------------
def machine(device: torch.device) -> Result:
    info: Result = {
        "cpu": common.cpu_model(platform.processor() or platform.machine()),
        "cores": os.cpu_count(),
        "ram_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": str(device),
        "native_cuda": _native.cuda_status(),
        "date": datetime.date.today().isoformat(),
    }
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(gpu=p.name, gpu_memory_bytes=p.total_memory, cuda=torch.version.cuda)
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version,pcie.link.gen.current,"
                 "pcie.link.width.current", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=30, check=True,
            )  # fmt: skip
            info["nvidia_smi"] = smi.stdout.strip()
        except (OSError, subprocess.SubprocessError) as e:
            info["nvidia_smi"] = f"unavailable: {e}"
    # gpu_check.sh names the commit: the GPU machine's .git can be older than its tree
    commit = os.environ.get("SNAPCORE_COMMIT", "")[:7]
    try:
        commit = commit or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=True, cwd=Path(__file__).parent,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        commit = "?"
    info["commit"] = commit
    return info


def probe(device: torch.device, nbytes: int, reps: int) -> Result:
    """Pinned D2H and H2D bandwidth (bytes/s) of one ``nbytes`` copy, ``reps`` times each
    after a warm-up; on a CPU device, plain copies between two faulted buffers."""
    cuda = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host.fill_(1)
    dev.fill_(2)
    out: Result = {"bytes": nbytes, "pinned": bool(cuda and host.is_pinned())}
    for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        rates = []
        for i in range(reps + 1):
            sync(device)
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=cuda)
            sync(device)
            if i:  # the first is the warm-up
                rates.append(nbytes / (time.perf_counter() - t0))
        out[f"{name}_Bps"] = rates
    del host, dev
    return out


def read_check_probe(root: Path, chunk: int, workers: int, reps: int) -> Result:
    """What a restore's workers do to each chunk, without the GPU: ``pread`` of a chunk
    from a file in ``root`` (the host tier's /dev/shm) into a faulted buffer, then xxh3-128
    of the buffer; bytes/s with one thread and with ``workers`` at once (each on its own
    chunk), the best of ``reps``. The restore from the host tier cannot go faster than
    the second (whatever the H2D copy can do)."""
    import xxhash

    path = root / f"snapcore-bench-read-{uuid.uuid4().hex[:8]}.bin"
    bufs = [torch.empty(chunk, dtype=torch.uint8) for _ in range(workers)]
    for b in bufs:
        b.fill_(7)
    try:
        with open(path, "wb") as f:
            for b in bufs:
                f.write(memoryview(b.numpy()))

        def one(i: int) -> None:
            _native.read_into(str(path), i * chunk, chunk, bufs[i].data_ptr())
            xxhash.xxh3_128_hexdigest(memoryview(bufs[i].numpy()))

        out: Result = {"chunk_bytes": chunk, "workers": workers, "root": str(root)}
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(one, range(workers)))  # the threads started, the file read once
            for name, n in (("one_Bps", 1), ("all_Bps", workers)):
                best = 0.0
                for _ in range(reps):
                    t0 = time.perf_counter()
                    list(pool.map(one, range(n)))
                    best = max(best, n * chunk / (time.perf_counter() - t0))
                out[name] = best
        return out
    finally:
        path.unlink(missing_ok=True)


def run_read_check(args: argparse.Namespace) -> Result:
    """The read-and-check probe as a restore would run it here: SNAPCORE_THREADS workers,
    SNAPCORE_CHUNK_MB chunks (4 MiB for --smoke), in /dev/shm where it has room."""
    workers = snapcore.settings.threads()
    chunk = snapcore.settings.chunk_bytes() if not args.smoke else 4 << 20
    shm = Path("/dev/shm")
    room = shm.is_dir() and shutil.disk_usage(shm).free > 2 * workers * chunk
    root = shm if room else Path(tempfile.gettempdir())
    return read_check_probe(root, chunk, workers, max(1, args.probe_reps))


# -- the state --------------------------------------------------------------------------------
def build(size_gb: float, device: torch.device) -> tuple[torch.nn.Module, Any, Result]:
    """Linear layers with Adam's state after one step, about ``size_gb`` GB in all."""
    t0 = time.perf_counter()
    param_bytes = size_gb * GB / 3
    width = 8192 if param_bytes >= 4 * 8192 * 8192 * 4 else 256
    layers = max(2, round(param_bytes / ((width * width + width) * 4)))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    model.to_empty(device=device)
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.02, 0.02)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    for p in model.parameters():  # one parameter at a time: no parameter-sized spike
        p.grad = torch.randn_like(p).mul_(1e-3)
        opt.step()
        p.grad = None
    sync(device)
    tensors = [p for p in model.parameters()] + [
        v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)
    ]
    info = {
        "width": width,
        "layers": layers,
        "tensors": len(tensors),
        "state_bytes": sum(t.numel() * t.element_size() for t in tensors),
        "device_bytes": sum(
            t.numel() * t.element_size() for t in tensors if t.device.type == device.type
        ),
        "build_s": time.perf_counter() - t0,
    }
    return model, opt, info


def train_pass(model: torch.nn.Module, width: int, device: torch.device) -> None:
    """A forward and backward pass (gradients for the next optimizer step)."""
    x = torch.randn(256, width, device=device)
    model(x).float().pow(2).mean().backward()


# -- one size ---------------------------------------------------------------------------------
def measure(size_gb: float, args: argparse.Namespace, device: torch.device) -> Result:
    model, opt, info = build(size_gb, device)
    r: Result = {"size_gb": size_gb, **info}
    state = {"model": model, "optim": opt}
    nbytes = info["device_bytes"]
    probe_bytes = int(min(nbytes, args.probe_gib * GIB))
    r["probe_before"] = probe(device, probe_bytes, args.probe_reps)
    name = f"bench-gpu-{uuid.uuid4().hex[:8]}"
    # The host tier needs two steps of room in /dev/shm (the committed one and the next);
    # where it lacks that (a container's small /dev/shm), a local directory, read back
    # from the page cache (the state was just written), stands in, and the run says so.
    shm = os.statvfs("/dev/shm")
    tmp = Path(tempfile.mkdtemp(prefix="snapcore-bench-gpu-", dir=args.dir))
    if shm.f_bavail * shm.f_frsize >= 2.5 * info["state_bytes"]:
        store, r["tier"] = snapcore.Store(host=name, retention={"host": 1}), "host"
    else:
        store = snapcore.Store(local=tmp, retention={"local": 1})
        r["tier"] = "local (/dev/shm too small for the host tier)"
    step = 0
    try:
        # D2H staging: default mode, the first save cold (the arena is made and pinned)
        saves = []
        for i in range(args.repeats + 1):
            step += 1
            sync(device)
            stats = snapcore.save(state, store, step=step)
            saves.append(
                {"first": i == 0, "staged_s": stats.staged_s, "stall_s": stats.stall_s,
                 "durable_s": stats.durable_s, "bytes": stats.bytes}
            )  # fmt: skip
        r["saves"] = saves

        # overlap mode: the call and the optimizer step's excess on the host
        base = []
        for _ in range(args.repeats + 2):
            train_pass(model, info["width"], device)
            sync(device)
            t0 = time.perf_counter()
            opt.step()
            base.append(time.perf_counter() - t0)
            opt.zero_grad(set_to_none=True)
        step_base = statistics.median(base)
        overlaps = []
        for _ in range(args.repeats):
            step += 1
            train_pass(model, info["width"], device)
            sync(device)
            t0 = time.perf_counter()
            h = snapcore.async_save(state, store, step=step, overlap=True)
            t1 = time.perf_counter()
            train_pass(model, info["width"], device)  # the copies overlap it on the GPU
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            stats = h.wait()
            opt.zero_grad(set_to_none=True)
            excess = max(0.0, t3 - t2 - step_base)
            overlaps.append(
                {"call_s": t1 - t0, "step_s": t3 - t2, "step_excess_s": excess,
                 "blocked_s": t1 - t0 + excess, "staged_s": stats.staged_s,
                 "stall_s": stats.stall_s}
            )  # fmt: skip
        r["step_base_s"] = step_base
        r["overlap"] = overlaps

        # restore H2D: a perturbed tensor must come back with the saved values (a last save
        # first: the overlap mode's snapshots hold the weights before their steps)
        step += 1
        snapcore.save(state, store, step=step)
        w = model[0].weight
        saved = w.detach().clone()
        restores = []
        default_slot = restore_ring.RING_SLOT_BYTES
        slots = ring_slots(args)
        # the library's own (its batch size, the ring made by each restore: judged), then
        # the ring kept between restores (SNAPCORE_RESTORE_RING_KEEP: the first makes it),
        # then other batch sizes (--ring-slot-mib): experiments
        variants = [(slots[0], False), (slots[0], True)] + [(m, False) for m in slots[1:]]
        for slot_mib, keep in [v for v in variants for _ in range(args.repeats)]:
            restore_ring.RING_SLOT_BYTES = slot_mib << 20
            with torch.no_grad():
                w.add_(1.0)
            sync(device)
            with snapcore.settings.override(SNAPCORE_RESTORE_RING_KEEP="1" if keep else "0"):
                t0 = time.perf_counter()
                ri = snapcore.restore(state, store)
                sync(device)
                wall = time.perf_counter() - t0
            restores.append(
                {"wall_s": wall, "seconds": ri.seconds, "bytes_read": ri.bytes, "tier": ri.tier,
                 "step": ri.step, "matches": bool(torch.equal(w, saved)),
                 "profile": dict(restore_ring.last_profile) if device.type == "cuda" else {},
                 "slot_mib": slot_mib, "ring_kept": keep}
            )  # fmt: skip
        restore_ring.RING_SLOT_BYTES = default_slot
        restore_ring.release_ring()
        r["restores"] = restores
        del saved
    finally:
        close_all()
        if r["tier"] == "host":
            snapcore.free_host(name)
        shutil.rmtree(tmp, ignore_errors=True)
    r["probe_after"] = probe(device, probe_bytes, args.probe_reps)
    del state, model, opt
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return r


def _wall(restore: Result) -> float:
    return float(restore["wall_s"])


def ring_slots(args: argparse.Namespace) -> list[int]:
    """The restore ring's slot sizes to try, in MiB (the first is judged)."""
    return [int(x) for x in str(args.ring_slot_mib).split(",") if x.strip()]


# -- verdicts ---------------------------------------------------------------------------------
def figures(r: Result) -> Result:
    """The size's figures: best and median of the warm runs, and the probes' best."""
    warm = [s for s in r["saves"] if not s["first"]] or r["saves"]
    nbytes = r["device_bytes"]
    d2h = max(r["probe_before"]["d2h_Bps"] + r["probe_after"]["d2h_Bps"])
    h2d = max(r["probe_before"]["h2d_Bps"] + r["probe_after"]["h2d_Bps"])
    staged = [nbytes / s["staged_s"] for s in warm]
    # the target is judged on the library's own way (its batch size, the ring made by
    # each restore); the ring kept and other batch sizes are experiments
    slots = list(dict.fromkeys(x.get("slot_mib") for x in r["restores"]))
    own = [x for x in r["restores"] if x.get("slot_mib") == slots[0] and not x.get("ring_kept")]
    kept = [nbytes / x["wall_s"] for x in r["restores"] if x.get("ring_kept")]
    restore = [nbytes / x["wall_s"] for x in own]
    blocked = [o["blocked_s"] for o in r["overlap"]]
    copy_s = nbytes / d2h
    return {
        "d2h_probe_Bps": d2h,
        "h2d_probe_Bps": h2d,
        "staging_Bps": max(staged),
        "staging_median_Bps": statistics.median(staged),
        "copy_s": copy_s,
        "blocked_s": min(blocked),
        "blocked_median_s": statistics.median(blocked),
        "restore_Bps": max(restore),
        "restore_median_Bps": statistics.median(restore),
        "restores_match": all(x["matches"] for x in r["restores"]),
        "restore_kept_Bps": max(kept) if kept else None,
        "restore_by_slot_mib": {
            str(m): max(
                nbytes / x["wall_s"]
                for x in r["restores"]
                if x.get("slot_mib") == m and not x.get("ring_kept")
            )
            for m in slots
            if m is not None
        },
    }


def targets(r: Result, cuda: bool) -> list[Result]:
    f = r["figures"]
    gb = f"{r['state_bytes'] / GB:.3g} GB"

    def verdict(
        name: str, value: float, limit: float, ratio: float, ok: bool, detail: str
    ) -> Result:
        status = ("PASS" if ok else "FAIL") if cuda else "N/A"
        if not cuda:
            detail = f"{detail}; judged on a GPU only (this run: {r['device']})"
        return {"target": name, "value": value, "limit": limit, "ratio": ratio,
                "status": status, "detail": detail}  # fmt: skip

    d2h_limit = D2H_TARGET * f["d2h_probe_Bps"]
    h2d_limit = H2D_TARGET * f["h2d_probe_Bps"]
    stall_limit = STALL_TARGET * f["copy_s"]
    return [
        verdict(
            f"D2H staging >= 0.9 x pinned D2H ({gb})", f["staging_Bps"], d2h_limit,
            f["staging_Bps"] / f["d2h_probe_Bps"], f["staging_Bps"] >= d2h_limit,
            "best warm save's bytes / staged_s against the best pinned D2H probe",
        ),
        verdict(
            f"overlap stall < 5% of the D2H copy ({gb})", f["blocked_s"], stall_limit,
            f["blocked_s"] / f["copy_s"], f["blocked_s"] < stall_limit,
            "async_save(overlap=True)'s call plus the optimizer step's excess on the host "
            "(best of the runs), against the state's bytes at the best pinned D2H rate",
        ),
        verdict(
            f"restore H2D >= 0.9 x pinned H2D ({gb})", f["restore_Bps"], h2d_limit,
            f["restore_Bps"] / f["h2d_probe_Bps"],
            f["restore_Bps"] >= h2d_limit and f["restores_match"],
            f"best restore from the {r['tier']} tier (bytes / wall time to synchronize; each "
            "restore makes its ring) against the best pinned H2D probe; every restore "
            f"bit-exact: {f['restores_match']}",
        ),
    ]  # fmt: skip


def render(doc: Result) -> str:
    info = doc["info"]
    lines = [
        f"`{doc['command']}`, {info['date']}, {info.get('gpu', info['device'])} "
        f"({info.get('nvidia_smi', '-')}), {info['cpu']}, {info['cores']} cores, "
        f"torch {info['torch']}, commit {info['commit']}.",
        "",
        "| state | tier | tensors | pinned D2H | staging (median) | x probe | overlap stall "
        "(median) | D2H copy | x copy | pinned H2D | restore (median) | x probe |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in doc["sizes"]:
        f = r["figures"]
        lines.append(
            f"| {r['state_bytes'] / GB:.2f} GB | {r['tier']} | {r['tensors']} | "
            f"{f['d2h_probe_Bps'] / GB:.1f} GB/s | {f['staging_Bps'] / GB:.1f} "
            f"({f['staging_median_Bps'] / GB:.1f}) GB/s | "
            f"{f['staging_Bps'] / f['d2h_probe_Bps']:.2f} | {f['blocked_s'] * 1e3:.2f} "
            f"({f['blocked_median_s'] * 1e3:.2f}) ms | {f['copy_s'] * 1e3:.1f} ms | "
            f"{f['blocked_s'] / f['copy_s']:.3f} | {f['h2d_probe_Bps'] / GB:.1f} GB/s | "
            f"{f['restore_Bps'] / GB:.1f} ({f['restore_median_Bps'] / GB:.1f}) GB/s | "
            f"{f['restore_Bps'] / f['h2d_probe_Bps']:.2f} |"
        )
    lines += ["", "Targets:", ""]
    lines += common.targets_table([t for t in doc["targets"] if t["value"] is not None], "memory")
    a = doc["abi"]
    lines += [
        "",
        f"ABI check (benchmarks/abi.py): {'PASS' if a['ok'] else 'FAIL'}: the module needs "
        f"{', '.join(a['needed'])}; names {', '.join(a['opened']) or 'no library'} for dlopen; "
        f"{len(a['torch_symbols'])} symbols of torch's C++ namespaces, "
        f"{len(a['cuda_symbols'])} of the CUDA runtime or driver.",
        "",
        "Times per save: "
        + "; ".join(
            f"{r['state_bytes'] / GB:.1f} GB: staged "
            + ", ".join(_s(s["staged_s"]) for s in r["saves"])
            + " s (the first cold)"
            for r in doc["sizes"]
        ),
    ]
    rc = doc.get("read_check")
    if rc:
        probe_h2d = max(r["figures"]["h2d_probe_Bps"] for r in doc["sizes"])
        lines += [
            "",
            f"Read and check, the restore workers' work without the GPU (`pread` of a "
            f"{rc['chunk_bytes'] / 2**20:.0f} MiB chunk from {rc['root']} into memory, then "
            f"xxh3-128 of it): 1 thread {rc['one_Bps'] / GB:.1f} GB/s; {rc['workers']} at "
            f"once {rc['all_Bps'] / GB:.1f} GB/s, {rc['all_Bps'] / probe_h2d:.2f} x the "
            "pinned H2D probe: a restore from the host tier cannot go faster.",
        ]
    for r in doc["sizes"]:
        f = r["figures"]
        if f.get("restore_kept_Bps"):
            lines += [
                "",
                f"{r['state_bytes'] / GB:.1f} GB with the ring kept between restores "
                f"(SNAPCORE_RESTORE_RING_KEEP; the first of them makes it): best "
                f"{f['restore_kept_Bps'] / GB:.1f} GB/s, "
                f"{f['restore_kept_Bps'] / f['h2d_probe_Bps']:.2f} x the probe (not judged).",
            ]
    groups = [  # where the best restore of each way spent its time
        (size, [x for x in size["restores"] if (x.get("slot_mib"), x.get("ring_kept")) == key])
        for size in doc["sizes"]
        for key in dict.fromkeys((x.get("slot_mib"), x.get("ring_kept")) for x in size["restores"])
    ]
    for r, runs in groups:
        best = min(runs, key=_wall)
        p = best.get("profile") or {}
        if p:
            lines += ["", _restore_line(r, best, p)]
    return "\n".join(lines) + "\n"


def _restore_line(r: Result, best: Result, p: Result) -> str:
    """Where a restore spent its time (h2d.last_profile); the workers' phases are summed
    over the workers (worker-seconds)."""
    workers = p.get("workers", 1)
    read_Bps = p["bytes"] / p["read_s"] * workers if p["read_s"] > 0 else 0.0
    ring = (
        f"{p['ring_made']:.0f} of them made in {_s(p['ring_s'])} worker-s"
        if p.get("ring_made", 1)
        else "kept from the last restore"
    )
    way = "the ring kept" if best.get("ring_kept") else "the ring made by each restore"
    return (
        f"Best restore of {r['state_bytes'] / GB:.1f} GB ({way}), {_s(best['wall_s'])} s: "
        f"the pinned ring ({p['slots']:.0f} slots of {p['slot_bytes'] / 2**20:.0f} MiB, "
        f"{ring}); "
        f"{workers:.0f} workers read and checked {p['reads']:.0f} batches in "
        f"{_s(p['read_s'])} worker-s ({read_Bps / GB:.1f} GB/s all together), queued the "
        f"copies in {_s(p['queue_s'])} worker-s, waited for a slot's copies "
        f"{_s(p['wait_s'])} worker-s; the last copies took {_s(p.get('drain_s', 0.0))} s "
        f"more, freeing {_s(p['close_s'])} s; the rest (the plan, the manifest) "
        f"{_s(best['wall_s'] - p['total_s'])} s."
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-gb", default="4,16", help="state sizes, comma-separated (GB)")
    p.add_argument("--repeats", type=int, default=3, help="warm runs of each measurement")
    p.add_argument("--probe-gib", type=float, default=2.0, help="the probes' copy size cap")
    p.add_argument("--probe-reps", type=int, default=5)
    p.add_argument(
        "--ring-slot-mib",
        default=str(restore_ring.RING_SLOT_BYTES >> 20),
        help="restores with each of these ring slot sizes (MiB, comma-separated; the "
        "first is judged: the library's own by default); the others are experiments",
    )
    p.add_argument("--device", default="cuda", help="cuda (default), or cpu for --smoke")
    p.add_argument("--dir", default=None, help="where a local store goes if /dev/shm is small")
    p.add_argument("--json", default=None, help="write the raw figures here")
    p.add_argument("--markdown", default=None, help="write the report (markdown) here")
    p.add_argument("--smoke", action="store_true", help="a tiny run: does it work?")
    p.add_argument(
        "--read-check-only",
        action="store_true",
        help="only the read-and-check probe (any machine): what the restore's workers can do",
    )
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if args.read_check_only:
        rc = run_read_check(args)
        print(
            f"read and check: {rc['chunk_bytes'] >> 20} MiB chunks from {rc['root']}: 1 thread "
            f"{rc['one_Bps'] / GB:.2f} GB/s; {rc['workers']} at once {rc['all_Bps'] / GB:.2f} "
            f"GB/s (best of {args.probe_reps}; {datetime.date.today()}, {common.cpu_model()}, "
            f"{os.cpu_count()} CPUs)"
        )
        return 0
    if args.smoke:
        args.sizes_gb, args.repeats, args.probe_reps = "0.02", 1, 1
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("bench_gpu: no CUDA device for torch; this benchmark needs one", file=sys.stderr)
            return 2
        if not _native.cuda_available():
            print(
                f"bench_gpu: snapcore's CUDA path is off: {_native.cuda_status()}", file=sys.stderr
            )
            return 2
    elif not args.smoke:
        print("bench_gpu: --device cpu is for --smoke runs only", file=sys.stderr)
        return 2
    doc: Result = {
        "command": " ".join(["python benchmarks/bench_gpu.py", *(argv or sys.argv[1:])]),
        "info": machine(device),
        "abi": abi.report(),
        "sizes": [],
    }  # fmt: skip
    doc["read_check"] = run_read_check(args)
    for gb in (float(x) for x in args.sizes_gb.split(",")):
        print(f"[bench_gpu] {gb:g} GB ...", flush=True)
        r = measure(gb, args, device)
        r["device"] = str(device)
        r["figures"] = figures(r)
        doc["sizes"].append(r)
    cuda = device.type == "cuda"
    doc["targets"] = [t for r in doc["sizes"] for t in targets(r, cuda)]
    doc["targets"].append(
        {"target": "the native module calls nothing of torch's C++ ABI", "value": None,
         "limit": None, "ratio": None, "status": "PASS" if doc["abi"]["ok"] else "FAIL",
         "detail": "benchmarks/abi.py: DT_NEEDED, undefined symbols, library names"}
    )  # fmt: skip
    text = render(doc)
    print(text)
    common.write_figures(args.json, doc, args.markdown, text)
    failed = [t for t in doc["targets"] if t["status"] == "FAIL"]
    return 1 if failed and not args.smoke else 0


if __name__ == "__main__":
    sys.exit(main())
