"""The benchmark harness (``python -m benchmarks``, benchmarks/harness.py): a quick run of
one cheap scenario writes a well-formed JSON and a PNG, and ``docs`` rewrites exactly the
marked regions of a Markdown file. No figure's value is judged."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks import harness  # noqa: E402


def harness_cli(*args: str | Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "benchmarks", *map(str, args)]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def test_list() -> None:
    proc = harness_cli("list")
    assert proc.returncode == 0, proc.stderr
    names = [ln.split()[0] for ln in proc.stdout.splitlines() if not ln.startswith("(")]
    assert {"save", "scaling", "tiers", "codec", "checkpointer", "simulate"} <= set(names)


def test_run_quick_writes_json_and_png(tmp_path: Path) -> None:
    proc = harness_cli("run", "checkpointer", "--quick", "--out", tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((tmp_path / "checkpointer.json").read_text())
    assert doc["schema"] == harness.SCHEMA and doc["scenario"] == "checkpointer"
    assert doc["quick"] is True and doc["ok"] is True
    assert doc["command"].startswith("python -m benchmarks run checkpointer --quick")
    m = doc["machine"]
    for key in ("cpu", "cores", "memory_bytes", "kernel", "python", "torch", "snapcore"):
        assert m[key], key
    assert "git_commit" in m and doc["date"]
    (run,) = doc["runs"]
    assert run["returncode"] == 0 and run["wall_s"] > 0
    assert run["command"] == "python benchmarks/bench_checkpointer.py --smoke"
    rows = run["result"]["rows"]  # the script's own figures, every one of them
    assert rows and all(r["calls"] > 0 and r["median_ns"] <= r["max_ns"] for r in rows)
    assert not list(tmp_path.glob(".*.tmp"))  # the scripts' raw files are folded in
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib (the bench extra) is not installed: no plot to check")
    assert doc["plots"] == ["checkpointer.png"], doc.get("plot_error")
    assert (tmp_path / "checkpointer.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_refuses_unknown_scenarios(tmp_path: Path) -> None:
    proc = harness_cli("run", "no-such-scenario", "--out", tmp_path)
    assert proc.returncode != 0 and "unknown scenarios" in proc.stderr
    assert not list(tmp_path.iterdir())


def test_replace_marked_changes_only_the_region() -> None:
    before = "# Title\n\nProse.\n\n<!-- bench:t:begin -->\n"
    after = "<!-- bench:t:end -->\n\nMore prose | not a table |\n"
    text = before + "| old | table |\n| --- | --- |\n\n" + after
    new = harness.replace_marked(text, "t", "| new | table |\n| --- | --- |")
    assert new == before + "\n| new | table |\n| --- | --- |\n\n" + after
    assert harness.replace_marked(new, "t", "| new | table |\n| --- | --- |") == new  # stable
    with pytest.raises(ValueError):
        harness.replace_marked(text, "other", "x")
    with pytest.raises(ValueError):
        harness.replace_marked(text + text, "t", "x")  # repeated markers
    with pytest.raises(ValueError):
        harness.replace_marked(after + before, "t", "x")  # end before begin


def _spread(x: float) -> dict[str, float]:
    return {"median": x, "min": x * 0.9, "max": x * 1.2, "n": 3}


def scaling_doc(quick: bool = False) -> dict:
    series = {"snapcore.async_save": [{"state_gb": 0.25, "figure": _spread(0.01)}]}
    return {
        "schema": harness.SCHEMA,
        "scenario": "scaling",
        "quick": quick,
        "command": "python -m benchmarks run scaling",
        "date": "2026-11-23",
        "machine": {
            "cores": 2,
            "cpu": "CPU",
            "memory_bytes": 2**34,
            "kernel": "6.1",
            "python": "3.11",
            "torch": "2.13.0",
            "snapcore": "0.1.0",
            "git_commit": "0123456789abcdef",
            "git_dirty": False,
        },
        "runs": [{"label": "0.25 GB", "returncode": 0, "result": {"snapcore": {}}}],
        "summary": {"sizes": [{}], "stall_s": series, "durable_s": series, "restore_s": series},
    }


def test_docs_rewrites_exactly_the_marked_regions(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    (results / "scaling.json").write_text(json.dumps(scaling_doc()))
    (results / "unrelated.json").write_text("[1, 2]")  # not a result: ignored
    head = "# Benchmarks\n\nProse that stays.\n\n```\nkeep me\n```\n\n"
    mid = "\n\nBetween the regions.\n\n"
    other = (
        "<!-- bench:save-report:begin -->\n\nno save result: kept\n\n<!-- bench:save-report:end -->"
    )
    tail = "\n\n| a hand-written | table |\n| --- | --- |\n"
    region = "<!-- bench:scaling:begin -->\n| stale |\n<!-- bench:scaling:end -->"
    doc = tmp_path / "doc.md"
    doc.write_text(head + region + mid + other + tail)

    proc = harness_cli("docs", results, "--doc", doc)
    assert proc.returncode == 0, proc.stderr
    assert "rewrote ['scaling']" in proc.stdout and "save-report" in proc.stdout
    text = doc.read_text()
    assert text.startswith(head + "<!-- bench:scaling:begin -->\n\n")
    assert text.endswith("<!-- bench:scaling:end -->" + mid + other + tail)
    body = text[len(head) : -len(mid + other + tail)]
    assert "| stale |" not in body
    assert "Made by `python -m benchmarks run scaling`, 2026-11-23" in body
    assert "| stall: state GB | snapcore.async_save |" in body
    assert "| 0.25 | 0.010 (0.009-0.012) |" in body

    # a second run changes nothing; results of a --quick run are not taken without asking
    harness_cli("docs", results, "--doc", doc)
    assert doc.read_text() == text
    (results / "scaling.json").write_text(json.dumps(scaling_doc(quick=True)))
    doc.write_text(head + region + mid + other + tail)
    proc = harness_cli("docs", results, "--doc", doc)
    assert "(a --quick run)" in proc.stdout
    assert doc.read_text() == head + region + mid + other + tail
