"""Sharded snapshots under torch.distributed (issue 10), on CPU with gloo.

Every restored tensor is compared, bit for bit (sha256 of its global value), with the
tensor that was saved: model parameters and AdamW state through get_state_dict. The
state also holds rank-local values (snapcore.RNGState, a RankLocal data position) that
each rank must get back as its own, and that a restore into another world size must
refuse (or keep, when asked).

Each run has a hard timeout (run_ranks kills the whole run), so a hang fails the test.
"""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
from launch import Nodes, run_ranks, spawn_logs, spawn_nodes

import snapcore
from snapcore.directory import LocalDirectory
from snapcore.tiers import HostTier

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "rank_snapcore.py"
TIMEOUT = 120.0
ENV = {"SNAPCORE_COMMIT_TIMEOUT_S": "60"}


def run(world: int, actions: list[dict[str, Any]], **kw: Any) -> list[list[dict[str, Any]]]:
    results = run_ranks(SCRIPT, world, [json.dumps(actions)], timeout=TIMEOUT, env=ENV, **kw)
    return [r.result for r in results]


def saved_bytes(store: Path, step: int) -> tuple[int, int]:
    """(bytes of data files, bytes of manifests and parts) of a step."""
    d = store / f"step-{step:012d}"
    data = sum(p.stat().st_size for p in d.glob("data-*.bin"))
    meta = sum(p.stat().st_size for p in d.glob("*.json"))
    return data, meta


def loaded_digests(store: Any, step: int | None = None, rank: int | None = None) -> dict[str, str]:
    """snapcore.load in this process (no process group): full tensors, by the paths
    get_state_dict gives them (with the rank-local values of ``rank``)."""
    import models

    tree = snapcore.load(store, step=step, rank=rank)
    app = tree["app"]
    return {k: models.digest(t) for k, t in models.tensors(app)}


@pytest.fixture(scope="module")
def fsdp4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    """A 4-rank FSDP2 save of step 5, and the same ranks restoring it (other weights)."""
    store = tmp_path_factory.mktemp("fsdp4")
    out = run(
        4,
        [
            {"op": "save", "kind": "fsdp2", "store": str(store), "step": 5},
            {"op": "restore", "kind": "fsdp2", "store": str(store)},
        ],
    )
    return store, out


def test_fsdp2_four_ranks_restore_bit_exact_with_their_own_rank_local_values(fsdp4) -> None:
    _, out = fsdp4
    saved = out[0][0]["digests"]
    for rank, (s, r) in enumerate(out):
        assert s["digests"] == saved  # every rank sees the same global tensors
        assert r["digests"] == saved, f"rank {rank}"
        assert r["step"] == 5 and r["saved_step"] == 5
        assert r["pos"] == 100 * rank + 5  # its own data position, not rank 0's
        assert r["rng_next"] == s["rng_next"]  # its own RNG state
    assert len({s["rng_next"] for s, _ in out}) == 4  # the ranks' RNG states differ
    # each rank wrote its own shards (FSDP2: nothing replicated but the optimizer steps)
    assert all(s["data_bytes"] > 0 for s, _ in out)


def test_a_sharded_step_is_an_index_of_parts(fsdp4) -> None:
    store, _ = fsdp4
    step_dir = store / "step-000000000005"
    index = json.loads((step_dir / "manifest.json").read_bytes())
    assert index["format_version"] == 3 and index["world_size"] == 4
    assert [p["rank"] for p in index["parts"]] == [0, 1, 2, 3]
    assert all((store / p["name"]).stat().st_size == p["size"] for p in index["parts"])
    assert not list(step_dir.glob("*.pending"))  # every rank's lock is gone


def test_one_rank_loads_alone_under_a_process_group(fsdp4) -> None:
    store, _ = fsdp4
    res = run(2, [{"op": "load-alone", "store": str(store)}])
    assert res[0] == [{"step": 5}] and res[1] == [{}]


def test_load_with_no_process_group_assembles_full_tensors(fsdp4) -> None:
    store, out = fsdp4
    saved = out[0][0]["digests"]
    assert loaded_digests(store) == saved
    tree = snapcore.load(store, rank=2)
    assert tree["data"]["value"] == {"pos": 205}  # rank 2's own value
    assert snapcore.load(store)["data"]["value"] == {"pos": 5}  # rank 0's, with a warning


def test_four_to_two_ranks_refuses_rank_local_values_then_keeps_them(fsdp4) -> None:
    store, out = fsdp4
    saved = out[0][0]["digests"]
    res = run(
        2,
        [
            {"op": "restore", "kind": "fsdp2", "store": str(store)},
            {"op": "restore", "kind": "fsdp2", "store": str(store), "rank_local": "keep"},
        ],
    )
    for rank, (refused, kept) in enumerate(res):
        assert refused["error"] == "StateMismatch"
        assert "data.value.pos" in refused["message"] and "rank_local='keep'" in refused["message"]
        assert kept["digests"] == saved  # resharded 4 -> 2, bit for bit
        assert kept["step"] == 5 and kept["saved_step"] == 5  # a global value is restored
        assert kept["pos"] == 100 * rank - 1  # its own live value, kept
    # each new rank reads about half of the model and optimizer, not all of it
    total, _ = saved_bytes(store, 5)
    for _, kept in res:
        assert kept["bytes"] < 0.75 * total


def test_fsdp2_to_tensor_parallel_and_to_fsdp2_with_tensor_parallel(fsdp4) -> None:
    store, out = fsdp4
    res = run(2, [{"op": "restore", "kind": "tp", "store": str(store), "rank_local": "keep"}])
    for (r,) in res:
        assert r["digests"] == out[0][0]["digests"]
    # FSDP2 on 4 ranks -> FSDP2 + TP on a 2x2 mesh (same world size: rank-local restored),
    # whose FSDP dimension shards rows TP split already (_StridedShard); then it saves
    two_d = store.parent / "fsdp_tp"
    res = run(
        4,
        [
            {"op": "restore", "kind": "fsdp_tp", "store": str(store)},
            {"op": "save", "kind": "fsdp_tp", "store": str(two_d), "step": 9},
        ],
    )
    for rank, (r, saved) in enumerate(res):
        assert r["digests"] == out[0][0]["digests"] and r["pos"] == 100 * rank + 5
        assert saved["digests"] == res[0][1]["digests"]
        # `scale`, which TP does not split, is a DTensor on each TP rank's own FSDP mesh
        # ([0, 2] or [1, 3]): two groups of ranks, whose copies are replicas (combine)
        assert saved["exchange"] == "grouped", (rank, saved["exchange_why"])
    assert loaded_digests(two_d) == res[0][1]["digests"]
    data = sum(p.stat().st_size for p in (two_d / "step-000000000009").glob("data-*.bin"))
    unique = _nbytes(snapcore.load(two_d)["app"])
    own = [_nbytes(snapcore.load(two_d, rank=r)["rng"]) for r in range(4)]
    assert unique + sum(own) <= data <= unique + sum(own) + 64 * 64  # `scale` once


def test_ddp_writes_replicated_tensors_once_and_restores_into_fsdp2(tmp_path: Path) -> None:
    store = tmp_path / "ddp"
    res = run(
        2,
        [
            {"op": "save", "kind": "ddp", "store": str(store), "step": 3},
            {"op": "restore", "kind": "fsdp2", "store": str(store)},
        ],
    )
    saved = res[0][0]["digests"]
    ddp = run(2, [{"op": "restore", "kind": "ddp", "store": str(store)}])
    for (r,) in ddp:
        assert r["digests"] == saved
    # each replicated tensor was read by one rank and broadcast: the ranks together read
    # the snapshot about once (their rank-local values each), not once per rank
    total, _ = saved_bytes(store, 3)
    assert sum(r["bytes"] for (r,) in ddp) <= 1.1 * total
    # DDP's ranks hold equal replicas: the job's bytes are the model's unique bytes once
    data, meta = saved_bytes(store, 3)
    replicated = _nbytes(snapcore.load(store)["app"])  # model and optimizer, once
    own = [_nbytes(snapcore.load(store, rank=r)["rng"]) for r in range(2)]  # rank-local
    assert replicated > 64 * 64  # a second copy would not fit in the slack below
    assert replicated + sum(own) <= data <= replicated + sum(own) + 64 * 64  # + alignment
    assert meta < 64 << 10
    assert res[0][0]["data_bytes"] > 0 and res[1][0]["data_bytes"] > 0  # balanced
    for _, restored in res:
        assert restored["digests"] == saved
    assert loaded_digests(store) == saved


