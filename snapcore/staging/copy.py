"""Copies from the state into the arena: CPU tensors with the native parallel copy (or a
torch gather for strided ones), CUDA tensors with the native copier on a side stream."""

from __future__ import annotations

import contextlib
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from .. import _native, settings
from ..errors import SnapcoreError
from ..io_types import Aborted, Progress, Window
from ..planning.layout import BlobPlan, Layout
from ..tree import local_shard
from .arena import HostArena
from .handle import SaveHandle, protect

# Staging copies at least this large use streaming stores: the arena is far larger than the
# caches and is read next by the hasher and the disk, not by this core. memcpy would use
# ordinary stores for tensors under a few hundred MB each, reading every destination line
# before writing it (see _native.copy_host): 16-17 GB/s here against 22-25 GB/s.
NONTEMPORAL_MIN = 64 << 20

# The pipelined whole mode stages the image in segments of about this many bytes (whole
# blobs), and the persist thread hashes and writes each one once it is staged.
PIPELINE_SEGMENT = 32 << 20


def refuse_overlap_in_graph_capture() -> None:
    """Overlap mode while a CUDA graph is being captured on the current stream would record
    the copies' ordering and the optimizer hook's stream wait into the graph instead of
    running them: refused with an error saying so."""
    # CUDA never initialised: no stream can be capturing (and a CPU build has no capture).
    if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
        raise SnapcoreError(
            "async_save(..., overlap=True) was called while a CUDA graph is being captured "
            "on the current stream (torch.cuda.is_current_stream_capturing()): its copies "
            "and the optimizer's stream wait would be captured into the graph instead of "
            "run. Save outside the capture, or without overlap=True"
        )


