"""The save path's conductor: stage tensors into a host arena on the caller's thread, then
hand the snapshot to the persist thread (host memory, local disk) and the upload thread
(object storage).

One ``Engine`` per store owns its arenas (allocated and faulted once, reused), its
threads, and the handles of snapshots in flight. With a host-memory tier there are two
arena slots in /dev/shm, so a new snapshot is staged while the previous one is still being
written, and the last committed one is never overwritten.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import fcntl
import json
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import xxhash

from .. import _native, settings
from .. import manifest as mf
from ..errors import SnapcoreError, SnapshotFailed, StorageError, StoreInUse
from ..planning.layout import BlobPlan, Layout, align_up, plan
from ..staging.handle import SaveHandle, SaveStats, protect
from ..store import Pending
from ..tiers import TIER_ORDER, HostTier, LocalTier, Store, as_store
from ..tree import flatten
from .local import (
    PAGE,
    LocalWriter,
    Location,
    Staged,
    build_manifest,
    chunk_list,
    commit_host,
    hash_chunks,
    writer_info,
)

log = logging.getLogger(__name__)

MIN_WINDOW = 8 << 20  # the smallest streaming window: the "small constant buffers"
# Staging copies at least this large use streaming stores: the arena is far larger than the
# caches and is read next by the hasher and the disk, not by this core. memcpy would use
# ordinary stores for tensors under a few hundred MB each, reading every destination line
# before writing it (see _native.copy_host): 16-17 GB/s here against 22-25 GB/s.
NONTEMPORAL_MIN = 64 << 20

# The writer lock: held (flock) by the process that saves to a store, from its first save
# until its engine is closed, in the store's local directory (else its host-memory area).
# Its name holds nothing rank-specific: when sharded snapshots come, the ranks of one job
# will share one lock (taken by one rank on their behalf) rather than each take their own.
WRITER_LOCK = "writer.lock"

__all__ = ["Engine", "SaveHandle", "SaveStats", "close_all", "close_store", "engine_for"]


class HostArena:
    """A native arena plus a byte view of it that torch and xxhash can use."""

    def __init__(self, size: int, shm_path: Path | None = None) -> None:
        self.native = _native.Arena(
            size,
            shm_path=str(shm_path) if shm_path else None,
            huge_pages=settings.huge_pages(),
            pin=True,
            prefault=True,
            threads=settings.threads(),
        )
        self.size = size
        self.address = self.native.address
        self._buf = (ctypes.c_char * size).from_address(self.address)
        self.u8 = torch.frombuffer(self._buf, dtype=torch.uint8)

    def view(self, offset: int, nbytes: int) -> memoryview:
        return memoryview(self._buf).cast("B")[offset : offset + nbytes]

    def close(self) -> None:
        self.u8 = torch.empty(0, dtype=torch.uint8)
        self.native.close()


@dataclass
class Window:
    """A byte range [start, end) of the snapshot image, staged at ``arena_offset``."""

    arena: HostArena
    start: int
    end: int
    arena_offset: int
    half: int
    deferred: list[Callable[[], None]] = field(default_factory=list)  # run on persist thread
    events: list[Any] = field(default_factory=list)  # CUDA events to wait for before reading
    keep: list[torch.Tensor] = field(default_factory=list)  # alive until the copies ran


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
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="snapcore-hash")
        self._upload = ThreadPoolExecutor(1, thread_name_prefix="snapcore-upload")
        self._encoder: ThreadPoolExecutor | None = None
        self._preparer: ThreadPoolExecutor | None = None
        self._handles: list[SaveHandle] = []
        self._copiers: dict[int, Any] = {}
        self._index: dict[str, dict[tuple[str, int, str], Location] | None] = {}
        self._index_steps: dict[str, frozenset[int]] = {}
        self._uploading: set[int] = set()  # steps whose local files the uploader still needs
        self._remote_collected = False
        self._slot_steps: list[set[int]] = [set(), set()]  # host steps held by each slot
        self._slot_last: int | None = None  # the slot staged into last
        self._writer_lock: str | None = None  # the lock file this engine holds (a share)

    @property
    def local_root(self) -> Path:
        assert self.local is not None
        return self.local.root

    def tier(self, name: str) -> Any:
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
        want = self._wanted(tiers)
        with self._lock:
            self._raise_unreported()
            if self.local is not None:  # before anything is touched: a second writer fails
                self._hold_writer_lock(self.local.root)
            flat = flatten(state)
            layout = plan(flat.tensors)
            streaming = budget is not None and budget < layout.total * self.slots
            if streaming and (self.host is not None or want != ("local",)):
                raise ValueError(
                    f"a budget of {budget} bytes is less than {self.slots} x the state "
                    f"({layout.total} bytes): streaming writes to the local tier only "
                    "(a store with a local tier and no host tier; send it with "
                    "tiers=['local'] when the store also has a remote)"
                )
            if self.host is not None and not self._claimed:
                self.host.claim(self.config.identity())
                if self.local is None:  # the area is the store: locked once it is its own
                    self._hold_writer_lock(self.host.root)
                self._release_stale_host()
                self._slot_steps = self.host.steps_by_slot()
                self._claimed = True
            slot = self._free_slot()
            self._raise_unreported()  # the snapshot that used this slot may have failed
            if self.host is not None:
                # Its host snapshots become invisible before their memory is overwritten.
                self.host.uncommit_steps(self._slot_steps[slot])
                self._slot_steps[slot] = {step}
                for other in self._slot_steps[:slot] + self._slot_steps[slot + 1 :]:
                    other.discard(step)  # a re-saved step's manifest will name this slot
            size = self._arena_size(layout, budget if streaming else None)
            arena = self._arena(slot, size)
            stats = SaveStats(step, layout.data_bytes, layout.total, streaming=streaming)
            handle = SaveHandle(step, stats, want)
            handle._t0 = t0
            windows: queue.Queue[Window | _Aborted | None] = queue.Queue()
            halves = [threading.Event(), threading.Event()]
            for h in halves:
                h.set()
            slot_free: Future[None] = Future()
            job = _Job(self, handle, layout, flat.tree, windows, halves, slot, slot_free)
            self._handles = [h for h in self._handles if not h.done() or h.unreported()]
            self._persist.submit(job.run)  # before the slot is marked: a failed submit frees it
            self._slot_free[slot] = slot_free
            self._handles.append(handle)
            try:
                if streaming:
                    if overlap:
                        log.warning(
                            "step %d: no overlap mode when the state exceeds the budget", step
                        )
                    self._stage_streaming(arena, layout, windows, halves, handle)
                else:
                    self._stage_whole(
                        arena, layout, windows, flat.optimizers if overlap else None, handle
                    )
            except BaseException as e:
                windows.put(_Aborted(e))  # the persist thread must not commit a partial image
                # The caller gets this error now: the handle's failure ("staging was
                # interrupted") is the same news and must not fail the next save again.
                handle._mark_all_reported()
                self._handles.remove(handle)
                raise
            windows.put(None)
            if not handle._deferred:
                handle._mark_staged()
            stats.stall_s = time.perf_counter() - t0
            if self.slots > 1 and not streaming:
                self._prepare_slot(1 - slot, size)  # the next save's, while training runs
            return handle

    def wait(self) -> None:
        """Wait for every snapshot in flight and the housekeeping after it (retention,
        collection); raise the first failure nobody saw."""
        for h in list(self._handles):
            for fut in h._futures.values():
                with contextlib.suppress(BaseException):
                    fut.exception()
        for pool in (self._persist, self._upload):  # in order: what was queued is done
            with contextlib.suppress(RuntimeError):  # a closed engine has nothing queued
                pool.submit(lambda: None).result()
        self._raise_unreported()

    def prepare(self, state: object) -> Future[None]:
        """Allocate and fault the arena(s) for ``state`` in the background, so that the
        first save does not do it on the training thread (memory touched for the first
        time fills at well under 1 GB/s on some machines)."""
        size = self._arena_size(plan(flatten(state).tensors), None)
        if self.host is not None:
            # Slot files may hold committed host snapshots until a save claims the area;
            # the second slot is prepared in the background after the first save.
            return _done()
        with self._lock:
            return self._prepare_slot(0, size) or _done()

    def close(self) -> None:
        """Wait for what is in flight, stop the threads, free the arenas, close the remote
        tier's connections and drop the writer lock. A failure nobody saw is logged."""
        try:
            self.wait()
        except SnapcoreError as e:
            log.error("closing the engine of %s: %s", self.config.describe(), e)
        for pool in (self._persist, self._hasher, self._upload, self._encoder, self._preparer):
            if pool is not None:
                pool.shutdown(wait=True)
        for c in self._copiers.values():
            c.close()
        for i, a in enumerate(self.arenas):
            if a is not None:
                a.close()
                self.arenas[i] = None
        if self.remote is not None:
            self.remote.close()
        if self._writer_lock is not None:
            _release_writer_lock(self._writer_lock)
            self._writer_lock = None

    def _hold_writer_lock(self, directory: Path) -> None:
        if self._writer_lock is None:
            self._writer_lock = _take_writer_lock(directory, self.config.describe())

    # -- used by the persist and upload stages --------------------------------------------
    def encoder(self) -> ThreadPoolExecutor:
        if self._encoder is None:
            self._encoder = ThreadPoolExecutor(
                settings.threads(), thread_name_prefix="snapcore-encode"
            )
        return self._encoder

    def chunk_index(self, tier: str) -> dict[tuple[str, int, str], Location]:
        """Where the tier already stores each chunk content (from its committed manifests).

        Rebuilt whenever the tier's committed steps are not what this engine last saw: a
        `snapcore gc` or another process may have removed snapshots (and their files).
        """
        t = self.tier(tier)
        steps = frozenset(t.committed_steps())
        index = self._index.get(tier)
        if index is None or steps != self._index_steps.get(tier):
            index = {}
            self._index_steps[tier] = steps
            for step in sorted(steps):
                try:
                    self._add_to_index(index, t.read_manifest(step))
                except SnapcoreError as e:
                    log.warning("%s tier, step %d: not shared: %s", tier, step, e)
            self._index[tier] = index
        return index

    @staticmethod
    def _add_to_index(index: dict[tuple[str, int, str], Location], m: mf.Manifest) -> None:
        for b in m.blobs:
            for c in b.chunks:
                f = m.files[c.file]
                index.setdefault(
                    (c.xxh3, c.raw_length, c.codec), Location(f.name, c.offset, c.length, f.size)
                )

    def after_commit(self, tier: str, m: mf.Manifest) -> None:
        """Record a commit's chunks, then apply the tier's retention."""
        index = self._index.get(tier)
        if index is not None:
            self._add_to_index(index, m)
            self._index_steps[tier] = self._index_steps.get(tier, frozenset()) | {m.step}
        t = self.tier(tier)
        if tier == "remote" and not self._remote_collected:
            self._remote_collected = True  # leftovers of uploads a crash interrupted
            removed = t.collect()
            if removed:
                log.info("remote tier: removed %d leftover object(s)", len(removed))
        protected = self._uploading if tier == "local" else set()
        doomed = [
            s
            for s in self.config.retention_for(tier).doomed(t.committed_steps())
            if s not in protected
        ]
        for step in doomed:
            t.uncommit(step)
        if doomed:
            self._index[tier] = None  # shared chunks may have gone with them
            removed = t.collect()
            log.info("%s tier: retention removed steps %s (%d files)", tier, doomed, len(removed))

    # -- internals ------------------------------------------------------------------------
    def _wanted(self, tiers: Iterable[str] | None) -> tuple[str, ...]:
        have = self.config.tiers
        if tiers is None:
            return have
        asked = set(tiers)
        bad = asked - set(have)
        if bad:
            raise ValueError(f"tiers {sorted(bad)} are not configured (this store has {have})")
        if "remote" in asked and "local" not in asked and self.local is not None:
            asked.add("local")  # uploads are read from the local copy
        return tuple(t for t in TIER_ORDER if t in asked)

    def _raise_unreported(self) -> None:
        for h in self._handles:
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
            self._slot_last = slot
        fut = self._slot_free[slot]
        if fut is not None:
            fut.result()
        return slot

    def _prepare_slot(self, slot: int, size: int) -> Future[None] | None:
        """Allocate and fault a slot's arena in the background (off the training thread)
        unless it is big enough or in use; the next save of that slot waits for it."""
        arena, busy = self.arenas[slot], self._slot_free[slot]
        if (arena is not None and arena.size >= size) or (busy is not None and not busy.done()):
            return None
        if self._preparer is None:
            self._preparer = ThreadPoolExecutor(1, thread_name_prefix="snapcore-prepare")
        fut = self._slot_free[slot] = self._preparer.submit(self._try_arena, slot, size)
        return fut

    def _try_arena(self, slot: int, size: int) -> None:
        try:
            self._arena(slot, size)
        except Exception as e:  # the next save allocates it again, and raises then
            log.warning("could not prepare arena slot %d in the background: %s", slot, e)

    def _arena(self, slot: int, size: int) -> HostArena:
        arena = self.arenas[slot]
        if arena is None or arena.size < size:
            if arena is not None:
                arena.close()
                self.arenas[slot] = None
            shm = self.host.slot_path(slot) if self.host is not None else None
            if shm is not None:
                with contextlib.suppress(FileNotFoundError):
                    shm.unlink()  # a fresh file: its old size and contents mean nothing now
            arena = self.arenas[slot] = HostArena(size, shm)
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

    def _copier(self, device: torch.device) -> Any:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx not in self._copiers:
            self._copiers[idx] = _native.CudaCopier(idx)
        return self._copiers[idx]

    def _stage_whole(
        self,
        arena: HostArena,
        layout: Layout,
        windows: queue.Queue[Window | _Aborted | None],
        optimizers: list[torch.optim.Optimizer] | None,
        handle: SaveHandle,
    ) -> None:
        w = Window(arena, 0, layout.total, 0, 0)
        protected = _optimizer_storages(optimizers) if optimizers else set()
        now = [b for b in layout.blobs if _storage_ptr(b) not in protected]
        later = [b for b in layout.blobs if _storage_ptr(b) in protected]
        self._copy(now, w, defer=False, wait_gpu="stream" if optimizers else "cpu")
        if later:
            handle._cuda_staged.extend(self._copy(later, w, defer=True, wait_gpu="none"))
            handle._deferred = True
            for opt in optimizers or []:
                protect(opt, handle)
        windows.put(w)

    def _stage_streaming(
        self,
        arena: HostArena,
        layout: Layout,
        windows: queue.Queue[Window | _Aborted | None],
        halves: list[threading.Event],
        handle: SaveHandle,
    ) -> None:
        half = arena.size // 2
        for i, start in enumerate(range(0, layout.total, half)):
            h = i % 2
            while not halves[h].wait(0.05):
                if handle.done("local"):
                    handle.wait()  # the writer failed: raise its error here
            halves[h].clear()
            w = Window(arena, start, min(start + half, layout.total), h * half, h)
            self._copy(layout.blobs, w, defer=False, wait_gpu="cpu")
            windows.put(w)

    def _copy(self, blobs: list[BlobPlan], w: Window, *, defer: bool, wait_gpu: str) -> list[Any]:
        """Copy the parts of ``blobs`` inside window ``w`` into the arena.

        CPU copies run now, or on the persist thread when ``defer``; CUDA copies are
        enqueued on the side stream and then waited for as ``wait_gpu`` says: "cpu"
        (block), "stream" (make the current stream wait), "none" (the caller decides).
        """
        host: list[tuple[int, int, int]] = []
        gathers: list[tuple[BlobPlan, int, int]] = []
        d2h: dict[torch.device, list[tuple[int, int, int]]] = {}
        arena = w.arena
        base = arena.address + w.arena_offset - w.start
        for b in blobs:
            s, e = max(b.offset, w.start), min(b.offset + b.nbytes, w.end)
            if s >= e:
                continue
            if b.device.type == "cpu":
                if b.raw:
                    host.append((base + s, b.src_ptr + s - b.offset, e - s))
                else:
                    gathers.append((b, s, e))
            elif b.device.type == "cuda":
                src_ptr = b.src_ptr
                if not b.raw:  # gather on the GPU first; the temporary lives until written
                    tmp = b.source.contiguous()
                    w.keep.append(tmp)
                    src_ptr = tmp.data_ptr()
                else:
                    w.keep.append(b.source)  # alive until the copy has run
                d2h.setdefault(b.device, []).append((base + s, src_ptr + s - b.offset, e - s))
            else:
                raise SnapcoreError(f"tensors on {b.device} are not supported")

        threads = settings.threads()
        nontemporal = sum(n for _, _, n in host) >= NONTEMPORAL_MIN

        def cpu_copies() -> None:
            _native.copy_host(host, threads, nontemporal=nontemporal)
            if gathers:
                with torch.no_grad():  # a source may require grad: the copy is not autograd's
                    _gather(gathers)

        def _gather(gathers: list[tuple[BlobPlan, int, int]]) -> None:
            for b, s, e in gathers:
                lo = w.arena_offset + s - w.start
                if s == b.offset and e == b.offset + b.nbytes:
                    arena.u8[lo : lo + b.nbytes].view(b.source.dtype).view(b.source.shape).copy_(
                        b.source
                    )
                else:  # streaming cut through a strided tensor: gather it, then slice
                    flat = b.source.contiguous().view(-1).view(torch.uint8)
                    arena.u8[lo : lo + e - s].copy_(flat[s - b.offset : e - b.offset])

        if defer:
            w.deferred.append(cpu_copies)
        else:
            cpu_copies()
        events = []
        for device, copies in d2h.items():
            stream = torch.cuda.current_stream(device).cuda_stream
            ev = self._copier(device).d2h(copies, stream)
            if wait_gpu == "cpu":
                ev.synchronize()
            elif wait_gpu == "stream":
                ev.make_stream_wait(stream)
            w.events.append(ev)
            events.append((device, ev))
        return events


