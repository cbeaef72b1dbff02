"""The persist stage: one snapshot's work on the engine's persist thread.

It takes the staged window(s) from the queue the staging side fills, hashes the chunks
(on the hash thread, in arena order, while this thread writes them), commits in host
memory, writes and commits on local disk, and hands the snapshot to the upload thread.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from .. import settings
from ..directory import Pending
from ..errors import SnapcoreError, SnapshotFailed
from ..io_types import Aborted, Location, StagingAborted, Window, WindowItem
from ..planning.layout import Layout
from ..staging.copy import settle_window
from ..staging.handle import SaveHandle
from .chunks import Staged, chunk_list, hash_chunks, hash_window
from .commit import OutcomeUnknown, ShardedSave, part_ref, verdict_ok
from .local import LocalWriter, commit_host, data_writer, trim
from .manifest_builder import BlobRecord, ChunkRecord, build_manifest, staged_manifest
from .upload import Upload

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger(__name__)


def _take_verdict(sh: ShardedSave) -> None:
    """Take a sharded save's plan verdict as soon as rank 0 gives it. A failure here is
    not lost: ``_check_plan`` asks again before any tier commits, and raises it there."""
    try:
        sh.verdict()
    except BaseException as e:
        log.debug("plan verdict, taken early: %s (asked again before the commit)", e)


class PersistJob:
    """One snapshot's persist work, run on the engine's persist thread: take the staged
    window(s), hash, commit in host memory, write and commit on local disk, hand over to
    the uploader. The handle gets each tier's outcome."""

    def __init__(
        self,
        engine: Engine,
        handle: SaveHandle,
        layout: Layout,
        tree: dict[str, Any],
        windows: queue.Queue[WindowItem],
        halves: list[threading.Event],
        slot: int,
        slot_free: Future[None],
        sharded: ShardedSave | None = None,
    ) -> None:
        self.sharded = sharded
        self.engine = engine
        self.handle = handle
        self.pending: Pending | None = None
        self.layout = layout
        self.tree = tree
        self.windows = windows
        self.halves = halves
        self.slot = slot
        self.slot_free = slot_free
        self.helpers: list[Future[Any]] = []  # hash and encode work that reads the arena
        self._ended = False  # staging's last item (None, or Aborted) was taken
        self.peer: Future[None] | None = None  # the peer tier's transfer (snapcore/peer)
        # Set when ``async_save`` returns (or raises): the job's own Python work (the
        # directory's leftovers and lock) then does not compete with the training thread
        # for the GIL inside the call. Set before staging when the persist thread reads
        # the image while it is staged (streaming, and the pipelined whole mode).
        self.go = threading.Event()

    def run(self) -> None:
        h = self.handle
        upload: Future[None] | None = None
        sh = self.sharded
        failed = False
        self.go.wait()
        try:
            local = self.engine.local
            if sh is not None:
                # The verdict is awaited before anything commits (_check_plan), not here:
                # rank 0 decides it once every rank's call has returned, and the writes
                # need not wait for the slowest rank's call. It is taken on a thread of
                # its own as soon as it is known, not when a tier commits: the next
                # save's plan reads it (Sharder.part), and must not wait for this save's
                # writes to learn it.
                sh.announce()
                threading.Thread(
                    target=_take_verdict, args=(sh,), name="snapcore-verdict", daemon=True
                ).start()
            if "local" in h.tiers and local is not None:
                # Off the training thread: the leftovers of a crashed writer, then our lock.
                if sh is None or sh.sharder.leads("local"):  # its node's ranks share the dir
                    local.store.collect_leftovers()
                self.pending = local.store.begin(h.step)
            if h.stats.streaming:
                self._run_streaming()
            else:
                upload = self._run_whole()
        except BaseException as e:
            # A staging error was raised to the caller already: only the rest is news.
            level = logging.DEBUG if isinstance(e, StagingAborted) else logging.ERROR
            log.log(
                level,
                "snapshot of step %d to %s failed: %s",
                h.step,
                self.engine.config.describe(),
                e,
            )
            failed = True
            for half in self.halves:
                half.set()
            if sh is not None:  # the coordinator must not wait for parts that will not come
                sh.fail(tuple(t for t in h.tiers if t != "peer"), h.step, e)
            if self.pending is not None and not self.pending.committed:
                with contextlib.suppress(Exception):
                    self.pending.abort()
            self._settle()  # the host commit, if it happens, resolves its own tier
            for tier in h.tiers:
                h.resolve(tier, e)
        finally:
            self._settle()
            self._drain()
            if failed:
                # Only now: staging has ended (the pipelined mode's copies go on in the
                # call after an early failure here), and "staged" says the state may
                # change. The failure itself is on the handle already (resolve above).
                h.mark_staged()
            self._release_slot(upload)

    def _staging_ended(self) -> None:
        """Take staging's last item: the snapshot's end (raises if staging failed, or if
        it staged more than the one window of the whole mode). Once only."""
        if not self._ended and self._take_window() is not None:
            raise SnapcoreError(f"step {self.handle.step}: expected one staged window")

    def _check_plan(self) -> None:
        """A sharded save: raise unless the save's plan verdict is "ok" (before any tier
        commits; the verdict is taken once, by whichever thread asks first)."""
        sh = self.sharded
        if sh is None:
            return
        why = sh.verdict()
        if why is not None:
            raise SnapshotFailed(
                f"step {self.handle.step} cannot be committed: {why}; every rank agrees the "
                "save plan again at its next save",
                step=self.handle.step,
            )

    def _settle(self) -> None:
        """Wait for every helper thread still reading the arena (the slot is then free)."""
        for fut in self.helpers:
            with contextlib.suppress(BaseException):
                fut.result()

    def _drain(self) -> None:
        """After a failure that came before staging's last window was taken (the store
        could not be opened, the plan changed...): take the windows staging still gives,
        up to its end, and wait for their copies. Overlap mode's run on after
        ``async_save`` returned (the overlap thread, the side streams): the slot is freed,
        and the arena reused, only once none of them writes into it or reads a source."""
        while not self._ended:
            w = self.windows.get()
            if w is None or isinstance(w, Aborted):
                self._ended = True
            else:
                settle_window(w)  # (streaming: its halves stay taken, so the stager
                w.keep.clear()  # finds the failure at its next window and stops)

    def _release_slot(self, upload: Future[None] | None) -> None:
        # The uploader and the peer tier read the slot: it stays busy until they are done.
        busy = [f for f in (upload, self.peer) if f is not None]
        if not busy:
            self.slot_free.set_result(None)
            return
        left = [len(busy)]
        lock = threading.Lock()

        def one_done(_: Future[None]) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                self.slot_free.set_result(None)

        for f in busy:
            f.add_done_callback(one_done)

    def _take_window(self) -> Window | None:
        w = self.windows.get()
        self._ended = w is None or isinstance(w, Aborted)
        if isinstance(w, Aborted):
            raise StagingAborted(f"staging of step {self.handle.step} was interrupted") from w.error
        if w is None:
            return None
        # Overlap mode's copies run on the stager's overlap thread: wait for them, and
        # for the CUDA copies, before reading the arena or dropping the sources.
        error: BaseException | None = None
        for fut in w.pending:
            try:
                fut.result()
            except BaseException as e:
                error = error or e
        for ev in w.events:
            ev.synchronize()
        w.keep.clear()
        if error is not None:
            raise error
        if self.handle.deferred:
            self.handle.mark_staged()
        return w

    def _peer_round(self, h: SaveHandle, *, unknown: bool = False) -> None:
        """The step's peer round, on a rank whose host commit failed after the
        coordinator's verdict committed the step (its node's index not written): every
        rank runs one round per such step, so the rounds stay in step; this one sends no
        copy (its part is gone) and receives its sources'. ``unknown``: this rank had no
        verdict within the commit timeout (``OutcomeUnknown``); the peer thread asks for
        it once more and runs the round (no copy sent) only if the step was committed
        (``PeerLink._run``)."""
        assert self.sharded is not None
        try:
            self.peer = self.engine.peer_submit(h, self.sharded, unknown=unknown)
        except BaseException as e:  # e.g. the engine is closing
            h.resolve("peer", e)

    def _run_whole(self) -> Future[None] | None:
        engine, h = self.engine, self.handle
        w = self._take_window()
        if w is None:
            raise SnapcoreError(f"step {h.step}: expected one staged window")
        progress = w.progress  # the pipelined mode: staging goes on while this reads
        if progress is None:
            self._staging_ended()
        s = Staged(
            h.step,
            self.layout,
            self.tree,
            w.arena,
            self.slot,
            chunk_list(self.layout, settings.chunk_bytes()),
            part=self.sharded.spec.info() if self.sharded is not None else None,
            drops=self.sharded.spec.drop if self.sharded is not None else {},
        )
        ready = [threading.Event() for _ in s.chunks]

        def after_hashing() -> None:
            if "host" in h.tiers:
                try:
                    assert engine.host is not None
                    if progress is not None:  # every byte is hashed, so staged; but the
                        progress.wait_end()  # call's staging must also have ended well
                    self._check_plan()
                    commit_host(engine.host, s, h, self.sharded)
                except BaseException as e:
                    h.resolve("host", e)
                    if self.sharded is not None:  # the coordinator must not wait for it
                        self.sharded.fail_tier("host", h.step, e)
                    if "peer" in h.tiers and verdict_ok(e):  # committed on the other ranks:
                        self._peer_round(h)  # the round still runs (it sends no copy)
                    elif "peer" in h.tiers and isinstance(e, OutcomeUnknown):  # no verdict:
                        self._peer_round(h, unknown=True)  # the peer thread asks again
                    elif "peer" in h.tiers:  # peer tier: nothing to send
                        h.resolve("peer", SnapshotFailed(
                            f"step {h.step}: not sent to the peer tier: the host tier failed "
                            f"({e})", step=h.step, tier="peer"))  # fmt: skip
                else:
                    h.resolve("host")
                    if "peer" in h.tiers:  # peer tier: the parts go to the partners
                        assert self.sharded is not None
                        try:
                            self.peer = engine.peer_submit(h, self.sharded)
                        except BaseException as e:  # e.g. the engine is closing
                            h.resolve("peer", e)

        hashing = engine.hasher.submit(hash_chunks, s, ready, after_hashing, progress)
        self.helpers.append(hashing)
        local_m = None
        if "local" in h.tiers:
            assert self.pending is not None and engine.local is not None
            resaved = h.step in engine.local.committed_steps()
            local_m = LocalWriter(
                s,
                self.pending,
                h,
                root=engine.local.root,
                codec=engine.config.codec_for("local"),
                index=engine.index.get("local"),
                encoder=engine.encoder,
                encode_ahead=engine.encode_ahead,
                helpers=self.helpers,
                rank=self.sharded.spec.rank if self.sharded is not None else 0,
            ).write(ready, hashing)
            hashing.result()
            self._staging_ended()  # nothing commits before the call's staging has ended
            if "remote" in h.tiers:
                engine.uploading.add(h.step)  # before retention can drop it
            try:
                self._check_plan()
                self._commit_local(local_m)
            except BaseException:
                engine.uploading.discard(h.step)
                raise
            h.resolve("local")  # durable: retention's deletions are not the caller's wait
            engine.after_commit("local", local_m, h, resaved=resaved)
        hashing.result()
        self._staging_ended()
        self._check_plan()  # (taken already when a tier committed above)
        if "remote" not in h.tiers:
            return None
        if local_m is not None:
            job = Upload(engine, h, engine.local, local_m, sharded=self.sharded)  # type: ignore[arg-type]
        else:  # no local tier: upload straight from host memory
            locs = [Location("arena", off, n, w.arena.size) for _, _, off, n in s.chunks]
            m = staged_manifest(s, locs, ["none"] * len(locs), [n for *_, n in s.chunks])
            job = Upload(engine, h, engine.local, m, arena=w.arena, sharded=self.sharded)  # type: ignore[arg-type]

        def upload() -> None:
            try:
                job.run()
            finally:
                engine.uploading.discard(h.step)

        fut = engine.uploader.submit(upload)
        return fut if local_m is None else None

    def _commit_local(self, m: Any) -> None:
        """Commit in the local tier: the manifest; or, for a sharded save, this rank's
        part, then the step's index once every rank's part is there (write/commit.py)."""
        assert self.pending is not None
        sh = self.sharded
        if sh is None:
            self.pending.commit(m)
            return
        data = m.dumps()
        name = self.pending.write_part(sh.spec.rank, data)
        pending = self.pending
        try:
            sh.commit("local", m.step, part_ref(sh.spec.rank, name, data), pending.commit)
        except OutcomeUnknown:
            pending.settle()  # the step may be committed with this part: keep it
            raise
        if not pending.committed:  # rank 0 committed it by writing the index
            pending.settle()

    def _run_streaming(self) -> None:
        """The state is larger than the budget: write the image window by window."""
        engine, layout, h = self.engine, self.layout, self.handle
        assert self.pending is not None and engine.local is not None
        chunks = layout.chunks(settings.chunk_bytes())
        digests: list[list[str]] = [[""] * len(c) for c in chunks]
        partial: dict[tuple[int, int], Any] = {}
        name = self.pending.data_name(0)
        writer, spare = data_writer(self.pending, engine.local.root / name, layout.total)
        h.stats.o_direct = writer.direct
        written = 0
        try:
            while (w := self._take_window()) is not None:
                hashed = engine.hasher.submit(hash_window, w, chunks, digests, partial)
                self.helpers.append(hashed)
                writer.write_at(w.start, w.arena.address + w.arena_offset, w.end - w.start)
                hashed.result()
                written = w.end
                self.halves[w.half].set()
            trim(engine.local.root / name, spare, written)
            writer.sync()
        finally:
            writer.close()
        if written != layout.total or any(not d for ds in digests for d in ds):
            raise SnapcoreError(f"step {h.step}: the image was not staged whole")
        blobs = [
            BlobRecord(
                b.nbytes,
                b.element_size,
                [
                    ChunkRecord(Location(name, off, n, layout.total), n, digests[i][j], "none", n)
                    for j, (off, n) in enumerate(chunks[i])
                ],
            )
            for i, b in enumerate(layout.blobs)
        ]
        m = build_manifest(step=h.step, blobs=blobs, tensors=layout.entries, tree=self.tree)
        resaved = h.step in engine.local.committed_steps()
        self.pending.commit(m)
        h.stats.written["local"] = layout.total
        h.resolve("local")
        engine.after_commit("local", m, h, resaved=resaved)
