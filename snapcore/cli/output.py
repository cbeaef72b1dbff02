"""What the verbs print: sizes, times and names that are safe on a terminal."""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import sys
from collections.abc import Callable, Iterator


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


def add_progress_args(p: argparse.ArgumentParser) -> None:
    """``--quiet`` and ``--progress``: the bar is drawn on stderr when it is a terminal,
    unless one of them says otherwise."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    g.add_argument(
        "--progress", action="store_true", help="draw the progress bar even when not on a terminal"
    )


def progress_enabled(args: argparse.Namespace) -> bool:
    """Whether the verb's progress bar is drawn: ``--progress``, else not ``--quiet`` and
    stderr is a terminal."""
    if getattr(args, "progress", False):
        return True
    return not getattr(args, "quiet", False) and sys.stderr.isatty()


@contextlib.contextmanager
def progress(
    total: float | None, description: str, enabled: bool, *, unit: str = "bytes"
) -> Iterator[Callable[..., None]]:
    """A progress bar on stderr (rich): ``with progress(n, "verify") as advance:``, then
    ``advance(k)`` as each ``k`` bytes (``unit="bytes"``: bytes/s and ETA) or items are
    done; ``advance(k, total=n)`` also sets the total once it is known (``total=None``:
    not known yet, no ETA). ``advance`` may be called from worker threads. Disabled
    (``enabled=False``): ``advance`` does nothing and nothing is drawn."""
    if not enabled:
        yield _nothing
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        TaskProgressColumn,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    # forced: --progress on a pipe or file still gets the bar (and its final state)
    console = Console(file=sys.stderr, force_terminal=True if not sys.stderr.isatty() else None)
    counts = (
        [DownloadColumn(binary_units=True), TransferSpeedColumn()]
        if unit == "bytes"
        else [MofNCompleteColumn()]
    )
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        *counts,
        TimeRemainingColumn(),
        console=console,
        transient=False,
        # a line printed meanwhile goes above the bar, on the terminal both share
        redirect_stdout=sys.stdout.isatty() and sys.stderr.isatty(),
        redirect_stderr=False,
    )
    with bar:
        task = bar.add_task(clean(description), total=total)

        def advance(n: float, total: float | None = None) -> None:
            if total is not None:
                bar.update(task, total=total)
            bar.advance(task, n)

        yield advance
        bar.refresh()


def _nothing(n: float, total: float | None = None) -> None:
    pass
