"""Ratio and speed of snapcore's chunk codecs on model weights and Adam optimizer state.

Data (fp32 unless said):
- weights: one tensor of ``--size-mb`` MB drawn as ``randn * 0.02`` (a transformer's
  initialisation scale), and the same values in bf16;
- exp_avg and exp_avg_sq: Adam's state after ``--adam-steps`` real steps of an MLP whose
  parameters take ``--size-mb`` MB (4 square Linear layers, random regression data).

Each is cut into 64 MiB chunks, as snapcore stores blobs, and encoded and decoded with
each codec (zstd and shuffle-zstd at levels 1 and 3) on 1 thread, then on 2 threads of a
ThreadPoolExecutor taking chunks in turn, the way snapcore's chunk pool runs them. Speeds
are raw bytes over wall time (GB = 1e9 bytes), best of ``--repeats``: this machine is a
shared virtual machine whose speeds drift. Every decode is checked bit for bit.

    python benchmarks/bench_codec.py                  # 256 MB tensors, a few minutes
    python benchmarks/bench_codec.py --size-mb 64     # a quick run
    python benchmarks/bench_codec.py --markdown out.md

Never run by the test suite.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import zstandard

from snapcore import _native, codec

GB = 1e9
MiB = 1 << 20
CHUNK = 64 * MiB  # snapcore's chunk size (docs/format.md)
CODECS = (("zstd", 1), ("zstd", 3), ("shuffle-zstd", 1), ("shuffle-zstd", 3))


@dataclass
class Row:
    data: str
    codec: str
    level: int
    ratio: float
    encode: dict[int, float]  # threads -> bytes/s of wall time
    decode: dict[int, float]
    encode_cpu: float  # bytes per CPU-second of this process, on one thread
    decode_cpu: float


def adam_state(size_mb: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """exp_avg and exp_avg_sq of all parameters, flattened, after `steps` Adam steps."""
    width = int((size_mb * 1e6 / 4 / 4) ** 0.5)  # 4 layers of width x width fp32
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *(m for _ in range(4) for m in (torch.nn.Linear(width, width), torch.nn.GELU()))
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(64, width)
    y = torch.randn(64, width)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    states = [opt.state[p] for p in model.parameters()]
    exp_avg = torch.cat([s["exp_avg"].reshape(-1) for s in states])
    exp_avg_sq = torch.cat([s["exp_avg_sq"].reshape(-1) for s in states])
    return exp_avg, exp_avg_sq


def chunks(t: torch.Tensor) -> list[tuple[int, memoryview]]:
    """(byte offset, bytes) of each 64 MiB chunk of a contiguous tensor."""
    raw = memoryview(t.view(torch.uint8).numpy()).cast("B")
    return [(off, raw[off : off + CHUNK]) for off in range(0, raw.nbytes, CHUNK)]


def best_time(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """The shortest wall time of `repeats` calls, and the least CPU time (all of this
    process's threads) of one call."""
    best = cpu = float("inf")
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        cpu = min(cpu, time.process_time() - c0)
    return best, cpu


def measure(name: str, t: torch.Tensor, repeats: int) -> list[Row]:
    parts = chunks(t)
    nbytes = t.numel() * t.element_size()
    es = t.element_size()
    out = torch.empty_like(t)
    rows = []
    for codec_name, level in CODECS:

        def encode_one(part: tuple[int, memoryview], c: str = codec_name, lv: int = level):
            return codec.encode(part[1], codec=c, element_size=es, level=lv)

        stored = [bytes(s) for s in map(encode_one, parts)]
        jobs = [(off, s, part.nbytes) for (off, part), s in zip(parts, stored, strict=True)]

        def decode_one(job: tuple[int, bytes, int], c: str = codec_name) -> None:
            off, s, n = job
            codec.decode(s, codec=c, element_size=es, raw_length=n, out=out.data_ptr() + off)

        enc: dict[int, float] = {}
        dec: dict[int, float] = {}
        cpu: dict[str, float] = {}
        for threads in (1, 2):
            with ThreadPoolExecutor(threads) as pool:

                def run_all(fn: Callable, items: list, pool: ThreadPoolExecutor = pool) -> None:
                    for _ in pool.map(fn, items):
                        pass

                wall, cpu_s = best_time(lambda: run_all(encode_one, parts), repeats)
                enc[threads] = nbytes / wall
                if threads == 1:
                    cpu["encode"] = nbytes / cpu_s
                out.zero_()
                wall, cpu_s = best_time(lambda jobs=jobs: run_all(decode_one, jobs), repeats)
                dec[threads] = nbytes / wall
                if threads == 1:
                    cpu["decode"] = nbytes / cpu_s
                if not torch.equal(out.view(torch.uint8), t.view(torch.uint8)):
                    raise AssertionError(f"{name} {codec_name} level {level}: decode differs")
        ratio = nbytes / sum(len(s) for s in stored)
        rows.append(Row(name, codec_name, level, ratio, enc, dec, cpu["encode"], cpu["decode"]))
        print(
            f"  {name:<22} {codec_name:<12} {level}  ratio {ratio:.3f}  "
            f"encode {enc[1] / GB:.2f}/{enc[2] / GB:.2f}  decode {dec[1] / GB:.2f}/"
            f"{dec[2] / GB:.2f} GB/s (1/2 threads); per CPU-second {cpu['encode'] / GB:.2f}/"
            f"{cpu['decode'] / GB:.2f}",
            file=sys.stderr,
            flush=True,
        )
    return rows


def shuffle_speed(repeats: int) -> dict[int, tuple[float, float]]:
    """byte_shuffle and byte_unshuffle alone on one 64 MiB chunk, one thread: GB/s."""
    a = torch.randint(0, 256, (CHUNK,), dtype=torch.uint8)
    b = torch.empty_like(a)
    speeds = {}
    for es in (2, 4, 8):
        _native.byte_shuffle(b.data_ptr(), a.data_ptr(), CHUNK, es, 1)
        s, _ = best_time(
            lambda es=es: _native.byte_shuffle(b.data_ptr(), a.data_ptr(), CHUNK, es, 1), repeats
        )
        u, _ = best_time(
            lambda es=es: _native.byte_unshuffle(a.data_ptr(), b.data_ptr(), CHUNK, es, 1), repeats
        )
        speeds[es] = (CHUNK / s, CHUNK / u)
    return speeds


def machine() -> str:
    cpu = "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    cores = len(os.sched_getaffinity(0))
    return (
        f"{cores} cores ({cpu}), Python {platform.python_version()}, torch {torch.__version__},"
        f" zstandard {zstandard.__version__} (zstd {'.'.join(map(str, zstandard.ZSTD_VERSION))})"
    )


def load_average() -> str:
    with open("/proc/loadavg") as f:
        return f.read().split()[0]


def markdown(
    rows: list[Row], shuffles: dict[int, tuple[float, float]], command: str, load: str
) -> str:
    lines = [
        f"Measured {datetime.date.today().isoformat()} on {machine()}, with",
        f"`{command}` (1-minute load average {load}: at 2 and more, other jobs shared the",
        "cores and the wall-time speeds, 2 threads above all, are low and noisy; the speeds",
        "per CPU-second hold regardless). Chunks of 64 MiB; ratio = raw bytes / stored",
        "bytes; speeds in GB (1e9 bytes) of raw data per second, best of the run's repeats.",
        "",
        "| data | codec | level | ratio | encode GB/s 1 thread | 2 threads "
        "| decode GB/s 1 thread | 2 threads | encode GB per CPU-s | decode GB per CPU-s |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r.data} | {r.codec} | {r.level} | {r.ratio:.3f} | {r.encode[1] / GB:.2f} "
            f"| {r.encode[2] / GB:.2f} | {r.decode[1] / GB:.2f} | {r.decode[2] / GB:.2f} "
            f"| {r.encode_cpu / GB:.2f} | {r.decode_cpu / GB:.2f} |"
        )
    lines += [
        "",
        "byte_shuffle / byte_unshuffle alone, one thread, one 64 MiB chunk: "
        + ", ".join(
            f"{es}-byte elements {s / GB:.1f} / {u / GB:.1f} GB/s"
            for es, (s, u) in shuffles.items()
        )
        + ".",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=int, default=256, help="fp32 tensor size (MB)")
    parser.add_argument("--adam-steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--markdown", help="also write the table to this file")
    args = parser.parse_args(argv)
    command = "python benchmarks/bench_codec.py " + shlex.join(
        argv if argv is not None else sys.argv[1:]
    )

    loads = [load_average()]
    print(f"building data: {args.size_mb} MB tensors ...", file=sys.stderr, flush=True)
    torch.manual_seed(1)
    weights = torch.randn(args.size_mb * 1_000_000 // 4) * 0.02
    exp_avg, exp_avg_sq = adam_state(args.size_mb, args.adam_steps)
    data = [
        ("weights fp32 (randn*0.02)", weights),
        ("weights bf16", weights.bfloat16()),
        (f"Adam exp_avg ({args.adam_steps} steps)", exp_avg),
        (f"Adam exp_avg_sq ({args.adam_steps} steps)", exp_avg_sq),
    ]
    rows = []
    for name, t in data:
        rows += measure(name, t.contiguous(), args.repeats)
    shuffles = shuffle_speed(max(3, args.repeats))
    loads.append(load_average())
    text = markdown(rows, shuffles, command.strip(), " at the start, ".join(loads) + " at the end")
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
