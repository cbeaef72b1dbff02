"""The public functions: save, async_save, restore, load."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from .distributed.job import Job, all_gather_bytes
from .distributed.job import current as current_job
from .errors import CorruptSnapshot, SnapcoreError, SnapshotNotFound, StateMismatch, StoreInUse
from .manifest import Manifest
from .peer import Fetched, peer_copies
from .peer import prepare_restore as prepare_peer_restore
from .read import (
    OutOfStep,
    Reader,
    RestoreInfo,
    describe_error,
    exchange_plan,
    exchange_save,
    out_of_step,
)
from .staging.handle import SaveHandle, SaveStats
from .tiers import HostTier, Store, Tier, host_area_names
from .tree import RestorePlan, flatten
from .write import writer_lock
from .write.engine import Engine, close_all, engine_for, engine_uses_host

log = logging.getLogger(__name__)

StoreLike = Store | str | os.PathLike[str]


def async_save(
    state: object,
    store: StoreLike,
    *,
    step: int,
    overlap: bool = False,
    budget_bytes: int | None = None,
    tiers: Iterable[str] | None = None,
) -> SaveHandle:
    """Snapshot ``state`` as ``step``; return as soon as the state is staged.

    ``store`` is a directory, an fsspec URL, or a ``Store`` naming several tiers. The
    snapshot is durable once ``handle.wait()`` returns (``wait(tier=...)`` for one tier).
    By default the state may be changed as soon as this returns. With ``overlap=True`` the
    copies of tensors that the state's optimizers write run on while training goes on,
    and each optimizer's next ``step()`` waits for them (or call ``handle.staged()``):
    for CUDA tensors its current stream waits, the CPU does not. Only the current stream
    is ordered (see docs/architecture.md); overlap mode is refused while a CUDA graph is
    being captured.
    ``budget_bytes`` bounds the host memory used for staging (default: the size of the
    state, times two with a host-memory tier); a smaller budget streams the state through
    the arena, and the call then blocks until the last part is staged. ``tiers`` sends
    this snapshot to some of the store's tiers only. A failure in the background is
    raised by ``handle.wait()`` and, if nobody waited for it, by the next save (under
    torch.distributed once that save is made: every rank makes every save; calling
    again for the same step returns its handle; docs/distributed.md).
    """
    return engine_for(store).async_save(
        state, step, overlap=overlap, budget=budget_bytes, tiers=tiers
    )


def save(
    state: object,
    store: StoreLike,
    *,
    step: int,
    budget_bytes: int | None = None,
    tiers: Iterable[str] | None = None,
) -> SaveStats:
    """Snapshot ``state`` as ``step`` and return once it is durable in every tier."""
    return async_save(state, store, step=step, budget_bytes=budget_bytes, tiers=tiers).wait()


def committed(store: StoreLike) -> dict[str, list[int]]:
    """The committed steps of each tier of ``store`` (a tier that cannot be read is left
    out, with a warning in the log)."""
    engine = engine_for(store)
    out: dict[str, list[int]] = {}
    for name in engine.config.tiers:
        if name == "host" and not engine.host_readable():
            log.info("host area %s belongs to another store: not read", engine.config.host)
            out[name] = []
            continue
        try:
            out[name] = engine.tier(name).committed_steps()
        except (OSError, SnapcoreError) as e:
            log.warning("cannot list the %s tier of %s: %s", name, engine.config.describe(), e)
    return out


Sources = list[tuple[Tier, Manifest]]  # each tier with its manifest of a step


def _opened(engine: Engine, steps: dict[str, list[int]], step: int) -> tuple[Sources, list[str]]:
    """The manifest of ``step`` in every tier that lists it (``steps``: ``committed()``),
    and the tiers whose manifest could not be read; raises when none could."""
    sources = []
    damaged: list[str] = []
    first: SnapcoreError | None = None
    for name, ss in steps.items():
        if step not in ss:
            continue
        tier = engine.tier(name)
        try:
            sources.append((tier, tier.read_manifest(step)))
        except (OSError, SnapcoreError) as e:
            damaged.append(f"{name}: {e}")
            first = first or (e if isinstance(e, SnapcoreError) else CorruptSnapshot(str(e)))
    if not sources:
        assert first is not None
        raise first
    return sources, damaged


def _reader(
    engine: Engine,
    steps: dict[str, list[int]],
    step: int,
    verify: bool,
    opened: tuple[Sources, list[str]] | None = None,
    save: str | None = None,
) -> Reader:
    """A reader of ``step`` over every tier that lists it (``opened``: their manifests,
    read here when not given), of save ``save`` only when one is given (the save the
    ranks agreed on: ``exchange_save``)."""
    sources, damaged = _opened(engine, steps, step) if opened is None else opened
    sources = _with_peer_copies(engine, sources, step)
    reader = Reader(sources, verify=verify, save=save)
    reader.damaged.extend(damaged)
    return reader


def _with_peer_copies(engine: Engine, sources: list[Any], step: int) -> list[Any]:
    """The peer tier (snapcore/peer): the copies this node holds of other ranks' parts
    serve, before object storage, the chunks its own tiers lack. Never a reason to take
    a step (they are not listed in ``committed``): only a source of chunks."""
    copies = peer_copies(engine.config)
    if copies is None or step not in copies.committed_steps():
        return sources
    try:
        m = copies.read_manifest(step)
    except (OSError, SnapcoreError) as e:
        log.warning("the peer copies of step %d cannot be read: %s", step, e)
        return sources
    at = next((i for i, (t, _) in enumerate(sources) if t.name == "remote"), len(sources))
    return [*sources[:at], (copies, m), *sources[at:]]


T = TypeVar("T")


def _read_agreed(
    engine: Engine,
    steps: dict[str, list[int]],
    job: Job,
    verify: bool,
    use: Callable[[Reader], T],
    step: int | None = None,
) -> tuple[T, Reader, list[str]]:
    """Under torch.distributed, ``step=None``: every rank takes the same step, the newest
    committed in a tier each rank reaches that every rank could read whole. Each rank
    tries it and the ranks tell each other how it went (a collective on snapcore's group
    per step tried, at restore time only): a step damaged on any rank is skipped by all,
    for the next older one, which every rank then reads again (a rank that had filled
    its state from the newer step is overwritten alike). A refusal that is not damage
    (the state does not fit) raises on every rank. With ``step``, only that step is
    tried: damaged or missing on any rank, it raises on every rank alike (so that all
    can try another step together). Any other exception on a rank (a bug, memory) is
    told to the others too, who raise ``StateMismatch`` naming it, instead of waiting
    for it until the timeout.

    The ranks agree on a save, not only a step number (``exchange_save``, before
    anything is read): a re-saved step whose newer save did not reach every node is
    restored from the newest save every rank reaches, or, when the ranks' tiers hold
    no save in common, skipped by all (for ``step``: ``CorruptSnapshot`` on every rank),
    never read as a mix of two saves. The first exchange carries each rank's ``step``,
    so that ranks that asked for different steps all raise ``OutOfStep``."""
    every = sorted({s for ss in steps.values() for s in ss}, reverse=True)
    mine_steps = {"kind": "steps", "step": step, "steps": every}
    heard = [json.loads(b) for b in all_gather_bytes(job, json.dumps(mine_steps).encode())]
    out_of_step(heard, "steps", step)  # restore(step=None) on one rank, step=N on another
    if step is None:
        common = sorted(set.intersection(*(set(h["steps"]) for h in heard)), reverse=True)
    else:
        common = [step]
    skipped: list[str] = []
    for s in common:
        result: Any = None
        reader: Reader | None = None
        mine: dict[str, Any] = {"kind": "verdict", "step": s, "damaged": None, "refused": None}
        error: BaseException | None = None
        opened: tuple[Sources, list[str]] | None = None
        unopened: BaseException | None = None
        try:
            if s not in every:
                raise SnapshotNotFound(
                    f"no committed snapshot of step {s} in {engine.config.describe()} on "
                    f"rank {job.rank}"
                )
            opened = _opened(engine, steps, s)
        except Exception as e:  # told in the exchange of saves, raised below
            unopened = e
        save, apart = exchange_save(job, s, opened[0] if opened else [], unopened is not None)
        if apart is not None:  # known alike on every rank: none reads the step
            if step is not None:
                raise CorruptSnapshot(apart, step=s)
            log.warning("%s: skipping %s", engine.config.describe(), apart)
            skipped.append(apart)
            continue
        try:
            if unopened is not None:
                raise unopened
            reader = _reader(engine, steps, s, verify, opened, save)
        except SnapcoreError as e:
            # the others enter the restore's exchange: take part in it, with the refusal
            exchange_plan(job, s, e)
            damage = isinstance(e, CorruptSnapshot | SnapshotNotFound)
            mine["damaged" if damage else "refused"], error = str(e), e
            mine["missing"] = isinstance(e, SnapshotNotFound)
        except Exception as e:  # not snapcore's (a bug, memory): the others are waiting
            exchange_plan(job, s, e)
            mine["refused"], error = describe_error(e), e
        try:
            if reader is not None:
                result = use(reader)
        except OutOfStep:  # every rank of the exchange raises it: no verdict follows
            raise
        except (CorruptSnapshot, SnapshotNotFound) as e:
            mine["damaged"], error = str(e), e
            mine["missing"] = isinstance(e, SnapshotNotFound)
        except SnapcoreError as e:
            mine["refused"], error = str(e), e
        except Exception as e:  # not snapcore's: the others must not wait for this rank
            mine["refused"], error = describe_error(e), e
        # whose damage or refusal it is: another rank's when the restore's exchange told us
        mine["origin"] = getattr(error, "rank", job.rank)
        said = [json.loads(b) for b in all_gather_bytes(job, json.dumps(mine).encode())]
        out_of_step(said, "verdict", s)
        refused = [(r, d["refused"]) for r, d in enumerate(said) if d["refused"]]
        if refused:
            if error is not None and mine["refused"]:
                raise error
            r, why = refused[0]
            raise StateMismatch(f"step {s}: rank {r} cannot restore it: {why}")
        damaged = [(r, d["damaged"]) for r, d in enumerate(said) if d["damaged"]]
        if not damaged:
            assert reader is not None
            return result, reader, skipped
        own = [(r, why) for r, why in damaged if said[r]["origin"] == r]  # not hearsay
        r, why = (own or damaged)[0]
        note = why if why.startswith(f"step {s}: ") else f"step {s}: {why}"
        if step is not None:  # the step asked for: no older one instead, on any rank
            if isinstance(error, SnapcoreError) and r == job.rank:
                raise error
            if said[r].get("missing"):
                raise SnapshotNotFound(f"{note} (rank {r})")
            raise CorruptSnapshot(f"{note} (rank {r})", step=s)
        log.warning("%s: skipping %s (rank %d)", engine.config.describe(), note, r)
        skipped.append(f"{note} (rank {r})")
    why = (
        f"no step of {engine.config.describe()} is committed and intact on every rank "
        f"(steps here: {every[:8]}; skipped: {skipped[:4]})"
    )
    if step is None and not any(h["steps"] for h in heard):  # no rank holds any step
        raise SnapshotNotFound(why)
    # Some rank holds a step that the job cannot restore whole: not a store to start
    # afresh from (a Checkpointer would otherwise begin again at step 0), and the state
    # may already hold part of a skipped step's tensors.
    err = CorruptSnapshot(why, step=common[0] if common else None)
    if skipped:
        err.add_note(
            "the state may hold part of the skipped steps' tensors:\n" + "\n".join(skipped)
        )
    raise err


def _read(
    store: StoreLike,
    step: int | None,
    verify: bool,
    use: Callable[[Reader], T],
    *,
    agree: bool = True,
) -> tuple[T, Reader, list[str]]:
    """``use(reader)`` on ``step``, or with ``step=None`` on the newest committed step
    that is intact in some tier: a step whose manifest, data files or chunks are damaged
    in every tier that holds it is skipped (logged as a warning) for the next older one.
    Returns what ``use`` returned, its reader, and the skipped steps ("step N: why")."""
    engine = engine_for(store)
    steps = committed(store)
    job = current_job() if agree else None
    if job is not None and engine.config.peer_spec is not None:
        # The peer tier (snapcore/peer): a replaced node's parts come back from its
        # partners' memory into its host area first; then the tiers are listed again.
        try:
            link = engine.peer_link(job)  # a collective at the first call
        except ValueError as e:  # a job of one node: no partner to restore from
            log.warning("restore: %s", e)
        else:
            engine.settle_reserve()  # prepare(): the memory the fetch receives into
            fetched = prepare_peer_restore(engine.config, steps, job, step, link)
            steps = committed(store)
            use = _noting_peer(use, fetched)
    if job is not None:  # every rank takes the same step, or raises with the others
        return _read_agreed(engine, steps, job, verify, use, step)
    every = sorted({s for ss in steps.values() for s in ss})
    if not every:
        raise SnapshotNotFound(f"no committed snapshot in {engine.config.describe()}")
    if step is not None:
        if step not in every:
            raise SnapshotNotFound(
                f"no committed snapshot of step {step} in {engine.config.describe()}"
            )
        reader = _reader(engine, steps, step, verify)
        return use(reader), reader, []
    skipped: list[str] = []
    newest: SnapcoreError | None = None
    for s in reversed(every):
        try:
            reader = _reader(engine, steps, s, verify)
            return use(reader), reader, skipped
        # SnapshotNotFound: the step went (retention by another process) since the listing
        except (CorruptSnapshot, SnapshotNotFound) as e:
            why = str(e) if str(e).startswith(f"step {s}: ") else f"step {s}: {e}"
            log.warning("%s: skipping %s", engine.config.describe(), why)
            skipped.append(why)
            newest = newest or e
        except SnapcoreError as e:  # e.g. the state does not fit the older step
            if skipped:
                e.add_note(
                    "newer steps were skipped as damaged (the state may hold part of their "
                    "tensors):\n" + "\n".join(skipped)
                )
            raise
    assert newest is not None
    if len(skipped) > 1:
        newest.add_note("older steps are damaged too:\n" + "\n".join(skipped[1:]))
    raise newest


def _with_peer(tier: str) -> str:
    """``RestoreInfo.tier`` of a rank whose part came from a partner's memory: the peer
    tier among the tiers read, in their order (its bytes are read from the host area they
    were received into)."""
    order = ("host", "peer", "local", "remote")
    read = set(tier.split("+")) | {"peer"}
    return "+".join(t for t in order if t in read)


def _noting_peer(use: Callable[[Reader], T], fetched: Fetched) -> Callable[[Reader], T]:
    def noted(reader: Reader) -> T:
        reader.peer_bytes, reader.peer_s = fetched.bytes, fetched.seconds
        reader.peer_ranks = list(fetched.ranks)
        reader.damaged.extend(fetched.notes)
        return use(reader)

    return noted


def restore(
    state: Any,
    store: StoreLike,
    *,
    step: int | None = None,
    verify: bool = True,
    strict: bool = True,
    rank_local: str = "error",
) -> RestoreInfo:
    """Load a committed snapshot into ``state`` in place (tensors keep device and storage).

    ``step=None`` takes the newest snapshot committed in any tier that is intact: a newer
    step damaged in every tier is skipped, with a warning, and listed in ``.skipped``.
    Each chunk is read from the fastest tier that holds it intact (host memory, local
    disk, object storage); ``.tier`` of the result says where the data came from,
    ``.damaged`` what was read elsewhere and ``.bytes`` how many bytes were read.

    The live state is the schema. Every tensor, value and object of ``state`` must be
    filled from the snapshot: with ``strict=True`` a leaf the snapshot lacks raises
    ``StateMismatch`` (naming its path) before anything is read; with ``strict=False`` it
    is left as it is and listed in ``.missing``. What the snapshot holds and the state has
    no place for is neither read nor added, and is listed in ``.unexpected`` (so
    ``restore({"model": m}, store)`` reads only the model). A module or optimizer takes a
    saved state dict, a dict takes a saved object's state dict, and a module's keys match
    across ``torch.compile`` (``_orig_mod.``) and DDP (``module.``) wrappers.

    Under torch.distributed every rank takes the same step (the newest every rank can
    read), and the same save of it (a re-saved step is never read as a mix of two
    saves), and reads only the bytes of its own shards, whatever world size and sharding
    saved it; DTensors are filled shard by shard. A snapshot saved by as many ranks gives
    each rank its own rank-local values (``snapcore.RNGState``,
    ``snapcore.distributed.RankLocal``); restored by another number of ranks, values the
    ranks saved differently raise ``StateMismatch`` naming them, unless ``rank_local=
    "keep"``, which leaves the state's own (docs/distributed.md).

    Raises ``SnapshotNotFound`` when there is none, ``CorruptSnapshot`` when no intact
    copy is left (for an explicit ``step``: of that step; ``verify=False`` skips the
    hashes), ``StateMismatch`` when the state cannot take the snapshot.
    """
    if rank_local not in ("error", "keep"):
        raise ValueError(f"rank_local must be 'error' or 'keep', not {rank_local!r}")
    t0 = time.perf_counter()
    job = current_job()
    rank, world = (job.rank, job.world_size) if job is not None else (0, 1)
    node = _node(engine_for(store), job)

    def keys() -> frozenset[str]:  # the state's global tensors (not rank-local)
        flat = flatten(state)
        return frozenset(p for p, local in zip(flat.paths, flat.local, strict=True) if not local)

    def use(reader: Reader) -> tuple[RestorePlan, int]:
        try:
            reader.select(rank, world, rank_local, keys)
        except Exception as e:  # snapcore's or not (a bug, memory): the others wait for it
            if job is not None:  # the others are in the restore's exchange: take part
                exchange_plan(job, reader.m.step, e)
            raise
        return reader.restore(state, strict=strict, job=job, node=node)

    (plan, n), reader, skipped = _read(store, step, verify, use)
    for d in reader.damaged:
        log.warning("restore of step %d: %s", reader.m.step, d)
    return RestoreInfo(
        step=reader.m.step,
        tier=_with_peer(reader.tier) if reader.peer_bytes else reader.tier,
        bytes=reader.bytes_read,
        seconds=time.perf_counter() - t0,
        tensors=n,
        damaged=list(reader.damaged),
        missing=plan.missing,
        unexpected=plan.unexpected,
        skipped=skipped,
        tier_bytes=dict(reader.tier_bytes),
        peer_bytes=reader.peer_bytes,
        peer_s=reader.peer_s,
        peer_ranks=list(reader.peer_ranks),
    )


def _node(engine: Engine, job: Job | None) -> list[Any] | None:
    """This rank's node, as the ranks that share their reads of a restore see it: its host
    and its node-local tiers (a directory, a host-memory area)."""
    if job is None:
        return None
    local = engine.config.local
    return [job.host, os.path.realpath(local) if local else None, engine.config.host]


def load(
    store: StoreLike, *, step: int | None = None, verify: bool = True, rank: int | None = None
) -> Any:
    """Read a committed snapshot as plain Python values and CPU tensors.

    Objects that were saved through ``state_dict()`` come back as their state dicts. No
    model, optimizer or process group is needed. ``step=None`` takes the newest step
    that is intact in some tier, as ``restore`` does (skipped steps are logged as
    warnings). A sharded snapshot comes back with full tensors, assembled from every
    rank's shards, and the rank-local values of rank ``rank`` (default 0, or the lowest
    rank whose part is at hand when rank 0's is not: another node's directory; when
    ranks saved different ones and no ``rank`` is given, a warning names them).
    """

    def use(reader: Reader) -> Any:
        if rank is None:
            reader.select(None, 1)
        else:
            reader.select_rank_tree(rank)
        return reader.load_tree()

    # A local read: one rank may load alone under a process group (no collective).
    tree, _, _ = _read(store, step, verify, use, agree=False)
    return tree


def open_reader(store: StoreLike, *, step: int | None = None, verify: bool = True) -> Reader:
    """A reader of ``step`` (default: the newest step intact in some tier, as ``load``
    takes) with rank 0's tree of a sharded snapshot selected, for callers that read one
    tensor at a time (``Reader.tensor(i)`` then ``Reader.release(i)``): snapcore convert."""

    def use(reader: Reader) -> Reader:
        reader.select(None, 1)
        return reader

    reader, _, _ = _read(store, step, verify, use, agree=False)  # a local read
    return reader


def prepare(state: object, store: StoreLike) -> Future[None]:
    """Allocate and fault the staging memory for ``state`` in the background, so that the
    first ``async_save`` does not (memory touched for the first time can fill at well under
    1 GB/s). Returns a future; a save waits for it. A store with a host-memory tier
    prepares its second slot after its first save instead; but under torch.distributed,
    a store with a peer tier whose host area holds no snapshot (a replaced node) faults
    in the memory its part will be fetched into from a partner, so that the restore
    receives into memory faulted already (docs/peer.md; the restore waits for it)."""
    return engine_for(store).prepare(state)


def wait_all(store: StoreLike) -> None:
    """Wait until every snapshot to ``store`` in flight is durable and the housekeeping
    after it (retention, garbage collection) is done; raises a failure nobody saw."""
    engine_for(store).wait()


def close() -> None:
    """Close every store this process saved to or read: wait until the snapshots in
    flight are durable (or failed), free the staging memory, close the connections to
    object storage and drop the writer locks. Raises the first failure nobody saw, once
    all are closed. Runs by itself at interpreter exit (failures are then logged); a
    later call makes new engines as needed."""
    close_all(raise_first=True)


@dataclass(frozen=True)
class HostAreaInfo:
    """A host-memory area (``/dev/shm/snapcore-NAME``) and what it holds."""

    name: str
    path: str
    bytes: int  # memory it takes
    steps: list[int]  # committed host snapshots
    store: dict[str, Any] | None  # the store it belongs to (local dir, remote URL)
    writer: dict[str, Any] | None  # the live process saving to it (pid, host), if any


def host_areas(root: str | os.PathLike[str] = "/dev/shm") -> list[HostAreaInfo]:
    """Every snapcore host-memory area under ``root``: its size, steps, owner and writer.

    Host areas outlive the training process on purpose (a restart restores from them);
    ``free_host`` gives their memory back.
    """
    out = []
    for name in host_area_names(root):
        tier = HostTier(name, root=root)
        try:
            steps = tier.committed_steps()
        except OSError:
            steps = []
        out.append(
            HostAreaInfo(
                name=name,
                path=str(tier.root),
                bytes=tier.nbytes(),
                steps=steps,
                store=_identity(tier),
                writer=_area_writer(tier),
            )
        )
    return out


def free_host(name: str, *, root: str | os.PathLike[str] = "/dev/shm") -> int:
    """Delete the host-memory area ``name`` and return the bytes it took.

    Refused with ``StoreInUse`` while a live process (this one included: close it with
    ``snapcore.close()``) saves to the store the area belongs to, and with
    ``SnapshotNotFound`` when there is no such area. Its snapshots are gone afterwards;
    copies in the store's other tiers are not touched.
    """
    tier = HostTier(name, root=root)
    if tier.root.is_symlink() or not tier.root.is_dir():
        raise SnapshotNotFound(f"no host-memory area {name!r} ({tier.root})")
    writer = _area_writer(tier)
    if writer is not None or engine_uses_host(name):
        who = f"pid {writer.get('pid')} on {writer.get('host')}" if writer else "this process"
        raise StoreInUse(
            f"host-memory area {name!r} is in use by {who}: end that process, or call "
            "snapcore.close() in it, before freeing the area",
            path=str(tier.root),
            pid=writer.get("pid") if writer else os.getpid(),
            host=writer.get("host") if writer else None,
        )
    size = tier.nbytes()
    tier.release()
    return size


def _area_writer(tier: HostTier) -> dict[str, Any] | None:
    """The live writer of the store an area belongs to: its writer lock is in the store's
    local directory, or in the area itself for a store without one."""
    local = (_identity(tier) or {}).get("local")
    directory = Path(local) if isinstance(local, str) else tier.root
    return writer_lock.holder(directory) or writer_lock.holder(tier.root)


def _identity(tier: HostTier) -> dict[str, Any] | None:
    """The store an area says it belongs to; None for an area that says nothing usable."""
    ident = tier.identity()
    return ident if isinstance(ident, dict) else None