def test_pipeline_stages_plan_from_one_description_per_stage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two pipeline stages of 2 ranks (FSDP2 within each stage, other tensors in each):
    the ranks' states differ, and the plan follows from one description per stage
    (``uniform.combine``), not from every rank's items; each stage's replicated tensors
    (its AdamW ``step`` counters, its buffer) are written once, by a rank of the stage;
    the same ranks restore every tensor bit-exact. With more groups than
    ``MAX_GROUPS`` (a second store, saved by the same job), the items are exchanged,
    with the same result."""
    actions: list[dict[str, Any]] = []
    for max_groups in (128, 1):
        store = str(tmp_path / f"pp-{max_groups}")
        save = {"op": "save", "kind": "pp", "store": store, "step": 2, "max_groups": max_groups}
        actions += [save, {"op": "restore", "kind": "pp", "store": store}]
    both = run(4, actions)
    for k, max_groups in enumerate((128, 1)):
        res = [r[2 * k : 2 * k + 2] for r in both]
        _check_pipeline_stages(tmp_path / f"pp-{max_groups}", res, max_groups)
    store, res = tmp_path / "pp-128", [r[:2] for r in both]
    # into 2 ranks: each stage on one rank now, its tensors from the 2 ranks that saved it
    into2 = {"op": "restore", "kind": "pp", "store": str(store), "rank_local": "keep"}
    (a,), (b,) = run(2, [into2])
    assert "error" not in a and "error" not in b, (a, b)
    assert a["digests"] == res[0][0]["digests"] and b["digests"] == res[2][0]["digests"]
    assert a["step"] == b["step"] == 2
    # (without rank_local="keep", the ranks' RNG states and data positions refuse it)
    for r in (0, 2):  # load(rank=r): rank r's tree, its stage's tensors
        model = snapcore.load(store, rank=r)["app"]["model"]
        assert all(k.startswith(f"stage{r // 2}.") for k in model), list(model)
        assert model[f"stage{r // 2}.buf"].tolist() == list(range(5))
    # load() with no rank: every stage's tensors, full (an export gets the whole model)
    assert loaded_digests(store) == res[0][0]["digests"] | res[2][0]["digests"]
    from safetensors.torch import load_file

    from snapcore.cli import main

    assert main(["convert", str(store), str(tmp_path / "st"), "--to", "safetensors"]) == 0
    capsys.readouterr()  # what convert printed
    names = set(load_file(tmp_path / "st" / "model.safetensors"))
    assert {"app.model.stage0.fc1.weight", "app.model.stage1.fc1.weight"} <= names, names
    assert main(["inspect", str(store), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    leaves = {x["path"] for x in doc["leaves"]}
    assert {"app.model.stage0.buf", "app.model.stage1.buf"} <= leaves, leaves
    # values the ranks saved differently: rank-local ones, and each stage's param_groups
    # (its own parameters' names); not every path of another stage's tensors
    differ = set(doc["rank_local"])
    assert {"app.optim.param_groups", "data.value.pos"} <= differ, differ
    assert all(p.startswith("rng.") for p in differ - {"app.optim.param_groups", "data.value.pos"})


def _check_pipeline_stages(store: Path, res: list[list[dict[str, Any]]], max_groups: int) -> None:
    for rank, (saved, restored) in enumerate(res):
        assert saved["exchange"] == ("grouped" if max_groups > 1 else "items"), rank
        assert restored["digests"] == saved["digests"], rank
        assert saved["data_bytes"] > 0, rank
    stages = [set(res[0][0]["digests"]), set(res[2][0]["digests"])]
    for mine, other in ((0, 1), (1, 0)):  # model.stage0.*, optim.state.stage0.*, ...
        assert all(f"stage{mine}." in k and f"stage{other}." not in k for k in stages[mine])
    assert res[1][0]["digests"] == res[0][0]["digests"]  # one stage, one state
    data, _ = saved_bytes(store, 2)
    # each rank's tree is its stage's: load(rank=r) gives rank r's, with full tensors
    unique = sum(_nbytes(snapcore.load(store, rank=r)["app"]) for r in (0, 2))
    own = [_nbytes(snapcore.load(store, rank=r)["rng"]) for r in range(4)]  # rank-local
    assert unique + sum(own) <= data <= unique + sum(own) + 64 * 64  # + alignment


def _nbytes(tree: Any) -> int:
    """Bytes of the tensors and NumPy arrays in a loaded tree (what the data files hold;
    arrays of 1 KiB or less are inline in the manifest)."""
    import numpy as np
    import torch

    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, np.ndarray):
        return tree.nbytes if tree.nbytes > 1024 else 0
    if isinstance(tree, dict):
        return sum(_nbytes(v) for v in tree.values())
    if isinstance(tree, list | tuple):
        return sum(_nbytes(v) for v in tree)
    return 0


def _chunk_bytes(store: Path, step: int) -> int:
    """Bytes of every chunk of a step, as stored: what its ranks read together when each
    chunk is read once (the data files hold alignment padding too)."""
    m = LocalDirectory(store).read_manifest(step)
    return sum(c.length for b in m.blobs for c in b.chunks)


def test_tensor_parallel_reads_a_replicated_dtensor_once_per_node(tmp_path: Path) -> None:
    """TP on 2 ranks of one node: fc2.bias and its AdamW moments are Replicate()
    DTensors, held whole by both ranks. One rank reads each and sends it to the other, so
    the ranks together read every chunk of the step once; each rank used to read them
    (156 bytes more in all)."""
    store = tmp_path / "tp"
    saved = run(2, [{"op": "save", "kind": "tp", "store": str(store), "step": 4}])
    res = run(2, [{"op": "restore", "kind": "tp", "store": str(store)}])
    for rank, (r,) in enumerate(res):
        assert r["digests"] == saved[0][0]["digests"] and r["pos"] == 100 * rank + 4, r
    app = snapcore.load(store)["app"]
    moments = app["optim"]["state"]["fc2.bias"]
    replicated = [app["model"]["fc2.bias"], moments["exp_avg"], moments["exp_avg_sq"]]
    assert sum(t.numel() * t.element_size() for t in replicated) == 156
    read = [r["bytes"] for (r,) in res]
    assert sum(read) == _chunk_bytes(store, 4), read
    assert all(n > 0 for n in read), read  # each rank read its own shards


def test_damage_in_a_shared_read_raises_on_every_rank(tmp_path: Path) -> None:
    """TP on 2 ranks: step 2's fc2.bias (a Replicate() DTensor, read by one rank for
    both) has a flipped byte. The reading rank finds it and the other, which reads no
    byte of it, hears of it instead of waiting for the tensor: both restore step 1 and
    name the damaged file; asked for step 2 by name, both raise."""
    store = tmp_path / "tp"
    steps = [{"step": 1, "seed": 0}, {"step": 2, "seed": 5}]
    saved = run(2, [{"op": "save", "kind": "tp", "store": str(store), **a} for a in steps])
    first = saved[0][0]["digests"]
    m = LocalDirectory(store).read_manifest(2)
    assert m.keys is not None
    (piece,) = m.tensors[m.keys.index("app.model.fc2.bias")].pieces
    (chunk,) = m.blobs[piece.blob].chunks
    victim = store / m.files[chunk.file].name
    data = bytearray(victim.read_bytes())
    data[chunk.offset + chunk.length // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    res = run(
        2,
        [
            {"op": "restore", "kind": "tp", "store": str(store)},
            {"op": "restore", "kind": "tp", "store": str(store), "at": 2},
        ],
    )
    (r0, at0), (r1, at1) = res
    for r in (r0, r1):
        assert r.get("step") == 1 and r["digests"] == first, r
        assert r["skipped"] == r0["skipped"] and len(r["skipped"]) == 1, r
        assert r["skipped"][0].startswith("step 2: ") and victim.name in r["skipped"][0], r
    for at in (at0, at1):
        assert at.get("error") == "CorruptSnapshot" and "step 2" in at["message"], at
    # the reading rank raises its own damage; the other names it, as both skips do
    (reader,) = [r for r, at in enumerate((at0, at1)) if not at["message"].endswith(")")]
    assert (at0, at1)[1 - reader]["message"].endswith(f"(rank {reader})"), (at0, at1)
    assert r0["skipped"][0].endswith(f"(rank {reader})"), r0


def test_an_exception_planning_or_reading_a_shared_unit_raises_on_every_rank(
    tmp_path: Path,
) -> None:
    """TP on 2 ranks: an exception that is not snapcore's, on one rank, while it lists
    what it could share (before the plan exchange) or while it reads a unit for both
    (before the others wait for its bytes): that rank raises it, the other raises
    StateMismatch naming it, none waits until the timeout, and the next restore agrees."""
    store = tmp_path / "tp"
    restore = {"op": "restore", "kind": "tp", "store": str(store)}
    res = run(
        2,
        [
            {"op": "save", "kind": "tp", "store": str(store), "step": 1},
            {**restore, "boom_on_rank": 1, "boom_in": "_units"},
            {**restore, "boom_on_rank": 0, "boom_in": "tensor"},
            restore,
        ],
    )
    (saved, units0, read0, ok0), (_, units1, read1, ok1) = res
    assert units1.get("error") == "RuntimeError" and "boom" in units1["message"], units1
    assert units0.get("error") == "StateMismatch", units0
    assert "rank 1 cannot restore it: RuntimeError: boom" in units0["message"], units0
    assert read0.get("error") == "RuntimeError" and "boom" in read0["message"], read0
    assert read1.get("error") == "StateMismatch", read1
    assert "rank 0 cannot restore it: RuntimeError: boom" in read1["message"], read1
    for ok in (ok0, ok1):
        assert ok.get("step") == 1 and ok["digests"] == saved["digests"], ok


def test_hsdp_and_two_to_four(tmp_path: Path) -> None:
    two = tmp_path / "two"
    res = run(2, [{"op": "save", "kind": "fsdp2", "store": str(two), "step": 1}])
    saved = res[0][0]["digests"]
    hsdp = tmp_path / "hsdp"
    res4 = run(
        4,
        [
            {"op": "restore", "kind": "fsdp2", "store": str(two), "rank_local": "keep"},
            {"op": "save", "kind": "hsdp", "store": str(hsdp), "step": 2},
            {"op": "restore", "kind": "hsdp", "store": str(hsdp)},
        ],
    )
    hsdp_saved = res4[0][1]["digests"]
    for rank, (grown, s, r) in enumerate(res4):
        assert grown["digests"] == saved  # 2 -> 4
        assert s["digests"] == hsdp_saved
        assert r["digests"] == hsdp_saved and r["pos"] == 100 * rank + 2
    assert loaded_digests(hsdp) == hsdp_saved
    # HSDP's mesh (2 replicas x 2 shards) lies within this node of 4 ranks: each shard is
    # needed by 2 of them (ranks 0 and 2, or 1 and 3), and read by one of the two for
    # both; the step counters and the buffer by one of the 4. So the ranks together read
    # every chunk of the step once (each rank used to read its shards itself).
    read = [r["bytes"] for _, _, r in res4]
    assert sum(read) == _chunk_bytes(hsdp, 2), read


# -- a rank dies during a save ------------------------------------------------------------


def _spawn(world: int, actions: list[dict[str, Any]], workdir: Path, timeout_s: float) -> list[Any]:
    """The ranks as plain processes (launch.spawn_nodes): no agent tears the survivors
    down when one dies, as torchrun would."""
    env = {"SNAPCORE_COMMIT_TIMEOUT_S": str(timeout_s)}
    args = [json.dumps(actions)]
    return spawn_nodes(
        SCRIPT, world, args, timeout=TIMEOUT, node_envs=[{}], env=env, workdir=workdir
    )


@pytest.mark.parametrize("point", ["staged", "writing", "part"])
def test_a_rank_killed_mid_save_leaves_the_previous_step_and_no_hang(
    tmp_path: Path, point: str
) -> None:
    store = tmp_path / "store"
    actions = [
        {"op": "kill-save", "kind": "fsdp2", "store": str(store), "step": 1, "victim": 1,
         "point": point}
    ]  # fmt: skip
    (code0, out0), (code1, _) = _spawn(2, actions, tmp_path, timeout_s=4)
    assert code1 == -signal.SIGKILL
    assert code0 == 0, (tmp_path / "spawn0.log").read_text()[-3000:]
    (res,) = out0
    outcome = res["outcome"]
    assert outcome["after"] == 3.0  # the survivor went on
    committed = LocalDirectory(store).committed_steps()
    if outcome["ok"]:  # the victim died after announcing its part: step 2 is whole
        assert committed == [1, 2]
        assert loaded_digests(store) == res["second"]
    else:
        assert committed == [1]
        assert "ranks 1 " in outcome["message"] or "ranks 1\n" in outcome["message"]
        assert loaded_digests(store) == res["first"]
        # the leftovers of step 2 go with the next collection
        LocalDirectory(store).collect_leftovers()
        assert not (store / "step-000000000002").exists()


def test_object_storage_holds_the_whole_job_and_restores_alone(tmp_path: Path, s3_bucket) -> None:
    both = {
        "local": str(tmp_path / "local"),
        "remote": s3_bucket.url,
        "storage_options": s3_bucket.storage_options,
    }
    remote = {"remote": s3_bucket.url, "storage_options": s3_bucket.storage_options}
    res = run(
        2,
        [
            {"op": "save", "kind": "fsdp2", "store": both, "step": 4},
            {"op": "restore", "kind": "fsdp2", "store": remote},
        ],
    )
    saved = res[0][0]["digests"]
    for rank, (_, r) in enumerate(res):
        assert r["digests"] == saved and r["tier"] == "remote" and r["pos"] == 100 * rank + 4
    store = snapcore.Store(**remote)
    assert snapcore.committed(store)["remote"] == [4]
    from snapcore.directory import rank_prefix
    from snapcore.tiers import RemoteStoreTier

    tier = RemoteStoreTier(s3_bucket.url, s3_bucket.storage_options)
    names = tier.rt.list("step-000000000004")
    tier.close()
    for rank in range(2):  # each rank's objects under its own prefix (S3 request limits)
        mine = [n for n in names if n.startswith(f"step-000000000004/{rank_prefix(rank)}/")]
        assert {n.rsplit("/", 1)[1].split("-")[0] for n in mine} == {"data", "part"}, names
    tree = snapcore.load(store, rank=1)
    assert tree["data"]["value"] == {"pos": 104}
    snapcore.close()


@pytest.mark.parametrize("who", [[0, 1], [1]])
def test_a_structure_change_fails_that_step_and_every_rank_replans(
    tmp_path: Path, who: list[int]
) -> None:
    store = tmp_path / "store"
    res = run(2, [{"op": "replan", "kind": "fsdp2", "store": str(store), "who": who}])
    for rank, (r,) in enumerate(res):
        second, third = r["saves"]
        assert not second["ok"] and second["error"] == "SnapshotFailed", rank
        assert f"structure changed on ranks {', '.join(map(str, who))} " in second["message"]
        assert third["ok"], third  # every rank agreed a new plan, with no hang
        # the first plan came from ~200 bytes a rank (every rank's state alike); after a
        # change on one rank only the ranks' states differ: a plain tensor on rank 1, the
        # FSDP2 DTensors on one mesh in both groups: one description per group
        assert r["small_exchange"] == [True, True], rank
        assert r["exchange"] == ("uniform" if len(who) == 2 else "grouped"), rank
    assert LocalDirectory(store).committed_steps() == [1, 3]
    tree = snapcore.load(store, rank=who[0])
    assert tree["step"] == 3 and tree["extra"].tolist() == list(range(6))


def test_a_state_one_rank_cannot_save_raises_on_every_rank(tmp_path: Path) -> None:
    """A Partial DTensor on rank 1 only: rank 1 cannot describe its state, and says so in
    the plan's first exchange, so that rank 0 raises at once naming it (instead of
    waiting in the exchange until gloo's timeout); the next save, without it, commits."""
    store = tmp_path / "store"
    res = run(2, [{"op": "unsupported", "kind": "fsdp2", "store": str(store), "bad_rank": 1}])
    (zero,), (one,) = res
    assert one["saves"][0]["error"] == "UnsupportedState", one
    assert "bad: DTensor placement Partial" in one["saves"][0]["message"]
    assert zero["saves"][0]["error"] == "UnsupportedState", zero
    assert zero["saves"][0]["message"].startswith("rank 1 cannot save its state: bad: ")
    assert zero["saves"][1] == one["saves"][1] == {"ok": True}
    assert LocalDirectory(store).committed_steps() == [2]


