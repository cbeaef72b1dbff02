"""Tiers: host memory that survives the process, local disk, retention, shared chunks."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import snapcore
from snapcore.directory import SPARE_DIR, LocalDirectory
from snapcore.tiers import HostTier, Retention
from snapcore.write.engine import close_all, engine_for


@pytest.fixture(autouse=True)
def _close_engines():
    yield
    close_all()


def state_at(step: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(256, 64, generator=g),
        "b": torch.randint(0, 100, (1000,), generator=g),
        "step": step,
    }


def assert_state(out: dict[str, object], step: int) -> None:
    want = state_at(step)
    assert torch.equal(out["w"], want["w"]) and torch.equal(out["b"], want["b"])
    assert out["step"] == step


def test_retention_parsing_and_choice():
    assert Retention.parse(3) == Retention(last=3)
    assert Retention.parse("2+10") == Retention(last=2, every=10)
    assert Retention.parse(None).doomed([1, 2, 3]) == []
    assert Retention(last=2).doomed([5, 1, 30, 4]) == [1, 4]
    assert Retention(last=2, every=10).doomed(range(1, 26)) == [
        s for s in range(1, 24) if s not in (10, 20)
    ]
    assert Retention(last=0, every=10).doomed([3, 10, 17]) == [3]  # the newest stays
    with pytest.raises(ValueError, match="N\\+EVERY"):
        Retention.parse("x")


def test_store_validation():
    with pytest.raises(ValueError, match="at least one tier"):
        snapcore.Store()
    with pytest.raises(ValueError, match="codec"):
        snapcore.Store(local="/tmp/x", codec="lz4")
    with pytest.raises(ValueError, match="unknown tier"):
        snapcore.Store(local="/tmp/x", retention={"disk": 1})


def test_host_and_local_commit_and_restore_from_host(tmp_path, host_name):
    store = snapcore.Store(host=host_name, local=tmp_path)
    h = snapcore.async_save(state_at(1), store, step=1)
    assert h.tiers == ("host", "local")
    h.wait(tier="host")
    h.wait()
    assert set(h.stats.tiers) == {"host", "local"}
    assert snapcore.committed(store) == {"host": [1], "local": [1]}
    state = state_at(0)
    info = snapcore.restore(state, store)
    assert info.step == 1 and info.tier == "host" and not info.damaged
    assert_state(state, 1)
    with pytest.raises(ValueError, match="not sent to tier 'remote'"):
        h.wait(tier="remote")


def test_two_slots_keep_the_last_committed_host_snapshot(tmp_path, host_name):
    store = snapcore.Store(host=host_name, local=tmp_path)
    for step in (1, 2, 3):
        snapcore.save(state_at(step), store, step=step)
    host = HostTier(host_name)
    assert host.committed_steps() == [2, 3]
    slots = {f.name for s in (2, 3) for f in host.read_manifest(s).files}
    assert slots == {"slot-0.bin", "slot-1.bin"}
    assert_state(snapcore.load(snapcore.Store(host=host_name), step=2), 2)


def test_reusing_a_slot_waits_for_the_other_slots_host_commit(tmp_path, host_name, monkeypatch):
    """Save 3 reuses save 1's slot while save 2's host commit is still under way (held
    here; in a sharded save it waits for the slowest rank and the coordinator): it waits
    for it before uncommitting step 1, so that the host tier always keeps a committed
    snapshot (docs/architecture.md, "Tier 0")."""
    from snapcore.write import job as write_job

    real = write_job.commit_host
    held = threading.Event()

    def slow(host, s, handle, sharded=None):
        if s.step == 2:
            held.set()
            time.sleep(1.5)
        return real(host, s, handle, sharded)

    monkeypatch.setattr(write_job, "commit_host", slow)
    store = snapcore.Store(host=host_name, local=tmp_path)
    snapcore.save(state_at(1), store, step=1)
    h2 = snapcore.async_save(state_at(2), store, step=2)
    assert held.wait(30)
    h3 = snapcore.async_save(state_at(3), store, step=3)
    host = HostTier(host_name)
    assert host.committed_steps()[:1] == [2]  # the host tier kept a committed snapshot
    assert h2.done("host")
    h2.wait()
    h3.wait()
    assert host.committed_steps() == [2, 3]


def test_host_only_snapshot_survives_sigkill_and_restores_without_disk(tmp_path, host_name):
    local = tmp_path / "local"
    code = textwrap.dedent(
        f"""
        import os, signal, torch, snapcore
        from tests.integration.test_tiers import state_at
        store = snapcore.Store(host={host_name!r}, local={str(local)!r})
        snapcore.save(state_at(7), store, step=7, tiers=["host"])
        print("committed", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[2],
        check=False,
    )
    assert r.returncode == -9 and "committed" in r.stdout, r.stderr
    assert LocalDirectory(local).committed_steps() == []  # nothing on disk to read from
    state = state_at(0)
    info = snapcore.restore(state, snapcore.Store(host=host_name, local=local))
    assert info.step == 7 and info.tier == "host"
    assert_state(state, 7)


