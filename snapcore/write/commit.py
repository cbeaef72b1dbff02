"""The commit of a sharded save: every rank's part durable in a tier, then one index.

Each rank, on its own background thread, writes its data and its part (a manifest of
what it wrote) into the tier, then announces the part in snapcore's key-value store.
Rank 0 (the coordinator) waits for every rank's announcement, checks that all followed
the same plan with the structure that plan was made from, writes the step's index
(``manifest.json``, the commit) and announces the verdict; the other ranks wait for it.
Nothing here is a collective: a rank that died leaves its key unset, the coordinator
gives up after ``SNAPCORE_COMMIT_TIMEOUT_S`` naming it, and the step stays uncommitted
(its files are leftovers the next save collects). The plan verdict, announced early in
each save, tells every rank alike whether the next save must agree a new plan.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import xxhash

from .. import manifest as mf
from ..distributed.job import Job, kv_get, kv_wait_all
from ..errors import SnapshotFailed
from ..planning.layout import Layout
from .manifest_builder import build_index
from .sharded import PartSpec, Sharder

log = logging.getLogger(__name__)

__all__ = [
    "OutcomeUnknown",
    "ShardedSave",
    "announce_structure",
    "commit_part",
    "index_key",
    "part_ref",
    "plan_verdict",
    "read_verdict",
]


class OutcomeUnknown(SnapshotFailed):
    """This rank's part was announced but the coordinator's verdict never came: the step
    may be committed, so the part and its data must be kept (they are leftovers for
    garbage collection if it is not)."""


@dataclass
class ShardedSave:
    """One rank's sharded save in flight: the job, its store's sharder, the engine's
    number in the job's key space, this save's part, and the tiers it has announced."""

    job: Job
    sharder: Sharder
    eid: int
    spec: PartSpec
    announced: set[str] = field(default_factory=set)  # "structure", "verdict", tier names
    _verdict_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # ``announced``'s tier names: the hash thread (host), the persist thread (local, and
    # every tier on a failure) and the upload thread (remote) announce, each tier once
    _tiers_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _why: str | None = None
    handed: bool = False  # the persist job has this save (it tells its own failures)
    # This save's identity, which rank 0 writes into every tier's index of the step
    # (``writer.save``): a restore tells a re-save of a step from the first save by it
    save: str = field(default_factory=lambda: secrets.token_hex(8))

    @classmethod
    def failed_seq(cls, job: Job, sharder: Sharder, eid: int, seq: int) -> ShardedSave:
        """A save that raised on this rank's training thread after it took save number
        ``seq`` but before its background work began (``Sharder.part``'s exchange, the
        arena...): no part, only ``fail`` to tell the coordinator (``Engine``)."""
        spec = PartSpec(seq, job.rank, job.world_size, "", "", False, Layout([], [], 0), ())
        return cls(job, sharder, eid, spec)

    def _claim(self, tier: str) -> bool:
        """Whether this call is the first to announce this rank's part in ``tier``."""
        with self._tiers_lock:
            if tier in self.announced:
                return False
            self.announced.add(tier)
            return True

    def announce(self, failed: str | None = None) -> None:
        """Announce this rank's structure for this save (no wait: the verdict is taken
        later, with ``verdict``, before anything commits)."""
        self.announced.add("structure")
        announce_structure(self.job, self.eid, self.spec, failed)

    def verdict(self) -> str | None:
        """The save's plan verdict (announced first if it was not): None when the save
        may commit, else why not. Rank 0 decides it once every rank has announced; every
        rank gets it alike. Taken once: later calls return the same answer."""
        with self._verdict_lock:
            if "structure" not in self.announced:
                self.announce()
            if "verdict" not in self.announced:
                self._why = plan_verdict(self.job, self.sharder, self.eid, self.spec)
                self.announced.add("verdict")
            return self._why

    def structure(self, failed: str | None = None) -> str | None:
        """Announce this rank's structure (or its failure) and take the plan verdict."""
        if "structure" not in self.announced:
            self.announce(failed)
        return self.verdict()

    def commit(
        self,
        tier: str,
        step: int,
        ref: mf.PartRef,
        write_index: Callable[[mf.Index], None],
        failed: str | None = None,
    ) -> None:
        """Announce this rank's part in ``tier``; rank 0 commits with ``write_index``,
        and in a node-local tier the leader of every other node writes the same index
        into its own directory with it too. Raises ``SnapshotFailed`` if this rank's
        failure was announced in ``tier`` already (``fail``): the step cannot commit."""
        if not self._claim(tier):
            raise SnapshotFailed(
                f"step {step}: this rank's save failed before its {tier} part was announced",
                step=step,
                tier=tier,
            )
        self._announce_part(tier, step, ref, write_index, failed)

    def _announce_part(
        self,
        tier: str,
        step: int,
        ref: mf.PartRef,
        write_index: Callable[[mf.Index], None],
        failed: str | None = None,
    ) -> None:
        sharder = self.sharder
        node = tier != "remote" and sharder.leads(tier) and not sharder.with_rank0[tier]
        commit_part(
            self.job,
            self.eid,
            self.spec,
            tier,
            step,
            ref,
            write_index,
            failed,
            node_index=node,
            save=self.save,
        )

    def verdict_now(self, tier: str) -> bool | None:
        """``tier``'s verdict on this save, asked once more without waiting (this rank
        had none in time: ``OutcomeUnknown``): see ``read_verdict``."""
        return read_verdict(self.job, self.eid, self.spec.seq, tier)

    def fail(self, tiers: tuple[str, ...], step: int, error: BaseException) -> None:
        """Tell the coordinator that this rank's save failed (so that it need not wait
        for a part that will never come); never raises."""
        why = f"{type(error).__name__}: {error}"
        try:
            with self._verdict_lock:
                if "structure" not in self.announced:
                    self.announce(failed=why)
            self.verdict()  # rank 0 announces it: the others must not wait for it in vain
            for tier in tiers:
                self.fail_tier(tier, step, error)
        except Exception as e:  # the store (rank 0) is gone: the others time out
            log.warning("step %d: could not tell the coordinator of this failure: %s", step, e)

    def fail_tier(self, tier: str, step: int, error: BaseException) -> None:
        """Tell the coordinator that this rank's part in ``tier`` will not come (unless
        this rank announced a part there already); never raises. Rank 0 decides the
        tier's verdict here (at once, with every other rank's part or failure)."""
        if not self._claim(tier) or (self._why is not None and "verdict" in self.announced):
            return  # announced; or no rank commits this save (its plan verdict)
        nothing = mf.PartRef(self.spec.rank, "", 0, "")
        why = f"{type(error).__name__}: {error}"
        try:
            with contextlib.suppress(SnapshotFailed):
                self._announce_part(tier, step, nothing, _no_index, why)
        except Exception as e:  # the store (rank 0) is gone: the others time out
            log.warning("step %d: could not tell the coordinator of this failure: %s", step, e)