@pytest.mark.parametrize("overlap", [False, True])
def test_steady_state_saves_reuse_the_part_and_each_step_holds_its_own_values(
    tmp_path: Path, overlap: bool
) -> None:
    """A save of the same tensors reuses the last save's part (the training thread does
    not plan again), and still stages what the state holds at that save: every step
    restores to the values saved at it, a new rank-local tensor of the same shape (and
    the generator's new state) included; one of another dtype is planned again."""
    import torch

    store = tmp_path / "store"
    spec = {"local": str(store), "retention": {"local": 4}}  # every step kept
    res = run(2, [{"op": "steady", "kind": "fsdp2", "store": spec, "overlap": overlap}])
    for rank, (r,) in enumerate(res):
        steps = r["steps"]
        # step 2 (new generator state, new "extra" alike) and 4 reused it; step 3 did not
        assert [s["reused"] for s in steps] == [0, 1, 1, 2], rank
        for step, s in enumerate(steps, 1):
            assert s["digests"] == res[0][0]["steps"][step - 1]["digests"]
            tree = snapcore.load(store, step=step, rank=rank)
            assert loaded_digests(store, step=step) == s["digests"], (rank, step)
            assert tree["extra"]["value"].tolist() == s["extra"], (rank, step)
            assert models_digest(tree["rng"]["torch"]) == s["rng"], (rank, step)
            assert tree["step"] == step
        assert steps[2]["extra"][1] == 100 + rank and steps[1]["extra"][1] == 10 + rank
        assert len({s["rng"] for s in steps}) == 4  # the generator moved on between saves
        assert len({json.dumps(s["digests"]) for s in steps}) == 4  # so did the weights
    assert snapcore.load(store, step=3, rank=0)["extra"]["value"].dtype == torch.float64


