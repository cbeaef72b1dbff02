"""The peer tier on the save path: after a step commits in host memory, each rank's part
goes to its partners, on a thread of its own (``snapcore-peer``), over snapcore's peer
group.

The group and the ring are made once per job (``connect``): a collective on the
training thread, at the first sharded save or restore of a store with a peer tier, which
every rank makes (as snapcore's job itself is made). After that, nothing on the training
thread is a collective: the transfers are point-to-point sends and receives between
partners, on the peer thread, on a gloo group that neither the training nor snapcore's
commit uses, in the order of the saves (every rank transfers the saves that committed in
host memory, which every rank learns alike from the coordinator's verdict; a rank whose
own part of such a step failed after the verdict sends "no copy" and still receives; a
rank that had no verdict in time asks for it once more, and disables the peer tier if it
still cannot tell whether the others run the round).

One transfer at a time per rank; the slot it reads stays reserved until it is done, so
a rank is never more than two snapshots behind (the next save after that waits for the
slot, as it waits for a slow local disk). ``PeerSpec.max_bytes_per_s`` paces it.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from .. import manifest, settings
from ..distributed.job import Job, all_gather_bytes, kv_get
from ..errors import SnapcoreError, SnapshotFailed
from ..staging.handle import SaveHandle
from ..tiers import HostTier, PeerSpec, Store
from .area import Budget, Copy, Destination, PeerArea, PeerCopies, peer_root
from .topology import Home, Topology
from .wire import Incoming, Outgoing, PeerLinkError, exchange

log = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = [
    "Connection",
    "PeerLink",
    "connect",
    "peer_copies",
    "peer_identity",
    "warm_parser",
]


@dataclass
class Connection:
    """The peer group of a job and its ring."""

    job: Job
    group: Any
    topology: Topology
    timeout_s: float


_connections: dict[tuple[int, str | None, int], Connection] = {}
_lock = threading.Lock()


_warming: threading.Thread | None = None


def warm_parser() -> None:
    """Compile the manifest parser (about 40 ms of pure Python at its first use in a
    process) on a thread of its own, once per process: the first transfer or fetch
    parses copies' manifests, and would otherwise compile it on its path (a restore's
    fetch, on both ranks). Called before the link's collective (which waits for the
    other ranks, a replaced node the last of them) and by ``prepare``."""
    global _warming
    with _lock:
        if _warming is None:
            _warming = threading.Thread(
                target=manifest.compile_validators, name="snapcore-peer-warm", daemon=True
            )
            _warming.start()


def connect(job: Job, store: Store) -> Connection:
    """The peer group and ring of ``job`` for ``store`` (made at the first call: a
    collective every rank makes). Raises ``ValueError`` when the job has one node."""

    warm_parser()
    spec = store.peer_spec
    assert spec is not None
    key = (id(job), store.host, spec.k)
    with _lock:
        conn = _connections.get(key)
        if conn is None:
            conn = _connections[key] = _make(job, store, spec)
    topo = conn.topology
    if len(topo.nodes) < 2:  # said at every call: no save may count a peer tier it lacks
        raise ValueError(
            f"{store.describe()}: the peer tier needs a job of two nodes or more (nodes are "
            "told apart by host name and host-memory area); this job has one"
        )
    return conn


def _make(job: Job, store: Store, spec: PeerSpec) -> Connection:
    """Gather every rank's home, make the ring and the peer group (a collective). A rank
    that cannot say its home or read its settings sends its error instead: every rank
    raises then, that rank its own error, the others one naming it (of the same kind when
    it is a ``ValueError``, which a restore passes over as "no peer tier" on every rank),
    rather than leave the others in the exchange or in the group's making."""
    import torch.distributed as dist

    try:
        mine: Any = Home(job.host, store.host, settings.failure_domain()).to_json()
        timeout = settings.peer_timeout_s()
        error: Exception | None = None
    except Exception as e:
        mine, timeout, error = None, 0.0, e
    said = {"home": mine, "error": None if error is None else [type(error).__name__, str(error)]}
    every = [json.loads(b) for b in all_gather_bytes(job, json.dumps(said).encode())]
    if error is not None:
        raise error
    failed = [(r, d["error"]) for r, d in enumerate(every) if d["error"] is not None]
    if failed:
        r, (kind, why) = failed[0]
        message = f"{store.describe()}: rank {r} cannot join the peer tier: {kind}: {why}"
        raise ValueError(message) if kind == "ValueError" else SnapcoreError(message)
    homes = [Home.from_json(d["home"]) for d in every]
    topo = Topology(homes, spec.k)
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
    if spec.k > len(topo.nodes) - 1:
        log.warning(
            "PeerSpec(k=%d): only %d other node(s) in this job", spec.k, len(topo.nodes) - 1
        )
    return Connection(job, group, topo, timeout)


def peer_identity(store: Store, world_size: int) -> dict[str, Any]:
    """What a peer namespace records of whose copies it holds."""
    return {"store": store.identity(), "world_size": world_size}