def test_host_area_of_another_store_is_released(tmp_path, host_name):
    snapcore.save(state_at(1), snapcore.Store(host=host_name, local=tmp_path / "a"), step=1)
    close_all()
    other = snapcore.Store(host=host_name, local=tmp_path / "b")
    assert snapcore.committed(other) == {"host": [], "local": []}  # not read...
    assert HostTier(host_name).committed_steps() == [1]  # ...and not destroyed by a read
    snapcore.save(state_at(2), other, step=2)  # the first save claims the area
    assert HostTier(host_name).committed_steps() == [2]


def test_host_snapshots_older_than_local_are_stale(tmp_path, host_name):
    store = snapcore.Store(host=host_name, local=tmp_path)
    snapcore.save(state_at(1), store, step=1)
    snapcore.save(state_at(2), tmp_path, step=2)  # a later run wrote the disk only
    close_all()
    state = state_at(0)
    assert snapcore.restore(state, store).tier == "local"
    assert_state(state, 2)
    snapcore.save(state_at(3), store, step=3)  # the stale area is released first
    assert snapcore.committed(store) == {"host": [3], "local": [1, 2, 3]}


def test_damaged_host_chunk_is_read_from_local(tmp_path, host_name):
    store = snapcore.Store(host=host_name, local=tmp_path)
    snapcore.save(state_at(4), store, step=4)
    host = HostTier(host_name)
    m = host.read_manifest(4)
    c = m.blobs[0].chunks[0]
    with open(host.root / m.files[c.file].name, "r+b") as f:
        f.seek(c.offset + 10)
        byte = f.read(1)
        f.seek(c.offset + 10)
        f.write(bytes([byte[0] ^ 0xFF]))
    state = state_at(0)
    info = snapcore.restore(state, store)
    assert_state(state, 4)
    assert info.tier == "host+local"
    assert len(info.damaged) == 1 and "host" in info.damaged[0] and "xxh3" in info.damaged[0]


def test_frozen_weights_cost_nothing_after_the_first_snapshot(tmp_path):
    torch.manual_seed(0)
    frozen = torch.nn.Linear(512, 512)  # 1 MiB, never changes
    head = torch.nn.Linear(512, 8)
    state = {"frozen": frozen, "head": head}
    first = snapcore.save(state, tmp_path, step=1)
    with torch.no_grad():
        head.weight.add_(1.0)
    second = snapcore.save(state, tmp_path, step=2)
    frozen_bytes = sum(p.numel() * 4 for p in frozen.parameters())
    assert first.written["local"] >= frozen_bytes
    assert second.reused["local"] >= frozen_bytes
    assert second.written["local"] < 20_000  # the head only
    out1, out2 = snapcore.load(tmp_path, step=1), snapcore.load(tmp_path, step=2)
    assert torch.equal(out2["frozen"]["weight"], frozen.weight)
    assert torch.equal(out2["head"]["weight"], head.weight)
    assert torch.equal(out1["head"]["weight"] + 1.0, head.weight)


def test_retention_keeps_shared_chunks_alive(tmp_path):
    frozen = torch.randn(64, 1024)
    store = snapcore.Store(local=tmp_path, retention={"local": 2})
    for step in range(1, 6):
        snapcore.save({"frozen": frozen, "x": torch.full((10,), float(step))}, store, step=step)
    snapcore.wait_all(store)  # retention runs after each commit, in the background
    assert LocalDirectory(tmp_path).committed_steps() == [4, 5]
    # step 1's file holds the frozen chunk that 4 and 5 share: it must still be there
    for step in (4, 5):
        out = snapcore.load(tmp_path, step=step)
        assert torch.equal(out["frozen"], frozen) and out["x"][0] == step
    files = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.bin"))
    referenced = {f.name for s in (4, 5) for f in LocalDirectory(tmp_path).read_manifest(s).files}
    kept = {f for f in files if not f.startswith(f"{SPARE_DIR}/")}
    assert kept == referenced  # nothing else was kept in the steps
    # steps 2 and 3's files were freed: kept as spares, unless a later save wrote over one
    assert 1 <= len(files) - len(kept) <= 2


def test_identical_chunks_within_one_snapshot_are_stored_once(tmp_path):
    a = torch.zeros(1 << 16)
    stats = snapcore.save({"a": a, "b": torch.zeros(1 << 16)}, tmp_path, step=1)
    assert stats.written["local"] < 2 * a.numel() * 4
    out = snapcore.load(tmp_path)
    assert torch.equal(out["a"], a) and torch.equal(out["b"], a)


def test_only_some_tiers_per_snapshot(tmp_path, host_name):
    store = snapcore.Store(host=host_name, local=tmp_path)
    snapcore.save(state_at(1), store, step=1, tiers=["host"])
    snapcore.save(state_at(2), store, step=2)
    assert snapcore.committed(store) == {"host": [1, 2], "local": [2]}
    with pytest.raises(ValueError, match="not configured"):
        snapcore.save(state_at(3), store, step=3, tiers=["remote"])


def test_engine_close_frees_the_arenas(tmp_path, host_name):
    store = snapcore.Store(host=host_name, local=tmp_path)
    snapcore.save(state_at(1), store, step=1)
    eng = engine_for(store)
    assert eng.arenas[0] is not None
    close_all()
    assert eng.arenas == [None, None]
    # the host snapshot is still there for a new process
    assert HostTier(host_name).committed_steps() == [1]
    assert os.path.getsize(HostTier(host_name).slot_path(0)) > 0
