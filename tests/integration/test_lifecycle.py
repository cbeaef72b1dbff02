"""The lifecycle of a process's stores: closing (snapcore.close, Store as a context manager,
interpreter exit), default retention, and one writer per store."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import uuid
from pathlib import Path

import pytest
import torch

import snapcore
from snapcore import _native
from snapcore.tiers import DEFAULT_RETENTION, HostTier, Retention
from snapcore.write import engine as engine_mod
from snapcore.write.engine import close_all


@pytest.fixture(autouse=True)
def _close_engines():
    yield
    close_all()


def small(v: float) -> dict[str, object]:
    return {"w": torch.full((64,), v)}


# -- closing --------------------------------------------------------------------------------

S3_CHILD = textwrap.dedent(
    """
    import json, sys, torch, snapcore
    local, url, opts, mode = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
    store = snapcore.Store(local=local, remote=url, storage_options=opts)
    state = {"w": torch.arange(1000.0)}
    if mode == "with":
        with store:
            snapcore.save(state, store, step=1)
    else:  # nothing closed: interpreter exit must
        snapcore.save(state, store, step=1)
    reader = snapcore.Store(remote=url, storage_options=opts)  # a second engine, reading
    out = {"w": torch.zeros(1000)}
    print(snapcore.restore(out, reader).step, bool(torch.equal(out["w"], state["w"])))
    """
)


@pytest.mark.parametrize("mode", ["exit", "with"])
def test_a_process_that_used_s3_exits_without_unclosed_sessions(s3_bucket, tmp_path, mode):
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            S3_CHILD,
            str(tmp_path / "local"),
            s3_bucket.url,
            json.dumps(s3_bucket.storage_options),
            mode,
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "True"]
    assert "Unclosed" not in out.stderr, out.stderr
    assert "Traceback" not in out.stderr, out.stderr


def test_close_waits_frees_and_raises_a_failure_nobody_saw(tmp_path, monkeypatch):
    store = snapcore.Store(local=tmp_path / "a", remote=f"memory://snapcore-{uuid.uuid4().hex[:8]}")
    h = snapcore.async_save(small(1.0), store, step=1)
    engine = engine_mod.engine_for(store)
    remote = engine.remote.rt
    snapcore.close()
    assert h.done()  # waited for: durable in every tier
    assert snapcore.committed(store) == {"local": [1], "remote": [1]}
    assert engine.arenas == [None] and remote.closed
    assert engine_mod.engine_for(store) is not engine  # a later call makes a new engine

    def failing(*a, **k):
        raise OSError(28, "No space left on device (simulated)")

    monkeypatch.setattr(_native, "FileWriter", failing)
    snapcore.async_save(small(2.0), tmp_path / "b", step=2)
    with pytest.raises(snapcore.SnapshotFailed, match="simulated"):
        snapcore.close()  # nobody waited for it: raised here, once
    monkeypatch.undo()
    snapcore.close()  # nothing left to raise


def test_store_as_a_context_manager_closes_its_engine(tmp_path, monkeypatch):
    url = f"memory://snapcore-{uuid.uuid4().hex[:8]}"
    other = tmp_path / "other"
    snapcore.save(small(0.0), other, step=1)
    with snapcore.Store(local=tmp_path / "a", remote=url) as store:
        h = snapcore.async_save(small(1.0), store, step=1)
        engine = engine_mod.engine_for(store)
    assert h.done() and engine.remote.rt.closed and engine.arenas == [None]
    assert store.key() not in engine_mod._engines
    assert snapcore.Store(local=other).key() in engine_mod._engines  # another store's: open

    def failing(*a, **k):
        raise OSError(28, "No space left on device (simulated)")

    monkeypatch.setattr(_native, "FileWriter", failing)
    with (
        pytest.raises(snapcore.SnapshotFailed, match="simulated"),
        snapcore.Store(local=tmp_path / "b") as store,
    ):
        snapcore.async_save(small(2.0), store, step=2)  # fails in the background
    with pytest.raises(KeyError), snapcore.Store(local=tmp_path / "c") as store:
        snapcore.async_save(small(2.0), store, step=2)
        raise KeyError("the body's own error wins; the failure is logged")


# -- retention ------------------------------------------------------------------------------


def test_default_retention_keeps_the_last_few_per_tier(tmp_path, host_name):
    assert {
        "host": Retention(last=2),
        "local": Retention(last=3),
        "remote": Retention(last=3),
    } == DEFAULT_RETENTION
    url = f"memory://snapcore-{uuid.uuid4().hex[:8]}"
    store = snapcore.Store(host=host_name, local=tmp_path / "a", remote=url)
    for step in range(1, 7):
        snapcore.save(small(float(step)), store, step=step)
    snapcore.wait_all(store)
    assert snapcore.committed(store) == {"host": [5, 6], "local": [4, 5, 6], "remote": [4, 5, 6]}
    # asked for explicitly, every step stays
    keep = snapcore.Store(local=tmp_path / "b", retention={"local": 0})
    for step in range(1, 7):
        snapcore.save(small(float(step)), keep, step=step)
    snapcore.wait_all(keep)
    assert snapcore.committed(keep) == {"local": [1, 2, 3, 4, 5, 6]}


# -- one writer per store -------------------------------------------------------------------

WRITER = textwrap.dedent(
    """
    import sys, torch, snapcore
    snapcore.save({"w": torch.ones(8)}, sys.argv[1], step=1)
    print("saved", flush=True)
    sys.stdin.readline()
    snapcore.close()  # drops the writer lock
    print("closed", flush=True)
    sys.stdin.readline()
    """
)


def test_a_second_live_writer_is_refused(tmp_path):
    store = tmp_path / "store"
    with subprocess.Popen(
        [sys.executable, "-c", WRITER, str(store)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as child:
        watchdog = threading.Timer(120, child.kill)  # a hung child fails the test, not CI
        watchdog.start()
        try:
            assert child.stdin is not None and child.stdout is not None
            assert child.stdout.readline() == "saved\n"
            with pytest.raises(snapcore.StoreInUse) as e:
                snapcore.save(small(2.0), store, step=2)
            assert e.value.pid == child.pid and e.value.host == socket.gethostname()
            assert str(store) in str(e.value) and f"pid {child.pid}" in str(e.value)
            assert isinstance(e.value, snapcore.StorageError)
            assert snapcore.committed(store) == {"local": [1]}  # nothing of ours was written
            info = snapcore.restore({"w": torch.zeros(8)}, store)  # reading is never refused
            assert info.step == 1
            child.stdin.write("close\n")
            child.stdin.flush()
            assert child.stdout.readline() == "closed\n"
            snapcore.save(small(2.0), store, step=2)  # the other writer is gone
            assert snapcore.committed(store) == {"local": [1, 2]}
            child.stdin.write("exit\n")
            child.stdin.flush()
            assert child.wait(timeout=60) == 0
        finally:
            watchdog.cancel()
            child.kill()


def test_a_killed_writer_leaves_no_lock_and_engines_of_one_process_share_it(tmp_path, host_name):
    store = tmp_path / "store"
    # a holder that dies however it dies releases the lock (the kernel drops the flock)
    code = "import os, sys, torch, snapcore\n" + (
        "snapcore.save({'w': torch.ones(8)}, sys.argv[1], step=1)\nos.kill(os.getpid(), 9)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(store)], capture_output=True, timeout=120)
    assert out.returncode == -9
    snapcore.save(small(2.0), store, step=2)
    # one process, two engines on the same directory (another tier set): one writer
    snapcore.save(small(3.0), snapcore.Store(local=store, host=host_name), step=3)
    assert snapcore.committed(store)["local"] == [1, 2, 3]


def test_a_host_only_store_is_locked_in_its_area(host_name):
    area = HostTier(host_name).root
    snapcore.save(small(1.0), snapcore.Store(host=host_name), step=1)
    close_all()
    assert (area / "writer.lock").is_file()
    # another holder (a separate open file description conflicts like another process)
    fd = os.open(area / "writer.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.pwrite(fd, json.dumps({"pid": 4242, "host": "elsewhere"}).encode().ljust(200), 0)
        with pytest.raises(snapcore.StoreInUse, match="pid 4242 on elsewhere"):
            snapcore.save(small(2.0), snapcore.Store(host=host_name), step=2)
    finally:
        os.close(fd)
    snapcore.save(small(2.0), snapcore.Store(host=host_name), step=2)
    assert snapcore.committed(snapcore.Store(host=host_name)) == {"host": [1, 2]}


def test_the_lock_file_is_not_garbage(tmp_path):
    snapcore.save(small(1.0), tmp_path, step=1)
    close_all()
    engine_mod.engine_for(tmp_path).tier("local").collect()  # what `snapcore gc` does
    assert Path(tmp_path / "writer.lock").is_file()
    assert json.loads((tmp_path / "writer.lock").read_text())["pid"] == os.getpid()
    assert snapcore.committed(tmp_path) == {"local": [1]}


# -- a failure after staging -----------------------------------------------------------------


def test_a_failure_after_staging_does_not_stall_the_persist_thread(
    tmp_path, host_name, monkeypatch
):
    """The persist job starts once the call is done with the training thread. A failure
    in the call after staging (preparing the next save's slot) reaches the caller, and
    the job still runs: this step commits, and the next save is not stuck behind it."""
    store = snapcore.Store(host=host_name, local=tmp_path / "s")

    def fails(self, *a, **k):
        raise MemoryError("no memory for the next slot (test)")

    monkeypatch.setattr(engine_mod.Engine, "_prepare_slot", fails)
    with pytest.raises(MemoryError, match="next slot"):
        snapcore.async_save(small(1.0), store, step=1)
    monkeypatch.undo()
    done = threading.Event()
    t = threading.Thread(target=lambda: (snapcore.save(small(2.0), store, step=2), done.set()))
    t.daemon = True
    t.start()
    t.join(120)  # a bound for a hang, not a timing: the save takes milliseconds
    assert done.is_set(), "the save after the failure never finished"
    assert snapcore.committed(store)["local"] == [1, 2]
