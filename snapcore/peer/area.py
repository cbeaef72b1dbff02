"""Where copies of a rank's part live on the node that receives them, and how a received
copy is checked and committed.

The peer namespace of a host-memory area is ``<area>/peer/r<R>/``, one store directory
per source rank ``R`` (docs/format.md, "The peer namespace"): the step's index and rank
``R``'s part, byte for byte as rank ``R``'s node committed them, and the data files the
part names (its host slot files, ``slot-r<R>-<i>.bin``), with ``peer.json`` saying which
store and job they belong to. A copy is committed when its index is there, written last,
after the part and the data have been received whole and every chunk's XXH3-128 matched
the part.

The same ``Destination`` also writes a copy fetched back at restore into the replaced
node's own host area (then the index is written once every rank of the node has its
part: ``commit_index=False``, and ``write_index`` later).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import shutil
import stat
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch
import xxhash

from .. import _native
from .. import manifest as mf
from ..assemble import read_sharded
from ..directory import MANIFEST, LocalDirectory, step_dir_name
from ..durable import allocated_bytes, fsync_dir
from ..errors import CorruptSnapshot, InvalidManifest, SnapcoreError, SnapshotNotFound

__all__ = [
    "Budget",
    "Copy",
    "Destination",
    "PeerArea",
    "PeerCopies",
    "drop_mappings",
    "hold_mapping",
    "holds_mapping",
    "peer_root",
]

IDENTITY = "peer.json"
PAGE = os.sysconf("SC_PAGE_SIZE")
INCOMING = ".incoming-"  # a copy's file received beside the newest copy's, renamed at commit
FAULT_STEP = 4 << 20  # a received copy's memory is faulted in ahead of the wire by this much
MADV_POPULATE_WRITE = 23  # Linux 5.14; older kernels answer EINVAL
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


# Mappings of files faulted in ahead of a fetch (peer/restore.py, ``reserve``), kept open
# so that the fetch receives into the very page tables that faulting filled: mapped
# again, 512 MiB would take its page table entries anew (about 0.07 s here), on the
# fetch's path. Keyed by the file's path (moved along when a fetch renames the file),
# with the file's (device, inode): a file removed or replaced at that path since (the
# area cleared) is not the mapped one, whose memory no longer reaches any file.
_held: dict[Path, tuple[Any, tuple[int, int]]] = {}
_held_lock = threading.Lock()


def hold_mapping(path: Path, arena: Any) -> None:
    """Keep ``arena`` (a native Arena of ``path``, faulted in) for a fetch into ``path``."""
    st = os.stat(path)
    with _held_lock:
        old = _held.pop(path, None)
        _held[path] = (arena, (st.st_dev, st.st_ino))
    if old is not None:
        old[0].close()


def drop_mappings(paths: list[Path] | None = None, *, under: Path | None = None) -> None:
    """Unmap the held mappings of ``paths`` (None: all of them), or those of the files
    under ``under``; the files stay."""
    with _held_lock:
        gone = [
            _held.pop(p)[0]
            for p in list(_held)
            if (under is None or p.is_relative_to(under)) and (paths is None or p in paths)
        ]
    for arena in gone:
        with contextlib.suppress(Exception):
            arena.close()


def holds_mapping(path: Path) -> bool:
    """Whether a mapping of ``path`` is held for a fetch."""
    with _held_lock:
        return path in _held


def _take_mapping(path: Path, size: int, fd: int) -> Any:
    """The held mapping of ``path`` when it is of the file open as ``fd`` (not one removed
    or replaced since) and covers ``size`` bytes, else None."""
    with _held_lock:
        held = _held.pop(path, None)
    if held is None:
        return None
    arena, inode = held
    st = os.fstat(fd)
    if arena.size < size or inode != (st.st_dev, st.st_ino):
        arena.close()
        return None
    return arena


def _move_mapping(src: Path, dst: Path) -> None:
    with _held_lock:
        if src in _held:
            _held[dst] = _held.pop(src)


def peer_root(area_root: Path, source: int) -> Path:
    """The peer namespace of ``source``'s copies in a host area."""
    return area_root / "peer" / f"r{source}"


