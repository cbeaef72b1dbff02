"""The snapcore command: ls, inspect, verify, gc."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

import snapcore
from snapcore.cli import human_bytes, main


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "snapcore", *args], capture_output=True, text=True, check=False
    )


def test_human_bytes():
    assert human_bytes(512) == "512 B"
    assert human_bytes(1536) == "1.5 KiB"
    assert human_bytes(3 * 2**30) == "3.0 GiB"


def test_ls_inspect_verify(tmp_path, capsys):
    model = torch.nn.Linear(4, 3)
    snapcore.save({"model": model, "step": 1}, tmp_path, step=1)
    snapcore.save({"model": model, "step": 20}, tmp_path, step=20)
    assert main(["ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[1].startswith("1 ") and lines[2].startswith("20 ") and "committed" in lines[2]
    assert main(["inspect", str(tmp_path), "--step", "1"]) == 0
    out = capsys.readouterr().out
    assert "weight: float32 [3x4] 48 B" in out and "bias: float32 [3] 12 B" in out
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 20
    r = run("verify", str(tmp_path))
    assert r.returncode == 0 and "step 20: intact" in r.stdout


def test_verify_names_the_damaged_chunk(tmp_path):
    snapcore.save({"a": torch.ones(1000), "b": torch.zeros(1000)}, tmp_path, step=3)
    m = json.loads(next(tmp_path.glob("step-*/manifest.json")).read_bytes())
    data = tmp_path / m["files"][0]["name"]
    raw = bytearray(data.read_bytes())
    raw[m["blobs"][1]["chunks"][0]["offset"]] ^= 1
    data.write_bytes(bytes(raw))
    r = run("verify", str(tmp_path), "--step", "3")
    assert r.returncode == 1
    assert "tensor 'b' chunk 0" in r.stderr and str(data) in r.stderr


def test_errors_are_one_line_and_nonzero(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 1
    assert "no committed snapshot" in capsys.readouterr().err
    assert main(["ls", str(tmp_path / "nope")]) == 0
    assert "no snapshots" in capsys.readouterr().out


def test_gc_removes_leftovers(tmp_path, capsys):
    from snapcore.store import LocalStore

    p = LocalStore(tmp_path).begin(4)
    (p.dir / f"data-{p.token}-r0.bin").write_bytes(b"x")
    import os

    os.close(p._fd)
    p._fd = None
    assert main(["gc", str(tmp_path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would delete" in out and "would be deleted (dry run)" in out and p.dir.exists()
    assert main(["gc", str(tmp_path)]) == 0
    assert "2 unreferenced or leftover file(s) deleted" in capsys.readouterr().out
    assert not p.dir.exists()


def test_ls_shows_tiers_and_gc_applies_retention(tmp_path, capsys):
    import uuid

    from snapcore.engine import close_all
    from snapcore.tiers import HostTier

    host = f"test-{uuid.uuid4().hex[:8]}"
    try:
        store = snapcore.Store(host=host, local=tmp_path)
        for step in (1, 2, 3):
            snapcore.save({"x": torch.full((1000,), float(step))}, store, step=step)
        close_all()
        assert main(["ls", str(tmp_path), "--host", host]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert "TIERS" in lines[0]
        assert " local " in lines[1] and "host,local" in lines[2] and "host,local" in lines[3]
        assert main(["gc", str(tmp_path), "--retention", "local=1", "--dry-run"]) == 0
        out = capsys.readouterr().out
        assert "local: would delete step 1 (retention)" in out and "step 2" in out
        assert snapcore.committed(tmp_path)["local"] == [1, 2, 3]
        assert main(["gc", str(tmp_path), "--retention", "local=1"]) == 0
        assert "local: deleted step 2 (retention)" in capsys.readouterr().out
        assert snapcore.committed(tmp_path)["local"] == [3]
        assert sorted(p.parent.name for p in tmp_path.rglob("*.bin")) == ["step-000000000003"]
        assert main(["gc", str(tmp_path), "--retention", "disk=1"]) == 1
        assert "unknown tier" in capsys.readouterr().err
    finally:
        close_all()
        HostTier(host).release()
