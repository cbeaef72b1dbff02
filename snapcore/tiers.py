"""The tiers of a store: host memory (tier 0), local disk (tier 1), object storage (tier 2).

Every tier holds snapshots in the same format (docs/format.md) and commits on its own: a
snapshot is visible in a tier once that tier's manifest is. ``Store`` names the tiers of
one run; ``save``/``restore`` accept it wherever they accept a path.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import re
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from . import _native
from . import manifest as mf
from .assemble import read_sharded
from .directory import MANIFEST, STEP_DIGITS, LocalDirectory, step_dir_name
from .durable import allocated_bytes
from .errors import CorruptSnapshot, InvalidManifest, SnapshotNotFound

log = logging.getLogger(__name__)

TIER_ORDER = ("host", "local", "remote")  # fastest first: where restore reads from
HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass(frozen=True)
class Retention:
    """Which committed snapshots a tier keeps: the newest ``last``, plus every step that
    is a multiple of ``every`` (0: none). The newest committed snapshot is always kept."""

    last: int = 0  # 0: keep everything
    every: int = 0

    @classmethod
    def parse(cls, value: Retention | int | str | None) -> Retention:
        """``3`` keeps the last 3; ``"2+10"`` the last 2 plus every 10th step."""
        if value is None:
            return cls()
        if isinstance(value, Retention):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            if value < 0:
                raise ValueError("retention must be >= 0")
            return cls(last=value)
        m = re.fullmatch(r"(\d+)(?:\+(\d+))?", str(value).strip())
        if not m:
            raise ValueError(f"retention {value!r}: expected N or N+EVERY, e.g. 3 or 2+10")
        return cls(last=int(m.group(1)), every=int(m.group(2) or 0))

    def doomed(self, steps: Iterable[int]) -> list[int]:
        """The steps to delete, in ascending order (never the newest)."""
        ordered = sorted(set(steps))
        if not self.last and not self.every:
            return []
        keep = set(ordered[-max(self.last, 1) :])
        if self.every:
            keep |= {s for s in ordered if s % self.every == 0}
        return [s for s in ordered if s not in keep]


# What each tier keeps unless Store(retention=...) says otherwise (docs/configuration.md):
# the newest is always kept, and one or two before it in case it proves damaged; keeping
# everything (what 0 says) fills a disk, and a full disk fails every later snapshot.
DEFAULT_RETENTION: dict[str, Retention] = {
    "host": Retention(last=2),  # what its two slots hold anyway
    "local": Retention(last=3),
    "remote": Retention(last=3),
}


class LocalTier:
    """A directory tier: local disk, or (subclass) host memory on tmpfs."""

    name = "local"

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.store = LocalDirectory(root)

    @property
    def root(self) -> Path:
        return self.store.root

    def describe(self) -> str:
        return str(self.store.root)

    def committed_steps(self) -> list[int]:
        return self.store.committed_steps()

    def read_manifest(self, step: int) -> mf.Manifest:
        return self.store.read_manifest(step)

    def file_size(self, name: str) -> int | None:
        """The size of data file ``name``; None if missing. Only regular files are data
        files: a symlink (even one inside the store), FIFO, device or directory is
        CorruptSnapshot, found by lstat without opening it (docs/format.md, "Store")."""
        try:
            st = os.lstat(self.root / name)
        except FileNotFoundError:
            return None
        if not stat.S_ISREG(st.st_mode):
            kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
            where = f"{self.describe().rstrip('/')}/{name}"
            raise CorruptSnapshot(f"data file {where} is {kind}", file=where)
        # No directory on its way may be a link either: out of the store is InvalidManifest
        # (file_path), a link inside it CorruptSnapshot like a linked file.
        if self.store.file_path(name) != self.root.resolve() / name:
            where = f"{self.describe().rstrip('/')}/{name}"
            raise CorruptSnapshot(
                f"data file {where} is reached through a symbolic link", file=where
            )
        return st.st_size

    def read_into(self, name: str, offset: int, length: int, address: int) -> None:
        if length == 0:
            return  # nothing to read: the file is not even opened (a FIFO would block)
        _native.read_into(str(self.store.file_path(name)), offset, length, address)

    def uncommit(self, step: int) -> None:
        """Uncommit a snapshot; its data goes when nothing references it (``collect``)."""
        self.store.uncommit(step)

    def collect(self, *, dry_run: bool = False, recycle: bool = False) -> list[str]:
        """Delete data files no committed manifest references, and leftovers of dead writers.

        Content-addressed chunks make a file of an old snapshot live on while a newer
        manifest points into it; files of live writers are never touched. ``recycle``
        keeps the unreferenced data files as spares for the next saves to write over
        (``LocalDirectory.take_spare``); without it the spares go too.
        """
        removed = self.store.collect_leftovers(full=True, dry_run=dry_run, recycle=recycle)
        return [str(p) for p in removed]


class HostTier(LocalTier):
    """Tier 0: snapshots in shared memory (/dev/shm) that outlive the training process.

    The data files are the staging arenas themselves (``slot-<i>.bin``, mapped shared),
    so committing a host snapshot writes only its manifest. Two slots: a new snapshot is
    staged into the slot the newest committed one does not use.
    """

    name = "host"
    SLOTS = 2

    def __init__(self, name: str, *, root: str | os.PathLike[str] = "/dev/shm") -> None:
        if not HOST_NAME.match(name):
            raise ValueError(f"host area name {name!r}: use letters, digits, '.', '_', '-'")
        super().__init__(Path(root) / f"snapcore-{name}")
        self.area = name
        self.rank: int | None = None  # under torch.distributed: each rank's own slots

    def slot_name(self, slot: int) -> str:
        return f"slot-{slot}.bin" if self.rank is None else f"slot-r{self.rank}-{slot}.bin"

    def slot_path(self, slot: int) -> Path:
        return self.root / self.slot_name(slot)

    def steps_by_slot(self) -> list[set[int]]:
        """The committed host steps whose data lie in each slot (read once, at claim)."""
        out: list[set[int]] = [set() for _ in range(self.SLOTS)]
        for step in self.committed_steps():
            try:
                names = {f.name for f in self.read_manifest(step).files}
            except (InvalidManifest, SnapshotNotFound):
                names = {self.slot_name(i) for i in range(self.SLOTS)}  # unknown: any slot
            for i in range(self.SLOTS):
                if self.slot_name(i) in names:
                    out[i].add(step)
        return out

    def uncommit_steps(self, steps: Iterable[int]) -> None:
        for step in steps:
            self.uncommit(step)
            shutil.rmtree(self.root / step_dir_name(step), ignore_errors=True)

    def identity(self) -> dict[str, Any] | None:
        try:
            return json.loads((self.root / "store.json").read_text())
        except (FileNotFoundError, ValueError):
            return None

    def holds(self, identity: dict[str, Any]) -> bool:
        """Whether the area holds the snapshots of the store with ``identity`` (an area
        claimed by another store does not; a host-only store reads whatever is there)."""
        ident = self.identity()
        return ident is None or ident == identity or identity == {"local": None, "remote": None}

    def nbytes(self) -> int:
        """The memory the area takes (allocated blocks of its files)."""
        return allocated_bytes(self.root)

    def claim(self, identity: dict[str, Any]) -> None:
        """Make the area belong to ``identity``; an area of another store is released."""
        current = self.identity()
        if current is not None and current != identity:
            self.release()
        self.root.mkdir(parents=True, exist_ok=True)
        if current != identity:
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".store.json.")  # O_EXCL, 0600
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(identity))
            os.replace(tmp, self.root / "store.json")

    def release(self) -> None:
        """Free the whole area (its memory)."""
        shutil.rmtree(self.root, ignore_errors=True)


class RemoteStoreTier:
    """Tier 2: snapshots under an fsspec URL (object storage), in the same layout.

    A manifest is committed with one PUT; objects of an upload in flight are marked by a
    ``<token>.pending`` object, which garbage collection respects for ``PENDING_GRACE_S``.
    """

    name = "remote"
    PENDING_GRACE_S = 3600.0
    _MANIFEST = re.compile(rf"^step-({STEP_DIGITS})/manifest\.json$")
    _PENDING = re.compile(rf"^step-{STEP_DIGITS}/([0-9a-f]+)\.pending$")

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        from .objstore import ObjectStoreClient

        self.rt = ObjectStoreClient(url, dict(storage_options or {}))

    def describe(self) -> str:
        return self.rt.url

    def close(self) -> None:
        self.rt.close()

    def committed_steps(self) -> list[int]:
        steps = []
        for name in self.rt.list(""):
            m = self._MANIFEST.match(name)
            if m:
                steps.append(int(m.group(1)))
        return sorted(steps)

    def read_manifest(self, step: int) -> mf.Manifest:
        name = f"{step_dir_name(step)}/{MANIFEST}"
        where = f"{self.rt.url.rstrip('/')}/{name}"
        size = self.rt.size(name)
        if size is None:
            raise SnapshotNotFound(f"no committed snapshot of step {step} in {self.rt.url}")
        if size > mf.MAX_MANIFEST_BYTES:
            raise InvalidManifest(f"{where}: manifest of {size} bytes exceeds the 64 MiB cap")
        doc = mf.parse_any(self.rt.read_bytes(name), where=where)
        if doc.step != step:
            raise InvalidManifest(f"{where}: manifest says step {doc.step}, path says {step}")
        if isinstance(doc, mf.Index):
            return read_sharded(doc, self._read_part, where=where)
        return doc

    def _read_part(self, name: str, size: int) -> bytes | None:
        got = self.rt.size(name)
        if got is None:
            return None
        if got != size:
            where = f"{self.rt.url.rstrip('/')}/{name}"
            raise InvalidManifest(f"{where}: part of {got} bytes, the index says {size}")
        return self.rt.read_bytes(name)

    def file_size(self, name: str) -> int | None:
        return self.rt.size(name)

    def read_into(self, name: str, offset: int, length: int, address: int) -> None:
        data = self.rt.read_range(name, offset, length)
        if len(data) != length:
            raise InvalidManifest(
                f"{self.rt.url}/{name}: {len(data)} bytes at {offset}, expected {length}"
            )
        ctypes.memmove(address, data, length)

    def begin(self, step: int, token: str) -> None:
        mark = {"t": now(), "host": socket.gethostname(), "pid": os.getpid()}
        self.rt.put_bytes(f"{step_dir_name(step)}/{token}.pending", json.dumps(mark).encode())

    def end(self, step: int, token: str) -> None:
        self.rt.delete([f"{step_dir_name(step)}/{token}.pending"])

    def upload_file(
        self, path: str, name: str, progress: Callable[[int], None] | None = None
    ) -> tuple[int, str]:
        """Upload the local file ``path`` as object ``name``; returns (size, checksum).
        ``progress(n)``: called as each ``n`` bytes go to the upload."""
        return self.rt.upload_file(path, name, progress)

    def open_writer(self, name: str) -> Any:
        """A streaming writer of object ``name`` (multipart upload)."""
        return self.rt.open_writer(name)

    def put(self, name: str, data: bytes) -> None:
        """Write a small object (a part of a sharded step) with one PUT."""
        self.rt.put_bytes(name, data)

    def commit(self, m: mf.Manifest | mf.Index) -> None:
        self.rt.put_bytes(f"{step_dir_name(m.step)}/{MANIFEST}", m.dumps())

    def uncommit(self, step: int) -> None:
        self.rt.delete([f"{step_dir_name(step)}/{MANIFEST}"])

    def collect(self, *, dry_run: bool = False) -> list[str]:
        """Delete objects no committed manifest references, sparing uploads in flight."""
        names = self.rt.list("")
        referenced: set[str] = set()
        for step in self.committed_steps():
            try:
                m = self.read_manifest(step)
                referenced |= {f.name for f in m.files} | set(m.part_files)
            except (InvalidManifest, SnapshotNotFound):
                return []
        live: set[str] = set()
        dead: set[str] = set()
        for name in names:
            m = self._PENDING.match(name)
            if m:
                alive = _upload_alive(self.rt.read_bytes(name), self.PENDING_GRACE_S)
                (live if alive else dead).add(m.group(1))
        doomed = [
            n
            for n in names
            if not self._MANIFEST.match(n)
            and n not in referenced
            and not any(t in n for t in live)
            and n.startswith("step-")
            # a live upload may reference any other object: then only dead ones' go
            and (not live or any(t in n for t in dead))
        ]
        if not dry_run and doomed:
            self.rt.delete(doomed)
        return doomed


def _upload_alive(mark: bytes, grace_s: float) -> bool:
    """Whether the writer of a remote pending marker may still be uploading."""
    try:
        info = json.loads(mark)
        started, host, pid = float(info["t"]), str(info["host"]), int(info["pid"])
    except (ValueError, KeyError, TypeError):
        return False
    if now() - started >= grace_s:
        return False
    if host != socket.gethostname():
        return True  # another machine's process: only time tells
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class PeerSpec:
    """The peer tier (docs/peer.md): after a node's host-memory snapshot commits, each
    rank's part is copied into the host memory of ``k`` partner nodes (a ring over the
    job's nodes, a partner in another failure domain first when ``SNAPCORE_FAILURE_DOMAIN``
    names them), over a gloo group snapcore makes for it.

    ``max_bytes``: the most host memory the copies one rank receives may take (its
    partner copies, both files of each source rank); ``None``: only /dev/shm's free space
    bounds them. ``max_bytes_per_s``: the sending rate of each rank (``None``: as fast
    as the network goes); ``piece_bytes``: the size of each send (the unit of pacing)."""

    k: int = 1
    max_bytes: int | None = None
    max_bytes_per_s: float | None = None
    piece_bytes: int = 16 << 20

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 1:
            raise ValueError(f"PeerSpec.k must be an int >= 1, not {self.k!r}")
        if self.max_bytes is not None and self.max_bytes < 0:
            raise ValueError("PeerSpec.max_bytes must be >= 0")
        if self.max_bytes_per_s is not None and self.max_bytes_per_s <= 0:
            raise ValueError("PeerSpec.max_bytes_per_s must be > 0")
        if self.piece_bytes < 4096:
            raise ValueError("PeerSpec.piece_bytes must be at least 4096")

    @classmethod
    def parse(cls, value: PeerSpec | bool | int | None) -> PeerSpec | None:
        """``True``: one partner; an int: that many partners; ``None``/``False``: none."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, PeerSpec):
            return value
        if isinstance(value, int):
            return cls(k=value)
        raise ValueError(f"peer={value!r}: expected True, a number of partners or a PeerSpec")


