"""SIGKILL crash tests: a process that saves in a loop is killed, and the store must hold
only whole snapshots.

After every kill, ``restore`` and ``load`` return the newest committed step bit-exact
(every tensor is a function of its step, so a snapshot mixing two steps or holding
half-written data cannot pass), a step the worker saw durable is never lost, and the next
save removes what the killed one left behind.

Workers are forked from a zygote: one interpreter, started once for the module, that
imported torch and snapcore and then only forks. Importing torch takes seconds here and a
fork milliseconds, so dozens of kills fit in a few seconds. The zygote starts no thread
(torch runs on one thread there, inline), so a fork copies no lock held by another
thread. Workers report through the zygote's stdout, one JSON line per event written with
a single ``write`` (atomic on a pipe), and wait for SIGUSR1 after their first save so that
the test can inspect the store while nothing writes to it.

The test module is also the zygote's program: ``python -c "import test_crash;
test_crash.zygote()"`` with this directory on the path.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import queue
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import snapcore
from snapcore import _native
from snapcore import directory as store_mod
from snapcore.directory import MANIFEST, LocalDirectory

FIXED_ELEMS = 1 << 20  # float32, 4 MiB, overwritten in place after each async_save
MAX_ELEMS = 7 << 18  # the longest tensor of expected_state
RANDOM_KILLS = 20
MESSAGE_TIMEOUT_S = 60.0


# -- the saved state: a function of the step alone -------------------------------------------
@functools.cache
def _base(n: int, salt: int) -> torch.Tensor:
    """n distinct-looking int64 values below 65521 (computed once: the workers are fast)."""
    return (torch.arange(n, dtype=torch.int64) * 2654435761 + salt) % 65521


def _ramp(n: int, step: int, salt: int, gen: int) -> torch.Tensor:
    """The first n values of a base pattern, shifted by the step and generation."""
    return _base(max(n, MAX_ELEMS), salt)[:n] + step * 65521 + gen * 12345


@functools.lru_cache(maxsize=4)
def expected_state(step: int, gen: int = 0) -> dict[str, Any]:
    """The state saved as ``step``: 7 to 20 MiB whose sizes and bytes depend on the step.

    The sizes vary so that kills land at different points of a write; the contents so that
    a snapshot assembled from two steps, or holding stale or zeroed bytes, is caught. A
    step saved again (after a rollback) holds other values: ``gen`` tells them apart.
    Cached, hence shared: callers must not modify it.
    """
    return {
        "fixed": _ramp(FIXED_ELEMS, step, 1, gen).to(torch.float32) / 8,
        "var": _ramp((1 + step % 7) << 18, step, 2, gen).to(torch.float64) / 7,
        "ints": _ramp((1 + step % 3) << 16, step, 3, gen),
        "bf16": _ramp(100_003, step, 4, gen).to(torch.bfloat16),
        "bytes": _ramp(12_345 + step, step, 5, gen).to(torch.uint8),
        "nested": {"list": [_ramp(7, step, 6, gen).to(torch.int16), None, step % 2 == 0]},
        "lr": step / 10,
        "tag": f"step {step}, generation {gen}",
        "step": step,
    }


def _blank(value: Any) -> Any:
    """A restore target shaped like ``value`` holding none of its data."""
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if isinstance(value, dict):
        return {k: _blank(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_blank(v) for v in value]
    return None


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def assert_bit_exact(got: Any, want: Any, path: str = "") -> None:
    """Equal trees; tensors equal in dtype, shape and every byte (-0.0 != 0.0, NaN == NaN)."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{path}: {type(got).__name__}, not a tensor"
        assert (got.dtype, got.shape) == (want.dtype, want.shape), path
        bits = _SAME_SIZE_INT[want.element_size()]
        assert torch.equal(got.contiguous().view(bits), want.contiguous().view(bits)), (
            f"{path}: bytes differ"
        )
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), path
        for k in want:
            assert_bit_exact(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_bit_exact(g, w, f"{path}.{i}")
    else:
        assert type(got) is type(want) and got == want, f"{path}: {got!r} != {want!r}"


# -- the zygote and its workers (run in the zygote process) --------------------------------
def _emit(**fields: Any) -> None:
    """One event line on stdout in one write, so lines of dying workers never interleave."""
    os.write(1, (json.dumps(fields) + "\n").encode())


def zygote() -> None:
    """Fork a worker per ``fork`` command read from stdin; report pids and exit statuses."""
    # One thread: torch then runs operations inline and never starts a thread pool that
    # forks would copy half-locked. The patterns are computed once, here, for all workers.
    torch.set_num_threads(1)
    expected_state(0)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "fork":
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    _worker(**cmd["args"])
                    code = 0
                except BaseException:
                    traceback.print_exc()
                finally:
                    sys.stderr.flush()
                    os._exit(code)
            _emit(op="forked", pid=pid)
        elif cmd["op"] == "reap":
            _, status = os.waitpid(cmd["pid"], 0)
            _emit(
                op="reaped",
                pid=cmd["pid"],
                signal=os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                code=os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
            )


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(phase: str) -> None:
    """Make this worker SIGKILL itself at ``phase`` of its first save.

    The random kills reach every phase too, but only by chance; these reach each one on
    purpose, with the store in the one state that phase can leave.
    """
    if phase == "write":  # half of the data file written
        real_writer = _native.FileWriter

        class HalfWriter:
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                self._w = real_writer(*args, **kwargs)

            def __getattr__(self, name: str) -> Any:
                return getattr(self._w, name)

            def write_at(self, offset: int, address: int, n: int, *rest: Any) -> None:
                half = n // 2 // 4096 * 4096  # O_DIRECT wants whole pages
                if half:
                    self._w.write_at(offset, address, half, *rest)
                _die()

        _native.FileWriter = HalfWriter  # type: ignore[misc]
    elif phase == "commit":  # data durable, no manifest yet
        store_mod.Pending.commit = lambda *args, **kwargs: _die()  # type: ignore[method-assign]
    elif phase in ("rename", "renamed"):  # just before / just after the manifest's rename
        real_replace = os.replace

        def replace(src: Any, dst: Any, **kwargs: Any) -> None:
            if str(dst).endswith(MANIFEST) and phase == "rename":
                _die()
            real_replace(src, dst, **kwargs)
            if str(dst).endswith(MANIFEST):
                _die()

        os.replace = replace
    elif phase == "released":  # lock file removed
        real_release = store_mod.Pending.release

        def release(self: store_mod.Pending, *args: Any, **kwargs: Any) -> None:
            real_release(self, *args, **kwargs)
            _die()

        store_mod.Pending.release = release  # type: ignore[method-assign]
    elif phase == "collecting":  # the first file a leftover collection deletes
        real_collect = store_mod.LocalDirectory.collect_leftovers
        real_unlink = os.unlink
        collecting = False

        def collect(self: LocalDirectory, *args: Any, **kwargs: Any) -> list[Path]:
            nonlocal collecting
            collecting = True
            try:
                return real_collect(self, *args, **kwargs)
            finally:
                collecting = False

        def unlink(path: Any, *args: Any, **kwargs: Any) -> None:
            real_unlink(path, *args, **kwargs)
            if collecting:
                _die()

        store_mod.LocalDirectory.collect_leftovers = collect  # type: ignore[method-assign]
        os.unlink = unlink
    else:
        raise ValueError(phase)


def _worker(store: str, start: int, mode: str, die_in: str | None = None, gen: int = 0) -> None:
    """Save ``expected_state(step)`` for step = start, start + 1, ... until killed; the
    first one as generation ``gen``.

    After the first durable save it waits for SIGUSR1. With ``mode="async"`` the tensor
    ``fixed`` is overwritten in place as soon as ``async_save`` returns, while the snapshot
    is still being written: the snapshot must hold the bytes of its own step.
    """
    # Blocked before snapcore starts its threads, which inherit the mask: sigwait gets it.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    if die_in is not None:
        _arm(die_in)
    fixed = torch.empty(FIXED_ELEMS, dtype=torch.float32)
    previous: snapcore.SaveHandle | None = None
    for step in itertools.count(start):
        want = expected_state(step, gen if step == start else 0)
        fixed.copy_(want["fixed"])
        state = {**want, "fixed": fixed}
        _emit(ev="begin", step=step, t=time.monotonic())
        if mode == "sync":
            snapcore.save(state, store, step=step)
            _emit(ev="durable", step=step)
        else:
            handle = snapcore.async_save(state, store, step=step)
            if previous is not None:  # async_save waited for it before staging this one
                _emit(ev="durable", step=previous.wait().step)
            previous = handle
            if step == start:
                previous = None
                _emit(ev="durable", step=handle.wait().step)
        if step == start:
            snapcore.wait_all(store)  # the collection after a re-save runs after its commit
            _emit(ev="first", step=step)
            signal.sigwait({signal.SIGUSR1})


# -- the test's side -----------------------------------------------------------------------
class Zygote:
    """The zygote process, seen from the test: fork workers, read their events, kill them."""

    def __init__(self, stderr_path: Path) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(Path(__file__).parent), env.get("PYTHONPATH")) if p
        )
        self.stderr_path = stderr_path
        self._stderr = open(stderr_path, "wb")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import test_crash; test_crash.zygote()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=env,
        )
        self.events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.live: int | None = None  # pid of the worker not yet reaped
        self.die_in: str | None = None  # where the live worker is to kill itself

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.events.put(json.loads(line))
        self.events.put(None)

    def _send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()

    def next(self) -> dict[str, Any]:
        try:
            event = self.events.get(timeout=MESSAGE_TIMEOUT_S)
        except queue.Empty:
            event = None
        if event is None:
            pytest.fail(f"no event from the zygote or its worker; stderr:\n{self.stderr()}")
        return event

    def until(self, key: str, value: str, seen: list[dict[str, Any]]) -> dict[str, Any]:
        """The next event with ``key == value``; the events before it go to ``seen``."""
        while True:
            event = self.next()
            if event.get(key) == value:
                return event
            seen.append(event)

    def fork(
        self, store: Path, start: int, mode: str, *, die_in: str | None = None, gen: int = 0
    ) -> int:
        assert self.live is None, "one worker at a time"
        args: dict[str, Any] = {"store": str(store), "start": start, "mode": mode, "gen": gen}
        if die_in is not None:
            args["die_in"] = die_in
        self._send(op="fork", args=args)
        self.live = self.until("op", "forked", [])["pid"]
        self.die_in = die_in
        return self.live

    def go(self) -> None:
        """Let the worker waiting after its first save go on saving."""
        assert self.live is not None
        os.kill(self.live, signal.SIGUSR1)

    def kill(self) -> None:
        assert self.live is not None
        os.kill(self.live, signal.SIGKILL)

    def reap(self, seen: list[dict[str, Any]]) -> None:
        """Wait until the worker is dead (its flocks gone); it must have died of SIGKILL."""
        assert self.live is not None
        self._send(op="reap", pid=self.live)
        survived = False
        while (event := self.next()).get("op") != "reaped":
            seen.append(event)
            if event.get("ev") == "first" and self.die_in is not None:
                survived = True  # the injection missed: end the wait instead of hanging
                self.kill()
        self.live = None
        if survived:
            pytest.fail(f"the worker was to kill itself in {self.die_in!r} but saved")
        status = event
        if status["signal"] != signal.SIGKILL:
            pytest.fail(f"the worker did not die of SIGKILL: {status}; stderr:\n{self.stderr()}")

    def stderr(self) -> str:
        self._stderr.flush()
        return self.stderr_path.read_text(errors="replace")[-5000:]

    def kill_live(self) -> None:
        """Kill and reap the worker if one is alive (cleanup after a failed test)."""
        if self.live is not None:
            self.kill()
            with contextlib.suppress(pytest.fail.Exception):
                self.reap([])
            self.live = None

    def close(self) -> None:
        self.kill_live()
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join()
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        self._stderr.close()