def _no_index(index: mf.Index) -> None:
    raise SnapshotFailed(f"step {index.step}: not committed (a rank failed)")


def _key(job: Job, eid: int, seq: int, *rest: object) -> str:
    return job.key(eid, seq, *rest)


def index_key(job: Job, eid: int, seq: int, tier: str) -> str:
    """Where the coordinator publishes the index of a node-local tier once it has
    committed it (the other nodes' leaders write it into their directories; the peer
    tier sends it with each rank's part)."""
    return _key(job, eid, seq, tier, "index")


def announce_structure(job: Job, eid: int, spec: PartSpec, failed: str | None = None) -> None:
    """Announce this rank's structure for save ``spec.seq`` (or its failure)."""
    mine = json.dumps({"structure": spec.structure, "replan": spec.replan, "failed": failed})
    job.kv.set(_key(job, eid, spec.seq, "structure", spec.rank), mine)


def plan_verdict(job: Job, sharder: Sharder, eid: int, spec: PartSpec) -> str | None:
    """The plan verdict of save ``spec.seq``, once this rank has announced its structure:
    every rank gets it alike (rank 0 decides it once every rank has announced): None when
    the save may commit, else why not (then every rank agrees a new plan at its next
    save). The verdict is also recorded on ``sharder`` for the next save."""
    verdict_key = _key(job, eid, spec.seq, "plan")
    if job.rank == 0:
        keys = [_key(job, eid, spec.seq, "structure", r) for r in range(job.world_size)]
        missing = kv_wait_all(job, keys, job.timeout_s)
        why = None
        if missing:
            why = (
                f"ranks {_ranks(missing)} did not start their part within {job.timeout_s:g} s "
                "(SNAPCORE_COMMIT_TIMEOUT_S)"
            )
        else:
            said = [json.loads(job.kv.get(k)) for k in keys]
            failing = [r for r, d in enumerate(said) if d["failed"]]
            changed = [r for r, d in enumerate(said) if d["replan"]]
            if failing:
                first = said[failing[0]]["failed"]
                why = f"ranks {_ranks(failing)} failed (rank {failing[0]}: {first})"
            elif changed:
                why = (
                    f"the state's structure changed on ranks {_ranks(changed)} since the save "
                    "plan was agreed"
                )
        job.kv.set(verdict_key, json.dumps({"why": why}))
        for k in [*keys, _key(job, eid, spec.seq - 8, "plan")]:
            _forget(job, k)
    else:
        got = kv_get(job, verdict_key, job.timeout_s * 2)
        why = (
            json.loads(got)["why"]
            if got is not None
            else f"no plan verdict from the coordinator (rank 0) within {job.timeout_s * 2:g} s"
        )
    sharder.set_verdict(spec.seq, "ok" if why is None else "replan")
    return why


