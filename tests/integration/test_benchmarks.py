"""Every benchmark runs, at a tiny size (``--smoke``), so that none can rot unnoticed.

Each is run as its users run it, ``python benchmarks/NAME.py``, in a subprocess with a
time limit, and must exit 0 and report the figures it exists for. Nothing here judges a
figure's value: on this shared machine speeds say nothing (and a smoke run's sizes are
far too small to mean anything); only that the benchmark measured what it should.
"""

from __future__ import annotations

import errno
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def run(script: str, *args: str | Path, timeout: float = 120) -> str:
    """Run ``benchmarks/script --smoke args``; its stdout, once it exited 0."""
    cmd = [sys.executable, str(BENCHMARKS / script), "--smoke", *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_bench_save(tmp_path: Path) -> None:
    raw, table = tmp_path / "raw.json", tmp_path / "table.md"
    out = run("bench_save.py", "--dir", tmp_path, "--json", raw, "--markdown", table, timeout=300)
    report = json.loads(raw.read_text())
    phases = ("machine", "snapcore", "torch_save", "dcp", "restore")
    for phase in phases:
        assert "error" not in report[phase], report[phase]
    assert report["machine"]["memcpy_Bps"] > 0 and report["machine"]["odirect_Bps"] > 0
    assert report["machine"]["cold_read_Bps"] > 0
    sc = report["snapcore"]
    assert len(sc["async"]) == 2 and len(sc["save"]) == 2 and len(sc["duel"]) == 1
    assert all(run["memcpy_Bps"] > 0 for run in sc["async"][1:])
    assert len(sc["odirect_Bps"]) == 2
    assert len(report["torch_save"]["runs"]) == 2
    st = report["torch_save"]["safetensors"]  # the safetensors peer, same process and state
    assert len(st.get("runs", [])) == 2, st.get("error")
    assert all(0 < x["blocked_s"] == x["durable_s"] for x in st["runs"])  # synchronous
    assert st["file_bytes"] >= report["torch_save"]["state_bytes"]
    dcp = report["dcp"]
    assert len(dcp["save"]) == 1 and len(dcp["async_thread"]) == 1
    assert len(dcp.get("async_process", [])) == 1, dcp.get("async_process_error")
    rs = report["restore"]
    assert [x["streams"] for x in rs["cold_read"]] == [1, 4, 1, 4]
    for key in (
        "snapcore_restore_noverify",
        "snapcore_load",
        "torch_load",
        "dcp_load",
        "safetensors_load",
    ):
        assert rs[key]["seconds"] > 0
    assert rs["snapcore_restore"]["state_matches"]  # each restore got the saved state back
    # every target was judged (PASS or FAIL: a smoke run's verdicts mean nothing)
    assert len(report["targets"]) == 7
    assert all(t["status"] in ("PASS", "FAIL") for t in report["targets"]), report["targets"]
    text = table.read_text()
    assert "| machine phase | GB/s |" in text and "| target | measured |" in text
    assert "| safetensors save_file + fsync (2 runs) |" in text
    assert "| safetensors load_file (new tensors) |" in text
    # the harness's summary takes the peer in beside the others
    sys.path.insert(0, str(BENCHMARKS.parent))
    from benchmarks import harness

    s = harness.save_peers(report)
    assert s["peers"]["safetensors.save_file"]["durable_s"]["n"] == 2
    assert s["restore"]["safetensors.load_file"]["median"] > 0 and not s["errors"]
    assert text in out
    assert not list(tmp_path.glob("snapcore-bench-*"))  # its work directory is removed


def test_bench_codec(tmp_path: Path) -> None:
    table = tmp_path / "table.md"
    out = run("bench_codec.py", "--markdown", table)
    text = table.read_text()
    assert text in out
    rows = [ln for ln in text.splitlines() if ln.startswith("| ") and "---" not in ln][1:]
    assert len(rows) == 16  # 4 data x 4 codecs and levels
    assert {row.split(" | ")[0][2:] for row in rows} == {
        "weights fp32 (randn*0.02)",
        "weights bf16",
        "Adam exp_avg (1 steps)",
        "Adam exp_avg_sq (1 steps)",
    }
    assert {tuple(row.split(" | ")[1:3]) for row in rows} == {
        ("zstd", "1"),
        ("zstd", "3"),
        ("shuffle-zstd", "1"),
        ("shuffle-zstd", "3"),
    }
    assert "byte_shuffle / byte_unshuffle alone" in text


def test_bench_tiers(tmp_path: Path) -> None:
    raw = tmp_path / "raw.json"
    out = run("bench_tiers.py", "--json", raw)
    r = json.loads(raw.read_text())
    assert set(r["durable"]) == {"stall", "host", "local", "remote"}
    assert set(r["written"]) == {"host", "local", "remote"}
    assert set(r["restore"]) == {"host", "local (cold)", "local (warm)", "remote"}
    assert [v["tier"] for v in r["restore"].values()] == ["host", "local", "local", "remote"]
    codec = r["remote_codec"]
    assert 0 < codec["written_shuffle_zstd"] < codec["written_none"]
    inc = r["incremental"]  # (at this size no layer is frozen: nothing to say about reuse)
    for key in ("full", "incremental"):
        assert inc[key]["local"] > 0 and inc[key]["remote"] > 0
    assert "| restore from | seconds | GB/s |" in out


def test_bench_checkpointer(tmp_path: Path) -> None:
    raw = tmp_path / "raw.json"
    out = run("bench_checkpointer.py", "--json", raw)
    doc = json.loads(raw.read_text())
    assert [row["name"] for row in doc["rows"]] == [
        "empty timed call (timing overhead)",
        "step(), nothing due",
        "step(), housekeeping",
        "re-plan, 1 tier(s)",
        "re-plan, 3 tier(s)",
        "step(), snapshot due (64 KiB state)",
    ]
    for row in doc["rows"]:
        assert row["calls"] > 0 and 0 <= row["median_ns"] <= row["max_ns"]
    assert "target: step() with nothing due under 20 us" in out


def test_bench_distributed(tmp_path: Path) -> None:
    raw, table = tmp_path / "raw.json", tmp_path / "table.md"
    out = run(
        "bench_distributed.py", "--dir", tmp_path, "--json", raw, "--markdown", table, timeout=240
    )
    r = json.loads(raw.read_text())
    for part in ("single_before", "ranks4", "reshard2", "single_after"):
        assert "error" not in r[part], r[part]
    rk = r["ranks4"]
    assert rk["world"] == 4 and len(rk["ranks"]) == 4 and rk["errors"] == {}
    assert len(r["disk_Bps"]) == 2 and min(r["disk_Bps"]) > 0  # the disk probed twice
    assert "The disk, before / after: O_DIRECT writes" in table.read_text()
    unique = rk["unique_bytes"]
    assert sum(x["needed_bytes"] for x in rk["ranks"]) >= unique > 0
    peers = ("snapcore", "snapcore_overlap", "dcp_sync", "dcp_thread", "dcp_process", "dcp_save")
    for peer in peers:
        runs = rk["runs"][peer]
        assert [x["first"] for x in runs] == [True, False], peer  # a first save, one timed
        for x in runs:
            for key in ("blocked_s", "staged_s", "durable_s"):
                assert len(x["per_rank"][key]) == 4 and min(x["per_rank"][key]) >= 0
            assert max(x["per_rank"]["blocked_s"]) <= max(x["per_rank"]["durable_s"])
            assert x["bytes_written"] >= unique  # every save wrote the whole state
    # snapcore writes each byte of the job once: deterministic, whatever the machine's speed
    for x in rk["runs"]["snapcore"] + rk["runs"]["snapcore_overlap"]:
        assert x["bytes_written"] <= 1.02 * unique
        assert sum(x["per_rank"]["rank_written"]) <= x["bytes_written"]
    # overlap=True: copies deferred, the step after the call changed the state, and the
    # snapshot is the state at the call, bit for bit
    for x in rk["runs"]["snapcore_overlap"]:
        assert x["deferred"] and x["step_changed_state"] and x["restore_exact"], x
    # every restore got the saved state back; the resharding one read about half each
    rs = r["reshard2"]
    assert rs["world"] == 2 and len(rs["needed_per_rank"]) == 2
    for res in (rk["restore"], rs["restore"]):
        assert len(res["snapcore"]) == 1 and len(res["dcp"]) == 1
        assert all(x["matches"] for x in res["snapcore"] + res["dcp"])
    read = rs["restore"]["snapcore"][0]["per_rank"]["bytes_read"]
    assert all(0 < b <= 1.1 * n for b, n in zip(read, rs["needed_per_rank"], strict=True))
    for part in ("single_before", "single_after"):
        assert len(r[part]["runs"]) == 2 and r[part]["state_bytes"] == unique
    assert [t["status"] for t in r["targets"]] and all(
        t["status"] in ("PASS", "FAIL") for t in r["targets"]
    ), r["targets"]
    assert len(r["targets"]) == 9  # 6, overlap=True's stall and staged, default's stall vs sync
    names = [t["target"] for t in r["targets"]]
    # each snapcore mode's stall against DCP's matching mode; the cross-mode figure kept
    assert any("default mode against DCP's default staging" in n for n in names), names
    assert any("overlap=True against DCP's async staging" in n for n in names), names
    assert any("information: not the matching mode" in n for n in names), names
    # DCP's default staging copies in the call: its staging ends when the call returns
    for x in rk["runs"]["dcp_sync"]:
        assert x["per_rank"]["staged_s"] == x["per_rank"]["blocked_s"]
    text = table.read_text()
    assert "| save | blocked s |" in text and "| target | measured |" in text
    assert text in out
    assert not list(tmp_path.glob("snapcore-bench-dist-*"))  # its work directory is removed


def test_bench_convert(tmp_path: Path) -> None:
    raw, table = tmp_path / "raw.json", tmp_path / "table.md"
    out = run(
        "bench_convert.py", "--dir", tmp_path, "--json", raw, "--markdown", table, timeout=240
    )
    r = json.loads(raw.read_text())
    state = r["prepare"]["state"]
    assert state["state_bytes"] > 0 and 0 < state["largest_bytes"] < state["state_bytes"]
    assert set(state["bytes_by_dtype"]) == {"float32", "bfloat16"}
    assert len(r["probes"]) == 2
    for p in r["probes"]:
        assert p["odirect_Bps"] > 0 and p["cold_read_Bps"] > 0
    assert [tag for tag, _ in r["order"]] == [
        "copy#before",
        "convert_to_safetensors",
        "save_file",
        "hf_hub",
        "consolidate",
        "dcp_to_torch_save",
        "copy#between",
        "convert_to_snapcore",
        "load_file_save",
        "copy#after",
        "convert_to_torch",
        "load_torch_save",
        "copy#end",
    ]
    for tag, x in r["order"]:
        if "skipped" in x:  # only an optional peer, with its reason
            assert tag in ("hf_hub", "consolidate") and x["skipped"], (tag, x)
            continue
        assert "error" not in x, (tag, x)
        assert x["seconds"] > 0 and x["peak_rss"] >= x["baseline_rss"] > 0, (tag, x)
        assert x["written_bytes"] >= state["state_bytes"], (tag, x)
        if not tag.startswith("copy"):
            # every output holds exactly the source's tensors, bit for bit
            assert x["check"]["equal"], (tag, x["check"])
            assert x["check"]["tensors"] == state["tensors"], (tag, x["check"])
    # every target was judged (PASS or FAIL: a smoke run's verdicts mean nothing)
    assert len(r["targets"]) == 9
    assert all(t["status"] in ("PASS", "FAIL") for t in r["targets"]), r["targets"]
    text = table.read_text()
    assert "| # | conversion | seconds | GB/s |" in text and "| target | measured |" in text
    assert text in out
    assert not list(tmp_path.glob("snapcore-bench-convert-*"))  # its work directory is removed


def test_simulate() -> None:
    out = run("simulate.py", timeout=60)  # --smoke: --quick on one worker
    assert "Checks against the issue's targets:" in out and "| 16,384 |" in out
    assert out.count("PASS") >= 4 and "FAIL" not in out  # the quick run meets the targets


def test_bench_training(tmp_path: Path) -> None:
    raw, table = tmp_path / "raw.json", tmp_path / "table.md"
    out = run(
        "bench_training.py", "--dir", tmp_path, "--json", raw, "--markdown", table,
        "--recompute", timeout=120,
    )  # fmt: skip
    r = json.loads(raw.read_text())
    assert r["config"]["model"]["recompute"] is True  # the gpu size's path, on the CPU
    modes = ["none", "snapcore", "snapcore_overlap", "dcp"]
    assert r["config"]["modes"] == modes and r["config"]["device"] in ("cpu", "cuda")
    steps, every = r["config"]["steps"], r["config"]["every"]
    assert [s["mode"] for s in r["segments"]] == modes  # one round, in order
    for seg in r["segments"]:
        assert len(seg["steps"]) == steps and seg["tokens_per_s"] > 0
        assert all(
            x["s"] > 0 and x["kind"] in ("clean", "staging", "persist") for x in seg["steps"]
        )
        snaps = seg["snapshots"]
        assert len(snaps) == (0 if seg["mode"] == "none" else -(-steps // every))
        for x in snaps:  # every snapshot was staged and became durable after its call
            assert 0 <= x["prev_wait_s"] <= x["stall_s"] and 0 <= x["staged_s"] <= x["durable_s"]
    s, snapshots = r["summary"], -(-steps // every)
    for mode in modes:
        assert s[mode]["tokens_per_s_median"] > 0 and s[mode]["ratio_vs_none_median"] > 0
        assert 0 < s[mode]["step_p50_s"] <= s[mode]["step_p99_s"]
        assert s[mode]["staging_steps"] == snapshots - ((steps - 1) % every == 0)
    assert s["none"]["ratio_vs_none_median"] == 1.0 and s["snapcore_vs_dcp_median"] > 0
    # the last snapshot of each mode, restored into a fresh model and AdamW: bit for bit
    assert r["restore_exact"] == {"snapcore": True, "snapcore_overlap": True, "dcp": True}
    assert [t["status"] in ("PASS", "FAIL") for t in r["targets"]] == [True] * 3
    text = table.read_text()
    assert "| mode | tokens/s | x no snapshots |" in text and "| target | measured |" in text
    assert text in out
    assert not list(tmp_path.glob("snapcore-bench-train-*"))  # its work directory is removed


def test_gpt_recomputing_activations_gives_the_same_gradients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The gpu size recomputes each block's activations in the backward: the same loss
    and gradients as keeping them, bit for bit (on the CPU, where the kernels are
    deterministic), and fewer tensors saved for the backward."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import dataclasses

    import gpt
    import torch

    assert gpt.SIZES["gpu"].recompute and gpt.SIZES["gpu"].batch == 64
    grads, saved = [], []
    for recompute in (False, True):
        cfg = dataclasses.replace(gpt.SIZES["smoke"], recompute=recompute)
        model, _ = gpt.build(cfg, torch.device("cpu"), seed=3)
        x, y = gpt.Tokens(cfg, torch.device("cpu")).batch(0)
        count = [0]

        def pack(t: torch.Tensor, count: list[int] = count) -> torch.Tensor:
            count[0] += 1
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = torch.nn.functional.cross_entropy(model(x).view(-1, cfg.vocab), y.reshape(-1))
        loss.backward()
        grads.append([loss.detach()] + [p.grad.clone() for p in model.parameters()])
        saved.append(count[0])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    assert saved[1] < saved[0], saved


def test_bench_plan(tmp_path: Path) -> None:
    raw = tmp_path / "raw.json"
    out = run("bench_plan.py", "--json", raw, "--markdown", tmp_path / "table.md")
    rows = json.loads(raw.read_text())["rows"]
    assert {r["mesh"] for r in rows} == {"fsdp2", "hsdp", "fsdp2+tp", "ddp", "pp"}
    for r in rows:
        assert r["now_s"] > 0 and r["tensors"] > 0
        assert r["same_plan"] is True  # the smoke worlds are small enough for the old plan
    assert "| mesh | ranks |" in out


def test_bench_manifest(tmp_path: Path) -> None:
    raw = tmp_path / "raw.json"
    out = run("bench_manifest.py", "--json", raw)
    report = json.loads(raw.read_text())
    (only,) = report["runs"]
    assert only["tensors"] == 10_000 and report["bytes"] > 10_000 * 100
    assert only["parse_s"] > 0 and only["json_s"] > 0 and only["schema_s"] > 0
    assert "run  parse_s" in out


def test_bench_peer(tmp_path: Path) -> None:
    raw = tmp_path / "raw.json"
    out = run("bench_peer.py", "--dir", tmp_path, "--json", raw, timeout=240)
    report = json.loads(raw.read_text())
    assert report["probe_bps"] > 0 and report["fetch_bps"] > 0 and report["restore_bps"] > 0
    lost = report["restored"][1]  # the replaced node's rank got its part from its partner
    assert lost["peer_bytes"] >= 8 << 20 and set(lost["tier_bytes"]) == {"host"}
    assert [r["digest"] for r in report["restored"]] == [s["digest"] for s in report["saved"]]
    # the replaced node's fetch, judged twice: after snapcore.prepare, and without it
    assert [t["status"] in ("PASS", "FAIL") for t in report["targets"]] == [True, True]
    assert ["no prepare" in t["target"] for t in report["targets"]] == [False, True]
    assert all(t["ratio"] > 0 for t in report["targets"])
    # the fetch after prepare ran in a job of its own, judged against its own probe's runs
    assert len(report["prepared"]) == 1 and all(x > 0 for x in report["prepared_ratios"])
    assert all(len(r[1]["probe_runs_bps"]) == 4 for r in [report["restored"], *report["prepared"]])
    # the training loop's four modes, each timed in every round, and the slowdowns
    modes = ["none", "host", "host+peer", "host+peer paced"]
    assert list(report["step_s"]) == modes and all(report["step_s"][m] > 0 for m in modes)
    assert list(report["slowdown"]) == modes[1:] and all(
        report["slowdown"][m] > 0 for m in modes[1:]
    )
    assert list(report["lost_per_snapshot_s"]) == modes[1:]
    assert all(t["train_failures"] == [] for t in report["trained"])
    assert all(len(t["step_s"][m]) == 3 for t in report["trained"] for m in modes)
    # and the device-wait loop (each step sleeps first, as one waiting on its GPU), alike
    wait = report["device_wait"]
    assert wait["device_ms"] == 4.0 and list(wait["lost_per_snapshot_s"]) == modes[1:]
    # the sleeps count: every step of that loop sleeps 4 ms first (not compared with the
    # CPU-bound loop's steps, which a busy minute of the machine can make the slower)
    assert all(wait["step_s"][m] >= wait["device_ms"] / 1000 for m in modes)
    assert all(len(t["device_wait"]["step_s"][m]) == 3 for t in report["trained"] for m in modes)
    assert "The device-wait loop (each step sleeps 4 ms first" in out
    assert "| target | measured |" in out
    assert not list(tmp_path.glob("snapcore-bench-*"))


def test_bench_gpu_plumbing_on_a_cpu(tmp_path: Path) -> None:
    """bench_gpu's measurements, verdicts and report, run on the CPU (the GPU machine
    runs it for real, benchmarks/gpu_check.sh): no verdict is given off a GPU."""
    raw, table = tmp_path / "raw.json", tmp_path / "table.md"
    out = run("bench_gpu.py", "--device", "cpu", "--json", raw, "--markdown", table)
    report = json.loads(raw.read_text())
    (size,) = report["sizes"]
    assert size["state_bytes"] > 0 and size["device_bytes"] == size["state_bytes"]
    assert len(size["saves"]) == 2 and size["saves"][0]["first"] and len(size["overlap"]) == 1
    assert all(s["staged_s"] > 0 for s in size["saves"])
    assert [r["matches"] for r in size["restores"]] == [True, True]  # the saves came back
    # the library's own way (64 MiB batches, the ring made by the restore), then the ring kept
    assert [(r["slot_mib"], r["ring_kept"]) for r in size["restores"]] == [(64, False), (64, True)]
    f = size["figures"]
    assert f["d2h_probe_Bps"] > 0 and f["h2d_probe_Bps"] > 0 and f["staging_Bps"] > 0
    assert f["restore_Bps"] > 0 and f["blocked_s"] > 0 and f["copy_s"] > 0
    assert [t["status"] for t in report["targets"]] == ["N/A", "N/A", "N/A", "PASS"]
    assert report["abi"]["ok"] is True
    rc = report["read_check"]  # the restore workers' work without the GPU, a machine limit
    assert rc["chunk_bytes"] == 4 << 20 and rc["one_Bps"] > 0 and rc["all_Bps"] > 0
    assert f"then xxh3-128 of it): 1 thread {rc['one_Bps'] / 1e9:.1f} GB/s" in out
    assert not list(Path(rc["root"]).glob("snapcore-bench-read-*"))  # its file is gone
    assert "| target | measured |" in out and table.read_text() in out
    sys.path.insert(0, str(BENCHMARKS.parent))
    from benchmarks import harness

    doc = {"scenario": "gpu", "runs": [{"result": report}], "machine": harness.machine()}
    doc.update(date="2026-11-26", command="python -m benchmarks run gpu")
    assert harness.plot_gpu(doc, tmp_path) == [tmp_path / "gpu.png"]
    assert (tmp_path / "gpu.png").stat().st_size > 10_000


def test_bench_gpu_reports_where_a_restore_to_the_gpu_spent_its_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The report breaks the best restore of each way down from h2d.last_profile (the
    H200 run's figures, with profiles of the kind a GPU restore records): the library's
    own (each restore makes its ring), judged, and the ring kept between restores,
    reported beside."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_gpu

    figures = BENCHMARKS.parent / "docs" / "figures" / "gpu.json"
    doc = json.loads(figures.read_text())["runs"][0]["result"]
    size = doc["sizes"][0]
    made = {"bytes": 4e9, "workers": 14, "slots": 16, "slot_bytes": 64 << 20, "reads": 60,
            "ring_made": 16, "ring_s": 0.3, "read_s": 1.0, "queue_s": 0.01, "wait_s": 0.05,
            "drain_s": 0.004, "close_s": 0.02, "total_s": 0.45}  # fmt: skip
    base = {k: v for k, v in size["restores"][0].items() if k != "wall_s"}
    size["restores"] = [
        {**base, "slot_mib": 64, "ring_kept": False, "wall_s": 0.5, "profile": made},
        {**base, "slot_mib": 64, "ring_kept": False, "wall_s": 0.6, "profile": made},
        {**base, "slot_mib": 64, "ring_kept": True, "wall_s": 0.7, "profile": made},
        {**base, "slot_mib": 64, "ring_kept": True, "wall_s": 0.2,
         "profile": {**made, "ring_made": 0, "ring_s": 0.0001, "read_s": 1.4}},
    ]  # fmt: skip
    size["figures"] = bench_gpu.figures(size)
    f = size["figures"]
    assert f["restore_Bps"] == size["device_bytes"] / 0.5  # judged: the ring made, the best
    assert f["restore_kept_Bps"] == size["device_bytes"] / 0.2
    text = bench_gpu.render(doc)
    lines = [ln for ln in text.splitlines() if ln.startswith("Best restore of 4.0 GB")]
    assert len(lines) == 2, lines
    assert "(the ring made by each restore), 0.500 s" in lines[0], lines[0]
    assert "(16 slots of 64 MiB, 16 of them made in 0.300 worker-s)" in lines[0], lines[0]
    assert "60 batches" in lines[0], lines[0]
    assert "1.000 worker-s (56.0 GB/s all together)" in lines[0], lines[0]
    assert "(the ring kept), 0.200 s" in lines[1], lines[1]
    assert "MiB, kept from the last restore)" in lines[1] and "1.400 worker-s" in lines[1]
    assert "the last copies took 0.004 s" in lines[1] and "manifest) -0.250 s." in lines[1]
    kept = next(ln for ln in text.splitlines() if "with the ring kept between" in ln)
    ratio = size["device_bytes"] / 0.2 / f["h2d_probe_Bps"]
    assert f"{ratio:.2f} x the probe (not judged)" in kept, kept
    assert sum(ln.startswith("Best restore") for ln in text.splitlines()) == 2  # 16 GB: none


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="checks the refusal on a machine without CUDA"
)
def test_bench_gpu_refuses_to_run_without_a_gpu() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_gpu.py")], capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and "needs one" in proc.stderr, proc.stderr


def test_bench_distributed_goes_on_without_its_disk_probe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk probe is information: where it cannot run (a full disk here; tmpfs
    without O_DIRECT elsewhere) it says why, leaves no file, and the run goes on."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_distributed
    import common

    def full(path: Path, pieces: object, direct: bool) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(common, "write_rate", full)
    errors: list[str] = []
    assert bench_distributed.probe_disk(tmp_path, 1 << 20, errors) is None
    probe = tmp_path / "disk-probe.bin"
    assert len(errors) == 1 and "No space left" in errors[0] and str(probe) in errors[0]
    assert not probe.exists()


def test_bench_slowdown(tmp_path: Path) -> None:
    raw = tmp_path / "raw.json"
    out = run("bench_slowdown.py", "--dir", tmp_path, "--json", raw, timeout=180)
    report = json.loads(raw.read_text())
    stores = report["stores"]
    assert list(stores) == ["host", "host+peer", "host+peer paced"]
    for kind, r in stores.items():
        assert r["steps"] > 100 and r["snapshots"] >= 2 and r["quiet_steps"] > 0
        assert set(r["per_tier"]) == ({"host"} if kind == "host" else {"host", "peer"})
        assert r["slowdown"] is None or 0.0 <= r["slowdown"] <= 0.9
        assert all(v > 0 for v in r["persist_s"].values())
    # each store judged, or said not measured (a smoke run's snapshots are short)
    assert [t["status"] in ("PASS", "FAIL", "N/A") for t in report["targets"]] == [True] * 3
    assert "| host+peer paced |" in out
    assert report["device"] == "cpu" and report["gpu"] is None and "ms asleep" in out


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="checks the refusal on a machine without CUDA"
)
def test_bench_slowdown_on_the_gpu_refuses_to_run_without_one(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_slowdown.py"), "--device", "cuda",
         "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and "needs one" in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == []  # refused before any job started
