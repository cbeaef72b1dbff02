"""What a snapshot costs on this machine: measured as the run goes, assumed until then.

The Checkpointer feeds a ``CostMeter`` with what it sees (the clock at slow ``step()``
calls, each snapshot's stall, when each snapshot persisted, each tier's persist time,
each restore's time); the meter keeps an exponentially weighted mean of each time (a
few snapshots follow a change), measures the slowdown over its last stretches between
slow calls, and gives the ``Costs`` a plan is made with, the defaults standing in for
what was not measured yet.
Pure Python: no torch, no native extension, no other part of snapcore.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# The peer tier sends a node's host snapshot to a partner node over the job's network
# once it is committed in host memory, and a replaced node reads it back the same way,
# so both cost what the host tier costs plus the node's snapshot over the network. Until
# measured: 40 GB per node (what local disk's 20 s below writes at 2 GB/s, one NVMe
# drive) over 25 GB/s (half the line rate of one 400 Gb/s NIC, the endpoint speed of
# Meta's Llama 3 clusters, of the eight a node has; the rest is left to training).
DEFAULT_NODE_SNAPSHOT_BYTES = 40e9
DEFAULT_NETWORK_BYTES_PER_S = 25e9
PEER_TRANSFER_S = DEFAULT_NODE_SNAPSHOT_BYTES / DEFAULT_NETWORK_BYTES_PER_S  # 1.6 s

# Costs assumed until measured (the same as `snapcore plan`'s defaults and the
# simulator's): a 1 s stall, persist 2 s / 3.6 s / 20 s / 5 min, restore 10 s / 11.6 s /
# 30 s / 2 min (host, peer, local, remote). Read when costs() is called, so that a test
# may set them.
DEFAULT_STALL_S = 1.0
DEFAULT_PERSIST_S = {"host": 2.0, "peer": 2.0 + PEER_TRANSFER_S, "local": 20.0, "remote": 300.0}
DEFAULT_RESTORE_S = {"host": 10.0, "peer": 10.0 + PEER_TRANSFER_S, "local": 30.0, "remote": 120.0}
DEFAULT_SLOWDOWN = 0.05

EWMA_WEIGHT = 0.3  # weight of a new measurement: a few snapshots to follow a change

# The slowdown is the step time while a snapshot persists over the step time while none
# does, from the stretches between two slow step() calls (their training time: the
# stalls left out) that a snapshot covered mostly (BUSY_FRACTION) or hardly at all
# (QUIET_FRACTION); stretches in between say nothing clear and are left out. The quiet
# side's step time q is the mean over the steps of its last SLOWDOWN_STRETCHES
# stretches; a busy stretch of T seconds and n steps, c of them covered, ran
# n - (T - c) / q of its steps while a snapshot persisted (the rest at the quiet pace),
# and the busy side's step time is its covered seconds over those steps, over its last
# SLOWDOWN_STRETCHES stretches. A persist that spans one or two stretches (and ends
# inside the last) is measured whole that way, not in its first stretch alone. Each
# side leaves out the stretches slower than OUTLIER times their median (one-off work: a
# pause), and is measured once it has SLOWDOWN_MIN_STEPS steps.
BUSY_FRACTION = 0.5
QUIET_FRACTION = 0.1
SLOWDOWN_STRETCHES = 64
SLOWDOWN_MIN_STEPS = 50
OUTLIER = 4.0
MAX_SLOWDOWN = 0.9  # the cost model takes a slowdown below 1


def _step_time(stretches: Iterable[tuple[float, float]]) -> float | None:
    """The mean step time over ``stretches`` ((seconds, steps) each), less those slower
    than ``OUTLIER`` times their median; None below ``SLOWDOWN_MIN_STEPS`` steps."""
    kept = list(stretches)
    if not kept:
        return None
    median = statistics.median(t / n for t, n in kept)
    kept = [(t, n) for t, n in kept if t / n <= OUTLIER * median]
    steps = sum(n for _, n in kept)
    return None if steps < SLOWDOWN_MIN_STEPS else sum(t for t, _ in kept) / steps


def restore_tier(tier: str) -> str:
    """The tier a restore's time is charged to, from ``RestoreInfo.tier`` (``"host"``,
    ``"local+remote"``, ...): the fastest it read, except that a restore which read a
    partner's copy (``peer``) is charged to the peer tier, whose transfer it waited for."""
    read = tier.split("+")
    return "peer" if "peer" in read else read[0]


def ewma(old: float | None, new: float, weight: float = EWMA_WEIGHT) -> float:
    """The mean ``old`` moved towards ``new`` by ``weight``; ``new`` when there is none."""
    return new if old is None else old + weight * (new - old)


@dataclass(frozen=True)
class Costs:
    """The costs the plan is made with; ``measured`` names those that are not defaults
    (``"step_s"``, ``"stall_s"``, ``"slowdown"``, ``"persist_s:<tier>"``,
    ``"restore_s:<tier>"``)."""

    step_s: float | None  # None until two step() calls were seen
    stall_s: float
    persist_s: dict[str, float]  # from the end of the stall until durable, per tier
    restore_s: dict[str, float]  # reading the snapshot back, per tier (restart apart)
    restart_s: float  # requeue, process start, process-group init: not measurable here
    slowdown: float  # training's step time while a snapshot persists, over it without, - 1
    measured: frozenset[str] = frozenset()


