"""A local store: a directory of step directories (docs/format.md, "Store" and "Commit").

The commit protocol makes a snapshot visible only once its manifest is renamed into
place after everything it references is durable. Snapshots being written hold a flock on
a `<token>.pending` file; one nobody holds belongs to a writer that died.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

import xxhash

from . import manifest as mf
from .assemble import read_sharded
from .durable import fsync_dir
from .errors import InvalidManifest, SnapshotNotFound, StorageError

log = logging.getLogger(__name__)

# Only the names writers make are steps: 12 digits zero-padded, or more without a leading
# zero (docs/format.md, "Store"). A stray `step-300` is not step 300.
STEP_DIGITS = r"(?:\d{12}|[1-9]\d{12,19})"
STEP_DIR = re.compile(rf"^step-({STEP_DIGITS})$")
MANIFEST = "manifest.json"
PENDING_SUFFIX = ".pending"
COLLECT_MARKER = "collect.needed"
# Data files retention freed, kept to be written over by the next saves (docs/format.md,
# "Spare data files"): in the store's SPARE_DIR, named as SPARE_NAME says (snapcore
# touches no other file there), at most as many as the newest snapshot has data files
# and at most SPARES_MAX.
SPARE_DIR = "snapcore-spare"
SPARE_NAME = re.compile(r"^[0-9a-f]{12}\.bin$")
SPARES_MAX = 16
DATA_FILE = re.compile(r"^data-[0-9a-f]+-r\d+(?:-\d+)?\.bin$")


def step_dir_name(step: int) -> str:
    return f"step-{step:012d}"


def part_file_name(step: int, rank: int, token: str, *, spread: bool = False) -> str:
    """The store-relative name of a rank's part of a sharded step (docs/format.md); with
    ``spread``, under the rank's object-name prefix (``rank_prefix``)."""
    where = f"{step_dir_name(step)}/{rank_prefix(rank)}" if spread else step_dir_name(step)
    return f"{where}/part-{rank:05d}-{token}.json"


def rank_prefix(rank: int) -> str:
    """The directory in a step under which object storage keeps a rank's objects: one of
    4096 (``p`` and 3 hex digits of the rank's xxh3), so that the requests of thousands
    of ranks spread over as many S3 prefixes (docs/distributed.md, "At scale")."""
    return f"p{xxhash.xxh3_64_intdigest(str(rank).encode()) % 4096:03x}"


@dataclass
class SnapshotInfo:
    step: int
    path: Path
    committed: bool