class Stager:
    """Stages a snapshot's blobs into an arena, window by window (one engine's copiers)."""

    def __init__(self) -> None:
        self._copiers: dict[int, Any] = {}
        # Overlap mode's CPU copies: on a thread of their own, not the persist thread, so
        # that the optimizer's step waits for them alone, never behind the previous
        # snapshot's hashing, writing and commit.
        self._overlap: ThreadPoolExecutor | None = None

    def close(self) -> None:
        if self._overlap is not None:
            self._overlap.shutdown(wait=True)
            self._overlap = None
        for c in self._copiers.values():
            c.close()
        self._copiers.clear()

    def copier(self, device: torch.device) -> Any:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx not in self._copiers:
            self._copiers[idx] = _native.CudaCopier(idx)
        return self._copiers[idx]

    def stage_pipelined(
        self, arena: HostArena, layout: Layout, windows: queue.Queue[Window | Aborted | None]
    ) -> Progress:
        """Stage the whole image of CPU tensors (the default mode) so that the persist
        thread reads it while it is staged: the window goes to the persist thread first,
        then the blobs are copied in arena order, in segments of about
        ``PIPELINE_SEGMENT`` bytes (whole blobs), and after each one the window's
        ``progress`` says how far the image is staged. Returns that progress (the caller
        ends it once the snapshot's last item is queued); a failure fails it, so that the
        persist thread stops and commits nothing."""
        progress = Progress()
        w = Window(arena, 0, layout.total, 0, 0, progress=progress)
        blobs = sorted(layout.blobs, key=lambda b: b.offset)
        nontemporal = sum(b.nbytes for b in blobs if b.raw) >= NONTEMPORAL_MIN
        try:
            windows.put(w)  # inside: an interrupt right after it still fails the progress
            segment: list[BlobPlan] = []
            size = 0
            for i, b in enumerate(blobs):
                segment.append(b)
                size += b.nbytes
                if size >= PIPELINE_SEGMENT or i == len(blobs) - 1:
                    self.copy(segment, w, defer=False, wait_gpu="cpu", nontemporal=nontemporal)
                    progress.advance(b.offset + b.nbytes)
                    segment, size = [], 0
            progress.advance(layout.total)
        except BaseException as e:
            progress.fail(e)
            raise
        return progress

    def stage_whole(
        self,
        arena: HostArena,
        layout: Layout,
        windows: queue.Queue[Window | Aborted | None],
        optimizers: list[torch.optim.Optimizer] | None,
        handle: SaveHandle,
    ) -> None:
        w = Window(arena, 0, layout.total, 0, 0)
        protected = _optimizer_storages(optimizers) if optimizers else set()
        now: list[BlobPlan] = []
        later: list[BlobPlan] = []
        for b in layout.blobs:
            (later if protected and _storage_ptr(b) in protected else now).append(b)
        try:
            self.copy(now, w, defer=False, wait_gpu="stream" if optimizers else "cpu")
            if later:
                events = self.copy(later, w, defer=True, wait_gpu="none")
                host = self._run_deferred(w, events, handle)
                handle.defer_staging(events, host)
                for opt in optimizers or []:
                    protect(opt, handle)
        except BaseException:
            # Overlap mode: copies queued on other devices (or running on the overlap
            # thread) still write into the arena and read their sources. They finish
            # before the error goes up: the arena is reused and the sources freed after.
            settle_window(w)
            raise
        windows.put(w)

    def _run_deferred(
        self, w: Window, events: list[tuple[torch.device, Any]], handle: SaveHandle
    ) -> Future[None]:
        """Start overlap mode's CPU copies (``w.deferred``) on the overlap thread; returns
        the future of the CPU copies alone, which the optimizer's step waits for. The same
        thread then waits for the CUDA copies (sleeping: blocking-sync events) and marks
        the snapshot staged; the persist thread waits for ``w.pending`` before reading."""
        copies, w.deferred = w.deferred, []
        host: Future[None] = Future()
        host.set_running_or_notify_cancel()

        def run() -> None:
            try:
                for c in copies:
                    c()
            except BaseException as e:
                host.set_exception(e)  # the persist job fails the snapshot with it
                raise
            else:
                host.set_result(None)
            for _, ev in events:
                ev.synchronize()
            handle.mark_staged()

        if self._overlap is None:
            self._overlap = ThreadPoolExecutor(1, thread_name_prefix="snapcore-overlap")
        w.pending.append(self._overlap.submit(run))
        return host

    def stage_streaming(
        self,
        arena: HostArena,
        layout: Layout,
        windows: queue.Queue[Window | Aborted | None],
        halves: list[threading.Event],
        handle: SaveHandle,
    ) -> None:
        half = arena.size // 2
        gathered: dict[int, torch.Tensor] = {}  # strided CUDA tensors, gathered once
        for i, start in enumerate(range(0, layout.total, half)):
            h = i % 2
            while not halves[h].wait(0.05):
                if handle.done("local"):
                    handle.wait()  # the writer failed: raise its error here
            halves[h].clear()
            w = Window(arena, start, min(start + half, layout.total), h * half, h)
            self.copy(layout.blobs, w, defer=False, wait_gpu="cpu", gathered=gathered)
            windows.put(w)

    def copy(
        self,
        blobs: list[BlobPlan],
        w: Window,
        *,
        defer: bool,
        wait_gpu: str,
        gathered: dict[int, torch.Tensor] | None = None,
        nontemporal: bool | None = None,
    ) -> list[Any]:
        """Copy the parts of ``blobs`` inside window ``w`` into the arena.

        A strided CUDA tensor is gathered on its GPU into a contiguous temporary first;
        ``gathered`` (streaming) keeps that temporary from the first window that cuts the
        tensor to the last, so that it is gathered once per snapshot, not once per window.
        ``nontemporal``: whether CPU copies use streaming stores (None: when they add up to
        ``NONTEMPORAL_MIN`` bytes or more).

        Every device's CUDA copies are queued on its side stream first, then the CPU
        copies run (now, or, when ``defer``, later: put in ``w.deferred``, which
        ``stage_whole`` hands to the overlap thread) while the GPUs copy, then the CUDA
        copies are waited for as ``wait_gpu`` says: "cpu" (block), "stream" (make the
        current stream wait), "none" (the caller decides). If queueing fails on one
        device, the copies already queued on the others are waited for before raising.
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
                    tmp = gathered.get(id(b)) if gathered is not None else None
                    if tmp is None:
                        tmp = b.source.contiguous()
                    if gathered is not None:  # kept for the next window, up to the last
                        if e < b.offset + b.nbytes:
                            gathered[id(b)] = tmp
                        else:
                            gathered.pop(id(b), None)
                    w.keep.append(tmp)
                    src_ptr = tmp.data_ptr()
                else:
                    w.keep.append(b.source)  # alive until the copy has run
                d2h.setdefault(b.device, []).append((base + s, src_ptr + s - b.offset, e - s))
            else:
                raise SnapcoreError(f"tensors on {b.device} are not supported")

        threads = settings.threads()
        if nontemporal is None:  # (the pipelined mode decides it for the whole image)
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

        events: list[tuple[torch.device, Any]] = []
        streams: list[int] = []
        try:
            for device, copies in d2h.items():
                stream = torch.cuda.current_stream(device).cuda_stream
                events.append((device, self.copier(device).d2h(copies, stream)))
                streams.append(stream)
            w.events.extend(ev for _, ev in events)
            if defer:
                w.deferred.append(cpu_copies)
            else:
                cpu_copies()  # while the GPUs copy
        except BaseException:
            for _, ev in events:  # nothing they read or write may be freed before they ran
                with contextlib.suppress(Exception):
                    ev.synchronize()
            raise
        for (_, ev), stream in zip(events, streams, strict=True):
            if wait_gpu == "cpu":
                ev.synchronize()
            elif wait_gpu == "stream":
                ev.make_stream_wait(stream)
        return events


def settle_window(w: Window) -> None:
    """Wait, raising nothing, for every copy of ``w`` already queued or running."""
    for fut in w.pending:
        with contextlib.suppress(BaseException):
            fut.result()
    for ev in w.events:
        with contextlib.suppress(Exception):
            ev.synchronize()


def _storage_ptr(b: BlobPlan) -> int:
    return b.source.untyped_storage().data_ptr()


def _optimizer_storages(optimizers: list[torch.optim.Optimizer]) -> set[int]:
    """Storages the optimizers write in step(): their parameters and state tensors."""
    ptrs: set[int] = set()

    def add(t: torch.Tensor) -> None:  # a DTensor: its shard's storage, what is staged
        ptrs.add(local_shard(t).untyped_storage().data_ptr())

    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                add(p)
        for st in opt.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    add(v)
    return ptrs