class CostMeter:
    """The measured costs of one run over ``tiers``; ``costs()`` fills in the defaults.

    ``restart_s`` (requeue and process start) is given, not measured; ``slowdown``
    (training while a snapshot persists) stands in until it is measured.
    """

    def __init__(self, tiers: Sequence[str], *, restart_s: float, slowdown: float) -> None:
        self.tiers = tuple(tiers)
        self.restart_s = restart_s
        self.default_slowdown = slowdown
        self.step_s: float | None = None  # None: not measured yet, the default is used
        self.stall_s: float | None = None
        self.persist_s: dict[str, float] = {}
        self.restore_s: dict[str, float] = {}
        self._mark: float | None = None  # clock and step of the last steps() call
        self._mark_step = 0
        self._stall_since_mark = 0.0
        # when snapshots persisted: key -> (start, end), end None while in flight
        self._windows: dict[object, tuple[float, float | None]] = {}
        # the last stretches while a snapshot persisted, (seconds, steps, seconds covered)
        # each, and while none did, (seconds, steps)
        self._busy: deque[tuple[float, int, float]] = deque(maxlen=SLOWDOWN_STRETCHES)
        self._quiet: deque[tuple[float, int]] = deque(maxlen=SLOWDOWN_STRETCHES)

    def steps(self, step: int, now: float) -> None:
        """The clock ``now`` at training step ``step``: the step time is the time since the
        last call over the steps since, without the stalls of snapshots taken meanwhile
        (the training loop's hot path counts nothing)."""
        steps = step - self._mark_step
        if self._mark is not None and steps > 0:
            per_step = max(0.0, now - self._mark - self._stall_since_mark) / steps
            self.step_s = ewma(self.step_s, per_step, weight=min(0.5, 0.05 * steps))
            train = per_step * steps  # the stretch less the stalls, which lie in windows
            if train > 0.0:
                persisting = self._persisting(self._mark, now) - self._stall_since_mark
                covered = min(train, max(0.0, persisting))
                if covered >= BUSY_FRACTION * train:
                    self._busy.append((train, steps, covered))
                elif covered <= QUIET_FRACTION * train:
                    self._quiet.append((train, steps))
        self._mark = now
        self._mark_step = step
        self._stall_since_mark = 0.0
        self._windows = {
            k: (start, end) for k, (start, end) in self._windows.items() if end is None or end > now
        }

    def persisting(self, key: object, start: float, end: float | None = None) -> None:
        """Snapshot ``key`` persisted from ``start`` (the clock at its ``async_save``) to
        ``end`` (when its last tier was done), or is still persisting (``end`` None)."""
        if end is not None and (self._mark is None or end <= self._mark):
            self._windows.pop(key, None)  # over before the stretch being measured
        else:
            self._windows[key] = (start, end)

    def _persisting(self, lo: float, hi: float) -> float:
        """The seconds of ``[lo, hi]`` during which a snapshot persisted."""
        windows = self._windows.values()
        spans = sorted((max(lo, s), hi if e is None else min(hi, e)) for s, e in windows)
        covered, reach = 0.0, lo
        for s, e in spans:
            s = max(s, reach)
            if e > s:
                covered += e - s
                reach = e
        return covered

    def slowdown(self) -> float | None:
        """The measured slowdown, None until each side has ``SLOWDOWN_MIN_STEPS`` steps."""
        quiet = _step_time(self._quiet)
        if quiet is None or quiet <= 0.0:
            return None
        # each busy stretch: its covered seconds, over the steps that ran in them
        ran = [(c, n - (t - c) / quiet) for t, n, c in self._busy]
        busy = _step_time((c, k) for c, k in ran if k > 0.0)
        if busy is None:
            return None
        return min(MAX_SLOWDOWN, max(0.0, busy / quiet - 1.0))

    def stalled(self, seconds: float) -> None:
        """A snapshot blocked training for ``seconds``."""
        self._stall_since_mark += seconds
        self.stall_s = ewma(self.stall_s, seconds)

    def persisted(self, tier: str, seconds: float) -> None:
        """A snapshot became durable in ``tier`` ``seconds`` after its stall ended."""
        self.persist_s[tier] = ewma(self.persist_s.get(tier), seconds)

    def restored(self, tier: str, seconds: float) -> None:
        """A restore read ``tier`` in ``seconds``."""
        self.restore_s[tier] = ewma(self.restore_s.get(tier), seconds)

    def costs(self) -> Costs:
        measured = set()
        if self.step_s is not None:
            measured.add("step_s")
        if self.stall_s is not None:
            measured.add("stall_s")
        slowdown = self.slowdown()
        if slowdown is not None:
            measured.add("slowdown")
        persist, restore = {}, {}
        for t in self.tiers:
            if t in self.persist_s:
                measured.add(f"persist_s:{t}")
            persist[t] = self.persist_s.get(t, DEFAULT_PERSIST_S[t])
            # reading a tier back costs about what writing it did, until a restore says
            if t in self.restore_s:
                measured.add(f"restore_s:{t}")
                restore[t] = self.restore_s[t]
            elif t in self.persist_s:
                restore[t] = self.persist_s[t]
            else:
                restore[t] = DEFAULT_RESTORE_S[t]
        return Costs(
            step_s=self.step_s,
            stall_s=DEFAULT_STALL_S if self.stall_s is None else self.stall_s,
            persist_s=persist,
            restore_s=restore,
            restart_s=self.restart_s,
            slowdown=self.default_slowdown if slowdown is None else slowdown,
            measured=frozenset(measured),
        )


__all__ = [
    "DEFAULT_NETWORK_BYTES_PER_S",
    "DEFAULT_NODE_SNAPSHOT_BYTES",
    "DEFAULT_PERSIST_S",
    "DEFAULT_RESTORE_S",
    "DEFAULT_SLOWDOWN",
    "DEFAULT_STALL_S",
    "EWMA_WEIGHT",
    "MAX_SLOWDOWN",
    "OUTLIER",
    "PEER_TRANSFER_S",
    "CostMeter",
    "Costs",
    "ewma",
    "restore_tier",
]