def _storage_ptr(b: BlobPlan) -> int:
    return b.source.untyped_storage().data_ptr()


def _optimizer_storages(optimizers: list[torch.optim.Optimizer]) -> set[int]:
    """Storages the optimizers write in step(): their parameters and state tensors."""
    ptrs: set[int] = set()
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                ptrs.add(p.untyped_storage().data_ptr())
        for st in opt.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    ptrs.add(v.untyped_storage().data_ptr())
    return ptrs


class _Job:
    """One snapshot's persist work, run on the engine's persist thread."""

    def __init__(
        self,
        engine: Engine,
        handle: SaveHandle,
        layout: Layout,
        tree: dict[str, Any],
        windows: queue.Queue[Window | _Aborted | None],
        halves: list[threading.Event],
        slot: int,
        slot_free: Future[None],
    ) -> None:
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

    def run(self) -> None:
        h = self.handle
        upload: Future[None] | None = None
        try:
            local = self.engine.local
            if "local" in h.tiers and local is not None:
                # Off the training thread: the leftovers of a crashed writer, then our lock.
                local.store.collect_leftovers()
                self.pending = local.store.begin(h.step)
            if h.stats.streaming:
                self._run_streaming()
            else:
                upload = self._run_whole()
        except BaseException as e:
            # A staging error was raised to the caller already: only the rest is news.
            level = logging.DEBUG if isinstance(e, _StagingAborted) else logging.ERROR
            log.log(
                level,
                "snapshot of step %d to %s failed: %s",
                h.step,
                self.engine.config.describe(),
                e,
            )
            h._mark_staged()
            for half in self.halves:
                half.set()
            if self.pending is not None and not self.pending.committed:
                with contextlib.suppress(Exception):
                    self.pending.abort()
            self._settle()  # the host commit, if it happens, resolves its own tier
            for tier in h.tiers:
                h._resolve(tier, e)
        finally:
            self._settle()
            self._release_slot(upload)

    def _settle(self) -> None:
        """Wait for every helper thread still reading the arena (the slot is then free)."""
        for fut in self.helpers:
            with contextlib.suppress(BaseException):
                fut.result()

    def _release_slot(self, upload: Future[None] | None) -> None:
        if upload is None:
            self.slot_free.set_result(None)
        else:  # the uploader reads the arena: the slot stays busy until it is done
            upload.add_done_callback(lambda _: self.slot_free.set_result(None))

    def _take_window(self) -> Window | None:
        w = self.windows.get()
        if isinstance(w, _Aborted):
            raise _StagingAborted(
                f"staging of step {self.handle.step} was interrupted"
            ) from w.error
        if w is None:
            return None
        for copy in w.deferred:
            copy()
        for ev in w.events:
            ev.synchronize()
        w.keep.clear()
        if self.handle._deferred:
            self.handle._mark_staged()
        return w

    def _run_whole(self) -> Future[None] | None:
        engine, h = self.engine, self.handle
        w = self._take_window()
        end = self._take_window()
        if w is None or end is not None:
            raise SnapcoreError(f"step {h.step}: expected one staged window")
        s = Staged(
            h.step,
            self.layout,
            self.tree,
            w.arena,
            self.slot,
            chunk_list(self.layout, settings.chunk_bytes()),
        )
        ready = [threading.Event() for _ in s.chunks]

        def after_hashing() -> None:
            if "host" in h.tiers:
                try:
                    commit_host(engine, s, h)
                except BaseException as e:
                    h._resolve("host", e)
                else:
                    h._resolve("host")

        hashing = engine._hasher.submit(hash_chunks, s, ready, after_hashing)
        self.helpers.append(hashing)
        local_m = None
        if "local" in h.tiers:
            assert self.pending is not None and engine.local is not None
            resaved = h.step in engine.local.committed_steps()
            local_m = LocalWriter(engine, s, self.pending, h, self.helpers).write(ready, hashing)
            hashing.result()
            if "remote" in h.tiers:
                engine._uploading.add(h.step)  # before retention can drop it
            self.pending.commit(local_m)
            h._resolve("local")  # durable: retention's deletions are not the caller's wait
            try:  # housekeeping: it cannot undo the commit, so its errors are warnings
                if resaved:  # the old files of a re-saved step may now be unreferenced
                    engine._index["local"] = None  # it may point into them
                    engine.local.collect()
                engine.after_commit("local", local_m)
            except Exception as e:
                h.warn(f"local tier: housekeeping after the commit of step {h.step} failed: {e}")
        hashing.result()
        if "remote" not in h.tiers:
            return None
        from .upload import Upload

        if local_m is not None:
            job = Upload(engine, h, engine.local, local_m)  # type: ignore[arg-type]
        else:  # no local tier: upload straight from host memory
            locs = [Location("arena", off, n, w.arena.size) for _, _, off, n in s.chunks]
            m = build_manifest(s, locs, ["none"] * len(locs), [n for *_, n in s.chunks])
            job = Upload(engine, h, engine.local, m, arena=w.arena)  # type: ignore[arg-type]

        def upload() -> None:
            try:
                job.run()
            finally:
                engine._uploading.discard(h.step)

        fut = engine._upload.submit(upload)
        return fut if local_m is None else None

    def _run_streaming(self) -> None:
        """The state is larger than the budget: write the image window by window."""
        engine, layout, h = self.engine, self.layout, self.handle
        assert self.pending is not None and engine.local is not None
        chunks = layout.chunks(settings.chunk_bytes())
        digests: list[list[str]] = [[""] * len(c) for c in chunks]
        partial: dict[tuple[int, int], Any] = {}
        name = self.pending.data_name(0)
        writer = _native.FileWriter(
            str(engine.local_root / name), direct=settings.o_direct() == "auto"
        )
        h.stats.o_direct = writer.direct
        written = 0
        try:
            while (w := self._take_window()) is not None:
                hashed = engine._hasher.submit(_hash_window, w, chunks, digests, partial)
                self.helpers.append(hashed)
                writer.write_at(w.start, w.arena.address + w.arena_offset, w.end - w.start)
                hashed.result()
                written = w.end
                self.halves[w.half].set()
            writer.sync()
        finally:
            writer.close()
        if written != layout.total or any(not d for ds in digests for d in ds):
            raise SnapcoreError(f"step {h.step}: the image was not staged whole")
        files = [mf.FileRef(name, layout.total)]
        blobs = [
            mf.Blob(
                b.nbytes,
                [mf.Chunk(0, off, n, digests[i][j]) for j, (off, n) in enumerate(chunks[i])],
                b.element_size,
            )
            for i, b in enumerate(layout.blobs)
        ]
        m = mf.Manifest(
            step=h.step,
            created_unix=time.time(),
            writer=writer_info(),
            world_size=1,
            rank_files=[[0]],
            files=files,
            blobs=blobs,
            tensors=layout.entries,
            tree=self.tree,
        )
        resaved = h.step in engine.local.committed_steps()
        self.pending.commit(m)
        h.stats.written["local"] = layout.total
        h._resolve("local")
        try:
            if resaved:
                engine._index["local"] = None
                engine.local.collect()
            engine.after_commit("local", m)
        except Exception as e:
            h.warn(f"local tier: housekeeping after the commit of step {h.step} failed: {e}")


