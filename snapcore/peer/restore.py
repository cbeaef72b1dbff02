"""The peer tier at restore: a replaced node gets its ranks' parts back from its
partners' memory, before the restore's agreement on a step.

Every rank says what it holds (its node-local steps, the remote's, and the copies it
holds of other ranks' parts); the step taken is the newest that every rank can get
whole from some tier or some partner. A rank that lacks it in its node's tiers receives
its part from a partner holding a copy (gloo point-to-point at restore time, on the
training thread, where a collective is fine), into its own host-memory area, where it is
committed as a host snapshot once every such rank of its node has its part: the node
holds its own copy again, and the restore then reads it like any host snapshot. Then
each rank whose partner lacks a copy of that step sends one (the re-send), in the
background on the peer thread, ahead of the next snapshot's transfer. A copy that fails to arrive is
reported (``RestoreInfo.damaged``) and the restore falls back to what the other tiers
hold; a fetch round that fails in transport (a partner lost) disables the peer tier on
every rank, as a failed save round does, and no re-send runs on the broken group.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..distributed.job import Job, all_gather_bytes
from ..errors import SnapcoreError
from ..tiers import HostTier, Store
from . import wire
from .area import Budget, Copy, Destination, PeerArea, drop_mappings, hold_mapping, peer_root
from .link import PeerLink, area_root, peer_identity
from .wire import Incoming, Outgoing, PeerLinkError, exchange

log = logging.getLogger(__name__)

__all__ = ["Fetched", "prepare_restore", "reserve"]

# The stages' times of this process's last fetch (benchmarks/bench_peer.py reports them).
last_fetch: dict[str, float] = {}

_SOURCE = re.compile(r"^r(\d{1,7})$")


def held_copies(store: Store, world_size: int) -> dict[int, list[int]]:
    """The committed copies this node's area holds, per source rank (of this store)."""
    area = area_root(store)
    identity = peer_identity(store, world_size)
    out: dict[int, list[int]] = {}
    try:
        entries = os.listdir(area / "peer")
    except (FileNotFoundError, NotADirectoryError):
        return out
    for entry in entries:
        m = _SOURCE.match(entry)
        if m and int(m.group(1)) < world_size:
            steps = PeerArea(area, int(m.group(1))).committed_steps(identity)
            if steps:
                out[int(m.group(1))] = steps
    return out


@dataclass
class Fetched:
    """What the peer tier did for a restore on this rank."""

    bytes: int = 0  # of this rank's part, received from a partner's memory
    seconds: float = 0.0  # the time that took (the whole round, with its checks)
    notes: list[str] = field(default_factory=list)  # what failed (the restore goes on)
    ranks: list[int] = field(default_factory=list)  # the job's ranks that got their part


def prepare_restore(
    store: Store, steps: dict[str, list[int]], job: Job, step: int | None, link: PeerLink
) -> Fetched:
    """``fetch_and_resend``; then the mappings ``prepare()`` held for a fetch and the
    fetch did not take are dropped (their files stay)."""
    try:
        return _fetch_and_resend(store, steps, job, step, link)
    finally:
        drop_mappings()


