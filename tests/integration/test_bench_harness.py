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


def test_run_passes_opts_to_one_scenarios_script(tmp_path: Path) -> None:
    """--opts NAME=OPTIONS goes after the scenario's own options (the GPU run sizes the
    training scenario so); an --opts for a scenario not in the run is refused."""
    proc = harness_cli("run", "checkpointer", "--quick", "--opts", "checkpointer=--calls 2000",
                       "--out", tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((tmp_path / "checkpointer.json").read_text())
    (run,) = doc["runs"]
    assert run["command"] == "python benchmarks/bench_checkpointer.py --smoke --calls 2000"
    assert "--opts 'checkpointer=--calls 2000'" in doc["command"]
    proc = harness_cli("run", "checkpointer", "--quick", "--opts", "training=--steps 4",
                       "--out", tmp_path / "no")  # fmt: skip
    assert proc.returncode != 0 and "--opts 'training=--steps 4'" in proc.stderr
    assert not (tmp_path / "no").exists()


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


def _doc(scenario: str, result: dict) -> dict:
    doc = scaling_doc()
    doc.update(scenario=scenario, command=f"python -m benchmarks run {scenario}")
    doc["runs"] = [{"label": "", "returncode": 0, "result": result}]
    del doc["summary"]
    return doc


TIERS_RESULT = {
    "state_bytes": 264_500_000,
    "durable": {"stall": 0.025, "host": 0.046, "local": 0.17, "remote": 3.271},
    "written": {"host": 264_500_000, "local": 264_500_000, "remote": 264_500_000},
    "restore": {
        "host": {"seconds": 0.1, "tier": "host"},
        "local (cold)": {"seconds": 0.25, "tier": "local"},
        "remote": {"seconds": 10.0, "tier": "remote"},
    },
    "remote_codec": {
        "written_none": 264_500_000,
        "written_shuffle_zstd": 205_900_000,
        "durable_remote_none": 3.27,
        "durable_remote_shuffle_zstd": 3.94,
    },
    "incremental": {
        "state_bytes": 113_400_000,
        "full": {"local": 113_400_000, "remote": 113_400_000},
        "incremental": {"local": 37_800_000, "remote": 37_800_000},
        "reused": {"local": 75_600_000, "remote": 75_600_000},
    },
}

CHECKPOINTER_RESULT = {
    "rows": [
        {
            "name": "step(), nothing due",
            "calls": 1_000_000,
            "median_ns": 250,
            "p99_ns": 520,
            "p999_ns": 880,
            "max_ns": 45_000,
        },
        {
            "name": "re-plan, 3 tier(s)",
            "calls": 100,
            "median_ns": 10_300_000,
            "p99_ns": 15_000_000,
            "p999_ns": 15_200_000,
            "max_ns": 15_200_000,
        },
    ]
}


def test_tiers_and_checkpointer_regions_from_fixture_json(tmp_path: Path) -> None:
    """The tiers and checkpointer tables are made from their scenarios' JSON, exactly."""
    results = tmp_path / "results"
    results.mkdir()
    (results / "tiers.json").write_text(json.dumps(_doc("tiers", TIERS_RESULT)))
    (results / "checkpointer.json").write_text(
        json.dumps(_doc("checkpointer", CHECKPOINTER_RESULT))
    )
    regions = "".join(
        f"Prose {n}.\n\n<!-- bench:{n}:begin -->\nstale\n<!-- bench:{n}:end -->\n\n"
        for n in ("tiers", "checkpointer", "codec-report")
    )
    doc = tmp_path / "doc.md"
    doc.write_text(regions)
    proc = harness_cli("docs", results, "--doc", doc)
    assert proc.returncode == 0, proc.stderr
    assert "rewrote ['tiers', 'checkpointer']" in proc.stdout
    text = doc.read_text()
    tiers = text[text.index("<!-- bench:tiers:begin -->") : text.index("<!-- bench:tiers:end -->")]
    assert "stale" not in tiers
    assert "Made by `python -m benchmarks run tiers`, 2026-11-23" in tiers
    for row in (
        "| (stall of async_save) | 0.025 s | |",
        "| remote | 3.271 s | 264.5 MB |",
        "| local (cold) | 0.250 | 1.06 |",
        "| remote | 10.000 | 0.03 |",
        "| shuffle-zstd | 205.9 MB | 1.28 | 3.94 s |",
        "| local | 113.4 MB | 37.8 MB | 75.6 MB |",
    ):
        assert "\n" + row + "\n" in tiers, row
    ck = text[text.index("<!-- bench:checkpointer:begin -->") :]
    assert "| step(), nothing due | 1,000,000 | 0.25 µs | 0.52 µs | 0.88 µs | 45.00 µs |" in ck
    assert "| re-plan, 3 tier(s) | 100 | 10.30 ms | 15.00 ms | 15.20 ms | 15.20 ms |" in ck
    assert "under 20 µs (median and p99): **PASS** (median 0.25 µs, p99 0.52 µs)" in ck
    assert "Prose tiers.\n\n<!-- bench:tiers:begin -->\n\n" in text  # prose kept as it was
    # no codec result: that region is kept, byte for byte; a second run changes nothing
    assert "<!-- bench:codec-report:begin -->\nstale\n<!-- bench:codec-report:end -->" in text
    harness_cli("docs", results, "--doc", doc)
    assert doc.read_text() == text

    # with one, its region is the script's own report after the harness's line
    codec = _doc("codec", {"rows": []})
    codec["runs"][0]["markdown"] = "Measured by bench_codec.\n\n| data | codec |\n| --- | --- |\n"
    (results / "codec.json").write_text(json.dumps(codec))
    proc = harness_cli("docs", results, "--doc", doc)
    assert "'codec-report'" in proc.stdout.split("kept")[0]
    made_by = harness._made_by(codec)
    assert made_by.startswith("Made by `python -m benchmarks run codec`, 2026-11-23; machine")
    assert doc.read_text() == text.replace(
        "<!-- bench:codec-report:begin -->\nstale\n",
        "<!-- bench:codec-report:begin -->\n\n"
        + made_by
        + "\n\nMeasured by bench_codec.\n\n| data | codec |\n| --- | --- |\n\n",
    )


def test_committed_figures_regenerate_the_docs_unchanged() -> None:
    """docs/benchmarks.md's generated regions are what `docs` prints from the JSON
    committed beside them (docs/figures/): the docs do not drift from a run."""
    text = harness.DOC.read_text()
    docs = harness.load_results(REPO / "docs" / "figures")
    new, done, _ = harness.regenerate(text, docs)
    generated = {"scaling", "tiers", "checkpointer", "codec-report"}
    generated |= {"distributed-report", "convert-report", "peer-report"}
    generated |= {"training-report", "plan-report", "manifest-report", "save-report"}
    generated |= {"slowdown-report", "gpu-report"}
    assert generated == set(done) == set(harness.TABLES)  # every region has its JSON
    assert new == text


def test_a_scripts_own_title_becomes_a_bold_line() -> None:
    """A report's ``# title`` would be a top-level heading in the middle of
    docs/benchmarks.md: the region gets it as a bold line, the rest as it was."""
    doc = _doc("peer", {})
    doc["runs"][0]["markdown"] = "# bench_peer: 8 MiB\n\nText.\n\n## kept\n| a |\n"
    out = harness.table_script_report(doc)
    assert out == harness._made_by(doc) + "\n\n**bench_peer: 8 MiB**\n\nText.\n\n## kept\n| a |"


def test_manifest_region_and_training_plot_from_fixture_json(tmp_path: Path) -> None:
    """bench_manifest prints no report of its own: its region is the median and range of
    each phase over the runs. bench_training's plot draws every timed step per mode."""
    runs = [
        {"parse_s": p, "tensors": 451_055, "peak_rss_mib": 140.0 + i, "json_s": 4.0}
        for i, p in enumerate([7.5, 7.1, 9.0])
    ]
    text = harness.table_manifest(_doc("manifest", {"bytes": 64 << 20, "runs": runs}))
    assert "A manifest of 64.0 MiB with 451,055 tensors; 3 runs" in text
    assert "| manifest.parse, s | 7.50 | 7.10 | 9.00 |" in text  # median, min, max
    assert "| json.loads with parse's duplicate-key hook, s | 4.00 | 4.00 | 4.00 |" in text
    assert "schema" not in text.split("| --- |")[-1]  # a phase no run measured: no row
    step = {"s": 0.1, "kind": "clean"}
    segments = [
        {"mode": m, "steps": [step, {"s": 0.2, "kind": "staging"}, step]}
        for m in ("none", "snapcore")
    ]
    doc = _doc("training", {"segments": segments})
    assert harness.plot_training(doc, tmp_path) == [tmp_path / "training.png"]
    assert (tmp_path / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert harness.plot_training(_doc("training", {}), tmp_path / "none") == []
