"""Tiers benchmark: time to durable per tier, restore time from each tier, the remote
codec's effect, and what an incremental snapshot of a model with frozen layers writes.

Object storage is moto's S3 server, started here as a separate process on 127.0.0.1
(only loopback is used). moto keeps objects in memory and moves 50-130 MB/s on the
development machine, so the remote figures measure snapcore against that server, not
against S3.

    python benchmarks/bench_tiers.py [--size-mb 256] [--json out.json]
    python benchmarks/bench_tiers.py --smoke       # does it run? (test_benchmarks.py)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import common
import torch

import snapcore
from snapcore.tiers import HostTier
from snapcore.write.engine import close_all

OPTIONS = {"key": "testing", "secret": "testing"}


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    port = common.free_port()
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                urllib.request.urlopen(url, timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait()


def make_state(size_mb: int, frozen_fraction: float = 0.0) -> dict[str, Any]:
    """A stack of Linear layers + Adam after one step: about size_mb of state in all."""
    params_mb = size_mb / 3  # weights, exp_avg, exp_avg_sq
    width = 1024
    layers = max(1, int(params_mb * 2**20 / 4 / (width * width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    frozen = int(layers * frozen_fraction)
    for layer in list(model)[:frozen]:
        layer.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(trainable, lr=1e-3)
    model(torch.randn(8, width)).sum().backward()
    opt.step()
    return {"model": model, "optim": opt, "step": 0}


def train_step(state: dict[str, Any]) -> None:
    model, opt = state["model"], state["optim"]
    opt.zero_grad()
    model(torch.randn(8, 1024)).sum().backward()
    opt.step()


def state_bytes(state: dict[str, Any]) -> int:
    n = sum(p.numel() * 4 for p in state["model"].parameters())
    for s in state["optim"].state.values():
        n += sum(v.numel() * v.element_size() for v in s.values() if isinstance(v, torch.Tensor))
    return n


def drop_cache(root: Path) -> None:
    common.drop_page_cache([str(p) for p in root.rglob("*.bin")])


def timed_restore(state: dict[str, Any], store: snapcore.Store) -> tuple[float, str]:
    close_all()
    t0 = time.perf_counter()
    info = snapcore.restore(state, store)
    return time.perf_counter() - t0, info.tier


def run(size_mb: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    work = Path(tempfile.mkdtemp(prefix="snapcore-bench-tiers-"))
    host = f"bench-{uuid.uuid4().hex[:8]}"
    import botocore.session

    try:
        with moto_server() as endpoint:
            client = botocore.session.get_session().create_client(
                "s3",
                endpoint_url=endpoint,
                region_name="us-east-1",
                aws_access_key_id="testing",
                aws_secret_access_key="testing",
            )
            for bucket in ("plain", "zstd", "incr"):
                client.create_bucket(Bucket=bucket)
            options = {**OPTIONS, "client_kwargs": {"endpoint_url": endpoint}}
            state = make_state(size_mb)
            nbytes = state_bytes(state)
            out["state_bytes"] = nbytes

            # 1. time to durable per tier (warm: the second of two snapshots)
            store = snapcore.Store(
                host=host, local=work / "local", remote="s3://plain", storage_options=options
            )
            snapcore.save(state, store, step=1)
            train_step(state)
            h = snapcore.async_save(state, store, step=2)
            stats = h.wait()
            out["durable"] = {"stall": stats.stall_s, **stats.tiers}
            out["written"] = dict(stats.written)

            # 2. restore from each tier alone
            restore: dict[str, Any] = {}
            restore["host"] = timed_restore(state, snapcore.Store(host=host))
            drop_cache(work / "local")
            restore["local (cold)"] = timed_restore(state, snapcore.Store(local=work / "local"))
            restore["local (warm)"] = timed_restore(state, snapcore.Store(local=work / "local"))
            restore["remote"] = timed_restore(
                state, snapcore.Store(remote="s3://plain", storage_options=options)
            )
            out["restore"] = {k: {"seconds": v[0], "tier": v[1]} for k, v in restore.items()}
            close_all()
            HostTier(host).release()

            # 3. the remote codec: bytes and time, same state
            zstore = snapcore.Store(
                local=work / "zlocal",
                remote="s3://zstd",
                storage_options=options,
                codec={"local": "none", "remote": "shuffle-zstd"},
            )
            zs = snapcore.save(state, zstore, step=2)
            out["remote_codec"] = {
                "written_none": out["written"]["remote"],
                "written_shuffle_zstd": zs.written["remote"],
                "durable_remote_none": out["durable"]["remote"],
                "durable_remote_shuffle_zstd": zs.tiers["remote"],
            }
            close_all()
            del state

            # 4. incremental: 90% of the layers frozen (fine-tuning)
            fstate = make_state(size_mb, frozen_fraction=0.9)
            istore = snapcore.Store(
                local=work / "ilocal", remote="s3://incr", storage_options=options
            )
            full = snapcore.save(fstate, istore, step=1)
            train_step(fstate)
            incr = snapcore.save(fstate, istore, step=2)
            out["incremental"] = {
                "state_bytes": state_bytes(fstate),
                "full": dict(full.written),
                "incremental": dict(incr.written),
                "reused": dict(incr.reused),
            }
            close_all()
    finally:
        close_all()
        HostTier(host).release()
        shutil.rmtree(work, ignore_errors=True)
    return out


def mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def report(r: dict[str, Any], size_mb: int) -> str:
    n = r["state_bytes"]
    d = r["durable"]
    lines = [
        f"State: {mb(n)} (Linear layers + Adam), `python benchmarks/bench_tiers.py --size-mb "
        f"{size_mb}`, {platform.node()}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}.",
        "",
        "| tier | time to durable | written |",
        "| --- | --- | --- |",
        f"| (stall of async_save) | {d['stall']:.3f} s | |",
    ]
    for tier in ("host", "local", "remote"):
        lines.append(f"| {tier} | {d[tier]:.3f} s | {mb(r['written'][tier])} |")
    lines += ["", "| restore from | seconds | GB/s |", "| --- | --- | --- |"]
    for k, v in r["restore"].items():
        lines.append(f"| {k} ({v['tier']}) | {v['seconds']:.3f} | {n / v['seconds'] / 1e9:.2f} |")
    c = r["remote_codec"]
    lines += [
        "",
        "| remote codec | bytes uploaded | ratio | time to durable (remote) |",
        "| --- | --- | --- | --- |",
        f"| none | {mb(c['written_none'])} | 1.00 | {c['durable_remote_none']:.2f} s |",
        f"| shuffle-zstd | {mb(c['written_shuffle_zstd'])} | "
        f"{c['written_none'] / c['written_shuffle_zstd']:.2f} | "
        f"{c['durable_remote_shuffle_zstd']:.2f} s |",
    ]
    i = r["incremental"]
    lines += [
        "",
        f"Incremental snapshot, 90% of the layers frozen (state {mb(i['state_bytes'])}):",
        "",
        "| tier | first snapshot writes | next snapshot writes | shared, not rewritten |",
        "| --- | --- | --- | --- |",
    ]
    for tier in ("local", "remote"):
        lines.append(
            f"| {tier} | {mb(i['full'][tier])} | {mb(i['incremental'][tier])} | "
            f"{mb(i['reused'].get(tier, 0))} |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=int, default=256)
    p.add_argument("--json", type=Path)
    p.add_argument(
        "--smoke", action="store_true", help="a tiny run (--size-mb 4) that only checks it works"
    )
    args = p.parse_args()
    if args.smoke:
        args.size_mb = 4
    r = run(args.size_mb)
    print(report(r, args.size_mb))
    common.write_figures(args.json, r)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