def test_a_reused_part_stages_from_where_its_moved_tensors_are_now(tmp_path: Path) -> None:
    """A tensor replaced by a new one alike moves its blob's source (the part is
    reused); the saves after it, of the same tensors, stage from the new address, not
    the freed predecessor's: each step restores the values saved at it (failed before
    the fix: step 3 held the step-1 tensors' freed memory)."""
    store = tmp_path / "store"
    spec = {"local": str(store), "retention": {"local": 4}}
    res = run(2, [{"op": "moved", "store": spec}])
    for rank, (r,) in enumerate(res):
        steps = r["steps"]
        assert [s["reused"] for s in steps] == [0, 1, 2, 3], rank
        for step, s in enumerate(steps, 1):
            tree = snapcore.load(store, step=step, rank=rank)
            assert tree["buf"].tolist() == s["buf"], (rank, step)
            assert tree["extra"]["value"].tolist() == s["extra"], (rank, step)
        assert steps[2]["buf"][1] == 2.5 and steps[2]["extra"][1] == 3.25 + rank


def test_the_plan_verdict_is_known_while_the_save_still_writes(tmp_path: Path) -> None:
    """Each rank learns a save's plan verdict as soon as rank 0 gives it, not when the
    save commits: the next save's plan reads it on the training thread, and must not
    wait for this save's writes (it did between 01b05d3 and the fix, where this test
    reports known False after waiting 30 s)."""
    store = tmp_path / "store"
    res = run(2, [{"op": "early-verdict", "store": {"local": str(store)}}])
    for rank, (r,) in enumerate(res):
        assert r["held"], rank  # the save's writes began and were held
        assert r["known"] and r["verdict"] == ["ok"], (rank, r)
        assert not r["done_then"], rank  # still writing when the verdict was in
        tree = snapcore.load(store, step=1, rank=rank)
        assert tree["extra"]["value"][:2].tolist() == [rank, 1 + rank]
    assert snapcore.load(store, step=1, rank=0)["buf"][-1].item() == (1 << 18) - 1


def models_digest(t: Any) -> str:
    import models

    return models.digest(t)


def test_the_checkpointer_snapshots_the_same_steps_on_every_rank(tmp_path: Path) -> None:
    store = tmp_path / "store"
    action = {"op": "checkpointer", "kind": "fsdp2", "store": str(store), "steps": 60,
              "max_interval_s": 0.25}  # fmt: skip
    res = run(2, [action])
    (r0,), (r1,) = res
    assert r0["snapshot_steps"] == r1["snapshot_steps"]  # rank 0 decided, both took them
    steps = r0["snapshot_steps"]
    assert steps[0] == 0 and len(steps) >= 3  # the first step, then the time bound
    committed = LocalDirectory(store).committed_steps()
    # close() adds the final state; the local tier keeps its 3 newest (default retention)
    assert committed == sorted({*steps, 59})[-3:]
    assert snapcore.load(store)["step"] == 59
    journal = store / "journal.jsonl"
    starts = [line for line in journal.read_text().splitlines() if '"start"' in line]
    assert len(starts) == 1  # the run journal is written once per job (by rank 0)


def test_two_nodes_keep_their_own_parts_and_a_lost_node_restores_from_the_remote(
    tmp_path: Path, s3_bucket
) -> None:
    """Two "nodes" (two torchruns, --nnodes 2, as on two machines: the other tests start
    their ranks directly, launch.run_nodes), each with its own local directory and
    host-memory area."""
    remote = {"remote": s3_bucket.url, "storage_options": s3_bucket.storage_options}
    with Nodes(tmp_path) as nodes:
        dirs, shm = nodes.dirs, nodes.shm
        actions = [{"op": "save", "kind": "fsdp2", "step": 6}]
        saved = _launch(nodes, actions, torchrun=True, **remote)
        digests = saved[0][0]["digests"]
        for node in range(2):
            for root in (dirs[node], shm[node]):
                step_dir = root / "step-000000000006"
                assert (step_dir / "manifest.json").exists()  # committed on every node
                parts = sorted(p.name[:10] for p in step_dir.glob("part-*.json"))
                mine = [f"part-{r:05d}" for r in (2 * node, 2 * node + 1)]
                assert parts == mine, root  # its own ranks' parts only
            slots = sorted(p.name for p in shm[node].glob("slot-*.bin"))
            assert {s.split("-")[1] for s in slots} == {f"r{2 * node}", f"r{2 * node + 1}"}

        nodes.replace(1)  # node 1 was replaced: its directory and memory are gone
        res = _launch(nodes, [{"op": "restore", "kind": "fsdp2"}], torchrun=True, **remote)
        for rank, (r,) in enumerate(res):
            assert r["digests"] == digests and r["step"] == 6 and r["pos"] == 100 * rank + 6
            tiers = r["tier"].split("+")
            if rank < 2:
                assert tiers[0] == "host", r["tier"]  # its node's own copy, the fastest
            else:
                assert tiers == ["remote"], r["tier"]  # the lost node's parts


def test_a_sigterm_gives_one_final_snapshot_of_the_same_step_on_every_rank(
    tmp_path: Path,
) -> None:
    """Rank 0 gets SIGTERM before step 20, rank 1 before step 21 (as a preemption reaches
    the ranks of a job): rank 0 decides one final snapshot, at step 22, which both take
    before passing the signal on."""
    store = tmp_path / "store"
    actions = [{"op": "sigterm", "kind": "fsdp2", "store": str(store), "steps": 200,
                "term_at": [20, 21]}]  # fmt: skip
    (code0, out0), (code1, out1) = _spawn(2, actions, tmp_path, timeout_s=60)
    logs = spawn_logs(tmp_path, 2)
    assert code0 == code1 == -signal.SIGTERM, logs  # both ended as the signal would
    assert out0 == out1 == [{"last_step": 22}], logs
    assert LocalDirectory(store).committed_steps() == [0, 22]  # the first step, the final
    assert snapcore.load(store)["step"] == 22


# -- the Checkpointer across ranks: every rank makes every agreed save, in order ----------
# The engine pairs the ranks' saves by a per-save number: one rank leaving a save out
# pairs every later save with another rank's (each then fails after the commit timeout,
# and the next plan exchange ends the job). Each run: 2 ranks, a short commit timeout,
# a hard process timeout.

CKPT_TIMEOUT = 60.0


def _ckpt(
    tmp_path: Path, commit_timeout_s: float = 5, **action: Any
) -> tuple[Path, list[tuple[int | None, dict[str, Any]]], str]:
    """Run the "ckpt-across" op on 2 plain processes: the store, each rank's (exit
    status, last report), the logs."""
    store = tmp_path / "store"
    a = {"op": "ckpt-across", "kind": "fsdp2", "store": str(store), **action}
    workdir = tmp_path / "run"
    out = spawn_nodes(
        SCRIPT,
        2,
        [json.dumps([a])],
        timeout=CKPT_TIMEOUT,
        node_envs=[{}],
        env={"SNAPCORE_COMMIT_TIMEOUT_S": str(commit_timeout_s)},
        workdir=workdir,
    )
    logs = spawn_logs(workdir, 2)
    return store, [(code, res[-1] if res else {}) for code, res in out], logs


def test_a_caught_background_failure_on_one_rank_keeps_every_later_snapshot(
    tmp_path: Path,
) -> None:
    """Rank 1's third local save fails (ENOSPC) and the loop catches the SnapshotFailed,
    as the docs advise. Rank 1 hears of it at an agreed step, rank 0 often earlier at a
    step with no save: each makes the agreed save before raising, so the saves stay
    paired and every later snapshot commits."""
    store, [(c0, r0), (c1, r1)], logs = _ckpt(
        tmp_path, steps=120, max_interval_s=0.3, step_s=0.05, fail=[1, 3]
    )
    assert c0 == c1 == 0, logs
    assert r0["snapshot_steps"] == r1["snapshot_steps"], logs
    assert [e[1] for e in r1["errors"]] == ["SnapshotFailed"], logs  # once
    steps = r0["snapshot_steps"]
    assert len(steps) >= 6, logs
    assert LocalDirectory(store).committed_steps() == sorted({*steps, 119})[-3:], logs


