"""The handle of an asynchronous snapshot, and the optimizer hook of overlap mode."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import SnapshotFailed

log = logging.getLogger(__name__)


@dataclass
class SaveStats:
    """What a snapshot cost. Times are seconds since ``async_save`` was called."""

    step: int
    bytes: int  # tensor bytes staged
    file_bytes: int  # bytes of the staged image
    stall_s: float = 0.0  # time async_save blocked the caller
    staged_s: float = 0.0  # time until every copy had finished (state may change)
    durable_s: float = 0.0  # time until durable in every tier it was sent to
    tiers: dict[str, float] = field(default_factory=dict)  # time until durable, per tier
    written: dict[str, int] = field(default_factory=dict)  # bytes written, per tier
    reused: dict[str, int] = field(
        default_factory=dict
    )  # chunk bytes shared with earlier snapshots
    streaming: bool = False
    o_direct: bool = False
    warnings: list[str] = field(default_factory=list)  # housekeeping that failed after a commit


class SaveHandle:
    """The handle of one asynchronous snapshot: one future per tier it goes to."""

    def __init__(
        self, step: int, stats: SaveStats, tiers: tuple[str, ...], *, t0: float | None = None
    ) -> None:
        self.step = step
        self.stats = stats
        self.tiers = tiers
        self._futures: dict[str, Future[None]] = {t: Future() for t in tiers}
        self._staged = threading.Event()
        self._cuda_staged: list[tuple[torch.device, Any]] = []
        self._t0 = time.perf_counter() if t0 is None else t0  # when async_save was called
        self._reported: set[str] = set()
        self._deferred = False  # some copies run after async_save returned (overlap mode)
        self._host_copies: Future[None] | None = None  # overlap mode's CPU copies
        self._left_out: dict[str, str] = {}  # tiers taken off after the save (leave_out)

    def done(self, tier: str | None = None) -> bool:
        """True once the snapshot is durable (or failed) in ``tier`` (default: all)."""
        return all(f.done() for f in self._select(tier).values())

    def wait(self, timeout: float | None = None, tier: str | None = None) -> SaveStats:
        """Block until durable in ``tier`` (``"host"``, ``"local"``, ``"remote"``,
        ``"peer"``: committed in the partners' memory; default: every tier this snapshot
        goes to). Raises ``SnapshotFailed`` if it failed there."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for name, fut in self._select(tier).items():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                fut.result(left)
            except FutureTimeout:
                raise TimeoutError(
                    f"snapshot of step {self.step} not durable in {name} after {timeout}s"
                ) from None
            except BaseException as e:
                self._mark_reported(e)
                if isinstance(e, SnapshotFailed):
                    raise
                raise SnapshotFailed(
                    f"snapshot of step {self.step} failed in tier {name}: {e}",
                    step=self.step,
                    tier=name,
                ) from e
            if name in self._left_out and tier is not None:  # left out while it waited
                raise self._not_sent(name)
        return self.stats

    def staged(self, timeout: float | None = None) -> None:
        """Block until the snapshot no longer reads the live state (safe to modify it).

        For CUDA tensors this makes the current stream of each device wait for the copies
        (a GPU-side wait: the CPU does not block, and the snapshot holds its references
        to the sources until the copies have run). Only the current stream is ordered:
        a write queued on another stream is not. The CPU blocks only for CPU copies still
        running (overlap mode's, on their own thread), never for the persist thread.
        """
        for device, ev in self._cuda_staged:
            ev.make_stream_wait(torch.cuda.current_stream(device).cuda_stream)
        if self._host_copies is not None:
            try:
                self._host_copies.result(timeout)
            except FutureTimeout:
                raise TimeoutError(
                    f"snapshot of step {self.step} not staged after {timeout}s"
                ) from None
            except BaseException:
                pass  # the copy's failure fails the snapshot: reported by wait()
        elif not self._staged.wait(timeout):
            raise TimeoutError(f"snapshot of step {self.step} not staged after {timeout}s")

    def unreported(self) -> tuple[str, BaseException] | None:
        """The first tier failure nobody has been told about yet (no side effect)."""
        for name, fut in self._futures.items():
            if name in self._reported or not fut.done():
                continue
            exc = fut.exception()
            if exc is not None:
                return name, exc
        return None

    def take_failure(self) -> tuple[str, BaseException] | None:
        """Like ``unreported``, and mark that failure told (in every tier it failed)."""
        failed = self.unreported()
        if failed is not None:
            self._mark_reported(failed[1])
        return failed

    def mark_all_reported(self) -> None:
        """The caller was told already (the save itself raised): no failure of this
        snapshot is news, whenever it comes."""
        self._reported.update(self.tiers)

    def _mark_reported(self, exc: BaseException) -> None:
        # One error often fails several tiers at once: it is reported once.
        for name, fut in self._futures.items():
            if fut.done() and fut.exception() is exc:
                self._reported.add(name)

    def warn(self, message: str) -> None:
        """A problem after a commit (it stays committed): logged and kept in the stats."""
        log.error("%s", message)
        self.stats.warnings.append(message)

    def _select(self, tier: str | None) -> dict[str, Future[None]]:
        if tier is None:
            return {t: f for t, f in list(self._futures.items()) if t not in self._left_out}
        if tier not in self._futures:
            raise ValueError(
                f"step {self.step} was not sent to tier {tier!r} (tiers: {self.tiers})"
            )
        return {tier: self._futures[tier]}

    def _not_sent(self, tier: str) -> ValueError:
        return ValueError(
            f"step {self.step} was not sent to tier {tier!r}: {self._left_out[tier]} "
            f"(tiers: {self.tiers})"
        )

    # -- the engine's side: the stages report through these ---------------------------------
    @property
    def deferred(self) -> bool:
        """Whether some copies run after ``async_save`` returned (overlap mode)."""
        return self._deferred

    def defer_staging(
        self, cuda_events: list[tuple[torch.device, Any]], host_copies: Future[None]
    ) -> None:
        """Some copies run after ``async_save`` returns (overlap mode): ``cuda_events``
        complete with the CUDA copies (on the side streams), ``host_copies`` with the CPU
        copies (on the stager's overlap thread). ``staged()`` waits for these only."""
        self._deferred = True
        self._cuda_staged.extend(cuda_events)
        self._host_copies = host_copies

    def mark_staged(self) -> None:
        """Every copy has finished: the state may change (idempotent)."""
        if not self._staged.is_set():
            self.stats.staged_s = time.perf_counter() - self._t0
            self._staged.set()

    def settle(self, tier: str | None = None, timeout: float | None = None) -> bool:
        """Wait until ``tier`` (default: every tier) has an outcome (durable or failed),
        at most ``timeout`` seconds; raises nothing. Whether it has."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for fut in self._select(tier).values():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                fut.exception(left)
            except FutureTimeout:
                return False
            except BaseException:
                pass  # cancelled: an outcome
        return True

    def leave_out(self, tier: str, why: str) -> None:
        """The snapshot goes to ``tier`` no more, for a reason reported already (the peer
        tier disabled, told on an earlier handle): ``tiers`` drops it, ``wait()`` waits for
        the others only, ``wait(tier=tier)`` raises ``ValueError``, as for a save that
        never had it; nothing is reported again (unless the tier has an outcome)."""
        if tier not in self._futures or self._futures[tier].done():
            return
        self._left_out[tier] = why
        self.tiers = tuple(t for t in self.tiers if t != tier)
        with contextlib.suppress(InvalidStateError):  # an outcome came meanwhile: it stands
            self._futures[tier].set_result(None)  # a waiter on it goes on (wait() says why)

    def resolve(self, tier: str, exc: BaseException | None = None) -> None:
        """The snapshot is durable in ``tier``, or failed there with ``exc`` (the first
        outcome of a tier counts)."""
        fut = self._futures[tier]
        if fut.done():
            return
        if exc is None:
            self.stats.tiers[tier] = time.perf_counter() - self._t0
            self.stats.durable_s = max(self.stats.durable_s, self.stats.tiers[tier])
            fut.set_result(None)
        else:
            fut.set_exception(exc)

    def __repr__(self) -> str:
        state = {t: ("done" if f.done() else "in flight") for t, f in self._futures.items()}
        return f"<SaveHandle step={self.step} {state}>"


# Optimizers whose step() must wait for overlapped copies, and the handles they wait on.
_hooked: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[SaveHandle]] = (
    weakref.WeakKeyDictionary()
)


def _optimizer_pre_hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    handles = _hooked.get(opt)
    if handles:
        for h in handles:
            h.staged()
        handles.clear()


def protect(opt: torch.optim.Optimizer, handle: SaveHandle) -> None:
    """Make ``opt.step()`` wait until ``handle`` has copied what the optimizer writes."""
    if opt not in _hooked:
        _hooked[opt] = []
        opt.register_step_pre_hook(_optimizer_pre_hook)
    _hooked[opt].append(handle)
