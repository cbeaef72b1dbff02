"""The snapcore command: every verb, its output and exit codes (docs/cli.md)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
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
    assert main(["verify", str(tmp_path)]) == 0
    assert "step 20: intact in local" in capsys.readouterr().out


def test_verify_names_the_damaged_chunk(tmp_path, capsys):
    snapcore.save({"a": torch.ones(1000), "b": torch.zeros(1000)}, tmp_path, step=3)
    m = json.loads(next(tmp_path.glob("step-*/manifest.json")).read_bytes())
    data = tmp_path / m["files"][0]["name"]
    raw = bytearray(data.read_bytes())
    raw[m["blobs"][1]["chunks"][0]["offset"]] ^= 1
    data.write_bytes(bytes(raw))
    assert main(["verify", str(tmp_path), "--step", "3"]) == 1
    err = capsys.readouterr().err
    assert "tensor 'b' chunk 0" in err and str(data) in err


def test_errors_are_one_line_and_nonzero(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 1
    assert "no committed snapshot" in capsys.readouterr().err
    # a missing store is an error (it exited 0 with "no snapshots" before: issue 8, item 7)
    assert main(["ls", str(tmp_path / "nope")]) == 1
    assert "no store at" in capsys.readouterr().err
    assert main(["ls", str(tmp_path)]) == 0  # an existing, empty one is not
    assert "no snapshots" in capsys.readouterr().out


def test_gc_removes_leftovers(tmp_path, capsys):
    from snapcore.directory import LocalDirectory

    p = LocalDirectory(tmp_path).begin(4)
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

    from snapcore.tiers import HostTier
    from snapcore.write.engine import close_all

    host = f"test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
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


# -- issue 8, item 7: output a person reads, store arguments, errors -------------------------


def test_inspect_prints_floats_as_numbers_and_collapses_long_sequences(tmp_path, capsys):
    rng = random.Random(3)
    state = {"lr": 0.001, "eps": float("inf"), "name": "run-1", "rng": rng.getstate()}
    snapcore.save(state, tmp_path, step=1)
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "lr = 0.001" in out and "eps = inf" in out and "name = 'run-1'" in out
    assert "0x1" not in out  # no hex float
    assert "(tuple of 625 int:" in out
    assert len(out.splitlines()) < 20  # was 625+ lines for the RNG's tuple


def test_inspect_prints_node_kinds_it_does_not_know_and_long_strings_briefly():
    from snapcore.cli.inspect import tree_lines

    tree = {
        "dict": [
            ["arr", {"ndarray": {"dtype": "int64", "shape": [3], "data": "AAAA" * 40}}],
            ["note", {"str": "x" * 5000}],
            ["bad", {"float": "0x1p99999"}],
        ]
    }
    lines = tree_lines(tree, None, "", 0)  # type: ignore[arg-type]  # no tensors in this tree
    assert lines[1].startswith('  arr = <ndarray> {"dtype":"int64","shape":[3]')
    assert lines[1].endswith("...") and len(lines[1]) < 100
    assert lines[2] == f"  note = {'x' * 60!r}... (5000 characters)"
    assert lines[3] == "  bad = <float> '0x1p99999'"  # no OverflowError traceback


def test_inspect_only_glob(tmp_path, capsys):
    snapcore.save({"model": torch.nn.Linear(2, 2), "lr": 0.5}, tmp_path, step=1)
    assert main(["inspect", str(tmp_path), "--only", "model.*"]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    assert sorted(line.split(":")[0] for line in lines) == ["model.bias", "model.weight"]


def test_names_with_terminal_escapes_are_escaped(tmp_path, capsys):
    snapcore.save({"\x1b[2J\x1b[31mred": 1, "v": "\x1b]0;title\x07"}, tmp_path, step=1)
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    assert "\\x1b[2J\\x1b[31mred" in out


def test_version():
    r = run("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"snapcore {snapcore.__version__}"


@pytest.mark.parametrize("verb", ["ls", "inspect", "verify", "gc", "journal"])
def test_a_store_that_is_a_file_or_missing_is_one_line(tmp_path, capsys, verb):
    # in this process (an exception main() let through would fail the test): a
    # subprocess costs torch's import; test_hostile's subprocess tests cover the exit path
    f = tmp_path / "file"
    f.write_text("x")
    for store in (f, tmp_path / "missing"):
        assert main([verb, str(store)]) == 1, (verb, store)
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err


def test_bad_storage_options_is_one_line(tmp_path, capsys):
    assert main(["ls", str(tmp_path), "--storage-options", "{nope"]) == 1
    err = capsys.readouterr().err
    assert "--storage-options is not JSON" in err and len(err.strip().splitlines()) == 1


def test_piping_into_head_prints_no_traceback(tmp_path):
    snapcore.save({f"key-{i}": i for i in range(20000)}, tmp_path, step=1)  # > a pipe's buffer
    for verb in ("inspect", "ls"):
        with subprocess.Popen(
            [sys.executable, "-m", "snapcore", verb, str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        ) as proc:
            assert proc.stdout is not None and proc.stderr is not None
            proc.stdout.readline()
            proc.stdout.close()  # what `head -1` does after its line
            err = proc.stderr.read().decode()
            assert proc.wait(timeout=60) in (0, 1)
        assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_ls_of_a_manifest_with_an_absurd_time(tmp_path, capsys):
    snapcore.save({"x": torch.ones(2)}, tmp_path, step=1)
    path = next(tmp_path.glob("step-*/manifest.json"))
    doc = json.loads(path.read_bytes())
    doc["created_unix"] = 1e300
    path.write_text(json.dumps(doc))
    assert main(["ls", str(tmp_path)]) == 0  # the time shows as "?", or the manifest as damaged
    out = capsys.readouterr().out
    assert out.splitlines()[1].startswith("1 ")


def test_gc_without_retention_deletes_no_committed_step(tmp_path, capsys):
    store = snapcore.Store(local=tmp_path, retention={"local": 0})
    for step in range(1, 6):
        snapcore.save({"x": torch.full((10,), float(step))}, store, step=step)
    assert main(["gc", str(tmp_path)]) == 0
    assert snapcore.committed(tmp_path)["local"] == [1, 2, 3, 4, 5]


def test_inspect_and_verify_read_object_storage(s3_server, s3_bucket, capsys):
    options = s3_bucket.options_for(s3_server)
    store = snapcore.Store(remote=f"{s3_bucket.url}/run", storage_options=options)
    snapcore.save({"w": torch.arange(10.0), "lr": 0.25}, store, step=7)
    snapcore.close()
    args = [f"{s3_bucket.url}/run", "--storage-options", json.dumps(options)]
    assert main(["ls", *args]) == 0
    assert "remote" in capsys.readouterr().out
    assert main(["inspect", *args]) == 0
    out = capsys.readouterr().out
    assert "step 7 (remote)" in out and "w: float32 [10]" in out and "lr = 0.25" in out
    assert main(["verify", *args]) == 0
    assert "step 7: intact in remote" in capsys.readouterr().out
    assert (
        main(["ls", f"{s3_bucket.url}/nothing-here", "--storage-options", json.dumps(options)]) == 1
    )
    assert "nothing under that prefix" in capsys.readouterr().err


def test_verify_every_tier_holding_the_step(tmp_path, host_name, capsys):
    store = snapcore.Store(local=tmp_path, host=host_name)
    snapcore.save({"x": torch.ones(100)}, store, step=2)
    assert main(["verify", str(tmp_path), "--host", host_name]) == 0
    out = capsys.readouterr().out
    assert "step 2: intact in host" in out and "step 2: intact in local" in out
    assert main(["verify", str(tmp_path), "--host", host_name, "--tier", "host"]) == 0
    assert "local" not in capsys.readouterr().out


def test_a_store_of_host_memory_only_needs_no_store_argument(host_name, capsys):
    snapcore.save({"lr": 0.5}, snapcore.Store(host=host_name), step=4)
    snapcore.close()
    assert main(["ls", "--host", host_name]) == 0
    assert "host" in capsys.readouterr().out.splitlines()[1]
    assert main(["inspect", "--host", host_name]) == 0
    assert "lr = 0.5" in capsys.readouterr().out
    assert main(["ls"]) == 2  # no tier named at all: a usage error
    assert "give a STORE" in capsys.readouterr().err
    assert main(["ls", "--host", "no-such-area-x"]) == 1
    assert "no host-memory area" in capsys.readouterr().err


def test_journal_of_a_missing_store_fails_and_an_absurd_time_prints(tmp_path, capsys):
    assert main(["journal", str(tmp_path / "missing")]) == 1
    assert "no store at" in capsys.readouterr().err
    assert main(["journal", str(tmp_path / "missing.jsonl")]) == 1
    capsys.readouterr()
    line = {"v": 1, "event": "start", "time": 1e300, "run": "r1", "pid": 1, "devices": 1}
    (tmp_path / "journal.jsonl").write_text(json.dumps(line) + "\n")
    assert main(["journal", str(tmp_path)]) == 0  # an OverflowError traceback before
    assert "start" in capsys.readouterr().out


# -- issue 8, item 5: host-memory areas ----------------------------------------------------


def test_host_areas_listed_and_freed(tmp_path, host_name, capsys):
    from pathlib import Path

    store = snapcore.Store(local=tmp_path, host=host_name)
    snapcore.save({"x": torch.ones(1 << 16)}, store, step=3)
    area = {a.name: a for a in snapcore.host_areas()}[host_name]
    assert area.steps == [3] and area.bytes >= 1 << 18
    assert area.store == {"local": str(tmp_path), "remote": None}
    # in use by this process's engine: refused, and nothing is freed
    assert main(["rm", "--host", host_name]) == 1
    assert "in use" in capsys.readouterr().err
    with pytest.raises(snapcore.StoreInUse):
        snapcore.free_host(host_name)
    assert Path(area.path).is_dir()
    snapcore.close()
    assert main(["hosts"]) == 0
    assert host_name in capsys.readouterr().out
    assert main(["rm", "--host", host_name]) == 0
    assert f"freed host-memory area {host_name}" in capsys.readouterr().out
    assert not Path(area.path).exists()
    assert snapcore.committed(tmp_path)["local"] == [3]  # the other tiers are untouched
    with pytest.raises(snapcore.SnapshotNotFound):
        snapcore.free_host(host_name)
    assert main(["rm", "--host", host_name]) == 1


def test_free_host_refuses_an_area_another_process_writes(tmp_path, host_name):
    code = (
        "import sys, torch, snapcore\n"
        f"snapcore.save({{'x': torch.ones(8)}}, snapcore.Store(local={str(tmp_path)!r}, "
        f"host={host_name!r}), step=1)\n"
        "print('saved', flush=True)\n"
        "sys.stdin.readline()\n"
    )
    with subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as child:
        assert child.stdout is not None and child.stdin is not None
        try:
            assert child.stdout.readline().strip() == "saved"
            with pytest.raises(snapcore.StoreInUse, match=f"pid {child.pid}"):
                snapcore.free_host(host_name)
        finally:
            child.stdin.close()  # the child exits
            child.wait(timeout=60)
    assert snapcore.free_host(host_name) > 0


def test_inspect_describes_the_value_kinds(tmp_path, capsys):
    import dataclasses
    import enum

    import numpy as np

    class Color(enum.Enum):
        BLUE = 2

    @dataclasses.dataclass
    class Cfg:
        lr: float
        name: str

    state = {
        "arr": np.arange(6, dtype=np.float32),
        "g": torch.Generator().manual_seed(1),
        "r": random.Random(5),
        "c": Color.BLUE,
        "cfg": Cfg(0.5, "x"),
    }
    snapcore.save(state, tmp_path, step=1)
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "arr = numpy float32 [6] (inline)" in out
    assert "g = torch.Generator on cpu" in out
    assert "r = random.Random" in out and len(out.splitlines()) < 20
    assert "Color.BLUE" in out
    assert "cfg/ (dataclass" in out and "lr = 0.5" in out and "name = 'x'" in out


def test_ctrl_c_is_one_line_and_exit_130(monkeypatch, capsys) -> None:
    import importlib

    module = importlib.import_module("snapcore.cli.main")

    def interrupted(argv: list[str]) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(module, "_run", interrupted)
    assert main(["ls", "anything"]) == 130
    err = capsys.readouterr().err
    assert err == "snapcore: interrupted\n"