class Pending:
    """A snapshot being written: its step directory, token and the lock that marks it live."""

    def __init__(self, store: LocalDirectory, step: int) -> None:
        self.store = store
        self.step = step
        self.dir = store.root / step_dir_name(step)
        self._fd: int | None = None
        self.committed = False
        # Another rank's collector may remove the empty directory at any time until our
        # lock is in it, even between mkdir's EEXIST and its is_dir() check: pathlib's
        # mkdir(exist_ok=True) then raises FileExistsError. Both mkdirs allow for that.
        if not self.dir.exists():
            with contextlib.suppress(FileExistsError):  # the loop below makes it again
                self.dir.mkdir(parents=True, exist_ok=True)
            fsync_dir(store.root)  # the new directory's entry must survive a power loss
        for _ in range(100):
            made = not self.dir.exists()
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
            except FileExistsError:  # removed by a collector meanwhile: try again
                continue
            if made:  # made again after a collector removed it: its entry must last too
                fsync_dir(store.root)
            self.token = secrets.token_hex(6)
            self.lock_path = self.dir / f"{self.token}{PENDING_SUFFIX}"
            try:
                fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except FileNotFoundError:  # a collector removed the empty directory meanwhile
                continue
            # A collector may claim the fresh lock file between open and flock (it then
            # deletes it): take the lock, then make sure the file is still ours.
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if os.stat(self.lock_path).st_ino == os.fstat(fd).st_ino:
                    self._fd = fd
                    break
            except OSError:
                pass
            os.close(fd)
        else:
            raise StorageError(errno.EBUSY, "cannot create a pending-snapshot lock", str(self.dir))
        fsync_dir(self.dir)

    def data_name(self, rank: int, index: int = 0) -> str:
        suffix = f"-{index}" if index else ""
        return f"{step_dir_name(self.step)}/data-{self.token}-r{rank}{suffix}.bin"

    def commit(self, m: mf.Manifest | mf.Index) -> None:
        """Write the manifest last and atomically: tmp file, fsync, rename, fsync dir."""
        tmp = self._write_tmp(MANIFEST, m.dumps())
        if (self.dir / MANIFEST).exists():  # a re-save: the old files need a full collection
            (self.dir / COLLECT_MARKER).touch()
            fsync_dir(self.dir)
        os.replace(tmp, self.dir / MANIFEST)
        self.committed = True  # visible now: from here on nothing may abort it
        fsync_dir(self.dir)
        self.release()

    def _write_tmp(self, name: str, data: bytes) -> Path:
        tmp = self.dir / f"{name}.{self.token}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        return tmp

    def write_part(self, rank: int, data: bytes) -> str:
        """Write this rank's part of a sharded step durably (not a commit: the step is
        committed by its index); returns its store-relative name."""
        name = part_file_name(self.step, rank, self.token)
        tmp = self._write_tmp(name.rsplit("/", 1)[1], data)
        os.replace(tmp, self.store.root / name)
        fsync_dir(self.dir)
        return name

    def settle(self) -> None:
        """This rank's part is in a step another rank committed: done, lock dropped."""
        self.committed = True
        self.release()

    def abort(self) -> None:
        """Remove what this snapshot wrote; the previous committed one is untouched."""
        if self.committed:
            raise AssertionError("a committed snapshot cannot be aborted")
        for p in self.dir.glob(f"*{self.token}*"):
            if p != self.lock_path:
                with contextlib.suppress(OSError):
                    p.unlink()
        self.release()
        with contextlib.suppress(OSError):
            self.dir.rmdir()  # only if nothing else lives there

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                self.lock_path.unlink()
            os.close(self._fd)
            self._fd = None


