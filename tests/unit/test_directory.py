"""The local store: commit visibility, leftovers of dead writers, live writers left alone."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

import snapcore
from snapcore.directory import LocalDirectory, step_dir_name


def test_uncommitted_snapshot_is_invisible_and_collected(tmp_path):
    snapcore.save({"x": torch.ones(4)}, tmp_path, step=1)
    store = LocalDirectory(tmp_path)
    pending = store.begin(2)  # a writer that "died": data written, no manifest
    (pending.dir / f"data-{pending.token}-r0.bin").write_bytes(b"partial")
    os.close(pending._fd)  # the lock goes away as it would with the process
    pending._fd = None
    assert store.committed_steps() == [1]
    assert snapcore.restore({"x": torch.zeros(4)}, tmp_path).step == 1
    removed = store.collect_leftovers()
    assert {p.name for p in removed} == {f"{pending.token}.pending", f"data-{pending.token}-r0.bin"}
    assert not (tmp_path / step_dir_name(2)).exists()


def test_live_writer_in_another_process_is_left_alone(tmp_path):
    code = (
        "import sys, time; from snapcore.directory import LocalDirectory\n"
        f"p = LocalDirectory({str(tmp_path)!r}).begin(3)\n"
        "(p.dir / f'data-{p.token}-r0.bin').write_bytes(b'x')\n"
        "print(p.token, flush=True); sys.stdin.read()\n"
    )
    with subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as child:
        assert child.stdout is not None
        token = child.stdout.readline().strip()
        store = LocalDirectory(tmp_path)
        assert store.collect_leftovers(full=True) == []
        assert (tmp_path / step_dir_name(3) / f"data-{token}-r0.bin").exists()
        child.kill()
        child.wait()
        removed = {p.name for p in store.collect_leftovers()}
        assert removed == {f"{token}.pending", f"data-{token}-r0.bin"}


def test_next_save_removes_leftovers(tmp_path):
    store = LocalDirectory(tmp_path)
    pending = store.begin(5)
    (pending.dir / f"data-{pending.token}-r0.bin").write_bytes(b"partial")
    os.close(pending._fd)
    pending._fd = None
    snapcore.save({"x": torch.ones(1)}, tmp_path, step=6)
    assert [s.step for s in store.snapshots()] == [6]


def test_stray_file_in_committed_dir_is_collected_by_full_gc_only(tmp_path):
    snapcore.save({"x": torch.ones(1)}, tmp_path, step=1)
    stray = tmp_path / step_dir_name(1) / "data-000000000000-r0.bin"
    stray.write_bytes(b"old")
    store = LocalDirectory(tmp_path)
    assert store.collect_leftovers() == []  # the cheap per-save pass skips committed dirs
    assert store.collect_leftovers(full=True, dry_run=True) == [stray] and stray.exists()
    assert store.collect_leftovers(full=True) == [stray] and not stray.exists()
    assert torch.equal(snapcore.load(tmp_path)["x"], torch.ones(1))


def test_bad_step_values_are_refused(tmp_path):
    import pytest

    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="step must be"):
            snapcore.save({"x": torch.ones(1)}, tmp_path, step=bad)  # type: ignore[arg-type]


def test_a_symlink_named_like_a_step_is_never_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "thesis.tex").write_text("years of work")
    store = tmp_path / "store"
    store.mkdir()
    (store / "step-000000000009").symlink_to(victim, target_is_directory=True)
    snapcore.save({"x": torch.ones(1)}, store, step=1)
    assert LocalDirectory(store).collect_leftovers(full=True) == []
    assert (victim / "thesis.tex").read_text() == "years of work"


def test_a_step_directory_removed_by_a_collector_during_begin_is_made_again(tmp_path, monkeypatch):
    """Another rank's collector may rmdir the empty step directory just after this
    writer's mkdir found it there: pathlib's mkdir(exist_ok=True) then raises
    FileExistsError (EEXIST, and its is_dir() check finds nothing). begin() must make the
    directory again, not fail the save (seen once in ~25 runs of the DCP interop test)."""
    import errno

    store = LocalDirectory(tmp_path)
    store.ensure()
    target = tmp_path / step_dir_name(4)
    real_mkdir, raced = os.mkdir, []

    def mkdir(path, mode=0o777, *args, **kw):
        if os.fspath(path) == os.fspath(target) and len(raced) < 2:
            raced.append(path)
            if not os.path.isdir(path):
                real_mkdir(path, mode)  # another rank made it...
            os.rmdir(path)  # ...and a collector removed it, after our EEXIST
            raise FileExistsError(errno.EEXIST, "File exists", os.fspath(path))
        return real_mkdir(path, mode, *args, **kw)

    monkeypatch.setattr(os, "mkdir", mkdir)
    pending = store.begin(4)
    monkeypatch.undo()
    assert len(raced) == 2  # both of begin()'s mkdirs met the race
    assert pending.lock_path.exists() and pending.dir == target
    pending.abort()
