"""The Checkpointer: a training loop's checkpoints, scheduled from the failures it sees.

Why a loop object instead of ``async_save`` at a fixed interval: the interval that keeps
lost work small depends on the failure rate of the cluster and on what a snapshot costs
on this machine, and neither is known before the run. The Checkpointer measures the
costs as it goes (step time, stall, persist latency per tier, restore time), learns the
failure rate from the store's run journal (snapcore/journal.py) and from this run's own
rollbacks, and asks the scheduler's model (snapcore/scheduler/model.py) for an interval
per tier. docs/scheduler.md ("The Checkpointer") describes the choices made here.

``step()`` is on the training loop's critical path every step, so when nothing is due it
does a clock read, two attribute stores (the step and state ``close()`` makes durable)
and one comparison against a precomputed time
(the next snapshot due, the next poll of snapshots in flight, the next re-plan, or minus
infinity once a SIGTERM asked for a final snapshot). Everything else happens on the
rare calls where that time has passed.
"""

from __future__ import annotations

import logging
import math
import os
import time
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .. import api
from ..distributed.job import current as current_job
from ..errors import SnapcoreError, SnapshotFailed, SnapshotNotFound
from ..staging.handle import SaveHandle, SaveStats
from ..tiers import HostTier, Store, as_store
from .costs import DEFAULT_SLOWDOWN, CostMeter, Costs, restore_tier
from .decisions import Decision, Decisions
from .journal import (
    MIN_RUN_S,
    UNKNOWN,
    FailureHistory,
    JournalWriter,
    failure_class,
    journal_path,
    read_history,
)
from .policy import RateInfo, Schedule, make_schedule, moved, plan_inputs, rate_info
from .preemption import SigtermGuard
from .rate import (
    CORRELATED,
    DEFAULT_QUANTILE,
    LLAMA3_RATE_PER_DEVICE_HOUR,
    MACHINE,
    PROCESS,
    RatePrior,
    llama3_class_counts,
)

log = logging.getLogger("snapcore.checkpointer")


def planned_tiers(store: Store) -> tuple[str, ...]:
    """The tiers a Checkpointer plans an interval for, fastest first: the store's, and
    its peer tier (``Store(peer=...)``) after host memory, whose snapshots it sends."""
    if store.peer_spec is None:
        return store.tiers
    return tuple(t for t in ("host", "peer", "local", "remote") if t in store.tiers or t == "peer")


def with_peer(store: Store, tiers: tuple[str, ...], *, planned: Iterable[str]) -> tuple[str, ...]:
    """The tiers a Checkpointer's snapshot goes to. A save with explicit tiers sends to the
    peer tier only when ``"peer"`` is among them; while the plan has no interval of its
    own for the peer tier (``planned``: the tiers it schedules), the peer tier goes with
    every host snapshot, as a plain ``async_save`` of the store sends it."""
    if store.peer_spec is None or "peer" in tiers or "peer" in planned or "host" not in tiers:
        return tiers
    return (*tiers, "peer")


StoreLike = Store | str | os.PathLike[str]

# The upper bound on every tier's interval unless max_interval_s says otherwise: the
# model's optimum for a small job with a reliable cluster's prior runs to hours, and a
# workstation's failure rate is a guess; at 1 h a 1 s stall costs 0.03% of the run.
DEFAULT_CHECKPOINTER_MAX_INTERVAL_S = 3600.0

POLL_S = 0.5  # how often snapshots in flight are looked at (lazily, from step())
# ... or a quarter of the time they are expected to persist, if shorter (not under
# MIN_POLL_S): the stretches between two looks are what the slowdown is measured over
# (CostMeter), and a snapshot that persists for one or two of them would be seen only
# in its first, the one that holds the host copy's work. Stretches of a few steps
# measure badly (0.47 against a loop's own 0.77 with 0.05 s, bench_slowdown's host
# store): a snapshot that persists less than MIN_POLL_S is not measured.
MIN_POLL_S = 0.2
HEARTBEAT_S = 300.0  # an "alive" journal event after MIN_RUN_S, then at least this often


@dataclass(frozen=True)
class CheckpointerStats:
    """Counters and measured costs of this run."""

    snapshots: int  # async_save calls made
    per_tier: dict[str, int]  # snapshots sent to each tier
    durable_step: dict[str, int]  # newest step durable in each tier (this run)
    in_flight: int
    failed: int  # snapshots that failed in some tier
    replans: int
    restored_step: int | None
    restored_from: str | None
    costs: Costs
    sigterm: bool  # a SIGTERM was received


@dataclass
class _InFlight:
    handle: SaveHandle
    number: int  # the Checkpointer's count of snapshots, this one's
    since: float  # the Checkpointer's clock at its async_save
    seen: set[str] = field(default_factory=set)  # tiers whose outcome was recorded
    told: bool = False  # its failure reached the caller already


