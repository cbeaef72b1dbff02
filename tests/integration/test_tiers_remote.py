"""The object-storage tier end to end, against moto's S3 server on 127.0.0.1 (real s3fs
HTTP, no mocks), and the failures a production store meets: a dead server, a full disk,
a damaged local copy."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

import snapcore
from snapcore import _native
from snapcore.directory import LocalDirectory
from snapcore.write.engine import close_all, engine_for
from tests.conftest import _botocore_client, s3_storage_options


@pytest.fixture(autouse=True)
def _close_engines():
    yield
    close_all()


def state_at(step: int, n: int = 1 << 16) -> dict[str, object]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(n, generator=g) * 0.02, "i": torch.arange(n) % 7, "step": step}


def same(a: dict[str, object], b: dict[str, object]) -> bool:
    return (
        torch.equal(a["w"], b["w"])  # type: ignore[arg-type]
        and torch.equal(a["i"], b["i"])  # type: ignore[arg-type]
        and a["step"] == b["step"]
    )


def test_upload_then_restore_from_remote_only(tmp_path, s3_bucket):
    store = snapcore.Store(
        local=tmp_path / "local", remote=s3_bucket.url, storage_options=s3_bucket.storage_options
    )
    h = snapcore.async_save(state_at(1), store, step=1)
    assert h.tiers == ("local", "remote")
    h.wait(tier="local")
    stats = h.wait(tier="remote")
    assert stats.written["remote"] > 0 and set(stats.tiers) == {"local", "remote"}
    assert snapcore.committed(store) == {"local": [1], "remote": [1]}
    close_all()
    shutil.rmtree(tmp_path / "local")  # the machine is gone: only object storage is left
    state = state_at(0)
    info = snapcore.restore(state, store)
    assert info.step == 1 and info.tier == "remote" and same(state, state_at(1))


def test_an_upload_reads_the_chunk_index_once_its_pending_mark_is_written(
    tmp_path, s3_bucket, monkeypatch
):
    """Another process removes a step and collects while an upload starts (in a sharded
    save: rank 0's retention, during another rank's upload). The upload reads the remote
    chunk index only once its pending mark is written: a collection that listed the
    store before the mark removed that step's manifest first, so the index no longer
    names its objects; one that lists it after the mark spares every object. Read before
    the mark, the index named an object deleted meanwhile: a committed, damaged step."""
    from snapcore.tiers import RemoteStoreTier

    remote = {"remote": s3_bucket.url, "storage_options": s3_bucket.storage_options}
    store = snapcore.Store(local=tmp_path, **remote)
    snapcore.save(state_at(1), store, step=1)
    other = RemoteStoreTier(s3_bucket.url, s3_bucket.storage_options)
    removed: list[str] = []
    real = RemoteStoreTier.begin

    def begin(self, step: int, token: str) -> None:
        if step == 2 and self is not other:  # just before the mark: step 1 goes
            other.uncommit(1)
            removed.extend(other.collect())
        real(self, step, token)

    monkeypatch.setattr(RemoteStoreTier, "begin", begin)
    again = {**state_at(1), "step": 2}  # step 1's tensors: its chunks would be referenced
    snapcore.save(again, store, step=2)
    other.close()
    assert any("/data-" in n for n in removed), removed  # step 1's data object went
    close_all()
    assert same(snapcore.load(snapcore.Store(**remote), step=2), again)


def test_remote_only_store_uploads_from_host_memory(s3_bucket):
    store = snapcore.Store(remote=s3_bucket.url, storage_options=s3_bucket.storage_options)
    snapcore.save(state_at(2), store, step=2)
    snapcore.save(state_at(3), store, step=3)
    assert same(snapcore.load(store, step=2), state_at(2))
    assert same(snapcore.load(store), state_at(3))


def test_remote_codec_and_frozen_chunks_not_uploaded_twice(tmp_path, s3_bucket):
    store = snapcore.Store(
        local=tmp_path,
        remote=s3_bucket.url,
        storage_options=s3_bucket.storage_options,
        codec={"local": "none", "remote": "shuffle-zstd"},
    )
    frozen = torch.randn(1 << 18) * 0.02  # 1 MiB
    first = snapcore.save({"frozen": frozen, "x": torch.zeros(10)}, store, step=1)
    second = snapcore.save({"frozen": frozen, "x": torch.ones(10)}, store, step=2)
    assert first.written["remote"] < first.written["local"]  # compressed on the way up
    assert second.reused["remote"] >= frozen.numel() * 4
    assert second.written["remote"] < 10_000
    remote = engine_for(store).remote
    m = remote.read_manifest(2)
    assert {c.codec for b in m.blobs for c in b.chunks} == {"shuffle-zstd"}
    close_all()
    shutil.rmtree(tmp_path)
    out = snapcore.load(store, step=2)
    assert torch.equal(out["frozen"], frozen) and torch.equal(out["x"], torch.ones(10))


def test_damaged_local_chunk_is_read_from_remote(tmp_path, s3_bucket):
    store = snapcore.Store(
        local=tmp_path, remote=s3_bucket.url, storage_options=s3_bucket.storage_options
    )
    snapcore.save(state_at(5), store, step=5)
    m = LocalDirectory(tmp_path).read_manifest(5)
    c = m.blobs[0].chunks[0]
    data = tmp_path / m.files[c.file].name
    raw = bytearray(data.read_bytes())
    raw[c.offset] ^= 0x01
    data.write_bytes(bytes(raw))
    state = state_at(0)
    info = snapcore.restore(state, store)
    assert same(state, state_at(5))
    assert info.tier == "local+remote"
    assert len(info.damaged) == 1 and "local" in info.damaged[0] and str(data) in info.damaged[0]


def test_remote_retention_and_gc(tmp_path, s3_bucket):
    store = snapcore.Store(
        local=tmp_path,
        remote=s3_bucket.url,
        storage_options=s3_bucket.storage_options,
        retention={"local": 2, "remote": "1+2"},
    )
    for step in range(1, 6):
        snapcore.save(state_at(step, 1024), store, step=step)
    assert snapcore.committed(store) == {"local": [4, 5], "remote": [2, 4, 5]}
    remote = engine_for(store).remote
    referenced = {f.name for s in (2, 4, 5) for f in remote.read_manifest(s).files}
    data = {n for n in remote.rt.list("") if not n.endswith("manifest.json")}
    assert data == referenced  # retention's leftovers were collected
    assert same(snapcore.load(store, step=2), state_at(2, 1024))


def test_dead_server_fails_the_upload_not_the_training(tmp_path, s3_restartable):
    _botocore_client(s3_restartable.endpoint).create_bucket(Bucket="outage")
    store = snapcore.Store(
        local=tmp_path,
        remote="s3://outage",
        storage_options=s3_storage_options(s3_restartable.endpoint),
    )
    snapcore.save(state_at(1), store, step=1)
    s3_restartable.stop()
    h = snapcore.async_save(state_at(2), store, step=2)
    h.wait(tier="local")  # the local tier commits on its own
    with pytest.raises(snapcore.SnapshotFailed) as e:
        h.wait(tier="remote")
    assert e.value.tier == "remote" and "outage" in str(e.value)
    # the next save reports it once; training goes on with the local tier
    h3 = snapcore.async_save(state_at(3), store, step=3, tiers=["local"])
    h3.wait()
    s3_restartable.start()
    assert snapcore.committed(store) == {"local": [1, 2, 3], "remote": [1]}
    snapcore.save(state_at(4), store, step=4)
    assert snapcore.committed(store)["remote"] == [1, 4]
    close_all()
    shutil.rmtree(tmp_path)
    assert same(snapcore.load(store), state_at(4))


def test_server_back_within_the_retries_completes_the_upload(tmp_path, s3_restartable):
    _botocore_client(s3_restartable.endpoint).create_bucket(Bucket="blip")
    store = snapcore.Store(
        local=tmp_path,
        remote="s3://blip",
        storage_options=s3_storage_options(s3_restartable.endpoint),
    )
    snapcore.save(state_at(1), store, step=1)  # connections are up
    s3_restartable.stop()
    restart = threading.Timer(0.5, s3_restartable.start)
    restart.start()
    try:
        snapcore.save(state_at(2), store, step=2)
    finally:
        restart.join()
    assert snapcore.committed(store)["remote"] == [1, 2]


@contextlib.contextmanager
def small_disk(path: Path, size: str = "2m"):
    """A real 2 MiB tmpfs where this machine lets us mount one; None otherwise."""
    path.mkdir(parents=True, exist_ok=True)
    ok = (
        shutil.which("mount") is not None
        and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
            capture_output=True,
            check=False,
        ).returncode
        == 0
    )
    try:
        yield ok
    finally:
        if ok:
            subprocess.run(["umount", "-l", str(path)], check=False)


def test_full_local_disk_is_a_clear_error_and_loses_nothing(tmp_path, monkeypatch):
    disk = tmp_path / "disk"
    with small_disk(disk) as mounted:
        if not mounted:  # inject ENOSPC at the write call instead
            real = _native.FileWriter

            class Full:
                def __init__(self, *a, **k):
                    self._w = real(*a, **k)
                    self.direct = self._w.direct

                def write_at(self, offset, address, n):
                    if offset + n > 1_500_000:
                        raise snapcore.StorageError(errno.ENOSPC, "No space left on device", "x")
                    self._w.write_at(offset, address, n)

                def __getattr__(self, name):
                    return getattr(self._w, name)

            monkeypatch.setattr(_native, "FileWriter", Full)
        snapcore.save({"x": torch.ones(1 << 16)}, disk, step=1)  # 256 KiB: fits
        h = snapcore.async_save({"x": torch.randn(1 << 19)}, disk, step=2)  # 2 MiB: does not
        with pytest.raises(snapcore.SnapshotFailed) as e:
            h.wait()
        cause = e.value.__cause__
        assert isinstance(cause, OSError) and cause.errno == errno.ENOSPC
        assert "step 2" in str(e.value)
        assert LocalDirectory(disk).committed_steps() == [1]
        assert torch.equal(snapcore.load(disk)["x"], torch.ones(1 << 16))
        # the failed snapshot left nothing behind, and a smaller one still fits
        assert [s.step for s in LocalDirectory(disk).snapshots()] == [1]
        snapcore.save({"x": torch.full((1 << 16,), 3.0)}, disk, step=3)
        assert LocalDirectory(disk).committed_steps() == [1, 3]
        close_all()


def test_leftovers_of_an_interrupted_upload_are_collected(tmp_path, s3_bucket):
    store = snapcore.Store(
        local=tmp_path, remote=s3_bucket.url, storage_options=s3_bucket.storage_options
    )
    snapcore.save(state_at(1, 1024), store, step=1)
    remote = engine_for(store).remote
    # a writer on this host that died mid-upload: its marker names a pid that is gone
    mark = {"t": time.time(), "host": socket.gethostname(), "pid": _dead_pid()}
    remote.rt.put_bytes("step-000000000002/abc123.pending", json.dumps(mark).encode())
    remote.rt.put_bytes("step-000000000002/data-abc123-r0.bin", b"partial")
    # and one that is alive (this process): its objects must stay
    live = {"t": time.time(), "host": socket.gethostname(), "pid": os.getpid()}
    remote.rt.put_bytes("step-000000000003/def456.pending", json.dumps(live).encode())
    remote.rt.put_bytes("step-000000000003/data-def456-r0.bin", b"in flight")
    close_all()
    snapcore.save(state_at(4, 1024), store, step=4)  # a new run's first upload collects
    names = set(engine_for(store).remote.rt.list(""))
    assert "step-000000000002/data-abc123-r0.bin" not in names
    assert "step-000000000003/data-def456-r0.bin" in names
    assert snapcore.committed(store)["remote"] == [1, 4]


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_damage_inside_a_coalesced_remote_read_is_found(tmp_path, s3_bucket):
    store = snapcore.Store(remote=s3_bucket.url, storage_options=s3_bucket.storage_options)
    snapcore.save(state_at(6), store, step=6)
    remote = engine_for(store).remote
    m = remote.read_manifest(6)
    c = m.blobs[1].chunks[0]
    name = m.files[c.file].name
    raw = bytearray(remote.rt.read_bytes(name))
    raw[c.offset + 5] ^= 0x10
    remote.rt.put_bytes(name, bytes(raw))
    close_all()
    with pytest.raises(snapcore.CorruptSnapshot) as e:
        snapcore.load(store)
    assert e.value.tensor == "i" and e.value.chunk == 0
    assert s3_bucket.url in str(e.value) and name in str(e.value)
    out = snapcore.load(store, verify=False)
    assert torch.equal(out["w"], state_at(6)["w"])  # the chunks around it were read
