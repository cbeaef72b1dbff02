"""The pipelined whole mode (docs/architecture.md, "The path of a snapshot"): in the
default mode with CPU tensors, the persist thread hashes and writes the image while
``async_save`` stages it. These tests make staging wait, in the middle, for a write of
what it staged before (so they fail if the writes only start once staging is done), and
check that no byte is written before it is staged, that a staging failure midway commits
nothing, and that every step restores bit for bit."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import snapcore
from snapcore import _native
from snapcore.directory import LocalDirectory, step_dir_name
from snapcore.io_types import Progress
from snapcore.staging import copy as copy_mod
from snapcore.staging.copy import Stager

GATE_S = 120  # a bound for a hang, not a timing: a write comes within milliseconds


def state(seed: int) -> dict[str, torch.Tensor]:
    """8 tensors of 1 MiB of random bits (8 segments of staging with PIPELINE_SEGMENT at
    1 MiB)."""
    g = torch.Generator().manual_seed(seed)
    return {
        f"t{i}": torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=g).view(
            torch.float32
        )
        for i in range(8)
    }


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    )


class Watch:
    """Records how far each pipelined staging has got, checks every write of the arena
    against it, and makes the staging's ``gate_at``-th segment wait for a first write."""

    def __init__(self, gate_at: int = 4, fail_at: int | None = None) -> None:
        self.lock = threading.Lock()
        self.base = 0  # the arena being staged into, and its size
        self.size = 0
        self.upto = 0  # staged bytes [0, upto) of the image
        self.ended = True
        self.copies = 0
        self.pipelined = 0  # saves that went through stage_pipelined
        self.gate_at = gate_at
        self.fail_at = fail_at
        self.wrote = threading.Event()  # a write of this staging's arena happened
        self.gate_opened: list[bool] = []  # per gated staging: whether the write came
        self.early: list[tuple[int, int, int]] = []  # writes beyond what was staged
        self.arena_writes = 0


@pytest.fixture
def watch(monkeypatch: pytest.MonkeyPatch) -> Iterator[Watch]:
    w = Watch()
    monkeypatch.setenv("SNAPCORE_PIPELINE", "on")
    monkeypatch.setattr(copy_mod, "PIPELINE_SEGMENT", 1 << 20)
    real_stage, real_copy, real_advance = Stager.stage_pipelined, Stager.copy, Progress.advance
    real_writer = _native.FileWriter

    def stage_pipelined(self: Stager, arena: Any, layout: Any, windows: Any) -> Progress:
        with w.lock:
            w.base, w.size, w.upto, w.ended, w.copies = arena.address, arena.size, 0, False, 0
            w.pipelined += 1
            w.wrote.clear()
        try:
            return real_stage(self, arena, layout, windows)
        finally:
            with w.lock:
                w.ended = True

    def copy(self: Stager, blobs: Any, win: Any, **kw: Any) -> Any:
        if win.progress is not None:
            w.copies += 1
            if w.copies == w.gate_at:  # earlier segments are staged: one must be written
                w.gate_opened.append(w.wrote.wait(GATE_S))
            if w.copies == w.fail_at:
                raise OSError(5, "Input/output error (simulated, while staging)")
        return real_copy(self, blobs, win, **kw)

    def advance(self: Progress, upto: int) -> None:
        with w.lock:
            w.upto = max(w.upto, upto)
        real_advance(self, upto)

    class Checked:
        def __init__(self, path: str, *, direct: bool = True, truncate: bool = True) -> None:
            self._w = real_writer(path, direct=direct, truncate=truncate)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._w, name)

        def write_at(self, offset: int, address: int, nbytes: int) -> None:
            with w.lock:
                if not w.ended and w.base <= address < w.base + w.size:
                    w.arena_writes += 1
                    if address - w.base + nbytes > w.upto:
                        w.early.append((address - w.base, nbytes, w.upto))
                    w.wrote.set()
            self._w.write_at(offset, address, nbytes)

    monkeypatch.setattr(Stager, "stage_pipelined", stage_pipelined)
    monkeypatch.setattr(Stager, "copy", copy)
    monkeypatch.setattr(Progress, "advance", advance)
    monkeypatch.setattr(_native, "FileWriter", Checked)
    yield w


def test_writes_follow_staging_and_each_step_restores_bit_exact(tmp_path, watch):
    saved = {}
    for step in (1, 2, 3):  # the same arena each time: a byte written early is stale
        saved[step] = state(step)
        snapcore.async_save(saved[step], tmp_path, step=step).wait()
    assert watch.pipelined == 3
    # staging's 4th segment waited for a write of the first three, and got it
    assert watch.gate_opened == [True, True, True]
    assert watch.arena_writes > 0 and watch.early == []
    for step, want in saved.items():
        got = snapcore.load(tmp_path, step=step)
        assert all(same_bits(got[k], v) for k, v in want.items()), step


def test_a_staging_failure_midway_commits_nothing(tmp_path, watch):
    first = state(1)
    snapcore.save(first, tmp_path, step=1)
    watch.fail_at = 6  # after the gate: some of the image is written already
    with pytest.raises(OSError, match="simulated, while staging"):
        snapcore.async_save(state(2), tmp_path, step=2)
    assert watch.gate_opened[-1] is True  # writes had started when staging failed
    watch.fail_at = None
    # the caller had the error: the next save is not failed by it, and step 2 is not there
    third = state(3)
    snapcore.save(third, tmp_path, step=3)
    snapcore.wait_all(tmp_path)
    assert LocalDirectory(tmp_path).committed_steps() == [1, 3]
    left = tmp_path / step_dir_name(2)
    assert not left.exists() or list(left.iterdir()) == []
    for step, want in ((1, first), (3, third)):
        got = snapcore.load(tmp_path, step=step)
        assert all(same_bits(got[k], v) for k, v in want.items()), step
    with pytest.raises(snapcore.SnapshotNotFound):
        snapcore.load(tmp_path, step=2)


