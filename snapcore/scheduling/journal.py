"""The run journal: the starts, restores, snapshots and exits of the runs of one store.

Why a journal: the scheduler plans with the failure rate of *this* run's cluster, and the
only record of a crash is what was written before it. Each process that trains on a
store appends a few events to ``journal.jsonl``; a start that is not followed by a clean
exit is a failure, and the tier the next run restored from tells which kind (host memory
survived: the process crashed; otherwise the machine was lost).

Where: at the root of the store's local tier, else in its host-memory area (which a lost
machine takes with it). A store with object storage only keeps no journal: appending to
an object is not possible, and rewriting one per event is neither atomic nor cheap.

Format (one JSON object per line, UTF-8, ``\\n``-terminated; ``v`` is the format version)::

    {"v":1,"event":"start","time":T,"run":ID,"pid":P,"host":H,"devices":N}  (+ "tiers")
    {"v":1,"event":"restore","time":T,"run":ID,"step":S,"tier":"host"}   (+ "rollback":true)
    {"v":1,"event":"snapshot","time":T,"run":ID,"step":S,"tiers":["host","local"]}
    {"v":1,"event":"alive","time":T,"run":ID}                              (a heartbeat)
    {"v":1,"event":"exit","time":T,"run":ID,"clean":true}                (+ "reason")

What counts as a failure: an unclean end (no clean ``exit``) or a rollback, except in a
run shorter than ``MIN_RUN_S`` of exposure (a test, or a job that died on start: not the
machine's doing, and a handful of them would otherwise make the rate absurd), and except
an end by the user's own interrupt (an ``exit`` whose reason is ``KeyboardInterrupt`` or
``SystemExit``, as the Checkpointer's context manager journals it).

Writing: each event is one ``os.write`` of a whole line on an ``O_APPEND`` descriptor,
then ``fdatasync``, so a killed process leaves at most one torn line, at the end; a writer
that finds the file not ending in a newline ends that torn line first, so later events
stay parseable. A live writer holds an exclusive ``flock`` on the file: the kernel drops
it when the process dies however it dies, which is how a reader tells a run that is
still going from one that crashed.

Reading never raises on a damaged journal and never unpickles: bad lines are skipped and
counted, a torn last line is reported.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..durable import fsync_dir
from .rate import CORRELATED, MACHINE, PROCESS, RateEstimate, RatePrior, estimate_from_history

if TYPE_CHECKING:
    from typing import TypeAlias

    from ..tiers import Store

    StoreLike: TypeAlias = Store | str | os.PathLike[str]

log = logging.getLogger(__name__)

JOURNAL_NAME = "journal.jsonl"
FORMAT_VERSION = 1
KINDS = ("start", "restore", "snapshot", "alive", "exit")
TIER_ORDER = ("host", "peer", "local", "remote")  # fastest first (no torch import here)
UNKNOWN = "unknown"  # the class of a failure whose next run restored nothing (or not yet)
MAX_LINE_BYTES = 16 << 10  # an event is ~150 bytes; a longer line is not ours
MAX_READ_BYTES = 64 << 20  # a reader looks at most at the newest 64 MiB (~400k events)
# A run with less exposure than this (its start to its last event) is not counted as a
# failure however it ended: test runs and jobs that die on start are not the machine's.
MIN_RUN_S = 60.0
# Exits that are the user's (or the program's) own decision, not a failure.
USER_EXITS = frozenset({"KeyboardInterrupt", "SystemExit"})


# -- where ----------------------------------------------------------------------------------


def journal_path(store: StoreLike) -> Path | None:
    """The journal file of ``store``; ``None`` for a store with object storage only.

    A path to a ``.jsonl`` file is taken as the journal itself (for `snapcore journal`).
    """
    # Imported here: the tiers pull in torch, and the journal itself needs none of it
    # (a crash test's child process appends without paying for that import).
    from ..tiers import HostTier, Store, as_store

    if not isinstance(store, Store):
        text = os.fspath(store)
        if text.endswith(".jsonl"):
            return Path(text).absolute()
    s = as_store(store)
    if s.local is not None:
        return Path(s.local) / JOURNAL_NAME
    if s.host is not None:
        return HostTier(s.host).root / JOURNAL_NAME
    return None


# -- writing --------------------------------------------------------------------------------


class JournalWriter:
    """Appends the events of one run (``run``) to a journal file; one per process.

    Every append is durable when it returns (``fdatasync``): a handful of events per run,
    so the cost does not matter, and an event lost in a crash would hide a failure.
    """

    def __init__(self, path: str | os.PathLike[str], run: str | None = None) -> None:
        self.path = Path(path)
        self.run = run or uuid.uuid4().hex[:16]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        created = not self.path.exists()
        self._fd: int | None = os.open(
            self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644
        )
        try:
            self.owner = _try_flock(self._fd, fcntl.LOCK_EX)
            if not self.owner:
                log.warning(
                    "journal %s is held by another live process: two runs on one store? "
                    "(this one is journaled, but readers may take it for that one)",
                    self.path,
                )
            self._end_torn_line()
            if created:
                _fsync_dir(self.path.parent)
        except BaseException:
            os.close(self._fd)
            self._fd = None
            raise

    def _end_torn_line(self) -> None:
        """A crash mid-append left a line without its newline: end it, so the next event
        starts a line of its own (the torn one is then skipped by readers, alone)."""
        assert self._fd is not None
        size = os.fstat(self._fd).st_size
        if size and os.pread(self._fd, 1, size - 1) != b"\n":
            os.write(self._fd, b"\n")
            os.fdatasync(self._fd)

    def append(self, kind: str, *, at: float | None = None, **fields: Any) -> None:
        """Append one event and make it durable. ``at``: its time (default: now)."""
        if self._fd is None:
            raise ValueError(f"journal {self.path} is closed")
        if kind not in KINDS:
            raise ValueError(f"unknown journal event {kind!r}; events are {KINDS}")
        record = {
            "v": FORMAT_VERSION,
            "event": kind,
            "time": time.time() if at is None else float(at),
            "run": self.run,
            **fields,
        }
        line = (json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n").encode()
        if len(line) > MAX_LINE_BYTES:
            raise ValueError(f"journal event of {len(line)} bytes (at most {MAX_LINE_BYTES})")
        n = os.write(self._fd, line)  # one write: O_APPEND places it whole at the end
        if n != len(line):  # only a full disk does this to a regular file
            with contextlib.suppress(OSError):
                os.write(self._fd, b"\n")
            raise OSError(errno.ENOSPC, f"short append ({n} of {len(line)} bytes)", str(self.path))
        os.fdatasync(self._fd)

    def start(
        self, *, devices: int, tiers: Iterable[str] | None = None, at: float | None = None
    ) -> None:
        extra = {"tiers": list(tiers)} if tiers is not None else {}
        self.append(
            "start", at=at, pid=os.getpid(), host=socket.gethostname(), devices=devices, **extra
        )

    def restore(
        self, step: int, tier: str, *, rollback: bool = False, at: float | None = None
    ) -> None:
        extra = {"rollback": True} if rollback else {}
        self.append("restore", at=at, step=step, tier=tier, **extra)

    def snapshot(self, step: int, tiers: Iterable[str], *, at: float | None = None) -> None:
        self.append("snapshot", at=at, step=step, tiers=list(tiers))

    def exit(self, *, clean: bool, reason: str | None = None, at: float | None = None) -> None:
        extra = {"reason": reason} if reason else {}
        self.append("exit", at=at, clean=clean, **extra)

    def close(self) -> None:
        """Close the file (which drops the lock that says this run is live)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> JournalWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _try_flock(fd: int, how: int) -> bool:
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as e:  # a file system without flock: liveness is then unknown
        log.debug("flock on the journal: %s", e)
        return True
    return True