def commit_part(
    job: Job,
    eid: int,
    spec: PartSpec,
    tier: str,
    step: int,
    ref: mf.PartRef,
    write_index: Callable[[mf.Index], None],
    failed: str | None = None,
    *,
    node_index: bool = False,
    save: str = "",
) -> None:
    """Announce this rank's part of ``step`` in ``tier`` (or its failure), and on rank 0
    commit the step once every part is there. ``node_index``: this rank writes the index
    into its own node's directory too, once rank 0 has committed. ``save``: the save's
    identity (rank 0's is written into the index, the same in every tier). Returns when
    the step is committed in the tier; raises ``SnapshotFailed`` naming what went wrong
    otherwise."""
    mine = {
        "step": step,
        "name": ref.name,
        "size": ref.size,
        "xxh3": ref.xxh3,
        "plan": spec.plan,
        "structure": spec.structure,
        "replan": spec.replan,
        "failed": failed,
    }
    job.kv.set(_key(job, eid, spec.seq, tier, "part", spec.rank), json.dumps(mine))
    verdict_key = _key(job, eid, spec.seq, tier, "verdict")
    if job.rank == 0:
        verdict = _coordinate(job, eid, spec, tier, step, write_index, save)
        job.kv.set(verdict_key, json.dumps(verdict))
        if verdict["ok"]:  # a committed step: no rank may lose its part for want of it
            job.expect_acks(_key(job, eid, spec.seq, tier, "ack"))
        _forget(job, _key(job, eid, spec.seq - 8, tier, "verdict"))  # read long ago
    else:
        got = kv_get(job, verdict_key, job.timeout_s * 2)
        if got is None:
            if failed is not None:
                raise SnapshotFailed(f"step {step}: {failed}", step=step, tier=tier)
            raise OutcomeUnknown(
                f"step {step}: no verdict from the coordinator (rank 0) on the {tier} tier "
                f"within {job.timeout_s * 2:g} s (it died, or cannot be reached): the step "
                "may or may not be committed; this rank's part is kept",
                step=step,
                tier=tier,
            )
        verdict = json.loads(got)
        _ack(job, _key(job, eid, spec.seq, tier, "ack"))
    if failed is not None:
        raise SnapshotFailed(f"step {step}: {failed}", step=step, tier=tier)
    if not verdict["ok"]:
        raise SnapshotFailed(
            f"step {step} was not committed in the {tier} tier: {verdict['why']}",
            step=step,
            tier=tier,
        )
    if node_index:  # another node's directory: its leader commits it there too
        try:
            data = kv_get(job, index_key(job, eid, spec.seq, tier), job.timeout_s)
            if data is None:
                raise SnapshotFailed(
                    f"step {step}: the index of the {tier} tier did not arrive from rank 0",
                    step=step,
                    tier=tier,
                )
            index = mf.parse_any(data, where=f"the index of step {step} from rank 0")
            if not isinstance(index, mf.Index) or index.step != step:
                raise SnapshotFailed(f"step {step}: rank 0 sent no index of it", step=step)
            write_index(index)
        except Exception as e:  # the step is committed on the other ranks all the same
            with contextlib.suppress(AttributeError):
                e.snapcore_verdict_ok = True  # type: ignore[attr-defined]
            raise