class PeerLink:
    """One engine's peer tier: its thread and what it needs to send and receive."""

    def __init__(self, conn: Connection, store: Store) -> None:
        assert store.host is not None and store.peer_spec is not None
        self.conn = conn
        self.store = store
        self.spec: PeerSpec = store.peer_spec
        self.area = HostTier(store.host).root
        self.rank = conn.job.rank
        self.identity = peer_identity(store, conn.job.world_size)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="snapcore-peer")
        self._notes: list[str] = []  # failures of background rounds, for the next handle
        self._notes_lock = threading.Lock()
        # Why the peer tier is off until the job restarts (a partner lost: gloo does not
        # recover a pair), once a round failed here or on another rank; and whether a
        # handle of this rank has failed with it (later saves then leave the tier out).
        self.disabled: str | None = None
        self.reported = False

    def off(self) -> bool:
        """Whether this rank's saves leave the peer tier out: it is disabled and a handle
        of this rank has failed with the reason (reported once; later saves go on)."""
        return self.disabled is not None and self.reported

    def disable(self, why: str) -> None:
        """The peer tier is off until the job restarts; the other ranks learn it from the
        job's store at their next round, instead of waiting for this rank in vain."""
        if self.disabled is not None:
            return
        self.disabled = why
        log.error("the peer tier is disabled until the job restarts: %s", why)
        with contextlib.suppress(Exception):  # rank 0's store may be gone with its rank
            job = self.conn.job
            job.kv.compare_set(job.key("peer", "disabled"), "", why)

    def _disabled_elsewhere(self) -> str | None:
        with contextlib.suppress(Exception):
            job = self.conn.job
            key = job.key("peer", "disabled")
            if job.kv.check([key]):
                return bytes(job.kv.get(key)).decode(errors="replace")
        return None

    def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the peer thread (the one user of the peer group) and wait."""
        return self.pool.submit(fn).result()

    def background(self, fn: Callable[[], list[str]]) -> None:
        """Queue ``fn`` on the peer thread; the failures it returns are logged and
        warned on the next snapshot's handle."""

        def call() -> None:
            try:
                notes = fn()
            except Exception as e:
                notes = [f"peer tier: {type(e).__name__}: {e}"]
            for note in notes:
                log.warning("%s", note)
            with self._notes_lock:
                self._notes.extend(notes)

        self.pool.submit(call)

    def drain(self) -> None:
        """Wait for what is queued on the peer thread."""
        with contextlib.suppress(RuntimeError):  # shut down: nothing is queued
            self.pool.submit(lambda: None).result()

    def submit(
        self,
        handle: SaveHandle,
        step: int,
        index_key: str,
        verdict: Callable[[], bool | None] | None = None,
    ) -> Future[None]:
        """Send this rank's part of ``step`` (committed in host memory) to its partners
        and receive its sources' parts; resolves ``handle``'s peer tier. ``verdict``:
        this rank had no host verdict on ``step`` in time; asked on the peer thread, it
        says whether the other ranks run the round (True: committed; False: not; None:
        still unknown)."""
        return self.pool.submit(self._run, handle, step, index_key, verdict)

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    def _run(
        self,
        handle: SaveHandle,
        step: int,
        index_key: str,
        verdict: Callable[[], bool | None] | None = None,
    ) -> None:
        with self._notes_lock:
            earlier, self._notes = self._notes, []
        for note in earlier:
            handle.warn(note)
        if self.disabled is None and (why := self._disabled_elsewhere()) is not None:
            self.disable(why)
        if self.disabled is not None and self.reported:
            # Told on an earlier handle of this rank (a save queued before that report,
            # two saves in flight): this one just has no peer tier, as the later ones.
            handle.leave_out(
                "peer", f"the peer tier is disabled until the job restarts: {self.disabled}"
            )
            return
        if self.disabled is not None:
            self.reported = True
            handle.resolve(
                "peer",
                SnapshotFailed(
                    f"step {step}: the peer tier is disabled until the job restarts: "
                    f"{self.disabled}; the other tiers go on, and later saves leave the "
                    "peer tier out",
                    step=step,
                    tier="peer",
                ),
            )
            return
        unsent = None
        if verdict is not None and (unsent := self._without_verdict(handle, step, verdict)) is None:
            return
        topo = self.conn.topology
        partners, sources = topo.partners(self.rank), topo.sources(self.rank)
        outgoing = [
            self._outgoing(p, step, index_key) if unsent is None else Outgoing(p, None, [], unsent)
            for p in partners
        ]
        cap = self.spec.max_bytes  # over every source's copies together
        budget = None if cap is None else Budget(cap, [peer_root(self.area, s) for s in sources])
        incoming = [
            Incoming(
                s,
                Destination(
                    peer_root(self.area, s),
                    step=step,
                    rank=s,
                    identity=self.identity,
                    budget=budget,
                ),
            )
            for s in sources
        ]
        try:
            sent, got = exchange(
                self.conn.group,
                outgoing,
                incoming,
                piece_bytes=self.spec.piece_bytes,
                rate=self.spec.max_bytes_per_s,
                stop=self._disabled_elsewhere,  # a partner gave up: do not wait in vain
            )
        except PeerLinkError as e:
            for s in sources:
                handle.warn(self._kept(s, step, f"the copy of rank {s}'s part was lost: {e}"))
            peers = sorted(set(partners) | set(sources))
            self.disable(f"partner rank(s) {peers} lost at step {step} ({e})")
            self.reported = True
            handle.resolve(
                "peer",
                SnapshotFailed(
                    f"step {step}: the peer tier failed: {e}; the partners keep their "
                    "previous copies. The peer tier is disabled until the job restarts "
                    "(gloo does not recover a pair); the other tiers go on, and later "
                    "saves leave the peer tier out",
                    step=step,
                    tier="peer",
                ),
            )
            return
        for i in incoming:
            i.dest.release()  # the copies are committed: their mappings can go
            for note in i.dest.notes:
                handle.warn(f"peer tier: {note}")
        for s, why in got.items():
            if why is not None:
                handle.warn(self._kept(s, step, f"rank {s}'s part was not received: {why}"))
        failed = {d: why for d, why in sent.items() if why is not None}
        if failed:
            d, why = next(iter(failed.items()))
            handle.resolve(
                "peer",
                SnapshotFailed(
                    f"step {step}: the peer tier failed: partner rank {d} did not commit this "
                    f"rank's part: {why}",
                    step=step,
                    tier="peer",
                ),
            )
            return
        copy = outgoing[0].copy if outgoing else None
        handle.stats.written["peer"] = sum(n for _, n in copy.files) * len(sent) if copy else 0
        handle.resolve("peer")

    def _without_verdict(
        self, handle: SaveHandle, step: int, verdict: Callable[[], bool | None]
    ) -> str | None:
        """A rank that had no host verdict on ``step`` within the commit timeout does not
        know whether the other ranks run the step's round. Asked once more: committed,
        the round runs, this rank sending no copy (the reason returned), so that its
        partners are not left waiting; not committed, no rank runs it (None, the handle
        resolved); still unknown, the rounds can no longer be kept in step: the peer tier
        is disabled (the partners waiting in the round learn it from the job's store, and
        give up at once) and None."""
        ok = verdict()
        if ok:
            return (
                f"rank {self.rank} sends no copy of step {step}: it had no verdict on its host "
                "commit from the coordinator in time"
            )
        if ok is None:
            why = (
                f"rank {self.rank} had no verdict on step {step}'s host commit from the "
                "coordinator (rank 0) in time: whether its partners run the step's round is "
                "unknown"
            )
            self.disable(why)
            self.reported = True
            message = (
                f"step {step}: not sent to the peer tier: {why}. The peer tier is disabled "
                "until the job restarts; the other tiers go on, and later saves leave the "
                "peer tier out"
            )
        else:
            message = f"step {step}: not sent to the peer tier: not committed in host memory"
        handle.resolve("peer", SnapshotFailed(message, step=step, tier="peer"))
        return None

    def _outgoing(self, dst: int, step: int, index_key: str) -> Outgoing:
        try:
            data = kv_get(self.conn.job, index_key, self.conn.timeout_s)
            if data is None:
                raise SnapcoreError(f"the index of step {step} did not arrive from rank 0")
            index = Copy.index_of(data)
            name = index.parts[self.rank].name
            copy = Copy(self.rank, data, name, (self.area / name).read_bytes())
        except (SnapcoreError, OSError, IndexError) as e:
            return Outgoing(dst, None, [], f"{type(e).__name__}: {e}")
        return Outgoing(dst, copy, [self.area / n for n, _ in copy.files])

    def _kept(self, source: int, step: int, what: str) -> str:
        held = PeerArea(self.area, source).committed_steps(self.identity)
        kept = f"the copy of step {held[-1]} stays" if held else "no older copy is held"
        return f"peer tier, step {step}: {what} ({kept})"


def open_link(job: Job, store: Store) -> PeerLink:
    """The peer tier of an engine: connects (a collective) and starts its thread."""
    return PeerLink(connect(job, store), store)


def peer_copies(store: Store) -> PeerCopies | None:
    """The copies this node holds of other ranks' parts, as a read-only tier; None when
    the store has no peer tier or no job runs."""
    import torch.distributed as dist

    from ..distributed.job import initialized

    # not current(): its first call is a collective, and a load may run on one rank alone
    if store.peer_spec is None or store.host is None or not initialized():
        return None
    return PeerCopies(area_root(store), peer_identity(store, dist.get_world_size()))


def area_root(store: Store) -> Path:
    assert store.host is not None
    return HostTier(store.host).root
