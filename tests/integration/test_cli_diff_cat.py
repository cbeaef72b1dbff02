"""snapcore diff, cat, inspect's --json and sizes, progress bars (issue 11, items 3-4)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import snapcore
from snapcore.cli import main
from snapcore.tiers import LocalTier


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)},
        "emb": torch.randn(100, 8, generator=g, dtype=torch.float64),
        "lr": 0.001,
        "step": 7,
    }


def test_diff_of_identical_stores_reads_no_tensor_data(tmp_path, capsys, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    snapcore.save(_state(), a, step=1)
    snapcore.save(_state(), b, step=3)
    reads = []
    real = LocalTier.read_into

    def counted(self, *args):
        reads.append(args)
        return real(self, *args)

    monkeypatch.setattr(LocalTier, "read_into", counted)
    assert main(["diff", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "0 changed, 0 added, 0 removed, 5 unchanged; 0 B of tensor data read" in out
    assert main(["diff", str(a), str(b), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["equal"] is True and doc["bytes_read"] == 0 and doc["unchanged"] == 5
    assert (doc["a"]["step"], doc["b"]["step"]) == (1, 3)
    assert reads == []  # equal chunk hashes: no data file was read at all


def test_diff_changed_added_removed(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    sa, sb = _state(0), _state(0)
    noise = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    sb["model"]["w"] = sa["model"]["w"] + 0.01 * noise  # (the global RNG made it flaky)
    sb["model"]["w"][3, 4] += 2.5
    sb["emb"] = sa["emb"].float()  # another dtype, same shape
    sb["lr"] = 0.0005
    del sb["step"]
    sb["model"]["extra"] = torch.zeros(2, dtype=torch.int32)
    snapcore.save(sa, a, step=1)
    snapcore.save(sb, b, step=1)
    assert main(["diff", str(a), str(b), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == {"a", "b", "equal", "changed", "added", "removed", "unchanged", "bytes_read"}
    assert doc["equal"] is False and doc["unchanged"] == 1  # model.b
    changed = {e["path"]: e for e in doc["changed"]}
    assert sorted(changed) == ["emb", "lr", "model.w"]
    w = changed["model.w"]
    x, y = sa["model"]["w"].double(), sb["model"]["w"].double()
    assert w["max_abs_diff"] == pytest.approx(float((x - y).abs().max()), rel=1e-12)
    assert w["rel_l2"] == pytest.approx(float(torch.linalg.norm(x - y) / torch.linalg.norm(x)))
    assert w["elements_changed"] == int((x != y).sum())
    assert w["a"] == {"path": "model.w", "kind": "tensor", "dtype": "float32", "shape": [64, 32],
                      "nbytes": 64 * 32 * 4}  # fmt: skip
    e = changed["emb"]
    assert (e["a"]["dtype"], e["b"]["dtype"]) == ("float64", "float32")
    ref = (sa["emb"] - sb["emb"].double()).abs().max()
    assert e["max_abs_diff"] == pytest.approx(float(ref), rel=1e-9)
    assert changed["lr"]["a"]["value"] == 0.001 and changed["lr"]["b"]["value"] == 0.0005
    assert [x["path"] for x in doc["added"]] == ["model.extra"]
    assert doc["added"][0]["dtype"] == "int32"
    assert doc["removed"] == [{"path": "step", "kind": "int", "value": 7}]
    assert doc["bytes_read"] > 0

    assert main(["diff", str(a), str(b)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"a: {a} step 1 (local)" and out[1] == f"b: {b} step 1 (local)"
    most = float((x - y).abs().max())  # 2.5 and the noise there
    assert f"changed model.w: float32 [64x32] 8.0 KiB: max abs diff {most:g}, rel L2 " in "\n".join(
        out
    )
    assert "changed lr: 0.001 -> 0.0005" in out
    assert any(line.startswith("changed emb: float64 [100x8] 6.2 KiB -> float32") for line in out)
    assert "added   model.extra: int32 [2] 8 B" in out
    assert "removed step: 7" in out
    assert out[-1].startswith("3 changed, 1 added, 1 removed, 1 unchanged")

    assert main(["diff", str(a), str(b), "--only", "model.b"]) == 0
    assert "0 changed" in capsys.readouterr().out


def test_diff_two_steps_of_one_store_and_exit_codes(tmp_path, capsys):
    s = _state()
    snapcore.save(s, tmp_path, step=1)
    s["model"]["b"] = torch.zeros(32)
    snapcore.save(s, tmp_path, step=2)
    assert main(["diff", str(tmp_path), "--step", "1", "--step-b", "2", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert [e["path"] for e in doc["changed"]] == ["model.b"]
    b = doc["changed"][0]
    assert b["rel_l2"] == 1.0 and b["elements_changed"] == 32  # ||a - 0|| / ||a||
    assert main(["diff", str(tmp_path), "--step-b", "2", "--step", "2"]) == 0
    capsys.readouterr()
    assert main(["diff", str(tmp_path)]) == 2  # neither STORE_B nor --step-b
    assert "--step-b" in capsys.readouterr().err
    assert main(["diff", str(tmp_path), str(tmp_path / "missing")]) == 2  # trouble, as diff(1)
    assert "no store at" in capsys.readouterr().err
    assert main(["diff", str(tmp_path), "--step", "9", "--step-b", "1"]) == 2
    with pytest.raises(SystemExit) as e:  # argparse's own exit, with its usage line
        main(["diff", str(tmp_path), "--bogus"])
    assert e.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_diff_shape_change_and_zero_norm(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    snapcore.save({"x": torch.zeros(4), "y": torch.ones(3)}, a, step=1)
    snapcore.save({"x": torch.ones(4), "y": torch.ones(5)}, b, step=1)
    assert main(["diff", str(a), str(b), "--json"]) == 1
    changed = {e["path"]: e for e in json.loads(capsys.readouterr().out)["changed"]}
    assert changed["x"]["rel_l2"] == "inf" and changed["x"]["max_abs_diff"] == 1.0
    assert "max_abs_diff" not in changed["y"] and changed["y"]["b"]["shape"] == [5]
    assert main(["diff", str(a), str(b)]) == 1
    assert "changed y: float32 [3] 12 B -> float32 [5] 20 B (shape differs: not compared)" in (
        capsys.readouterr().out
    )


def test_cat_tensor_and_values(tmp_path, capsys):
    t = torch.randn(50, 20, dtype=torch.float64)
    t[0, 1], t[2, 3], t[4, 5] = math.nan, math.inf, -math.inf
    ints = torch.arange(-5, 1000, dtype=torch.int64)
    snapcore.save({"t": t, "i": ints, "name": "x" * 500, "lr": 0.25}, tmp_path, step=4)
    assert main(["cat", str(tmp_path), "t", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    finite = t[t.isfinite()]
    st = doc["stats"]
    assert (doc["dtype"], doc["shape"], doc["step"]) == ("float64", [50, 20], 4)
    assert st["nan"] == 1 and st["inf"] == 2
    assert st["min"] == float(finite.min()) and st["max"] == float(finite.max())
    assert st["mean"] == pytest.approx(float(finite.mean()), rel=1e-9)
    assert st["std"] == pytest.approx(float(finite.std()), rel=1e-9)
    assert doc["values"][:3] == [float(t[0, 0]), "nan", float(t[0, 2])] and len(doc["values"]) == 8
    assert main(["cat", str(tmp_path), "i", "-n", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "i: int64 [1005] 7.9 KiB (step 4, local)"
    assert out[1].startswith("min -5  max 999  mean 497") and "nan" not in "\n".join(out)
    assert out[2] == "values (first 3 of 1005): [-5, -4, -3]"
    assert main(["cat", str(tmp_path), "name"]) == 0
    assert capsys.readouterr().out.strip() == f"name = {'x' * 500!r}"  # whole
    assert main(["cat", str(tmp_path), "lr"]) == 0
    assert capsys.readouterr().out.strip() == "lr = 0.25"
    assert main(["cat", str(tmp_path), "nope"]) == 1
    assert "has no leaf 'nope'" in capsys.readouterr().err


def test_cat_of_a_subtree_names_its_leaves(tmp_path, capsys):
    snapcore.save({"model": torch.nn.Linear(2, 2)}, tmp_path, step=1)
    assert main(["cat", str(tmp_path), "model"]) == 1
    err = capsys.readouterr().err
    assert "not a leaf" in err and "model.weight" in err


def test_inspect_sizes_json_and_only(tmp_path, capsys):
    state = {"model": torch.nn.Linear(4, 3), "opt": {"m": torch.zeros(10)}, "lr": 1e-3}
    snapcore.save(state, tmp_path, step=2)
    assert main(["inspect", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "<root>/  100 B in 3 tensors"
    assert any(
        line.startswith("  model/ (") and line.endswith("60 B in 2 tensors") for line in lines
    )
    assert "  opt/  40 B in 1 tensor" in lines and "  lr = 0.001" in lines
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["step"], doc["world_size"], doc["sharded"], doc["tensor_bytes"]) == (
        2,
        1,
        False,
        100,
    )
    leaves = {x["path"]: x for x in doc["leaves"]}
    assert leaves["lr"] == {"path": "lr", "kind": "float", "value": 0.001}
    assert leaves["model.weight"]["shape"] == [3, 4] and leaves["model.weight"]["nbytes"] == 48
    sizes = {s["path"]: s["tensor_bytes"] for s in doc["subtrees"]}
    assert sizes == {"": 100, "model": 60, "opt": 40}
    assert main(["inspect", str(tmp_path), "--json", "--only", "model.*"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert sorted(x["path"] for x in doc["leaves"]) == ["model.bias", "model.weight"]


def test_inspect_a_sharded_snapshot(tmp_path, capsys):
    sys.path.insert(0, str(Path(__file__).parent))
    from hostile import corpus

    corpus._sharded()(tmp_path)
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "sharded, saved by 2 ranks" in out.splitlines()[0]
    assert main(["inspect", str(tmp_path), "--json"]) == 0  # was a ValueError (to_json)
    doc = json.loads(capsys.readouterr().out)
    assert doc["sharded"] is True and doc["world_size"] == 2 and doc["missing_ranks"] == []
    assert main(["cat", str(tmp_path), "w"]) == 0  # assembled from both ranks' pieces
    assert "float32 [3x4]" in capsys.readouterr().out
    assert main(["diff", str(tmp_path), str(tmp_path), "--step", str(corpus.STEP)]) == 0


def test_progress_only_when_asked_or_on_a_terminal(tmp_path, capsys):
    snapcore.save(_state(), tmp_path / "a", step=1)
    snapcore.save(_state(1), tmp_path / "b", step=1)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    for args in (["verify", a], ["diff", a, b], ["gc", a]):
        main(args)  # stderr is captured, not a terminal: no bar
        quiet = capsys.readouterr()
        assert quiet.err == "", (args, quiet.err)
        main([*args, "--progress"])
        shown = capsys.readouterr()
        assert args[0] in shown.err and "100%" in shown.err, (args, shown.err)
        assert shown.out == quiet.out
    with pytest.raises(SystemExit) as e:
        main(["verify", a, "--quiet", "--progress"])
    assert e.value.code == 2  # one or the other


@pytest.mark.parametrize(
    "verb", [["diff", "{a}", "{b}"], ["cat", "{a}", "big"], ["inspect", "{a}", "--json"]]
)
def test_piping_new_verbs_into_head_prints_no_traceback(tmp_path, verb):
    a, b = tmp_path / "a", tmp_path / "b"
    state = {f"k{i}": torch.full((2,), float(i)) for i in range(3000)}  # > a pipe's buffer
    state["big"] = torch.zeros(10)
    snapcore.save(state, a, step=1)
    state = {f"k{i}": torch.full((2,), float(i + 1)) for i in range(3000)}
    snapcore.save(state, b, step=1)
    argv = [x.format(a=a, b=b) for x in verb]
    if verb[0] == "cat":
        argv += ["-n", "10"]
    with subprocess.Popen(
        [sys.executable, "-m", "snapcore", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.readline()
        proc.stdout.close()  # what `head -1` does after its line
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=60) in (0, 1, 2)
    assert "Traceback" not in err and "BrokenPipe" not in err, err
