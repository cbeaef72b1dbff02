"""The peer tier's pure parts: who partners whom (snapcore/peer/topology.py), and how a
received copy is checked and committed (snapcore/peer/area.py). The transfers between
processes are tested in tests/multiproc/test_peer.py."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

import snapcore
from snapcore.errors import InvalidManifest, SnapcoreError
from snapcore.peer.area import Copy, Destination, PeerArea, PeerCopies, peer_root
from snapcore.peer.topology import Home, Topology

PLAN = "ab" * 32
IDENTITY = {"store": {"local": None, "remote": None}, "world_size": 2}


def homes(nodes: int, per_node: int, domains: list[str] | None = None) -> list[Home]:
    return [
        Home("h", f"area{n}", domains[n] if domains else None)
        for n in range(nodes)
        for _ in range(per_node)
    ]


def test_a_ring_of_two_nodes_partners_each_rank_with_its_peer_on_the_other_node() -> None:
    t = Topology(homes(2, 2))
    assert [t.partners(r) for r in range(4)] == [[2], [3], [0], [1]]
    assert [t.sources(r) for r in range(4)] == [[2], [3], [0], [1]]
    assert not any(t.same_node(r, t.partners(r)[0]) for r in range(4))


def test_k_partners_are_the_next_k_nodes_of_the_ring() -> None:
    t = Topology(homes(3, 1), k=2)
    assert [t.partners(r) for r in range(3)] == [[1, 2], [2, 0], [0, 1]]
    capped = Topology(homes(2, 1), k=3)  # only one other node
    assert capped.partners(0) == [1]


def test_partners_are_in_another_failure_domain_when_the_domains_are_known() -> None:
    # nodes 0, 1 in rack a, nodes 2, 3 in rack b: the ring interleaves them
    t = Topology(homes(4, 1, ["a", "a", "b", "b"]))
    for r in range(4):
        (p,) = t.partners(r)
        assert t.homes[p].domain != t.homes[r].domain, (r, p)


def test_peer_spec_parses_true_a_number_or_a_spec() -> None:
    assert snapcore.PeerSpec.parse(True) == snapcore.PeerSpec(k=1)
    assert snapcore.PeerSpec.parse(2) == snapcore.PeerSpec(k=2)
    assert snapcore.PeerSpec.parse(None) is None and snapcore.PeerSpec.parse(False) is None
    with pytest.raises(ValueError, match="k must be"):
        snapcore.PeerSpec(k=0)
    with pytest.raises(ValueError, match="needs a host tier"):
        snapcore.Store(local="/tmp/x", peer=True)


# -- a copy: rank 1's part of a step, its slot file and the index --------------------------


def make_copy(step: int, seed: int = 0) -> tuple[Copy, bytes]:
    data = bytes((seed + i * 7) % 251 for i in range(128))
    name = "slot-r1-0.bin" if step % 2 == 0 else "slot-r1-1.bin"
    part = {
        "format_version": 3,
        "kind": "snapcore.part",
        "rank": 1,
        "plan": PLAN,
        "structure": "cd" * 32,
        "keys": ["w"],
        "step": step,
        "created_unix": 1700000000.0,
        "writer": {},
        "world_size": 2,
        "rank_files": [[0]],
        "files": [{"name": name, "size": 128}],
        "blobs": [{"nbytes": 64, "element_size": 4, "chunks": [chunk(data, 0, 64)]}],
        "tensors": [
            {
                "dtype": "float32",
                "shape": [8, 4],
                "pieces": [
                    {
                        "offsets": [4, 0],
                        "shape": [4, 4],
                        "blob": 0,
                        "byte_offset": 0,
                        "strides": [4, 1],
                    }
                ],
            }
        ],
        "tree": {"dict": [["w", {"tensor": 0}]]},
    }
    part_bytes = json.dumps(part).encode()
    part_name = f"step-{step:012d}/part-00001-0123456789ab.json"
    refs = [
        {"rank": 0, "name": f"step-{step:012d}/part-00000-0123456789ab.json", "size": 10,
         "xxh3": "0" * 32},
        {"rank": 1, "name": part_name, "size": len(part_bytes),
         "xxh3": xxhash.xxh3_128_hexdigest(part_bytes)},
    ]  # fmt: skip
    index = {
        "format_version": 3,
        "kind": "snapcore.snapshot",
        "step": step,
        "created_unix": 1700000000.0,
        "writer": {},
        "world_size": 2,
        "plan": PLAN,
        "parts": refs,
    }
    return Copy(1, json.dumps(index).encode(), part_name, part_bytes), data


def chunk(data: bytes, offset: int, n: int) -> dict[str, Any]:
    return {
        "file": 0,
        "offset": offset,
        "length": n,
        "raw_length": n,
        "codec": "none",
        "xxh3": xxhash.xxh3_128_hexdigest(data[offset : offset + n]),
    }


def receive(root: Path, copy: Copy, data: bytes, **kw: Any) -> Destination:
    kw.setdefault("identity", IDENTITY)
    dest = Destination(root, step=copy.step, rank=1, **kw)
    dest.prepare(copy.meta())
    whole = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    dest.write(0, 0, whole[:50])  # in two pieces, as the wire hands them
    dest.write(0, 50, whole[50:])
    dest.finish()
    return dest


@pytest.fixture
def area(tmp_path: Path) -> Path:
    return tmp_path / "area"


def test_a_received_copy_is_committed_and_reads_back(area: Path) -> None:
    copy, data = make_copy(4)
    receive(peer_root(area, 1), copy, data)
    assert PeerArea(area, 1).committed_steps(IDENTITY) == [4]
    assert PeerArea(area, 1).committed_steps({"other": 1}) == []  # another store's: none
    again = Copy.read(peer_root(area, 1), 4, 1)
    assert again.part_bytes == copy.part_bytes and again.index_bytes == copy.index_bytes
    assert (peer_root(area, 1) / "slot-r1-0.bin").read_bytes() == data
    view = PeerCopies(area, IDENTITY)
    m = view.read_manifest(4)
    assert m.missing_ranks == [0] and view.file_size("slot-r1-0.bin") == 128


def test_a_copy_damaged_on_the_way_is_not_committed_and_the_previous_one_stays(
    area: Path,
) -> None:
    old, old_data = make_copy(4)
    receive(peer_root(area, 1), old, old_data)
    new, data = make_copy(5, seed=3)
    bad = bytearray(data)
    bad[10] ^= 0xFF
    with pytest.raises(InvalidManifest, match="arrived damaged: chunk 0/0"):
        receive(peer_root(area, 1), new, bytes(bad))
    assert PeerArea(area, 1).committed_steps(IDENTITY) == [4]
    assert (peer_root(area, 1) / "slot-r1-0.bin").read_bytes() == old_data


def test_a_copy_that_would_exceed_max_bytes_is_refused_before_anything_changes(
    area: Path,
) -> None:
    old, old_data = make_copy(4)
    receive(peer_root(area, 1), old, old_data)
    new, _ = make_copy(5)
    dest = Destination(peer_root(area, 1), step=5, rank=1, identity=IDENTITY, max_bytes=4096)
    with pytest.raises(SnapcoreError, match="partner memory full"):
        dest.prepare(new.meta())
    assert PeerArea(area, 1).committed_steps(IDENTITY) == [4]


def test_a_copy_into_the_newest_copys_file_leaves_it_committed_until_the_new_one_is(
    area: Path,
) -> None:
    """A peer save every other host save sends the same sender slot each time (step 4
    and step 6 both in slot-r1-0.bin): the newest committed copy names the very file the
    next one arrives in. It is received beside it and renamed over it only once whole:
    a copy cut short leaves the previous one committed and intact."""
    root = peer_root(area, 1)
    old, old_data = make_copy(4)
    receive(root, old, old_data)
    new, data = make_copy(6, seed=5)
    assert new.files == old.files  # the same slot file
    dest = Destination(root, step=6, rank=1, identity=IDENTITY)
    dest.prepare(new.meta())
    assert PeerArea(area, 1).committed_steps(IDENTITY) == [4]  # still, mid-transfer
    dest.write(0, 0, torch.frombuffer(bytearray(data[:40]), dtype=torch.uint8))
    with pytest.raises(InvalidManifest, match="did not arrive whole"):
        dest.finish()
    assert PeerArea(area, 1).committed_steps(IDENTITY) == [4]
    assert (root / "slot-r1-0.bin").read_bytes() == old_data
    (root / "slot-r1-1.bin").write_bytes(b"x" * 4096)  # a file no committed copy names
    assert Copy.read(root, 4, 1).part_bytes == old.part_bytes
    assert [p.name for p in root.iterdir() if p.name.startswith(".")] == []

    receive(root, new, data)  # whole: it replaces the newest copy, then commits
    assert PeerArea(area, 1).committed_steps(IDENTITY) == [6]
    assert not (root / "slot-r1-1.bin").exists()  # dropped: its memory is not held
    assert (root / "slot-r1-0.bin").read_bytes() == data
    assert [p.name for p in root.iterdir() if p.name.startswith(".")] == []
    again, _ = make_copy(6, seed=9)  # the same step again (a re-send): the newest stays
    dest = Destination(root, step=6, rank=1, identity=IDENTITY)
    dest.prepare(again.meta())
    dest.abort()
    assert PeerArea(area, 1).committed_steps(IDENTITY) == [6]
    assert (root / "slot-r1-0.bin").read_bytes() == data


def test_max_bytes_caps_all_of_a_ranks_copies_together(area: Path) -> None:
    """``PeerSpec.max_bytes`` is what all of one rank's copies take: the namespaces of
    each of its sources (k=2, or nodes of unequal size), and the copies accepted earlier
    in the same round (whose memory is not filled yet), counted together."""
    from snapcore.peer.area import Budget

    copy, data = make_copy(4)
    roots = [peer_root(area, 1), peer_root(area, 3)]
    cap = 20 << 10
    first = Destination(roots[0], step=4, rank=1, identity=IDENTITY, budget=Budget(cap, roots))
    first.prepare(copy.meta())  # accepted: its file holds no memory yet
    second = Destination(roots[1], step=4, rank=1, identity=IDENTITY, budget=first.budget)
    with pytest.raises(SnapcoreError, match="partner memory full"):
        second.prepare(copy.meta())
    first.abort()
    # a later round: the copy held in one namespace counts against the other's
    receive(roots[0], copy, data, budget=Budget(cap, roots))
    with pytest.raises(SnapcoreError, match="partner memory full"):
        receive(roots[1], copy, data, budget=Budget(cap, roots))
    assert PeerArea(area, 3).committed_steps(IDENTITY) == []
    receive(roots[1], copy, data, budget=Budget(2 * cap, roots))  # room for both
    assert PeerArea(area, 3).committed_steps(IDENTITY) == [4]


def test_a_stale_area_of_another_store_or_a_newer_step_is_dropped_and_said(area: Path) -> None:
    root = peer_root(area, 1)
    copy, data = make_copy(8)
    receive(root, copy, data)
    older, older_data = make_copy(6)  # a restarted run saves step 6 again: 8 is stale
    dest = receive(root, older, older_data)
    assert PeerArea(area, 1).committed_steps(IDENTITY) == [6]
    assert any("stale copies of steps [8]" in n for n in dest.notes)
    (root / "peer.json").write_text(json.dumps({"store": {"local": "/else"}}))
    dest = receive(root, copy, data)
    assert PeerArea(area, 1).committed_steps(IDENTITY) == [8]
    assert any("dropped the stale copies" in n for n in dest.notes)


def test_a_copy_of_another_step_or_rank_is_refused(area: Path) -> None:
    copy, _ = make_copy(4)
    with pytest.raises(InvalidManifest, match="expected step 5"):
        Destination(peer_root(area, 1), step=5, rank=1).prepare(copy.meta())
    with pytest.raises(InvalidManifest, match="expected rank 0's part"):
        Destination(peer_root(area, 1), step=4, rank=0).prepare(copy.meta())
    assert not os.path.exists(peer_root(area, 1) / "slot-r1-0.bin")


def test_a_copy_cut_short_is_not_committed(area: Path) -> None:
    copy, data = make_copy(4)
    dest = Destination(peer_root(area, 1), step=4, rank=1, identity=IDENTITY)
    dest.prepare(copy.meta())
    dest.write(0, 0, torch.frombuffer(bytearray(data[:40]), dtype=torch.uint8))
    with pytest.raises(InvalidManifest, match="did not arrive whole"):
        dest.finish()
    assert PeerArea(area, 1).committed_steps(IDENTITY) == []


def test_a_copy_is_received_straight_into_its_files_mapping(area: Path) -> None:
    copy, data = make_copy(4)
    dest = Destination(peer_root(area, 1), step=4, rank=1, identity=IDENTITY)
    dest.prepare(copy.meta())
    whole = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    for off, n in ((0, 50), (50, 78)):  # as the wire's irecv fills each piece
        target = dest.target(0, off, n)
        assert target is not None and target.numel() == n
        target.copy_(whole[off : off + n])
        dest.received(0, off, n)
    dest.finish()
    assert PeerArea(area, 1).committed_steps(IDENTITY) == [4]
    path = peer_root(area, 1) / "slot-r1-0.bin"
    assert path.read_bytes() == data and path.stat().st_size == 128  # not a page up


def test_memory_that_cannot_be_faulted_in_is_reported_as_full_and_nothing_commits(
    area: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    old, old_data = make_copy(4)
    receive(peer_root(area, 1), old, old_data)
    monkeypatch.setattr(Destination, "_populate", staticmethod(lambda *a: errno.ENOMEM))
    new, _data = make_copy(5, seed=3)
    dest = Destination(peer_root(area, 1), step=5, rank=1, identity=IDENTITY)
    dest.prepare(new.meta())
    assert dest.target(0, 0, 50) is None  # the wire drops the piece into a buffer of its own
    with pytest.raises(SnapcoreError, match="partner memory full: faulting in"):
        dest.finish()
    assert PeerArea(area, 1).committed_steps(IDENTITY) == [4]
    assert (peer_root(area, 1) / "slot-r1-0.bin").read_bytes() == old_data


def test_the_checkpointer_sends_the_peer_tier_with_its_host_snapshots() -> None:
    from snapcore.scheduling.checkpointer import with_peer

    peer = snapcore.Store(host="a", local="/x", peer=True)
    plain = snapcore.Store(host="a", local="/x")
    planned = ("host", "local")
    assert with_peer(peer, ("host", "local"), planned=planned) == ("host", "local", "peer")
    assert with_peer(peer, ("host",), planned=planned) == ("host", "peer")
    assert with_peer(peer, ("local",), planned=planned) == ("local",)  # no host: nothing to send
    assert with_peer(plain, ("host",), planned=planned) == ("host",)
    assert with_peer(peer, ("host", "peer"), planned=planned) == ("host", "peer")
    # a plan with an interval of its own for the peer tier decides when it goes
    assert with_peer(peer, ("host",), planned=(*planned, "peer")) == ("host",)


def test_a_checkpointer_over_a_peer_store_plans_and_asks_for_the_peer_tier(
    tmp_path: Path, host_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from snapcore import api
    from snapcore.write.engine import close_all

    asked: list[tuple[str, ...]] = []
    real = api.async_save

    def spy(state: Any, store: Any, **kw: Any) -> Any:
        asked.append(tuple(kw["tiers"]))
        # one process is no job: the peer tier itself is tested in tests/multiproc
        return real(state, snapcore.Store(host=host_name, local=tmp_path), **kw | {
            "tiers": [t for t in kw["tiers"] if t != "peer"]
        })  # fmt: skip

    monkeypatch.setattr(api, "async_save", spy)
    store = snapcore.Store(host=host_name, local=tmp_path, peer=True)
    try:
        ckpt = snapcore.Checkpointer(store, devices=64)
        state = {"w": torch.ones(8)}
        for step in range(3):
            ckpt.step(step, state)
        ckpt.close()
    finally:
        close_all()
    # The peer tier has an interval of its own in the plan (between host and local), and
    # the first step snapshots every tier, the peer tier included.
    assert list(ckpt._intervals) == ["host", "peer", "local"], ckpt._intervals
    assert ckpt._intervals["host"] <= ckpt._intervals["peer"] <= ckpt._intervals["local"]
    assert asked and set(asked[0]) == {"host", "peer", "local"}, asked


class FakeKV:
    """The job's key-value store, in memory."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        if key not in self.data and expected == "":
            self.data[key] = desired.encode()
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def get(self, key: str) -> bytes:
        return self.data[key]


