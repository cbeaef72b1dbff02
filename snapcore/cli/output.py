"""What the verbs print: sizes, times and names that are safe on a terminal."""

from __future__ import annotations

import datetime as dt
import sys


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def clean(text: object) -> str:
    """``text`` with every non-printable character escaped (``\\x1b``, ``\\n``): names and
    values come from snapshots, which may be hostile, and a raw escape sequence would
    drive the terminal."""
    s = str(text)
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in s)


def when(unix: float) -> str:
    """A manifest's time as local date and time; '?' for one no calendar holds."""
    try:
        return dt.datetime.fromtimestamp(unix).strftime("%Y-%m-%d %H:%M:%S")
    except (OverflowError, OSError, ValueError):
        return "?"


class Progress:
    """A one-line progress bar on stderr, drawn only when stderr is a terminal."""

    def __init__(self, label: str, *, enabled: bool) -> None:
        self.label = label
        self.enabled = enabled and sys.stderr.isatty()

    def update(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        frac = done / total if total else 1.0
        bar = "#" * int(frac * 30)
        sys.stderr.write(
            f"\r{self.label} [{bar:<30}] {frac:6.1%} {human_bytes(done)}/{human_bytes(total)}"
        )
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
