"""snapcore convert against the paths a user would take otherwise (issue 11's benchmark).

A transformer-like state (an fp32 token embedding, a bf16 output head, bf16 layers of
attention and MLP weights with fp32 norms: the shapes of a Llama-3.2-1B-sized model at
the default 4 GB) is built once, from seeded generators, and saved once as a snapcore
store; the inputs of the other paths are made from it, untimed. Then, each in a child
process of its own (so that its peak RSS, ``VmHWM``, is its own), with every source file
dropped from the page cache first, and every output fsynced before the clock stops:

- ``snapcore.convert.convert(store, dir, to="safetensors", shard_size=...)``: Hugging
  Face's sharded layout;
- the same in the other direction, the safetensors directory to a new snapcore store;
- beside them, what a user would do otherwise: ``snapcore.load`` then
  ``safetensors.torch.save_file`` shard by shard (cut as convert cuts them, plus the
  index) ; ``snapcore.load`` then ``huggingface_hub.save_torch_state_dict`` (where
  installed); torch's ``_consolidate_hf_safetensors.consolidate_safetensors_files`` from a
  DCP checkpoint written in its Hugging Face format (``HuggingFaceStorageWriter``,
  ``save_distributed=True``); ``format_utils.dcp_to_torch_save`` from a DCP copy of the
  state (made by ``convert``); ``safetensors.torch.load_file`` of every shard then
  ``snapcore.save``;
- ``convert(store, file, to="torch")``: a ``torch.save`` file, beside ``snapcore.load``
  then ``torch.save`` (and ``dcp_to_torch_save``, above);
- the machine's limits in the same run: a plain copy of the store's data files
  (``shutil.copyfile`` + fsync, page cache dropped first: the disk's copy speed) before,
  between and after the conversions, and O_DIRECT write / cold read probes
  (``common.write_rate``, ``common.cold_read_rate``) at the start and the end.

Each output is then checked against the source store, tensor by tensor (names, dtypes,
shapes, bytes: ``torch.equal``), outside the timing. Targets (issue 11): each conversion
>= 0.7 x the copy speed measured next to it, peak RSS <= 1 GB + the largest tensor, and
faster than every alternative of its direction. docs/benchmarks.md explains the figures.

    python benchmarks/bench_convert.py                  # 4 GB state, ~5-8 minutes
    python benchmarks/bench_convert.py --size-gb 1 --shard-size 5GB
    python benchmarks/bench_convert.py --json out.json --markdown out.md --dir /mnt/fast
    python benchmarks/bench_convert.py --smoke          # ~10 MB, does it work?

The test suite runs only its --smoke run (tests/integration/test_benchmarks.py).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import glob
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import common
from common import fmt_gb as _gbs
from common import fmt_s as _s
from common import status_bytes

GB = 1e9
GIB = 1 << 30
CHILD_TIMEOUT_S = 900
Result = dict[str, Any]

# (smallest state, hidden, MLP width, key/value width, vocabulary): the shapes grow with
# the state, so that a small run still has a few large tensors and many medium ones
PRESETS = (
    (2.0 * GB, 2048, 8192, 512, 128256),  # Llama-3.2-1B's shapes
    (0.2 * GB, 1024, 4096, 256, 32000),
    (0.0, 256, 1024, 64, 4000),
)

# The timed jobs, in the order they run (the copies are the machine's reference).
TO_SAFETENSORS = ("save_file", "hf_hub", "consolidate", "dcp_to_torch_save")
TO_SNAPCORE = ("load_file_save",)
TO_TORCH = ("load_torch_save",)  # and dcp_to_torch_save, run with TO_SAFETENSORS
LABELS = {
    "copy": "plain copy of the store's data files (copyfile + fsync)",
    "convert_to_safetensors": "snapcore convert: snapcore -> safetensors (HF sharded)",
    "save_file": "snapcore.load + safetensors save_file per shard + index",
    "hf_hub": "snapcore.load + huggingface_hub.save_torch_state_dict",
    "consolidate": "torch _consolidate_hf_safetensors: DCP (HF format) -> safetensors",
    "dcp_to_torch_save": "torch dcp_to_torch_save: DCP -> torch.save file",
    "convert_to_snapcore": "snapcore convert: safetensors -> snapcore",
    "load_file_save": "safetensors load_file of every shard + snapcore.save",
    "convert_to_torch": "snapcore convert: snapcore -> torch.save file",
    "load_torch_save": "snapcore.load + torch.save",
}


# -- the state --------------------------------------------------------------------------------
def layout(size_bytes: float) -> tuple[list[tuple[str, tuple[int, ...], str]], Result]:
    """(name, shape, dtype name) of every tensor of a state of about ``size_bytes``."""
    _, d, f, kv, vocab = next(p for p in PRESETS if size_bytes >= p[0])
    nbytes = {"float32": 4, "bfloat16": 2}

    def size(items: list[tuple[str, tuple[int, ...], str]]) -> int:
        total = 0
        for _, shape, dtype in items:
            n = nbytes[dtype]
            for s in shape:
                n *= s
            total += n
        return total

    def layer(i: int) -> list[tuple[str, tuple[int, ...], str]]:
        p = f"model.layers.{i}."
        return [
            (p + "self_attn.q_proj.weight", (d, d), "bfloat16"),
            (p + "self_attn.k_proj.weight", (kv, d), "bfloat16"),
            (p + "self_attn.v_proj.weight", (kv, d), "bfloat16"),
            (p + "self_attn.o_proj.weight", (d, d), "bfloat16"),
            (p + "mlp.gate_proj.weight", (f, d), "bfloat16"),
            (p + "mlp.up_proj.weight", (f, d), "bfloat16"),
            (p + "mlp.down_proj.weight", (d, f), "bfloat16"),
            (p + "input_layernorm.weight", (d,), "float32"),
            (p + "post_attention_layernorm.weight", (d,), "float32"),
        ]

    head = [("model.embed_tokens.weight", (vocab, d), "float32")]
    tail = [("model.norm.weight", (d,), "float32"), ("lm_head.weight", (vocab, d), "bfloat16")]
    layers = max(1, round((size_bytes - size(head + tail)) / size(layer(0))))
    items = head + [x for i in range(layers) for x in layer(i)] + tail
    sizes = [size([x]) for x in items]
    largest = max(range(len(items)), key=sizes.__getitem__)
    by_dtype: dict[str, int] = {}
    for (_, _, dtype), n in zip(items, sizes, strict=True):
        by_dtype[dtype] = by_dtype.get(dtype, 0) + n
    info = {
        "state_bytes": sum(sizes),
        "tensors": len(items),
        "layers": layers,
        "hidden": d,
        "mlp": f,
        "kv": kv,
        "vocab": vocab,
        "largest_name": items[largest][0],
        "largest_bytes": sizes[largest],
        "bytes_by_dtype": by_dtype,
    }
    return items, info


def build_state(size_bytes: float) -> tuple[dict[str, Any], Result]:
    """The state: each tensor from a generator seeded with its index (deterministic)."""
    import torch

    items, info = layout(size_bytes)
    state: dict[str, Any] = {}
    for k, (name, shape, dtype) in enumerate(items):
        gen = torch.Generator().manual_seed(1000 + k)
        mean = 1.0 if name.endswith("norm.weight") else 0.0
        t = torch.empty(shape, dtype=torch.float32).normal_(mean, 0.02, generator=gen)
        state[name] = t if dtype == "float32" else t.to(getattr(torch, dtype))
        del t
    return state, info


def shard_plan(infos: list[tuple[str, int]], shard_size: int) -> list[list[str]]:
    """Names per shard, cut the way convert (and save_pretrained) cuts: in order, a new
    shard once the next tensor would overflow this one (a larger tensor: its own)."""
    shards: list[list[str]] = []
    size = 0
    for name, n in infos:
        if not shards or (size + n > shard_size and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


# -- files ------------------------------------------------------------------------------------
def files_under(root: str | Path) -> list[str]:
    if os.path.isfile(root):
        return [str(root)]
    return sorted(p for p in glob.glob(f"{root}/**/*", recursive=True) if os.path.isfile(p))


def store_data_files(store: Path) -> list[str]:
    return sorted(glob.glob(f"{store}/step-*/data-*"))


def fsync_tree(root: str | Path) -> None:
    """fsync every file under ``root`` (or the file), then the directories."""
    root = Path(root)
    paths = [*files_under(root), *(p for p in glob.glob(f"{root}/**/", recursive=True))]
    paths.append(str(root.parent))
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def flatten(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from flatten(v, f"{prefix}.{k}" if prefix else str(k))
    else:
        yield prefix, obj


# -- reading an output back, to check it ------------------------------------------------------
def read_output(kind: str, path: Path) -> Iterator[tuple[str, Any]]:
    """(name, tensor) of every tensor of an output, one at a time."""
    if kind == "safetensors":
        from safetensors import safe_open

        for f in sorted(glob.glob(f"{path}/*.safetensors")) if path.is_dir() else [str(path)]:
            with safe_open(f, framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 (safe_open is not iterable)
                    yield name, st.get_tensor(name)
    elif kind == "snapcore":
        from snapcore.convert.snapcore_fmt import SnapcoreSource

        src = SnapcoreSource(path, {})
        try:
            for info in src.tensors():
                yield info.name, src.read(info)
        finally:
            src.close()
    elif kind == "torch":
        import torch

        (f,) = files_under(path)
        yield from flatten(torch.load(f, mmap=True, weights_only=True))
    else:
        raise ValueError(kind)


def check_output(kind: str, path: Path, store: Path) -> Result:
    """Compare every tensor of an output with the source store's, bit for bit."""
    import torch

    from snapcore.convert.snapcore_fmt import SnapcoreSource

    src = SnapcoreSource(store, {})
    try:
        infos = {i.name: i for i in src.tensors()}
        seen: set[str] = set()
        bad: list[str] = []
        for name, t in read_output(kind, path):
            info = infos.get(name)
            if info is None or name in seen:
                bad.append(f"{name}: {'twice' if name in seen else 'not in the source'}")
                continue
            seen.add(name)
            ref = src.read(info)
            if t.dtype != ref.dtype or tuple(t.shape) != tuple(ref.shape):
                bad.append(f"{name}: {t.dtype} {tuple(t.shape)} != {ref.dtype} {tuple(ref.shape)}")
            elif not torch.equal(t, ref):
                bad.append(f"{name}: values differ")
            del t, ref
    finally:
        src.close()
    missing = sorted(set(infos) - seen)
    bad += [f"{name}: missing" for name in missing[:5]]
    return {"equal": not bad, "tensors": len(seen), "problems": bad[:10]}


