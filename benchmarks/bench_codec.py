"""Ratio and speed of snapcore's chunk codecs on model weights and Adam optimizer state.

Data (fp32 unless said):
- weights: one tensor of ``--size-mb`` MB drawn as ``randn * 0.02`` (a transformer's
  initialisation scale), and the same values in bf16;
- exp_avg and exp_avg_sq: Adam's state after ``--adam-steps`` real steps of an MLP whose
  parameters take ``--size-mb`` MB (4 square Linear layers, random regression data).

Each is cut into 64 MiB chunks, as snapcore stores blobs, and encoded and decoded with
each codec (zstd and shuffle-zstd at levels 1 and 3) on 1 thread, then on 2 threads of a
ThreadPoolExecutor taking chunks in turn, the way snapcore's chunk pool runs them. Every
decode is checked bit for bit.

Speeds are raw bytes over wall time (GB = 1e9 bytes), best of ``--repeats``. This
machine is shared with other jobs, so each timed run first waits (up to ``--max-wait``
seconds) until other processes take less than ``--quiet-cores`` of the CPUs, and the
table shows how many cores they took during the timings it reports, next to the speed per
CPU-second of this process, which depends less on them.

    python benchmarks/bench_codec.py                  # 256 MB tensors, a few minutes
    python benchmarks/bench_codec.py --size-mb 64     # a quick run
    python benchmarks/bench_codec.py --markdown out.md
    python benchmarks/bench_codec.py --smoke          # does it run? (test_benchmarks.py)

The test suite runs only its --smoke run (tests/integration/test_benchmarks.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import shlex
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import common
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
    encode: dict[int, float]  # threads -> bytes per second of wall time
    decode: dict[int, float]
    encode_cpu: float  # bytes per CPU-second of this process, on one thread
    decode_cpu: float
    others: float  # the most cores other processes took during one of the row's timings


@dataclass
class Settings:
    repeats: int
    quiet_cores: float  # before each timed run, wait until other processes take less ...
    max_wait: float  # ... but for at most this many seconds


# -- timings -------------------------------------------------------------------------------
def best_time(fn: Callable[[], object], settings: Settings) -> tuple[float, float, float]:
    """The shortest wall time of `repeats` calls, each started once the machine is quiet
    (or the wait is over), with this process's CPU time in that call and the cores other
    processes took meanwhile."""
    best = (float("inf"), 0.0, 0.0)
    for _ in range(settings.repeats):
        t = common.timed(fn)
        best = min(best, (t.wall_s, t.cpu_s, t.others))
    return best


# -- data ----------------------------------------------------------------------------------
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


# -- measurements --------------------------------------------------------------------------
def measure(name: str, t: torch.Tensor, settings: Settings) -> list[Row]:
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

        wall: dict[tuple[str, int], float] = {}
        cpu: dict[str, float] = {}
        others = 0.0
        for threads in (1, 2):
            with ThreadPoolExecutor(threads) as pool:
                for step, fn, items in (
                    ("encode", encode_one, parts),
                    ("decode", decode_one, jobs),
                ):

                    def run_all(fn: Callable = fn, items: list = items, pool=pool) -> None:
                        for _ in pool.map(fn, items):
                            pass

                    out.zero_()
                    seconds, cpu_seconds, busy = best_time(run_all, settings)
                    wall[step, threads] = nbytes / seconds
                    others = max(others, busy)
                    if threads == 1:
                        cpu[step] = nbytes / cpu_seconds
            if not torch.equal(out.view(torch.uint8), t.view(torch.uint8)):
                raise AssertionError(f"{name} {codec_name} level {level}: decode differs")
        ratio = nbytes / sum(len(s) for s in stored)
        row = Row(
            name,
            codec_name,
            level,
            ratio,
            {n: wall["encode", n] for n in (1, 2)},
            {n: wall["decode", n] for n in (1, 2)},
            cpu["encode"],
            cpu["decode"],
            others,
        )
        rows.append(row)
        print(format_row(row), file=sys.stderr, flush=True)
    return rows


def shuffle_speed(settings: Settings) -> dict[int, tuple[float, float]]:
    """byte_shuffle and byte_unshuffle alone on one 64 MiB chunk, one thread: bytes/s."""
    a = torch.randint(0, 256, (CHUNK,), dtype=torch.uint8)
    b = torch.empty_like(a)
    speeds = {}
    for es in (2, 4, 8):

        def shuffle(es: int = es) -> None:
            _native.byte_shuffle(b.data_ptr(), a.data_ptr(), CHUNK, es, 1)

        def unshuffle(es: int = es) -> None:
            _native.byte_unshuffle(a.data_ptr(), b.data_ptr(), CHUNK, es, 1)

        shuffle()
        speeds[es] = (
            CHUNK / best_time(shuffle, settings)[0],
            CHUNK / best_time(unshuffle, settings)[0],
        )
    return speeds


# -- report --------------------------------------------------------------------------------
def machine() -> str:
    cpu = common.cpu_model()
    cores = len(os.sched_getaffinity(0))
    return (
        f"{cores} cores ({cpu}), Python {platform.python_version()}, torch {torch.__version__},"
        f" zstandard {zstandard.__version__} (zstd {'.'.join(map(str, zstandard.ZSTD_VERSION))})"
    )


def format_row(r: Row) -> str:
    cells = [r.data, r.codec, str(r.level), f"{r.ratio:.3f}"]
    cells += [f"{x / GB:.2f}" for x in (r.encode[1], r.encode[2], r.decode[1], r.decode[2])]
    cells += [f"{r.encode_cpu / GB:.2f}", f"{r.decode_cpu / GB:.2f}", f"{r.others:.2f}"]
    return "| " + " | ".join(cells) + " |"


def markdown(rows: list[Row], shuffles: dict[int, tuple[float, float]], command: str) -> str:
    lines = [
        f"Measured {datetime.date.today().isoformat()} on {machine()}, with",
        f"`{command}`. Chunks of 64 MiB; ratio = raw bytes / stored bytes; speeds in GB",
        "(1e9 bytes) of raw data per second of wall time, best of the run's repeats, and per",
        'CPU-second of the benchmark\'s process (1 thread); "others" is the most CPU, in',
        "cores, that other processes took during one of the row's timings.",
        "",
        "| data | codec | level | ratio | encode GB/s, 1 thread | 2 threads "
        "| decode GB/s, 1 thread | 2 threads | encode GB per CPU-s | decode GB per CPU-s "
        "| others |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    lines += [format_row(r) for r in rows]
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
    parser.add_argument("--quiet-cores", type=float, default=0.2)
    parser.add_argument("--max-wait", type=float, default=60.0, help="seconds")
    parser.add_argument("--markdown", help="also write the table to this file")
    parser.add_argument("--json", help="also write the figures (bytes per second) as JSON")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a tiny run that only checks the benchmark works (4 MB, one repeat, no waiting)",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.size_mb, args.adam_steps, args.repeats, args.max_wait = 4, 1, 1, 0.0
    settings = Settings(args.repeats, args.quiet_cores, args.max_wait)
    common.set_quiet(args.quiet_cores, args.max_wait, probe_s=0.5)
    command = shlex.join(["python", "benchmarks/bench_codec.py", *(argv or sys.argv[1:])])

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
        rows += measure(name, t.contiguous(), settings)
    shuffles = shuffle_speed(settings)
    text = markdown(rows, shuffles, command)
    print(text)
    doc = {
        "command": command,
        "size_mb": args.size_mb,
        "repeats": args.repeats,
        "rows": [dataclasses.asdict(r) for r in rows],
        "shuffle": {
            str(es): {"shuffle_Bps": s, "unshuffle_Bps": u} for es, (s, u) in shuffles.items()
        },
    }
    common.write_figures(args.json, doc, args.markdown, text)


if __name__ == "__main__":
    main()