@pytest.fixture(scope="module")
def zygote_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Zygote]:
    z = Zygote(tmp_path_factory.mktemp("zygote") / "stderr.txt")
    try:
        yield z
    finally:
        z.close()


@pytest.fixture
def zygote_proc(zygote_module: Zygote) -> Iterator[Zygote]:
    """The module's zygote, with no worker left alive by a test that failed half-way."""
    yield zygote_module
    zygote_module.kill_live()


def stray_files(store: Path) -> list[str]:
    """What the store holds besides committed manifests and the files they reference.

    Chunks are shared between snapshots, so a file counts as referenced when any committed
    manifest names it, whichever step directory holds it.
    """
    local = LocalDirectory(store)
    referenced = {MANIFEST}
    for step in local.committed_steps():
        referenced |= {f.name for f in local.read_manifest(step).files}
    stray: list[str] = []
    for snap in local.snapshots():
        names = [f"{snap.path.name}/{p.name}" for p in sorted(snap.path.iterdir())]
        if not names:
            stray.append(f"{snap.path.name}/ (empty)")
        stray += [n for n in names if n not in referenced and not n.endswith("/" + MANIFEST)]
    return stray


def check_after_kill(
    store: Path, *, durable: int | None, begun: int, gens: dict[int, int] | None = None
) -> int:
    """Check what a killed worker left; return the newest committed step.

    ``durable``: the newest step the worker saw durable (it must survive), ``begun``: the
    newest it started (nothing newer may appear), ``gens``: the generation each step's
    snapshot must hold where not 0.
    """
    gens = gens or {}
    committed = LocalDirectory(store).committed_steps()
    assert committed, "no committed snapshot survived"
    newest = committed[-1]
    if durable is not None:
        assert newest >= durable, f"step {durable} was durable, the newest committed is {newest}"
    assert newest <= begun, f"step {newest} is committed but only {begun} was begun"
    for step in committed:
        want = expected_state(step, gens.get(step, 0))
        assert_bit_exact(snapcore.load(store, step=step), want, f"step {step}")
    want = expected_state(newest, gens.get(newest, 0))
    state = _blank(want)
    info = snapcore.restore(state, store)
    assert info.step == newest
    assert_bit_exact(state, want, "restored")
    return newest


