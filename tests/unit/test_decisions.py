"""The Checkpointer's decisions under torch.distributed (snapcore/scheduling/decisions.py),
with the ranks' Decisions in one process over an in-memory key-value store."""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest
from test_checkpointer_ranks import FakeJob, FakeKV

from snapcore.scheduling import decisions as dmod
from snapcore.scheduling.decisions import Decision, Decisions


@pytest.fixture
def ranks(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Rank 0's and rank 1's Decisions of one Checkpointer (the same id), one store."""
    kv = FakeKV()
    made: list[Decisions] = []

    def make(rank: int) -> Decisions:
        monkeypatch.setattr(dmod, "_ids", itertools.count(1))
        d = Decisions(FakeJob(rank, kv))  # type: ignore[arg-type]
        made.append(d)
        return d

    yield make
    for d in made:
        d.close(join_s=0.5)


def _next(d: Decisions, timeout: float = 5.0) -> Decision:
    deadline = time.monotonic() + timeout
    while (got := d.next()) is None:
        assert time.monotonic() < deadline, "no decision arrived"
        time.sleep(0.01)
    return got


def test_rank_0_takes_what_it_publishes_in_order_as_the_others_do(ranks: Any) -> None:
    r0, r1 = ranks(0), ranks(1)
    r0.publish(5, ("local",))
    r0.publish(9, ("host", "local"), final=True)
    want = [Decision(5, ("local",)), Decision(9, ("host", "local"), final=True)]
    assert [r0.next(), r0.next(), r0.next()] == [*want, None]
    assert [_next(r1), _next(r1)] == want
    assert r0.last_step == 9


def test_a_rank_stops_listening_at_once_after_a_final_decision(ranks: Any) -> None:
    """The listener of a rank that ends by its signal after the final snapshot used to
    wait in the store for rank 0's next decision, and close() joined it for the whole
    commit timeout (5 s here)."""
    r0, r1 = ranks(0), ranks(1)
    r0.publish(12, ("local",), final=True)
    assert _next(r1).final
    time.sleep(0.3)  # the listener waits for the next decision now
    t0 = time.monotonic()
    r1.close()
    assert time.monotonic() - t0 < 1.0
    assert r1._thread is not None and not r1._thread.is_alive()


def test_a_rank_that_asked_for_a_final_snapshot_stops_listening_at_once(ranks: Any) -> None:
    r0, r1 = ranks(0), ranks(1)
    r0.publish(4, ("local",))
    assert _next(r1) == Decision(4, ("local",))
    r1.request_final()
    r0.publish(8, ("local",))  # wakes the listener's long wait; the next one is short
    assert _next(r1) == Decision(8, ("local",))
    time.sleep(0.3)
    t0 = time.monotonic()
    r1.close()
    assert time.monotonic() - t0 < 1.0
