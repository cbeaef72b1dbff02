"""The peer tier (issue 13): each rank's host snapshot is copied into a partner's memory
on the other node, and a replaced node restores from it.

Two "nodes" are the ranks of two torchruns (--nnodes 2) on this machine, started with
torchrun's environment by launch.run_nodes, each with its own local directory and
host-memory area; ranks 0, 1 are node 0 and ranks 2, 3 node 1, so rank r's
partner is rank (r + 2) % 4. Every restored tensor is compared bit for bit (sha256) with
the one saved, and the bytes each rank read are counted per tier (``RestoreInfo
.tier_bytes``, and ``peer_bytes``: received from a partner's memory). Each run has a
hard timeout: a hang fails the test.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
from launch import Nodes, run_ranks, spawn_logs

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "rank_snapcore.py"
TIMEOUT = 150.0
ENV = {"SNAPCORE_COMMIT_TIMEOUT_S": "60", "SNAPCORE_PEER_TIMEOUT_S": "30"}


class PeerNodes(Nodes):
    """Two nodes (launch.Nodes), with a launcher for both and what their memory holds."""

    def launch(self, actions: list[dict[str, Any]], **kw: Any) -> list[Any]:
        results = self.run(SCRIPT, 2, [json.dumps(actions)], timeout=TIMEOUT, env=ENV, **kw)
        return [r.result for r in results] if kw.get("check", True) else results

    def spawn_ranks(
        self, actions: list[dict[str, Any]], workdir: Path
    ) -> list[tuple[int | None, Any]]:
        """The four ranks as plain processes (launch.spawn_nodes): when a node's processes
        are SIGKILLed, no torchrun agent waits for them."""
        args = [json.dumps(actions)]
        return self.spawn(SCRIPT, 2, args, timeout=TIMEOUT, env=ENV, workdir=workdir)

    @staticmethod
    def logs(workdir: Path) -> str:
        return spawn_logs(workdir, 4)

    def copies(self, node: int, source: int) -> list[int]:
        """The committed copies of ``source``'s part that ``node`` holds."""
        root = self.shm[node] / "peer" / f"r{source}"
        return sorted(int(p.parent.name[5:]) for p in root.glob("step-*/manifest.json"))

    def host_steps(self, node: int) -> list[int]:
        return sorted(int(p.parent.name[5:]) for p in self.shm[node].glob("step-*/manifest.json"))


@pytest.fixture
def nodes(tmp_path: Path) -> Any:
    with PeerNodes(tmp_path) as n:
        yield n