@pytest.mark.parametrize("term_at", [[0, 1], [2, 0]], ids=["rank0", "rank1"])
def test_a_sigterm_before_the_first_step_gives_the_first_and_a_final_snapshot(
    tmp_path: Path, term_at: list[int]
) -> None:
    """A SIGTERM reaches a rank before its first step() (the other rank's comes a step or
    two later): every rank takes the first snapshot, then rank 0 alone decides the
    final one, which both take before passing the signal on."""
    store, [(c0, r0), (c1, r1)], logs = _ckpt(tmp_path, steps=100, step_s=0.05, term_at=term_at)
    assert c0 == c1 == -signal.SIGTERM, logs
    final = r0["last_step"]
    assert r1["last_step"] == final and final >= 2, logs
    assert LocalDirectory(store).committed_steps() == [0, final], logs
    assert snapcore.load(store)["step"] == final


def test_a_sigterm_while_an_ordinary_snapshot_is_published_keeps_it_then_the_final(
    tmp_path: Path,
) -> None:
    """Both ranks get SIGTERM while rank 0 has published an ordinary snapshot that is not
    taken yet: every rank takes it, then the final one, published after it."""
    store, [(c0, r0), (c1, r1)], logs = _ckpt(
        tmp_path, steps=300, max_interval_s=0.3, step_s=0.05, lead=4, term_when_planned=True
    )
    assert c0 == c1 == -signal.SIGTERM, logs
    final = r0["last_step"]
    assert r1["last_step"] == final, logs
    assert r0["snapshot_steps"] == r1["snapshot_steps"], logs
    ordinary = r0["snapshot_steps"][-1]  # taken before the final step's report
    assert 20 < ordinary < final, logs
    assert LocalDirectory(store).committed_steps()[-2:] == [ordinary, final], logs
    assert snapcore.load(store)["step"] == final


def test_a_decision_heard_late_fails_that_snapshot_whole_and_no_other(tmp_path: Path) -> None:
    """Rank 1 hears rank 0's second decision three step() calls late: it saves at its
    current step, the coordinator refuses that snapshot (the ranks saved other steps),
    and the saves stay paired: every later snapshot commits."""
    store, [(c0, r0), (c1, r1)], logs = _ckpt(
        tmp_path, steps=120, max_interval_s=0.3, step_s=0.05, late=[1, 2, 3]
    )
    assert c0 == c1 == 0, logs
    steps0, steps1 = r0["snapshot_steps"], r1["snapshot_steps"]
    assert len(steps0) == len(steps1) >= 6, logs
    late = steps0[2]  # the first snapshot, then the first decision's, then this one
    assert steps1[2] > late and steps0[3:] == steps1[3:], logs
    assert any("another step" in e[2] for e in r0["errors"] + r1["errors"]), logs
    committed = LocalDirectory(store).committed_steps()
    assert committed == sorted({*steps0[3:], 119})[-3:], logs


def test_a_rank_ended_by_its_signal_does_not_linger_while_rank_0_goes_on(tmp_path: Path) -> None:
    """Only rank 1 gets SIGTERM: both take the final snapshot, rank 1 passes the signal on
    at once (not after the commit timeout, 30 s here, waiting for rank 0's next
    decision); rank 0 goes on until its next all_reduce finds rank 1 gone."""
    store, [(c0, r0), (c1, r1)], logs = _ckpt(
        tmp_path, commit_timeout_s=30, steps=1000, step_s=0.05, term_at=[None, 10]
    )
    assert c1 == -signal.SIGTERM and c0 == 0, logs
    assert "peer_gone" in r0, logs
    final = r1["last_step"]
    assert final in LocalDirectory(store).committed_steps(), logs
    assert r0["peer_gone"][1] - r1["at"] < 10, logs


def test_the_coordinator_killed_after_committing_loses_nothing(tmp_path: Path) -> None:
    """Rank 0 dies right after writing the index: rank 1 may not have its verdict, but its
    part is in a committed step and must stay (the step restores whole)."""
    store = tmp_path / "store"
    actions = [{"op": "kill-save", "kind": "fsdp2", "store": str(store), "step": 1,
                "victim": 0, "point": "index"}]  # fmt: skip
    (code0, _), (code1, out1) = _spawn(2, actions, tmp_path, timeout_s=3)
    assert code0 == -signal.SIGKILL
    assert code1 == 0, (tmp_path / "spawn1.log").read_text()[-3000:]
    (res,) = out1
    outcome = res["outcome"]
    assert outcome["ok"] or "may or may not be committed" in outcome["message"], outcome
    assert LocalDirectory(store).committed_steps() == [1, 2]
    assert loaded_digests(store) == res["second"]


def test_a_dcp_checkpoint_and_a_snapcore_one_restore_to_identical_tensors(tmp_path: Path) -> None:
    """The same FSDP2 state saved by torch.distributed.checkpoint and by snapcore, each
    restored into a fresh model with other weights: every tensor agrees, bit for bit."""
    dcp_dir, store = tmp_path / "dcp", tmp_path / "snapcore"
    action = {"op": "dcp-vs-snapcore", "dcp": str(dcp_dir), "store": str(store)}
    res = run(2, [action])
    saved = res[0][0]["saved"]
    assert any(k.startswith("optim.state.") for k in saved)  # AdamW's state is in it
    for rank, (r,) in enumerate(res):
        assert r["before"] != saved, rank  # the fresh model held other weights
        assert r["saved"] == saved, rank
        assert r["dcp"] == saved, rank
        assert r["snapcore"] == saved, rank
        assert r["step"] == 1
        # snapcore's restore read its own directory only, and unpickled nothing; the
        # recorders do see DCP's load open its directory and unpickle its metadata
        sc, dc = r["snapcore_restore"], r["dcp_load"]
        assert "step-000000000001/manifest.json" in sc["store"], sc
        assert sc["dcp"] == [] and sc["unpickled"] == [], sc
        assert ".metadata" in dc["dcp"] and dc["unpickled"] and dc["store"] == [], dc


def test_a_step_damaged_on_one_rank_is_skipped_by_every_rank(tmp_path: Path) -> None:
    """Rank 1's data of step 2 is damaged: rank 0 alone could read step 2, but every rank
    must restore the same step, so both take step 1 and say why."""
    store = tmp_path / "store"
    saved = run(
        2,
        [
            {"op": "save", "kind": "fsdp2", "store": str(store), "step": 1, "seed": 0},
            {"op": "save", "kind": "fsdp2", "store": str(store), "step": 2, "seed": 5},
        ],
    )
    first = saved[0][0]["digests"]
    assert saved[0][1]["digests"] != first  # the two steps hold different tensors
    (victim,) = (store / "step-000000000002").glob("data-*-r1.bin")
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in rank 1's shards
    victim.write_bytes(bytes(data))
    res = run(2, [{"op": "restore", "kind": "fsdp2", "store": str(store)}])
    for (r,) in res:
        assert r["step"] == 1 and r["digests"] == first
        assert len(r["skipped"]) == 1 and r["skipped"][0].startswith("step 2: ")
        assert "(rank 1)" in r["skipped"][0]


def test_a_store_every_rank_holds_but_cannot_restore_raises_on_every_rank(
    tmp_path: Path,
) -> None:
    """Rank 1's data of both steps is damaged: no step is left that every rank can
    restore, although every rank holds both. Every rank raises CorruptSnapshot (not
    SnapshotNotFound, "nothing to restore"), and a Checkpointer does not start again at
    step 0 over the snapshots with a state half-filled from them."""
    store = tmp_path / "store"
    run(
        2,
        [
            {"op": "save", "kind": "fsdp2", "store": str(store), "step": 1, "seed": 0},
            {"op": "save", "kind": "fsdp2", "store": str(store), "step": 2, "seed": 5},
        ],
    )
    for step in (1, 2):
        (victim,) = (store / f"step-{step:012d}").glob("data-*-r1.bin")
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    res = run(
        2,
        [
            {"op": "restore", "kind": "fsdp2", "store": str(store)},
            {"op": "restore", "kind": "fsdp2", "store": str(store), "via": "checkpointer"},
        ],
    )
    for plain, ckpt in res:
        assert plain["error"] == "CorruptSnapshot", plain
        assert "step 2: " in plain["message"] and "step 1: " in plain["message"], plain
        assert ckpt["error"] == "CorruptSnapshot", ckpt  # no "next_step": 0


def test_a_checkpointer_starts_at_step_0_only_from_a_store_no_rank_holds_a_step_of(
    tmp_path: Path,
) -> None:
    """The other side of the test above: an empty store is a fresh start on every rank."""
    res = run(
        2, [{"op": "restore", "kind": "fsdp2", "store": str(tmp_path / "s"), "via": "checkpointer"}]
    )
    assert [r["next_step"] for (r,) in res] == [0, 0], res