class Copy:
    """What travels: a step's index, one rank's part, and the data files it names."""

    def __init__(self, rank: int, index: bytes, part_name: str, part: bytes) -> None:
        self.rank = rank
        self.index_bytes = index
        self.part_name = part_name
        self.part_bytes = part
        where = f"the copy of rank {rank}'s part"
        doc = mf.parse_any(index, where=f"{where}: index")
        if not isinstance(doc, mf.Index):
            raise InvalidManifest(f"{where}: the index is not a sharded snapshot's index")
        self.index = doc
        if not 0 <= rank < len(doc.parts):
            raise InvalidManifest(f"{where}: the index of step {doc.step} names no rank {rank}")
        ref = doc.parts[rank]
        if ref.name != part_name or ref.size != len(part):
            raise InvalidManifest(f"{where}: the part is not the one the index names")
        if xxhash.xxh3_128_hexdigest(part) != ref.xxh3:
            raise InvalidManifest(f"{where}: the part's xxh3 does not match the index")
        self.part = mf.parse_part(part, where=f"{where}: {part_name}")
        if self.part.part is None or self.part.part.rank != rank or self.part.step != doc.step:
            raise InvalidManifest(f"{where}: not rank {rank}'s part of step {doc.step}")
        for f in self.part.files:
            if "/" in f.name:
                raise InvalidManifest(f"{where}: data file {f.name!r} is not a slot file")
        for b in self.part.blobs:
            for c in b.chunks:
                if c.codec != "none":
                    raise InvalidManifest(f"{where}: a compressed chunk in a host-tier part")

    @staticmethod
    def index_of(data: bytes) -> mf.Index:
        """``data`` parsed as a sharded step's index."""
        doc = mf.parse_any(data, where="the index of a peer copy")
        if not isinstance(doc, mf.Index):
            raise InvalidManifest("the index of a peer copy is not a sharded snapshot's index")
        return doc

    @property
    def step(self) -> int:
        return self.index.step

    @property
    def files(self) -> list[tuple[str, int]]:
        return [(f.name, f.size) for f in self.part.files]

    def meta(self) -> bytes:
        return json.dumps(
            {
                "rank": self.rank,
                "index": self.index_bytes.decode(),
                "part_name": self.part_name,
                "part": self.part_bytes.decode(),
            }
        ).encode()

    @classmethod
    def from_meta(cls, data: bytes) -> Copy:
        try:
            d = json.loads(data)
            rank, index, name, part = d["rank"], d["index"], d["part_name"], d["part"]
        except (ValueError, KeyError, TypeError) as e:
            raise InvalidManifest(f"a peer copy's description is malformed: {e}") from None
        return cls(int(rank), index.encode(), str(name), part.encode())

    @classmethod
    def read(cls, root: Path, step: int, rank: int) -> Copy:
        """Rank ``rank``'s part of ``step`` as the store directory ``root`` holds it
        (its committed index, its part, checked)."""
        d = LocalDirectory(root)
        path = d.manifest_path(step)
        try:
            index = path.read_bytes()
        except FileNotFoundError:
            raise SnapshotNotFound(f"no committed step {step} in {root}") from None
        doc = mf.parse_any(index, where=str(path))
        if not isinstance(doc, mf.Index) or not 0 <= rank < len(doc.parts):
            raise InvalidManifest(f"{path}: no part of rank {rank} in this index")
        name = doc.parts[rank].name
        part = (root / name).read_bytes()
        return cls(rank, index, name, part)


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def identity_of(root: Path) -> dict[str, Any] | None:
    """What a peer namespace says it holds copies of (``peer.json``), or None."""
    try:
        return json.loads((root / IDENTITY).read_text())
    except (FileNotFoundError, ValueError):
        return None


class PeerArea:
    """One source rank's peer namespace in this node's host area."""

    def __init__(self, area_root: Path, source: int) -> None:
        self.root = peer_root(area_root, source)
        self.source = source
        self.dir = LocalDirectory(self.root)

    def identity(self) -> dict[str, Any] | None:
        return identity_of(self.root)

    def committed_steps(self, identity: dict[str, Any]) -> list[int]:
        """The steps of which this namespace holds a committed copy of this store's."""
        if self.identity() != identity:
            return []
        return self.dir.committed_steps()

    def nbytes(self) -> int:
        return allocated_bytes(self.root)