def test_a_replaced_node_restores_from_its_partners_memory(
    nodes: PeerNodes, s3_bucket, tmp_path: Path
) -> None:
    """Save steps 6 and 7 to host, local disk, object storage and the peer tier; node 1
    is replaced (SIGKILLed: its processes end with the run; its directory and memory are
    deleted); the job restarts and restores step 7 bit-exact, node 1's ranks from node
    0's memory over the network (into the slot file snapcore.prepare faulted in), reading
    nothing from local disk or object storage."""
    spec = {
        "local": "$SNAPCORE_TEST_LOCAL",
        "host": "$SNAPCORE_TEST_HOST",
        "remote": s3_bucket.url,
        "storage_options": s3_bucket.storage_options,
        "peer": True,
    }
    saves = [
        {"op": "peer-save", "kind": "fsdp2", "store": spec, "step": s, "pad_mb": 1} for s in (6, 7)
    ]
    die = {"op": "die", "store": spec, "ranks": [2, 3], "no_barrier": True}
    runs = nodes.spawn_ranks([*saves, die], tmp_path / "save")
    assert [code for code, _ in runs] == [0, 0, -9, -9], nodes.logs(tmp_path / "save")
    saved = [out for _, out in runs]
    for first, second, *_ in saved:
        assert first["tiers"] == second["tiers"] == {t: "ok" for t in first["tiers"]}
        assert set(first["tiers"]) == {"host", "local", "remote", "peer"}
        assert second["warnings"] == []
    for node in range(2):
        for source in (2 * (1 - node), 2 * (1 - node) + 1):  # the other node's ranks
            assert nodes.copies(node, source) == [6, 7], (node, source)

    nodes.replace(1)
    res = nodes.launch(
        [{"op": "restore", "kind": "fsdp2", "store": spec, "pad_mb": 1, "prepare": True}]
    )
    for rank, (r,) in enumerate(res):
        assert "error" not in r, r
        if rank >= 2:  # snapcore.prepare faulted in one slot file; the fetch received into it
            (reserved,) = r["prepared"].values()
            assert reserved in r["slots"].values(), r
        else:  # a node whose area holds its snapshot: nothing reserved
            assert r["prepared"] == r["slots"], r
        assert r["step"] == 7 and r["digests"] == saved[rank][1]["digests"]
        assert r["pad"] == saved[rank][1]["pad"] and r["pos"] == 100 * rank + 7
        # Nothing from local disk or object storage: the node's own memory, and the copies
        # it holds of the other node's parts (a tensor written once in the job, there).
        assert set(r["tier_bytes"]) <= {"host", "peer"}, r["tier_bytes"]
        assert r["tier_bytes"]["host"] > 1 << 20
        if rank >= 2:
            assert r["peer_bytes"] > 1 << 20, r  # its part came from its partner's memory
            assert "peer" in r["tier"].split("+"), r["tier"]
        else:
            assert r["peer_bytes"] == 0, r
        # every rank knows that the replaced node's parts came from a partner (the
        # Checkpointer journals the failure as a lost machine on whichever rank)
        assert r["peer_ranks"] == [2, 3], r
        assert r["damaged"] == [], r["damaged"]
    # Node 1 holds its own copy again, and its partners' copies (the re-send).
    assert nodes.host_steps(1) == [7]
    assert nodes.copies(1, 0) == nodes.copies(1, 1) == [7]


def test_a_partner_killed_mid_transfer_leaves_the_previous_copy_usable(
    nodes: PeerNodes, tmp_path: Path
) -> None:
    """Step 6 reaches the partners; during step 7's transfer (paced to 4 MiB/s, so it
    takes seconds) every process of node 1 is SIGKILLed once its receiving file exists
    and its own host tier has committed step 7 (which may come after the transfer began).
    Node 0's ranks are told (the peer tier of step 7 fails, naming the copy of step 6
    that stays), their host tier holds step 7. Then node 0 is replaced: the job restores
    step 6 from node 1's copies, and the next snapshot reaches the partners again."""
    spec = {
        "host": "$SNAPCORE_TEST_HOST",
        "peer": {"max_bytes_per_s": 4 << 20, "piece_bytes": 1 << 20},
    }
    save = {"op": "peer-save", "kind": "fsdp2", "store": spec, "pad_mb": 8}
    runs = nodes.spawn_ranks(
        [
            {**save, "step": 6},
            {
                **save,
                "step": 7,
                "die_when": [
                    "$SNAPCORE_TEST_SHM/peer/r*/slot-r*-1.bin",
                    "$SNAPCORE_TEST_SHM/step-000000000007/manifest.json",
                ],
                "die_ranks": [2, 3],
                "no_barrier": True,
            },
        ],
        tmp_path / "save",
    )
    assert [code for code, _ in runs] == [0, 0, -9, -9], nodes.logs(tmp_path / "save")
    for rank in (0, 1):
        first, second = runs[rank][1]
        assert set(first["tiers"].values()) == {"ok"}, first
        assert second["tiers"]["host"] == "ok"
        assert "peer tier failed" in second["tiers"]["peer"], second
        assert any("the copy of step 6 stays" in w for w in second["warnings"]), second
    assert nodes.copies(1, 0) == nodes.copies(1, 1) == [6]  # step 7 never committed there
    assert nodes.host_steps(1) == [6, 7]
    step6 = [runs[rank][1][0] for rank in range(2)]

    nodes.replace(0)
    res = nodes.launch(
        [
            {"op": "restore", "kind": "fsdp2", "store": spec, "pad_mb": 8},
            {**save, "step": 8},
        ]
    )
    for rank, (r, after) in enumerate(res):
        assert r.get("step") == 6, r
        assert set(r["tier_bytes"]) <= {"host", "peer"}, r
        if rank < 2:
            assert r["digests"] == step6[rank]["digests"] and r["pad"] == step6[rank]["pad"]
            assert r["peer_bytes"] > 8 << 20
        assert set(after["tiers"].values()) == {"ok"}, after  # the next snapshot repairs
    assert nodes.copies(1, 0)[-1] == nodes.copies(0, 2)[-1] == 8


