"""Under torch.distributed, rank 0's Checkpointer decides when to snapshot and every rank
takes the same step.

Rank 0 runs the schedule; when tiers are due at step ``s`` it publishes "snapshot these
tiers at step ``s + lead``" under a numbered key in snapcore's key-value store (the
TCPStore rank 0 serves, never a collective). Every other rank has a thread that waits
for the next numbered key and queues the decision; its ``Checkpointer.step()`` only
compares its step with the queued one, so a step with nothing due costs a few attribute
reads, and no rank ever talks to another on the training thread. Rank 0 queues what it
publishes for itself too, so every rank takes the same decisions in the same order: the
engine pairs the ranks' saves by their number, not their step, so every rank must make
every agreed save. A rank that passed the agreed step before the decision arrived
(steps shorter than the store's latency times ``lead``) logs it and saves at its current
step anyway: the coordinator refuses a save whose ranks saved different steps, so that
snapshot fails whole, and the saves stay paired.

A SIGTERM is a decision too: a rank that receives one asks rank 0 (an atomic add on a
key rank 0's watcher thread waits for); rank 0, at its next step, publishes a *final*
snapshot, after any snapshot it published before, that every rank takes; the ranks that
received the signal then pass it on, as one process does. After a final decision a
listener waits for the next one in short slices (``FINAL_POLL_S``) for a while
(``linger_s``), so that a rank ending by its signal can stop its listener at once
instead of waiting for rank 0 to publish again.
"""

from __future__ import annotations

import collections
import datetime
import itertools
import json
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the scheduling package stays torch-free below the Checkpointer
    from ..distributed.job import Job

log = logging.getLogger(__name__)

_ids = itertools.count(1)  # Checkpointers of this process, in creation order

LONG_WAIT = datetime.timedelta(hours=1)  # a listener's wait for the next decision
FINAL_POLL_S = 0.2  # ... in slices of this after a final decision (for ``linger_s``)


@dataclass(frozen=True)
class Decision:
    """Every rank snapshots ``tiers`` at ``step``; ``final``: for a SIGTERM."""

    step: int
    tiers: tuple[str, ...]
    final: bool = False


class Decisions:
    """The snapshot decisions of one Checkpointer of the job (see the module docstring)."""

    def __init__(
        self,
        job: Job,
        on_final_request: Callable[[], None] | None = None,
        *,
        linger_s: float = 60.0,
    ) -> None:
        self.job = job
        self.cid = next(_ids)  # the same on every rank: they make Checkpointers alike
        self._sent = 0
        self.last_step = -1  # rank 0: the step of the newest decision published
        self.linger_s = linger_s  # how long a listener polls after a final decision
        self._queue: collections.deque[Decision] = collections.deque()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.final_requested = False  # rank 0: some rank received a SIGTERM
        self._asked = False
        self._on_final_request = on_final_request
        target = self._listen if job.rank != 0 else self._watch
        self._thread = threading.Thread(target=target, name="snapcore-decisions", daemon=True)
        self._thread.start()

    def _key(self, n: int) -> str:
        return self.job.key("ckpt", self.cid, n)

    def publish(self, step: int, tiers: tuple[str, ...], *, final: bool = False) -> None:
        """Rank 0: every rank snapshots ``tiers`` at ``step`` (``final``: a SIGTERM's).
        Rank 0 queues it for itself too: it takes the decisions as every rank does."""
        self._send({"step": step, "tiers": list(tiers), "final": final})
        self._queue.append(Decision(step, tuple(tiers), final))
        self.last_step = max(self.last_step, step)

    def request_final(self) -> None:
        """This rank received a SIGTERM: ask rank 0 for a final snapshot (once)."""
        if self._asked:
            return
        self._asked = True
        try:
            self.job.kv.add(self.job.key("ckpt", self.cid, "final"), 1)
        except Exception as e:  # rank 0 is gone: the grace timer passes the signal on
            log.warning("cannot ask rank 0 for a final snapshot: %s", e)

    def _watch(self) -> None:
        """Rank 0: wait for a rank's request of a final snapshot."""
        key = self.job.key("ckpt", self.cid, "final")
        while not self._stop.is_set():
            try:
                self.job.kv.wait([key], datetime.timedelta(hours=1))
            except Exception as e:
                if self._stop.is_set() or "timeout" not in str(e).lower():
                    return
                continue
            if not self._stop.is_set():
                self.final_requested = True
                if self._on_final_request is not None:
                    self._on_final_request()
            return

    def _send(self, decision: dict[str, object]) -> None:
        self.job.kv.set(self._key(self._sent), json.dumps(decision))
        self._sent += 1

    def next(self) -> Decision | None:
        """The next decision received (other ranks), or None."""
        try:
            return self._queue.popleft()
        except IndexError:
            return None

    def _listen(self) -> None:
        n = 0
        short_until = -math.inf  # after a final decision: short waits until then
        while not self._stop.is_set():
            key = self._key(n)
            short = self._asked or time.monotonic() < short_until
            try:
                wait = datetime.timedelta(seconds=FINAL_POLL_S) if short else LONG_WAIT
                self.job.kv.wait([key], wait)
                got = json.loads(self.job.kv.get(key))
            except Exception as e:  # a timeout: wait again; a lost store: the job is over
                if self._stop.is_set() or "timeout" not in str(e).lower():
                    if not self._stop.is_set():
                        log.warning("no more snapshot decisions from rank 0: %s", e)
                    return
                continue
            if got.get("stop"):
                return
            decision = Decision(int(got["step"]), tuple(got["tiers"]), bool(got.get("final")))
            if decision.final:
                # A rank that ends by its signal after this snapshot stops its listener
                # (close()): it must not be blocked in the store for long then.
                short_until = time.monotonic() + self.linger_s
            self._queue.append(decision)
            n += 1

    def close(self, join_s: float | None = None) -> None:
        """Rank 0 tells the other ranks that no decision follows; they wait for that (up
        to the commit timeout), so that no thread is left blocked in the store when the
        process exits (torch aborts the process then). After a final decision another
        rank's listener waits in short slices (also once this rank asked for a final
        snapshot): its ``close()`` returns within one. ``join_s`` bounds the wait (a rank
        ending by its signal: the listener is a daemon thread)."""
        self._stop.set()
        if self.job.rank == 0:
            try:
                self._send({"stop": True})
                # wakes this rank's watcher, which then sees the stop
                self.job.kv.add(self.job.key("ckpt", self.cid, "final"), 0)
            except Exception as e:  # the others' listeners end with their processes
                log.warning("cannot tell the ranks that the Checkpointer closed: %s", e)
        if self._thread is not None:
            self._thread.join(self.job.timeout_s if join_s is None else join_s)