def step_names(d: LocalDirectory, step: int) -> set[str] | None:
    """The data files a committed step of ``d`` names; None when unreadable."""
    try:
        return {f.name for f in d.read_manifest(step).files}
    except (InvalidManifest, SnapshotNotFound, OSError, SnapcoreError):
        return None


class Budget:
    """What all of one rank's received copies may take (``PeerSpec.max_bytes``): the
    files of every namespace ``roots`` names (the rank's sources'), counted together,
    with the copies accepted earlier in the same round (their files fill up while the
    round runs: their sizes are counted, not their memory so far)."""

    def __init__(self, max_bytes: int, roots: list[Path]) -> None:
        self.max_bytes = max_bytes
        self.roots = list(roots)
        self._accepted: dict[Path, tuple[set[str], int]] = {}  # root: (files replaced, size)

    def claim(self, root: Path, replaced: set[str], need: int, what: str) -> None:
        """Count ``need`` bytes arriving in ``root`` (its files ``replaced`` go), or raise
        "partner memory full" when they would exceed the cap."""
        held = 0
        for r in dict.fromkeys([*self.roots, root]):
            gone = replaced if r == root else self._accepted.get(r, (set(), 0))[0]
            held += _bytes_of(r, exclude=gone)
        pending = sum(n for r, (_, n) in self._accepted.items() if r != root)
        if held + pending + need > self.max_bytes:
            where = ", ".join(str(r) for r in self.roots) or str(root)
            raise SnapcoreError(
                f"partner memory full: {what} needs {need} bytes, {held + pending} are held "
                f"or arriving of the {self.max_bytes} allowed (PeerSpec.max_bytes) in this "
                f"rank's copies ({where})"
            )
        self._accepted[root] = (set(replaced), need)

    def release(self, root: Path) -> None:
        """``root``'s copy was not accepted after all."""
        self._accepted.pop(root, None)