@pytest.mark.parametrize("where", ["open", "select"])
def test_a_foreign_error_on_one_rank_while_it_opens_a_step_fails_every_rank_at_once(
    tmp_path: Path, where: str
) -> None:
    """Rank 1 meets an exception that is not snapcore's (MemoryError() with no message,
    while opening the step; a RuntimeError while matching the state): it raises it, and
    rank 0 raises StateMismatch naming rank 1 and the error's type, instead of waiting in
    the plan's exchange until the group's timeout (and a gloo error naming no one)."""
    store = tmp_path / "store"
    run(2, [{"op": "save", "kind": "fsdp2", "store": str(store), "step": 1, "seed": 0}])
    res = run(
        2,
        [
            {
                "op": "restore",
                "kind": "fsdp2",
                "store": str(store),
                "boom_on_rank": 1,
                "boom_in": where,
            }
        ],
    )
    (r0,), (r1,) = res
    assert r1["error"] == ("MemoryError" if where == "open" else "RuntimeError"), r1
    assert r0["error"] == "StateMismatch", r0
    assert "rank 1" in r0["message"], r0
    assert ("MemoryError" if where == "open" else "RuntimeError: boom") in r0["message"], r0


def test_a_step_one_node_cannot_open_is_skipped_by_every_rank(tmp_path: Path, s3_bucket) -> None:
    """Two nodes of one rank each, a directory each, and object storage. Step 2: node 1's
    own part is damaged and object storage no longer holds the step, so node 1 cannot
    even open step 2 while node 0 can; both ranks restore step 1."""
    from snapcore.tiers import RemoteStoreTier

    nodes = Nodes(tmp_path)  # no host tier: nothing to clean up
    dirs = nodes.dirs
    spec = {
        "local": "$SNAPCORE_TEST_LOCAL",
        "remote": s3_bucket.url,
        "storage_options": s3_bucket.storage_options,
    }
    saves = [{"step": 1, "seed": 0}, {"step": 2, "seed": 5}]
    saved = _launch(nodes, [{"op": "save", "kind": "fsdp2", **a} for a in saves], 1, spec=spec)
    first = saved[0][0]["digests"]
    (part,) = (dirs[1] / "step-000000000002").glob("part-00001-*.json")
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0x01  # its xxh3 no longer matches the index
    part.write_bytes(bytes(data))
    remote = RemoteStoreTier(s3_bucket.url, s3_bucket.storage_options)
    remote.uncommit(2)
    remote.close()
    res = _launch(nodes, [{"op": "restore", "kind": "fsdp2"}], 1, spec=spec)
    for (r,) in res:
        assert r.get("step") == 1 and r["digests"] == first, r
        assert "(rank 1)" in r["skipped"][0]
    # Asked for step 2 by name, every rank raises (none waits for rank 1 in vain), and
    # the ranks' next restore, of step 1, pairs with itself: each rank holds step 1's
    # tensors and says so (a rank that left step 2's restore early once paired its step
    # 1 exchange with the others' step 2 one, and got step 2's tensors under "step 1").
    asked = [
        {"op": "restore", "kind": "fsdp2", "at": 2},
        {"op": "restore", "kind": "fsdp2", "at": 1},
    ]
    res = _launch(nodes, asked, 1, spec=spec)
    (two0, one0), (two1, one1) = res
    # rank 1 raises its own damage (naming its file), rank 0 the same news naming rank 1
    assert two0.get("error") == "CorruptSnapshot" and "(rank 1)" in two0["message"], two0
    assert two1.get("error") == "InvalidManifest" and str(part) in two1["message"], two1
    for one in (one0, one1):
        assert one.get("step") == 1 and one["digests"] == first, one


def test_a_rank_whose_part_is_missing_makes_every_rank_skip_the_step(tmp_path: Path) -> None:
    """Two nodes of one rank each, a directory each, no object storage. Step 2: node 1's
    part is gone from its directory (the step's index still lists it), so rank 1 finds
    its own part in none of its tiers once the step is open, while rank 0 restores its
    part: both ranks restore step 1 (this once failed with a KeyError on both, their
    exchanges paired with each other's)."""
    nodes = Nodes(tmp_path)
    dirs = nodes.dirs
    spec = {"local": "$SNAPCORE_TEST_LOCAL"}
    saves = [{"step": 1, "seed": 0}, {"step": 2, "seed": 5}]
    saved = _launch(nodes, [{"op": "save", "kind": "fsdp2", **a} for a in saves], 1, spec=spec)
    first = saved[0][0]["digests"]
    (part,) = (dirs[1] / "step-000000000002").glob("part-00001-*.json")
    part.unlink()
    res = _launch(nodes, [{"op": "restore", "kind": "fsdp2"}], 1, spec=spec)
    for (r,) in res:
        assert r.get("step") == 1 and r["digests"] == first, r
        assert "(rank 1)" in r["skipped"][0], r
    # Ranks that ask for different steps all raise, naming where each was, and their
    # next restore agrees again.
    apart = {"op": "restore", "kind": "fsdp2", "at_by_rank": {"0": 1, "1": 2}}
    res = _launch(nodes, [apart, {"op": "restore", "kind": "fsdp2"}], 1, spec=spec)
    for r, again in res:
        assert r.get("error") == "OutOfStep", r
        assert "rank 0: restore(step=1), rank 1: restore(step=2)" in r["message"], r
        assert again.get("step") == 1 and again["digests"] == first, again
    # An exception that is not snapcore's, on one rank mid-restore: that rank raises it,
    # the other raises at once naming it (not after the timeout), and the next agrees.
    boom = {"op": "restore", "kind": "fsdp2", "boom_on_rank": 1}
    (b0, again0), (b1, again1) = _launch(
        nodes, [boom, {"op": "restore", "kind": "fsdp2"}], 1, spec=spec
    )
    assert b1.get("error") == "RuntimeError" and "boom" in b1["message"], b1
    assert b0.get("error") == "StateMismatch", b0
    assert "rank 1 cannot restore it: RuntimeError: boom" in b0["message"], b0
    for again in (again0, again1):
        assert again.get("step") == 1 and again["digests"] == first, again


def test_a_re_saved_step_is_restored_as_one_save_never_a_mix_of_two(tmp_path: Path) -> None:
    """Two nodes of one rank each, a directory and a host-memory area each. Step 2 is
    saved (seed 5), then saved again (seed 9: a job that rolled back re-saves the step),
    but node 1's directory keeps the first save (its leader writes a node-local index
    after rank 0 has committed: the node was lost in between). The ranks agree on a save,
    not only on a step number: while node 1's memory holds the re-save, both restore the
    re-save (node 1 does not read its directory's first save); once node 1 holds the
    first save only and node 0 the re-save only, both skip step 2 for step 1, or raise
    for step=2, instead of restoring a mix of the two saves (each rank its own part of a
    different save: before, 8 of the 29 tensors equal to each save, the rest mixed)."""
    with Nodes(tmp_path) as nodes:
        dirs, shm = nodes.dirs, nodes.shm
        saves = [{"step": 1, "seed": 0}, {"step": 2, "seed": 5}]
        saved = _launch(nodes, [{"op": "save", "kind": "fsdp2", **a} for a in saves], 1)
        first, former = saved[0][0]["digests"], saved[0][1]["digests"]
        step2 = "step-000000000002"
        shutil.copytree(dirs[1] / step2, tmp_path / "node1-first-save")
        resaved = _launch(nodes, [{"op": "save", "kind": "fsdp2", "step": 2, "seed": 9}], 1)
        latest = resaved[0][0]["digests"]
        assert former != latest and first not in (former, latest)
        shutil.rmtree(dirs[1] / step2)
        shutil.copytree(tmp_path / "node1-first-save", dirs[1] / step2)

        res = _launch(nodes, [{"op": "restore", "kind": "fsdp2"}], 1)
        for (r,) in res:
            assert r.get("step") == 2 and r["digests"] == latest and r["skipped"] == [], r
            assert r["tier"] == "host", r
        other = [d for d in res[1][0]["damaged"] if d.endswith(": not read")]
        assert len(other) == 1 and other[0].startswith("local: holds the save "), res[1]

        (shm[1] / step2 / "manifest.json").unlink()  # node 1: the first save alone
        asked = [
            {"op": "restore", "kind": "fsdp2"},
            {"op": "restore", "kind": "fsdp2", "at": 2},
            # restore(step=None) on rank 0, step=1 on rank 1: both raise OutOfStep
            {"op": "restore", "kind": "fsdp2", "at_by_rank": {"1": 1}},
        ]
        res = _launch(nodes, asked, 1)
        for newest, named, apart in res:
            assert newest.get("step") == 1 and newest["digests"] == first, newest
            (why,) = newest["skipped"]
            assert why.startswith("step 2: the ranks hold different saves of it"), why
            assert "rank 0: the save " in why and "rank 1: the save " in why, why
            assert named.get("error") == "CorruptSnapshot", named
            assert named["message"].startswith("step 2: the ranks hold different saves"), named
            assert apart.get("error") == "OutOfStep", apart
            assert "rank 0: restore(step=None), rank 1: restore(step=1)" in apart["message"]


