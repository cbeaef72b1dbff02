"""The run journal: crash-safe appends, a reader that never raises, failure counting."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import snapcore
from snapcore.cli import main as cli_main
from snapcore.scheduling import journal as jn
from snapcore.scheduling.plan import plan_main
from snapcore.scheduling.rate import RatePrior, estimate_from_history
from snapcore.tiers import HostTier

HOUR = 3600.0


def write_runs(path: Path, runs: list[list[tuple[str, dict[str, object]]]]) -> list[str]:
    """Each run: a list of (event, fields); ``at`` in the fields is the event time."""
    ids = []
    for events in runs:
        w = jn.JournalWriter(path)
        ids.append(w.run)
        for kind, fields in events:
            w.append(kind, **fields)
        w.close()
    return ids


def start(at: float) -> tuple[str, dict[str, object]]:
    return "start", {"at": at, "pid": 1, "host": "h", "devices": 8}


def test_missing_journal_is_empty(tmp_path):
    assert jn.failure_history(tmp_path) == (0, 0.0)
    c = jn.read_journal(tmp_path / "none.jsonl")
    assert c.events == [] and not c.torn and not c.live
    assert jn.journal_path(snapcore.Store(remote="memory://x")) is None
    assert jn.failure_history(snapcore.Store(remote="memory://x")) == (0, 0.0)


def test_journal_location(tmp_path):
    assert jn.journal_path(tmp_path) == tmp_path / "journal.jsonl"
    assert jn.journal_path(snapcore.Store(host="x", local=tmp_path)) == tmp_path / "journal.jsonl"
    assert jn.journal_path(snapcore.Store(host="x", remote="memory://y")) == (
        HostTier("x").root / "journal.jsonl"
    )
    assert jn.journal_path(str(tmp_path / "j.jsonl")) == tmp_path / "j.jsonl"


def test_clean_runs_are_exposure_only(tmp_path):
    write_runs(
        tmp_path / "journal.jsonl",
        [
            [start(0), ("snapshot", {"at": HOUR, "step": 5, "tiers": ["local"]}),
             ("exit", {"at": 2 * HOUR, "clean": True})],
            [start(3 * HOUR), ("restore", {"at": 3 * HOUR + 1, "step": 5, "tier": "local"}),
             ("exit", {"at": 4 * HOUR, "clean": True})],
        ],
    )  # fmt: skip
    h = jn.read_history(tmp_path)
    assert h.failures == 0
    assert h.exposure_hours == pytest.approx(3.0)
    assert [r.clean for r in h.runs] == [True, True]
    assert jn.failure_history(tmp_path) == (0, pytest.approx(3.0))


def test_unclean_ends_are_classed_by_the_next_restore(tmp_path):
    write_runs(
        tmp_path / "journal.jsonl",
        [
            # crashed; the next run restored from host memory: the machine survived
            [start(0), ("snapshot", {"at": HOUR, "step": 1, "tiers": ["host"]})],
            [start(2 * HOUR), ("restore", {"at": 2 * HOUR, "step": 1, "tier": "host"}),
             ("snapshot", {"at": 3 * HOUR, "step": 2, "tiers": ["host", "remote"]})],
            # lost the machine: the next run read local disk and object storage
            [start(4 * HOUR), ("restore", {"at": 4 * HOUR, "step": 2, "tier": "local+remote"}),
             ("exit", {"at": 5 * HOUR, "clean": False, "reason": "RuntimeError"})],
            # ended by an unclean exit; the next run found nothing to restore
            [start(6 * HOUR), ("exit", {"at": 6.5 * HOUR, "clean": True})],
        ],
    )  # fmt: skip
    h = jn.read_history(tmp_path)
    assert [r.failure for r in h.runs] == [jn.PROCESS, jn.MACHINE, jn.UNKNOWN, None]
    assert h.by_class == {jn.PROCESS: 1, jn.MACHINE: 1, jn.CORRELATED: 0, jn.UNKNOWN: 1}
    assert h.failures == 3
    assert h.exposure_hours == pytest.approx(1 + 1 + 1 + 0.5)
    assert jn.failure_class("host+local") == jn.PROCESS
    assert jn.failure_class("remote") == jn.MACHINE


def test_failures_of_a_store_with_a_peer_tier_are_classed_by_the_partner_copy(tmp_path):
    # A restore that read a partner's memory: one machine lost (its partner was up), even
    # when the other nodes read their own host memory. One that read neither host nor
    # peer in a store that has a peer tier: the machine went with its partner.
    assert jn.failure_class("peer") == jn.MACHINE
    assert jn.failure_class("host+peer") == jn.MACHINE
    assert jn.failure_class("host", ("host", "peer", "remote")) == jn.PROCESS
    assert jn.failure_class("remote", ("host", "peer", "remote")) == jn.CORRELATED
    assert jn.failure_class("local+remote", ("host", "local", "remote")) == jn.MACHINE
    tiers = ["host", "peer", "remote"]

    def start_peer(at: float) -> tuple[str, dict[str, object]]:
        return "start", {"at": at, "pid": 1, "host": "h", "devices": 8, "tiers": tiers}

    write_runs(
        tmp_path / "journal.jsonl",
        [
            [start_peer(0), ("snapshot", {"at": 0.5 * HOUR, "step": 1, "tiers": tiers})],
            [start_peer(HOUR), ("restore", {"at": HOUR, "step": 1, "tier": "host+peer"}),
             ("snapshot", {"at": 1.5 * HOUR, "step": 2, "tiers": tiers})],
            [start_peer(2 * HOUR), ("restore", {"at": 2 * HOUR, "step": 1, "tier": "remote"}),
             ("exit", {"at": 3 * HOUR, "clean": True})],
        ],
    )  # fmt: skip
    h = jn.read_history(tmp_path)
    assert [r.failure for r in h.runs] == [jn.MACHINE, jn.CORRELATED, None]
    assert h.by_class == {jn.PROCESS: 0, jn.MACHINE: 1, jn.CORRELATED: 1, jn.UNKNOWN: 0}


def test_the_last_run_is_a_failure_unless_live(tmp_path):
    path = tmp_path / "journal.jsonl"
    [_, last] = write_runs(
        path,
        [
            [start(0), ("exit", {"at": HOUR, "clean": True})],
            [start(2 * HOUR), ("alive", {"at": 2 * HOUR + 600})],  # past the 60 s floor
        ],
    )
    assert jn.read_history(tmp_path).failures == 1  # nobody holds the journal: it died
    assert jn.read_history(tmp_path).by_class[jn.UNKNOWN] == 1
    assert jn.read_history(tmp_path, live_runs=[last]).failures == 0
    # a live writer holds the journal's lock: the newest run is going on, not failed
    w = jn.JournalWriter(path)
    try:
        h = jn.read_history(tmp_path)
        assert h.contents.live and h.runs[-1].live and h.failures == 0
        assert jn.failure_history(tmp_path) == (0, pytest.approx(1.0 + 600 / HOUR))
    finally:
        w.close()
    assert not jn.read_journal(path).live


def test_a_rollback_is_a_failure_inside_a_run(tmp_path):
    write_runs(
        tmp_path / "journal.jsonl",
        [[start(0), ("restore", {"at": 1, "step": 0, "tier": "host"}),
          ("restore", {"at": HOUR, "step": 9, "tier": "host", "rollback": True}),
          ("exit", {"at": 2 * HOUR, "clean": True})]],
    )  # fmt: skip
    h = jn.read_history(tmp_path)
    assert h.failures == 1 and h.by_class[jn.PROCESS] == 1


def test_short_runs_and_user_interrupts_are_not_failures(tmp_path):
    write_runs(
        tmp_path / "journal.jsonl",
        [
            # test runs of a few seconds: killed, crashed, rolled back
            [start(0), ("snapshot", {"at": 5.0, "step": 0, "tiers": ["local"]})],
            [start(100), ("snapshot", {"at": 103.0, "step": 0, "tiers": ["local"]}),
             ("exit", {"at": 104.0, "clean": False, "reason": "RuntimeError"})],
            [start(200), ("restore", {"at": 201.0, "step": 0, "tier": "local", "rollback": True}),
             ("exit", {"at": 202.0, "clean": True})],
            # two hours, then Ctrl-C: the user's own decision
            [start(HOUR), ("alive", {"at": 2 * HOUR}),
             ("exit", {"at": 3 * HOUR, "clean": False, "reason": "KeyboardInterrupt"})],
            # a real failure: an hour, then nothing more
            [start(4 * HOUR), ("alive", {"at": 5 * HOUR})],
        ],
    )  # fmt: skip
    h = jn.read_history(tmp_path)
    assert h.failures == 1 and h.by_class == {
        jn.PROCESS: 0,
        jn.MACHINE: 0,
        jn.CORRELATED: 0,
        jn.UNKNOWN: 1,
    }
    assert [r.failure for r in h.runs] == [None, None, None, None, jn.UNKNOWN]
    why = [r.not_counted or "" for r in h.runs]
    assert all("under the 60 s" in w for w in why[:2]) and "rollbacks" in why[2]
    assert "interrupted by the user (KeyboardInterrupt)" in why[3] and not why[4]
    assert h.exposure_hours == pytest.approx((5 + 4 + 2) / HOUR + 2 + 1)
    text = "\n".join(jn.history_text(h, None))
    assert text.count("not counted as a failure") == 4
    assert jn.history_json(h, None)["runs"][3]["not_counted"].startswith("interrupted")


def test_damaged_lines_are_skipped_and_counted(tmp_path):
    path = tmp_path / "journal.jsonl"
    [run] = write_runs(path, [[start(0)]])
    good = {"v": 1, "event": "exit", "time": HOUR, "run": run, "clean": True}
    bad_lines = [
        b"not json",
        b"[1, 2]",
        b'"a string"',
        json.dumps({**good, "time": True}).encode(),
        json.dumps({**good, "time": "1"}).encode(),
        b'{"v":1,"event":"exit","time":NaN,"run":"x","clean":true}',
        json.dumps({**good, "run": ""}).encode(),
        json.dumps({**good, "clean": "yes"}).encode(),
        json.dumps({"v": 1, "event": "snapshot", "time": 1, "run": run, "step": "7"}).encode(),
        json.dumps({"v": 1, "event": "restore", "time": 1, "run": run, "step": 1}).encode(),
        b"\xff\xfe\x00garbage",
        b'{"v":1,"event":"exit","time":1,"run":"' + b"x" * (20 << 10) + b'","clean":true}',
        b"[" * 15_000,  # deep nesting: json raises RecursionError, not ValueError
    ]
    with open(path, "ab") as f:
        for line in bad_lines:
            f.write(line + b"\n")
        f.write(json.dumps({**good, "event": "checkpoint-v2"}).encode() + b"\n")
        f.write(b"\n   \n")  # blank lines are nothing
        f.write(json.dumps(good).encode() + b"\n")
        f.write(b'{"v":1,"event":"snapshot","ti')  # torn
    c = jn.read_journal(path)
    assert c.malformed == len(bad_lines)
    assert c.unknown == 1
    assert c.torn
    assert [e.kind for e in c.events] == ["start", "exit"]
    h = jn.analyse(c)
    assert h.failures == 0 and h.exposure_hours == pytest.approx(1.0)


def test_reader_never_raises_on_random_damage(tmp_path):
    path = tmp_path / "journal.jsonl"
    write_runs(
        path,
        [[start(0), ("snapshot", {"at": 1, "step": 1, "tiers": ["host"]}),
          ("exit", {"at": 2, "clean": True})],
         [start(3), ("restore", {"at": 4, "step": 1, "tier": "host"})]],
    )  # fmt: skip
    original = path.read_bytes()
    rng = random.Random(4)
    for _ in range(200):
        data = bytearray(original)
        for _ in range(rng.randint(1, 8)):
            op = rng.random()
            i = rng.randrange(len(data))
            if op < 0.5:
                data[i] = rng.randrange(256)
            elif op < 0.8:
                del data[i : i + rng.randint(1, 20)]
            else:
                data[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 5)))
        path.write_bytes(bytes(data))
        h = jn.analyse(jn.read_journal(path))  # must not raise
        assert h.failures >= 0 and h.exposure_hours >= 0


def test_a_torn_tail_is_ended_before_the_next_append(tmp_path):
    path = tmp_path / "journal.jsonl"
    write_runs(path, [[start(0)]])
    with open(path, "ab") as f:  # a crash mid-append (a power cut: part of the line)
        f.write(b'{"v":1,"event":"snapshot","time":5,"run":"ab')
    assert jn.read_journal(path).torn
    [run] = write_runs(path, [[start(HOUR), ("exit", {"at": 2 * HOUR, "clean": True})]])
    c = jn.read_journal(path)
    assert not c.torn and c.malformed == 1  # the torn line, alone on its line
    assert [e.kind for e in c.events] == ["start", "start", "exit"]
    assert c.events[-1].run == run


def test_writer_refuses_nonsense(tmp_path):
    w = jn.JournalWriter(tmp_path / "journal.jsonl")
    with pytest.raises(ValueError, match="unknown journal event"):
        w.append("heartbeat")
    with pytest.raises(ValueError, match="bytes"):
        w.append("exit", clean=True, reason="x" * (20 << 10))
    w.close()
    with pytest.raises(ValueError, match="closed"):
        w.append("exit", clean=True)


# The child imports snapcore.scheduling.journal without snapcore/__init__.py, which imports torch
# (3 s a child); the journal needs none of it.
LIGHT_IMPORT = textwrap.dedent(
    """
    import importlib.util, sys, types
    pkg = types.ModuleType("snapcore")
    pkg.__path__ = list(importlib.util.find_spec("snapcore").submodule_search_locations)
    sys.modules["snapcore"] = pkg
    """
)

CHILD = LIGHT_IMPORT + textwrap.dedent(
    """
    import time
    from snapcore.scheduling.journal import JournalWriter
    assert "torch" not in sys.modules
    w = JournalWriter(sys.argv[1])
    w.start(devices=1, at=time.time() - 120)  # a run past the floor of runs that count
    sys.stdout.write("ready\\n")
    sys.stdout.flush()
    i = 0
    while True:  # as fast as it can: fdatasync on every line
        w.append("snapshot", step=i, tiers=["local"], pad="x" * (i % 300))
        i += 1
    """
)


def test_journal_survives_sigkill_mid_append(tmp_path):
    """A child appends in a tight loop and is killed at random moments, several times: every
    complete line parses, at most one line is torn (the last), and appends go on."""
    path = tmp_path / "journal.jsonl"
    rng = random.Random(7)
    runs: list[str] = []
    kills = 8
    for _ in range(kills):
        with subprocess.Popen(
            [sys.executable, "-c", CHILD, str(path)], stdout=subprocess.PIPE, text=True
        ) as child:
            try:
                assert child.stdout is not None and child.stdout.readline() == "ready\n"
                time.sleep(rng.uniform(0.02, 0.15))
            finally:
                child.send_signal(signal.SIGKILL)
        assert child.returncode == -signal.SIGKILL
        raw = path.read_bytes()
        c = jn.read_journal(path)
        assert not c.live  # the dead child's lock is gone
        assert c.torn == (not raw.endswith(b"\n") and bool(raw))
        unterminated = bool(raw) and not raw.endswith(b"\n")
        assert len(c.events) + c.malformed == raw.count(b"\n") + (unterminated and not c.torn)
        assert c.malformed <= len(runs)  # only torn tails of earlier kills, ended since
        runs.append(c.events[-1].run)
        for run in runs:  # each child's steps: 0, 1, 2, ... with no gap
            steps = [e.data["step"] for e in c.events if e.run == run and e.kind == "snapshot"]
            assert steps == list(range(len(steps))) and steps
    h = jn.read_history(tmp_path)
    assert len(h.runs) == kills
    assert h.failures == kills and h.by_class[jn.UNKNOWN] == kills  # killed, and nobody restored
    w = jn.JournalWriter(path)  # still usable
    w.exit(clean=True)
    w.close()
    c = jn.read_journal(path)
    assert c.events[-1].kind == "exit" and not c.torn


def test_live_writer_in_another_process(tmp_path):
    path = tmp_path / "journal.jsonl"
    code = LIGHT_IMPORT + (
        "import time; from snapcore.scheduling.journal import JournalWriter\n"
        "w = JournalWriter(sys.argv[1]); w.start(devices=2, at=time.time() - 120)\n"
        "w.append('alive'); print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    with subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE) as child:
        try:
            assert child.stdout is not None and child.stdout.readline() == b"ready\n"
            h = jn.read_history(tmp_path)
            assert h.runs[-1].live and h.failures == 0
        finally:
            child.kill()
    h = jn.read_history(tmp_path)
    assert not h.runs[-1].live and h.failures == 1


def test_plan_journal_option_reads_the_history(tmp_path, capsys):
    write_runs(
        tmp_path / "journal.jsonl",
        [[start(0), ("alive", {"at": 5 * HOUR})],
         [start(10 * HOUR), ("restore", {"at": 10 * HOUR, "step": 1, "tier": "remote"}),
          ("exit", {"at": 20 * HOUR, "clean": True})]],
    )  # fmt: skip
    assert plan_main(["--journal", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # one failure in 15 h of exposure, with the prior of the 8 devices the runs journaled
    # (the same as the Checkpointer's)
    prior = RatePrior.from_devices(8)
    want = estimate_from_history(1, 15.0, prior).conservative_mtbf_hours
    assert out["mtbf_s"] == pytest.approx(3600 * want)


def test_plan_journal_of_a_few_short_test_runs(tmp_path, capsys):
    # what a new user's first tries leave: runs of seconds, killed, crashed, interrupted
    def begin(at: float) -> tuple[str, dict[str, object]]:
        return "start", {"at": at, "pid": 1, "host": "h", "devices": 1, "tiers": ["local"]}

    write_runs(
        tmp_path / "journal.jsonl",
        [
            [begin(0), ("snapshot", {"at": 2.0, "step": 0, "tiers": ["local"]})],
            [begin(60), ("exit", {"at": 63.0, "clean": False, "reason": "KeyboardInterrupt"})],
            [begin(120), ("exit", {"at": 121.0, "clean": False, "reason": "RuntimeError"})],
            [begin(180), ("snapshot", {"at": 186.0, "step": 0, "tiers": ["local"]})],
        ],
    )
    assert plan_main(["--journal", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # no failure counts, and the runs' own prior (1 device) stands: not an MTBF of seconds
    assert out["mtbf_s"] == pytest.approx(
        3600
        * estimate_from_history(0, 12 / HOUR, RatePrior.from_devices(1)).conservative_mtbf_hours
    )
    assert out["mtbf_s"] > 1000 * HOUR and out["predicted_waste"] < 0.02
    # the store has a local tier only: nothing else is recommended
    assert out["store_tiers"] == ["local"] and set(out["intervals_s"]) == {"local"}
    assert plan_main(["--journal", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "tiers local" in text and "remote " not in text and "host " not in text
    assert plan_main(["--journal", str(tmp_path), "--persist", "remote=5m"]) == 2
    assert "does not have" in capsys.readouterr().err


def test_cli_journal_verb(tmp_path, capsys):
    write_runs(
        tmp_path / "journal.jsonl",
        [[start(0), ("alive", {"at": 0.5 * HOUR})],
         [start(HOUR), ("restore", {"at": HOUR, "step": 3, "tier": "host"}),
          ("exit", {"at": 2 * HOUR, "clean": True})]],
    )  # fmt: skip
    assert cli_main(["journal", str(tmp_path), "--devices", "16384"]) == 0
    text = capsys.readouterr().out
    assert "restore   step 3 from host" in text
    assert "1 failure(s): 1 process crash(es)" in text
    assert "MTBF" in text
    assert cli_main(["journal", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["failures"] == 1 and out["failures_by_class"]["process"] == 1
    assert [e["event"] for e in out["events"]] == ["start", "alive", "start", "restore", "exit"]
    assert out["rate"]["conservative_per_hour"] > out["rate"]["mean_per_hour"] > 0
    assert cli_main(["journal", str(tmp_path / "missing")]) == 1  # no store: an error
    capsys.readouterr()
    (tmp_path / "empty").mkdir()
    assert cli_main(["journal", str(tmp_path / "empty")]) == 0  # a store with no journal yet
    assert "no events" in capsys.readouterr().out