def read_verdict(job: Job, eid: int, seq: int, tier: str) -> bool | None:
    """The coordinator's verdict on save ``seq`` in ``tier``, asked once, without
    waiting, by a rank that had none within the commit timeout: True when the step was
    committed, False when not, None when there is none yet (rank 0 has not decided: dead,
    or slower than that) or the store cannot be reached."""
    key = _key(job, eid, seq, tier, "verdict")
    try:
        if not job.kv.check([key]):
            return None
        verdict = json.loads(job.kv.get(key))
    except Exception:
        return None
    _ack(job, _key(job, eid, seq, tier, "ack"))
    return bool(verdict["ok"])


def verdict_ok(e: BaseException) -> bool:
    """Whether ``e`` failed a rank's part of a step that the coordinator committed (this
    rank's own node index not written): what follows every rank's verdict alike (the
    peer tier's round) still runs on this rank."""
    return bool(getattr(e, "snapcore_verdict_ok", False))


def _coordinate(
    job: Job,
    eid: int,
    spec: PartSpec,
    tier: str,
    step: int,
    write_index: Callable[[mf.Index], None],
    save: str = "",
) -> dict[str, object]:
    keys = [_key(job, eid, spec.seq, tier, "part", r) for r in range(job.world_size)]
    missing = kv_wait_all(job, keys, job.timeout_s)
    if missing:
        return {
            "ok": False,
            "why": f"ranks {_ranks(missing)} did not write their parts within "
            f"{job.timeout_s:g} s (SNAPCORE_COMMIT_TIMEOUT_S)",
        }
    parts = [json.loads(job.kv.get(k)) for k in keys]
    for k in keys:
        _forget(job, k)
    failed = [r for r, p in enumerate(parts) if p["failed"]]
    if failed:
        first = parts[failed[0]]["failed"]
        return {"ok": False, "why": f"ranks {_ranks(failed)} failed (rank {failed[0]}: {first})"}
    others = [r for r, p in enumerate(parts) if p["step"] != step]
    if others:
        return {
            "ok": False,
            "why": f"ranks {_ranks(others)} saved another step than rank 0's {step} in the same "
            "save (every rank must save the same steps, in the same order)",
        }
    changed = [r for r, p in enumerate(parts) if p["replan"] or p["plan"] != spec.plan]
    if changed:
        return {
            "ok": False,
            "why": f"the state's structure changed on ranks {_ranks(changed)} since the save "
            "plan was agreed; every rank agrees a new plan at its next save",
        }
    refs = [mf.PartRef(r, p["name"], p["size"], p["xxh3"]) for r, p in enumerate(parts)]
    index = build_index(step, spec.plan, refs, save=save)
    try:
        write_index(index)
    except Exception as e:
        return {"ok": False, "why": f"the coordinator could not write the index: {e}"}
    if tier != "remote":  # the leaders of the other nodes write it into their directories
        job.kv.set(index_key(job, eid, spec.seq, tier), index.dumps())
        _forget(job, index_key(job, eid, spec.seq - 8, tier))
    return {"ok": True}


def part_ref(rank: int, name: str, data: bytes) -> mf.PartRef:
    return mf.PartRef(rank, name, len(data), xxhash.xxh3_128_hexdigest(data))


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:16]))
    return shown + (f" and {len(ranks) - 16} more" if len(ranks) > 16 else "")


def _ack(job: Job, key: str) -> None:
    """Tell rank 0 that this rank has the verdict (so that its store may go away)."""
    with contextlib.suppress(Exception):
        job.kv.add(key, 1)


def _forget(job: Job, key: str) -> None:
    with contextlib.suppress(Exception):  # only memory in rank 0's store, never a failure
        job.kv.delete_key(key)