class LocalDirectory:
    """A directory store. Thread-safe for readers; one writer per step at a time."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).absolute()

    def __repr__(self) -> str:
        return f"LocalDirectory({str(self.root)!r})"

    def ensure(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StorageError(
                e.errno, f"cannot create store directory: {e.strerror}", str(self.root)
            ) from e

    # -- listing ---------------------------------------------------------------------------
    def snapshots(self) -> list[SnapshotInfo]:
        """Every step directory, committed or not, in numeric step order."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        except NotADirectoryError:
            raise StorageError(
                errno.ENOTDIR, "the store is not a directory", str(self.root)
            ) from None
        out = []
        for name in names:
            m = STEP_DIR.match(name)
            path = self.root / name
            # A symlink named like a step is not ours: collecting "its" leftovers would
            # delete files outside the store.
            if m and stat.S_ISDIR(_lstat_mode(path)):
                # Committed means a manifest.json entry exists (format.md): one that is not
                # a regular file is then refused by read_manifest, not silently skipped.
                committed = os.path.lexists(path / MANIFEST)
                out.append(SnapshotInfo(int(m.group(1)), path, committed))
        out.sort(key=lambda s: s.step)
        return out

    def committed_steps(self) -> list[int]:
        return [s.step for s in self.snapshots() if s.committed]

    def resolve_step(self, step: int | None) -> int:
        steps = self.committed_steps()
        if not steps:
            raise SnapshotNotFound(f"no committed snapshot in {self.root}")
        if step is None:
            return steps[-1]
        if step not in steps:
            raise SnapshotNotFound(
                f"no committed snapshot of step {step} in {self.root} (steps: {_ranges(steps)})"
            )
        return step

    def manifest_path(self, step: int) -> Path:
        return self.root / step_dir_name(step) / MANIFEST

    def read_manifest(self, step: int) -> mf.Manifest:
        path = self.manifest_path(step)
        data = read_regular_file(path, mf.MAX_MANIFEST_BYTES + 1, what="manifest")
        if data is None:
            raise SnapshotNotFound(f"no committed snapshot of step {step} in {self.root}")
        doc = mf.parse_any(data, where=str(path))
        if doc.step != step:
            raise InvalidManifest(f"{path}: manifest says step {doc.step}, directory says {step}")
        if isinstance(doc, mf.Index):
            # a directory of one node holds its ranks' parts only
            return read_sharded(doc, self._read_part, where=str(path), partial=True)
        m = doc
        if m.step != step:
            raise InvalidManifest(f"{path}: manifest says step {m.step}, directory says {step}")
        return m

    def _read_part(self, name: str, size: int) -> bytes | None:
        path = self.file_path(name)
        if path != self.root.resolve() / name:
            raise InvalidManifest(f"{self.root}/{name}: a part reached through a symbolic link")
        return read_regular_file(path, size + 1, what="part")

    def file_path(self, name: str) -> Path:
        """Path of a data file named by a manifest; never outside the store."""
        path = (self.root / name).resolve()
        root = self.root.resolve()
        if root not in path.parents:
            raise InvalidManifest(f"file name {name!r} escapes the store {self.root}")
        return path

    # -- writing and cleaning --------------------------------------------------------------
    def begin(self, step: int) -> Pending:
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative int, not {step!r}")
        self.ensure()
        return Pending(self, step)

    def referenced_files(self) -> set[str] | None:
        """Names of the data files every committed manifest refers to.

        ``None`` if a manifest cannot be read: then nothing may be deleted, since a
        damaged manifest's files are unknown.
        """
        names: set[str] = set()
        for step in self.committed_steps():
            try:
                m = self.read_manifest(step)
                names |= {f.name for f in m.files} | set(m.part_files)
            except (InvalidManifest, SnapshotNotFound) as e:
                log.warning("not collecting garbage in %s: %s", self.root, e)
                return None
        return names

    def collect_leftovers(
        self, *, full: bool = False, dry_run: bool = False, recycle: bool = False
    ) -> list[Path]:
        """Delete what interrupted snapshots left behind; returns the paths removed.

        A `.pending` file whose flock can be taken belongs to a dead writer, and the files
        with its token are leftovers, unless a committed manifest names them (the writer
        may have died between committing and removing its lock). Chunks are shared
        between snapshots, so "referenced" means by any committed manifest of the store.
        ``full`` also removes every other unreferenced data file (after retention deleted
        manifests), but only while no writer is live: a live writer may be about to
        reference an old file.

        ``recycle`` (retention, after a commit) keeps unreferenced data files as spares
        (``SPARE_DIR``) for the next saves to write over, up to ``SPARES_MAX``; a ``full``
        collection without it (``snapcore gc``, ``delete``) removes the spares too.
        """
        snaps = self.snapshots()
        live: set[str] = set()
        dead: set[str] = set()
        removed: list[Path] = []
        listing: dict[Path, list[str]] = {}
        claimed: dict[Path, int] = {}
        try:
            for snap in snaps:
                listing[snap.path] = names = _listdir(snap.path)
                for name in [n for n in names if n.endswith(PENDING_SUFFIX)]:
                    token = name[: -len(PENDING_SUFFIX)]
                    fd = _claim_if_dead(snap.path / name)
                    if fd is None:
                        live.add(token)
                    else:
                        dead.add(token)
                        claimed[snap.path / name] = fd
            owed = [s for s in snaps if COLLECT_MARKER in listing[s.path]]
            full = full or bool(owed and not live)
            self._collect(snaps, listing, live, dead, full, dry_run, recycle, removed)
            if full and not recycle:
                removed += self._drop_spares(dry_run)
            if full and not live and not dry_run:
                for s in owed:
                    with contextlib.suppress(FileNotFoundError):
                        (s.path / COLLECT_MARKER).unlink()
        finally:
            for lock, fd in claimed.items():  # the marker of a dead writer goes last
                if not dry_run:
                    with contextlib.suppress(FileNotFoundError):
                        lock.unlink()
                removed.append(lock)
                os.close(fd)
            for snap in snaps:
                if not dry_run and not (snap.path / MANIFEST).exists():
                    with contextlib.suppress(OSError):
                        snap.path.rmdir()  # only if nothing is left in it
        if removed:
            log.info("removed %d leftover file(s) in %s", len(removed), self.root)
        return removed

    def _collect(
        self,
        snaps: list[SnapshotInfo],
        listing: dict[Path, list[str]],
        live: set[str],
        dead: set[str],
        full: bool,
        dry_run: bool,
        recycle: bool,
        removed: list[Path],
    ) -> None:
        # While any writer is live, only dead writers' own files go: a live one may be
        # about to reference any other file (shared chunks), even in an uncommitted dir.
        # A writer whose files a committed manifest names already committed and only
        # has its lock to remove (the node's other ranks, while their leader applies
        # retention right after the step's commit): it will reference nothing more.
        referenced: set[str] | None = None
        if full and live:
            referenced = self.referenced_files()
            if referenced is None:
                return
            names = sorted(referenced)
            live.difference_update({t for t in live if _tokens_in(names, {t})})
        orphan_dirs = [] if live else [s for s in snaps if not s.committed]
        if not (dead or orphan_dirs or full):
            return
        if referenced is None:
            referenced = self.referenced_files()
        if referenced is None:
            return
        if full and live:
            log.info(
                "a snapshot is being written to %s: only dead writers' files are collected",
                self.root,
            )
            full = False
        # spares: how many more freed files to keep (none unless recycling)
        recycle = recycle and not dry_run
        wanted, largest = self._spares_wanted(snaps, listing) if recycle else (0, 0)
        # (spares too large for the next save do not count: they are deleted below)
        fit = sum(1 for size, _ in self._spares() if size <= largest) if recycle else 0
        keep = wanted - fit
        for snap in snaps:
            for name in listing[snap.path]:
                if name in (MANIFEST, COLLECT_MARKER) or name.endswith(PENDING_SUFFIX):
                    continue
                if _tokens_in([name], live):
                    continue
                if f"{snap.path.name}/{name}" in referenced:
                    continue
                if not (full or _tokens_in([name], dead) or snap in orphan_dirs):
                    continue
                path = snap.path / name
                if not stat.S_ISREG(_lstat_mode(path)):
                    continue  # only regular files are ours to delete
                if not dry_run:
                    try:
                        if keep > 0 and DATA_FILE.match(name) and self._spare(path):
                            keep -= 1
                        else:
                            path.unlink()
                    except FileNotFoundError:
                        continue
                removed.append(path)
            if not dry_run and not (snap.path / MANIFEST).exists():
                with contextlib.suppress(OSError):
                    snap.path.rmdir()  # only if nothing is left in it
        # beyond what the next save takes: those too large for it, then the smallest
        spares = sorted(self._spares(), key=lambda s: (s[0] <= largest, s[0])) if recycle else []
        for _, path in spares[: max(0, len(spares) - wanted)]:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(path)

    # -- spare data files (docs/format.md, "Spare data files") ---------------------------
    def _spare_dir(self) -> Path | None:
        """The spares' directory; None unless it is a directory (a symbolic link there
        could lead out of the store: its files are neither taken nor deleted)."""
        path = self.root / SPARE_DIR
        return path if stat.S_ISDIR(_lstat_mode(path)) else None

    def _spares_wanted(
        self, snaps: list[SnapshotInfo], listing: dict[Path, list[str]]
    ) -> tuple[int, int]:
        """How many spares the next save may take, and the largest it would take: as many
        data files as the newest committed snapshot has (every rank's, in a node's shared
        directory), the size ``take_spare`` accepts for the largest of them."""
        newest = max((s for s in snaps if s.committed), key=lambda s: s.step, default=None)
        if newest is None:
            return 0, 0
        sizes = []
        for name in listing.get(newest.path, ()):
            if DATA_FILE.match(name):
                with contextlib.suppress(OSError):
                    sizes.append(os.lstat(newest.path / name).st_size)
        return min(SPARES_MAX, len(sizes)), _largest_spare_for(max(sizes, default=0))

    def _spares(self) -> list[tuple[int, Path]]:
        """The spares a save may take, with their sizes: files named as ``_spare`` names
        them, regular, with no other name (a hard link's bytes are another file's too),
        owned by this user and writable by it. Other entries are left alone."""
        spare_dir = self._spare_dir()
        if spare_dir is None:
            return []
        out = []
        for name in _listdir(spare_dir):
            if not SPARE_NAME.match(name):
                continue
            try:
                st = os.lstat(spare_dir / name)
            except FileNotFoundError:
                continue
            if _takeable(st):
                out.append((st.st_size, spare_dir / name))
        return out

    def _spare(self, path: Path) -> bool:
        """Move unreferenced data file ``path`` into the spares; False where that fails
        or where it is no use as one (another name links to it, another user owns it)."""
        try:
            if not _takeable(os.lstat(path)):
                return False
        except FileNotFoundError:
            raise  # gone meanwhile: nothing to remove either
        try:
            (self.root / SPARE_DIR).mkdir()
        except FileExistsError:
            pass
        except OSError as e:
            log.debug("not keeping %s as a spare: %s", path, e)
            return False
        spare_dir = self._spare_dir()
        if spare_dir is None:
            return False
        try:
            os.rename(path, spare_dir / f"{secrets.token_hex(6)}.bin")
        except FileNotFoundError:
            if os.path.lexists(path):
                return False  # the spares' directory went meanwhile (snapcore gc)
            raise  # gone meanwhile: nothing to remove either
        except OSError as e:
            log.debug("not keeping %s as a spare: %s", path, e)
            return False
        return True

    def give_back(self, path: Path) -> bool:
        """Return a spare taken by ``take_spare`` and not used; False where it failed."""
        try:
            return self._spare(path)
        except FileNotFoundError:
            return False

    def take_spare(self, dest: Path, size: int) -> int | None:
        """Move a spare data file to ``dest`` (a new data file's path, in a pending step)
        for a file of at most ``size`` bytes: the smallest spare that holds it, else the
        largest. Returns its size, or None when there is none (write a new file then).

        A rename, so a spare goes to one writer only, and any time before it may still be
        removed by a collection. What arrives at ``dest`` is checked to be the file that
        was checked in the spares (else it is removed and the next one tried)."""
        spares = [sp for sp in self._spares() if sp[0] <= _largest_spare_for(size)]
        fits = sorted(sp for sp in spares if sp[0] >= size)
        rest = sorted((sp for sp in spares if sp[0] < size), reverse=True)
        for _, path in fits + rest:
            try:
                before = os.lstat(path)
                if not _takeable(before):
                    continue
                os.rename(path, dest)
            except FileNotFoundError:
                continue  # taken by another writer, or collected
            except OSError as e:
                log.debug("not reusing spare %s: %s", path, e)
                return None
            try:
                after = os.lstat(dest)
            except FileNotFoundError:
                continue
            if (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino) and _takeable(after):
                return after.st_size
            # swapped after the check: not ours to write; back where it was
            try:
                os.rename(dest, path)
            except OSError as e:
                raise StorageError(
                    f"{path} was replaced while it was taken as a spare data file, and "
                    f"what came in its place could not be moved back from {dest}: {e}"
                ) from e
        return None

    def room_for(self, dest: Path, nbytes: int) -> None:
        """A new data file at ``dest`` needs ``nbytes`` more: if the file system has less
        room than that, the spares are deleted first (they are retention's freed files,
        held only to be written over)."""
        try:
            st = os.statvfs(dest.parent)
        except OSError:
            return
        if st.f_bavail * st.f_frsize >= nbytes:
            return
        dropped = 0
        for _, path in self._spares():  # this user's: another's are not in its way
            try:
                path.unlink()
                dropped += 1
            except OSError as e:  # never the save's failure: the write may still fit
                log.debug("not deleting spare %s: %s", path, e)
        if dropped:
            log.info(
                "%s: %d spare data file(s) deleted to make room for %d bytes",
                self.root,
                dropped,
                nbytes,
            )

    def _drop_spares(self, dry_run: bool) -> list[Path]:
        spare_dir = self._spare_dir()
        if spare_dir is None:
            return []
        removed = []
        for name in _listdir(spare_dir):
            path = spare_dir / name
            if not SPARE_NAME.match(name) or not stat.S_ISREG(_lstat_mode(path)):
                continue  # only the files _spare made are ours to delete
            if not dry_run:
                try:
                    path.unlink()
                except FileNotFoundError:
                    continue
            removed.append(path)
        if not dry_run:
            with contextlib.suppress(OSError):
                spare_dir.rmdir()  # only if nothing is left in it
        return removed

    def delete(self, step: int) -> None:
        """Delete a committed snapshot: its manifest first (so it is never half-visible),
        then every data file no other committed manifest still shares."""
        self.uncommit(step)
        self.collect_leftovers(full=True)

    def uncommit(self, step: int) -> None:
        """Make a committed snapshot invisible (its manifest goes first, atomically).

        Its data files stay until ``collect_leftovers(full=True)`` finds that no other
        committed manifest shares them.
        """
        d = self.root / step_dir_name(step)
        with contextlib.suppress(FileNotFoundError):
            (d / MANIFEST).unlink()
            fsync_dir(d)