def _done() -> Future[None]:
    f: Future[None] = Future()
    f.set_result(None)
    return f


class _StagingAborted(SnapcoreError):
    """The persist side of a snapshot whose staging raised (to the caller of the save)."""


@dataclass
class _Aborted:
    """Put in the window queue when staging failed: nothing may be committed."""

    error: BaseException


def _hash_window(
    w: Window,
    chunks: list[list[tuple[int, int]]],
    digests: list[list[str]],
    partial: dict[tuple[int, int], Any],
) -> None:
    for i, blob_chunks in enumerate(chunks):
        for j, (off, n) in enumerate(blob_chunks):
            s, e = max(off, w.start), min(off + n, w.end)
            if s >= e:
                continue
            view = w.arena.view(w.arena_offset + s - w.start, e - s)
            if s == off and e == off + n:
                digests[i][j] = xxhash.xxh3_128_hexdigest(view)
                continue
            hasher = partial.setdefault((i, j), xxhash.xxh3_128())
            hasher.update(view)
            if e == off + n:
                digests[i][j] = partial.pop((i, j)).hexdigest()


_engines: dict[tuple[Any, ...], Engine] = {}
_engines_lock = threading.Lock()


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
    durable (or fail), arenas are freed, remote connections closed, writer locks dropped.
    A failure nobody saw is logged, or with ``raise_first`` raised once all are closed."""
    with _engines_lock:
        engines = list(_engines.values())
        _engines.clear()
    _close_engines(engines, raise_first=raise_first)


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


atexit.register(_close_at_exit)


# -- the writer lock -----------------------------------------------------------------------

_writer_locks: dict[str, list[int]] = {}  # lock path -> [fd, engines of this process]
_writer_locks_lock = threading.Lock()


def _take_writer_lock(directory: Path, describe: str) -> str:
    """Hold ``directory``/writer.lock for this process (engines of one process share it);
    raise StoreInUse when another live process holds it. Returns the lock's path."""
    path = str(directory / WRITER_LOCK)
    with _writer_locks_lock:
        held = _writer_locks.get(path)
        if held is not None:
            held[1] += 1
            return path
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise StorageError(
                e.errno, f"cannot open the writer lock of {describe}: {e.strerror}", path
            ) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _lock_holder(fd)
            os.close(fd)
            pid, host = holder.get("pid"), holder.get("host")
            who = f"pid {pid} on {host}" if pid is not None else "a process that did not say"
            raise StoreInUse(
                f"{describe} is being saved to by another live process ({who}; it holds "
                f"{path}): two writers would delete each other's snapshots. Save to another "
                "store, or end that process first",
                path=path,
                pid=pid if isinstance(pid, int) else None,
                host=host if isinstance(host, str) else None,
            ) from None
        except OSError as e:  # a file system without flock: a second writer goes unseen
            log.warning("no writer lock on %s (%s): a second writer is not detected", path, e)
        me = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()})
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, me.encode(), 0)
        _writer_locks[path] = [fd, 1]
        return path


def _release_writer_lock(path: str) -> None:
    with _writer_locks_lock:
        held = _writer_locks.get(path)
        if held is None:
            return
        held[1] -= 1
        if held[1] == 0:
            del _writer_locks[path]
            os.close(held[0])  # drops the flock; the file stays (unlinking it would race)


def writer_lock_holder(directory: Path) -> dict[str, Any] | None:
    """Who holds ``directory``'s writer lock (pid, host, since, as far as it says), or
    None when no live process does. Engines of this process count as holders."""
    path = str(directory / WRITER_LOCK)
    with _writer_locks_lock:
        held = _writer_locks.get(path)
        if held is not None:
            return _lock_holder(held[0])
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _lock_holder(fd)
    finally:
        os.close(fd)
    return None


def _lock_holder(fd: int) -> dict[str, Any]:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}
