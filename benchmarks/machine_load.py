"""Other processes' CPU load, for the benchmarks: this machine is shared (other people's
tests and builds run on its 2 cores), so timings wait for a quiet moment and report what
others took meanwhile."""

from __future__ import annotations

import os
import time

CLK_TCK = os.sysconf("SC_CLK_TCK")


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
