"""The save path: stage tensors into the host arena, persist it, commit the manifest.

One ``Engine`` per store directory owns a host arena (allocated and faulted once, reused),
a persist thread and the last snapshot's handle. The caller's thread only stages; the
persist thread hashes and writes while the hasher thread hashes the same bytes, and both
spend their time in native code that has released the GIL.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import queue
import socket
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import xxhash

from . import _native, settings
from . import manifest as mf
from .errors import SnapcoreError, SnapshotFailed
from .layout import BlobPlan, Layout, align_up, plan
from .store import LocalStore, Pending
from .tree import flatten

log = logging.getLogger(__name__)

PAGE = _native.page_size()
MIN_WINDOW = 8 << 20  # the smallest streaming window: the "small constant buffers"


class HostArena:
    """The native arena plus a byte view of it that torch and xxhash can use."""

    def __init__(self, size: int) -> None:
        self.native = _native.Arena(
            size,
            huge_pages=settings.huge_pages(),
            pin=True,
            prefault=True,
            threads=settings.threads(),
        )
        self.size = size
        self.address = self.native.address
        self._buf = (ctypes.c_char * size).from_address(self.address)
        self.u8 = (
            torch.frombuffer(self._buf, dtype=torch.uint8)
            if size
            else torch.empty(0, dtype=torch.uint8)
        )

    def view(self, offset: int, nbytes: int) -> memoryview:
        return memoryview(self._buf).cast("B")[offset : offset + nbytes]

    def close(self) -> None:
        self.u8 = torch.empty(0, dtype=torch.uint8)
        self.native.close()


@dataclass
class Window:
    """A byte range [start, end) of the data file, staged at ``arena_offset``."""

    start: int
    end: int
    arena_offset: int
    half: int
    deferred: list[Callable[[], None]] = field(
        default_factory=list
    )  # copies for the persist thread
    events: list[Any] = field(default_factory=list)  # CUDA events to wait for before reading
    keep: list[torch.Tensor] = field(default_factory=list)  # temporaries alive until written


@dataclass
class SaveStats:
    step: int
    bytes: int  # tensor bytes staged
    file_bytes: int  # bytes written to data files
    stall_s: float = 0.0  # time async_save blocked the caller
    staged_s: float = 0.0  # time until every copy had finished (state may change)
    durable_s: float = 0.0  # time until committed in the local store
    streaming: bool = False
    o_direct: bool = False


class SaveHandle:
    """The handle of one asynchronous snapshot."""

    def __init__(self, step: int, stats: SaveStats) -> None:
        self.step = step
        self.stats = stats
        self._future: Future[None] = Future()
        self._staged = threading.Event()
        self._cuda_staged: list[Any] = []
        self._t0 = time.perf_counter()
        self._reported = False
        self._deferred = False  # some copies run on the persist thread (overlap mode)

    def done(self) -> bool:
        """True once the snapshot is durable or has failed."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> SaveStats:
        """Block until the snapshot is durable; raise ``SnapshotFailed`` if it failed."""
        try:
            self._future.result(timeout)
        except TimeoutError:
            raise
        except BaseException as e:
            self._reported = True
            if isinstance(e, SnapshotFailed):
                raise
            raise SnapshotFailed(f"snapshot of step {self.step} failed: {e}", step=self.step) from e
        return self.stats

    def staged(self, timeout: float | None = None) -> None:
        """Block until the snapshot no longer reads the live state (safe to modify it).

        For CUDA tensors this makes the current stream wait for the copies (no CPU block).
        """
        for device, ev in self._cuda_staged:
            ev.make_stream_wait(torch.cuda.current_stream(device).cuda_stream)
        while not self._staged.wait(0.05 if timeout is None else timeout):
            if self._future.done():
                break
            if timeout is not None:
                raise TimeoutError(f"snapshot of step {self.step} not staged after {timeout}s")
        if not self._staged.is_set():
            self.wait()  # it failed before staging: raise that

    def __repr__(self) -> str:
        state = "done" if self.done() else "in flight"
        return f"<SaveHandle step={self.step} {state}>"


# Optimizers whose step() must wait for overlapped copies, and the handles they wait on.
_hooked: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[SaveHandle]] = (
    weakref.WeakKeyDictionary()
)


def _optimizer_pre_hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    handles = _hooked.get(opt)
    if handles:
        for h in handles:
            h.staged()
        handles.clear()


def _protect(opt: torch.optim.Optimizer, handle: SaveHandle) -> None:
    if opt not in _hooked:
        _hooked[opt] = []
        opt.register_step_pre_hook(_optimizer_pre_hook)
    _hooked[opt].append(handle)


