"""The multi-process harness itself: launching, result channel, timeouts, killed ranks,
two nodes on one machine, and the sharded models' layouts and global values.

Every test goes through run_ranks/run_nodes, whose timeout kills the whole run: a hang
fails the test instead of stalling the suite.
"""

from __future__ import annotations

import json
import math
import signal
import time
from pathlib import Path
from typing import Any

import models
import pytest
import torch
from launch import LaunchError, processes_of, run_nodes, run_ranks, spawn_logs, spawn_nodes

HERE = Path(__file__).resolve().parent
PLAIN = HERE / "rank_plain.py"
MODELS = HERE / "rank_models.py"
TIMEOUT = 60.0  # per run; a healthy one takes 1-15 s here


def _gone(pid: int) -> bool:
    """Dead: no such process, or a zombie (init reaps those in its own time)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


# ---------------------------------------------------------------------------- launcher


# Each launcher test runs twice: under torchrun (as a job is started on several machines)
# and with the ranks started directly (run_nodes' default: the same job, its workers'
# environment and torchrun's teardown, without the agents' own startup).
TORCHRUN = pytest.mark.parametrize("torchrun", [True, False], ids=["torchrun", "direct"])


@TORCHRUN
def test_a_failing_rank_raises_with_its_traceback(tmp_path: Path, torchrun: bool) -> None:
    with pytest.raises(LaunchError) as info:
        run_ranks(PLAIN, 2, ["fail"], timeout=TIMEOUT, workdir=tmp_path, torchrun=torchrun)
    err = info.value
    assert not err.timed_out
    assert err.results[1].exitcode == 1
    assert "RuntimeError: rank 1 fails on purpose" in err.results[1].output
    assert "RuntimeError: rank 1 fails on purpose" in str(err)
    assert err.results[0].result == {"ok": True}
    assert processes_of(err.run_id) == []
    assert str(tmp_path) in str(err)  # where the logs are kept


@TORCHRUN
def test_a_hung_rank_is_killed_on_timeout(tmp_path: Path, torchrun: bool) -> None:
    timeout = 10.0  # these ranks import no torch: they start in about a second
    started = time.monotonic()
    with pytest.raises(LaunchError) as info:
        run_ranks(PLAIN, 2, ["hang"], timeout=timeout, workdir=tmp_path, torchrun=torchrun)
    elapsed = time.monotonic() - started
    err = info.value
    assert err.timed_out
    assert elapsed < timeout + 60  # raised at the deadline, not when the rank ended
    hung, done = err.results
    assert hung.exitcode is None  # killed with the run: no status recorded
    assert done.exitcode == 0
    assert f"rank 0 (pid {hung.result['pid']}) hangs" in str(err)  # its output, in the error
    assert _gone(hung.result["pid"])
    assert processes_of(err.run_id) == []


@TORCHRUN
def test_a_rank_killed_at_a_point_reports_sigkill(torchrun: bool) -> None:
    kill = {1: "loop#2"}
    results = run_ranks(
        PLAIN, 2, ["die"], timeout=TIMEOUT, kill_at=kill, check=False, torchrun=torchrun
    )
    survivor, killed = results
    assert killed.exitcode == -signal.SIGKILL
    assert "pass 1" in killed.output and "pass 2" not in killed.output
    assert "SIGKILLs itself at loop#2" in killed.output
    assert killed.result is None
    # rank 0 blocked (as in a collective with the dead rank) until torchrun (or the direct
    # launcher, as torchrun does) tore it down
    assert survivor.exitcode == -signal.SIGTERM
    assert survivor.result == {"passes": 3}


def test_kill_at_names_a_rank_of_the_world() -> None:
    with pytest.raises(ValueError, match="no rank 2"):
        run_ranks(PLAIN, 2, ["die"], timeout=TIMEOUT, kill_at={2: "loop"})


# rank_plain.py's "nodes" on two nodes of 2 ranks: the environments the launchers are
# given, and what each rank sees
_TWO_NODES: dict[str, Any] = {
    "env": {"SNAPCORE_MP_TEST_COMMON": "both"},
    "node_envs": [{"SNAPCORE_MP_TEST_NODE": "a"}, {"SNAPCORE_MP_TEST_NODE": "b"}],
}
_TWO_NODES_SEEN = [
    {"rank": r, "local_rank": r % 2, "world": 4, "node_env": "ab"[r // 2], "common_env": "both"}
    for r in range(4)
]


@TORCHRUN
def test_two_nodes_form_one_job_each_with_its_own_env(torchrun: bool) -> None:
    results = run_nodes(PLAIN, 2, ["nodes"], timeout=TIMEOUT, torchrun=torchrun, **_TWO_NODES)
    assert [(r.rank, r.node) for r in results] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    expected = _TWO_NODES_SEEN
    for r in results:
        assert r.result == {"mine": expected[r.rank], "everyone": expected}


def test_spawned_nodes_form_one_job_each_with_its_own_env(tmp_path: Path) -> None:
    """spawn_nodes: the ranks as plain processes, with the same layout as run_nodes."""
    runs = spawn_nodes(PLAIN, 2, ["nodes"], timeout=TIMEOUT, workdir=tmp_path, **_TWO_NODES)
    expected = _TWO_NODES_SEEN
    assert [code for code, _ in runs] == [0] * 4, spawn_logs(tmp_path, 4)
    for rank, (_, result) in enumerate(runs):
        assert result == {"mine": expected[rank], "everyone": expected}


def test_a_hung_spawned_rank_is_killed_on_timeout(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="did not finish in 10 s") as info:
        spawn_nodes(PLAIN, 2, ["hang"], timeout=10.0, node_envs=[{}], workdir=tmp_path)
    pid = json.loads((tmp_path / "rank0.json").read_text())["pid"]
    assert f"rank 0 (pid {pid}) hangs" in str(info.value)  # its output, in the error
    assert _gone(pid)


# ---------------------------------------------------------------------------- models


def _chunk(n: int, parts: int, i: int) -> int:
    """Size of part i of n rows split as torch.chunk and FSDP2 split them."""
    size = math.ceil(n / parts)
    return max(0, min(size, n - i * size))


def _expected_local(kind: str, path: str, shape: list[int], rank: int, world: int) -> list[int]:
    """The local shape each kind gives a tensor (module docstring of models.py)."""
    param = path.removeprefix("model.").split(".exp_avg")[0].removeprefix("optim.state.")
    if path.endswith(".step") or param == "buf" or kind == "ddp":
        return shape
    if kind == "fsdp2":
        return [_chunk(shape[0], world, rank), *shape[1:]]
    if kind == "hsdp":
        return [_chunk(shape[0], world // 2, rank % (world // 2)), *shape[1:]]
    assert kind == "tp"
    if param.startswith(("fc1.", "head.")):
        return [_chunk(shape[0], world, rank), *shape[1:]]
    if param == "fc2.weight":
        return [shape[0], _chunk(shape[1], world, rank)]
    return shape  # fc2.bias (Replicate) and scale (plain)


@pytest.mark.parametrize("world", [2, 4])
def test_every_model_kind_shards_as_expected(world: int) -> None:
    kinds = ["fsdp2", "tp", "ddp"] + (["hsdp"] if world == 4 else [])
    results = run_ranks(MODELS, world, [",".join(kinds)], timeout=TIMEOUT)
    reports: list[dict[str, Any]] = [r.result for r in results]
    reference = {
        k: models.digest(t) for k, t in models.make_model(0).state_dict().items()
    }  # unsharded, in this process
    step2 = models.digest(torch.tensor(2.0))

    for kind in kinds:
        first = reports[0][kind]
        # the same seeded init everywhere: the unsharded model's tensors, bit for bit
        assert all(rep[kind]["init"] == reference for rep in reports), kind
        # global values and their layout agree across ranks, bit for bit
        assert all(rep[kind]["global"] == first["global"] for rep in reports), kind
        for path, d in first["layout"].items():
            assert all(rep[kind]["layout"][path]["shape"] == d["shape"] for rep in reports)
        # model and AdamW state are there, and two steps were taken
        names = set(reference)
        assert {p.removeprefix("model.") for p in first["global"] if p.startswith("model.")} == (
            names
        )
        trainable = names - {"buf"}
        for p in trainable:
            for s in ("exp_avg", "exp_avg_sq", "step"):
                assert f"optim.state.{p}.{s}" in first["global"], (kind, p, s)
            assert first["global"][f"optim.state.{p}.step"] == step2
            assert first["global"][f"model.{p}"] != reference[p], (kind, p)
        # each rank holds the shard the kind gives it
        for rank, rep in enumerate(reports):
            for path, d in rep[kind]["layout"].items():
                want = _expected_local(kind, path, d["shape"], rank, world)
                assert d["local_shape"] == want, (kind, rank, path)

    # uneven shards: fc2's 13 rows split unequally; on 4 ranks, rank 3 has no `scale`
    fc2_rows = {tuple(r["fsdp2"]["layout"]["model.fc2.weight"]["local_shape"]) for r in reports}
    assert len(fc2_rows) == 2
    if world == 4:
        assert reports[3]["fsdp2"]["layout"]["model.scale"]["local_shape"] == [0]
        hsdp = reports[0]["hsdp"]["layout"]["model.fc1.weight"]
        assert hsdp["placements"] == ["Replicate()", "Shard(dim=0)"]
        assert hsdp["mesh_shape"] == [2, 2]
    tp = reports[0]["tp"]["layout"]
    assert tp["model.fc2.weight"]["placements"] == ["Shard(dim=1)"]
    assert tp["model.scale"]["placements"] is None  # replicated by convention
    assert reports[0]["ddp"]["layout"]["model.fc1.weight"]["placements"] is None
