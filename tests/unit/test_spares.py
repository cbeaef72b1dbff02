"""Spare data files (docs/format.md, "Spare data files"): retention keeps the local data
files it frees, and the next save renames one to its new data file and writes over it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import snapcore
from snapcore import directory, settings
from snapcore.cli.main import main
from snapcore.directory import SPARE_DIR, SPARE_NAME, LocalDirectory, step_dir_name
from snapcore.tiers import LocalTier


def _data_files(root: Path, step: int) -> list[Path]:
    return sorted((root / step_dir_name(step)).glob("data-*.bin"))


def _spares(root: Path) -> list[Path]:
    return sorted(p for p in (root / SPARE_DIR).glob("*.bin") if SPARE_NAME.match(p.name))


def _save(state: dict[str, torch.Tensor], store: snapcore.Store, step: int) -> None:
    snapcore.save(state, store, step=step)
    snapcore.wait_all(store)  # retention runs after the commit, on the persist thread


def test_retention_keeps_the_freed_file_and_the_next_save_writes_over_it(tmp_path):
    store = snapcore.Store(local=tmp_path, retention={"local": 1})
    states = [{"x": torch.arange(1 << 16, dtype=torch.float32) * s} for s in range(1, 4)]
    _save(states[0], store, 1)
    (first,) = _data_files(tmp_path, 1)
    inode = first.stat().st_ino
    _save(states[1], store, 2)
    assert LocalDirectory(tmp_path).committed_steps() == [2]
    assert [p.stat().st_ino for p in _spares(tmp_path)] == [inode]  # step 1's file, moved
    _save(states[2], store, 3)
    (third,) = _data_files(tmp_path, 3)
    assert third.stat().st_ino == inode  # written over, not a new file
    assert [p.stat().st_ino for p in _spares(tmp_path)] != [inode]  # step 2's file now
    out = snapcore.load(tmp_path, step=3)
    assert torch.equal(out["x"], states[2]["x"])


def test_a_larger_spare_is_cut_to_the_bytes_written_and_a_smaller_one_grows(tmp_path):
    store = snapcore.Store(local=tmp_path, retention={"local": 1})
    big = {"x": torch.randn(1 << 18)}  # 1 MiB
    small = {"x": torch.randn(3000)}
    _save(big, store, 1)
    _save(small, store, 2)  # step 1's 1 MiB file becomes the spare
    (spare,) = _spares(tmp_path)
    assert spare.stat().st_size >= 1 << 20
    _save(small | {"y": torch.ones(5)}, store, 3)  # writes over the 1 MiB spare
    (written,) = _data_files(tmp_path, 3)
    name = written.relative_to(tmp_path).as_posix()
    (loc,) = {f.size for f in LocalDirectory(tmp_path).read_manifest(3).files if f.name == name}
    assert written.stat().st_size == loc < 1 << 20  # cut to what this save wrote
    out = snapcore.load(tmp_path, step=3)
    assert torch.equal(out["x"], small["x"]) and torch.equal(out["y"], torch.ones(5))
    _save(big, store, 4)  # over step 2's small file, which grows
    (grown,) = _data_files(tmp_path, 4)
    assert grown.stat().st_size >= 1 << 20
    assert torch.equal(snapcore.load(tmp_path, step=4)["x"], big["x"])


def test_a_streaming_save_writes_over_a_spare_too(tmp_path):
    store = snapcore.Store(local=tmp_path, retention={"local": 1})
    states = [{f"t{i}": torch.randn(1 << 20) + s for i in range(3)} for s in range(3)]  # 12 MiB
    for step, state in enumerate(states):
        stats = snapcore.save(state, store, step=step, budget_bytes=5 << 20)
        snapcore.wait_all(store)
        assert stats.streaming
        if step == 1:
            inode = _spares(tmp_path)[0].stat().st_ino
    (last,) = _data_files(tmp_path, 2)
    assert last.stat().st_ino == inode
    out = snapcore.load(tmp_path, step=2)
    assert all(torch.equal(out[k], v) for k, v in states[2].items())


def test_gc_removes_the_spares_and_dry_run_only_lists_them(tmp_path, capsys):
    store = snapcore.Store(local=tmp_path, retention={"local": 1})
    for step in (1, 2):
        _save({"x": torch.full((1000,), float(step))}, store, step)
    (spare,) = _spares(tmp_path)
    assert str(spare) in LocalTier(tmp_path).collect(dry_run=True) and spare.exists()
    assert main(["gc", str(tmp_path)]) == 0
    assert not spare.exists() and not (tmp_path / SPARE_DIR).exists()
    assert torch.equal(snapcore.load(tmp_path)["x"], torch.full((1000,), 2.0))


def test_with_recycling_off_freed_files_are_deleted(tmp_path):
    store = snapcore.Store(local=tmp_path, retention={"local": 1})
    with settings.override(SNAPCORE_RECYCLE="off"):
        for step in (1, 2, 3):
            _save({"x": torch.full((1000,), float(step))}, store, step)
    assert not (tmp_path / SPARE_DIR).exists()
    assert [p.parent.name for p in tmp_path.rglob("*.bin")] == [step_dir_name(3)]
    with settings.override(SNAPCORE_RECYCLE="maybe"), pytest.raises(ValueError, match="RECYCLE"):
        settings.recycle()


def _make_spares(d: LocalDirectory, sizes: list[int]) -> list[int]:
    """Spares of ``sizes`` bytes, made as retention makes them; their inodes."""
    inodes = []
    for i, size in enumerate(sizes):
        f = d.root / f"freed-{i}"
        f.write_bytes(b"\x01" * size)
        inodes.append(f.stat().st_ino)
        assert d._spare(f)
    return inodes


def test_spares_are_as_many_as_the_newest_snapshot_has_data_files(tmp_path, monkeypatch):
    store = snapcore.Store(local=tmp_path, retention={"local": 0})  # keeps every step
    for step in range(1, 6):
        _save({"x": torch.full((1000,), float(step))}, store, step)
    d = LocalDirectory(tmp_path)
    for step in (1, 2, 3, 4):  # retention lowered: four steps' files freed at once
        d.uncommit(step)
    freed = d.collect_leftovers(full=True, recycle=True)
    assert len(freed) == 4 and not any(p.exists() for p in freed)  # out of the steps
    assert len(_spares(tmp_path)) == 1  # what the next save takes: step 5 has one file
    assert [p.parent.name for p in tmp_path.rglob("data-*.bin")] == [step_dir_name(5)]
    # spares beyond that (left by an earlier collection) go, the smallest first
    kept = _make_spares(d, [5000, 100, 3000])
    _save({"x": torch.full((1000,), 6.0)}, store, 6)  # takes one
    d.uncommit(5)
    d.collect_leftovers(full=True, recycle=True)
    assert [p.stat().st_ino for p in _spares(tmp_path)] == [kept[0]]  # the largest
    monkeypatch.setattr(directory, "SPARES_MAX", 0)
    d.uncommit(6)
    _save({"x": torch.full((1000,), 7.0)}, store, 7)
    d.collect_leftovers(full=True, recycle=True)
    assert _spares(tmp_path) == []
    assert torch.equal(snapcore.load(tmp_path)["x"], torch.full((1000,), 7.0))


def test_the_smallest_spare_that_holds_the_file_is_taken(tmp_path):
    d = LocalDirectory(tmp_path)
    small, fits, large = _make_spares(d, [10_000, 300_000, 4 << 20])
    state = {"x": torch.randn(50_000)}  # 200 kB
    stats = snapcore.save(state, snapcore.Store(local=tmp_path), step=1)
    (written,) = _data_files(tmp_path, 1)
    assert written.stat().st_ino == fits and written.stat().st_size == stats.file_bytes
    assert sorted(p.stat().st_ino for p in _spares(tmp_path)) == sorted([small, large])
    stats = snapcore.save({"x": torch.randn(2 << 20)}, snapcore.Store(local=tmp_path), step=2)
    (written,) = _data_files(tmp_path, 2)
    assert written.stat().st_ino == large  # none holds 8 MB: the largest, which grows
    assert torch.equal(snapcore.load(tmp_path, step=1)["x"], state["x"])


def test_spares_go_when_the_disk_has_no_room_for_a_new_file(tmp_path, monkeypatch):
    d = LocalDirectory(tmp_path)
    _make_spares(d, [1000, 2000, 3000])
    snapcore.save({"x": torch.randn(100_000)}, snapcore.Store(local=tmp_path), step=1)
    assert len(_spares(tmp_path)) == 2  # one taken; room for the rest of the file
    real = os.statvfs

    def full(path):  # what statvfs says of a disk with 4 kB free
        st = real(path)
        return os.statvfs_result((*st[:4], 1, *st[5:]))  # f_bavail = 1 block

    monkeypatch.setattr(directory.os, "statvfs", full)
    state = {"x": torch.randn(100_000)}
    snapcore.save(state, snapcore.Store(local=tmp_path), step=2)  # takes one: too small
    assert _spares(tmp_path) == []
    assert torch.equal(snapcore.load(tmp_path, step=2)["x"], state["x"])


def test_the_free_space_check_deletes_only_this_users_spares(tmp_path, monkeypatch):
    d = LocalDirectory(tmp_path)
    _make_spares(d, [1000, 2000])
    (other,) = _make_spares(d, [3000])
    (theirs,) = [p for p in _spares(tmp_path) if p.stat().st_ino == other]
    theirs.chmod(0o444)  # another user's (or read-only): not this save's to delete
    real = os.statvfs
    monkeypatch.setattr(
        directory.os, "statvfs", lambda p: os.statvfs_result((*real(p)[:4], 1, *real(p)[5:]))
    )
    state = {"x": torch.randn(100_000)}
    snapcore.save(state, snapcore.Store(local=tmp_path), step=1)
    assert _spares(tmp_path) == [theirs]
    assert torch.equal(snapcore.load(tmp_path)["x"], state["x"])


def test_a_spare_much_larger_than_the_save_is_not_taken_and_goes_first(tmp_path):
    d = LocalDirectory(tmp_path)
    (large,) = _make_spares(d, [8 << 20])
    store = snapcore.Store(local=tmp_path, retention={"local": 1})
    _save({"x": torch.randn(1000)}, store, 1)  # 4 kB: cutting 8 MB back costs more
    (written,) = _data_files(tmp_path, 1)
    assert written.stat().st_ino != large
    _save({"x": torch.randn(1000)}, store, 2)  # step 1's file freed: a spare that fits
    assert [p.stat().st_size < 1 << 20 for p in _spares(tmp_path)] == [True]  # 8 MB went


def test_a_spare_swapped_for_a_directory_is_put_back_and_a_new_file_written(tmp_path, monkeypatch):
    d = LocalDirectory(tmp_path)
    _make_spares(d, [100_000])
    (spare,) = _spares(tmp_path)
    real = os.rename

    def swap(src, dst):  # another process replaces the spare between check and rename
        if Path(src) == spare and not Path(src).is_dir():
            Path(src).unlink()
            Path(src).mkdir()
        return real(src, dst)

    monkeypatch.setattr(directory.os, "rename", swap)
    state = {"x": torch.randn(10_000)}
    snapcore.save(state, snapcore.Store(local=tmp_path), step=1)
    assert spare.is_dir()  # back where it was
    (written,) = _data_files(tmp_path, 1)
    assert written.is_file()
    assert torch.equal(snapcore.load(tmp_path)["x"], state["x"])


def test_files_in_the_spare_directory_that_snapcore_did_not_make_are_left_alone(tmp_path):
    (tmp_path / SPARE_DIR).mkdir()
    notes = tmp_path / SPARE_DIR / "notes.txt"
    notes.write_bytes(b"n" * 100_000)  # the largest file there: taken first if it were a spare
    other = tmp_path / SPARE_DIR / "0123456789abcdef.bin"  # not the names spares have
    other.write_bytes(b"o" * 100_000)
    store = snapcore.Store(local=tmp_path, retention={"local": 1})
    for step in (1, 2, 3):
        _save({"x": torch.full((1000,), float(step))}, store, step)
    assert len(_spares(tmp_path)) == 1  # step 2's file
    assert main(["gc", str(tmp_path)]) == 0
    assert sorted(os.listdir(tmp_path / SPARE_DIR)) == ["0123456789abcdef.bin", "notes.txt"]
    assert notes.read_bytes() == b"n" * 100_000 and other.read_bytes() == b"o" * 100_000


def test_a_spare_this_user_may_not_write_is_not_taken(tmp_path):
    d = LocalDirectory(tmp_path)
    (inode,) = _make_spares(d, [100_000])
    (spare,) = _spares(tmp_path)
    spare.chmod(0o444)  # another user's file, say: renaming it would fail the save
    snapcore.save({"x": torch.ones(1000)}, snapcore.Store(local=tmp_path), step=1)
    (written,) = _data_files(tmp_path, 1)
    assert written.stat().st_ino != inode and spare.exists()


def test_a_freed_file_with_another_name_is_deleted_not_kept(tmp_path):
    store = snapcore.Store(local=tmp_path, retention={"local": 1})
    _save({"x": torch.full((1000,), 1.0)}, store, 1)
    (first,) = _data_files(tmp_path, 1)
    backup = tmp_path.parent / f"{tmp_path.name}-backup.bin"
    os.link(first, backup)  # a hard-link backup (cp -al) of the step
    _save({"x": torch.full((1000,), 2.0)}, store, 2)
    assert _spares(tmp_path) == [] and not first.exists()  # its name went, not its bytes
    assert backup.stat().st_nlink == 1 and backup.stat().st_size > 0


def test_with_recycling_off_no_spare_is_taken(tmp_path):
    d = LocalDirectory(tmp_path)
    (inode,) = _make_spares(d, [100_000])
    with settings.override(SNAPCORE_RECYCLE="off"):
        snapcore.save({"x": torch.ones(1000)}, snapcore.Store(local=tmp_path), step=1)
    (written,) = _data_files(tmp_path, 1)
    assert written.stat().st_ino != inode and len(_spares(tmp_path)) == 1


def test_a_bad_recycle_setting_fails_the_save_before_retention_drops_anything(tmp_path):
    store = snapcore.Store(local=tmp_path, retention={"local": 1})
    _save({"x": torch.full((1000,), 1.0)}, store, 1)
    bad = settings.override(SNAPCORE_RECYCLE="maybe")
    with bad, pytest.raises(snapcore.SnapshotFailed, match="SNAPCORE_RECYCLE must be"):
        _save({"x": torch.full((1000,), 2.0)}, store, 2)
    assert LocalDirectory(tmp_path).committed_steps() == [1]
    assert torch.equal(snapcore.load(tmp_path)["x"], torch.full((1000,), 1.0))


def test_a_spare_directory_that_is_a_link_is_never_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "aaaaaaaaaaaa.bin").write_bytes(b"years of work")
    root = tmp_path / "store"
    root.mkdir()
    (root / SPARE_DIR).symlink_to(victim, target_is_directory=True)
    store = snapcore.Store(local=root, retention={"local": 1})
    for step in (1, 2, 3):
        _save({"x": torch.full((1000,), float(step))}, store, step)
    assert main(["gc", str(root)]) == 0
    assert os.listdir(victim) == ["aaaaaaaaaaaa.bin"]
    assert (victim / "aaaaaaaaaaaa.bin").read_bytes() == b"years of work"
    assert torch.equal(snapcore.load(root)["x"], torch.full((1000,), 3.0))


def test_a_spare_that_is_not_a_plain_file_of_its_own_is_never_written_over(tmp_path):
    target = tmp_path / "elsewhere.bin"
    target.write_bytes(b"x" * 10000)  # larger than any real spare here: taken first if followed
    root = tmp_path / "store"
    (root / SPARE_DIR).mkdir(parents=True)
    (root / SPARE_DIR / "ffffffffffff.bin").symlink_to(target)
    os.link(target, root / SPARE_DIR / "dddddddddddd.bin")  # the same bytes under two names
    os.mkfifo(root / SPARE_DIR / "eeeeeeeeeeee.bin")
    store = snapcore.Store(local=root, retention={"local": 1})
    for step in (1, 2, 3):
        _save({"x": torch.full((1000,), float(step))}, store, step)
    assert target.read_bytes() == b"x" * 10000
    assert (root / SPARE_DIR / "dddddddddddd.bin").exists()  # not taken
    assert main(["gc", str(root)]) == 0  # removes the link (a name), not the file's bytes
    assert sorted(os.listdir(root / SPARE_DIR)) == ["eeeeeeeeeeee.bin", "ffffffffffff.bin"]
    assert target.read_bytes() == b"x" * 10000
    assert torch.equal(snapcore.load(root)["x"], torch.full((1000,), 3.0))


def test_a_writer_whose_files_are_committed_does_not_hold_back_retention(tmp_path):
    """The node's other ranks still hold their step's lock for a moment after its commit,
    when their leader applies retention: their files are committed, so they will
    reference nothing more; a writer of a step not committed yet still holds it back."""
    import fcntl

    store = snapcore.Store(local=tmp_path, retention={"local": 0})
    for step in (1, 2):
        _save({"x": torch.full((1000,), float(step))}, store, step)
    d = LocalDirectory(tmp_path)
    (old,) = _data_files(tmp_path, 1)
    (new,) = _data_files(tmp_path, 2)
    token = new.name.split("-")[1]  # data-<token>-r0.bin

    def hold(step: int, token: str) -> int:
        (tmp_path / step_dir_name(step)).mkdir(exist_ok=True)
        fd = os.open(tmp_path / step_dir_name(step) / f"{token}.pending", os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd

    d.uncommit(1)
    pending = hold(3, "abcdef012345")  # a step being written: holds back the full pass
    assert d.collect_leftovers(full=True) == [] and old.exists()
    os.close(pending)
    (tmp_path / step_dir_name(3) / "abcdef012345.pending").unlink()
    finishing = hold(2, token)  # committed in step 2, its lock not removed yet
    try:
        assert old in d.collect_leftovers(full=True, recycle=True)
        assert not old.exists() and len(_spares(tmp_path)) == 1
        assert (tmp_path / step_dir_name(2) / f"{token}.pending").exists()  # still its own
    finally:
        os.close(finishing)
    assert torch.equal(snapcore.load(tmp_path)["x"], torch.full((1000,), 2.0))