def _launch(
    nodes: Nodes,
    actions: list[dict[str, Any]],
    nproc: int = 2,
    spec: Any = None,
    *,
    torchrun: bool | None = None,
    **tiers: Any,
) -> list[list[dict[str, Any]]]:
    """Run ``actions`` on ``nodes`` (``nproc`` ranks each), every action with the store
    ``spec``, by default each node's directory and host-memory area and ``tiers``
    (object storage); the results by rank. ``torchrun``: as in launch.run_nodes."""
    if spec is None:
        spec = {"local": "$SNAPCORE_TEST_LOCAL", "host": "$SNAPCORE_TEST_HOST", **tiers}
    args = [json.dumps([{**a, "store": spec} for a in actions])]
    runs = nodes.run(SCRIPT, nproc, args, timeout=TIMEOUT, env=ENV, torchrun=torchrun)
    return [r.result for r in runs]


def test_each_node_holds_the_replicated_tensors_its_ranks_need_and_restores_alone(
    tmp_path: Path,
) -> None:
    """HSDP on a 2x2 mesh over two nodes, with no object storage: the replicate dimension
    spans the nodes (each shard is held by one rank of each node), AdamW's `step`
    counters and the model's buffer are plain tensors on every rank. Each node's tiers
    must hold every tensor its ranks need, so that a restore from node-local tiers alone
    is whole and bit-exact."""
    with Nodes(tmp_path) as nodes:
        dirs = nodes.dirs
        saved = _launch(nodes, [{"op": "save", "kind": "hsdp", "step": 7}])
        digests = saved[0][0]["digests"]
        for node in range(2):  # each node's directory alone gives the full global tensors
            rank = 2 * node
            assert loaded_digests(dirs[node], rank=rank) == digests
            assert snapcore.load(dirs[node], rank=rank)["data"]["value"] == {"pos": 100 * rank + 7}
        snapcore.close()
        res = _launch(nodes, [{"op": "restore", "kind": "hsdp"}])
        for rank, (r,) in enumerate(res):
            assert "error" not in r, r
            assert r["digests"] == digests and r["step"] == 7 and r["pos"] == 100 * rank + 7
            assert r["tier"].split("+")[0] == "host", r["tier"]


def test_node_local_tiers_serve_a_part_lost_from_host_memory_and_another_world_size(
    tmp_path: Path,
) -> None:
    """DDP on two nodes of 2 ranks, no object storage. Rank 3's part of the step is lost
    from node 1's host memory only (its directory holds it): every rank still restores
    the step, rank 3 reading its part from the directory (every rank once skipped the
    step, rank 3 finding its part "in none of the tiers"). Node 1's directory alone
    loads with no rank (rank 2's values), and restores into one rank per node with
    rank_local="keep": node 1's rank takes rank 2's tree (rank 0's is not on node 1)."""
    with Nodes(tmp_path) as nodes:
        saved = _launch(nodes, [{"op": "save", "kind": "ddp", "step": 3}])
        digests = saved[0][0]["digests"]
        (part,) = (nodes.shm[1] / "step-000000000003").glob("part-00003-*.json")
        part.unlink()
        res = _launch(nodes, [{"op": "restore", "kind": "ddp"}])
        for rank, (r,) in enumerate(res):
            assert r.get("step") == 3 and r["digests"] == digests and not r["skipped"], r
            assert r["pos"] == 100 * rank + 3, r
        assert "local" in res[3][0]["tier"], res[3][0]
        assert loaded_digests(nodes.dirs[1]) == digests
        assert snapcore.load(nodes.dirs[1])["data"]["value"] == {"pos": 203}
        snapcore.close()
        keep = {"op": "restore", "kind": "ddp", "rank_local": "keep"}
        res = _launch(nodes, [keep], 1, spec={"local": "$SNAPCORE_TEST_LOCAL"})
        for (r,) in res:
            assert r.get("step") == 3 and r["digests"] == digests, r


def test_object_storage_gets_each_replicated_tensor_once_and_each_node_a_copy(
    tmp_path: Path, s3_bucket, s3_client
) -> None:
    """DDP on two nodes of 2 ranks with object storage: every tensor is replicated.
    Object storage holds each once in the whole job; each node's directory holds each
    once too (its ranks' share of the node's copy). A restore reads each once per node,
    from the node's own tiers, shared by its ranks."""
    from snapcore.tiers import RemoteStoreTier

    remote = {"remote": s3_bucket.url, "storage_options": s3_bucket.storage_options}
    with Nodes(tmp_path) as nodes:
        dirs = nodes.dirs
        actions = [{"op": "save", "kind": "ddp", "step": 3}, {"op": "restore", "kind": "ddp"}]
        saved, restored = zip(*_launch(nodes, actions, **remote), strict=True)
    digests = saved[0]["digests"]
    only_remote = snapcore.Store(**remote)
    assert loaded_digests(only_remote) == digests
    replicated = _nbytes(snapcore.load(only_remote)["app"])  # model and optimizer, once
    own = [_nbytes(snapcore.load(only_remote, rank=r)["rng"]) for r in range(4)]
    assert replicated > 64 * 64  # a second copy would not fit in the slack below
    objects = [
        o
        for page in s3_client.get_paginator("list_objects_v2").paginate(Bucket=s3_bucket.name)
        for o in page.get("Contents", [])
    ]
    data = [o for o in objects if o["Key"].rsplit("/", 1)[-1].startswith("data-")]
    assert len(data) <= 4, [o["Key"] for o in data]  # a data object per rank at most
    remote_bytes = sum(o["Size"] for o in data)
    # (equal chunks, such as AdamW's `step` counters, are stored once by a rank: a few
    # bytes less than the sum)
    assert replicated <= remote_bytes <= replicated + sum(own) + 64 * 64
    tier = RemoteStoreTier(s3_bucket.url, s3_bucket.storage_options)
    try:
        m = tier.read_manifest(3)  # every piece once: the pieces of each tensor tile it
    finally:
        tier.close()
    assert not m.missing_ranks
    for node in range(2):  # each node: the replicated tensors once, its ranks' own
        mine = own[2 * node] + own[2 * node + 1]
        local, _ = saved_bytes(dirs[node], 3)
        assert replicated <= local <= replicated + mine + 64 * 64, node
        assert loaded_digests(dirs[node], rank=2 * node) == digests
        # read once per node: each of its ranks a share, together the whole state once
        ranks = restored[2 * node : 2 * node + 2]
        for r in ranks:
            assert r["digests"] == digests and r["tier"] == "host", r
        read = [r["bytes"] for r in ranks]
        assert replicated + mine <= sum(read) <= replicated + mine + 64 * 64, read
        for rank, n in enumerate(read, 2 * node):  # less than it restores: a share
            assert n < replicated + own[rank], read
    snapcore.close()


# -- one rank's failure: every rank learns it at once, and the saves after it commit ------

FAST = 6.0  # SNAPCORE_COMMIT_TIMEOUT_S of these tests: waiting for it is a failure


def _injected(tmp_path: Path, spec: Any, **op: Any) -> list[dict[str, Any]]:
    action = {"op": "injected", "store": spec, "rank": 1, **op}
    env = {"SNAPCORE_COMMIT_TIMEOUT_S": str(FAST)}
    results = run_ranks(SCRIPT, 2, [json.dumps([action])], timeout=60, env=env)
    return [r.result[0] for r in results]


@pytest.mark.parametrize("retry", [False, True])
def test_a_save_that_failed_on_one_rank_leaves_the_ranks_saves_in_step(
    tmp_path: Path, retry: bool
) -> None:
    """Rank 1's local write of step 1 fails (after 0.5 s: its host part committed);
    rank 0's takes 3 s longer. Rank 1
    calls its next save once it knows, rank 0 at once: each raises the failure at a call
    of its own (rank 0 later, or from its handle), and every rank uses up that save's
    number all the same (it is made, then the failure raised), so the ranks' saves stay
    paired: steps 2-4 commit, none waits for the commit timeout. (A rank that raised
    before taking the number, the other after or not at all, paired every later save
    with another step's: all failed, each after the timeout.) "retry": a rank whose call
    raised calls again for the same step (as Checkpointer.close does), and gets the
    handle of the save made, not a second save of its own."""
    store = tmp_path / "store"
    area = f"mp-{tmp_path.name}"
    spec = {"local": str(store), "host": area}
    try:
        out = _injected(
            tmp_path,
            spec,
            fail="local-write",
            at=1,
            steps=4,
            settle=True,
            retry=retry,
            fail_after=0.5,
            slow=3,
        )
    finally:
        HostTier(area).release()
    for rank, r in enumerate(out):
        calls, tiers = r["calls"], r["tiers"]
        assert calls[0] == "handed", (rank, r)
        raised = [c for c in calls[1:] if c != "handed"]
        failed = [t for t, (how, _) in tiers[0].items() if how != "ok"]
        assert len(failed) >= 1 and len(raised) <= len(failed), (rank, r)  # each once
        for c in raised:  # once the save was made
            assert c.startswith("SnapshotFailed: an earlier snapshot (step 1)"), r
            assert c.endswith(" | again: handed") == retry, r
        assert tiers[0]["local"][0].startswith("SnapshotFailed"), (rank, r)
        for t in tiers[1:]:
            assert t is None or t["local"][0] == "ok", (rank, r)
            assert t is None or t["local"][1] < FAST, (rank, r)
        assert r["end"] == "ok", (rank, r)
    assert out[1]["calls"][1] != "handed"  # rank 1 knew of its failure at that call
    assert out[0]["calls"][1] == "handed"  # rank 0 did not
    assert LocalDirectory(store).committed_steps() == [2, 3, 4]