def test_a_peer_save_every_other_host_save_keeps_the_newest_copy_through_a_failed_transfer(
    nodes: PeerNodes, tmp_path: Path
) -> None:
    """Steps 1 and 3 go to host and peer, step 2 to host only: the sender's slots
    alternate on every host save, so steps 1 and 3 are in the same slot file. Node 1 is
    SIGKILLed a second into step 3's transfer (paced to 2 MiB/s, 8 MiB a rank): node 0
    still holds step 1's copies of node 1's ranks, committed, and its ranks say so."""
    spec = {
        "host": "$SNAPCORE_TEST_HOST",
        "peer": {"max_bytes_per_s": 2 << 20, "piece_bytes": 1 << 20},
    }
    save = {"op": "peer-save", "kind": "fsdp2", "store": spec, "pad_mb": 8}
    runs = nodes.spawn_ranks(
        [
            {**save, "step": 1, "tiers": ["host", "peer"]},
            {**save, "step": 2, "tiers": ["host"]},
            {
                **save,
                "step": 3,
                "tiers": ["host", "peer"],
                "die_when": "$SNAPCORE_TEST_SHM/step-000000000003/manifest.json",
                "die_delay_s": 1.0,
                "die_ranks": [2, 3],
                "no_barrier": True,
            },
        ],
        tmp_path / "save",
    )
    assert [code for code, _ in runs] == [0, 0, -9, -9], nodes.logs(tmp_path / "save")
    for rank in (0, 1):
        first, second, third = runs[rank][1]
        assert set(first["tiers"].values()) == {"ok"}, first
        assert set(second["tiers"]) == {"host"}, second
        assert third["tiers"]["host"] == "ok"
        assert "peer tier failed" in third["tiers"]["peer"], third
        assert any("the copy of step 1 stays" in w for w in third["warnings"]), third
    assert nodes.copies(0, 2) == nodes.copies(0, 3) == [1]  # not uncommitted mid-transfer


def test_a_partner_lost_in_a_ring_of_four_fails_every_round_at_once(tmp_path: Path) -> None:
    """Four nodes of one rank, a ring 0 -> 1 -> 2 -> 3 -> 0; rank 2 is SIGKILLed a second
    into step 2's transfer (paced). Rank 3, whose source died while it was sending to
    rank 0, goes on (gloo is never left reading memory that was unmapped); rank 0, whose
    partner and source are alive but gave up the round, learns it from the job's store
    and gives up in seconds, not after the peer group's timeout (60 s here)."""
    spec = {
        "host": "$SNAPCORE_TEST_HOST",
        "peer": {"max_bytes_per_s": 2 << 20, "piece_bytes": 1 << 20},
    }
    save = {"op": "peer-save", "kind": "fsdp2", "store": spec, "pad_mb": 8}
    actions = [
        {**save, "step": 1},
        {
            **save,
            "step": 2,
            "die_when": "$SNAPCORE_TEST_SHM/step-000000000002/manifest.json",
            "die_delay_s": 1.0,
            "die_ranks": [2],
            "no_barrier": True,
        },
        {"op": "linger", "count": 3, "max_s": 90, "after_s": 5},  # no survivor's exit cuts a round
    ]
    env = {**ENV, "SNAPCORE_PEER_TIMEOUT_S": "60"}
    with Nodes(tmp_path / "ring", 4) as ring:
        runs = ring.spawn(
            SCRIPT, 1, [json.dumps(actions)], timeout=TIMEOUT, env=env, workdir=tmp_path / "w"
        )
    logs = spawn_logs(tmp_path / "w", 4)
    assert [code for code, _ in runs] == [0, 0, -9, 0], logs
    for rank in (0, 1, 3):
        first, second, _ = runs[rank][1]
        assert set(first["tiers"].values()) == {"ok"}, first
        assert second["tiers"]["host"] == "ok", second
        assert "peer tier failed" in second["tiers"]["peer"], second
        assert second["peer_s"] < 20, (rank, second)
    assert "gave up the peer transfer" in runs[0][1][1]["tiers"]["peer"], runs[0][1][1]
    assert all(runs[rank][1][2] == {"lingered": 3} for rank in (0, 1, 3)), runs