def test_host_tier_slots_and_overlap_mode(tmp_path, host_name, watch):
    """With a host tier (two arena slots) each step restores from host memory and from
    disk; overlap mode hands the image over once staged (not pipelined)."""
    store = snapcore.Store(host=host_name, local=tmp_path / "s")
    saved = {}
    for step in (1, 2, 3):
        saved[step] = state(step)
        snapcore.async_save(saved[step], store, step=step).wait()
    assert watch.pipelined == 3 and watch.early == []
    assert watch.gate_opened == [True, True, True]
    for step in (2, 3):  # the host tier keeps the two newest, one per slot
        got = snapcore.load(snapcore.Store(host=host_name), step=step)
        assert all(same_bits(got[k], v) for k, v in saved[step].items()), step
    for step, want in saved.items():
        got = snapcore.load(tmp_path / "s", step=step)
        assert all(same_bits(got[k], v) for k, v in want.items()), step
    fourth = state(4)
    snapcore.async_save(fourth, store, step=4, overlap=True).wait()
    assert watch.pipelined == 3
    got = snapcore.load(tmp_path / "s", step=4)
    assert all(same_bits(got[k], v) for k, v in fourth.items())


@pytest.mark.parametrize(
    ("setting", "threads", "cores", "want"),
    [
        ("auto", "1", 2, True),  # the copies leave a core to the hash thread
        ("auto", "0", 2, False),  # one copy thread per core: handed over once staged
        ("auto", "2", 2, False),
        # a rank pinned to one core of a 64-core machine: its one copy thread leaves
        # no core free, whatever the machine has
        ("auto", "1", 1, False),
        ("on", "0", 2, True),
        ("off", "1", 8, False),
    ],
)
def test_the_setting_decides_when_staging_is_pipelined(
    tmp_path, watch, monkeypatch, setting, threads, cores, want
):
    """``cores``: the process's CPU affinity (what it may run on); the machine has 64."""
    monkeypatch.setenv("SNAPCORE_PIPELINE", setting)
    monkeypatch.setenv("SNAPCORE_THREADS", threads)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    s = state(1)
    snapcore.async_save(s, tmp_path, step=1).wait()
    assert watch.pipelined == int(want)
    got = snapcore.load(tmp_path, step=1)
    assert all(same_bits(got[k], v) for k, v in s.items())


def test_a_bad_pipeline_setting_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("SNAPCORE_PIPELINE", "sometimes")
    with pytest.raises(ValueError, match="SNAPCORE_PIPELINE"):
        snapcore.save(state(1), tmp_path, step=1)
    monkeypatch.setenv("SNAPCORE_PIPELINE", "off")  # refused before anything started
    s = state(2)
    snapcore.save(s, tmp_path, step=2)
    assert LocalDirectory(tmp_path).committed_steps() == [2]


def test_an_early_persist_failure_marks_staged_only_once_staging_ended(
    tmp_path, watch, monkeypatch
):
    """The persist side fails (the step's directory cannot be opened) while staging still
    copies: the handle must not say "staged" before the copy has ended (the caller may
    then change the tensors), and the failure still surfaces on the handle."""
    from snapcore.staging.handle import SaveHandle

    handles: list[SaveHandle] = []
    marks: list[bool] = []  # per mark_staged call: whether staging had ended
    real_init, real_mark = SaveHandle.__init__, SaveHandle.mark_staged
    real_begin, real_copy = LocalDirectory.begin, Stager.copy

    def init(self: SaveHandle, *a: Any, **kw: Any) -> None:
        real_init(self, *a, **kw)
        handles.append(self)

    def mark(self: SaveHandle) -> None:
        with watch.lock:
            marks.append(watch.ended)
        real_mark(self)

    def begin(self: LocalDirectory, step: int) -> Any:
        if step == 2:
            raise OSError(28, f"No space left on device (simulated): step {step}")
        return real_begin(self, step)

    def copy(self: Stager, blobs: Any, win: Any, **kw: Any) -> Any:
        if win.progress is not None and watch.copies == 2 and handles:
            handles[-1].settle()  # the persist side has failed (every tier has its outcome)
        return real_copy(self, blobs, win, **kw)

    snapcore.save(state(1), tmp_path, step=1)
    watch.gate_at = 0  # no gate: nothing is written for step 2
    monkeypatch.setattr(SaveHandle, "__init__", init)
    monkeypatch.setattr(SaveHandle, "mark_staged", mark)
    monkeypatch.setattr(LocalDirectory, "begin", begin)
    monkeypatch.setattr(Stager, "copy", copy)
    marks.clear()
    h = snapcore.async_save(state(2), tmp_path, step=2)
    assert h is handles[-1]
    assert marks and all(marks), marks  # never marked while staging copied
    h.staged(GATE_S)
    with pytest.raises(snapcore.SnapshotFailed, match="simulated"):
        h.wait()
    assert watch.pipelined == 2
