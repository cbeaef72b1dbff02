"""The save path's conductor: stage tensors into a host arena on the caller's thread, then
hand the snapshot to the persist thread (host memory, local disk) and the upload thread
(object storage).

One ``Engine`` per store owns its arenas (allocated and faulted once, reused), its
threads, and the handles of snapshots in flight. With a host-memory tier there are two
arena slots in /dev/shm, so a new snapshot is staged while the previous one is still being
written, and the last committed one is not overwritten: a save that reuses a slot waits
first, at most the commit timeout, for the other slot's host commit (``_await_other_slot``).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from .. import manifest as mf
from .. import settings
from ..distributed.job import Job, initialized
from ..distributed.job import current as current_job
from ..distributed.job import forget as forget_job
from ..errors import SnapcoreError, SnapshotFailed, UnsupportedState
from ..io_types import Aborted, WindowItem
from ..peer import PeerLink, open_link
from ..peer.area import drop_mappings
from ..peer.link import warm_parser
from ..peer.restore import reserve as reserve_peer_fetch
from ..planning.layout import Layout, align_up, plan
from ..staging import h2d
from ..staging.arena import HostArena, pin_device
from ..staging.copy import Stager, refuse_overlap_in_graph_capture
from ..staging.handle import SaveHandle, SaveStats
from ..tiers import TIER_ORDER, HostTier, LocalTier, Store, Tier, as_store, on_store_exit
from ..tree import Flattened, flatten, is_dtensor, local_shard
from . import writer_lock
from .chunks import ChunkIndex
from .commit import ShardedSave, index_key
from .job import PersistJob
from .local import PAGE
from .sharded import Sharder

log = logging.getLogger(__name__)

MIN_WINDOW = 8 << 20  # the smallest streaming window: the "small constant buffers"

__all__ = ["Engine", "SaveHandle", "SaveStats", "close_all", "close_store", "engine_for"]


class Engine:
    """Saves to one store (its tiers); thread-safe, snapshots in order."""

    encode_ahead = 4

    def __init__(self, store: Store) -> None:
        self.config = store
        self.host = HostTier(store.host) if store.host else None
        self.local = LocalTier(store.local) if store.local else None
        self.remote: Any = None
        if store.remote:
            from ..tiers import RemoteStoreTier

            self.remote = RemoteStoreTier(store.remote, store.storage_options)
        self.remote_url = store.remote
        self._claimed = False  # the host area is claimed by the first save, never by reads
        self.slots = 2 if self.host is not None else 1
        self.arenas: list[HostArena | None] = [None] * self.slots
        self._slot_free: list[Future[None] | None] = [None] * self.slots
        self._lock = threading.Lock()
        self._persist = ThreadPoolExecutor(1, thread_name_prefix="snapcore-persist")
        self.hasher = ThreadPoolExecutor(1, thread_name_prefix="snapcore-hash")
        self.uploader = ThreadPoolExecutor(1, thread_name_prefix="snapcore-upload")
        self._encoder: ThreadPoolExecutor | None = None
        self._preparer: ThreadPoolExecutor | None = None
        self._handles: list[SaveHandle] = []
        self.stager = Stager()
        self.index = ChunkIndex(self.tier)  # where each tier stores each chunk content
        self.uploading: set[int] = set()  # steps whose local files the uploader still needs
        self._remote_collected = False
        self._slot_steps: list[set[int]] = [set(), set()]  # host steps held by each slot
        self._slot_last: int | None = None  # the slot staged into last
        # a sharded save made by the last call, which then raised an earlier failure
        self._made: SaveHandle | None = None
        self._slot_handle: list[SaveHandle | None] = [None, None]  # the last save of each
        self._writer_lock: str | None = None  # the lock file this engine holds (a share)
        self._sharder: Sharder | None = None  # the save plan, under torch.distributed
        self._eid = 0  # this engine's number in the job's key space (write/commit.py)
        self.peer: PeerLink | None = None  # the peer tier (snapcore/peer), under a job
        self._reserving: Future[None] | None = None  # prepare(): a peer fetch's memory

    @property
    def local_root(self) -> Path:
        assert self.local is not None
        return self.local.root

    @property
    def sharder(self) -> Sharder | None:
        """The save plan of this store under torch.distributed (None before a sharded
        save)."""
        return self._sharder

    def made(self, step: int) -> SaveHandle | None:
        """The handle of the sharded save of ``step`` that the last call made before it
        raised an earlier snapshot's failure (``_sharded_save``), or None: the caller that
        wants to follow that save takes it here instead of saving again."""
        made = self._made
        return made if made is not None and made.step == step else None

    def tier(self, name: str) -> Tier:
        return {"host": self.host, "local": self.local, "remote": self.remote}[name]

    def host_readable(self) -> bool:
        """Whether the host area holds this store's snapshots (not another run's)."""
        return self.host is not None and self.host.holds(self.config.identity())

    # -- public ---------------------------------------------------------------------------
    def async_save(
        self,
        state: object,
        step: int,
        *,
        overlap: bool = False,
        budget: int | None = None,
        tiers: Iterable[str] | None = None,
    ) -> SaveHandle:
        t0 = time.perf_counter()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative int, not {step!r}")
        if overlap:
            refuse_overlap_in_graph_capture()
        want = self._wanted(tiers)
        djob = current_job()  # under torch.distributed: a sharded save (a collective, once)
        if "peer" in want and djob is None:
            raise ValueError(
                f"{self.config.describe()}: the peer tier needs a torch.distributed job of two "
                "nodes or more"
            )
        # The ranks of a node share its directory and host-memory area: the node's first
        # process (LOCAL_RANK 0) holds the writer lock and claims the area for them.
        first = djob is None or _local_rank(djob) == 0
        with self._lock:
            made, self._made = self._made, None
            if djob is None:
                self._raise_unreported()  # a sharded save raises it once handed over
                self._take_store(first)
                flat = flatten(state)
                _whole_dtensors(flat)
                layout = plan(flat.tensors)
                return self._save(None, layout, flat, step, want, overlap, budget, t0)
            if made is not None and made.step == step and made.tiers == want:
                return made  # made by the last call, which raised an earlier failure
            # A failure here is this rank's alone (a second writer holds its node's lock,
            # its state's walk, the peer tier's link): the rank takes the save's number
            # all the same and raises with the others (``Sharder.part``), so that none
            # waits for it in the plan's exchange and every rank's numbers stay in step.
            # It walks its state and makes the link's collective even so, as the others.
            early: Exception | None = None
            fl: Flattened | None = None
            try:
                self._take_store(first)
            except Exception as e:
                early = e
            try:
                fl = flatten(state)
            except Exception as e:
                early = early or e
            if "peer" in want:  # the peer tier's group and ring: a collective, once
                try:
                    self.peer_link(djob)
                except Exception as e:
                    early = early or e
            sharded = self._sharded(djob, fl, step, early)
            assert fl is not None  # else _sharded raised ``early``
            return self._sharded_save(sharded, fl, step, want, overlap, budget, t0)

    def _take_store(self, first: bool) -> None:
        """Before anything is touched: the writer lock (a second writer fails) and the
        host-memory area, by the node's first process (``first``) for its ranks."""
        if self.local is not None and first:
            self._hold_writer_lock(self.local.root)
        if self.host is not None and not self._claimed:
            # prepare()'s reservation for a peer fetch (a replaced node's) is not
            # wanted once the area is saved into: finished first (it sizes the slot
            # file the first save maps), then its mapping is given back.
            self.settle_reserve()
            drop_mappings(under=self.host.root)
        if self.host is not None and not self._claimed and first:
            # Before the first sharded save's exchange, which the node's other ranks
            # leave only once this one has entered it: they see the area claimed.
            self.host.claim(self.config.identity())
            if self.local is None:  # the area is the store: locked once it is its own
                self._hold_writer_lock(self.host.root)
            self._release_stale_host()

    def _sharded_save(
        self,
        sharded: ShardedSave,
        flat: Flattened,
        step: int,
        want: tuple[str, ...],
        overlap: bool,
        budget: int | None,
        t0: float,
    ) -> SaveHandle:
        """A sharded save, once ``Sharder.part`` has given it its save number (``seq``):
        every rank uses up each number, whatever happens on its own. A failure before the
        save is handed to the persist thread is told to the coordinator (so the others'
        save of that number fails at once, not after the commit timeout); a failure nobody
        saw (an earlier snapshot's) is raised only after this save was handed over: a rank
        that skipped a save the others make would fail theirs, and their failure would
        then be raised at their next save, failing this rank's, and so on. A caller that
        calls again for the same step and tiers right after that (to try again, as in one
        process) gets this save's handle: a second save on this rank alone would be
        paired with the others' next one."""
        try:
            handle = self._save(sharded, sharded.spec.layout, flat, step, want, overlap, budget, t0)
        except BaseException as e:
            if not sharded.handed:  # else the persist job tells its own failure
                self._tell_failure(sharded, step, e)
            raise
        self._made = handle
        self._raise_unreported(but=handle)
        self._made = None
        return handle

    @staticmethod
    def _tell_failure(sharded: ShardedSave, step: int, error: BaseException) -> None:
        """Announce this rank's failure of save ``sharded.spec.seq`` from a thread of
        its own (rank 0 waits there for every rank's announcement: never the training
        thread). No tier can commit it: the save's plan verdict says this rank failed."""
        threading.Thread(
            target=sharded.fail, args=((), step, error), name="snapcore-fail", daemon=True
        ).start()

    def _save(
        self,
        sharded: ShardedSave | None,
        layout: Layout,
        flat: Flattened,
        step: int,
        want: tuple[str, ...],
        overlap: bool,
        budget: int | None,
        t0: float,
    ) -> SaveHandle:
        """The save once planned (under ``self._lock``): the slot, the arena, staging,
        the hand-over to the persist thread."""
        streaming = budget is not None and budget < layout.total * self.slots
        if streaming and sharded is not None:
            raise ValueError("a sharded save cannot stream through a smaller budget yet")
        if streaming and (self.host is not None or want != ("local",)):
            raise ValueError(
                f"a budget of {budget} bytes is less than {self.slots} x the state "
                f"({layout.total} bytes): streaming writes to the local tier only "
                "(a store with a local tier and no host tier; send it with "
                "tiers=['local'] when the store also has a remote)"
            )
        # The default mode with CPU tensors only: the persist thread hashes and writes
        # the image while it is staged (its start, the directory's lock, overlaps the
        # copy too); overlap mode and CUDA tensors hand the image over once staged. By
        # default only when the copies leave a core free (SNAPCORE_PIPELINE): else the
        # hash thread takes cores and memory bandwidth from the copies the caller
        # waits for (docs/benchmarks.md, "Targets: what passed, what failed").
        pipelined = (
            not streaming
            and not overlap
            and settings.pipelined()
            and all(b.device.type == "cpu" for b in layout.blobs)
        )
        if self.host is not None and not self._claimed:
            self._slot_steps = self.host.steps_by_slot()
            self._claimed = True
        slot = self._free_slot()
        if sharded is None:  # the snapshot that used this slot may have failed
            self._raise_unreported()
        if self.host is not None:
            self._await_other_slot(slot)
            # Its host snapshots become invisible before their memory is overwritten.
            self.host.uncommit_steps(self._slot_steps[slot])
            self._slot_steps[slot] = {step}
            for other in self._slot_steps[:slot] + self._slot_steps[slot + 1 :]:
                other.discard(step)  # a re-saved step's manifest will name this slot
        size = self._arena_size(layout, budget if streaming else None)
        device = None  # no CUDA tensor without CUDA initialised: no walk over the blobs
        if torch.cuda.is_initialized():
            device = pin_device(b.device for b in layout.blobs)
        arena = self._arena(slot, size, device)
        stats = SaveStats(step, layout.data_bytes, layout.total, streaming=streaming)
        handle = SaveHandle(step, stats, want, t0=t0)
        windows: queue.Queue[WindowItem] = queue.Queue()
        halves = [threading.Event(), threading.Event()]
        for h in halves:
            h.set()
        slot_free: Future[None] = Future()
        job = PersistJob(self, handle, layout, flat.tree, windows, halves, slot, slot_free, sharded)
        self._handles = [h for h in self._handles if not h.done() or h.unreported()]
        self._persist.submit(job.run)  # before the slot is marked: a failed submit frees it
        if sharded is not None:
            sharded.handed = True
        self._slot_free[slot] = slot_free
        self._slot_last, self._slot_handle[slot] = slot, handle
        self._handles.append(handle)
        progress = None
        try:
            if streaming:
                job.go.set()  # the persist thread frees each half that staging refills
                if overlap:
                    log.warning("step %d: no overlap mode when the state exceeds the budget", step)
                self.stager.stage_streaming(arena, layout, windows, halves, handle)
            elif pipelined:
                job.go.set()
                progress = self.stager.stage_pipelined(arena, layout, windows)
            else:
                self.stager.stage_whole(
                    arena, layout, windows, flat.optimizers if overlap else None, handle
                )
        except BaseException as e:
            windows.put(Aborted(e))  # the persist thread must not commit a partial image
            # The caller gets this error now: the handle's failure ("staging was
            # interrupted") is the same news and must not fail the next save again.
            handle.mark_all_reported()
            self._handles.remove(handle)
            job.go.set()
            raise
        windows.put(None)
        if progress is not None:
            progress.end()
        try:
            if not handle.deferred:
                handle.mark_staged()
            if self.slots > 1 and not streaming:
                self._prepare_slot(1 - slot, size, device)  # the next save's, meanwhile
            stats.stall_s = time.perf_counter() - t0
        finally:
            job.go.set()  # whatever happens here, the persist job must not wait forever
        return handle

    def _sharded(
        self, djob: Job, flat: Flattened | None, step: int, early: Exception | None = None
    ) -> ShardedSave:
        """This rank's part of the next sharded save, with its number; ``early``: this
        rank failed before it (``async_save``), and raises it here with the others."""
        if self._sharder is None or self._sharder.job is not djob:
            local = str(self.local.root) if self.local else None
            self._sharder = Sharder(djob, local, self.config.host)
            self._eid = next(_engine_ids)
            if self.host is not None:  # each rank stages into slot files of its own
                self.host.rank = djob.rank
        sharder = self._sharder
        seq = sharder.seq + 1
        try:
            spec = sharder.part(flat, early)
        except BaseException as e:
            # The save number is used up on every rank (an exchange that raised here, or
            # that the others left): the others must not wait for this rank's part.
            if sharder.seq == seq:
                self._tell_failure(ShardedSave.failed_seq(djob, sharder, self._eid, seq), step, e)
            raise
        return ShardedSave(djob, sharder, self._eid, spec)

    def peer_link(self, djob: Job) -> PeerLink:
        """The peer tier's link (made at the first sharded save or restore: a collective
        every rank makes)."""
        if self.peer is None:
            self.peer = open_link(djob, self.config)
        return self.peer

    def peer_submit(
        self, handle: SaveHandle, sharded: ShardedSave, *, unknown: bool = False
    ) -> Future[None]:
        """The peer tier (snapcore/peer): send this rank's part of the step that has just
        committed in host memory to its partners, receive its sources' parts. ``unknown``:
        this rank had no host verdict in time; the peer thread asks for it once more
        (``PeerLink.submit``'s ``verdict``)."""
        assert self.peer is not None
        key = index_key(sharded.job, sharded.eid, sharded.spec.seq, "host")
        verdict = (lambda: sharded.verdict_now("host")) if unknown else None
        return self.peer.submit(handle, handle.step, key, verdict=verdict)

    def wait(self) -> None:
        """Wait for every snapshot in flight and the housekeeping after it (retention,
        collection); raise the first failure nobody saw."""
        for h in list(self._handles):
            h.settle()
        for pool in (self._persist, self.uploader):  # in order: what was queued is done
            with contextlib.suppress(RuntimeError):  # a closed engine has nothing queued
                pool.submit(lambda: None).result()
        if self.peer is not None:  # the peer tier's thread (a re-send after a restore)
            self.peer.drain()
        self._raise_unreported()

    def prepare(self, state: object) -> Future[None]:
        """Allocate and fault the arena(s) for ``state`` in the background, so that the
        first save does not do it on the training thread (memory touched for the first
        time fills at well under 1 GB/s on some machines)."""
        tensors = [t.to_local() if is_dtensor(t) else t for t in flatten(state).tensors]
        size = self._arena_size(plan(tensors), None)
        device = pin_device(t.device for t in tensors)
        if self.host is not None:
            # Slot files may hold committed host snapshots until a save claims the area;
            # the second slot is prepared in the background after the first save. A
            # replaced node of a job with a peer tier (an area with no snapshot) faults
            # in the memory its part will be fetched into (snapcore/peer/restore.py).
            if self.config.peer_spec is None or not initialized() or self._claimed:
                return _done()
            warm_parser()  # a replaced node's fetch parses its copy's manifest
            with self._lock:
                if self._preparer is None:
                    self._preparer = ThreadPoolExecutor(1, thread_name_prefix="snapcore-prepare")
                import torch.distributed as dist

                rank = dist.get_rank()
                self._reserving = self._preparer.submit(self._reserve, rank, size)
                return self._reserving
        with self._lock:
            return self._prepare_slot(0, size, device) or _done()

    def _reserve(self, rank: int, size: int) -> None:
        try:
            reserve_peer_fetch(self.config, rank, size)
        except Exception as e:  # the fetch faults its memory on the way instead
            log.warning("could not fault in the memory of a peer fetch ahead: %s", e)

    def settle_reserve(self) -> None:
        """Wait for ``prepare``'s reservation for a peer fetch (before the fetch uses it)."""
        fut = self._reserving
        if fut is not None:
            fut.result()
            self._reserving = None

    def close(self) -> None:
        """Wait for what is in flight, stop the threads, free the arenas, close the remote
        tier's connections and drop the writer lock. A failure nobody saw is logged."""
        try:
            self.wait()
        except SnapcoreError as e:
            log.error("closing the engine of %s: %s", self.config.describe(), e)
        if self._sharder is not None and self._sharder.job.rank == 0:
            # rank 0 serves the job's key-value store: every rank must have its verdicts
            short = self._sharder.job.settle()
            if short:
                log.warning("closing: %d verdict(s) not acknowledged by every rank", len(short))
        for pool in (self._persist, self.hasher, self.uploader, self._encoder, self._preparer):
            if pool is not None:
                pool.shutdown(wait=True)
        if self.host is not None:  # prepare()'s mapping for a fetch that never came
            drop_mappings(under=self.host.root)
        if self.peer is not None:
            self.peer.close()
        self.stager.close()
        for i, a in enumerate(self.arenas):
            if a is not None:
                a.close()
                self.arenas[i] = None
        if self.remote is not None:
            self.remote.close()
        if self._writer_lock is not None:
            writer_lock.release(self._writer_lock)
            self._writer_lock = None

    def _hold_writer_lock(self, directory: Path) -> None:
        if self._writer_lock is None:
            self._writer_lock = writer_lock.take(directory, self.config.describe())

    # -- used by the persist and upload stages --------------------------------------------
    def encoder(self) -> ThreadPoolExecutor:
        if self._encoder is None:
            self._encoder = ThreadPoolExecutor(
                settings.threads(), thread_name_prefix="snapcore-encode"
            )
        return self._encoder

    def after_commit(
        self,
        tier: str,
        m: mf.Manifest,
        handle: SaveHandle,
        *,
        resaved: bool = False,
        before: Callable[[], None] | None = None,
    ) -> None:
        """The housekeeping after ``m`` committed in ``tier``: ``before`` (e.g. the end
        of an upload's pending mark), the collection of a re-saved step's old files, the
        chunk index, then the tier's retention. It cannot undo the commit, so its errors
        are warnings on ``handle``."""
        try:
            if before is not None:
                before()
            # The ranks of a sharded save share the tiers: rank 0 does the housekeeping of
            # object storage, the leader of each node that of its directory.
            sh = self._sharder
            shared = sh is not None and not sh.leads(tier)
            if resaved and not shared:  # the old files of a re-saved step may be unreferenced
                self.index.invalidate(tier)  # it may point into them
                self.tier(tier).collect()
            self.index.add(tier, m)
            if not shared:
                self._retain(tier)
        except Exception as e:
            handle.warn(f"{tier} tier: housekeeping after the commit of step {m.step} failed: {e}")

    def _retain(self, tier: str) -> None:
        t = self.tier(tier)
        if tier == "remote" and not self._remote_collected:
            self._remote_collected = True  # leftovers of uploads a crash interrupted
            removed = t.collect()
            if removed:
                log.info("remote tier: removed %d leftover object(s)", len(removed))
        protected = self.uploading if tier == "local" else set()
        # read before anything is dropped: a bad setting fails here, not half-way
        recycle = tier == "local" and self.local is not None and settings.recycle()
        doomed = [
            s
            for s in self.config.retention_for(tier).doomed(t.committed_steps())
            if s not in protected
        ]
        for step in doomed:
            t.uncommit(step)
        if doomed:
            self.index.invalidate(tier, doomed)  # shared chunks may have gone with them
            # The local tier keeps freed data files for the next saves to write over
            # (docs/format.md, "Spare data files"): no new blocks to allocate.
            if recycle:
                assert self.local is not None
                removed = self.local.collect(recycle=True)
            else:
                removed = t.collect()
            log.info("%s tier: retention removed steps %s (%d files)", tier, doomed, len(removed))

    # -- internals ------------------------------------------------------------------------
    def _wanted(self, tiers: Iterable[str] | None) -> tuple[str, ...]:
        have = self.config.tiers
        peer = ("peer",) if self.config.peer_spec is not None else ()  # after host commits
        # A peer tier disabled until the job restarts (a partner lost), once reported on
        # a handle of this rank: later saves go on without it (docs/peer.md, "Failures").
        off = self.peer is not None and self.peer.off()
        if tiers is None:
            return have if off else have + peer
        asked = set(tiers)
        bad = asked - set(have + peer)
        if bad:
            raise ValueError(
                f"tiers {sorted(bad)} are not configured (this store has {have + peer})"
            )
        if "remote" in asked and "local" not in asked and self.local is not None:
            asked.add("local")  # uploads are read from the local copy
        if "peer" in asked:
            asked.add("host")  # the peer tier sends the host snapshot
            if off:
                asked.discard("peer")
        return tuple(t for t in TIER_ORDER if t in asked) + (("peer",) if "peer" in asked else ())

    def _raise_unreported(self, but: SaveHandle | None = None) -> None:
        for h in self._handles:
            if h is but:
                continue
            failed = h.take_failure()
            if failed is not None:
                tier, exc = failed
                raise SnapshotFailed(
                    f"an earlier snapshot (step {h.step}) to {self.config.describe()} failed in "
                    f"tier {tier}: {exc}",
                    step=h.step,
                    tier=tier,
                ) from exc

    def _free_slot(self) -> int:
        """The arena slot to stage into (not the one holding the newest host snapshot, nor
        the one being written); waits until it is no longer read."""
        slot = 0
        if self.host is not None:
            newest = [max(steps, default=-1) for steps in self._slot_steps]
            slot = 0 if self._slot_last == 1 else 1
            if self._slot_last is None:  # first save: keep the newest committed one
                slot = 0 if newest[0] <= newest[1] else 1
        fut = self._slot_free[slot]
        if fut is not None:
            fut.result()
        return slot  # (``_slot_last`` once a save is handed over in it)

    def _await_other_slot(self, slot: int) -> None:
        """Before ``slot``'s host snapshots are uncommitted: wait until the save staged
        last into the other slot has its host outcome, so that the host tier keeps a
        committed snapshot meanwhile (that save's host commit may still be under way: a
        sharded one waits for every rank's part and the coordinator). Bounded by the
        commit timeout (``SNAPCORE_COMMIT_TIMEOUT_S``); past it, or if that save failed
        in host memory, the host tier holds no snapshot until this one commits."""
        other = self._slot_handle[1 - slot]
        if other is None or "host" not in other.tiers or other.done("host"):
            return
        limit = settings.commit_timeout_s()
        if not other.settle("host", limit):
            log.warning(
                "step %d has no host-memory outcome after %g s (SNAPCORE_COMMIT_TIMEOUT_S): "
                "slot %d's host snapshots are uncommitted before it commits",
                other.step,
                limit,
                slot,
            )

    def _prepare_slot(self, slot: int, size: int, device: int | None) -> Future[None] | None:
        """Allocate and fault a slot's arena in the background (off the training thread)
        unless it is big enough or in use; the next save of that slot waits for it."""
        arena, busy = self.arenas[slot], self._slot_free[slot]
        fits = arena is not None and arena.fits(size, device)
        if fits or (busy is not None and not busy.done()):
            return None
        if self._preparer is None:
            self._preparer = ThreadPoolExecutor(1, thread_name_prefix="snapcore-prepare")
        fut = self._slot_free[slot] = self._preparer.submit(self._try_arena, slot, size, device)
        return fut

    def _try_arena(self, slot: int, size: int, device: int | None) -> None:
        try:
            self._arena(slot, size, device)
        except Exception as e:  # the next save allocates it again, and raises then
            log.warning("could not prepare arena slot %d in the background: %s", slot, e)

    def _arena(self, slot: int, size: int, device: int | None) -> HostArena:
        """Slot ``slot``'s arena, (re)made if it is too small, or unpinned while the state
        now has CUDA tensors; pinned on ``device`` (None: not pinned)."""
        arena = self.arenas[slot]
        if arena is None or not arena.fits(size, device):
            if arena is not None:
                arena.close()
                self.arenas[slot] = None
            shm = self.host.slot_path(slot) if self.host is not None else None
            # A fresh file: its old size and contents mean nothing now, and a reader may
            # still map it. In an area that holds no committed snapshot, nobody reads it:
            # its memory (prepare()'s reservation for a peer fetch) is taken as it is.
            if shm is not None and self.host is not None and self.host.committed_steps():
                with contextlib.suppress(FileNotFoundError):
                    shm.unlink()
            arena = self.arenas[slot] = HostArena(size, shm, device)
        return arena

    @staticmethod
    def _arena_size(layout: Layout, budget: int | None) -> int:
        if budget is None:
            return max(align_up(layout.total, PAGE), PAGE)
        half = max(budget // 2 // PAGE * PAGE, MIN_WINDOW)
        return 2 * half

    def _release_stale_host(self) -> None:
        """Host snapshots older than what a slower tier holds are of a finished run."""
        assert self.host is not None
        host_steps = self.host.committed_steps()
        if not host_steps:
            return
        newest_elsewhere = -1
        if self.local is not None:
            newest_elsewhere = max(self.local.committed_steps(), default=-1)
        if host_steps[-1] < newest_elsewhere:
            log.info("host area %s is older than the local tier: released", self.host.area)
            self.host.release()
            self.host.claim(self.config.identity())


def _local_rank(job: Job) -> int:
    """This process's rank on its node (torchrun's LOCAL_RANK; the global rank if unset)."""
    return int(os.environ.get("LOCAL_RANK", job.rank))


def _done() -> Future[None]:
    f: Future[None] = Future()
    f.set_result(None)
    return f


_engine_ids = itertools.count(1)  # engines that made sharded saves, in creation order
_engines: dict[tuple[Any, ...], Engine] = {}
_engines_lock = threading.Lock()


def _whole_dtensors(flat: Flattened) -> None:
    """Outside a job of several ranks (no process group, or a world of one rank), a
    DTensor holds its whole tensor (a mesh of one rank): it is saved as that tensor. A
    DTensor that does not (a sub-mesh of a larger world, or padded) is refused, naming
    it: only a sharded save (every rank) can save a shard of it."""
    for i, t in enumerate(flat.tensors):
        if not is_dtensor(t):
            continue
        local = local_shard(t)
        if tuple(local.shape) != tuple(t.shape):
            raise UnsupportedState(
                f"{flat.paths[i] or '<root>'}: a DTensor of shape {tuple(t.shape)} whose "
                f"local shard is {tuple(local.shape)}: its other shards are on other ranks, "
                "and this is not a sharded save (a torch.distributed job of 2 ranks or more)",
                path=flat.paths[i],
            )
        flat.tensors[i] = local


def engine_for(store: Store | str | os.PathLike[str]) -> Engine:
    """The engine of a store (one per set of tiers in this process)."""
    config = as_store(store)
    with _engines_lock:
        e = _engines.get(config.key())
        if e is None:
            e = _engines[config.key()] = Engine(config)
        else:
            e.config = config  # codecs and retention may change between calls
        return e


def engine_uses_host(name: str) -> bool:
    """Whether an open engine of this process has the host-memory area ``name``."""
    with _engines_lock:
        return any(e.config.host == name for e in _engines.values())


def close_store(store: Store | str | os.PathLike[str]) -> None:
    """Wait for and close the engine of ``store``'s tiers, if there is one; raises the
    first failure nobody saw (after closing). The next save makes a new engine."""
    with _engines_lock:
        e = _engines.pop(as_store(store).key(), None)
    if e is not None:
        _close_engines([e], raise_first=True)


def close_all(*, raise_first: bool = False) -> None:
    """Wait for and close every engine of this process: the snapshots in flight become
    durable (or fail), arenas (and the restore ring) are freed, remote connections closed,
    writer locks dropped.
    A failure nobody saw is logged, or with ``raise_first`` raised once all are closed."""
    with _engines_lock:
        engines = list(_engines.values())
        _engines.clear()
    try:
        _close_engines(engines, raise_first=raise_first)
    finally:
        h2d.release_ring()  # the pinned ring restores to the GPU keep


def _close_engines(engines: list[Engine], *, raise_first: bool) -> None:
    first: SnapcoreError | None = None
    for e in engines:
        try:
            e.wait()
        except SnapcoreError as exc:
            if first is None and raise_first:
                first = exc
            else:
                log.error("closing the engine of %s: %s", e.config.describe(), exc)
        e.close()
    if first is not None:
        raise first


def _close_at_exit() -> None:
    """Interpreter exit: close what the program did not, so that no remote session is
    left for the garbage collector (aiohttp's "Unclosed client session")."""
    try:
        close_all()
    except Exception as e:  # never a traceback at exit: said once, in the log
        log.error("closing snapcore at exit: %s", e)
    forget_job()  # the job's store and connections go now, not in the teardown


atexit.register(_close_at_exit)
on_store_exit(close_store)  # `with Store(...)` closes its engine


# -- the writer lock -----------------------------------------------------------------------