def test_a_host_commit_failing_on_one_rank_keeps_the_peer_rounds_in_step(
    nodes: PeerNodes,
) -> None:
    """Node 1's leader (rank 2) cannot write its node's index of step 2 (ENOSPC), after
    the coordinator committed the step: its host tier fails, yet it still takes part in
    step 2's round (sending no copy, receiving rank 0's), so rank 0 is not left waiting
    for it, and step 3 reaches every partner."""
    spec = {"host": "$SNAPCORE_TEST_HOST", "peer": True}
    save = {"op": "peer-save", "kind": "fsdp2", "store": spec}
    res = nodes.launch(
        [
            {"op": "fail-node-index", "step": 2, "ranks": [2]},
            *({**save, "step": s} for s in (1, 2, 3)),
        ]
    )
    for rank, (_, first, second, third) in enumerate(res):
        assert set(first["tiers"].values()) == {"ok"}, (rank, first)
        assert set(third["tiers"].values()) == {"ok"}, (rank, third)
        if rank == 2:
            assert "No space left on device" in second["tiers"]["host"], second
            assert "peer tier failed" in second["tiers"]["peer"], second
        else:
            assert set(second["tiers"].values()) == {"ok"}, (rank, second)
        assert second["peer_s"] < 15, (rank, second)  # nobody waited for a partner
    assert any("rank 2's part was not received" in w for w in res[0][2]["warnings"]), res[0]
    assert nodes.copies(0, 2)[-1] == nodes.copies(1, 0)[-1] == 3


def test_a_rank_without_a_host_verdict_still_takes_part_in_the_peer_round(
    nodes: PeerNodes,
) -> None:
    """Rank 2 has no verdict on step 2's host commit in time (the step committed on the
    other ranks): asked once more on the peer thread, the verdict says committed, so rank
    2 still takes part in step 2's round, sending no copy (its host tier failed) and
    receiving rank 0's; rank 0 is not left waiting for it, and step 3 reaches every
    partner (failed before: rank 2 skipped the round, the rounds went out of step)."""
    spec = {"host": "$SNAPCORE_TEST_HOST", "peer": True}
    save = {"op": "peer-save", "kind": "fsdp2", "store": spec}
    res = nodes.launch(
        [
            {"op": "no-host-verdict", "step": 2, "ranks": [2]},
            *({**save, "step": s} for s in (1, 2, 3)),
        ]
    )
    for rank, (_, first, second, third) in enumerate(res):
        assert set(first["tiers"].values()) == {"ok"}, (rank, first)
        assert set(third["tiers"].values()) == {"ok"}, (rank, third)
        if rank == 2:
            assert "no verdict from the coordinator" in second["tiers"]["host"], second
            assert "sends no copy of step 2" in second["tiers"]["peer"], second
        else:
            assert set(second["tiers"].values()) == {"ok"}, (rank, second)
        assert second["peer_s"] < 15, (rank, second)  # nobody waited for a partner
    assert any("rank 2's part was not received" in w for w in res[0][2]["warnings"]), res[0]
    assert nodes.copies(0, 2)[-1] == nodes.copies(1, 0)[-1] == 3
    assert 2 not in nodes.copies(0, 2)  # rank 2 sent no copy of a step it had no verdict on