def _fsync_dir(path: Path) -> None:
    """Best effort: the journal is never worth failing a run for."""
    with contextlib.suppress(OSError):
        fsync_dir(path)


def held_by_live_writer(path: str | os.PathLike[str]) -> bool:
    """Whether a live process (this one included) holds the journal open for writing."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return not _try_flock(fd, fcntl.LOCK_SH)
    finally:
        os.close(fd)  # drops our shared lock, if we got it


# -- reading --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    """One journal line: its kind, time, run, and the whole object (``data``)."""

    kind: str
    time: float
    run: str
    data: Mapping[str, Any]


@dataclass
class JournalContents:
    """What a journal file holds, and what could not be read of it."""

    path: Path | None
    events: list[Event] = field(default_factory=list)
    malformed: int = 0  # lines skipped: not JSON, not an object, or a bad field
    unknown: int = 0  # well-formed events of a kind this version does not know
    torn: bool = False  # the last line had no newline and did not parse: a crash mid-append
    skipped_bytes: int = 0  # older part not read (journal beyond MAX_READ_BYTES)
    live: bool = False  # a live process holds the journal for writing


def read_journal(path: str | os.PathLike[str] | None) -> JournalContents:
    """Parse a journal; never raises on damage (a missing file is an empty journal)."""
    out = JournalContents(Path(path) if path is not None else None)
    if path is None:
        return out
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_READ_BYTES:
                f.seek(size - MAX_READ_BYTES)
                out.skipped_bytes = size - MAX_READ_BYTES
            data = f.read(MAX_READ_BYTES)
    except FileNotFoundError:
        return out
    except OSError as e:
        log.warning("cannot read journal %s: %s", path, e)
        out.malformed += 1
        return out
    out.live = held_by_live_writer(path)
    lines = data.split(b"\n")
    if out.skipped_bytes:
        lines = lines[1:]  # the first line is cut by the seek
    tail = lines.pop()  # b"" when the file ends with a newline
    for raw in lines:
        if not raw.strip():
            continue
        ev = _parse(raw)
        if ev is None:
            out.malformed += 1
        elif ev.kind not in KINDS:
            out.unknown += 1
        else:
            out.events.append(ev)
    if tail.strip():
        ev = _parse(tail)  # complete but for its newline: the write itself finished
        if ev is None:
            out.torn = True
        elif ev.kind in KINDS:
            out.events.append(ev)
        else:
            out.unknown += 1
    return out


def _parse(raw: bytes) -> Event | None:
    if len(raw) > MAX_LINE_BYTES:
        return None
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None
    if not isinstance(obj, dict):
        return None
    kind, t, run = obj.get("event"), obj.get("time"), obj.get("run")
    if not isinstance(kind, str) or not isinstance(run, str) or not run:
        return None
    if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t):
        return None
    if not _fields_ok(kind, obj):
        return None
    return Event(kind, float(t), run, obj)


def _fields_ok(kind: str, o: dict[str, Any]) -> bool:
    """The fields each kind needs, with their types (other fields are free)."""
    if kind == "restore":
        return _is_int(o.get("step")) and isinstance(o.get("tier"), str)
    if kind == "snapshot":
        tiers = o.get("tiers")
        return (
            _is_int(o.get("step"))
            and isinstance(tiers, list)
            and all(isinstance(x, str) for x in tiers)
        )
    if kind == "exit":
        return isinstance(o.get("clean"), bool)
    return True


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _tier_names(v: object) -> tuple[str, ...] | None:
    if not isinstance(v, list) or not v or any(t not in TIER_ORDER for t in v):
        return None
    return tuple(t for t in TIER_ORDER if t in v)


# -- failure history ------------------------------------------------------------------------


@dataclass
class RunRecord:
    """One run (a process from its start event on) as the journal tells it."""

    run: str
    start: float
    pid: int | None = None
    host: str | None = None
    devices: int | None = None
    last: float = 0.0  # time of its newest event: the run was alive then
    restores: list[tuple[int, str, bool]] = field(default_factory=list)  # step, tier, rollback
    snapshots: int = 0
    last_step: int | None = None  # newest step it snapshotted
    exit: str | None = None  # "clean", "unclean" (an exit event saying so), or None
    reason: str | None = None
    live: bool = False  # still running (the journal's live writer, or the caller's run)
    failure: str | None = None  # the class of its unclean end: process, machine, unknown
    not_counted: str | None = None  # why an unclean end or rollbacks are no failure
    tiers: tuple[str, ...] | None = None  # the store's tiers, as its start event says

    @property
    def exposure_s(self) -> float:
        return max(0.0, self.last - self.start)

    @property
    def clean(self) -> bool:
        return self.exit == "clean"

    @property
    def short(self) -> bool:
        """Under MIN_RUN_S of exposure: none of its failures count."""
        return self.exposure_s < MIN_RUN_S

    def counted_failures(self) -> list[str]:
        """The classes of this run's failures that count: its rollbacks and its unclean
        end, none when the run is short."""
        if self.short and not self.live:
            return []
        out = [failure_class(tier, self.tiers) for _, tier, rollback in self.restores if rollback]
        if self.failure is not None:
            out.append(self.failure)
        return out


@dataclass
class FailureHistory:
    """Failures and exposure of the runs of a store, for the failure-rate estimate."""

    runs: list[RunRecord]
    failures: int  # unclean ends, plus rollbacks (restores in the middle of a run)
    by_class: dict[str, int]  # process, machine, correlated, unknown
    exposure_hours: float
    contents: JournalContents

    def estimate(self, prior: RatePrior | None = None, quantile: float = 0.9) -> RateEstimate:
        """The posterior failure rate (``ValueError`` with no prior and no exposure)."""
        return estimate_from_history(self.failures, self.exposure_hours, prior, quantile=quantile)


def failure_class(tier: str, store_tiers: Iterable[str] | None = None) -> str:
    """The class of a failure, from the tier the run after it restored from.

    A restore that read a partner's copy (``peer``) proves a machine was lost, and only
    one: its partner was up. Host memory is lost with the machine, so a restore that read
    from it (and from no partner) proves the machines survived: the process crashed.
    Anything else is a lost machine, or, when the store has a peer tier (``store_tiers``,
    as its run journaled them), a machine lost with its partner: the partner's copy would
    have been newer. ``tier`` is ``RestoreInfo.tier``, e.g. ``"host"`` or ``"local+remote"``.
    """
    read = tier.split("+")
    if "peer" in read:
        return MACHINE
    if "host" in read:
        return PROCESS
    return CORRELATED if store_tiers is not None and "peer" in store_tiers else MACHINE


def analyse(contents: JournalContents, *, live_runs: Iterable[str] = ()) -> FailureHistory:
    """Turn a journal's events into runs, failures per class and exposure.

    A run ends uncleanly when it has no clean ``exit``, unless it is live: the newest run
    while a live process holds the journal, or one named in ``live_runs`` (the caller's
    own). A rollback (``restore`` with ``rollback``) is a failure inside a run.
    """
    runs: dict[str, RunRecord] = {}
    order: list[RunRecord] = []
    for ev in contents.events:
        d = ev.data
        if ev.kind == "start":
            r = RunRecord(
                ev.run,
                ev.time,
                pid=d.get("pid") if _is_int(d.get("pid")) else None,
                host=d.get("host") if isinstance(d.get("host"), str) else None,
                devices=d.get("devices") if _is_int(d.get("devices")) else None,
                last=ev.time,
                tiers=_tier_names(d.get("tiers")),
            )
            if ev.run in runs:  # a reused id: the newer start wins
                log.debug("journal: run %s started twice", ev.run)
            runs[ev.run] = r
            order.append(r)
            continue
        r = runs.get(ev.run)
        if r is None:
            continue  # an event of a run whose start is not in the part read
        r.last = max(r.last, ev.time)
        if ev.kind == "restore":
            r.restores.append((d["step"], d["tier"], d.get("rollback") is True))
        elif ev.kind == "snapshot":
            r.snapshots += 1
            r.last_step = d["step"] if r.last_step is None else max(r.last_step, d["step"])
        elif ev.kind == "exit":
            r.exit = "clean" if d["clean"] else "unclean"
            r.reason = d.get("reason") if isinstance(d.get("reason"), str) else None

    live = set(live_runs)
    for r in order:
        r.live = r.run in live
    if contents.live and order and order[-1].exit is None:
        order[-1].live = True

    by_class = {PROCESS: 0, MACHINE: 0, CORRELATED: 0, UNKNOWN: 0}
    for i, r in enumerate(order):
        if not (r.clean or (r.live and r.exit is None)):
            if r.exit == "unclean" and r.reason in USER_EXITS:
                r.not_counted = f"interrupted by the user ({r.reason})"
            elif r.short and not r.live:
                r.not_counted = (
                    f"ran {r.exposure_s:.3g} s, under the {MIN_RUN_S:.0f} s a run must last "
                    "to count"
                )
            else:
                nxt = order[i + 1] if i + 1 < len(order) else None
                first = next((t for _, t, rb in nxt.restores if not rb), None) if nxt else None
                r.failure = (
                    UNKNOWN if nxt is None or first is None else failure_class(first, nxt.tiers)
                )
        elif r.short and not r.live and any(rb for *_, rb in r.restores):
            r.not_counted = f"ran {r.exposure_s:.3g} s: its rollbacks do not count"
        for cls in r.counted_failures():
            by_class[cls] += 1
    exposure = sum(r.exposure_s for r in order)
    return FailureHistory(
        runs=order,
        failures=sum(by_class.values()),
        by_class=by_class,
        exposure_hours=exposure / 3600.0,
        contents=contents,
    )


def read_history(store: StoreLike, *, live_runs: Iterable[str] = ()) -> FailureHistory:
    """Read and analyse the journal of ``store`` (empty for a store without one)."""
    contents = read_journal(journal_path(store))
    if contents.malformed or contents.torn:
        log.warning(
            "journal %s: %d malformed line(s) skipped%s",
            contents.path,
            contents.malformed,
            ", a torn last line (a crash mid-append)" if contents.torn else "",
        )
    return analyse(contents, live_runs=live_runs)


def failure_history(store: StoreLike) -> tuple[int, float]:
    """(failures, exposure hours) of ``store``'s runs: what `snapcore plan --journal` uses.

    A run that is still going counts for its exposure so far, not as a failure.
    """
    h = read_history(store)
    return h.failures, h.exposure_hours


def run_facts(store: StoreLike) -> tuple[int | None, tuple[str, ...] | None]:
    """The devices and the store tiers the newest run that journaled them started with
    (``None`` for what no run said): `snapcore plan --journal` plans for those."""
    devices: int | None = None
    tiers: tuple[str, ...] | None = None
    for r in reversed(read_history(store).runs):
        devices = r.devices if devices is None else devices
        tiers = r.tiers if tiers is None else tiers
        if devices is not None and tiers is not None:
            break
    return devices, tiers


# -- presentation (the `snapcore journal` verb prints these) ---------------------------------


def history_json(h: FailureHistory, estimate: RateEstimate | None) -> dict[str, Any]:
    """A JSON-able summary: the events, the runs, the failures and the rate."""
    c = h.contents
    out: dict[str, Any] = {
        "path": str(c.path) if c.path else None,
        "events": [dict(e.data) for e in c.events],
        "malformed_lines": c.malformed,
        "unknown_events": c.unknown,
        "torn_last_line": c.torn,
        "live": c.live,
        "runs": [
            {
                "run": r.run,
                "start": r.start,
                "last": r.last,
                "host": r.host,
                "pid": r.pid,
                "devices": r.devices,
                "snapshots": r.snapshots,
                "last_step": r.last_step,
                "restores": [{"step": s, "tier": t, "rollback": rb} for s, t, rb in r.restores],
                "end": "live" if r.live and r.exit is None else (r.exit or "unclean"),
                "failure": r.failure,
                "not_counted": r.not_counted,
                "tiers": list(r.tiers) if r.tiers is not None else None,
                "exposure_s": r.exposure_s,
            }
            for r in h.runs
        ],
        "failures": h.failures,
        "failures_by_class": h.by_class,
        "exposure_hours": h.exposure_hours,
        "rate": None,
    }
    if estimate is not None:
        out["rate"] = {
            "mean_per_hour": estimate.mean_per_hour,
            "conservative_per_hour": estimate.conservative_per_hour,
            "quantile": estimate.quantile,
            "conservative_mtbf_hours": estimate.conservative_mtbf_hours,
        }
    return out


def _event_detail(e: Event) -> str:
    d = e.data
    if e.kind == "start":
        return f"pid {d.get('pid')} on {d.get('host')}, {d.get('devices')} device(s)"
    if e.kind == "restore":
        return f"step {d['step']} from {d['tier']}" + (
            " (rollback)" if d.get("rollback") is True else ""
        )
    if e.kind == "snapshot":
        return f"step {d['step']} durable in {', '.join(d['tiers']) or '-'}"
    if e.kind == "alive":
        return "running"
    reason = d.get("reason")
    return ("clean" if d["clean"] else "UNCLEAN") + (
        f" ({reason})" if isinstance(reason, str) else ""
    )


def history_text(h: FailureHistory, estimate: RateEstimate | None) -> list[str]:
    """Human-readable lines: one per event, then the runs' failures and the rate."""
    import datetime as dt

    c = h.contents
    lines = [f"journal {c.path}"]
    for e in c.events:
        try:
            when = dt.datetime.fromtimestamp(e.time).strftime("%Y-%m-%d %H:%M:%S")
        except (OverflowError, OSError, ValueError):  # a time no calendar holds
            when = "?".ljust(19)
        detail = _event_detail(e)
        lines.append(f"  {when}  {e.run[:8]}  {e.kind:<8}  {detail}")
    if not c.events:
        lines.append("  (no events)")
    if c.malformed or c.torn or c.unknown:
        lines.append(
            f"  skipped: {c.malformed} malformed line(s), {c.unknown} unknown event(s)"
            + (", a torn last line (a crash mid-append)" if c.torn else "")
        )
    lines.append("")
    live = sum(1 for r in h.runs if r.live and r.exit is None)
    lines.append(
        f"{len(h.runs)} run(s), {live} live; {h.failures} failure(s): "
        f"{h.by_class[PROCESS]} process crash(es), {h.by_class[MACHINE]} lost machine(s), "
        f"{h.by_class[CORRELATED]} lost with its partner, "
        f"{h.by_class[UNKNOWN]} of unknown class; exposure {h.exposure_hours:.3g} h"
    )
    for r in h.runs:
        if r.not_counted is not None:
            lines.append(f"  run {r.run[:8]} not counted as a failure: {r.not_counted}")
    if estimate is None:
        lines.append("failure rate: no prior and no exposure (give --devices)")
    else:
        lines.append(
            f"failure rate: {estimate.mean_per_hour:.3g}/h (mean), "
            f"{estimate.conservative_per_hour:.3g}/h (the {estimate.quantile:.0%} upper "
            f"quantile the scheduler uses: MTBF {estimate.conservative_mtbf_hours:.3g} h)"
        )
    return lines


__all__ = [
    "JOURNAL_NAME",
    "MIN_RUN_S",
    "UNKNOWN",
    "USER_EXITS",
    "Event",
    "FailureHistory",
    "JournalContents",
    "JournalWriter",
    "RunRecord",
    "analyse",
    "failure_class",
    "failure_history",
    "held_by_live_writer",
    "history_json",
    "history_text",
    "journal_path",
    "read_history",
    "read_journal",
    "run_facts",
]