class Checkpointer:
    """Snapshots a training loop's state at the intervals the scheduler picks.

    ::

        ckpt = snapcore.Checkpointer(store, target_waste=0.02, devices=64)
        start = ckpt.restore(state)          # 0 when there is nothing to restore
        for step in range(start, total):
            train_step()
            ckpt.step(step, state)           # cheap unless a snapshot is due
        ckpt.close()                         # the last step()'s state durable, a clean exit

    ``store``: a directory, URL or ``Store`` (``remote=``/``host=`` add tiers to a
    directory). ``devices`` and ``rate_per_device_hour`` (default: Llama 3's, 419
    interruptions in 54 days on 16,384 GPUs) give the prior failure rate, which the
    store's journal and this run's rollbacks update. ``restart_s``: time to requeue and
    restart the job, added to each tier's restore time. ``grace_s``: how long a final
    snapshot (SIGTERM, ``snapshot_now``) may take. ``handle_sigterm``: take a final
    snapshot on SIGTERM at the next ``step()``, then hand the signal on. ``overlap`` and
    ``budget_bytes`` are passed to ``async_save``. ``slowdown``: how much training slows
    while a snapshot persists, until measured (the step time while one persists over
    the step time while none does). ``replan_s``: the least time between two
    plans. ``max_interval_s``: a hard upper bound on every tier's interval, from the
    first step on (default 1 h). ``journal``: keep the run journal (default: yes, on
    rank 0 only under torch.distributed). ``clock``: seconds, monotonic (tests inject a
    fake one). ``partners_across_racks``: a store with a peer tier whose partners sit
    behind other rack switches, so that switch and cable failures do not take a lost
    machine's partner (the prior split of failure classes, docs/scheduler.md).

    Guarantees (docs/scheduler.md, "The Checkpointer"): the first ``step()`` of a run,
    and the first after a ``restore()``, snapshots to every tier of the store (which
    also measures what a snapshot costs here); after that no tier goes longer than its
    planned interval, at most ``max_interval_s``, without a snapshot (one still being
    written is waited for); ``close()`` makes the state of the last ``step()`` durable
    in every tier.

    A snapshot that fails in the background is logged and raised once, as
    ``SnapshotFailed``, by the next ``step()`` (or ``snapshot_now``/``close``) that sees
    it; training may catch it and go on, and the next snapshot is tried at its usual time.
    A call that has a snapshot to take takes it first and raises after it: under
    torch.distributed every rank makes every agreed snapshot, in the same order (the
    engine pairs the ranks' saves by number; docs/distributed.md).
    """

    def __init__(
        self,
        store: StoreLike,
        *,
        remote: str | None = None,
        host: str | None = None,
        target_waste: float = 0.02,
        devices: int = 1,
        rate_per_device_hour: float | None = None,
        restart_s: float = 180.0,
        grace_s: float = 60.0,
        handle_sigterm: bool = True,
        overlap: bool = False,
        budget_bytes: int | None = None,
        slowdown: float = DEFAULT_SLOWDOWN,
        quantile: float = DEFAULT_QUANTILE,
        replan_s: float = 10.0,
        max_interval_s: float | None = None,
        journal: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
        lead_steps: int = 2,
        partners_across_racks: bool = False,
    ) -> None:
        if remote is not None or host is not None:
            if isinstance(store, Store):
                raise ValueError("give remote=/host= with a directory, or put them in the Store")
            store = Store(local=store, remote=remote, host=host)
        self.store: Store = as_store(store)
        if not 0 < target_waste < 1:
            raise ValueError(f"target_waste must be a fraction in (0, 1), got {target_waste}")
        if not (restart_s >= 0 and grace_s >= 0 and replan_s >= 0):
            raise ValueError("restart_s, grace_s and replan_s must be >= 0")
        self.target_waste = target_waste
        self.devices = devices
        self.overlap = overlap
        self.budget_bytes = budget_bytes
        self.replan_s = replan_s
        if max_interval_s is not None and not max_interval_s > 0:
            raise ValueError(f"max_interval_s must be > 0, got {max_interval_s}")
        self.max_interval_s = max_interval_s or DEFAULT_CHECKPOINTER_MAX_INTERVAL_S
        self._clock = clock
        self._tiers = planned_tiers(self.store)
        self._prior = RatePrior.from_devices(
            devices, rate_per_device_hour or LLAMA3_RATE_PER_DEVICE_HOUR
        )
        self._quantile = quantile
        # how many lost machines take their partner's copy too (a store with a peer tier)
        self._class_prior = llama3_class_counts(partners_across_racks=partners_across_racks)

        # measured costs (the defaults until measured)
        self._meter = CostMeter(self._tiers, restart_s=restart_s, slowdown=slowdown)

        # the journal and the failure history
        self._journal_on = _journal_default() if journal is None else journal
        self._journal_path = journal_path(self.store) if self._journal_on else None
        self._journal: JournalWriter | None = None
        self._next_alive = math.inf  # when the next "alive" event is due (journal time)
        self.run_id: str | None = None
        self._history: FailureHistory | None = None
        self._past: dict[str, int] = {PROCESS: 0, MACHINE: 0, CORRELATED: 0, UNKNOWN: 0}
        self._past_hours = 0.0
        self._own: dict[str, int] = {PROCESS: 0, MACHINE: 0, CORRELATED: 0}
        if self._journal_path is not None:
            self._load_history(read_history(self.store))
        elif self._journal_on:
            log.info("%s keeps no run journal (object storage only)", self.store.describe())

        # the schedule, and what the hot path compares against
        self._begun = False
        self._run_start = 0.0
        self._next_check = -math.inf  # the first step() begins the run
        self._intervals: dict[str, float] = {}
        self._last_begin: dict[str, float] = {}
        self._schedule: Schedule | None = None
        self._plan_inputs: tuple[float, ...] = ()
        self._planned_at = -math.inf
        self._replans = 0

        # the first snapshot, and what close() makes durable
        self._first_due = True  # the first step() of the run (or after a restore) snapshots
        self._last_step: int | None = None  # the last step() call's step and state
        self._last_state: Any = None
        self._sent: dict[str, int] = {}  # tier -> step of the newest snapshot sent there
        self._made: dict[str, int] = {}  # the same, failed ones too (torch.distributed)

        # counters
        self._trained = False  # a slow step() call was seen: a later restore() rolls back
        self._snapshots = 0
        self._per_tier: dict[str, int] = dict.fromkeys(self._tiers, 0)
        self._durable: dict[str, int] = {}
        self._failed = 0
        self._pending: list[_InFlight] = []
        self._restored: tuple[int, str] | None = None
        self._closed = False

        # under torch.distributed: rank 0 decides, every rank snapshots the same step
        if lead_steps < 1:
            raise ValueError(f"lead_steps must be >= 1, got {lead_steps}")
        self.lead_steps = lead_steps
        self._rank: int | None = None  # None: one process; else this rank (at _begin)
        self._decisions: Decisions | None = None
        self._planned: Decision | None = None  # the next snapshot every rank takes
        self._final_at: int | None = None  # rank 0: a final snapshot published, not taken

        # SIGTERM
        self._sigterm = SigtermGuard(
            grace_s,
            on_request=self._on_sigterm,
            on_expired=self._grace_expired,
            on_pass_on=self._shutdown,
        )
        self._replan(self._clock(), force=True)
        if handle_sigterm:
            self._sigterm.install()

    # -- the training loop's calls ---------------------------------------------------------
    def restore(self, state: Any, *, step: int | None = None, strict: bool = True) -> int:
        """Load the newest intact snapshot (or ``step``) into ``state``; returns the step to
        run next. ``strict``: as for ``snapcore.restore``.

        0 when the store holds nothing (with ``step``: ``SnapshotNotFound`` when it
        does not hold that step). A store whose snapshots are all damaged, or (under
        torch.distributed) that holds steps no one of which every rank can restore, raises
        ``CorruptSnapshot``: the run does not begin again at step 0 behind the user's
        back. Journals the run's start and the restore; a restore after training began in
        this run is a rollback, which counts as a failure of the class its tier tells.
        """
        self._begin()
        try:
            info = api.restore(state, self.store, step=step, strict=strict)
        except SnapshotNotFound:
            if step is not None:  # the step asked for is not there: not a fresh start
                raise
            log.info("nothing to restore in %s: starting at step 0", self.store.describe())
            return 0
        now = self._clock()
        rollback = self._trained  # training had begun: this run rolls back
        # The job's restore read a partner's memory when any rank's part came from one:
        # a machine was replaced, whichever rank (and node) this is.
        tier = info.tier
        if info.peer_ranks and "peer" not in tier.split("+"):
            tier = f"{tier}+peer"
        self._meter.restored(restore_tier(tier), info.seconds)
        self._restored = (info.step, tier)
        self._journal_event("restore", step=info.step, tier=tier, rollback=rollback)
        if rollback:
            self._own[failure_class(tier, self._tiers)] += 1
        elif self._journal is not None:
            # our restore tells the class of the failure that ended the previous run
            self._load_history(read_history(self.store, live_runs=[self._journal.run]))
        for t in self._tiers:  # the restart point counts as durable, as in the model
            self._last_begin[t] = now
        log.info(
            "restored step %d from %s in %.2fs%s",
            info.step,
            info.tier,
            info.seconds,
            " (a rollback: counted as a failure)" if rollback else "",
        )
        self._replan(now, force=True)
        self._first_due = True  # the restored step is not this run's: bound what is at risk
        self._next_check = -math.inf  # the next step() takes the slow path: a fresh mark
        return info.step + 1

    def step(self, step: int, state: Any) -> None:
        """Call once per training step, after the step: snapshots ``state`` as ``step``
        when a tier is due (``async_save``: training blocks only for the stall).

        Raises ``SnapshotFailed`` once for a snapshot that failed in the background.
        The step and state of the last call are what ``close()`` makes durable.
        """
        now = self._clock()
        self._last_step = step
        self._last_state = state
        if self._decisions is not None:
            followed = self._followed(step, state, now)
            if followed is None:
                return
            now = followed
        if now < self._next_check:
            return
        self._tick(step, state, now)

    def _followed(self, step: int, state: Any, now: float) -> float | None:
        """``_follow``: None where it says to return (a rank other than 0), else the clock
        to go on with, read again where rank 0 made saves: the stretch that its slow call
        measures ends after their stalls, which are taken off it (not off the one
        before, which would then read too fast, and the next too slow)."""
        made = self._snapshots
        if self._follow(step, state, now):
            return None
        return self._clock() if self._snapshots != made else now

    def _follow(self, step: int, state: Any, now: float) -> bool:
        """Under torch.distributed: take the snapshots every rank agreed to take at
        ``step`` (rank 0's decisions, published ``lead_steps`` ahead, in the order
        published), then the first snapshot of the run (or after a restore), which needs
        no decision. Returns True on a rank other than 0, whose own schedule is not
        consulted.

        The engine pairs the ranks' saves by their number, so every rank makes every one
        of these saves, whatever happened before: a background failure seen meanwhile is
        raised after them, never instead of them."""
        decisions = self._decisions
        assert decisions is not None
        if self._closed:
            return False
        failure: SnapshotFailed | None = None
        while (planned := self._planned or decisions.next()) is not None:
            if step < planned.step:
                self._planned = planned
                break
            self._planned = None
            failure = self._take(planned, step, state, now) or failure
            if self._closed:  # a final snapshot ended this process's Checkpointer
                return True
        if self._first_due:  # every rank's first step snapshots, with no decision needed
            failure = self._first_snapshot(step, state, now) or failure
        if self._rank != 0 and self._sigterm.pending:  # rank 0 decides the final: ask it
            decisions.request_final()
        if failure is not None:
            raise failure
        return self._rank != 0

    def _take(self, planned: Decision, step: int, state: Any, now: float) -> SnapshotFailed | None:
        """Make the agreed snapshot ``planned`` at ``step``; returns an earlier failure
        to raise once the step's agreed saves are made."""
        if step > planned.step:
            # The decision came late: save anyway, at this step, so that the ranks' saves
            # stay paired; the coordinator refuses a save whose ranks saved other steps,
            # so this snapshot fails whole (rank 0 saved planned.step).
            log.error(
                "step %d: the snapshot agreed for step %d was missed (the decision arrived "
                "late; raise lead_steps): saved at step %d, where it fails whole",
                step,
                planned.step,
                step,
            )
        if planned.final:
            if self._rank == 0:
                self._final_at = None
            self._agreed_final(step, state)
            return None
        failure = self._poll()
        _, earlier = self._save(step, state, planned.tiers, now)
        return failure or earlier

    def _first_snapshot(self, step: int, state: Any, now: float) -> SnapshotFailed | None:
        """Under torch.distributed: the first snapshot of the run, or the first after a
        ``restore()``, which every rank takes at the same call without a decision: to
        every tier, busy or not (one rank's tiers may be busy and another's not), even
        with a SIGTERM pending (rank 0 decides the final snapshot after it). Returns an
        earlier failure to raise after it."""
        self._first_due = False  # made whatever happens: the saves stay paired
        failure = self._poll()
        _, earlier = self._save(step, state, self._tiers, now)
        return failure or earlier

    def snapshot_now(self, state: Any, step: int) -> SaveStats:
        """Snapshot ``state`` as ``step`` to every tier and wait until durable.

        Raises ``TimeoutError`` if it is not durable within ``grace_s`` (it goes on in
        the background), ``SnapshotFailed`` if it (or an earlier one nobody was told of,
        raised once this one is durable) failed. Under torch.distributed every rank
        calls it at the same point, and every rank makes the snapshot.
        """
        if self._closed:
            raise ValueError("snapshot_now() after close() (or after a SIGTERM was handled)")
        self._begin()
        now = self._clock()
        failure = self._poll()  # raised after the snapshot (every rank makes it)
        h, earlier = self._save(step, state, self._tiers, now)
        failure = failure or earlier
        self._first_due = False
        try:
            stats = h.wait(timeout=self.grace_s)
        except SnapshotFailed:
            self._told(h)  # reaches the caller here: not again from step() or close()
            raise
        failure = failure or self._poll()
        self._schedule_next(self._clock())
        if failure is not None:
            raise failure
        return stats

    def wait(self, timeout: float | None = None) -> None:
        """Block until every snapshot in flight is durable (or failed); raises a failure
        nobody was told of (once), ``TimeoutError`` after ``timeout`` seconds."""
        failure = self._wait_all(timeout)
        if failure is not None:
            raise failure

    def _wait_all(self, timeout: float | None) -> SnapshotFailed | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        for rec in list(self._pending):
            # polled, not handle.wait(): that would raise again what was told already
            while not rec.handle.done():
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(
                        f"snapshot of step {rec.handle.step} not durable after {timeout}s"
                    )
                time.sleep(0.002)
        return self._poll()

    def close(self, *, final: bool = True, clean: bool = True, reason: str | None = None) -> None:
        """Make the final state durable, wait until every snapshot in flight is durable,
        journal the exit, and give the SIGTERM handler back. Raises a background failure
        nobody was told of (once), or the final snapshot's failure.

        The final state is the state object given to the last ``step()`` call, as it is
        when ``close()`` runs, saved as that call's step: call ``close()`` right after
        the last ``step()``. It is snapshotted to every tier that was not already sent
        that step; nothing is taken when no ``step()`` was called. ``final=False`` takes
        no final snapshot (what is in flight is still waited for).

        ``clean=False`` (with a ``reason``) journals the end as a failure: what the
        context manager does when training raised (with ``final=False``: the state may
        be half-way through an update)."""
        if self._closed:
            return
        self._next_check = math.inf
        failure: SnapshotFailed | None = None
        try:
            if final:
                failure = self._final_on_close()
            later = self._wait_all(None)
            failure = failure or later
        finally:
            self._journal_event("exit", clean=clean, **({"reason": reason} if reason else {}))
            term = self._sigterm.take() is not None
            self._shutdown()
            if term:  # a SIGTERM came while closing: what was in flight is durable now
                self._sigterm.resend()
        if failure is not None:
            raise failure

    def _final_on_close(self) -> SnapshotFailed | None:
        """Send the last ``step()``'s state to the tiers that were not sent its step;
        returns an earlier failure the engine raised meanwhile (told now)."""
        step, state = self._last_step, self._last_state
        if step is None:
            return None
        # Under torch.distributed every rank must make the same saves: the tiers not
        # tried at that step, which every rank knows alike (whether a snapshot failed
        # yet is seen at different times on different ranks: it is not sent again).
        sent = self._made if self._decisions is not None else self._sent
        tiers = [t for t in self._tiers if sent.get(t) != step]
        if not tiers:
            return None
        failure = self._poll()  # a snapshot of this step that failed is sent again
        tiers = [t for t in self._tiers if sent.get(t) != step]
        if not tiers:
            return failure
        _, earlier = self._save(step, state, tiers, self._clock())
        log.info("close: final snapshot of step %d to %s", step, ",".join(tiers))
        return failure or earlier

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: types.TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:  # training died of an exception: an unclean end, counted as a failure
            # unless it is the user's own interrupt (journal.USER_EXITS); no final
            # snapshot either way: the state may be half-way through an update
            try:
                self.close(final=False, clean=False, reason=exc_type.__name__)
            except SnapcoreError as e:
                log.error("while closing after %s: %s", exc_type.__name__, e)

    # -- reports ---------------------------------------------------------------------------
    def plan(self) -> Schedule:
        """The current schedule: intervals per tier (seconds, steps), the failure rate
        (mean and the conservative one used), the predicted waste and its parts, whether
        the target is met (and by how much not), and the costs it was made with."""
        assert self._schedule is not None
        return self._schedule

    def stats(self) -> CheckpointerStats:
        """Counters and the costs measured so far."""
        restored = self._restored
        return CheckpointerStats(
            snapshots=self._snapshots,
            per_tier=dict(self._per_tier),
            durable_step=dict(self._durable),
            in_flight=sum(1 for r in self._pending if not r.handle.done()),
            failed=self._failed,
            replans=self._replans,
            restored_step=restored[0] if restored else None,
            restored_from=restored[1] if restored else None,
            costs=self._costs(),
            sigterm=self._sigterm.seen,
        )

    # -- the slow path ---------------------------------------------------------------------
    def _tick(self, step: int, state: Any, now: float) -> None:
        if self._closed:
            self._next_check = math.inf
            log.warning("step() after close(): nothing is snapshotted any more")
            return
        if not self._begun:
            self._begin()
            # under torch.distributed from now on: this step follows the ranks' agreement
            if self._decisions is not None:
                followed = self._followed(step, state, now)
                if followed is None:
                    return
                now = followed
        if self._decisions is not None:
            self._lead(step, state, now)
            return
        if self._sigterm.pending:
            self._final_snapshot(step, state)
            return
        self._housekeeping(step, now)
        due = self._due(now)
        earlier = None
        if due:
            _, earlier = self._save(step, state, due, now)
            self._first_due = False
        self._schedule_next(now)
        if earlier is not None:  # the snapshot is made; the earlier failure is news
            raise earlier

    def _housekeeping(self, step: int, now: float) -> None:
        """A slow call's bookkeeping (one process, or rank 0 deciding): the step time
        measured, finished snapshots polled (a failure is raised, and what was due stays
        due at the next call), the run's heartbeat, a re-plan when it is time."""
        self._trained = True
        failure = self._poll(now)  # first: the snapshots done since are not counted on
        self._meter.steps(step, now)
        if failure is not None:
            self._next_check = -math.inf
            raise failure
        if now >= self._next_alive:
            self._journal_event("alive")  # the run's exposure, between snapshot events
            self._next_alive = now + HEARTBEAT_S
        if now - self._planned_at >= self.replan_s:
            self._replan(now)

    def _lead(self, step: int, state: Any, now: float) -> None:
        """Rank 0 under torch.distributed: decide. Every rank takes what is published
        (rank 0 too, in ``_follow``), ``lead_steps`` ahead and after what was published
        before, so that the agreed steps only grow."""
        decisions = self._decisions
        assert decisions is not None
        if self._sigterm.pending or decisions.final_requested:
            # a final snapshot to every tier, after any snapshot published before (it is
            # kept: the other ranks have it queued), once until it is taken
            if self._final_at is None:
                self._final_at = max(step + self.lead_steps, decisions.last_step + 1)
                decisions.publish(self._final_at, self._tiers, final=True)
            self._next_check = -math.inf
            return
        self._housekeeping(step, now)
        due = self._due(now)
        if due:  # every rank snapshots these tiers lead_steps ahead
            decisions.publish(max(step + self.lead_steps, decisions.last_step + 1), due)
            for t in due:  # begun, as far as the schedule is concerned
                self._last_begin[t] = now
        self._schedule_next(now)

    def _due(self, now: float) -> tuple[str, ...]:
        """The tiers to snapshot now: those whose interval has elapsed since their last
        snapshot began, joined by those due within half the fastest interval (so that
        nested tiers stay on one staged copy instead of drifting apart)."""
        busy = self._busy_tiers()
        if self._first_due:  # the run's first step (or the first after a restore): all tiers
            return tuple(t for t in self._tiers if t not in busy)
        strict = [
            t
            for t, iv in self._intervals.items()
            if now >= self._last_begin[t] + iv and t not in busy
        ]
        if not strict:
            return ()
        slack = 0.5 * min(self._intervals.values())
        return tuple(
            t
            for t in self._tiers  # the store's tiers, fastest first
            if t in self._intervals
            and t not in busy
            and now + slack >= self._last_begin[t] + self._intervals[t]
        )

    def _busy_tiers(self) -> set[str]:
        """Tiers a snapshot is still being written to: a new one would queue behind it
        (the engine has two host slots), so it waits for the next check."""
        return {
            t
            for r in self._pending
            for t in r.handle.tiers
            if t not in r.seen and not r.handle.done(t)
        }

    def _schedule_next(self, now: float) -> None:
        nxt = min((self._last_begin[t] + iv for t, iv in self._intervals.items()), default=math.inf)
        if self._first_due:
            nxt = now  # still to do (tiers were busy): look again soon
        if self._journal is not None:
            nxt = min(nxt, self._next_alive)
        if self._pending:
            nxt = min(nxt, now + self._poll_s())
        if math.isfinite(self.replan_s):
            nxt = min(nxt, now + max(self.replan_s, POLL_S))
        if nxt <= now:  # due but busy: look again soon
            nxt = now + min(POLL_S, min(self._intervals.values(), default=POLL_S))
        self._next_check = nxt
        if self._sigterm.pending:  # a SIGTERM between the two lines above
            self._next_check = -math.inf

    def _save(
        self, step: int, state: Any, tiers: Iterable[str], now: float
    ) -> tuple[SaveHandle, SnapshotFailed | None]:
        """Snapshot ``state`` as ``step`` to ``tiers``. Returns the handle and an earlier
        snapshot's failure that the engine raised (told now, for the caller to raise once
        the save is made). In one process the engine raises it instead of saving: the
        save is tried again. Under torch.distributed it raises it once this save is made
        (the sharded save number moved): the save's handle is taken from the engine
        (``Engine.made``), never saved again, which would pair this rank's next save with
        the others' next agreed one; where no save was made (it failed on every rank once
        begun), the failure is raised."""
        tiers = with_peer(self.store, tuple(tiers), planned=self._tiers)
        for t in tiers:  # tried, whatever comes of it (close() under torch.distributed)
            self._made[t] = step
        earlier: SnapshotFailed | None = None
        for _ in range(64):  # each try takes one unreported failure: a few at most
            number = self._save_number() if self._decisions is not None else None
            try:
                h = api.async_save(
                    state,
                    self.store,
                    step=step,
                    tiers=tiers,
                    overlap=self.overlap,
                    budget_bytes=self.budget_bytes,
                )
                break
            except SnapshotFailed as e:
                if e.tier is None:  # this save's own failure (a rank's refusal, say)
                    raise
                # An earlier snapshot failed after our last look: the engine raises it now.
                # Its other tiers' failures are the same news, so they are not raised again.
                for r in self._pending:
                    if r.handle.step == e.step:
                        self._drain(r)
                        r.told = True
                if self._decisions is not None and self._save_number() != number:
                    # The number moved: the engine made this save, then raised the earlier
                    # failure (it is followed like any other); or the save itself failed
                    # on every rank once begun. Saving again would pair this rank's next
                    # save with the others' next agreed one.
                    made = self._engine().made(step)
                    if made is None:
                        raise
                    h, earlier = made, earlier or e
                    break
                log.error("before the snapshot of step %d: %s", step, e)
                earlier = earlier or e
        else:
            raise earlier or SnapshotFailed(f"cannot save step {step}", step=step)
        self._meter.stalled(h.stats.stall_s)
        for t in h.tiers:  # the engine adds local to a remote snapshot (uploads read it)
            self._last_begin[t] = now
            self._per_tier[t] = self._per_tier.get(t, 0) + 1
            self._sent[t] = step
            self._made[t] = step
        self._snapshots += 1
        self._pending.append(_InFlight(h, number=self._snapshots, since=now))
        self._meter.persisting(self._snapshots, now)
        # look at it soon: under torch.distributed this save is not made at a slow call
        self._next_check = min(self._next_check, now + self._poll_s())
        log.debug("step %d: snapshot to %s (stall %.3fs)", step, ",".join(h.tiers), h.stats.stall_s)
        return h, earlier

    def _poll_s(self) -> float:
        """How soon to look at the snapshots in flight again: ``POLL_S``, or a quarter of
        the longest persist time measured of their tiers if shorter (``MIN_POLL_S`` at
        least; a tier not measured yet counts as long)."""
        persist = self._meter.persist_s
        tiers = {t for r in self._pending for t in r.handle.tiers if t not in r.seen}
        expected = max((persist.get(t, math.inf) for t in tiers), default=math.inf)
        return max(MIN_POLL_S, min(POLL_S, expected / 4))

    def _engine(self) -> Any:
        from ..write.engine import engine_for

        return engine_for(self.store)

    def _save_number(self) -> int | None:
        """The engine's count of sharded saves of this store (None before the first)."""
        sharder = self._engine().sharder
        return None if sharder is None else sharder.seq

    def _poll(self, now: float | None = None) -> SnapshotFailed | None:
        """Record snapshots that finished (without blocking): persist latency per tier,
        when each persisted (until ``now`` at the latest: the clock), a journal event per
        snapshot; return the first failure nobody was told of."""
        first: SnapshotFailed | None = None
        for rec in list(self._pending):
            h = rec.handle
            for t in h.tiers:
                if t in rec.seen or not h.done(t):
                    continue
                rec.seen.add(t)
                took = h.stats.tiers.get(t)
                if took is not None:
                    persist = max(0.0, took - h.stats.stall_s)
                    self._meter.persisted(t, persist)
                    self._durable[t] = max(self._durable.get(t, -1), h.step)
                elif self._sent.get(t) == h.step:
                    del self._sent[t]  # failed there: close() sends it again
            if not h.done():
                continue
            self._pending.remove(rec)
            took = max(h.stats.tiers.values(), default=math.inf)  # seconds from the call
            now = self._clock() if now is None else now
            end = max(rec.since, min(now, rec.since + took))
            self._meter.persisting(rec.number, rec.since, end)
            failures = self._drain(rec)
            ok = [t for t in h.tiers if t in h.stats.tiers]
            if ok:
                self._journal_event("snapshot", step=h.step, tiers=ok)
            if len(ok) < len(h.tiers):
                self._failed += 1
            for tier, exc in failures:
                log.error("snapshot of step %d failed in tier %s: %s", h.step, tier, exc)
            if failures and not rec.told and first is None:
                tier, exc = failures[0]
                first = SnapshotFailed(
                    f"snapshot of step {h.step} to {self.store.describe()} failed in tier "
                    f"{', '.join(t for t, _ in failures)}: {exc}",
                    step=h.step,
                    tier=tier,
                )
                first.__cause__ = exc
        return first

    @staticmethod
    def _drain(rec: _InFlight) -> list[tuple[str, BaseException]]:
        """Take every failure of the handle nobody was told of (marking them told)."""
        out = []
        while (f := rec.handle.take_failure()) is not None:
            out.append(f)
        return out

    def _told(self, h: SaveHandle) -> None:
        for r in self._pending:
            if r.handle is h:
                r.told = True

    # -- planning --------------------------------------------------------------------------
    def _costs(self) -> Costs:
        return self._meter.costs()

    def _rate(self, now: float) -> RateInfo:
        own_hours = max(0.0, now - self._run_start) / 3600.0 if self._begun else 0.0
        return rate_info(
            self._prior,
            self._quantile,
            self._past,
            self._past_hours,
            self._own,
            own_hours,
            class_prior=self._class_prior,
        )

    def _replan(self, now: float, *, force: bool = False) -> None:
        """Ask the model for intervals when an input moved by more than MATERIAL_CHANGE."""
        self._planned_at = now
        costs = self._costs()
        rate = self._rate(now)
        inputs = plan_inputs(costs, rate, self._tiers)
        if not force and not moved(self._plan_inputs, inputs):
            return
        try:
            schedule = make_schedule(
                costs,
                rate,
                self._tiers,
                target=self.target_waste,
                max_interval_s=self.max_interval_s,
            )
        except ValueError as e:  # keep the schedule we have (the first one must succeed)
            if self._schedule is None:
                raise
            log.error("re-planning failed, keeping the current intervals: %s", e)
            return
        self._plan_inputs = inputs
        old = self._intervals
        self._schedule = schedule
        self._intervals = dict(schedule.intervals_s)
        for t in self._intervals:
            self._last_begin.setdefault(t, self._run_start if self._begun else now)
        self._replans += 1
        if old != self._intervals:
            log.info(
                "plan: %s; predicted waste %.2f%% (target %.2f%%%s); failure rate %.3g/h "
                "(conservative, %d failure(s) in %.3g h)",
                ", ".join(f"{t} every {iv:.4g}s" for t, iv in self._intervals.items()),
                100 * schedule.predicted_waste,
                100 * schedule.target,
                ""
                if schedule.target_met
                else f", NOT met by {100 * schedule.shortfall:.2f} points",
                rate.conservative_per_hour,
                rate.failures,
                rate.exposure_hours,
            )

    # -- the journal -----------------------------------------------------------------------
    def _load_history(self, h: FailureHistory) -> None:
        """Past runs' failures and exposure (this run's own are counted live)."""
        self._history = h
        mine = self._journal.run if self._journal is not None else None
        past = {PROCESS: 0, MACHINE: 0, CORRELATED: 0, UNKNOWN: 0}
        hours = 0.0
        for r in h.runs:
            if r.run == mine:
                continue
            hours += r.exposure_s / 3600.0
            for cls in r.counted_failures():  # none for a short or interrupted run
                past[cls] += 1
        self._past, self._past_hours = past, hours  # read_history logged any damaged lines

    def _begin(self) -> None:
        """The run starts: journal it (lazily, so that a Checkpointer made only to look
        at plan() leaves no trace)."""
        if self._begun:
            return
        self._begun = True
        job = current_job()  # a collective the first time: every rank begins alike
        if job is not None:
            self._rank = job.rank
            self._decisions = Decisions(
                job, on_final_request=self._on_sigterm, linger_s=max(60.0, 2 * self.grace_s)
            )
        self._run_start = self._clock()
        for t in self._intervals:
            self._last_begin[t] = self._run_start
        if self._journal_path is None:
            return
        try:
            if self.store.local is None and self.store.host is not None:
                # the journal lives in the host area: make it this store's before writing,
                # or the first snapshot would release the area, journal and all
                HostTier(self.store.host).claim(self.store.identity())
            self._journal = JournalWriter(self._journal_path)
            self.run_id = self._journal.run
            self._journal.start(devices=self.devices, tiers=self._tiers)
            self._next_alive = self._run_start + MIN_RUN_S  # the run has lasted the floor
        except OSError as e:
            log.warning("cannot keep the run journal %s: %s", self._journal_path, e)
            self._journal = None

    def _journal_event(self, kind: str, **fields: Any) -> None:
        if self._journal is None:
            return
        try:
            self._journal.append(kind, **fields)
        except (OSError, ValueError) as e:  # never worth stopping training for
            log.warning("journal %s: cannot append %s: %s", self._journal_path, kind, e)

    # -- SIGTERM ---------------------------------------------------------------------------
    @property
    def grace_s(self) -> float:
        """How long a final snapshot (SIGTERM, ``snapshot_now``) may take."""
        return self._sigterm.grace_s

    @grace_s.setter
    def grace_s(self, value: float) -> None:
        self._sigterm.grace_s = value

    def _on_sigterm(self) -> None:
        """The guard's handler saw a SIGTERM: the next step() snapshots (sets a field only)."""
        self._next_check = -math.inf

    def _agreed_final(self, step: int, state: Any) -> None:
        """Under torch.distributed: the final snapshot every rank takes at ``step``. A rank
        that received the SIGTERM ends as one process does (snapshot, wait, pass the
        signal on); the others wait until it is durable and go on."""
        if self._sigterm.pending:
            self._final_snapshot(step, state)
            return
        if self._decisions is not None:
            self._decisions.final_requested = False  # answered
        try:
            h, _ = self._save(step, state, self._tiers, self._clock())  # earlier: logged
            self._told(h)
            h.wait(timeout=self.grace_s)
        except (SnapcoreError, OSError) as e:  # TimeoutError is an OSError
            log.error("the final snapshot of step %d (another rank's SIGTERM): %s", step, e)

    def _final_snapshot(self, step: int, state: Any) -> None:
        """The SIGTERM path: snapshot to every tier, wait (within the grace left), journal
        a clean exit, give the handler back and deliver the signal again."""
        term_at = self._sigterm.take()
        if term_at is None:  # the grace timer took it
            return
        left = max(0.0, self.grace_s - (time.monotonic() - term_at))
        durable = False
        try:
            if (failure := self._poll()) is not None:
                log.error("before the final snapshot: %s", failure)
            h, _ = self._save(step, state, self._tiers, self._clock())  # earlier: logged
            self._told(h)
            h.wait(timeout=max(0.0, self.grace_s - (time.monotonic() - term_at)))
            durable = True
            log.warning("SIGTERM: step %d is durable in %s", step, ",".join(h.tiers))
        except (SnapcoreError, OSError, ValueError) as e:  # TimeoutError is an OSError
            log.error("SIGTERM: the final snapshot of step %d is not durable: %s", step, e)
        finally:
            self._journal_event(
                "exit", clean=True, reason="sigterm", step=step, durable=durable, grace_left=left
            )
            # the signal ends this process next: a rank other than 0 does not wait for
            # rank 0's next decision (its listener stops within a short slice, or is left)
            self._shutdown(join_s=1.0)
        self._sigterm.resend()  # now handled as it would have been

    def _grace_expired(self) -> None:
        """Timer thread: step() did not come within the grace period (a hung step); the
        guard hands the signal on without a snapshot (the state may be mid-update)."""
        self._journal_event("exit", clean=False, reason="sigterm: no step() within grace")

    def _shutdown(self, join_s: float | None = None) -> None:
        """Stop for good: no more snapshots, the handler given back, the journal closed.
        ``join_s``: how long a rank other than 0 waits for its decisions' listener."""
        self._closed = True
        self._next_check = math.inf
        self._last_state = None  # the state is the caller's again (no reference kept)
        self._sigterm.release()
        if self._decisions is not None:
            self._decisions.close(join_s=join_s)
        if self._journal is not None:
            self._journal.close()
            self._journal = None


def _journal_default() -> bool:
    """Journal on every process, or on rank 0 only under torch.distributed."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


__all__ = ["Checkpointer", "CheckpointerStats", "Costs", "RateInfo", "Schedule"]