class Engine:
    """Saves to one local store; thread-safe (one snapshot in flight at a time)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.store = LocalStore(root)
        self.arena: HostArena | None = None
        self._lock = threading.Lock()
        self._persist = ThreadPoolExecutor(1, thread_name_prefix="snapcore-persist")
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="snapcore-hash")
        self._last: SaveHandle | None = None
        self._copiers: dict[int, Any] = {}

    # -- public ---------------------------------------------------------------------------
    def async_save(
        self, state: object, step: int, *, overlap: bool = False, budget: int | None = None
    ) -> SaveHandle:
        t0 = time.perf_counter()
        with self._lock:
            self._raise_unreported()
            flat = flatten(state)
            layout = plan(flat.tensors)
            if self._last is not None:  # the arena is in use until the last one is written
                with contextlib.suppress(BaseException):
                    self._last._future.exception()
                self._raise_unreported()
            self.store.ensure()
            self.store.collect_leftovers()
            streaming = budget is not None and budget < layout.total
            size = self._arena_size(layout, budget)
            if self.arena is None or self.arena.size < size:
                if self.arena is not None:
                    self.arena.close()
                    self.arena = None
                self.arena = HostArena(size)
            stats = SaveStats(step, layout.data_bytes, layout.total, streaming=streaming)
            handle = SaveHandle(step, stats)
            handle._t0 = t0
            pending = self.store.begin(step)
            try:
                windows: queue.Queue[Window | None] = queue.Queue()
                halves = [threading.Event(), threading.Event()]
                for h in halves:
                    h.set()
                job = _Job(self, handle, pending, layout, flat.tree, windows, halves)
                self._persist.submit(job.run)
                self._last = handle
                if streaming:
                    if overlap:
                        log.warning(
                            "overlap mode is off for step %d: the state exceeds the budget", step
                        )
                    self._stage_streaming(layout, size, windows, halves, handle)
                else:
                    self._stage_whole(layout, windows, flat.optimizers if overlap else None, handle)
            except BaseException:
                windows.put(None)
                raise
            windows.put(None)
            if not handle._deferred:
                _mark_staged(handle)
            stats.stall_s = time.perf_counter() - t0
            return handle

    def wait(self) -> None:
        last = self._last
        if last is not None:
            last.wait()

    def close(self) -> None:
        with contextlib.suppress(SnapcoreError):
            self.wait()
        self._persist.shutdown(wait=True)
        self._hasher.shutdown(wait=True)
        for c in self._copiers.values():
            c.close()
        if self.arena is not None:
            self.arena.close()
            self.arena = None

    # -- internals ------------------------------------------------------------------------
    def _raise_unreported(self) -> None:
        last = self._last
        if last is None or not last.done() or last._reported:
            return
        exc = last._future.exception()
        if exc is not None:
            last._reported = True
            raise SnapshotFailed(
                f"the previous snapshot (step {last.step}) to {self.store.root} failed: {exc}",
                step=last.step,
            ) from exc

    @staticmethod
    def _arena_size(layout: Layout, budget: int | None) -> int:
        if budget is None or budget >= layout.total:
            return max(align_up(layout.total, PAGE), PAGE)
        half = max(budget // 2 // PAGE * PAGE, MIN_WINDOW)
        return 2 * half

    def _copier(self, device: torch.device) -> Any:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx not in self._copiers:
            self._copiers[idx] = _native.CudaCopier(idx)
        return self._copiers[idx]

    def _stage_whole(
        self,
        layout: Layout,
        windows: queue.Queue[Window | None],
        optimizers: list[torch.optim.Optimizer] | None,
        handle: SaveHandle,
    ) -> None:
        w = Window(0, layout.total, 0, 0)
        protected: set[int] = set()
        if optimizers:
            protected = _optimizer_storages(optimizers)
        now = [b for b in layout.blobs if _storage_ptr(b) not in protected]
        later = [b for b in layout.blobs if _storage_ptr(b) in protected]
        self._copy(now, w, defer=False, wait_gpu="cpu" if not optimizers else "stream")
        if later:
            events = self._copy(later, w, defer=True, wait_gpu="none")
            handle._cuda_staged.extend(events)
            handle._deferred = True
            for opt in optimizers or []:
                _protect(opt, handle)
        windows.put(w)

    def _stage_streaming(
        self,
        layout: Layout,
        size: int,
        windows: queue.Queue[Window | None],
        halves: list[threading.Event],
        handle: SaveHandle,
    ) -> None:
        half = size // 2
        for i, start in enumerate(range(0, layout.total, half)):
            h = i % 2
            while not halves[h].wait(0.05):
                if handle._future.done():
                    handle.wait()  # the writer failed: raise its error here
            halves[h].clear()
            w = Window(start, min(start + half, layout.total), h * half, h)
            self._copy(layout.blobs, w, defer=False, wait_gpu="cpu")
            windows.put(w)

    def _copy(self, blobs: list[BlobPlan], w: Window, *, defer: bool, wait_gpu: str) -> list[Any]:
        """Copy the parts of ``blobs`` inside window ``w`` into the arena.

        CPU copies run now, or on the persist thread when ``defer``; CUDA copies are
        enqueued on the side stream and then waited for as ``wait_gpu`` says: "cpu"
        (block), "stream" (make the current stream wait), "none" (the caller decides).
        """
        assert self.arena is not None
        host: list[tuple[int, int, int]] = []
        gathers: list[tuple[BlobPlan, int, int]] = []
        d2h: dict[torch.device, list[tuple[int, int, int]]] = {}
        base = self.arena.address + w.arena_offset - w.start
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
                d2h.setdefault(b.device, []).append((base + s, src_ptr + s - b.offset, e - s))
            else:
                raise SnapcoreError(f"tensors on {b.device} are not supported")

        threads = settings.threads()
        arena = self.arena

        def cpu_copies() -> None:
            _native.copy_host(host, threads)
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


def _mark_staged(h: SaveHandle) -> None:
    if not h._staged.is_set():
        h.stats.staged_s = time.perf_counter() - h._t0
        h._staged.set()


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
        pending: Pending,
        layout: Layout,
        tree: dict[str, Any],
        windows: queue.Queue[Window | None],
        halves: list[threading.Event],
    ) -> None:
        self.engine = engine
        self.handle = handle
        self.pending = pending
        self.layout = layout
        self.tree = tree
        self.windows = windows
        self.halves = halves

    def run(self) -> None:
        h = self.handle
        try:
            self._run()
        except BaseException as e:
            h._staged.set()
            for half in self.halves:
                half.set()
            with contextlib.suppress(Exception):
                self.pending.abort()
            log.error("snapshot of step %d to %s failed: %s", h.step, self.engine.store.root, e)
            h._future.set_exception(e)
        else:
            h._future.set_result(None)

    def _run(self) -> None:
        engine, layout, h = self.engine, self.layout, self.handle
        arena = engine.arena
        assert arena is not None
        chunk_bytes = settings.chunk_bytes()
        chunks = layout.chunks(chunk_bytes)
        digests: list[list[str]] = [[""] * len(c) for c in chunks]
        partial: dict[tuple[int, int], Any] = {}
        name = self.pending.data_name(0)
        path = engine.store.root / name
        writer = _native.FileWriter(str(path), direct=settings.o_direct() == "auto")
        h.stats.o_direct = writer.direct
        try:
            while True:
                w = self.windows.get()
                if w is None:
                    break
                for copy in w.deferred:
                    copy()
                for ev in w.events:
                    ev.synchronize()
                w.keep.clear()
                if h._deferred:
                    _mark_staged(h)
                hashed = engine._hasher.submit(_hash_window, arena, w, chunks, digests, partial)
                writer.write_at(w.start, arena.address + w.arena_offset, w.end - w.start)
                hashed.result()
                self.halves[w.half].set()
            writer.sync()
        finally:
            writer.close()
        h._staged.set()
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
            writer={
                "snapcore": _version(),
                "torch": torch.__version__,
                "host": socket.gethostname(),
                "pid": os.getpid(),
            },
            world_size=1,
            rank_files=[[0]],
            files=files,
            blobs=blobs,
            tensors=layout.entries,
            tree=self.tree,
        )
        self.pending.commit(m)
        engine.store.collect_leftovers(step=h.step)  # a re-saved step's old files
        h.stats.durable_s = time.perf_counter() - h._t0


def _hash_window(
    arena: HostArena,
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
            view = arena.view(w.arena_offset + s - w.start, e - s)
            if s == off and e == off + n:
                digests[i][j] = xxhash.xxh3_128_hexdigest(view)
                continue
            hasher = partial.setdefault((i, j), xxhash.xxh3_128())
            hasher.update(view)
            if e == off + n:
                digests[i][j] = partial.pop((i, j)).hexdigest()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("snapcore")
    except PackageNotFoundError:
        return "unknown"


_engines: dict[Path, Engine] = {}
_engines_lock = threading.Lock()


def engine_for(store: str | os.PathLike[str]) -> Engine:
    root = Path(store).absolute()
    with _engines_lock:
        e = _engines.get(root)
        if e is None:
            e = _engines[root] = Engine(root)
        return e