def test_a_save_that_raises_on_one_rank_before_its_background_work_fails_at_once(
    tmp_path: Path,
) -> None:
    """Rank 1's save of step 2 raises on its training thread after taking the save's
    number (its arena cannot be made): it tells the coordinator, so rank 0's step 2
    fails at once naming it (not after the commit timeout), and step 3 commits."""
    store = tmp_path / "store"
    out = _injected(tmp_path, {"local": str(store)}, fail="arena", at=2, steps=3, wait_each=True)
    zero, one = out
    assert one["calls"] == ["handed", "MemoryError: cannot allocate the arena (injected)", "handed"]
    why, secs = zero["tiers"][1]["local"]
    assert "ranks 1 failed" in why and "MemoryError: cannot allocate the arena" in why, zero
    assert secs < FAST / 2, zero
    for r in out:
        assert r["tiers"][2] == {"local": ["ok", r["tiers"][2]["local"][1]]}, r
        assert r["tiers"][2]["local"][1] < FAST / 2, r
    assert LocalDirectory(store).committed_steps() == [1, 3]


def test_a_host_tier_failure_on_one_rank_fails_the_others_at_once(tmp_path: Path) -> None:
    """Rank 1 cannot write its part in host memory (ENOSPC): it tells the coordinator,
    so rank 0's host tier fails at once naming it, and no rank's local commit waits
    behind it (rank 0's persist thread waits for its hash thread, where the host
    coordinator ran)."""
    area = f"mp-{tmp_path.name}"
    spec = {"local": str(tmp_path / "store"), "host": area}
    try:
        out = _injected(tmp_path, spec, fail="host-part", at=2, steps=2, wait_each=True)
    finally:
        HostTier(area).release()
    zero, one = out
    assert one["tiers"][1]["host"][0].startswith("SnapshotFailed"), one
    assert "No space left on device (injected)" in one["tiers"][1]["host"][0], one
    why, secs = zero["tiers"][1]["host"]
    assert "ranks 1 failed" in why and "No space left on device (injected)" in why, zero
    assert secs < FAST / 2, zero
    for r in out:
        local, secs = r["tiers"][1]["local"]
        assert local == "ok" and secs < FAST / 2, r
    assert LocalDirectory(tmp_path / "store").committed_steps() == [1, 2]


# -- one rank's failure before its save takes its number (issue 10's leftover) -----------
# A second writer holding its node's lock, its state's walk, the peer tier's link: each
# used to raise on that rank alone, before the save's number, leaving the others in the
# plan's first exchange until snapcore's group timeout (FAST here: waiting for it is a
# failure), and the ranks' save numbers out of step. After each save the ranks meet in a
# barrier on the training's group, as training's next collective would.


def _early(tmp_path: Path, spec: Any, nodes: Nodes | None = None, **op: Any) -> list[Any]:
    action = {"op": "early", "store": spec, **op}
    env = {"SNAPCORE_COMMIT_TIMEOUT_S": str(FAST)}
    args = [json.dumps([action])]
    if nodes is None:
        results = run_ranks(SCRIPT, 2, args, timeout=90, env=env)
    else:
        results = nodes.run(SCRIPT, 1, args, timeout=90, env=env)
    return [r.result[0] for r in results]


def _all_commit(out: list[Any], steps: range) -> None:
    """Every rank's saves of ``steps`` were handed and committed in every tier, none
    after waiting for the commit timeout."""
    for rank, r in enumerate(out):
        for s in steps:
            assert r["calls"][s - 1][0] == "handed", (rank, s, r)
            for tier, (how, secs) in r["tiers"][s - 1].items():
                assert how == "ok" and secs < FAST / 2, (rank, s, tier, r)


def test_a_second_writer_of_one_ranks_node_fails_every_ranks_first_save_at_once(
    tmp_path: Path,
) -> None:
    """A second writer holds the store's writer lock, which rank 0 (its node's first
    process) takes at the first save: rank 0 raises StoreInUse, and rank 1, in the plan's
    first exchange, raises at once too, naming rank 0 and its error (it waited there until
    snapcore's group timeout). Once the second writer is gone, steps 2 and 3 commit on
    both ranks: their save numbers stayed in step."""
    store = tmp_path / "store"
    zero, one = _early(tmp_path, {"local": str(store)}, rank=0, fail="lock", at=1, steps=3)
    how, secs = zero["calls"][0]
    assert how.startswith("StoreInUse: ") and "pid 4242" in how and secs < FAST / 2, zero
    how, secs = one["calls"][0]
    assert how.startswith("SnapshotFailed: rank 0 failed before its save could begin: "), one
    assert "StoreInUse: " in how and "pid 4242" in how and secs < FAST / 2, one
    _all_commit([zero, one], range(2, 4))
    assert LocalDirectory(store).committed_steps() == [2, 3]


@pytest.mark.parametrize("at", [1, 2])
def test_a_state_one_rank_cannot_walk_fails_every_ranks_save_at_once(
    tmp_path: Path, at: int
) -> None:
    """Rank 1's state holds a value snapcore refuses at step ``at`` only: its walk raises
    before the save's number. At the first save (1) rank 0 raises with it in the plan's
    exchange, naming it; at a later save (2: no exchange) rank 1 takes the number and
    tells the coordinator, so rank 0's save of that step fails at once naming rank 1.
    The other steps commit on both ranks (the numbers stayed in step: rank 1's next save
    used to pair with rank 0's one after, failing each after the commit timeout)."""
    store = tmp_path / "store"
    zero, one = _early(tmp_path, {"local": str(store)}, rank=1, fail="walk", at=at, steps=3)
    how, secs = one["calls"][at - 1]
    assert how.startswith("UnsupportedState: bad: cannot save a value of type builtins.object")
    assert secs < FAST / 2, one
    how, secs = zero["calls"][at - 1]
    if at == 1:
        assert how.startswith("UnsupportedState: rank 1 cannot save its state: bad: "), zero
        assert secs < FAST / 2, zero
    else:
        assert how == "handed", zero
        why, secs = zero["tiers"][at - 1]["local"]
        assert why.startswith("SnapshotFailed") and "ranks 1 failed" in why, zero
        assert "UnsupportedState: bad: " in why and secs < FAST / 2, zero
    _all_commit([zero, one], range(at + 1, 4))
    if at == 2:
        _all_commit([zero, one], range(1, 2))
    assert LocalDirectory(store).committed_steps() == [s for s in (1, 2, 3) if s != at]


@pytest.mark.parametrize("fail", ["link", "home"])
def test_a_peer_link_failing_on_one_rank_fails_every_ranks_first_save_at_once(
    tmp_path: Path, fail: str
) -> None:
    """Two nodes of one rank with a peer tier. "link": rank 1's peer link cannot be made
    once the link's collective is done, so rank 0 went on into the plan's exchange alone;
    "home": rank 1 cannot read its peer settings, before the link's collective, where rank
    0 waited for it. Either way both ranks' first save now raises at once, rank 0's
    naming rank 1 and its error, and step 2 commits in every tier on both."""
    spec = {"local": "$SNAPCORE_TEST_LOCAL", "host": "$SNAPCORE_TEST_HOST", "peer": True}
    with Nodes(tmp_path) as nodes:
        zero, one = _early(tmp_path, spec, nodes, rank=1, fail=fail, at=1, steps=2)
    ours, secs = one["calls"][0]
    theirs, secs0 = zero["calls"][0]
    assert secs < FAST / 2 and secs0 < FAST / 2, (zero, one)
    if fail == "link":
        assert ours == "RuntimeError: cannot start the peer thread (injected)", one
        assert theirs == ("SnapshotFailed: rank 1 failed before its save could begin: " + ours), (
            zero
        )
    else:
        assert ours == "ValueError: SNAPCORE_FAILURE_DOMAIN cannot be read (injected)", one
        assert theirs.startswith("ValueError: ") and theirs.endswith(
            ": rank 1 cannot join the peer tier: " + ours
        ), zero
    _all_commit([zero, one], range(2, 3))
    for r in (zero, one):
        assert set(r["tiers"][1]) == {"host", "local", "peer"}, r
