"""Tests of `snapcore plan` (plan_main): parsing, output, and errors with exit code 2."""

from __future__ import annotations

import json
import math
import sys
import types

import pytest

from snapcore.scheduling.plan import format_duration, parse_duration, plan_main


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90", 90.0),
        ("2.5", 2.5),
        ("20s", 20.0),
        ("5m", 300.0),
        ("1.5h", 5400.0),
        ("1h30m", 5400.0),
        (" 3M ", 180.0),
        ("0", 0.0),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "5x", "m", "5 m", "-3s", "1h-2m", "inf", "nan", "5m3"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


def test_format_duration() -> None:
    assert format_duration(45) == "45s"
    assert format_duration(325) == "5m25s"
    assert format_duration(7500) == "2h05m"
    assert format_duration(math.inf) == "never"


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert plan_main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_young_daly_and_choice(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(capsys, "--mtbf", "24h", "--cost", "5m", "--persist", "remote=5m")
    assert out["young_s"] == pytest.approx(7200.0)
    assert out["daly_s"] / 60 == pytest.approx(116.69, abs=0.01)
    assert out["interval_s"] == out["intervals_s"]["remote"]
    assert 0 < out["predicted_waste"] < 1
    parts = out["waste_parts"]
    assert sum(parts.values()) == pytest.approx(out["predicted_waste"])
    assert out["target"] == 0.02 and isinstance(out["target_met"], bool)


def test_devices_default_llama3_rate(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(capsys, "--devices", "16384", "--step-time", "5s")
    assert out["mtbf_s"] / 3600 == pytest.approx(1296 / 419)
    assert out["target_met"] is False  # restarts alone exceed 2% at this scale
    assert out["shortfall"] == pytest.approx(out["predicted_waste"] - 0.02)
    assert all(v % 5 == 0 for v in out["intervals_s"].values())
    # snapcore's tiered plan beats single-tier Young and Daly on the same model
    assert out["predicted_waste"] < min(out["young_waste"], out["daly_waste"])


def test_rate_per_device_hour_and_target(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(
        capsys, "--devices", "1000", "--rate-per-device-hour", "1e-6", "--target", "0.05"
    )
    assert out["mtbf_s"] == pytest.approx(3600 / 1e-3)
    assert out["target_met"] is True and out["shortfall"] == 0


def test_text_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_main(["--mtbf", "3h", "--persist", "local=20s,remote=5m"]) == 0
    text = capsys.readouterr().out
    assert "Young (1974)" in text and "Daly (2006)" in text
    assert "predicted waste" in text and "remote" in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--mtbf", "3x"], "bad duration"),
        (["--mtbf", "0"], "--mtbf must be > 0"),
        ([], "give the failure rate"),
        (["--mtbf", "3h", "--devices", "8"], "not both"),
        (["--devices", "0"], "--devices must be >= 1"),
        (["--mtbf", "3h", "--target", "2"], "--target"),
        (["--mtbf", "3h", "--persist", "tape=1h"], "unknown tier"),
        (["--mtbf", "3h", "--persist", "remote"], "tier=duration"),
        (["--mtbf", "3h", "--persist", "local=20s"], "add a remote tier"),
        (["--mtbf", "3h", "--cost=-1s"], "bad duration"),
        (["--mtbf", "3h", "--restart", "soon"], "bad duration"),
        (["--mtbf", "3h", "--crash-fraction", "1.5"], "--crash-fraction"),
        (["--devices", "many"], "invalid int value"),
        (["--mtbf", "3h", "--correlated-fraction", "0.9"], "--correlated-fraction"),
        (["--mtbf", "3h", "--persist", "peer=4s"], "add a remote tier"),  # a pair is lost
        (["--mtbf", "3h", "--persist", "local=20s", "--peer"], "add a remote tier"),
    ],
)
def test_bad_input_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert plan_main(argv) == 2
    err = capsys.readouterr().err
    assert message in err


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_main(["--help"]) == 0
    assert "--persist" in capsys.readouterr().out


def test_journal_hook_uses_history(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = types.ModuleType("snapcore.scheduling.journal")
    calls: list[str] = []

    def failure_history(store: str) -> tuple[int, float]:
        calls.append(store)
        return 99, 100.0  # 99 failures in 100 hours, no prior: Gamma(99.5, 100)

    def run_facts(store: str) -> tuple[None, None]:
        return None, None  # the runs said neither their devices nor their tiers

    fake.failure_history = failure_history  # type: ignore[attr-defined]
    fake.run_facts = run_facts  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "snapcore.scheduling.journal", fake)
    out = run_json(capsys, "--journal", "/tmp/store")
    assert calls == ["/tmp/store"]
    # a directory: a local tier only, which lost machines are charged to
    assert out["store_tiers"] == ["local"] and out["uncovered"] == ["machine"]
    assert set(out["intervals_s"]) == {"local"}
    # the conservative (90%) rate is above the mean of 0.995 per hour
    assert 3600 / out["mtbf_s"] == pytest.approx(1.125, abs=0.02)


def test_peer_tier_on_request(capsys: pytest.CaptureFixture[str]) -> None:
    base = run_json(capsys, "--devices", "16384", "--step-time", "5s")
    peer = run_json(capsys, "--devices", "16384", "--step-time", "5s", "--peer")
    assert "peer" not in base["intervals_s"] and "correlated" not in base["recovers_from"]
    assert peer["recovers_from"] == {
        "process": "host",
        "machine": "peer",
        "correlated": "remote",
    }
    assert peer["intervals_s"]["peer"] < peer["intervals_s"]["remote"]
    # lost machines restore from a partner's memory: about half the waste at this scale
    assert peer["predicted_waste"] < 0.6 * base["predicted_waste"]
    across = run_json(
        capsys, "--devices", "16384", "--step-time", "5s", "--peer", "--partners-across-racks"
    )
    # switch failures no longer take the partner: object storage is needed less often
    assert across["intervals_s"]["remote"] > 2 * peer["intervals_s"]["remote"]
    assert across["predicted_waste"] < 0.04 < peer["predicted_waste"]


def test_peer_costs_and_fractions_from_options(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--mtbf", "3h", "--persist", "peer=4s,remote=5m"]
    fast = run_json(capsys, *argv)
    slow = run_json(capsys, "--mtbf", "3h", "--persist", "peer=40s,remote=5m")
    assert slow["intervals_s"]["peer"] > fast["intervals_s"]["peer"]
    assert slow["predicted_waste"] > fast["predicted_waste"]
    slow_restore = run_json(capsys, *argv, "--restart", "peer=10m")
    assert slow_restore["waste_parts"]["restart"] > fast["waste_parts"]["restart"]
    # no correlated failures: host and peer suffice, object storage is not needed
    none = run_json(capsys, "--mtbf", "3h", "--persist", "peer=4s", "--correlated-fraction", "0")
    assert set(none["intervals_s"]) <= {"host", "peer"} and "peer" in none["intervals_s"]


def test_peer_text_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_main(["--devices", "16384", "--peer"]) == 0
    text = capsys.readouterr().out
    assert "9% machines lost with their partner" in text
    assert [ln.split()[0] for ln in text.splitlines() if ln.startswith("  ")][:5] == [
        "tier",
        "host",
        "peer",
        "local",
        "remote",
    ]
    peer_line = next(ln for ln in text.splitlines() if ln.startswith("  peer"))
    assert peer_line.endswith("lost machines")


def test_journal_store_with_a_peer_tier_is_planned_with_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = types.ModuleType("snapcore.scheduling.journal")
    fake.failure_history = lambda store: (0, 0.0)  # type: ignore[attr-defined]
    fake.run_facts = lambda store: (16384, ("host", "peer", "remote"))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "snapcore.scheduling.journal", fake)
    out = run_json(capsys, "--journal", "/tmp/store")
    assert out["store_tiers"] == ["host", "peer", "remote"] and out["uncovered"] == []
    assert out["recovers_from"]["machine"] == "peer"
    # a store with partners but no object storage: a pair lost is charged to the partner
    fake.run_facts = lambda store: (16384, ("host", "peer"))  # type: ignore[attr-defined]
    out = run_json(capsys, "--journal", "/tmp/store")
    assert out["uncovered"] == ["correlated"] and out["recovers_from"]["correlated"] == "peer"