def fake_link(host: str, rank: int, kv: FakeKV) -> Any:
    from types import SimpleNamespace

    from snapcore.peer.link import Connection, PeerLink

    job = SimpleNamespace(
        rank=rank, world_size=2, kv=kv, key=lambda *p: "snapcore/" + "/".join(map(str, p))
    )
    conn = Connection(job, None, Topology(homes(2, 1), 1), 1.0)  # type: ignore[arg-type]
    return PeerLink(conn, snapcore.Store(host=host, peer=True))


def test_a_lost_partner_disables_the_peer_tier_once_and_later_saves_leave_it_out(
    host_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from snapcore.errors import SnapshotFailed
    from snapcore.peer import link as link_mod
    from snapcore.peer.wire import Outgoing, PeerLinkError
    from snapcore.staging.handle import SaveHandle, SaveStats
    from snapcore.write.engine import close_all, engine_for

    def lost(*a: Any, **k: Any) -> Any:
        raise PeerLinkError("the peer transfer with ranks [1] failed: Connection reset by peer")

    monkeypatch.setattr(link_mod, "exchange", lost)
    monkeypatch.setattr(link_mod.PeerLink, "_outgoing", lambda self, d, s, k: Outgoing(d, None, []))
    kv = FakeKV()
    links = [fake_link(host_name, r, kv) for r in range(2)]
    try:
        h = SaveHandle(7, SaveStats(7, 0, 0), ("host", "peer"))
        links[0]._run(h, 7, "index")
        with pytest.raises(SnapshotFailed, match="disabled until the job restarts"):
            h.wait(tier="peer")
        assert links[0].off() and "lost at step 7" in (links[0].disabled or "")

        # rank 1 learns it from the job's store at its next round: no transfer is tried
        monkeypatch.setattr(link_mod, "exchange", lambda *a, **k: pytest.fail("transferred"))
        assert not links[1].off()
        h1 = SaveHandle(7, SaveStats(7, 0, 0), ("host", "peer"))
        links[1]._run(h1, 7, "index")
        with pytest.raises(SnapshotFailed, match=r"disabled until the job restarts: .*step 7"):
            h1.wait(tier="peer")
        assert links[1].off()

        # once reported, this rank's saves go to the other tiers only
        engine = engine_for(snapcore.Store(host=host_name, peer=True))
        assert engine._wanted(None) == ("host", "peer")
        engine.peer = links[0]
        assert engine._wanted(None) == ("host",)
        assert engine._wanted(["host", "peer"]) == ("host",)
        engine.peer = None
    finally:
        for link in links:
            link.close()
        close_all()


def test_a_save_queued_behind_the_failed_round_leaves_the_peer_tier_out_not_failed_again(
    host_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two saves in flight: step 7's round fails (a partner lost), and step 8's round,
    queued behind it on the peer thread, finds the peer tier disabled. The failure is
    reported once, on step 7's handle; step 8's handle just has no peer tier, as the
    saves after it (failed before: it failed again, "disabled until the job restarts")."""
    from snapcore.errors import SnapshotFailed
    from snapcore.peer import link as link_mod
    from snapcore.peer.wire import Outgoing, PeerLinkError
    from snapcore.staging.handle import SaveHandle, SaveStats

    def lost(*a: Any, **k: Any) -> Any:
        raise PeerLinkError("the peer transfer with ranks [1] failed: Connection reset by peer")

    monkeypatch.setattr(link_mod, "exchange", lost)
    monkeypatch.setattr(link_mod.PeerLink, "_outgoing", lambda self, d, s, k: Outgoing(d, None, []))
    link = fake_link(host_name, 0, FakeKV())
    try:
        h7, h8 = (SaveHandle(s, SaveStats(s, 0, 0), ("host", "peer")) for s in (7, 8))
        from concurrent.futures import ThreadPoolExecutor

        waiter = ThreadPoolExecutor(1)
        waiting = waiter.submit(h8.wait)  # a waiter on step 8 already
        first, second = link.submit(h7, 7, "index"), link.submit(h8, 8, "index")
        first.result(), second.result()
        with pytest.raises(SnapshotFailed, match="peer tier failed"):
            h7.wait(tier="peer")
        h7.resolve("host"), h8.resolve("host")
        assert h8.unreported() is None and h8.tiers == ("host",)
        assert h8.wait() is h8.stats and waiting.result() is h8.stats
        assert "peer" not in h8.stats.tiers  # never counted durable there
        with pytest.raises(ValueError, match="not sent to tier 'peer': the peer tier is disabled"):
            h8.wait(tier="peer")
        assert h8.done() and h8.done("peer")
        waiter.shutdown()
    finally:
        link.close()


@pytest.mark.parametrize("where", ["here", "elsewhere"])
def test_a_failed_fetch_disables_the_peer_tier_and_nothing_else_runs_on_the_group(
    host_name: str, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A restore's fetch round that fails (a partner lost) breaks the peer group as a
    failed save round does: the peer tier is disabled on every rank (here: this rank's
    round failed; elsewhere: another rank's, said in the exchange after the fetch), the
    re-send is not queued, and the next save reports it without a transfer (failed
    before: only a note, then the re-send ran on the broken group)."""
    from snapcore.errors import SnapshotFailed
    from snapcore.peer import link as link_mod
    from snapcore.peer import restore as restore_mod
    from snapcore.peer.wire import PeerLinkError
    from snapcore.staging.handle import SaveHandle, SaveStats
    from snapcore.tiers import HostTier

    rounds: list[str] = []

    def exchange(group: Any, outgoing: Any, incoming: Any, **kw: Any) -> Any:
        rounds.append("fetch" if not rounds else "after")
        if where == "here":
            raise PeerLinkError("the peer transfer with ranks [1] failed: Connection reset")
        return {o.dst: None for o in outgoing}, {}

    lost = "a partner lost in the fetch of step 5 (the peer transfer with ranks [0] failed)"
    # here: rank 0 lacks step 5 and fetches its part from rank 1, which holds a copy;
    # elsewhere: rank 1 lacks it and fetches from rank 0; rank 1's round fails
    holds = {"host": [5], "own": [5], "remote": [], "writable": True, "disabled": None}
    lacks = {"host": [], "own": [], "remote": [], "held": {}, "writable": True, "disabled": None}
    other = {**holds, "held": {"0": [5]}} if where == "here" else lacks
    said = {"ok": True, "disabled": None} if where == "here" else {"ok": False, "disabled": lost}
    gathered: list[Any] = []

    def all_gather(job: Any, data: bytes) -> list[bytes]:
        gathered.append(json.loads(data) if data else None)
        answer = [other, said, None][len(gathered) - 1]
        return [data, json.dumps(answer).encode() if answer is not None else b""]

    monkeypatch.setattr(restore_mod, "exchange", exchange)
    monkeypatch.setattr(restore_mod, "all_gather_bytes", all_gather)
    monkeypatch.setattr(link_mod, "exchange", lambda *a, **k: pytest.fail("a save round ran"))
    kv = FakeKV()
    link = fake_link(host_name, 0, kv)
    store = link.store
    root = HostTier(host_name).root
    try:
        if where == "elsewhere":  # rank 0 holds a copy of rank 1's part: it sends it back
            copy, data = make_copy(5)
            identity = link_mod.peer_identity(store, 2)
            receive(peer_root(root, 1), copy, data, identity=identity)
        steps = {"host": [5] if where == "elsewhere" else []}
        job = link.conn.job
        fetched = restore_mod.prepare_restore(store, steps, job, None, link)
        link.drain()
        assert rounds == ["fetch"]  # no re-send on the broken group
        assert link.disabled is not None and "fetch of step 5" in link.disabled
        assert "fetch of step 5" in kv.data["snapcore/peer/disabled"].decode()
        assert any("disabled until the job restarts" in n for n in fetched.notes), fetched
        assert not link.off()  # reported once, on the next save's handle:
        h = SaveHandle(6, SaveStats(6, 0, 0), ("host", "peer"))
        link._run(h, 6, "index")
        with pytest.raises(SnapshotFailed, match=r"disabled until the job restarts: .*fetch"):
            h.wait(tier="peer")
        assert link.off()
    finally:
        link.close()
        snapcore.close()
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("verdict", [True, False, None])
def test_a_rank_without_a_host_verdict_keeps_its_partners_from_waiting(
    host_name: str, monkeypatch: pytest.MonkeyPatch, verdict: bool | None
) -> None:
    """A rank whose host commit had no verdict from the coordinator in time
    (``OutcomeUnknown``) does not know whether its partners run the step's round; the
    peer thread asks for the verdict once more. Committed: the round runs and this rank
    sends no copy (a status-1 header, never its part of a step it cannot call committed),
    so its partners are not left waiting. Not committed: no round, as on every rank.
    Still unknown: the peer tier is disabled in the job's store (partners waiting in the
    round give up at once) and reported once."""
    from snapcore.errors import SnapshotFailed
    from snapcore.peer import link as link_mod
    from snapcore.staging.handle import SaveHandle, SaveStats

    rounds: list[Any] = []

    def exchange(group: Any, outgoing: Any, incoming: Any, **kw: Any) -> Any:
        rounds.append(outgoing)
        return {o.dst: o.error for o in outgoing}, {i.src: None for i in incoming}

    monkeypatch.setattr(link_mod, "exchange", exchange)
    monkeypatch.setattr(
        link_mod.PeerLink, "_outgoing", lambda *a: pytest.fail("read this rank's part to send")
    )
    kv = FakeKV()
    link = fake_link(host_name, 0, kv)
    try:
        h = SaveHandle(7, SaveStats(7, 0, 0), ("host", "peer"))
        link.submit(h, 7, "index", verdict=lambda: verdict).result()
        with pytest.raises(SnapshotFailed) as failed:
            h.wait(tier="peer")
        if verdict:
            (outgoing,) = rounds
            assert [(o.dst, o.copy) for o in outgoing] == [(1, None)]
            assert "no verdict on its host commit" in (outgoing[0].error or "")
            assert "did not commit this rank's part" in str(failed.value)
        else:
            assert rounds == []
        assert (link.disabled is not None) == (verdict is None)
        if verdict is None:
            assert "had no verdict on step 7's host commit" in str(failed.value)
            assert "disabled until the job restarts" in str(failed.value)
            assert "no verdict on step 7" in kv.data["snapcore/peer/disabled"].decode()
            assert link.off()  # reported once: later saves leave the peer tier out
        else:
            assert "snapcore/peer/disabled" not in kv.data and not link.off()
    finally:
        link.close()


def test_a_replaced_nodes_fetch_receives_into_the_memory_prepare_faulted_in(
    host_name: str,
) -> None:
    from snapcore.peer.area import drop_mappings, holds_mapping
    from snapcore.peer.restore import reserve, reserved
    from snapcore.tiers import HostTier

    store = snapcore.Store(host=host_name, peer=True)
    root = HostTier(host_name).root
    try:
        path = reserve(store, 1, 4096)
        assert path == root / "slot-r1-0.bin" and path.stat().st_blocks * 512 >= 4096
        inode = path.stat().st_ino
        assert reserve(store, 1, 4096) is None  # made once
        assert holds_mapping(path)  # kept mapped, for the fetch to receive into
        copy, data = make_copy(5)  # the part names slot 1: the reserved file is renamed
        dest = Destination(root, step=5, rank=1, commit_index=False, reserved=reserved(store, 1))
        dest.prepare(copy.meta())
        # the fetch took that mapping (not mapped anew), under the file's new name
        assert not holds_mapping(path) and not holds_mapping(root / "slot-r1-1.bin")
        dest.write(0, 0, torch.frombuffer(bytearray(data), dtype=torch.uint8))
        dest.finish()
        dest.write_index()
        got = root / "slot-r1-1.bin"
        assert got.stat().st_ino == inode and not path.exists()
        assert got.read_bytes() == data and got.stat().st_size == 128
        # an area that holds a snapshot is never reserved into
        assert reserve(store, 1, 4096) is None and reserved(store, 1) == []
        dest.release()
    finally:
        drop_mappings()
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("how", ["area_removed", "file_replaced", "file_truncated"])
def test_a_held_mapping_of_a_file_since_replaced_is_not_received_into(
    host_name: str, how: str
) -> None:
    """``prepare()`` holds the mapping of the file it faulted in; if that file is removed
    (the area cleared) or replaced by another at the same path before the restore, the
    fetch must receive into the file it commits, not into the old file's orphaned memory:
    the committed copy holds the bytes that arrived (failed before: it held zeros). The
    same file cut to nothing meanwhile is extended again before the mapping is touched
    (no SIGBUS)."""
    from snapcore.peer.area import drop_mappings, holds_mapping
    from snapcore.peer.restore import reserve, reserved
    from snapcore.tiers import HostTier

    store = snapcore.Store(host=host_name, peer=True)
    root = HostTier(host_name).root
    try:
        path = reserve(store, 1, 4096)
        assert path == root / "slot-r1-0.bin" and holds_mapping(path)
        if how == "area_removed":
            shutil.rmtree(root)
            root.mkdir(parents=True)
        elif how == "file_replaced":
            path.unlink()
            path.write_bytes(b"\0" * 4096)  # another file at the same path
        else:  # the same file, cut under the mapping: taken, and no access past its end
            os.truncate(path, 0)
        copy, data = make_copy(4)  # names slot-r1-0.bin, the path the mapping was held for
        dest = Destination(root, step=4, rank=1, commit_index=False, reserved=reserved(store, 1))
        dest.prepare(copy.meta())
        dest.write(0, 0, torch.frombuffer(bytearray(data), dtype=torch.uint8))
        dest.finish()
        dest.release()
        assert not holds_mapping(path)
        assert path.read_bytes() == data
    finally:
        drop_mappings()
        shutil.rmtree(root, ignore_errors=True)


def test_a_held_mapping_no_fetch_took_is_given_back_when_the_store_closes(
    host_name: str,
) -> None:
    """A mapping ``prepare()`` held for a fetch that never came (no restore) is unmapped
    when the store's engine closes: else the reserved memory would stay taken by this
    process even once the area is freed (failed before: held until the process ends)."""
    from snapcore.peer.area import drop_mappings, holds_mapping
    from snapcore.peer.restore import reserve
    from snapcore.tiers import HostTier
    from snapcore.write.engine import engine_for

    store = snapcore.Store(host=host_name, peer=True)
    root = HostTier(host_name).root
    try:
        engine_for(store)
        path = reserve(store, 1, 4096)
        assert path is not None and holds_mapping(path)
        snapcore.close()
        assert not holds_mapping(path) and path.exists()  # the file stays
        # nor is it kept once the area is saved into (the first save gives it back)
        path.unlink()
        path = reserve(store, 1, 4096)
        assert path is not None and holds_mapping(path)
        snapcore.async_save({"w": torch.ones(4)}, store, step=1, tiers=["host"]).wait()
        assert not holds_mapping(path)
        assert snapcore.load(store, step=1)["w"].tolist() == [1.0] * 4
        snapcore.close()
    finally:
        drop_mappings()
        shutil.rmtree(root, ignore_errors=True)


def test_a_fetch_cut_short_into_a_held_mapping_commits_nothing_and_unmaps_it(
    host_name: str,
) -> None:
    """A fetch that took ``prepare()``'s mapping and fails midway commits no part (its
    file is left to be overwritten) and unmaps that mapping; a later fetch maps anew."""
    from snapcore.peer.area import drop_mappings, holds_mapping
    from snapcore.peer.restore import reserve, reserved
    from snapcore.tiers import HostTier

    store = snapcore.Store(host=host_name, peer=True)
    root = HostTier(host_name).root
    try:
        path = reserve(store, 1, 4096)
        assert path is not None and holds_mapping(path)
        copy, data = make_copy(4)  # names the reserved file
        dest = Destination(root, step=4, rank=1, commit_index=False, reserved=reserved(store, 1))
        dest.prepare(copy.meta())
        assert not holds_mapping(path) and dest._maps[0] is not None  # taken
        dest.write(0, 0, torch.frombuffer(bytearray(data[:40]), dtype=torch.uint8))
        with pytest.raises(InvalidManifest, match="did not arrive whole"):
            dest.finish()
        assert dest._maps == [] and not (root / copy.part_name).exists()
        again = Destination(root, step=4, rank=1, commit_index=False, reserved=reserved(store, 1))
        again.prepare(copy.meta())
        again.write(0, 0, torch.frombuffer(bytearray(data), dtype=torch.uint8))
        again.finish()
        again.release()
        assert (root / copy.part_name).exists() and path.read_bytes() == data
    finally:
        drop_mappings()
        shutil.rmtree(root, ignore_errors=True)


def test_a_round_whose_partner_gave_up_is_abandoned_and_what_gloo_holds_is_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A partner that is alive but gave up the round (its own partner died) never
    completes this rank's operations: the round asks the job's store (``stop``) while it
    waits and gives up once the peer tier is disabled elsewhere, instead of waiting for
    the group's timeout. What gloo may still touch (the operations, with their buffers)
    is kept, never freed under it."""
    import threading
    import time

    import torch.distributed as dist

    from snapcore.peer import wire
    from snapcore.peer.wire import Outgoing, PeerLinkError, exchange

    release = threading.Event()

    class Pending:  # an operation whose partner never takes part
        def wait(self) -> bool:
            release.wait()
            return True

    posted: list[Pending] = []

    def post(*a: Any, **k: Any) -> Pending:
        posted.append(Pending())
        return posted[-1]

    monkeypatch.setattr(dist, "isend", post)
    monkeypatch.setattr(dist, "irecv", post)
    t0 = time.monotonic()
    asked: list[float] = []

    def stop() -> str | None:
        asked.append(time.monotonic() - t0)
        return "partner rank(s) [2] lost at step 7" if len(asked) >= 3 else None

    try:
        with pytest.raises(PeerLinkError, match=r"gave up .* disabled on another rank"):
            exchange(None, [Outgoing(1, None, [], "none")], [], piece_bytes=1 << 20, stop=stop)
        assert time.monotonic() - t0 < 5 and len(asked) == 3
        assert posted and all(any(p is k for k in wire._kept) for p in posted)
    finally:
        release.set()