@dataclass
class Store:
    """The tiers of one run. Any of them may be left out (``local`` alone is a path).

    ``codec``: one codec for every tier, or a mapping per tier (``"none"``, ``"zstd"``,
    ``"shuffle-zstd"``); host memory is never compressed. ``retention``: per tier, an int
    (keep the last N; 0 keeps everything) or ``"N+EVERY"`` (the last N plus every EVERY-th
    step); a tier not named keeps ``DEFAULT_RETENTION`` (host 2, local 3, remote 3).

    A Store is a context manager: leaving ``with Store(...) as store:`` closes the
    engine of its tiers (waits for the snapshots in flight, frees the staging memory,
    closes remote connections, drops the writer lock), like ``snapcore.close()`` does for
    every store.
    """

    local: str | os.PathLike[str] | None = None
    remote: str | None = None
    host: str | None = None
    storage_options: Mapping[str, Any] | None = None
    codec: str | Mapping[str, str] = "none"
    retention: Mapping[str, Retention | int | str] = field(default_factory=dict)
    # The peer tier (snapcore/peer/, docs/peer.md): copies of each node's host snapshot
    # in partner nodes' host memory. Needs a host tier and a job of two nodes or more.
    peer: PeerSpec | bool | int | None = None

    def __post_init__(self) -> None:
        if self.local is None and self.remote is None and self.host is None:
            raise ValueError("a Store needs at least one tier: local=, remote= or host=")
        self.peer_spec = PeerSpec.parse(self.peer)
        if self.peer_spec is not None and self.host is None:
            raise ValueError("peer= needs a host tier (host=): the peer tier copies it")
        if self.local is not None:
            self.local = Path(self.local).absolute()
        for tier in self.retention:
            if tier not in TIER_ORDER:
                raise ValueError(f"retention for unknown tier {tier!r} (tiers: {TIER_ORDER})")
        self._retention = {t: Retention.parse(v) for t, v in self.retention.items()}
        for tier in TIER_ORDER:
            c = self.codec_for(tier)
            if c not in mf.CODECS:
                raise ValueError(f"codec {c!r} for tier {tier}: choose one of {mf.CODECS}")

    @property
    def tiers(self) -> tuple[str, ...]:
        present = {"host": self.host, "local": self.local, "remote": self.remote}
        return tuple(t for t in TIER_ORDER if present[t] is not None)

    def codec_for(self, tier: str) -> str:
        if tier == "host":
            return "none"
        if isinstance(self.codec, str):
            return self.codec
        return self.codec.get(tier, "none")

    def retention_for(self, tier: str) -> Retention:
        return self._retention.get(tier, DEFAULT_RETENTION[tier])

    def __enter__(self) -> Store:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        if exc_type is None:
            _close_store(self)  # raises a background failure nobody saw
            return
        try:  # the body's exception is the news: a failure on top of it is logged
            _close_store(self)
        except Exception as e:
            log.error("closing %s after %s: %s", self.describe(), exc_type.__name__, e)

    def key(self) -> tuple[Any, ...]:
        return (str(self.local) if self.local else None, self.remote, self.host)

    def identity(self) -> dict[str, Any]:
        return {"local": str(self.local) if self.local else None, "remote": self.remote}

    def describe(self) -> str:
        parts = [
            f"{t}={v}"
            for t, v in zip(TIER_ORDER, (self.host, self.local, self.remote), strict=True)
            if v
        ]
        if self.peer_spec is not None:
            parts.append(f"peer={self.peer_spec.k}")
        return "Store(" + ", ".join(parts) + ")"