def test_a_rank_that_never_learns_its_host_verdict_disables_the_peer_tier_at_once(
    nodes: PeerNodes,
) -> None:
    """Rank 2 has no verdict on step 2's host commit, even asked once more: whether its
    partners run the round is unknown, so it disables the peer tier; rank 0, waiting for
    it in step 2's round (or about to run it), learns it from the job's store and gives up
    at once (not after the peer timeout, 30 s here). Every rank reports the peer tier's
    loss once (step 2, or step 3 for a rank whose step-2 round had completed), and step
    3's other tiers go on."""
    spec = {"host": "$SNAPCORE_TEST_HOST", "peer": True}
    save = {"op": "peer-save", "kind": "fsdp2", "store": spec}
    res = nodes.launch(
        [
            {"op": "no-host-verdict", "step": 2, "ranks": [2], "again": False},
            *({**save, "step": s} for s in (1, 2, 3)),
        ]
    )
    for rank, (_, first, second, third) in enumerate(res):
        assert set(first["tiers"].values()) == {"ok"}, (rank, first)
        assert third["tiers"]["host"] == "ok", (rank, third)
        assert second["peer_s"] < 15, (rank, second)  # nobody waited for the peer timeout
        # a rank told at step 2 leaves the peer tier out of step 3 (no "peer" there)
        peer = [second["tiers"]["peer"], third["tiers"].get("peer", "left out")]
        failed = [p for p in peer if p.startswith("SnapshotFailed")]
        assert len(failed) == 1 and "disabled until the job restarts" in failed[0], (rank, peer)
    assert "had no verdict on step 2's host commit" in res[2][2]["tiers"]["peer"], res[2]
    # rank 0 gave up its round, or learnt it from the store before the round began
    said = res[0][2]["tiers"]["peer"]
    assert "gave up the peer transfer" in said or "rank 2 had no verdict" in said, res[0]


def test_a_full_partner_memory_and_a_stale_partner_area_are_reported(nodes: PeerNodes) -> None:
    """Partner copies are capped at 64 KiB (PeerSpec.max_bytes) and each rank's part
    takes 1 MiB: every rank's peer tier fails with "partner memory full", each receiver
    warns, and the host and local tiers are committed as ever. Node 1's area also holds a
    copy of rank 0's part from another store (a stale area): it is dropped, and said."""
    stale = nodes.shm[1] / "peer" / "r0"
    (stale / "step-000000000099").mkdir(parents=True)
    (stale / "step-000000000099" / "manifest.json").write_text("{}")
    (stale / "peer.json").write_text(json.dumps({"store": {"local": "/gone"}, "world_size": 4}))
    spec = {
        "host": "$SNAPCORE_TEST_HOST",
        "local": "$SNAPCORE_TEST_LOCAL",
        "peer": {"max_bytes": 64 << 10},
    }
    res = nodes.launch(
        [{"op": "peer-save", "kind": "fsdp2", "store": spec, "step": 3, "pad_mb": 1}]
    )
    for rank, (r,) in enumerate(res):
        assert r["tiers"]["host"] == r["tiers"]["local"] == "ok", r
        assert "partner memory full" in r["tiers"]["peer"], r
        assert any("partner memory full" in w for w in r["warnings"]), r
        if rank == 2:  # the receiver of rank 0's copies
            assert any("dropped the stale copies" in w for w in r["warnings"]), r
    assert not (stale / "step-000000000099").exists()
    for node in range(2):
        assert nodes.host_steps(node) == [3]
        assert nodes.copies(node, 2 * (1 - node)) == []


def test_a_job_of_one_node_cannot_save_to_a_peer_tier(tmp_path: Path) -> None:
    """Two ranks sharing one host area are one node: no partner to send to. Every save
    says so (a ValueError), rather than counting a peer tier it does not have."""
    area = f"test-{os.getpid()}-{uuid.uuid4().hex[:8]}-one"
    spec = {"host": area, "peer": True}
    save = {"op": "peer-save", "kind": "fsdp2", "store": spec}
    try:
        res = run_ranks(
            SCRIPT, 2, [json.dumps([{**save, "step": 1}, {**save, "step": 2}])],
            timeout=TIMEOUT, env=ENV,
        )  # fmt: skip
        for r in res:
            for out in r.result:
                assert "the peer tier needs a job of two nodes" in out["error"], out
    finally:
        shutil.rmtree(Path("/dev/shm") / f"snapcore-{area}", ignore_errors=True)