def _fetch_and_resend(
    store: Store, steps: dict[str, list[int]], job: Job, step: int | None, link: PeerLink
) -> Fetched:
    """Fetch the parts this node lacks of the step every rank can restore, from the
    partners' copies (collective: every rank calls it), then queue the re-send of the
    copies the partners lack. The rounds run on ``link``'s thread, the one user of the
    peer group."""
    conn = link.conn
    topo, rank, world = conn.topology, job.rank, job.world_size
    spec = store.peer_spec
    assert spec is not None
    area = area_root(store)
    host = HostTier(store.host or "")
    writable = host.identity() in (None, store.identity())
    mine = {
        "host": sorted(steps.get("host", [])),
        "own": sorted(set(steps.get("host", [])) | set(steps.get("local", []))),
        "remote": sorted(steps.get("remote", [])),
        "held": {str(r): ss for r, ss in held_copies(store, world).items()},
        "writable": writable,
        "disabled": link.disabled,
    }
    every = [json.loads(b) for b in all_gather_bytes(job, json.dumps(mine).encode())]
    off = [(r, e["disabled"]) for r, e in enumerate(every) if e["disabled"]]
    if off:  # the peer group is broken (a partner lost): no rank talks over it
        r, why = off[0]
        note = f"peer: the peer tier is disabled until the job restarts (rank {r}: {why})"
        log.warning("%s", note)
        return Fetched(notes=[note])

    def holders(r: int, s: int) -> list[int]:
        return [h for h in range(world) if s in every[h]["held"].get(str(r), [])]

    avail = []
    for r in range(world):
        a = set(every[r]["own"]) | set(every[r]["remote"])
        for h in range(world):
            a |= set(every[h]["held"].get(str(r), []))
        avail.append(a)
    common = set.intersection(*avail) if avail else set()
    target = step if step is not None else max(common, default=None)
    if target is None or target not in common:
        return Fetched()
    fetch = {
        r: min(holders(r, target))
        for r in range(world)
        if target not in every[r]["own"] and holders(r, target) and every[r]["writable"]
    }
    out = Fetched()
    notes = out.notes
    dest: Destination | None = None
    ok = True
    said: list[dict[str, bool]] = [{"ok": False}] * world
    if fetch:
        if rank in fetch and host.identity() is None:
            host.claim(store.identity())  # a replaced node's fresh area becomes this store's
        outgoing = [
            _read_copy(peer_root(area, r), target, r, dst=r) for r, h in fetch.items() if h == rank
        ]
        incoming = []
        if rank in fetch:
            dest = Destination(
                area, step=target, rank=rank, commit_index=False, reserved=reserved(store, rank)
            )
            incoming.append(Incoming(fetch[rank], dest))
        t0 = time.perf_counter()
        sent, got, failure = link.run(
            lambda: _round(conn.group, outgoing, incoming, spec.piece_bytes, link)
        )
        out.seconds = time.perf_counter() - t0
        if dest is not None:  # unmapped on the peer thread while the restore goes on
            link.background(_releasing(dest))
        last_fetch.clear()
        last_fetch.update(wire.last_round)
        if failure:  # the peer group is broken, as after a failed save round
            link.disable(f"a partner lost in the fetch of step {target} ({failure})")
            notes.append(
                f"peer: step {target}: {failure}; the peer tier is disabled until the job restarts"
            )
        for r, why in sent.items():
            if why is not None:
                notes.append(f"peer: step {target}: rank {r} did not take its part back: {why}")
        if rank in fetch:
            why = got.get(fetch[rank], failure or "not received")
            ok = why is None and failure is None
            if ok:
                assert dest is not None and dest.copy is not None
                out.bytes = sum(n for _, n in dest.copy.files)
            else:
                notes.append(
                    f"peer: step {target}: this rank's part from rank {fetch[rank]}'s memory: {why}"
                )
        # The node's copy is committed once every rank of it that fetched has its part;
        # a rank whose round failed says so: no rank then queues anything on the group.
        mine_now = {"ok": ok, "disabled": link.disabled}
        said = [json.loads(b) for b in all_gather_bytes(job, json.dumps(mine_now).encode())]
        off = [(r, d["disabled"]) for r, d in enumerate(said) if d["disabled"]]
        if off and link.disabled is None:
            link.disable(f"rank {off[0][0]}: {off[0][1]}")
            notes.append(f"peer: the peer tier is disabled until the job restarts: {link.disabled}")
        out.ranks = sorted(r for r in fetch if said[r]["ok"])
        if rank in fetch and ok:
            node = [r for r in topo.nodes[topo.node_of[rank]] if r in fetch]
            if all(said[r]["ok"] for r in node) and rank == min(node):
                assert dest is not None
                dest.write_index()
        all_gather_bytes(job, b"")  # the node's index is there before any rank lists
    # The re-send: each rank whose partners lack a copy of the step sends them one.
    has_host = [target in every[r]["host"] or (r in fetch and said[r]["ok"]) for r in range(world)]
    pairs = [
        (r, p)
        for r in range(world)
        if has_host[r]
        for p in topo.partners(r)
        if target not in every[p]["held"].get(str(r), [])
    ]
    if pairs and link.disabled is None:
        identity = peer_identity(store, world)
        cap = spec.max_bytes  # over every source's copies together
        roots = [peer_root(area, s) for s in topo.sources(rank)]
        budget = None if cap is None else Budget(cap, roots)
        outgoing = []
        for r, p in pairs:
            if r != rank:
                continue
            if dest is not None and dest.copy is not None and ok:
                copy = dest.copy
                outgoing.append(Outgoing(p, copy, [area / n for n, _ in copy.files]))
            else:
                outgoing.append(_read_copy(area, target, rank, dst=p))
        incoming = [
            Incoming(
                r,
                Destination(
                    peer_root(area, r),
                    step=target,
                    rank=r,
                    identity=identity,
                    budget=budget,
                ),
            )
            for r, p in pairs
            if p == rank
        ]

        def resend() -> list[str]:
            if link.disabled is not None:  # since queued: nothing more runs on the group
                return []  # (the next snapshot's handle reports it)
            sent, got, failure = _round(conn.group, outgoing, incoming, spec.piece_bytes, link)
            for i in incoming:
                i.dest.release()
            if failure:
                link.disable(f"a partner lost in the re-send of step {target} ({failure})")
            return [
                f"peer tier: the re-send of step {target}'s copies with rank {who} after the "
                f"restore failed: {failure or why} (the next snapshot sends again)"
                for who, why in [*sent.items(), *got.items()]
                if why is not None or failure
            ]

        # On the peer thread, while the restore reads and training starts: the next
        # snapshot's transfer comes after it on the same thread, so that snapshot's peer
        # tier is durable only once the partners hold copies again.
        link.background(resend)
    for note in notes:
        log.warning("%s", note)
    return out