# -- the jobs (each runs in a child process) --------------------------------------------------
def prepare(args: argparse.Namespace, work: Path) -> Result:
    """Build the state, save it as a snapcore store, and make the other paths' inputs
    (untimed): a safetensors directory and a DCP directory (both by convert), and a DCP
    checkpoint in its Hugging Face format (for torch's consolidation)."""
    import snapcore
    from snapcore.convert import convert

    out: Result = {}
    t0 = time.perf_counter()
    state, info = build_state(args.size_gb * GB)
    out["build_s"] = time.perf_counter() - t0
    out["state"] = info
    t0 = time.perf_counter()
    with snapcore.Store(local=work / "store") as store:
        snapcore.save(state, store, step=0)
    snapcore.close()
    out["save_s"] = time.perf_counter() - t0
    out["store_data_bytes"] = sum(os.path.getsize(p) for p in store_data_files(work / "store"))
    t0 = time.perf_counter()
    try:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            writer = HuggingFaceStorageWriter(str(work / "dcp_hf"), save_distributed=True)
            dcp.save(state, storage_writer=writer, no_dist=True)
        out["dcp_hf_s"] = time.perf_counter() - t0
    except Exception as e:  # an older or newer torch: the job is skipped, with the reason
        out["dcp_hf_error"] = f"{type(e).__name__}: {e}"
    del state
    t0 = time.perf_counter()
    convert(work / "store", work / "in_safetensors", to="safetensors", shard_size=args.shard_bytes)
    out["in_safetensors_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    convert(work / "store", work / "in_dcp", to="dcp")
    out["in_dcp_s"] = time.perf_counter() - t0
    return out


def job_body(name: str, args: argparse.Namespace, work: Path, out: Path) -> tuple[Callable, str]:
    """(the timed call, the kind of output it writes) of a job."""
    store = work / "store"

    def plan_of(sd: dict[str, Any]) -> list[list[str]]:
        return shard_plan([(k, t.nbytes) for k, t in sd.items()], args.shard_bytes)

    if name == "copy":

        def copy() -> None:
            out.mkdir()
            for f in store_data_files(store):
                shutil.copyfile(f, out / os.path.basename(f))
            fsync_tree(out)

        return copy, ""
    if name == "convert_to_safetensors":
        from snapcore.convert import convert

        return lambda: convert(store, out, to="safetensors", shard_size=args.shard_bytes), (
            "safetensors"
        )
    if name == "convert_to_snapcore":
        from snapcore.convert import convert

        return lambda: convert(work / "in_safetensors", out, to="snapcore"), "snapcore"
    if name == "convert_to_torch":
        from snapcore.convert import convert

        def to_torch_file() -> None:
            out.mkdir()
            convert(store, out / "model.pt", to="torch")

        return to_torch_file, "torch"
    if name == "load_torch_save":
        import torch

        import snapcore

        def load_torch_save() -> None:
            out.mkdir()
            sd = snapcore.load(store)
            torch.save(sd, out / "model.pt")
            del sd
            snapcore.close()
            fsync_tree(out)

        return load_torch_save, "torch"
    if name == "save_file":
        from safetensors.torch import save_file

        import snapcore

        def by_hand() -> None:
            sd = dict(flatten(snapcore.load(store)))
            shards = plan_of(sd)
            out.mkdir()
            weight_map = {}
            for k, names in enumerate(shards):
                fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file({n: sd[n] for n in names}, out / fname, metadata={"format": "pt"})
                weight_map |= dict.fromkeys(names, fname)
            total = sum(t.nbytes for t in sd.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
            fsync_tree(out)

        return by_hand, "safetensors"
    if name == "hf_hub":
        from huggingface_hub import save_torch_state_dict

        import snapcore

        def hub() -> None:
            sd = dict(flatten(snapcore.load(store)))
            out.mkdir()
            save_torch_state_dict(sd, out, max_shard_size=args.shard_bytes)
            fsync_tree(out)

        return hub, "safetensors"
    if name == "consolidate":
        from torch.distributed.checkpoint._consolidate_hf_safetensors import (
            consolidate_safetensors_files,
        )

        from snapcore.convert.snapcore_fmt import SnapcoreSource

        src = SnapcoreSource(store, {})  # the same cuts as convert's, from the manifest
        infos = [(i.name, i.nbytes) for i in src.tensors()]
        src.close()
        shards = shard_plan(infos, args.shard_bytes)
        mapping = {n: k + 1 for k, names in enumerate(shards) for n in names}

        def consolidate() -> None:
            out.mkdir()
            consolidate_safetensors_files(
                str(work / "dcp_hf"), str(out), mapping, num_threads=os.cpu_count() or 1
            )
            fsync_tree(out)

        return consolidate, "safetensors"
    if name == "dcp_to_torch_save":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        def to_torch() -> None:
            out.mkdir()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp_to_torch_save(work / "in_dcp", out / "model.pt")
            fsync_tree(out)

        return to_torch, "torch"
    if name == "load_file_save":
        from safetensors.torch import load_file

        import snapcore

        def load_save() -> None:
            sd: dict[str, Any] = {}
            for f in sorted(glob.glob(f"{work / 'in_safetensors'}/*.safetensors")):
                sd.update(load_file(f))
            with snapcore.Store(local=out) as st:
                snapcore.save(sd, st, step=0)
            snapcore.close()

        return load_save, "snapcore"
    raise ValueError(f"unknown job {name}")


SOURCES = {
    "copy": "store",
    "convert_to_safetensors": "store",
    "save_file": "store",
    "hf_hub": "store",
    "consolidate": "dcp_hf",
    "dcp_to_torch_save": "in_dcp",
    "convert_to_snapcore": "in_safetensors",
    "load_file_save": "in_safetensors",
    "convert_to_torch": "store",
    "load_torch_save": "store",
}


def run_job(name: str, args: argparse.Namespace, work: Path) -> Result:
    """One timed conversion (or copy) in this fresh process: seconds, peak RSS, the
    output's bytes, then (untimed) the output checked against the source store."""
    import gc

    out = work / f"out-{name}"
    body, kind = job_body(name, args, work, out)  # imports done before the baseline
    gc.collect()
    sources = files_under(work / SOURCES[name])
    res: Result = {"baseline_rss": status_bytes("VmRSS")}
    res["dropped"] = common.drop_page_cache(sources)
    res["source_bytes"] = sum(os.path.getsize(p) for p in sources)
    timing = common.timed(body)
    res["peak_rss"] = status_bytes("VmHWM")  # a fresh process: its peak since it started
    res |= {"seconds": timing.wall_s, "cpu_s": timing.cpu_s, "others": timing.others}
    outputs = files_under(out)
    res["written_bytes"] = sum(os.path.getsize(p) for p in outputs)
    res["files"] = len(outputs)
    if kind and args.verify:
        t0 = time.perf_counter()
        res["check"] = check_output(kind, out, work / "store")
        res["check_s"] = time.perf_counter() - t0
    common.drop_page_cache(outputs)
    return res


def probes(args: argparse.Namespace, work: Path) -> Result:
    """O_DIRECT writes of state-sized files and cold reads of the store's data files."""
    import ctypes

    from snapcore import _native

    piece = 64 << 20
    arena = _native.Arena(4 * piece)
    ctypes.memset(arena.address, 0x5A, arena.size)
    total = sum(os.path.getsize(p) for p in store_data_files(work / "store"))
    total = max(piece, total // piece * piece)
    pieces = [(o, arena.address + (o // piece % 4) * piece, piece) for o in range(0, total, piece)]
    path = work / "odirect-probe.bin"
    out: Result = {"bytes": total}
    out["odirect_Bps"], out["odirect_in_use"] = common.write_rate(path, pieces, direct=True)
    path.unlink()
    reads: list[float] = []
    for threads in (1, 0):  # one reading thread, then one per core
        nbytes, seconds, dropped = 0, 0.0, True
        for f in store_data_files(work / "store"):
            size = os.path.getsize(f)
            jobs = [(o, min(piece, size - o), arena.address) for o in range(0, size, piece)]
            rate, ok = common.cold_read_rate(f, jobs, threads=threads)
            dropped &= ok
            nbytes, seconds = nbytes + size, seconds + size / rate
        reads.append(nbytes / seconds)
        out["cold_read_dropped"] = dropped
    out["cold_read_1t_Bps"], out["cold_read_parallel_Bps"] = reads
    out["cold_read_Bps"] = max(reads)
    arena.close()
    return out


def child_job(job: str, args: argparse.Namespace, work: Path) -> Result:
    """What a child process runs: the preparation, a probe, or a timed job."""
    if job == "prepare":
        return prepare(args, work)
    if job == "probes":
        return probes(args, work)
    return run_job(job, args, work)


# -- the parent -------------------------------------------------------------------------------
def child_cmd(args: argparse.Namespace, work: Path, out_file: Path) -> list[str]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child-out", str(out_file)]
    cmd += ["--dir", str(work), "--size-gb", str(args.size_gb), "--shard-size", args.shard_size]
    cmd += ["--quiet-cores", str(args.quiet_cores), "--quiet-wait", str(args.quiet_wait)]
    return cmd + ([] if args.verify else ["--no-verify"])


def run_children(jobs: list[tuple[str, str]], args: argparse.Namespace, work: Path) -> list[Result]:
    """Run each (job, tag) in a fresh child process, in order; with --smoke, all of them in
    one child (a process's start, torch's import, costs more than a smoke job), whose peak
    RSS figures are then the shared process's. Each result (or its error) in order."""
    if not args.smoke:
        return [run_child(["--child", job], args, work, tag) for job, tag in jobs]
    batch = ",".join(f"{job}:{tag}" for job, tag in jobs)
    done = run_child(["--child-batch", batch], args, work, "batch")
    if "error" in done:
        return [done for _ in jobs]
    return [json.loads((work / f"{tag}.json").read_text()) for _, tag in jobs]


def run_child(child: list[str], args: argparse.Namespace, work: Path, tag: str) -> Result:
    out_file, log_file = work / f"{tag}.json", work / f"{tag}.log"
    print(f"[{tag}] running ...", flush=True)
    t0 = time.perf_counter()
    with open(log_file, "w") as log:
        try:
            rc = subprocess.run(
                child_cmd(args, work, out_file) + child,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=CHILD_TIMEOUT_S,
            ).returncode
        except subprocess.TimeoutExpired:
            rc = -1
    wall = time.perf_counter() - t0
    if child[0] == "--child":
        shutil.rmtree(work / f"out-{child[1]}", ignore_errors=True)
    if rc != 0 or not out_file.exists():
        tail = log_file.read_text(errors="replace")[-2000:]
        print(f"[{tag}] FAILED (rc={rc}) after {wall:.1f}s:\n{tail}", flush=True)
        return {"error": f"exited with {rc}", "log_tail": tail, "wall_s": wall}
    res = json.loads(out_file.read_text())
    res["wall_s"] = wall
    if "seconds" in res:
        print(f"[{tag}] {res['seconds']:.2f} s, peak RSS {res['peak_rss'] / GB:.2f} GB", flush=True)
    else:
        print(f"[{tag}] done in {wall:.1f}s", flush=True)
    return res


def machine_info(work: Path) -> Result:
    def run(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return ""

    mem = 0
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        mem = next((int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemTotal")), 0)
    df = run(["df", "-T", str(work)]).splitlines()
    import safetensors
    import torch

    import snapcore

    src = str(Path(snapcore.__file__).resolve().parent.parent)
    commit = run(["git", "-C", src, "rev-parse", "--short", "HEAD"]).strip()
    changed = ["git", "-C", src, "status", "--porcelain", "-uno", "--", "snapcore", "csrc"]
    if commit and run(changed).strip():
        commit += " with uncommitted changes"
    hub = "not installed"
    with contextlib.suppress(ImportError):
        import huggingface_hub

        hub = huggingface_hub.__version__
    return {
        "cpu": common.cpu_model(""),
        "cores": os.cpu_count(),
        "ram_bytes": mem,
        "kernel": platform.release(),
        "fs": df[1].split()[1] if len(df) > 1 else "?",
        "dir": str(work),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "safetensors": safetensors.__version__,
        "huggingface_hub": hub,
        "commit": commit,
        "date": datetime.date.today().isoformat(),
    }


def skip_reason(job: str, prep: Result) -> str | None:
    if job == "hf_hub":
        try:
            import huggingface_hub  # noqa: F401
        except ImportError:
            return "huggingface_hub is not installed"
    if job == "consolidate":
        try:
            from torch.distributed.checkpoint import _consolidate_hf_safetensors  # noqa: F401
        except ImportError:
            return "this torch has no torch.distributed.checkpoint._consolidate_hf_safetensors"
        if "dcp_hf_error" in prep:
            return f"DCP's Hugging Face writer failed: {prep['dcp_hf_error']}"
    return None


def check_targets(r: Result) -> list[Result]:
    """Issue 11's targets, each as measured / limit from this run."""
    jobs, copies = r["jobs"], r["copies"]
    state = r["prepare"]["state"]
    rss_limit = 1 * GB + state["largest_bytes"]
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

    def rate(x: Result) -> float | None:
        return state["state_bytes"] / x["seconds"] if "seconds" in x else None

    def copy_rate(k: int) -> float | None:
        x = copies[k] if k < len(copies) else {}
        return x["written_bytes"] / x["seconds"] if "seconds" in x else None

    for conv, (before, after), alts, short in (
        ("convert_to_safetensors", (0, 1), TO_SAFETENSORS, "snapcore -> safetensors"),
        ("convert_to_snapcore", (1, 2), TO_SNAPCORE, "safetensors -> snapcore"),
        ("convert_to_torch", (2, 3), (*TO_TORCH, "dcp_to_torch_save"), "snapcore -> torch"),
    ):
        x = jobs.get(conv, {})
        near = [c for c in (copy_rate(before), copy_rate(after)) if c]
        best = max(near) if near else None
        add(
            f"{short}: >= 0.7 x the disk's copy speed",
            rate(x),
            0.7 * best if best else None,
            f"{_gbs(rate(x))} GB/s of tensors; the faster of the copies before and after it: "
            + ", ".join(f"{_gbs(c)}" for c in near)
            + " GB/s",
            le=False,
        )
        add(
            f"{short}: peak RSS <= 1 GB + largest tensor",
            x.get("peak_rss"),
            rss_limit,
            f"VmHWM of the process {_gbs(x.get('peak_rss'))} GB (of which "
            f"{_gbs(x.get('baseline_rss'))} GB before the call: Python, torch, snapcore); "
            f"largest tensor {state['largest_name']}, {_gbs(state['largest_bytes'])} GB",
            le=True,
        )
        timed = {a: jobs[a]["seconds"] for a in alts if "seconds" in jobs.get(a, {})}
        fastest = min(timed, key=timed.__getitem__) if timed else None
        add(
            f"{short}: faster than every alternative",
            x.get("seconds"),
            timed[fastest] if fastest else None,
            f"{_s(x.get('seconds'))} s against "
            + "; ".join(f"{a} {_s(s)} s" for a, s in timed.items())
            + (f" (fastest: {fastest})" if fastest else ""),
            le=True,
        )
    return targets


def render(r: Result) -> str:
    info, prep = r["info"], r["prepare"]
    state = prep["state"]
    p0, p1 = r["probes"]
    lines = [
        f"Command: `{r['command']}` ({r['total_s']:.0f} s in all)",
        "",
        f"Machine: {info['cores']} cores ({info['cpu']}), {info['ram_bytes'] / GIB:.1f} GiB RAM, "
        f"Linux {info['kernel']}, files on {info['fs']} (`{info['dir']}`); Python "
        f"{info['python']}, torch {info['torch']}, safetensors {info['safetensors']}, "
        f"huggingface_hub {info['huggingface_hub']}, snapcore at {info['commit'] or '?'}; "
        f"{info['date']}.",
        "",
        f"State: {state['state_bytes'] / GB:.3f} GB in {state['tensors']} tensors: "
        f"token embedding {state['vocab']} x {state['hidden']} fp32, {state['layers']} layers "
        f"(q/o {state['hidden']}^2, k/v {state['kv']} x {state['hidden']}, MLP "
        f"{state['mlp']} x {state['hidden']}, bf16; norms fp32), output head bf16; "
        + ", ".join(f"{k} {v / GB:.3f} GB" for k, v in state["bytes_by_dtype"].items())
        + f"; largest tensor {state['largest_name']} ({state['largest_bytes'] / GB:.3f} GB). "
        f"Shard size {r['shard_size']} ({r['shard_bytes']} bytes).",
        "",
        "Each row is one run in a fresh process, its source dropped from the page cache "
        "first, its output fsynced before the clock stops. GB/s: the state's tensor bytes "
        "(the copy: the data files' bytes) per second. Peak RSS: the process's VmHWM "
        "(Python, torch and snapcore included; before the call: the second figure). "
        "Others: cores other processes took meanwhile.",
        "",
        "| # | conversion | seconds | GB/s | peak RSS GB (before) | written GB | others | "
        "output equal to the source |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for k, (tag, x) in enumerate(r["order"]):
        label = LABELS[tag.split("#")[0]] + (f" ({tag.split('#')[1]})" if "#" in tag else "")
        if "skipped" in x:
            lines.append(f"| {k + 1} | {label} | skipped: {x['skipped']} | | | | | |")
            continue
        if "error" in x:
            lines.append(f"| {k + 1} | {label} | FAILED: {x['error']} | | | | | |")
            continue
        nbytes = x["written_bytes"] if tag.startswith("copy") else state["state_bytes"]
        check = x.get("check")
        ok = "—" if check is None else "yes" if check["equal"] else "NO: " + check["problems"][0]
        lines.append(
            f"| {k + 1} | {label} | {_s(x['seconds'])} | {_gbs(nbytes / x['seconds'])} | "
            f"{_gbs(x['peak_rss'])} ({_gbs(x['baseline_rss'])}) | {_gbs(x['written_bytes'])} | "
            f"{x['others']:.2f} | {ok} |"
        )
    lines += [
        "",
        f"Machine probes, at the start / at the end: O_DIRECT write of {_gbs(p0['bytes'])} GB "
        f"{_gbs(p0['odirect_Bps'])} / {_gbs(p1['odirect_Bps'])} GB/s; cold read of the store's "
        f"data files {_gbs(p0['cold_read_Bps'])} / {_gbs(p1['cold_read_Bps'])} GB/s (one "
        f"thread {_gbs(p0['cold_read_1t_Bps'])} / {_gbs(p1['cold_read_1t_Bps'])}, one per core "
        f"{_gbs(p0['cold_read_parallel_Bps'])} / {_gbs(p1['cold_read_parallel_Bps'])}).",
        "",
    ]
    lines += common.targets_table(r["targets"], "RSS")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--size-gb", type=float, default=4.0, help="state size (default 4)")
    p.add_argument(
        "--shard-size", default="1GB", help="safetensors shard size (default 1GB; e.g. 5GB)"
    )
    p.add_argument(
        "--dir", default=None, help="where to write (a fresh subdirectory; default under /tmp)"
    )
    p.add_argument("--json", default=None, help="write the raw figures here")
    p.add_argument("--markdown", default=None, help="write the report (markdown) here")
    p.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="do not check the outputs against the source (saves a read of each)",
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
        help="a tiny run that only checks the benchmark works (~10 MB state, 4 MB shards, "
        "no waiting for a quiet machine, every job in one child process); its figures "
        "mean nothing",
    )
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # child process mode
    p.add_argument("--child-batch", default=None, help=argparse.SUPPRESS)  # JOB:TAG,... (smoke)
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.size_gb, args.shard_size, args.quiet_wait = 0.01, "4MB", 0.0
    from snapcore.convert.run import parse_size

    args.shard_bytes = parse_size(args.shard_size)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    common.set_quiet(args.quiet_cores, args.quiet_wait)
    if args.child or args.child_batch:
        work = Path(args.dir)
        if args.child:
            Path(args.child_out).write_text(json.dumps(child_job(args.child, args, work), indent=1))
            return 0
        for item in args.child_batch.split(","):  # --smoke: every job in this one process
            job, tag = item.split(":")
            (work / f"{tag}.json").write_text(json.dumps(child_job(job, args, work), indent=1))
            shutil.rmtree(work / f"out-{job}", ignore_errors=True)
            print(f"[{tag}] done", flush=True)
        Path(args.child_out).write_text("{}")
        return 0
    command = "python benchmarks/bench_convert.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    t0 = time.perf_counter()
    with common.work_dir(args.dir, prefix="snapcore-bench-convert-") as work:
        r: Result = {"command": command.strip(), "info": machine_info(work)}
        r["shard_size"], r["shard_bytes"] = args.shard_size, args.shard_bytes
        r["prepare"] = run_child(["--child", "prepare"], args, work, "prepare")
        if "error" in r["prepare"]:
            raise SystemExit("preparing the state failed: see above")
        steps = [("copy", "copy#before"), ("convert_to_safetensors", "convert_to_safetensors")]
        steps += [(job, job) for job in TO_SAFETENSORS]
        steps += [("copy", "copy#between"), ("convert_to_snapcore", "convert_to_snapcore")]
        steps += [(job, job) for job in TO_SNAPCORE]
        steps += [("copy", "copy#after"), ("convert_to_torch", "convert_to_torch")]
        steps += [(job, job) for job in TO_TORCH] + [("copy", "copy#end")]
        skipped = {job: skip_reason(job, r["prepare"]) for job, _ in steps}
        for job, reason in skipped.items():
            if reason:
                print(f"[{job}] skipped: {reason}", flush=True)
        todo = [("probes", "probes-start")]
        todo += [(job, tag) for job, tag in steps if not skipped[job]]
        todo += [("probes", "probes-end")]
        results = dict(zip((tag for _, tag in todo), run_children(todo, args, work), strict=True))
        r["probes"] = [results["probes-start"], results["probes-end"]]
        order = [(tag, results.get(tag, {"skipped": skipped[job]})) for job, tag in steps]
        r["order"] = order
        r["copies"] = [x for (job, _), (_, x) in zip(steps, order, strict=True) if job == "copy"]
        r["jobs"] = {job: x for (job, _), (_, x) in zip(steps, order, strict=True) if job != "copy"}
        r["targets"] = check_targets(r)
    r["total_s"] = time.perf_counter() - t0
    text = render(r)
    print()
    print(text)
    for t in r["targets"]:
        print(f"{t['status']:4}  {t['target']}: {t['detail']}")
    print(f"total {r['total_s']:.0f}s")
    common.write_figures(args.json, r, args.markdown, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
