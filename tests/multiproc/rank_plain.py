"""Rank script for the launcher's own tests; argv[1] picks the behaviour. Only "nodes"
imports torch, so that the others start fast."""

from __future__ import annotations

import os
import signal
import sys
import time

import launch


def hang() -> None:
    """Rank 0 blocks until killed; the others finish."""
    launch.report({"pid": os.getpid()})
    if launch.rank() == 0:
        print(f"rank 0 (pid {os.getpid()}) hangs", flush=True)
        while True:
            signal.pause()


def die() -> None:
    """Three passes through the point "loop"; then block, like a rank waiting in a
    collective for a peer that is gone, until torchrun tears the job down. The other
    ranks start their passes once rank 0 has reported: one killed at a point cannot
    have torchrun tear rank 0 down before it has, however slow its start."""
    if launch.rank() != 0:
        while not (launch.workdir() / "rank0.json").exists():
            time.sleep(0.01)
    for i in range(3):
        print(f"pass {i}", flush=True)
        launch.maybe_die("loop")
    launch.report({"passes": 3})
    while True:
        signal.pause()


def fail() -> None:
    """Rank 1 raises once rank 0 has reported (so that torchrun, which tears the other
    ranks down when one fails, cannot stop rank 0 before it has); rank 0 finishes."""
    if launch.rank() == 1:
        while not (launch.workdir() / "rank0.json").exists():
            time.sleep(0.01)
        raise RuntimeError("rank 1 fails on purpose")
    launch.report({"ok": True})


def nodes() -> None:
    """Join the gloo job and gather each rank's identity and SNAPCORE_MP_TEST_NODE."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    mine = {
        "rank": dist.get_rank(),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "world": dist.get_world_size(),
        "node_env": os.environ.get("SNAPCORE_MP_TEST_NODE"),
        "common_env": os.environ.get("SNAPCORE_MP_TEST_COMMON"),
    }
    everyone: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    launch.report({"mine": mine, "everyone": everyone})
    dist.destroy_process_group()


if __name__ == "__main__":
    {"hang": hang, "die": die, "fail": fail, "nodes": nodes}[sys.argv[1]]()
