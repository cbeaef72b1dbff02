"""The distributed job as snapcore sees it: ranks, snapcore's own gloo group, its own
key-value store, and the one exchange that agrees a save plan.

Made once, at the first sharded save or restore, which every rank enters (it is a
collective: a gloo group is created and rank 0's store address is broadcast). After
that, nothing here is a collective except ``all_gather_bytes``, which the engine calls
only when the save plan must be agreed (the first save, and the save after a structure
change), and ``Job.group_of`` the first time a restore shares reads within nodes. The
commit of each save is coordinated through the key-value store (a
``torch.distributed.TCPStore`` served by rank 0), from the background threads: setting
and waiting for keys involves no other rank's threads, so a dead rank makes the others
time out with its rank named, never hang (docs/distributed.md).
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import settings

__all__ = ["Job", "all_gather_bytes", "current", "kv_get", "kv_wait_all"]


@dataclass
class Job:
    """This process's place in the job: its rank, the world size, snapcore's own gloo
    group (never the training's group) and key-value store, and the node it runs on."""

    rank: int
    world_size: int
    group: Any  # torch.distributed.ProcessGroup (gloo)
    server: Any  # rank 0: the TCPStore it serves (kept alive); else None
    addr: str
    port: int
    host: str
    timeout_s: float
    _threads: threading.local = field(default_factory=threading.local)
    _acks: list[str] = field(default_factory=list)
    _groups: dict[tuple[tuple[int, ...], ...], list[Any]] = field(default_factory=dict)

    def group_of(self, parts: list[list[int]]) -> Any:
        """This rank's gloo group in ``parts``, a partition of the job's ranks (the ranks
        of each node). Every rank must pass the same partition: the first time it is a
        collective (every part's group is made, in order, on every rank), later cached.
        One part: snapcore's group of the whole job."""
        key = tuple(sorted(tuple(sorted(p)) for p in parts))
        if len(key) == 1:
            return self.group
        groups = self._groups.get(key)
        if groups is None:
            import torch.distributed as dist

            timeout = datetime.timedelta(seconds=self.timeout_s)
            groups = [dist.new_group(list(p), backend="gloo", timeout=timeout) for p in key]
            self._groups[key] = groups
        return groups[next(i for i, p in enumerate(key) if self.rank in p)]

    @property
    def kv(self) -> Any:
        """This thread's connection to the key-value store. One per thread: a client's
        requests are serialised on its socket, so a thread blocked in ``wait`` would hold
        up every other thread's requests."""
        client = getattr(self._threads, "kv", None)
        if client is None:
            import torch.distributed as dist

            timeout = datetime.timedelta(seconds=self.timeout_s)
            client = dist.TCPStore(self.addr, self.port, is_master=False, timeout=timeout)
            self._threads.kv = client
        return client

    def key(self, *parts: object) -> str:
        return "snapcore/" + "/".join(str(p) for p in parts)

    def expect_acks(self, key: str) -> None:
        """Rank 0: every other rank will count itself in ``key`` once it has read a
        verdict; ``settle`` waits for that before rank 0's store may go away."""
        with _lock:
            self._acks.append(key)
            del self._acks[:-64]  # the latest saves' (older ones were read long ago)

    def settle(self, timeout_s: float | None = None) -> list[str]:
        """Rank 0: wait (at most ``timeout_s``, default the commit timeout but no more
        than a minute: a dead rank never answers) until every rank has read the verdicts
        of the steps rank 0 committed, so that ending rank 0's process (which serves the
        key-value store) does not leave a rank without its verdict. Returns the keys
        still short of acknowledgements."""
        limit = min(self.timeout_s, 60.0) if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        with _lock:
            keys = list(self._acks)
        short = keys
        while short and time.monotonic() < deadline:
            try:
                short = [k for k in short if int(self.kv.add(k, 0)) < self.world_size - 1]
            except Exception:  # the store is gone: nothing to wait for
                return short
            if short:
                time.sleep(0.01)
        if not short:
            with _lock:
                self._acks = [k for k in self._acks if k not in keys]
        return short


_job: Job | None = None
_lock = threading.Lock()


def initialized() -> bool:
    """Whether a process group of more than one rank is initialised."""
    if not torch.distributed.is_available():
        return False
    dist = torch.distributed
    return bool(dist.is_initialized() and dist.get_world_size() > 1)


def current() -> Job | None:
    """The job, or None outside torch.distributed (or in a world of one rank).

    The first call under a process group is a collective: every rank must make it (the
    first save or restore does, on every rank)."""
    global _job
    if not initialized():
        return None
    with _lock:
        if _job is None:
            _job = _make()
        return _job


def forget() -> None:
    """Drop this process's job objects (snapcore's key-value store and its connections)
    while the interpreter is whole: at exit, after the engines are closed, rather than in
    the interpreter's teardown, where a C++ object's threads may outlive what they use.
    A later sharded save makes them again (a collective)."""
    global _job
    with _lock:
        job, _job = _job, None
    if job is not None:
        job.server = None
        job._threads = threading.local()


def _make() -> Job:
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=settings.commit_timeout_s())
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(backend="gloo", timeout=timeout)
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = torch.zeros(1, dtype=torch.int64)
    server = None
    if rank == 0:
        server = dist.TCPStore(addr, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        port[0] = server.port
    dist.broadcast(port, src=0, group=group)
    return Job(
        rank,
        world,
        group,
        server,
        addr,
        int(port[0]),
        socket.gethostname(),
        timeout.total_seconds(),
    )


def all_gather_bytes(job: Job, data: bytes, group: Any = None) -> list[bytes]:
    """Every rank's ``data`` (a collective on snapcore's gloo group, or on ``group``, one
    of its node groups: ``Job.group_of``; in the group's rank order; no pickle)."""
    import torch.distributed as dist

    group = job.group if group is None else group
    count = dist.get_world_size(group)
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(count)]
    dist.all_gather(sizes, size, group=group)
    n = max(int(s) for s in sizes)
    buf = torch.zeros(n, dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = [torch.empty(n, dtype=torch.uint8) for _ in range(count)]
    dist.all_gather(out, buf, group=group)
    return [bytes(o[: int(s)].numpy()) for o, s in zip(out, sizes, strict=True)]


def broadcast_bytes(job: Job, data: bytes, src: int, size: int) -> bytes:
    """Rank ``src``'s ``data``, of ``size`` bytes (a size every rank knows already), on
    every rank: a broadcast on snapcore's gloo group, of those bytes alone."""
    import torch.distributed as dist

    buf = torch.empty(size, dtype=torch.uint8)
    if job.rank == src:
        if len(data) != size:
            raise ValueError(f"broadcast_bytes: {len(data)} bytes, {size} announced")
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buf, src=src, group=job.group)
    return bytes(buf.numpy())


def kv_wait_all(job: Job, keys: list[str], timeout_s: float) -> list[int]:
    """Wait until every key is set; return the indices of those still missing after
    ``timeout_s`` (empty when all are set)."""
    try:
        job.kv.wait(keys, datetime.timedelta(seconds=timeout_s))
        return []
    except Exception:  # DistStoreError (timeout), or a lost connection
        return [i for i, k in enumerate(keys) if not _has(job, k)]


def _has(job: Job, key: str) -> bool:
    try:
        return bool(job.kv.check([key]))
    except Exception:
        return False


def kv_get(job: Job, key: str, timeout_s: float) -> bytes | None:
    """The value of ``key`` once set, or None after ``timeout_s`` or when the store (rank
    0) cannot be reached."""
    try:
        job.kv.wait([key], datetime.timedelta(seconds=timeout_s))
        return bytes(job.kv.get(key))
    except Exception:
        return None