class Tier(Protocol):
    """What every tier is to the code that reads and collects it: host memory, local disk
    and object storage alike (``HostTier``, ``LocalTier``, ``RemoteStoreTier``)."""

    name: str

    def describe(self) -> str: ...
    def committed_steps(self) -> list[int]: ...
    def read_manifest(self, step: int) -> mf.Manifest: ...
    def file_size(self, name: str) -> int | None: ...
    def read_into(self, name: str, offset: int, length: int, address: int) -> None: ...
    def uncommit(self, step: int) -> None: ...
    def collect(self, *, dry_run: bool = False) -> list[str]: ...


# What closes the engine of a store when its ``with`` block ends. The write layer, above
# this one, registers it when it is imported; before that no store has an engine.
_store_closers: list[Callable[[Store], None]] = []


def on_store_exit(closer: Callable[[Store], None]) -> None:
    """Register ``closer(store)`` to run when a ``with Store(...)`` block ends."""
    _store_closers.append(closer)


def _close_store(store: Store) -> None:
    for closer in _store_closers:
        closer(store)


def open_tiers(store: Store) -> dict[str, Tier]:
    """The tiers of ``store`` opened for reading: no engine, arena, thread or lock. A host
    area that belongs to another store is left out (its snapshots are not this store's).
    The caller closes a remote tier (``close()``)."""
    out: dict[str, Tier] = {}
    if store.host is not None:
        host = HostTier(store.host)
        if host.holds(store.identity()):
            out["host"] = host
    if store.local is not None:
        out["local"] = LocalTier(store.local)
    if store.remote is not None:
        out["remote"] = RemoteStoreTier(store.remote, store.storage_options)
    return out


def host_area_names(root: str | os.PathLike[str] = "/dev/shm") -> list[str]:
    """The names of the host-memory areas under ``root`` (``snapcore-NAME`` directories)."""
    try:
        entries = os.listdir(root)
    except FileNotFoundError:
        return []
    names = []
    for entry in entries:
        name = entry.removeprefix("snapcore-")
        path = Path(root) / entry
        ours = entry.startswith("snapcore-") and HOST_NAME.match(name)
        if ours and path.is_dir() and not path.is_symlink():
            names.append(name)
    return sorted(names)


def as_store(store: Store | str | os.PathLike[str]) -> Store:
    if isinstance(store, Store):
        return store
    text = os.fspath(store)
    if "://" in text and not text.startswith("file://"):
        return Store(remote=text)
    return Store(local=text.removeprefix("file://"))


def now() -> float:
    return time.time()