def start_and_check_clean(z: Zygote, store: Path, start: int, mode: str) -> list[dict[str, Any]]:
    """Start a worker at ``start``; once its first save is durable it waits, and by then the
    save must have removed every leftover of the killed one."""
    z.fork(store, start, mode)
    seen: list[dict[str, Any]] = []
    z.until("ev", "first", seen)
    assert stray_files(store) == [], "the next save left leftovers of the killed one"
    return seen


def _newest(events: list[dict[str, Any]], ev: str) -> int | None:
    return max((e["step"] for e in events if e.get("ev") == ev), default=None)


def test_random_sigkills_leave_only_whole_snapshots(zygote_proc: Zygote, tmp_path: Path) -> None:
    """Workers saving in a loop (save and async_save in turn) are killed at random moments.

    Every other kill is timed from the moment a save begins, within about one save's
    duration, so that many land inside a snapshot whatever the speed of the machine; the
    others fall anywhere within a few saves.
    """
    z, store = zygote_proc, tmp_path / "store"
    rng = random.Random(0x5EED)
    period = 0.1  # seconds from one save's start to the next's, learnt from the workers
    intervals: list[float] = []
    mid_snapshot = 0  # kills after which an uncommitted snapshot was found
    start = 1
    for i in range(RANDOM_KILLS):
        seen = start_and_check_clean(z, store, start, ("sync", "async")[i % 2])
        local = LocalDirectory(store)
        for old in local.committed_steps()[:-2]:  # bounded disk; two stay to be re-checked
            local.delete(old)
        z.go()
        if i % 4 < 2:
            time.sleep(rng.uniform(0, 2.5 * period))
        else:
            seen.append(z.until("ev", "begin", seen))
            time.sleep(rng.uniform(0, period))
        z.kill()
        z.reap(seen)
        begins = [e["t"] for e in seen if e.get("ev") == "begin"][1:]  # [0] waited for go()
        intervals += [b - a for a, b in itertools.pairwise(begins)]
        period = statistics.median(intervals) if intervals else period
        mid_snapshot += bool(stray_files(store))
        start = 1 + check_after_kill(
            store, durable=_newest(seen, "durable"), begun=_newest(seen, "begin") or start
        )
    # A test whose kills all fell between snapshots would prove little.
    assert mid_snapshot, "no kill landed inside a snapshot"


