"""Under torch.distributed, rank 0's Checkpointer decides when to snapshot and every rank
takes the same step.

Rank 0 runs the schedule; when tiers are due at step ``s`` it publishes "snapshot these
tiers at step ``s + lead``" under a numbered key in snapcore's key-value store (the
TCPStore rank 0 serves, never a collective). Every other rank has a thread that waits
for the next numbered key and queues the decision; its ``Checkpointer.step()`` only
compares its step with the queued one, so a step with nothing due costs a few attribute
reads, and no rank ever talks to another on the training thread. A rank that reaches the
agreed step before the decision arrived (steps shorter than the store's latency times
``lead``) logs it and skips that snapshot; the commit of a step needs every rank's part,
so a snapshot the ranks disagree on fails whole instead of mixing steps.
"""

from __future__ import annotations

import collections
import datetime
import itertools
import json
import logging
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the scheduling package stays torch-free below the Checkpointer
    from ..distributed.job import Job

log = logging.getLogger(__name__)

_ids = itertools.count(1)  # Checkpointers of this process, in creation order


class Decisions:
    """The snapshot decisions of one Checkpointer of the job (see the module docstring)."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.cid = next(_ids)  # the same on every rank: they make Checkpointers alike
        self._sent = 0
        self._queue: collections.deque[tuple[int, tuple[str, ...]]] = collections.deque()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if job.rank != 0:
            self._thread = threading.Thread(
                target=self._listen, name="snapcore-decisions", daemon=True
            )
            self._thread.start()

    def _key(self, n: int) -> str:
        return self.job.key("ckpt", self.cid, n)

    def publish(self, step: int, tiers: tuple[str, ...]) -> None:
        """Rank 0: every rank snapshots ``tiers`` at ``step``."""
        self._send({"step": step, "tiers": list(tiers)})

    def _send(self, decision: dict[str, object]) -> None:
        self.job.kv.set(self._key(self._sent), json.dumps(decision))
        self._sent += 1

    def next(self) -> tuple[int, tuple[str, ...]] | None:
        """The next decision received (other ranks), or None."""
        try:
            return self._queue.popleft()
        except IndexError:
            return None

    def _listen(self) -> None:
        n = 0
        while not self._stop.is_set():
            key = self._key(n)
            try:
                self.job.kv.wait([key], datetime.timedelta(hours=1))
                got = json.loads(self.job.kv.get(key))
            except Exception as e:  # a timeout: wait again; a lost store: the job is over
                if self._stop.is_set() or "timeout" not in str(e).lower():
                    if not self._stop.is_set():
                        log.warning("no more snapshot decisions from rank 0: %s", e)
                    return
                continue
            if got.get("stop"):
                return
            self._queue.append((int(got["step"]), tuple(got["tiers"])))
            n += 1

    def close(self) -> None:
        """Rank 0 tells the other ranks that no decision follows; they wait for that (up
        to the commit timeout), so that no thread is left blocked in the store when the
        process exits (torch aborts the process then)."""
        self._stop.set()
        if self.job.rank == 0:
            try:
                self._send({"stop": True})
            except Exception as e:  # the others' listeners end with their processes
                log.warning("cannot tell the ranks that the Checkpointer closed: %s", e)
        elif self._thread is not None:
            self._thread.join(self.job.timeout_s)