def read_regular_file(path: Path, limit: int, *, what: str) -> bytes | None:
    """Up to ``limit`` bytes of the regular file at ``path``; None if there is none.

    A symlink is refused (it could lead out of the store), and so is anything but a
    regular file: a FIFO is opened non-blocking and refused before it is read, so that it
    cannot hang the reader (docs/format.md, "Store").
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise InvalidManifest(f"{path}: the {what} is a symbolic link") from None
        raise StorageError(e.errno, f"cannot open the {what}: {e.strerror}", str(path)) from e
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise InvalidManifest(f"{path}: the {what} is not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(limit)
    finally:
        os.close(fd)


def _claim_if_dead(path: Path) -> int | None:
    """Lock a pending-lock file nobody holds; the open fd, or None if its writer lives."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        raise
    return fd


def _largest_spare_for(size: int) -> int:
    """The largest spare worth taking for a file of ``size`` bytes: cutting a spare back
    to the bytes written is on the path to durable, and costs what it frees."""
    return 2 * size + (1 << 20)


def _takeable(st: os.stat_result) -> bool:
    """Whether a file may be a spare: regular, its only name, owned and writable by this
    process's user."""
    return (
        stat.S_ISREG(st.st_mode)
        and st.st_nlink == 1
        and st.st_uid == os.geteuid()
        and bool(st.st_mode & stat.S_IWUSR)
    )


def _lstat_mode(path: Path) -> int:
    try:
        return os.lstat(path).st_mode
    except FileNotFoundError:
        return 0


def _listdir(path: Path) -> list[str]:
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []


def _tokens_in(names: list[str], tokens: set[str]) -> bool:
    return any(t in n for n in names for t in tokens)


def _ranges(steps: list[int]) -> str:
    if len(steps) <= 8:
        return ", ".join(map(str, steps))
    return f"{steps[0]}, {steps[1]}, ..., {steps[-1]} ({len(steps)} in all)"