class Destination:
    """Receives one copy into a store directory ``root`` (a peer namespace, or a host
    area at restore): ``prepare`` checks the copy and makes its files, the wire receives
    each piece straight into the file's mapping (``target``, once faulted in) and says
    when it has arrived (``received``: each chunk hashed as its bytes pass; ``write``
    copies a piece in and says so), ``finish`` checks that every chunk arrived whole
    and intact, and commits."""

    def __init__(
        self,
        root: Path,
        *,
        step: int | None,
        rank: int,
        identity: dict[str, Any] | None = None,
        max_bytes: int | None = None,
        commit_index: bool = True,
        reserved: list[Path] | None = None,
        budget: Budget | None = None,
    ) -> None:
        self.root = root
        # what all of this rank's copies may take (max_bytes alone: this namespace's)
        self.budget = budget or (Budget(max_bytes, [root]) if max_bytes is not None else None)
        # files of this root faulted in ahead, that no committed snapshot names: the
        # copy's files that do not exist yet are these, renamed (peer/restore.py)
        self.reserved = list(reserved or [])
        self.step = step  # the step expected (None: any)
        self.rank = rank  # whose part
        self.identity = identity  # a peer namespace's: written as peer.json
        self.max_bytes = max_bytes
        self.commit_index = commit_index
        self.copy: Copy | None = None
        self.fds: list[int] = []
        self.notes: list[str] = []  # what was dropped on the way (stale copies)
        self.failed: BaseException | None = None  # the first failure while writing
        # where each file is received: its own path, or beside it (``INCOMING``) when the
        # newest committed copy names it; those are renamed over it at ``finish``
        self._paths: list[Path] = []
        self._staged: list[tuple[Path, Path]] = []
        self._protected: int | None = None  # the newest committed step, uncommitted at finish
        # per file: its chunks (offset, length, xxh3, where), a streaming hash of each
        self._chunks: list[list[tuple[int, int, str, str]]] = []
        self._hashers: dict[tuple[int, int], Any] = {}
        self._done: dict[tuple[int, int], int] = {}
        # the files' mappings, the views the wire receives into, and their faulting
        self._maps: list[Any] = []
        self._views: list[torch.Tensor | None] = []
        self._sizes: list[tuple[str, int]] = []
        self._faulted: list[int] = []
        self._fault_done = False
        self._faulter: threading.Thread | None = None
        self._stop = False
        self._progress = threading.Condition()

    def prepare(self, meta: bytes) -> None:
        """Check the copy's description and make room for it; raises ``SnapcoreError``
        (or ``OSError``: memory full) with the reason to refuse it."""
        copy = Copy.from_meta(meta)
        if copy.rank != self.rank:
            raise InvalidManifest(f"expected rank {self.rank}'s part, got rank {copy.rank}'s")
        if self.step is not None and copy.step != self.step:
            raise InvalidManifest(f"expected step {self.step}, got step {copy.step}")
        d = LocalDirectory(self.root)
        if self.identity is not None:
            current = identity_of(self.root)
            if current is not None and current != self.identity:
                shutil.rmtree(self.root, ignore_errors=True)  # another store's or job's
                self.notes.append(f"dropped the stale copies in {self.root} ({current})")
            else:
                newer = [s for s in d.committed_steps() if s > copy.step]
                for s in newer:  # a copy newer than this run's step: of an earlier run
                    d.uncommit(s)
                if newer:
                    self.notes.append(f"dropped stale copies of steps {newer} in {self.root}")
        for p in self.root.glob(INCOMING + "*"):  # of a round that failed
            with contextlib.suppress(OSError):
                p.unlink()
        names = {n for n, _ in copy.files}
        committed = d.committed_steps()
        # The newest committed copy stays whole and committed until this one is: a file it
        # names is received beside it and renamed over it at ``finish``. (The sender's
        # slots alternate on every host save, whatever the tiers: a peer tier every other
        # host save sends the same slot each time, and a failed round repeats one.)
        newest = max(committed, default=None)
        kept_names = step_names(d, newest) if newest is not None else None
        protected = newest if kept_names is not None else None
        staged = names & kept_names if kept_names is not None else set()
        replaced = [
            s
            for s in committed
            if s != protected and (s == copy.step or (step_names(d, s) or names) & names)
        ]
        overwritten = names - staged
        if self.identity is not None:  # a peer namespace: files no copy will name go
            named = names | set().union(
                *((step_names(d, s) or set()) for s in committed if s not in replaced)
            )
            garbage = {p.name for p in _data_files(self.root) if p.name not in named}
        else:  # a host area at restore: its own files are not ours to drop
            garbage = set()
        overwritten |= garbage
        need = sum(n for _, n in copy.files)
        what = f"the copy of rank {copy.rank}'s step {copy.step}"
        if self.budget is not None:  # the memory it takes: whole pages, with its manifests
            pages = [n for _, n in copy.files] + [len(copy.part_bytes), len(copy.index_bytes)]
            taken = sum(-(-n // PAGE) * PAGE for n in pages)
            self.budget.claim(self.root, overwritten, taken, what)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            free = _free_bytes(self.root) + _bytes_of(self.root, only=overwritten)
            if need > free:
                raise SnapcoreError(
                    f"partner memory full: {what} needs {need} bytes, {free} are free in "
                    f"{self.root}"
                )
            if self.identity is not None:
                _write_atomic(self.root / IDENTITY, json.dumps(self.identity).encode())
        except BaseException:
            if self.budget is not None:
                self.budget.release(self.root)
            raise
        # The files about to be overwritten: the copies naming them become invisible first
        # (never the newest: its files are received beside it).
        for s in replaced:
            d.uncommit(s)
        for name in garbage:
            with contextlib.suppress(OSError):
                (self.root / name).unlink()
        if protected is not None and (staged or copy.step == protected):
            self._protected = protected
        try:
            for name, size in copy.files:
                # The file of the copy before last is reused (cut to size): its memory is
                # taken already; so is a file reserved ahead, renamed.
                final = self.root / name
                path = self.root / (INCOMING + name) if name in staged else final
                self._paths.append(path)
                if path != final:
                    self._staged.append((path, final))
                spare = [p for p in self.reserved if p != path and p.exists()]
                if spare and not path.exists():
                    os.rename(spare[0], path)
                    _move_mapping(spare[0], path)
                    self.reserved.remove(spare[0])
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
                self.fds.append(fd)
                os.ftruncate(fd, size)
            self._map(copy)
        except BaseException:
            self.abort()
            raise
        self._chunks = [[] for _ in copy.files]
        for b_i, b in enumerate(copy.part.blobs):
            for j, c in enumerate(b.chunks):
                self._chunks[c.file].append((c.offset, c.length, c.xxh3, f"{b_i}/{j}"))
        for chunks in self._chunks:
            chunks.sort()
        self.copy = copy

    def _map(self, copy: Copy) -> None:
        """Map the copy's files shared and start faulting them in, in order, on a thread
        of their own: the wire receives each piece straight into the mapping (no copy),
        into memory faulted while the pieces before it traveled. Fresh memory (a
        replaced node's host area) fills several times slower than faulted memory, and
        MADV_POPULATE_WRITE reports a full /dev/shm as an error where a store into the
        mapping would be a SIGBUS: a piece is received into the mapping only once its
        range is populated."""
        for f, (_, size) in enumerate(copy.files):
            if size == 0:
                self._maps.append(None)
                self._views.append(None)
                continue
            path = self._paths[f]
            arena = _take_mapping(path, size, self.fds[f]) or _native.Arena(
                size,
                shm_path=str(path),
                huge_pages=False,
                pin=False,
                prefault=False,
            )
            self._maps.append(arena)
            buf = (ctypes.c_char * size).from_address(arena.address)
            self._views.append(torch.frombuffer(buf, dtype=torch.uint8))
        self._sizes = list(copy.files)
        self._faulted = [0] * len(copy.files)
        self._faulter = threading.Thread(
            target=self._fault, args=([n for _, n in copy.files],), name="snapcore-peer-fault"
        )
        self._faulter.start()

    def _fault(self, sizes: list[int]) -> None:
        populate = True
        try:
            for f, size in enumerate(sizes):
                arena = self._maps[f]
                for off in range(0, size, FAULT_STEP):
                    if self._stop:
                        return
                    n = min(FAULT_STEP, size - off)
                    err = self._populate(arena, off, n) if populate else 0
                    if err == errno.EINVAL:  # a kernel older than 5.14: faults on arrival
                        populate = False
                    elif err:
                        self.failed = self.failed or SnapcoreError(
                            "partner memory full: faulting in the copy of rank "
                            f"{self.rank}'s part in {self._paths[f]}: "
                            f"{os.strerror(err)}"
                        )
                        return
                    with self._progress:
                        self._faulted[f] = off + n
                        self._progress.notify_all()
        except BaseException as e:  # never leave the wire waiting
            self.failed = self.failed or e
        finally:
            with self._progress:
                self._fault_done = True
                self._progress.notify_all()

    @staticmethod
    def _populate(arena: Any, off: int, n: int) -> int:
        """Fault ``[off, +n)`` of ``arena`` in; 0, or the errno."""
        if arena is None or _libc.madvise(arena.address + off, n, MADV_POPULATE_WRITE) == 0:
            return 0
        return ctypes.get_errno()

    def target(self, file: int, offset: int, nbytes: int) -> torch.Tensor | None:
        """Where the wire receives piece ``[offset, +nbytes)`` of file ``file``: a view of
        its mapping, once that range is faulted in; None once the copy has failed (the
        wire then receives the piece into a buffer of its own and drops it)."""
        with self._progress:
            self._progress.wait_for(
                lambda: self._fault_done or self._faulted[file] >= offset + nbytes
            )
        view = self._views[file]
        if self.failed is not None or view is None:
            return None
        return view[offset : offset + nbytes]

    def received(self, file: int, offset: int, nbytes: int) -> None:
        """Piece ``[offset, +nbytes)`` of file ``file`` is in the mapping (pieces come in
        order): the chunks it holds are hashed. A failure is kept for ``finish``."""
        if self.failed is not None:
            return
        view = self._views[file]
        assert view is not None
        self._hash(file, offset, memoryview(view[offset : offset + nbytes].numpy()).cast("B"))

    def write(self, file: int, offset: int, data: torch.Tensor) -> None:
        """Piece ``data`` of file ``file`` at ``offset`` (pieces come in order), copied
        into the mapping and hashed: ``target`` and ``received`` without a zero-copy
        receive. A failure is kept for ``finish`` (the sender goes on sending: the
        wire's stages stay in step)."""
        t = self.target(file, offset, data.numel())
        if t is None:
            return
        t.copy_(data)
        self.received(file, offset, data.numel())

    def _hash(self, file: int, offset: int, view: memoryview) -> None:
        assert self.copy is not None
        try:
            end = offset + len(view)
            for c_off, c_len, xxh3, where in self._chunks[file]:
                lo, hi = max(c_off, offset), min(c_off + c_len, end)
                if lo >= hi:
                    continue
                key = (file, c_off)
                h = self._hashers.get(key)
                if h is None:
                    h = self._hashers[key] = xxhash.xxh3_128()
                h.update(view[lo - offset : hi - offset])
                got = self._done[key] = self._done.get(key, 0) + hi - lo
                if got == c_len and h.hexdigest() != xxh3:
                    name = self.copy.part.files[file].name
                    raise InvalidManifest(
                        f"the copy of rank {self.copy.rank}'s step {self.copy.step} arrived "
                        f"damaged: chunk {where} at [{c_off}, +{c_len}) of {name} has xxh3 "
                        f"{h.hexdigest()}, the part says {xxh3}"
                    )
        except BaseException as e:
            self.failed = e

    def finish(self) -> None:
        """Check that every chunk arrived whole and intact, then commit: the part, then
        (``commit_index``) the index, each written atomically."""
        copy = self.copy
        assert copy is not None
        try:
            if self.failed is not None:
                raise self.failed
            for file, chunks in enumerate(self._chunks):
                for c_off, c_len, _, where in chunks:
                    if c_len and self._done.get((file, c_off), 0) != c_len:
                        raise InvalidManifest(
                            f"the copy of rank {copy.rank}'s step {copy.step}: chunk {where} "
                            "did not arrive whole"
                        )
        except BaseException:
            self.abort()
            raise
        self._close(unmap=False)  # the mapping goes later (release): off the fetch's path
        if self._protected is not None:  # the new copy is whole: the newest one goes now
            LocalDirectory(self.root).uncommit(self._protected)
        for path, final in self._staged:
            os.replace(path, final)
            _move_mapping(path, final)
        if self._staged:
            fsync_dir(self.root)
        self._staged = []
        step_dir = self.root / step_dir_name(copy.step)
        _write_atomic(self.root / copy.part_name, copy.part_bytes)
        if self.commit_index:
            _write_atomic(step_dir / MANIFEST, copy.index_bytes)

    def write_index(self) -> None:
        assert self.copy is not None
        path = self.root / step_dir_name(self.copy.step) / MANIFEST
        if not path.exists():
            _write_atomic(path, self.copy.index_bytes)

    def abort(self) -> None:
        """Nothing of this copy is committed; its files are left to be overwritten (a file
        received beside the newest copy's is removed)."""
        self._close()
        self._drop_staged()
        if self.budget is not None:
            self.budget.release(self.root)

    def abandon(self) -> list[Any]:
        """``abort``, but the mappings stay: returned, for the caller to keep until the
        process ends (a transfer that failed may still have gloo writing into them)."""
        self._close(unmap=False)
        self._drop_staged()
        kept, self._maps, self._views = [*self._maps, *self._views], [], []
        return kept

    def _drop_staged(self) -> None:
        for path, _ in self._staged:
            with contextlib.suppress(OSError):
                path.unlink()
        self._staged = []

    def release(self) -> None:
        """Unmap the copy's files once it is committed (``finish`` leaves them mapped:
        tearing down a large mapping's page tables takes tens of milliseconds, which a
        restore need not wait for). Idempotent; ``abort`` does it too."""
        self._views = []
        for arena in self._maps:
            if arena is not None:
                with contextlib.suppress(Exception):
                    arena.close()
        self._maps = []

    def _close(self, *, unmap: bool = True) -> None:
        if self._faulter is not None:
            self._stop = True
            self._faulter.join()
            self._faulter = None
        if unmap:
            self.release()
        for fd, (_, size) in zip(self.fds, self._sizes, strict=False):  # mapped: a page up
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []


def _bytes_of(root: Path, *, exclude: frozenset[str] | set[str] = frozenset(),
              only: set[str] | None = None) -> int:  # fmt: skip
    total = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            rel = os.path.relpath(os.path.join(dirpath, f), root)
            if f.startswith(INCOMING):  # arriving: counted by its size (Budget)
                continue
            if rel in exclude or (only is not None and rel not in only):
                continue
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
    return total


def _data_files(root: Path) -> list[Path]:
    """The data files of a peer namespace (its top-level files but ``peer.json``, and
    those arriving or being written)."""
    try:
        entries = list(os.scandir(root))
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [
        Path(e.path)
        for e in entries
        if e.is_file(follow_symlinks=False) and e.name != IDENTITY and not e.name.startswith(".")
    ]


def _free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


_SOURCE_DIR = re.compile(r"^r(\d{1,7})$")


class PeerCopies:
    """The copies a node holds of other ranks' parts, read as one tier (``"peer"``),
    together with the node's own parts in its host area: a restore reads from it the
    chunks its node's own tiers lack or hold damaged before it would go to object
    storage, and with every rank's part at
    hand (a node's own and its copies, in a ring of two nodes) it is the complete view
    the reader checks the other, partial, node-local tiers against. Read only."""

    name = "peer"

    def __init__(self, area_root: Path, identity: dict[str, Any]) -> None:
        self.area_root = area_root
        self.identity = identity
        self._paths: dict[str, Path] = {}  # data file name -> where (set by read_manifest)

    def describe(self) -> str:
        return str(self.area_root / "peer")

    def _areas(self) -> dict[int, PeerArea]:
        try:
            entries = os.listdir(self.area_root / "peer")
        except (FileNotFoundError, NotADirectoryError):
            return {}
        out = {}
        for entry in entries:
            m = _SOURCE_DIR.match(entry)
            if m:
                area = PeerArea(self.area_root, int(m.group(1)))
                if area.identity() == self.identity:
                    out[area.source] = area
        return out

    def committed_steps(self) -> list[int]:
        return sorted({s for a in self._areas().values() for s in a.dir.committed_steps()})

    def read_manifest(self, step: int) -> mf.Manifest:
        holding = [a for a in self._areas().values() if step in a.dir.committed_steps()]
        if not holding:
            raise SnapshotNotFound(f"no copy of step {step} in {self.describe()}")
        path = holding[0].dir.manifest_path(step)
        index = Copy.index_of(path.read_bytes())
        dirs = [self.area_root] + [a.root for a in holding]  # the node's own parts first
        paths: dict[str, Path] = {}

        def read_part(name: str, size: int) -> bytes | None:
            for d in dirs:
                p = d / name
                if not p.is_file() or p.is_symlink():
                    continue
                with open(p, "rb") as f:
                    data = f.read(size + 1)
                with contextlib.suppress(SnapcoreError):  # read_sharded says what is wrong
                    for fr in mf.parse_part(data, where=str(p)).files:
                        paths[fr.name] = d / fr.name
                return data
            return None

        m = read_sharded(index, read_part, where=str(path), partial=True)
        self._paths = paths
        return m

    def _path(self, name: str) -> Path | None:
        return self._paths.get(name)

    def file_size(self, name: str) -> int | None:
        path = self._path(name)
        if path is None:
            return None
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None
        if not stat.S_ISREG(st.st_mode):
            raise CorruptSnapshot(f"peer copy {path} is not a regular file", file=str(path))
        return st.st_size

    def read_into(self, name: str, offset: int, length: int, address: int) -> None:
        path = self._path(name)
        if path is None:
            raise CorruptSnapshot(f"no peer copy holds {name}", file=name)
        if length:
            _native.read_into(str(path), offset, length, address)

    def uncommit(self, step: int) -> None:
        raise NotImplementedError("the peer tier's copies are managed by their receivers")

    def collect(self, *, dry_run: bool = False) -> list[str]:
        return []