def _releasing(dest: Destination) -> Callable[[], list[str]]:
    def release() -> list[str]:
        dest.release()
        return []

    return release


def _read_copy(root: Path, step: int, rank: int, *, dst: int) -> Outgoing:
    try:
        copy = Copy.read(root, step, rank)
    except (SnapcoreError, OSError) as e:
        return Outgoing(dst, None, [], f"{type(e).__name__}: {e}")
    return Outgoing(dst, copy, [root / n for n, _ in copy.files])


def _round(
    group: Any, outgoing: list[Outgoing], incoming: list[Incoming], piece: int, link: PeerLink
) -> tuple[dict[int, str | None], dict[int, str | None], str | None]:
    try:
        sent, got = exchange(
            group, outgoing, incoming, piece_bytes=piece, stop=link._disabled_elsewhere
        )
    except PeerLinkError as e:
        return {}, {}, str(e)
    return sent, got, None


def reserve(store: Store, rank: int, size: int) -> Path | None:
    """A replaced node's ranks fault in, ahead of the restore (``snapcore.prepare``, while
    the model is built), the memory their parts will be fetched into: the rank's first
    host slot file, of ``size`` bytes. The fetch renames it to the slot file the part
    names and cuts it to the part's size (or extends it: the rest is faulted on the
    way). Memory touched for the first time fills several times slower than the network
    brings a part; faulted here, the fetch receives into memory faulted once. Only in an
    area that holds no committed snapshot (a fresh one, or this store's, empty), where
    nothing is overwritten. Returns the file, or None when the area is not fresh."""
    from .. import _native, settings

    host = HostTier(store.host or "")
    if host.identity() not in (None, store.identity()) or host.committed_steps():
        return None
    host.rank = rank
    path = host.slot_path(0)
    if path.exists():
        return None  # an engine's arena, or a reservation already made
    host.root.mkdir(parents=True, exist_ok=True)
    arena = _native.Arena(
        size,
        shm_path=str(path),
        huge_pages=False,
        pin=False,
        prefault=True,
        threads=settings.threads(),
    )
    hold_mapping(path, arena)  # the fetch receives into this mapping (or drops it)
    return path


def reserved(store: Store, rank: int) -> list[Path]:
    """The slot files of ``rank`` in a host area that holds no committed snapshot: memory
    faulted ahead (``reserve``) that a fetch may receive into."""
    host = HostTier(store.host or "")
    if host.committed_steps():
        return []
    host.rank = rank
    return [p for p in (host.slot_path(i) for i in range(host.SLOTS)) if p.exists()]
