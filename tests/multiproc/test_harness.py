"""The multi-process harness itself: launching, result channel, timeouts, killed ranks,
two nodes on one machine.

Every test goes through run_ranks/run_nodes, whose timeout kills the whole run: a hang
fails the test instead of stalling the suite.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from launch import LaunchError, processes_of, run_nodes, run_ranks

HERE = Path(__file__).resolve().parent
PLAIN = HERE / "rank_plain.py"
TIMEOUT = 60.0  # per run; a healthy one takes 1-15 s here


def _gone(pid: int) -> bool:
    """Dead: no such process, or a zombie (init reaps those in its own time)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


# ---------------------------------------------------------------------------- launcher


def test_a_failing_rank_raises_with_its_traceback() -> None:
    with pytest.raises(LaunchError) as info:
        run_ranks(PLAIN, 2, ["fail"], timeout=TIMEOUT)
    err = info.value
    assert not err.timed_out
    assert err.results[1].exitcode == 1
    assert "RuntimeError: rank 1 fails on purpose" in err.results[1].output
    assert "RuntimeError: rank 1 fails on purpose" in str(err)
    assert err.results[0].result == {"ok": True}
    assert processes_of(err.run_id) == []


def test_a_hung_rank_is_killed_on_timeout(tmp_path: Path) -> None:
    timeout = 10.0  # these ranks import no torch: they start in about a second
    started = time.monotonic()
    with pytest.raises(LaunchError) as info:
        run_ranks(PLAIN, 2, ["hang"], timeout=timeout, workdir=tmp_path)
    elapsed = time.monotonic() - started
    err = info.value
    assert err.timed_out
    assert elapsed < timeout + 60  # raised at the deadline, not when the rank ended
    hung, done = err.results
    assert hung.exitcode is None  # killed with the run: no status recorded
    assert done.exitcode == 0
    assert f"rank 0 (pid {hung.result['pid']}) hangs" in str(err)  # its output, in the error
    assert _gone(hung.result["pid"])
    assert processes_of(err.run_id) == []


def test_a_rank_killed_at_a_point_reports_sigkill() -> None:
    results = run_ranks(PLAIN, 2, ["die"], timeout=TIMEOUT, kill_at={1: "loop#2"}, check=False)
    survivor, killed = results
    assert killed.exitcode == -signal.SIGKILL
    assert "pass 1" in killed.output and "pass 2" not in killed.output
    assert "SIGKILLs itself at loop#2" in killed.output
    assert killed.result is None
    # rank 0 blocked (as in a collective with the dead rank) until torchrun tore it down
    assert survivor.exitcode == -signal.SIGTERM
    assert survivor.result == {"passes": 3}


def test_kill_at_names_a_rank_of_the_world() -> None:
    with pytest.raises(ValueError, match="no rank 2"):
        run_ranks(PLAIN, 2, ["die"], timeout=TIMEOUT, kill_at={2: "loop"})


def test_two_nodes_form_one_job_each_with_its_own_env() -> None:
    results = run_nodes(
        PLAIN,
        2,
        ["nodes"],
        timeout=TIMEOUT,
        env={"SNAPCORE_MP_TEST_COMMON": "both"},
        node_envs=[{"SNAPCORE_MP_TEST_NODE": "a"}, {"SNAPCORE_MP_TEST_NODE": "b"}],
    )
    assert [(r.rank, r.node) for r in results] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    expected = [
        {"rank": r, "local_rank": r % 2, "world": 4, "node_env": "ab"[r // 2], "common_env": "both"}
        for r in range(4)
    ]
    for r in results:
        assert r.result == {"mine": expected[r.rank], "everyone": expected}
