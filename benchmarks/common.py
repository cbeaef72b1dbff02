"""What the benchmarks share: other processes' CPU load and waits for a quiet machine,
probes of the machine (memcpy, O_DIRECT and buffered writes, cold reads, page-cache
drops, memory), a description of the machine, and writing the figures out.

This machine is shared (other people's tests and builds run on its 2 cores), so timings
wait for a quiet moment first and report what others took meanwhile. The benchmarks run
as scripts (``python benchmarks/NAME.py``), which puts this folder on ``sys.path``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- other processes' load --------------------------------------------------------------------
def jiffies() -> tuple[int, int]:
    """(busy jiffies of all CPUs, steal included; jiffies of this process's threads)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return sum(v) - v[3] - v[4], int(fields[11]) + int(fields[12])  # less idle and iowait


class Others:
    """The CPU, in cores, that other processes took during a ``with`` block."""

    cores = 0.0

    def __enter__(self) -> Others:
        self._start, self._t0 = jiffies(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        (busy, own), (busy0, own0) = jiffies(), self._start
        elapsed = max(time.perf_counter() - self._t0, 1e-9)
        self.cores = max(0, (busy - busy0) - (own - own0)) / CLK_TCK / elapsed


def wait_for_quiet(cores: float, max_wait_s: float, probe_s: float = 0.3) -> None:
    """Wait (``max_wait_s`` at most) until other processes take less than ``cores``."""
    deadline = time.monotonic() + max_wait_s
    while time.monotonic() < deadline:
        with Others() as others:
            time.sleep(probe_s)
        if others.cores < cores:
            return


@dataclass
class Quiet:
    """How long each timing waits for a quiet machine first (a benchmark sets it from its
    options with `set_quiet`)."""

    cores: float = 0.25  # wait until other processes take less CPU than this ...
    max_wait_s: float = 2.0  # ... but for at most this many seconds
    probe_s: float = 0.3  # the window in which their load is measured


QUIET = Quiet()


def set_quiet(cores: float, max_wait_s: float, probe_s: float = 0.3) -> None:
    QUIET.cores, QUIET.max_wait_s, QUIET.probe_s = cores, max_wait_s, probe_s


def settle() -> None:
    """Wait (`QUIET.max_wait_s` at most) until other processes leave the CPUs nearly idle."""
    wait_for_quiet(QUIET.cores, QUIET.max_wait_s, QUIET.probe_s)


@dataclass
class Timing:
    wall_s: float
    cpu_s: float  # this process's CPU time during the call
    others: float  # the cores other processes took meanwhile


def timed(fn: Callable[[], object]) -> Timing:
    """One call of ``fn``, started once the machine is quiet (or the wait is over)."""
    settle()
    with Others() as others:
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return Timing(wall, cpu, others.cores)


def rate(fn: Callable[[], object], nbytes: int) -> float:
    """Bytes per second of one call of ``fn`` that moves ``nbytes``, on a quiet machine."""
    return nbytes / timed(fn).wall_s


# -- probes of the machine --------------------------------------------------------------------
def copy_rate(dst: int, src: int, nbytes: int, nontemporal: bool = False) -> float:
    """One copy_host of ``nbytes`` between pre-faulted addresses: bytes per second."""
    from snapcore import _native

    return rate(lambda: _native.copy_host([(dst, src, nbytes)], 0, nontemporal=nontemporal), nbytes)


def write_rate(
    path: str | Path, pieces: Sequence[tuple[int, int, int]], direct: bool
) -> tuple[float, bool]:
    """Writes each (file offset, address, bytes) of ``pieces`` to ``path`` (O_DIRECT where
    ``direct`` and the file system takes it), fdatasync and close included: (bytes per
    second, whether O_DIRECT was in use). The file is left in place."""
    from snapcore import _native

    writer: list[_native.FileWriter] = []

    def write() -> None:
        with _native.FileWriter(str(path), direct=direct) as w:
            writer.append(w)
            for offset, address, n in pieces:
                w.write_at(offset, address, n)
            w.sync()

    return rate(write, sum(n for _, _, n in pieces)), writer[0].direct


def drop_page_cache(paths: Sequence[str]) -> bool:
    """Evict these files from the page cache; False where the kernel refused one."""
    from snapcore import _native

    return all([_native.drop_page_cache(p) for p in paths])  # every one, even after a refusal


def cold_read_rate(
    path: str, reads: Sequence[tuple[int, int, int]], streams: int | None = None, threads: int = 1
) -> tuple[float, bool]:
    """Reads each (file offset, bytes, address) of ``reads`` from ``path`` after dropping
    it from the page cache: (bytes per second, whether the drop worked). ``streams``
    None reads in this thread, one read after the other, each on ``threads`` threads of
    read_into; otherwise ``streams`` reads are in flight at once."""
    from snapcore import _native

    def read() -> None:
        if streams is None:
            for o, n, a in reads:
                _native.read_into(path, o, n, a, threads=threads)
            return
        with ThreadPoolExecutor(streams) as pool:
            for f in [pool.submit(_native.read_into, path, o, n, a) for o, n, a in reads]:
                f.result()

    dropped = drop_page_cache([path])
    return rate(read, sum(n for _, n, _ in reads)), dropped


def status_bytes(field: str, pid: int | str = "self") -> int:
    """A memory figure of ``/proc/PID/status`` (``VmRSS``, ``VmHWM``) in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no {field}")


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_two_nodes(
    argv: Callable[[int], list[str]],
    env: Callable[[int], dict[str, str]],
    logs: Callable[[int], Path],
    timeout_s: float,
    avoid: Sequence[int] = (),
    what: str = "job",
) -> None:
    """Run a job of 2 nodes x 1 rank on 127.0.0.1: rank ``r`` runs ``argv(r)`` with the
    environment torchrun gives its workers plus ``env(r)``, its output in ``logs(r)``,
    the job's port not one of ``avoid``. Waits for both (at most ``timeout_s``, then
    kills them); raises with ``what`` and the log's tail of a rank that failed."""
    port = free_port()
    while port in avoid:
        port = free_port()
    procs = []
    for rank in range(2):
        full = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "1",
            "GROUP_RANK": str(rank),  # a node each
            "GLOO_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1",
            **env(rank),
        }
        log = open(logs(rank), "wb")  # noqa: SIM115 (the child keeps it)
        procs.append(subprocess.Popen(argv(rank), env=full, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, p in enumerate(procs):
        if p.returncode != 0:
            tail = logs(rank).read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{what}: rank {rank} exited {p.returncode}:\n{tail}")


# -- the machine and the figures --------------------------------------------------------------
def cpu_model(default: str = "?") -> str:
    """The CPU's model name from /proc/cpuinfo, or ``default``."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        return next(
            (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), default
        )
    return default


def write_figures(
    json_path: str | Path | None, doc: Any, markdown_path: str | Path | None = None, text: str = ""
) -> None:
    """Write the raw figures as JSON and the report as markdown, where asked."""
    if json_path:
        Path(json_path).write_text(json.dumps(doc, indent=1))
    if markdown_path:
        Path(markdown_path).write_text(text)


@contextlib.contextmanager
def work_dir(base: str | None, prefix: str = "snapcore-bench-") -> Iterator[Path]:
    """A fresh directory for a run's files (under ``base``, default the temp directory),
    removed at the end."""
    parent = base or tempfile.gettempdir()
    Path(parent).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def fmt_s(x: float | None) -> str:
    """Seconds for a table: 3 decimals under 10 s, else 2; a dash for no figure."""
    return "—" if x is None else f"{x:.3f}" if x < 10 else f"{x:.2f}"


def fmt_gb(x: float | None) -> str:
    """Bytes (or bytes/s) in GB for a table, 2 decimals; a dash for no figure."""
    return "—" if x is None else f"{x / 1e9:.2f}"


def targets_table(targets: Sequence[dict[str, Any]], memory_word: str) -> list[str]:
    """The Markdown table of a run's targets (measured, limit, ratio, result) and a line
    of detail per target. A target whose name holds ``memory_word`` is in GB, one with
    ">=" a rate in GB/s, any other a time in seconds."""
    lines = ["| target | measured | limit | ratio | result |", "| --- | --- | --- | --- | --- |"]
    for t in targets:
        if t["status"] == "N/A":
            lines.append(f"| {t['target']} | {t['detail']} | | | N/A |")
            continue
        if memory_word in t["target"]:
            value, limit = f"{fmt_gb(t['value'])} GB", f"{fmt_gb(t['limit'])} GB"
        elif ">=" in t["target"]:
            value, limit = f"{fmt_gb(t['value'])} GB/s", f"{fmt_gb(t['limit'])} GB/s"
        else:
            value, limit = f"{fmt_s(t['value'])} s", f"{fmt_s(t['limit'])} s"
        lines.append(f"| {t['target']} | {value} | {limit} | {t['ratio']:.2f} | {t['status']} |")
    lines.append("")
    lines += [f"- {t['target']}: {t['detail']}" for t in targets]
    return lines
