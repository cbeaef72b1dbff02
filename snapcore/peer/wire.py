"""One round of copies between ranks over snapcore's peer group: torch.distributed's
point-to-point ``isend``/``irecv`` on a gloo group of its own, no protocol of our own
below that. Every rank of a round posts its sends and its receives of each stage, then
waits for all of them, so that a ring (each rank both sends and receives) cannot
deadlock:

1. a header per copy (int64: magic, status, description length, data length);
2. the description: the step's index, the part (their bytes), as JSON;
3. the receiver's answer: accepted, or refused with its reason (memory full, a copy of
   the wrong step, a part that does not match its index);
4. the data files the part names, in pieces of ``piece_bytes`` sent from the sender's
   read-only mappings of its files straight into the receiver's shared mappings of the
   copy's files (faulted in ahead of them), ``WINDOW`` pieces in flight, or one at a
   time paced to ``rate`` bytes per second when one is set (the sender sleeps between
   pieces);
5. the receiver's verdict once every chunk's XXH3-128 matched and the copy is
   committed (or why not).

A rank that dies mid-round makes the ranks talking to it fail at once (gloo reports the
reset connection) or after the group's timeout; that is ``PeerLinkError``. A rank whose
partners are alive but gave up the round (their own partner died) learns it from the
job's store (``stop``: the peer tier disabled on another rank), which it asks every
``STOP_POLL_S`` while it waits, and gives up too, rather than waiting for the group's
timeout: the operations are waited for on a thread of their own (``snapcore-peer-wait``),
since gloo's point-to-point operations say they are done only to ``wait()``, and a
``wait()`` with a timeout of its own fails the whole group.

After a failed round, gloo may still read from the sender's mappings and write into the
receiver's (an operation pending on a live pair is not cancelled; one on a reset pair
may still be in its I/O thread's hands): nothing it may touch is unmapped or freed.
The round's operations, buffers and mappings are kept until the process ends
(``_kept``); the peer tier is disabled for the rest of the job, so that happens once.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import SnapcoreError
from .area import Copy, Destination

__all__ = ["Incoming", "Outgoing", "PeerLinkError", "exchange"]

MAGIC = 0x5C9EE4
REPLY_BYTES = 1024
WINDOW = 4  # the data's pieces in flight per copy (unpaced)
POPULATE_STEP = 4 << 20  # a sent file's pages are mapped ahead of the wire by this much
MADV_POPULATE_READ = 22  # Linux 5.14
STOP_POLL_S = 0.25  # how often a rank waiting on its partners asks whether to give up

# What the operations of a failed round may still use (their Work objects, whose tensors
# own the buffers; the sent files' mappings; the received copies' mappings): never
# unmapped or freed, until the process ends.
_kept: list[Any] = []
_kept_lock = threading.Lock()


# The stages' times of this process's last round, in seconds (what benchmarks/bench_peer.py
# reports: where a transfer's time goes).
last_round: dict[str, float] = {}


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.mmap.restype = ctypes.c_void_p
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int
_MAP_FAILED = ctypes.c_void_p(-1).value


class Mapping:
    """A file's first ``size`` bytes mapped shared and read-only, as a uint8 tensor: the
    sender hands gloo its pieces straight from the file's memory (no copy into a buffer
    first). The files sent are never cut while a round reads them: a host slot stays
    reserved until its transfer is done, and is replaced by unlinking, never truncating;
    a peer namespace's files are rewritten only by rounds on the same thread.

    A fresh mapping has no page table entries: gloo's socket writes would fault them in
    one by one, on the wire's path (about 0.1 s per 512 MiB here). A thread of its own
    (``snapcore-peer-map``) maps them ahead of the wire instead (``MADV_POPULATE_READ``,
    in bulk); ``ready`` waits until a range is mapped."""

    def __init__(self, path: Path, size: int) -> None:
        self.size = size
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr is None or addr == _MAP_FAILED:
                err = ctypes.get_errno()
                raise OSError(err, f"mmap {path}: {os.strerror(err)}")
        finally:
            os.close(fd)
        self.addr = addr
        self.tensor = torch.frombuffer((ctypes.c_char * size).from_address(addr), dtype=torch.uint8)
        self._mapped = 0  # the bytes populated so far (all of them once it gave up)
        self._stop = False
        self._progress = threading.Condition()
        self._thread = threading.Thread(target=self._populate, name="snapcore-peer-map")
        self._thread.start()

    def _populate(self) -> None:
        try:
            for off in range(0, self.size, POPULATE_STEP):
                n = min(POPULATE_STEP, self.size - off)
                if self._stop or _libc.madvise(self.addr + off, n, MADV_POPULATE_READ) != 0:
                    return  # stopped, or a kernel older than 5.14: gloo faults them in
                with self._progress:
                    self._mapped = off + n
                    self._progress.notify_all()
        finally:
            with self._progress:
                self._mapped = self.size
                self._progress.notify_all()

    def ready(self, offset: int, nbytes: int) -> torch.Tensor:
        """Bytes ``[offset, +nbytes)``, once their pages are mapped."""
        with self._progress:
            self._progress.wait_for(lambda: self._mapped >= offset + nbytes)
        return self.tensor[offset : offset + nbytes]

    def stop(self) -> None:
        """Stop mapping ahead (the mapping stays)."""
        self._stop = True
        self._thread.join()

    def close(self) -> None:
        if self.addr is not None:
            self.stop()
            del self.tensor
            _libc.munmap(self.addr, self.size)
            self.addr = None


class PeerLinkError(SnapcoreError):
    """The transport failed mid-round (a partner died, or did not answer in time)."""


class _Waiter:
    """Waits for a round's operations on a thread of its own, batch after batch, while
    the peer thread asks ``stop`` every ``STOP_POLL_S`` whether to give up. Every
    operation it was handed stays in ``works`` (kept after a failure)."""

    def __init__(self, stop: Callable[[], str | None] | None, peers: list[int]) -> None:
        self.stop = stop
        self.peers = peers
        self.works: list[Any] = []
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="snapcore-peer-wait", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            works, done, failed = item
            for w in works:
                try:
                    w.wait()
                except BaseException as e:  # the first failure ends the batch's wait
                    if not failed:
                        failed.append(e)
                        done.set()
            done.set()

    def run(self, works: list[Any]) -> None:
        """Wait for ``works``; raises the first failure, or ``PeerLinkError`` once
        ``stop`` says why to give up."""
        self.works.extend(works)
        done = threading.Event()
        failed: list[BaseException] = []
        self._queue.put((works, done, failed))
        while not done.wait(STOP_POLL_S):
            why = self.stop() if self.stop is not None else None
            if why is not None:
                raise PeerLinkError(
                    f"gave up the peer transfer with ranks {self.peers}: the peer tier was "
                    f"disabled on another rank ({why})"
                )
        if failed:
            raise failed[0]

    def close(self) -> None:
        """No more batches (the thread ends once the one it waits for is done)."""
        self._queue.put(None)


@dataclass
class Outgoing:
    """A copy this rank sends to ``dst``: ``copy`` and its data files (``paths``, in the
    part's order), or ``error``: why it has none (told to the receiver)."""

    dst: int
    copy: Copy | None
    paths: list[Path]
    error: str | None = None
    maps: list[Mapping] = field(default_factory=list)  # the files, mapped read-only


@dataclass
class Incoming:
    """A copy this rank receives from ``src`` into ``dest``."""

    src: int
    dest: Destination


@dataclass
class Pacer:
    """Sleeps so that the bytes sent stay under ``rate`` per second (None: no limit)."""

    rate: float | None
    sent: int = 0
    t0: float = 0.0

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def account(self, nbytes: int) -> None:
        if self.rate is None or nbytes == 0:
            return
        self.sent += nbytes
        ahead = self.sent / self.rate - (time.perf_counter() - self.t0)
        if ahead > 0:
            time.sleep(ahead)


def exchange(
    group: Any,
    outgoing: list[Outgoing],
    incoming: list[Incoming],
    *,
    piece_bytes: int,
    rate: float | None = None,
    stop: Callable[[], str | None] | None = None,
) -> tuple[dict[int, str | None], dict[int, str | None]]:
    """Run one round; returns, per destination and per source, None when the copy was
    committed there, else why not. Raises ``PeerLinkError`` when the transport fails, or
    once ``stop`` (asked while waiting) says why to give up: every copy of the round is
    then lost, nothing half-received is committed, and what gloo may still touch is kept
    (``_kept``)."""
    import torch.distributed as dist

    sent: dict[int, str | None] = {o.dst: None for o in outgoing}
    got: dict[int, str | None] = {i.src: None for i in incoming}
    peers = sorted({o.dst for o in outgoing} | {i.src for i in incoming})
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    waiter = _Waiter(stop, peers)
    _run = waiter.run
    try:
        # 1. headers, 2. descriptions
        metas: dict[int, bytes] = {}
        heads_out = []
        for o in outgoing:
            meta, status, data = _describe(o)
            metas[o.dst] = meta
            heads_out.append((o.dst, torch.tensor([MAGIC, status, len(meta), data])))
        heads_in = {i.src: torch.zeros(4, dtype=torch.int64) for i in incoming}
        _run(
            [dist.isend(t, d, group=group) for d, t in heads_out]
            + [dist.irecv(t, s, group=group) for s, t in heads_in.items()]
        )
        for s, h in heads_in.items():
            if int(h[0]) != MAGIC:
                raise PeerLinkError(f"rank {s} sent no peer-copy header (protocol mismatch)")
        bufs_in = {s: torch.empty(int(h[2]), dtype=torch.uint8) for s, h in heads_in.items()}
        _run(
            [dist.isend(_bytes(metas[o.dst]), o.dst, group=group) for o in outgoing if metas[o.dst]]
            + [dist.irecv(b, s, group=group) for s, b in bufs_in.items() if b.numel()]
        )
        times["describe"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        # 3. the receivers' answers
        accepted_in: list[Incoming] = []
        answers_out: list[tuple[int, torch.Tensor]] = []
        for i in incoming:
            meta = bytes(bufs_in[i.src].numpy())
            why: str | None
            if int(heads_in[i.src][1]) != 0:
                why = f"rank {i.src} had no copy to send: {meta.decode(errors='replace')}"
            else:
                try:
                    i.dest.prepare(meta)
                    why = None
                except (SnapcoreError, OSError, ValueError) as e:
                    why = f"{type(e).__name__}: {e}"
            got[i.src] = why
            if why is None:
                accepted_in.append(i)
            answers_out.append((i.src, _reply(why)))
        answers_in = {o.dst: torch.zeros(REPLY_BYTES, dtype=torch.uint8) for o in outgoing}
        _run(
            [dist.isend(t, s, group=group) for s, t in answers_out]
            + [dist.irecv(t, d, group=group) for d, t in answers_in.items()]
        )
        accepted_out: list[Outgoing] = []
        for o in outgoing:
            why = o.error or _why(answers_in[o.dst])
            sent[o.dst] = why
            if why is None:
                accepted_out.append(o)
        times["prepare"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        # 4. the data, piece by piece, from the sender's file mappings straight into the
        # receiver's, a piece hashed while the next ones travel
        times.update(_data(group, accepted_out, accepted_in, piece_bytes, Pacer(rate), _run))
        times["data"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        # 5. the receivers' verdicts
        verdicts_out = []
        for i in accepted_in:
            try:
                i.dest.finish()
                why = None
            except (SnapcoreError, OSError, ValueError) as e:
                why = f"{type(e).__name__}: {e}"
            got[i.src] = why
            verdicts_out.append((i.src, _reply(why)))
        verdicts_in = {o.dst: torch.zeros(REPLY_BYTES, dtype=torch.uint8) for o in accepted_out}
        _run(
            [dist.isend(t, s, group=group) for s, t in verdicts_out]
            + [dist.irecv(t, d, group=group) for d, t in verdicts_in.items()]
        )
        for d, t in verdicts_in.items():
            sent[d] = _why(t)
        times["check_commit"] = time.perf_counter() - t0
        last_round.clear()
        last_round.update(times)
    except PeerLinkError:
        _keep(waiter, outgoing, incoming)
        raise
    except Exception as e:  # gloo: a reset connection, a timeout
        _keep(waiter, outgoing, incoming)
        raise PeerLinkError(
            f"the peer transfer with ranks {peers} failed: {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else e}"
        ) from e
    except BaseException:
        _keep(waiter, outgoing, incoming)
        raise
    finally:
        waiter.close()
    _unmap(outgoing)
    return sent, got


def _describe(o: Outgoing) -> tuple[bytes, int, int]:
    """(description, status, data length) of an outgoing copy; status 1: none to send."""
    if o.copy is None:
        return (o.error or "no copy").encode()[:65536], 1, 0
    try:
        for path, (name, size) in zip(o.paths, o.copy.files, strict=True):
            got = os.stat(path).st_size
            if got < size:
                raise SnapcoreError(f"{path} has {got} bytes, the part says {size} ({name})")
            if size:
                o.maps.append(Mapping(path, size))
    except (OSError, SnapcoreError) as e:
        _unmap([o])
        o.error = f"{type(e).__name__}: {e}"
        o.copy = None
        return o.error.encode()[:65536], 1, 0
    return o.copy.meta(), 0, sum(n for _, n in o.copy.files)


def _data(
    group: Any,
    out: list[Outgoing],
    inc: list[Incoming],
    piece: int,
    pacer: Pacer,
    run: Callable[[list[Any]], None],
) -> dict[str, float]:
    """The data, piece by piece, ``WINDOW`` pieces in flight per copy (one when paced):
    a sender's pieces go straight from its files' mappings, a receiver's straight into
    its destination's mapping (faulted in ahead of them); a piece that has arrived is
    hashed while the next ones travel."""
    import torch.distributed as dist

    sends = {o.dst: _cut(o.copy.files if o.copy else [], piece) for o in out}
    recvs = {i.src: _cut(i.dest.copy.files if i.dest.copy else [], piece) for i in inc}
    maps = {o.dst: o.maps for o in out}
    sizes = {o.dst: [n for _, n in o.copy.files] if o.copy else [] for o in out}
    dests = {i.src: i.dest for i in inc}
    # only a copy that has failed on the way takes buffers, to drop its pieces into
    spare: dict[tuple[int, int], torch.Tensor] = {}
    landed: dict[tuple[int, int], bool] = {}  # (source, piece): it went into the mapping

    def source(d: int, k: int) -> torch.Tensor:  # sender: piece k, in its file's mapping
        f, off, n = sends[d][k]
        nonzero = [i for i, size in enumerate(sizes[d]) if size]
        return maps[d][nonzero.index(f)].ready(off, n)

    def into(s: int, k: int) -> torch.Tensor:  # receiver: where piece k lands
        f, off, n = recvs[s][k]
        t0 = time.perf_counter()
        t = dests[s].target(f, off, n)
        spent["fault_wait"] += time.perf_counter() - t0
        landed[s, k] = t is not None
        if t is None:
            key = (s, k % WINDOW)
            if key not in spare:
                spare[key] = torch.empty(max(p[2] for p in recvs[s]), dtype=torch.uint8)
            t = spare[key][:n]
        return t

    def post(k: int) -> list[Any]:
        works = [dist.isend(source(d, k), d, group=group) for d, p in sends.items() if k < len(p)]
        targets = [(s, into(s, k)) for s, p in recvs.items() if k < len(p)]
        t0 = time.perf_counter()  # gloo takes a pair's lock to post, which its reads hold
        works += [dist.irecv(t, s, group=group) for s, t in targets]
        spent["post_recv"] += time.perf_counter() - t0
        return works

    spent = {"fault_wait": 0.0, "post_recv": 0.0, "wire_wait": 0.0, "hash": 0.0}
    pacer.start()
    rounds = max([len(p) for p in (*sends.values(), *recvs.values())], default=0)
    window = 1 if pacer.rate is not None else WINDOW  # paced: one piece at a time
    posted: collections.deque[list[Any]] = collections.deque()
    for k in range(rounds):
        # (a failure leaves the pieces posted in gloo's hands: exchange keeps them)
        while len(posted) < window and k + len(posted) < rounds:
            posted.append(post(k + len(posted)))
        t0 = time.perf_counter()
        run(posted.popleft())
        spent["wire_wait"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        for s, p in recvs.items():  # hashed while the next pieces travel
            if k < len(p):
                f, off, n = p[k]
                if landed.pop((s, k)):
                    dests[s].received(f, off, n)
        spent["hash"] += time.perf_counter() - t0
        pacer.account(sum(p[k][2] for p in sends.values() if k < len(p)))
    return spent


def _cut(files: list[tuple[str, int]], piece: int) -> list[tuple[int, int, int]]:
    """The pieces of a copy's files: (file, offset, length), in order."""
    return [
        (f, off, min(piece, size - off))
        for f, (_, size) in enumerate(files)
        for off in range(0, size, piece)
    ]


def _unmap(outgoing: list[Outgoing]) -> None:
    for o in outgoing:
        for m in o.maps:
            m.close()
        o.maps = []


def _bytes(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _reply(why: str | None) -> torch.Tensor:
    t = torch.zeros(REPLY_BYTES, dtype=torch.uint8)
    if why is None:
        t[0] = 1
        return t
    text = why.encode()[: REPLY_BYTES - 3]
    t[0] = 2
    t[1] = len(text) >> 8
    t[2] = len(text) & 0xFF
    t[3 : 3 + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    return t


def _why(t: torch.Tensor) -> str | None:
    if int(t[0]) == 1:
        return None
    n = (int(t[1]) << 8) | int(t[2])
    return bytes(t[3 : 3 + n].numpy()).decode(errors="replace") or "refused"


def _keep(waiter: _Waiter, outgoing: list[Outgoing], incoming: list[Incoming]) -> None:
    """A round failed: nothing of it is committed, and nothing gloo may still read or
    write (the operations posted, their buffers, the sent files' mappings, the received
    copies' mappings) is unmapped or freed: kept until the process ends."""
    kept: list[Any] = list(waiter.works)
    for o in outgoing:
        for m in o.maps:
            with contextlib.suppress(Exception):
                m.stop()
        kept.extend(o.maps)
        o.maps = []
    for i in incoming:
        with contextlib.suppress(Exception):
            kept.extend(i.dest.abandon())
    with _kept_lock:
        _kept.extend(kept)