PHASES = ["write", "commit", "rename", "renamed", "released"]


def seed_step_1(z: Zygote, store: Path) -> None:
    """A store whose newest snapshot is step 1, written by a worker killed while idle."""
    start_and_check_clean(z, store, 1, "sync")
    z.kill()
    z.reap([])


@pytest.mark.parametrize("resave", [False, True], ids=["new-step", "resave"])
@pytest.mark.parametrize("phase", PHASES)
def test_sigkill_at_each_commit_phase(
    zygote_proc: Zygote, tmp_path: Path, phase: str, resave: bool
) -> None:
    """A kill at each point of the commit protocol, for a new step and for a committed step
    saved again with other values (as after a rollback)."""
    z, store = zygote_proc, tmp_path / "store"
    seed_step_1(z, store)
    step = 1 if resave else 2
    z.fork(store, step, "sync", die_in=phase, gen=1)
    seen: list[dict[str, Any]] = []
    z.reap(seen)
    assert _newest(seen, "durable") is None, f"the worker was to die in {phase!r}"
    committed = phase in ("renamed", "released")
    gens = {step: 1} if committed else {}
    newest = check_after_kill(store, durable=1, begun=step, gens=gens)
    assert newest == (step if committed else 1)
    if phase != "released":
        assert stray_files(store), f"a kill in {phase!r} should leave something to collect"
    start_and_check_clean(z, store, newest + 1, "sync")
    z.kill()
    z.reap([])
    check_after_kill(store, durable=newest + 1, begun=newest + 1, gens=gens)


@pytest.mark.parametrize("resave", [False, True], ids=["new-step", "resave"])
def test_sigkill_while_collecting_leftovers(
    zygote_proc: Zygote, tmp_path: Path, resave: bool
) -> None:
    """A kill in the middle of the next save's cleanup of a dead writer's files: the save
    after that must still remove what is left."""
    z, store = zygote_proc, tmp_path / "store"
    seed_step_1(z, store)
    step = 1 if resave else 2
    z.fork(store, step, "sync", die_in="commit", gen=1)  # a dead writer's lock and data
    z.reap([])
    z.fork(store, 3, "sync", die_in="collecting")
    seen: list[dict[str, Any]] = []
    z.reap(seen)
    assert check_after_kill(store, durable=1, begun=3) == 1
    assert stray_files(store), "the collection was to be cut short"
    start_and_check_clean(z, store, 2, "sync")
    z.kill()
    z.reap([])


def test_demo_passes(tmp_path: Path) -> None:
    """``make demo`` with small settings: a SIGKILLed training run resumes bit-exact."""
    out = subprocess.run(
        [sys.executable, "-m", "snapcore.demo", "--steps", "12", "--every", "3"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PASS" in out.stdout
